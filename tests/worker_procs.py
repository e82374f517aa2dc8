"""Trainer workers started as a node's launcher starts them, for the in-process resize tests
(tests/test_grow.py, tests/test_elastic_data.py, tests/test_fsdp_resize.py): one process
per "node" running the elastic test job (:mod:`trainers.elastic_job`), torchrun's
environment given by the test, the node's agent files under ``tmp_path/<node>``, its join
credential from :data:`AUTHORITY` (as the daemon issues one to each node it admits)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import node_files
from bench.ports import free_port
from daemon.controlnode.rendezvous import StoreProcess
from trainer.contract import JOIN_CREDENTIAL_ENV, JOIN_ENV, NODE_ID_ENV, RDZV_ENDPOINT_ENV, RUN_ID_ENV
from trainer.credential import Authority

#: the tests' stand-in for the daemon's join key
AUTHORITY = Authority.generate()


#: the folder of the tests' own modules (``trainers``)
TESTS = Path(__file__).resolve().parent


def pythonpath() -> str:
    """``PYTHONPATH`` for a worker that runs ``-m trainers.…``: ``tests/``, then this process's."""
    return os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))


#: What the zygote imports before it forks: the test job and what its ``--job`` choices
#: import lazily (torch, transformers' GPT-2, DeepSpeed, DCP)
ZYGOTE_PRELOAD = ("trainers.elastic_job", "trainer.run", "trainer.data", "trainer.examples.deepspeed_zero2",
                  "trainer.examples.fsdp_dcp", "trainer.integrations.deepspeed_resize", "deepspeed",
                  "torch.distributed.checkpoint.state_dict")

_zygote: subprocess.Popen | None = None  # this test process's zygote host (tests/zygote_host.py)
_zygote_env: dict[str, str] = {}  # what a worker's client needs to reach it


def worker_zygote() -> dict[str, str]:
    """The variables that make a worker's command fork from this test process's zygote,
    started on first use: the product's own (:mod:`daemon.gpunode.zygote`, as a node's
    launcher forks one), preloaded with :data:`ZYGOTE_PRELOAD`. A worker started fresh
    spends about 4 CPU-s importing them; forked, about 0.1 s. Empty if it did not start
    (each worker then starts fresh). Ended by :func:`stop_worker_zygote` (conftest.py, at
    the session's end) or with this process (its host reads our pipe to its end)."""
    global _zygote, _zygote_env
    if _zygote is None or _zygote.poll() is not None:
        from daemon.gpunode.zygote import PRELOAD_ENV

        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath(), PRELOAD_ENV: ",".join(ZYGOTE_PRELOAD)}
        from zygote_host import start_host

        _zygote, info = start_host(env)
        _zygote_env = {} if info is None else info["env"]
    return _zygote_env


def stop_worker_zygote() -> None:
    """End the zygote (its host's input closed: the zygote SIGKILLs any worker left)."""
    global _zygote
    if _zygote is not None:
        _zygote.stdin.close()  # type: ignore[union-attr]
        _zygote.wait(timeout=30)
        _zygote = None


def start_worker(tmp_path: Path, name: str, env: dict[str, str], rdzv_port: int, argv: list[str], *,
                 run_id: str, fork: bool = True) -> subprocess.Popen:
    """``python -m trainers.elastic_job *argv`` as node ``name``'s only worker (``argv``: the
    job's flags, then the trainer's; ``env``: torchrun's variables); its status file, step
    logs, notices and scratch are under ``tmp_path/name``, ``$OUT`` is ``tmp_path``; its join
    credential is :data:`AUTHORITY`'s for ``name`` in ``run_id`` unless ``env`` sets one.
    Output captured (text). ``fork``: forked from :func:`worker_zygote`, as torchrun's
    workers are on a node without a GPU; the process returned is then the zygote's client
    (its exit status and its signals are the worker's; its pid is not), else a fresh
    interpreter."""
    node = tmp_path / name
    node.mkdir()
    full = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path), RUN_ID_ENV: run_id, NODE_ID_ENV: name,
            JOIN_CREDENTIAL_ENV: AUTHORITY.issue(run=run_id, node=name, now=time.time()),
            "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", **env,
            "SPOTVISOR_NOTICE_FILE": str(node / "notices.json"), "SPOTVISOR_STATUS_FILE": str(node / "status.jsonl"),
            "SPOTVISOR_LOG_DIR": str(node / "logs"), "SPOTVISOR_SCRATCH_DIR": str(node / "scratch"),
            RDZV_ENDPOINT_ENV: f"127.0.0.1:{rdzv_port}",
            "PYTHONPATH": pythonpath()}
    forked = worker_zygote() if fork else {}
    return subprocess.Popen([forked.get("PYTHON_EXEC", sys.executable), "-m", "trainers.elastic_job", *argv],
                            env={**full, **forked}, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


#: the sharded jobs' resize tests (test_fsdp_resize.py, test_deepspeed_resize.py): a 2-layer GPT-2,
#: 12 steps of a global batch of 12 in micro batches of 2
SHARDED_JOB = ("--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--target-steps", "12",
               "--global-batch-size", "12", "--micro-batch-size", "2", "--pg-timeout-s", "60",
               "--join-timeout-s", "120", "--hold-timeout-s", "3")


def sharded_events(job: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The sharded resize tests' scripted events for the elastic test job ``--job job``:
    ``recorded`` (rank 0 writes the whole state's digest before stage_state and after
    reshard: a collective gather, a test's cost only), ``grow_and_shrink`` (rank 0 waits
    after step 5 for the joiner and admits nobody before, so the grow lands at step 5;
    node0, old rank 0, gets a notice at step 8) and ``kill_node2`` (node2 SIGKILLs itself
    before its step 7)."""
    recorded = ("--job", job, "--record-resizes")
    return (recorded, (*recorded, "--wait-joiners-at", "5", "--admit-from", "5", "--notice-at", "8",
                       "--notice-node", "node0"),
            (*recorded, "--kill-at", "6", "--kill-node", "node2"))


def start_sharded(tmp_path: Path, name: str, env: dict[str, str], rdzv_port: int, ckpt: str,
                  job: tuple[str, ...], extra: tuple[str, ...], *, run_id: str) -> subprocess.Popen:
    """One worker of node ``name`` (``env``: torchrun's variables) running the elastic test job
    with the events ``job`` on :data:`SHARDED_JOB`, committing to ``ckpt``, plus ``extra``."""
    return start_worker(tmp_path, name, env, rdzv_port, [*job, "--checkpoint-uri", ckpt, *SHARDED_JOB, *extra],
                        run_id=run_id)


def assert_rebuilt_from_copies(tmp_path: Path, procs: list[subprocess.Popen], outs: list[str], step: int) -> None:
    """A sharded job of three workers whose node2 was killed: node0 and node1 went on at
    world 2 from ``step`` rebuilt from the copies (their ``started`` line says
    ``from_replicas``), loaded no commit, and the rebuilt state hashes as step ``step``'s
    did at world 3 (``--record-step`` and ``--record-resizes``)."""
    assert [p.returncode for p in procs] == [0, 0, -9], "\n".join(outs)
    for node in ("node0", "node1"):
        lines = status_lines(tmp_path, node)
        started = [(x["step"], x.get("resized"), x["world_size"], x.get("resumed_from"), x.get("from_replicas"))
                   for x in lines if x["event"] == "started"]
        assert started == [(0, None, 3, None, None), (step, "in_process", 2, None, True)], "\n".join(outs)
        assert not [x for x in lines if x["event"] == "checkpoint_loaded"]
    before = (tmp_path / f"step-{step}.txt").read_text().split()
    after = (tmp_path / f"after-{step}.txt").read_text().split()
    assert after[0] == before[0] and (before[-1], after[-1]) == ("3", "2"), (before, after)


def assert_rebuilt_twice(tmp_path: Path, procs: list[subprocess.Popen], outs: list[str], step: int) -> None:
    """A sharded job of three workers whose node2 was killed, then node1 at the smaller
    world: node0 went on from ``step`` rebuilt from the copies at world 2, then again at
    world 1, loaded no commit, and the state it rebuilt last hashes as step ``step``'s did
    at world 3 (``--record-step`` and ``--record-resizes``)."""
    assert [p.returncode for p in procs] == [0, -9, -9], "\n".join(outs)
    lines = status_lines(tmp_path, "node0")
    started = [(x["step"], x.get("resized"), x["world_size"], x.get("from_replicas"))
               for x in lines if x["event"] == "started"]
    assert started == [(0, None, 3, None), (step, "in_process", 2, True), (step, "in_process", 1, True)], \
        "\n".join(outs)
    assert not [x for x in lines if x["event"] == "checkpoint_loaded"]
    before = (tmp_path / f"step-{step}.txt").read_text().split()
    after = (tmp_path / f"after-{step}.txt").read_text().split()
    assert after[0] == before[0] and (before[-1], after[-1]) == ("3", "1"), (before, after)


def member_env(rank: int, world: int, master_port: int, run: str, **extra: str) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of a group of ``world`` one-worker nodes (run id ``run``)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": str(rank), "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RUN_ID": run, **extra}


def joiner_env(**extra: str) -> dict[str, str]:
    """A new node's worker as its own launcher (``torchrun --standalone``) starts it with
    ``SPOTVISOR_JOIN=1``: rank 0 of a world of 1, its own master port and run id."""
    return {**member_env(0, 1, free_port(), "standalone-1"), JOIN_ENV: "1", **extra}


def wait_for_status(tmp_path: Path, node: str, proc: subprocess.Popen, text: str) -> None:
    """Until node ``node``'s status file holds ``text``; fails with ``proc``'s output if it exits first."""
    status = tmp_path / node / "status.jsonl"
    while not (status.exists() and text in status.read_text()):
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)  # polling another process's file


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Each worker's output once all have exited; on a hang, all of it in the failure."""
    try:
        return [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("\n".join(p.communicate()[0] for p in procs)) from None


def status_lines(tmp_path: Path, node: str) -> list[dict]:
    """Node ``node``'s status lines, parsed."""
    return node_files.status_lines(tmp_path / node)


def trained(tmp_path: Path) -> dict[int, list[int]]:
    """Step -> the sample positions trained for it, over every worker's step logs."""
    out: dict[int, list[int]] = {}
    for log in tmp_path.glob("node*/logs/steps-*.jsonl"):
        for rec in map(json.loads, log.read_text().splitlines()):
            out.setdefault(rec["step"], []).extend(rec["positions"])
    return out


def until(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether ``cond()`` holds within ``timeout_s`` (polled every 50 ms: the condition
    under test is another process's or thread's doing)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def store_process() -> Iterator[StoreProcess]:
    """The rendezvous store in a process of its own on a free loopback port (a test may
    kill it and start it again, empty, as ``kill_store`` does); stopped at the end."""
    proc = StoreProcess("127.0.0.1", free_port())
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
