"""An FSDP2 job's new shards in memory its rank holds already
(``trainer.integrations.fsdp_shards``): :func:`within` finds the rows a resize's new
shard needs in the memory of the old one, and :func:`adopt` makes such a view
the tensor the model and optimizer train, so nothing is copied into fresh memory. The
adopted memory must be what FSDP2 all-gathers for the forward and what AdamW updates."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.integrations.fsdp_shards import ShardMover, adopt, fsdp_params, within


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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    mover = ShardMover(SimpleNamespace(state=SimpleNamespace(model=model, optimizer=opt)))
    params, memories, adopted = fsdp_params(model), [], []
    for slot in list(mover._slots()):
        t = slot[2]
        local = t.to_local() if hasattr(t, "to_local") else t
        memory = torch.full((local.shape[0] + 4, *local.shape[1:]), -7.0)  # a larger, older shard's memory
        view = memory.narrow(0, 2, local.shape[0])
        view.copy_(local.detach() * 2)  # other values than the model's: the forward must read them
        adopted.append(adopt(slot, view, params))
        memories.append(memory)
    w1, b1, w2, b2 = (memories[i].narrow(0, 2, memories[i].shape[0] - 4) for i in (0, 3, 6, 9))
    expected = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
    forward = torch.allclose(model(x), expected)
    before = [m.clone() for m in memories]
    model(x).sum().backward()
    opt.step()
    updated = [not torch.equal(m[2:-2], b[2:-2]) for m, b in zip(memories, before)]  # AdamW wrote there
    outside = all(torch.equal(m[:2], b[:2]) and torch.equal(m[-2:], b[-2:]) for m, b in zip(memories, before))
    same = all(torch.equal(p.to_local().detach(), memories[i].narrow(0, 2, memories[i].shape[0] - 4))
               for i, p in zip((0, 3, 6, 9), model.parameters()))
    Path(tmp, "out.json").write_text(json.dumps({"adopted": adopted, "forward": forward, "updated": updated,
                                                 "outside": outside, "same": same}))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_adopted_memory_is_what_fsdp2_gathers_and_adamw_updates(tmp_path: Path) -> None:
    """Every parameter and AdamW moment of an FSDP2 model takes a view of other memory
    with other values: the forward computes with those values, and the optimizer step
    updates that memory in place (only the view's rows: the memory around it untouched),
    the parameter still reading it after the step."""
    mp.start_processes(_adopt_worker, args=(str(tmp_path),), nprocs=1, start_method="spawn")
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["adopted"] == [True] * 12, got  # 4 parameters, each with exp_avg and exp_avg_sq
    assert got["forward"] and got["outside"] and got["same"], got
    assert all(got["updated"]), got
