"""trainer/group_sockets.py: the loss watch fails a collective blocked on a live peer in
any process group the worker made, and never shuts a socket that is not a group's.

Two defects the suite caught under load. The DeepSpeed loss cell's rank 0 sat 61 s (its
pg timeout) in a collective on DeepSpeed's clone of the world group, whose sockets the
watch did not know. The silent-node cell's survivor had its own store client shut: a
group socket gloo closed was reused for it, and the watch shut the descriptor it had
recorded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from bench.ports import free_port
from conftest import REPO
from trainer import group_sockets

# rank 0 blocks in an all_reduce on a subgroup (as DeepSpeed's collectives run on its clone
# of the world group) while rank 1 never enters it; rank 0's loss watch is then woken
WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from trainer.membership import LossWatch
from trainer.runtime import setup_distributed
rank, store_port, out = int(os.environ["RANK"]), int(sys.argv[1]), sys.argv[2]
ctx = setup_distributed(timeout_s=60)
sub = dist.new_group(ranks=[0, 1])
dist.barrier()
if rank == 1:
    sys.stdin.read()  # alive, never in the collective, until the test ends
    sys.exit(0)
watch = LossWatch(("127.0.0.1", store_port), "r")
watch.follow("a1", 0)
print("blocking", flush=True)
t0 = time.monotonic()
try:
    dist.all_reduce(torch.ones(4), group=sub)
    what = "completed"
except Exception as exc:
    what = f"{type(exc).__name__}: {exc}"[:300]
watch.stop()  # joined: its count is final (the wake may land just before the collective starts)
with open(out, "w") as f:
    json.dump({"what": what, "seconds": time.monotonic() - t0, "unblocked": watch.unblocked}, f)
os._exit(0)  # the broken group's teardown is not what this measures
"""


def test_a_collective_blocked_on_a_live_peer_in_a_subgroup_fails_when_the_watch_is_woken(tmp_path: Path) -> None:
    from trainer.membership import wake_survivors

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    out = tmp_path / "rank0.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(store.port), str(out)], cwd=REPO,
                              env={**env, "RANK": str(r)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        assert procs[0].stdout.readline().strip() == "blocking", procs[0].communicate(timeout=60)[0]
        # the loss watch's key: set as a survivor would; rank 0 must leave its collective now,
        # not at the 60 s pg timeout
        wake_survivors(("127.0.0.1", store.port), "r", "a1", 2, reason="loss")
        rc = procs[0].wait(timeout=30)
        result = json.loads(out.read_text())
    finally:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0][-2000:] for p in procs]
    assert rc == 0 and result["what"] != "completed" and result["unblocked"] == 1, (result, outs)
    assert result["seconds"] < 30, result


def test_a_recorded_descriptor_reused_by_another_socket_is_never_shut() -> None:
    """gloo closes a pair whose peer is gone; the next socket opened (a store client) may
    get that descriptor number. Only the socket recorded is a group's."""
    with group_sockets.recording():
        a, b = socket.socketpair()
    fd = a.fileno()
    assert fd in group_sockets.live()
    other, peer = socket.socketpair()
    a.close()
    os.dup2(other.fileno(), fd)  # the descriptor now names another socket
    try:
        assert fd not in group_sockets.live()
        with group_sockets.recording():
            pass  # a later group: the stale record stays dropped
        assert fd not in group_sockets.live()
    finally:
        os.close(fd)
        for s in (b, other, peer):
            s.close()
