"""The survivors of a notice re-form their process group in their running workers
(``trainer.runtime.shrink_process_group``, ``trainer.loop.ElasticJob.shrink``)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.batch import ElasticBatch
from trainer.guard import Decision
from trainer.run import ReferenceJob
from trainer.contract import NODE_ID_ENV, RDZV_ENDPOINT_ENV
from trainer.runtime import DistContext, rendezvous_endpoint, shrink_process_group
from bench.ports import free_port
from worker_procs import pythonpath, worker_zygote


def _gone(port: int, timeout_s: float) -> bool:
    """True once nothing listens on 127.0.0.1:port any more."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _worker(rank: int, group_port: int, store_port: int, tmp: str) -> None:
    # rank 0 hosts the group's store (env:// init, as torchrun's workers do) and is the one that leaves;
    # each rank is a node of its own, with the variables torchrun gives its worker
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "3", "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": "3",
                       "LOCAL_RANK": "0"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=30))
    ctx = DistContext(rank, 0, 3, "gloo", torch.device("cpu"), True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = DDP(model)
    dist.barrier()  # the notice commit
    if rank == 0:
        os._exit(0)  # the noticed node is stopped after the commit
    new = shrink_process_group(ctx, [1, 2], "test/shrink/1", ("127.0.0.1", store_port), 30.0)
    del ddp
    ddp = DDP(model)  # over the new default group
    assert _gone(group_port, timeout_s=20.0)  # train on once the old rank 0 and its store are gone
    x = torch.full((3, 4), float(new.rank + 1))
    ddp(x).sum().backward()
    t = torch.tensor([float(new.rank + 1)])
    dist.all_reduce(t)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({
        "new_rank": new.rank, "world": new.world_size, "dist_world": dist.get_world_size(),
        "sum": t.item(), "grad": model.weight.grad.tolist(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK")}}))
    # DDP's reducer holds the group: drop it while the group is registered, so the group is
    # destroyed by destroy_process_group (GIL released), not by the reducer's dealloc at
    # exit, where gloo's worker thread, freeing its last work's tensors, waits for the GIL
    # the dealloc holds (a deadlock seen once under load)
    del ddp
    dist.barrier()
    dist.destroy_process_group()


def test_survivors_go_on_after_the_store_host_leaves(tmp_path: Path) -> None:
    # port 0: the store binds a port the kernel gives it (one found free first can be taken in between)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    store_port = store.port
    try:
        mp.spawn(_worker, args=(free_port(), store_port, str(tmp_path)), nprocs=3, join=True)
    finally:
        del store
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    r2 = json.loads((tmp_path / "rank2.json").read_text())
    assert (r1["new_rank"], r2["new_rank"]) == (0, 1)  # old order kept
    assert r1["world"] == r2["world"] == r1["dist_world"] == 2
    assert r1["sum"] == r2["sum"] == 3.0  # 1 + 2: only the survivors
    assert r1["grad"] == r2["grad"]  # DDP averaged over the two survivors
    # torchrun's variables follow, for code that reads them: the two nodes left are 0 and 1
    assert r1["env"] == {"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert r2["env"] == {"RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0"}


def test_shrink_refuses_a_leaving_rank() -> None:
    ctx = DistContext(0, 0, 3, "gloo", torch.device("cpu"), True)
    with pytest.raises(ValueError, match="rank 0 cannot shrink"):
        shrink_process_group(ctx, [1, 2], "k", ("127.0.0.1", 1), 1.0)


@pytest.mark.parametrize("raw, expected", [
    ("127.0.0.1:29400", ("127.0.0.1", 29400)),
    ("[::1]:29400", ("::1", 29400)),
    ("", None), ("nohost", None), ("host:port", None),
])
def test_rendezvous_endpoint(monkeypatch: pytest.MonkeyPatch, raw: str, expected) -> None:
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, raw)
    assert rendezvous_endpoint() == expected


def _job(world: int, *, resize: str = "in-process", global_batch: int = 12) -> ReferenceJob:
    job = object.__new__(ReferenceJob)
    job.args = argparse.Namespace(resize=resize)
    job.ctx = DistContext(0, 0, world, "gloo", torch.device("cpu"), True)
    job.G = global_batch
    job.plan = ElasticBatch(global_batch, 1).plan(world)
    return job


_LEAVE_2 = Decision(True, True, ("n",), ("interruption",), (2,))


@pytest.mark.parametrize("decision, resize, global_batch, expected", [
    (_LEAVE_2, "in-process", 12, True),
    (Decision(True, True, ("n", "m"), ("interruption", "interruption"), (1, 2)), "in-process", 12, True),
    (_LEAVE_2, "restart", 12, False),  # --resize restart
    (Decision(True, True, ("n", "r"), ("interruption", "rejoin"), (2,)), "in-process", 12, False),  # a grow too
    (Decision(True, True, ("r",), ("rejoin",), ()), "in-process", 12, False),  # nobody leaves
    (Decision(True, True, ("n",), ("interruption",), (0, 1, 2)), "in-process", 12, False),  # nobody survives
    (_LEAVE_2, "in-process", 9, False),  # 9 splits over 3 ranks, not over 2: hold for a restart instead
])
def test_when_the_survivors_go_on_in_process(monkeypatch: pytest.MonkeyPatch, decision: Decision, resize: str,
                                             global_batch: int, expected: bool) -> None:
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, "127.0.0.1:29400")
    assert _job(3, resize=resize, global_batch=global_batch)._can_shrink(decision) is expected


def test_no_shrink_without_the_rendezvous_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RDZV_ENDPOINT_ENV, raising=False)
    assert not _job(3)._can_shrink(Decision(True, True, ("n",), ("interruption",), (2,)))


# node0 (rank 0)'s notice appears after step 10, so the guard sees it at that boundary
# (tests/trainers/elastic_job.py)
NOTICE_AT_10 = ("--notice-at", "10", "--notice-node", "node0")


@pytest.mark.slow
def test_a_notice_on_a_periodic_step_shrinks_and_goes_on(tmp_path: Path) -> None:
    """Node 0 (rank 0, the committer) gets a notice that lands on step 10, a periodic
    commit step (K = 10): the survivors shrink in-process, the new rank 0 does not commit
    step 10 again at world size 2 (a second, different manifest: CommitConflictError and
    a torchrun restart), and the job finishes without a restart."""
    import subprocess
    import sys

    from torch.distributed import TCPStore

    from trainer.checkpoint import list_committed, open_store

    rdzv = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    master_port, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = []
    for rank in range(3):
        node = tmp_path / f"node{rank}"
        node.mkdir()
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": "3",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": "periodic", "OMP_NUM_THREADS": "1",
               "SPOTVISOR_NOTICE_FILE": str(node / "notices.json"), "SPOTVISOR_STATUS_FILE": str(node / "status.jsonl"),
               "SPOTVISOR_LOG_DIR": str(node / "logs"), RDZV_ENDPOINT_ENV: f"127.0.0.1:{rdzv.port}",
               NODE_ID_ENV: f"node{rank}", "PYTHONPATH": pythonpath()}
        argv = ["--checkpoint-uri", ckpt, "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
                "--target-steps", "14", "--checkpoint-interval", "10", "--global-batch-size", "12",
                "--micro-batch-size", "2", "--hold-timeout-s", "3", "--pg-timeout-s", "60"]
        forked = worker_zygote()  # forked from the zygote, as torchrun's workers are on a node without a GPU
        procs.append(subprocess.Popen([forked.get("PYTHON_EXEC", sys.executable), "-m", "trainers.elastic_job",
                                       *NOTICE_AT_10, *argv], env={**env, **forked}, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs[1:]] == [0, 0], outs[1] + outs[2]
    assert procs[0].returncode != 0  # the leaving rank was not stopped by an agent: it exits after its hold
    assert "CommitConflictError" not in outs[1] + outs[2]
    manifests = {m.step: m for m in list_committed(open_store(ckpt))}
    assert (manifests[10].world_size, manifests[14].world_size) == (3, 2)
    assert manifests[10].extra["notice_ids"] == ["n0"]
    lines = [json.loads(x) for x in (tmp_path / "node1" / "status.jsonl").read_text().splitlines()]
    started = [x for x in lines if x["event"] == "started"]
    assert [(s["step"], s.get("resized")) for s in started] == [(0, None), (10, "in_process")]
    commits = [(x["step"], x["world_size"]) for x in lines if x["event"] == "checkpoint_committed"]
    assert commits == [(10, 3), (14, 2)]  # step 10 once, by the old group
