"""The trainer log shipped with heartbeats (daemon/gpunode/nodelog.py): the agent's chunk
reader against a real file, and the daemon's bounded buffer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon.controlnode.node_logs import NodeLogs
from daemon.gpunode.nodelog import error_line, last_error, read_chunk


def write(path: Path, text: str) -> None:
    with open(path, "ab") as f:
        f.write(text.encode())


def ship(logs: NodeLogs, path: Path, node: str = "n1", max_bytes: int = 64) -> dict | None:
    chunk = read_chunk(path, logs.ack(node)["offset"], max_bytes=max_bytes)
    logs.feed(node, chunk)
    return chunk


def lines(logs: NodeLogs, node: str = "n1") -> list[str]:
    return [ln.line for ln in logs.tail(node, 1000)]


def test_whole_lines_in_order(tmp_path: Path) -> None:
    log, logs = tmp_path / "trainer.log", NodeLogs()
    assert read_chunk(log, None) is None  # no trainer yet
    write(log, "a\nb\npart")
    assert ship(logs, log) == {"offset": 0, "next": 4, "size": 8, "data": "a\nb\n"}
    assert lines(logs) == ["a", "b"]
    assert ship(logs, log) is None  # "part" has no newline yet
    write(log, "ial line\nc\n")
    ship(logs, log)
    assert lines(logs) == ["a", "b", "partial line", "c"]
    assert logs.ack("n1") == {"offset": log.stat().st_size}
    assert [ln.seq for ln in logs.since("n1", 2)] == [3, 4]


def test_falling_behind_skips_and_says_so(tmp_path: Path) -> None:
    log, logs = tmp_path / "trainer.log", NodeLogs()
    write(log, "0123456789\n" * 20)  # 220 bytes, chunks of 64: the daemon holds nothing yet
    first = ship(logs, log)
    assert first is not None and first["offset"] > 0 and first["next"] == 220
    got = lines(logs)
    assert got[0] == f"[spotvisor: the first {first['offset']} bytes of trainer.log are only on the node]"
    assert set(got[1:]) == {"0123456789"}
    write(log, "x" * 9 + "\n" + ("y" * 29 + "\n") * 3)  # 100 new bytes: more than a chunk behind
    ship(logs, log)
    got = lines(logs)
    gap = [g for g in got if "not shipped" in g]
    assert gap == ["[spotvisor: 40 bytes of trainer.log not shipped]"]  # the x line and the first y line
    assert got[-3:] == [gap[0], "y" * 29, "y" * 29]


def test_a_line_longer_than_a_chunk_is_shipped_cut(tmp_path: Path) -> None:
    log, logs = tmp_path / "trainer.log", NodeLogs()
    write(log, "a" * 100 + "\nb\r\rc\n")
    ship(logs, log)  # the daemon holds nothing: whole lines from the last 64 bytes
    # lines end at newlines only: a progress bar's carriage returns stay in their line
    assert lines(logs) == ["[spotvisor: the first 101 bytes of trainer.log are only on the node]", "b\r\rc"]
    write(log, "z" * 70)  # a line longer than a chunk, still being written
    ship(logs, log)
    write(log, "z\n")
    ship(logs, log)
    assert lines(logs)[2:] == ["[spotvisor: 6 bytes of trainer.log not shipped]", "z" * 64, "z"]


def test_overlap_and_replaced_file(tmp_path: Path) -> None:
    log, logs = tmp_path / "trainer.log", NodeLogs()
    write(log, "a\nb\n")
    ship(logs, log)
    write(log, "c\n")
    logs.feed("n1", read_chunk(log, 0))  # an agent that restarted re-sends from 0: only "c" is new
    assert lines(logs) == ["a", "b", "c"]
    log.unlink()
    write(log, "new\n")  # a new file, shorter than what the daemon holds
    ship(logs, log)
    assert lines(logs)[-2:] == ["[spotvisor: trainer.log was replaced; starting over]", "new"]


def test_bounded_in_bytes_and_nodes(tmp_path: Path) -> None:
    logs = NodeLogs(max_bytes=100, max_nodes=2)
    logs.feed("n1", {"offset": 0, "next": 300, "size": 300, "data": "".join(f"{i:09d}\n" for i in range(30))})
    got = lines(logs)
    assert len(got) == 10 and got[-1] == "000000029"  # the last 100 bytes
    logs.feed("n2", {"offset": 0, "next": 2, "size": 2, "data": "b\n"})
    logs.feed("n3", {"offset": 0, "next": 2, "size": 2, "data": "c\n"})
    assert logs.tail("n1", 5) == [] and lines(logs, "n3") == ["c"]  # the node heard from longest ago goes
    for bad in ("x", {"offset": -1, "next": 0, "size": 0, "data": ""}, {"offset": 5, "next": 2, "size": 9,
                                                                         "data": "x"}):
        logs.feed("n3", bad)  # logged and dropped
    assert lines(logs, "n3") == ["c"]
    with pytest.raises(ValueError):
        NodeLogs(max_bytes=0)


async def test_wait_returns_on_new_lines() -> None:
    logs = NodeLogs()
    waiter = asyncio.create_task(logs.wait("n1", 0, timeout_s=10))
    await asyncio.sleep(0)  # let it start waiting (scheduling, not synchronisation with a timer)
    assert not waiter.done()
    logs.feed("n1", {"offset": 0, "next": 2, "size": 2, "data": "a\n"})
    await asyncio.wait_for(waiter, 5)
    await logs.wait("n1", 1, timeout_s=0.01)  # nothing newer: returns after the timeout


def test_a_secret_printed_by_the_job_is_masked_in_the_daemons_copy(tmp_path: Path) -> None:
    """A job.setup that echoes a secret (``set -x``, a token in an index URL): ``spotctl tail``
    shows ``***``, never the value."""
    import uuid

    secret = f"hf_{uuid.uuid4().hex}"
    f = tmp_path / "trainer.log"
    f.write_text(f"+ pip install --index-url https://user:{secret}@pypi.example/simple x\nstep 1\n")
    logs = NodeLogs()
    logs.mask([secret])  # as the supervisor does with the job's secrets at start
    logs.feed("n-1", read_chunk(f, 0))
    lines = [ln.line for ln in logs.tail("n-1", 10)]
    assert lines == ["+ pip install --index-url https://user:***@pypi.example/simple x", "step 1"]


# a worker refused by NCCL (the H200 trial of 2026-12-04: two ranks on one GPU), as torchrun's log holds it
NCCL_REFUSED = """\
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", line 2253, in _new_pr
    eager_backend.eager_connect_single_device(device_id)
torch.distributed.DistBackendError: NCCL error in: NCCLUtils.cpp:93, invalid usage, NCCL version 2.28.9
ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
Last error:
Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60
[W1204 17:41:20.029546044 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called
E1204 17:41:20.887000 2074 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 0
"""


def test_the_error_line_is_the_newest_exception_with_its_message_lines() -> None:
    assert error_line(NCCL_REFUSED) == (
        "torch.distributed.DistBackendError: NCCL error in: NCCLUtils.cpp:93, invalid usage, NCCL version 2.28.9"
        " | ncclInvalidUsage: This usually reflects invalid usage of NCCL library. | Last error:"
        " | Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60")
    older = "Traceback (most recent call last):\n  File \"a.py\"\nKeyError: 'x'\n"
    assert error_line(older + "Traceback (most recent call last):\n  File \"b.py\"\nValueError: bad lr\n") \
        == "ValueError: bad lr"
    # python -m of a missing module: one line of its own, then torchrun's
    assert error_line("/venv/bin/python: No module named mytrainer\nE1204 12:00:00.1 1 api.py:986] failed\n") \
        == "/venv/bin/python: No module named mytrainer"
    assert error_line("") == "" and len(error_line("ValueError: " + "x" * 5000)) == 500


def test_the_last_error_reads_only_the_logs_tail(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text("ValueError: an old one\n" + "step line\n" * 20_000 + NCCL_REFUSED)
    assert last_error(log).startswith("torch.distributed.DistBackendError")
    assert last_error(tmp_path / "none.log") == ""

