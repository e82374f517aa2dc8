"""The worker group's store binds exactly rank 0's address on the job's network.

A c10d ``TCPStore`` server has no authentication, and ``env://`` puts it on every interface
of rank 0's node (its port reachable from wherever that node is). ``setup_distributed``
hosts it on a socket bound to ``MASTER_ADDR`` only (:func:`trainer.runtime.group_store`);
under ``--rdzv-backend=spotvisor`` that is the node's address toward the rendezvous store
(``tests/test_rendezvous_handler.py`` shows torchrun hands it over as ``MASTER_ADDR``).
Two real ranks (gloo) form the group; rank 0 reports where its store's port listens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, psutil, torch.distributed as dist
from trainer.runtime import setup_distributed
ctx = setup_distributed(60)
x = __import__("torch").ones(1)
dist.all_reduce(x)
port = int(os.environ["MASTER_PORT"])
listening = sorted(c.laddr.ip for c in psutil.Process().net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
print(json.dumps({"rank": ctx.rank, "sum": x.item(), "listening": listening}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""


def _form(master_addr: str) -> list[dict]:
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=120)
            assert p.returncode == 0, stdout
            out += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(out, key=lambda r: r["rank"])


@pytest.mark.timeout(180)
def test_rank_0_hosts_the_group_store_on_master_addr_only() -> None:
    r0, r1 = _form("127.0.0.1")
    assert r0["sum"] == r1["sum"] == 2.0  # the group formed and works
    assert r0["listening"] == ["127.0.0.1"]  # not 0.0.0.0 or ::, every interface
    assert r1["listening"] == []


@pytest.mark.timeout(180)
def test_a_master_addr_given_as_a_name_keeps_torchs_own_store() -> None:
    """A name may resolve on rank 0's node to an address the others cannot reach (Debian
    maps the host name to 127.0.1.1): there the store stays torch's ``env://`` one."""
    r0, _ = _form("localhost")
    assert r0["sum"] == 2.0
    assert r0["listening"] and r0["listening"] != ["127.0.0.1"]
