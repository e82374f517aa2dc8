"""An FSDP2 job's new shards in memory its rank holds already
(``trainer.integrations.fsdp_shards``): :func:`within` finds the rows a resize's new
shard needs in the memory of the old one, and :func:`adopt` makes such a view
the tensor the model and optimizer train, so nothing is copied into fresh memory. The
adopted memory must be what FSDP2 all-gathers for the forward and what AdamW updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from trainer.integrations.fsdp_shards import within


def test_a_view_spans_rows_past_its_own_where_its_memory_does() -> None:
    memory = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    shard = memory.narrow(0, 4, 3)  # rows 4..6 of memory held as a shard
    wider = within(shard, -2, 6)  # rows 2..7
    assert wider is not None and wider.untyped_storage().data_ptr() == memory.untyped_storage().data_ptr()
    assert torch.equal(wider, memory[2:8])
    assert torch.equal(within(shard, 1, 2), memory[5:7])  # type: ignore[arg-type]
    assert within(shard, -5, 3) is None  # before the memory's first row
    assert within(shard, 3, 4) is None  # past its last
    assert within(shard, 0, 0) is None  # nothing to keep
    assert within(memory.t(), 0, 1) is None  # not laid out row after row


def _adopt_worker(rank: int, tmp: str) -> None:
    from bench.gpu_check import adopt_check

    Path(tmp, "out.txt").write_text(adopt_check(torch.device("cpu")))


@pytest.mark.timeout(120)
def test_adopted_memory_is_what_fsdp2_gathers_and_adamw_updates(tmp_path: Path) -> None:
    """Every parameter and AdamW moment of an FSDP2 model takes a view of other memory
    with other values (``bench.gpu_check.adopt_check``, which a GPU check runs on the
    device): the forward computes with those values, and the optimizer step updates that
    memory in place (only the view's rows: the memory around it untouched), the
    parameter still reading it after the step."""
    mp.start_processes(_adopt_worker, args=(str(tmp_path),), nprocs=1, start_method="spawn")
    assert (tmp_path / "out.txt").read_text() == "ok"
