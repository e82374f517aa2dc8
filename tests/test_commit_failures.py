"""A commit that fails on one rank fails on every rank (trainer.integrations.common.Committer).

Two real ranks (gloo, two processes). A failure on rank 0 alone, in the format's save or
in the put that records the notices a reused commit now answers, must reach the other
rank as a CheckpointError naming rank 0: before, rank 0 raised alone and its peer waited
in the next collective until rank 0's process died, then took that for a lost peer and
trained on without it, as if the step were committed. Whether a step is committed
already (only its notices recorded, nothing saved) is rank 0's word: a rank without the
manifest in memory (one that joined in process since) takes the same path.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.checkpoint import CheckpointError, FileStore, ShardInfo, latest_committed, write_shard
from trainer.guard import Decision, PreemptionGuard
from trainer.integrations.common import Committer
from trainer.runtime import DistContext, StatusWriter


class _Writer:
    """One small shard per rank; rank ``fail_rank``'s save raises."""

    def __init__(self, store: FileStore, rank: int, fail_rank: int | None) -> None:
        self.store, self.rank, self.fail_rank = store, rank, fail_rank

    def prepare(self, step: int) -> None:
        pass

    def save(self, step: int) -> None:
        if self.rank == self.fail_rank:
            raise OSError("No space left on device")

    def upload(self, step: int) -> list[ShardInfo]:
        return [write_shard(self.store, step, f"rank{self.rank}.bin", bytes([self.rank]) * 64)]

    def cleanup(self, step: int) -> None:
        pass


class _PutFails(FileStore):
    """A store whose puts fail once ``broken`` is set (the object store out of reach)."""

    broken = False

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.broken:
            raise OSError("connection reset by the object store")
        super().put_bytes(key, data)


def _worker(rank: int, tmp: str) -> None:
    # a rank left waiting fails in 30 s, not gloo's default 30 min
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg-init", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    ctx = DistContext(rank, rank, 2, "gloo", torch.device("cpu"), True)
    store = _PutFails(os.path.join(tmp, "ckpt"))
    committer = Committer(ctx, store, StatusWriter(os.path.join(tmp, f"status-{rank}.jsonl"), ctx, "a1"),
                          PreemptionGuard(None))
    out: dict[str, str] = {}

    def attempt(name: str, step: int, fail_rank: int | None, decision: Decision | None = None) -> None:
        try:
            committer.commit(step, _Writer(store, rank, fail_rank), reason=name, decision=decision,
                             global_batch_size=4, data_position={"consumed_samples": step * 4})
            out[name] = "committed"
        except CheckpointError as exc:
            out[name] = str(exc)
        except OSError as exc:  # the format's own error, on the rank where it failed
            out[name] = f"{type(exc).__name__}: {exc}"

    attempt("save fails on rank 0", 3, fail_rank=0)
    attempt("a good commit", 4, fail_rank=None)
    if rank == 1:
        committer.last_committed = None  # as a rank that joined in process since: not in its memory
    asked = Decision(checkpoint=True, notice_ids=("c:1",), kinds=("checkpoint",))
    attempt("step 4 again, rank 1 without its manifest", 4, fail_rank=None, decision=asked)
    out["rank 1's manifest after it"] = str(committer.last_committed.step if committer.last_committed else None)
    if rank == 0:
        store.broken = True
    notice = Decision(checkpoint=True, hold=True, notice_ids=("n2:1",), kinds=("interruption",))
    attempt("the re-answer's put fails on rank 0", 4, fail_rank=None, decision=notice)
    dist.barrier()  # both ranks got here: nobody was left waiting
    Path(tmp, f"out-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_a_failure_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=2, join=True)
    outs = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in (0, 1)]
    assert outs[0]["save fails on rank 0"] == "OSError: No space left on device"  # as the format raised it
    assert outs[1]["save fails on rank 0"].startswith("step 3 not committed: rank 0: save failed: OSError")
    for out in outs:
        assert out["a good commit"] == "committed"
        # rank 0's word: both record the notice on step 4's manifest, and neither saves it again
        assert out["step 4 again, rank 1 without its manifest"] == "committed"
        assert out["rank 1's manifest after it"] == "4"
        assert "notices it answers were not recorded: rank 0: OSError" in out["the re-answer's put fails on rank 0"]
    store = FileStore(str(tmp_path / "ckpt"))
    assert latest_committed(store).step == 4  # the failed save left no manifest of step 3
    assert latest_committed(store).extra["notice_ids"] == ["c:1"]  # the last re-answer's put never landed
