"""Membership metadata goes between ranks as JSON, never pickled (``trainer.exchange``;
issue 25 item 11: an outsider admitted as a rank would otherwise have run code in every
rank through ``all_gather_object``)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.contract import NOTICE_FILE_ENV


class _Refused:
    """Stands in for ``pickle.Unpickler`` in torch's object collectives."""

    def __init__(self, *_: object) -> None:
        raise AssertionError("a peer's bytes were unpickled")


def _worker(rank: int, tmp: str) -> None:
    from trainer.exchange import MAX_BYTES, all_gather_json, broadcast_json
    from trainer.guard import PreemptionGuard
    from trainer.runtime import DistContext, new_attempt_id, publish_world_env

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))  # no port to race other tests for
    dist.distributed_c10d._unpickler = _Refused  # what all_gather_object and broadcast_object_list load with
    ctx = DistContext(rank, 0, 2, "gloo", torch.device("cpu"), True)
    out: dict[str, object] = {}
    # a grow's exchanges: the new group's node keys, the new attempt's id
    os.environ["GROUP_RANK"] = str(rank)
    publish_world_env(ctx, node_key=None if rank == 0 else "joined:n3")
    out["group_rank"] = os.environ["GROUP_RANK"]
    out["attempt"] = new_attempt_id(ctx)
    # a step boundary with a notice on rank 1's node
    notices = Path(tmp, f"notices{rank}.json")
    notices.write_text(json.dumps([{"id": "n3:x", "kind": "interruption", "time": 0.0, "deadline": None}]
                                  if rank == 1 else []))
    os.environ[NOTICE_FILE_ENV] = str(notices)
    decision = PreemptionGuard().check()
    out["decision"] = [list(decision.notice_ids), list(decision.leaving_ranks)]
    out["gathered"] = all_gather_json({"rank": rank, "pair": ("a", rank)})
    out["broadcast"] = broadcast_json(["x", 1.5, None] if rank == 1 else "ignored", src=1)
    try:
        all_gather_json("y" * (MAX_BYTES + 1) if rank == 1 else "small")
    except ValueError as exc:
        out["too_big"] = str(exc)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_membership_exchanges_unpickle_nothing(tmp_path: Path) -> None:
    """Two ranks, pickle loading disabled in both: a grow's node keys and attempt id, a
    notice's step boundary and the helpers themselves still agree; a payload over
    MAX_BYTES is refused on every rank, not allocated."""
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (r0["group_rank"], r1["group_rank"]) == ("0", "1")  # the joiner's node numbered after rank 0's
    assert r0["attempt"] == r1["attempt"]
    assert r0["decision"] == r1["decision"] == [["n3:x"], [1]]
    assert r0["gathered"] == r1["gathered"] == [{"rank": 0, "pair": ["a", 0]}, {"rank": 1, "pair": ["a", 1]}]
    assert r0["broadcast"] == r1["broadcast"] == ["x", 1.5, None]
    assert "at most" in r0["too_big"] and "at most" in r1["too_big"]
