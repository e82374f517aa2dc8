"""The rendezvous store moves with an HA takeover (issue 29): the new leader serves it
from its own control node, every heartbeat reply says where it is, the agent keeps that
in the node's endpoint file, and every new store client of the workers goes there."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from daemon.gpunode.agent import NodeAgent
from trainer.contract import RDZV_ENDPOINT_ENV, RDZV_ENDPOINT_FILE_ENV, write_endpoint_file
from trainer.membership import JoinQueue
from trainer.runtime import rendezvous_endpoint
from trainer.store_retry import current_endpoint, parse_endpoint
from worker_procs import until


@pytest.mark.parametrize("raw,parsed", [
    ("10.0.0.10:29400", ("10.0.0.10", 29400)),
    ("[fd00::1]:29400\n", ("fd00::1", 29400)),
    ("rdzv.internal:1", ("rdzv.internal", 1)),
    ("10.0.0.10", None), (":29400", None), ("10.0.0.10:http", None), ("10.0.0.10:0", None),
    ("10.0.0.10:65536", None), ("", None),
])
def test_an_endpoint_is_host_and_port_or_nothing(raw: str, parsed: tuple[str, int] | None) -> None:
    assert parse_endpoint(raw) == parsed


def test_the_file_says_where_the_store_is_once_it_holds_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = ("10.0.0.10", 29400)
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, "10.0.0.10:29400")
    assert current_endpoint(started) == started and rendezvous_endpoint() == started  # no file named
    path = tmp_path / "rendezvous"
    monkeypatch.setenv(RDZV_ENDPOINT_FILE_ENV, str(path))
    assert rendezvous_endpoint() == started  # named, not written yet: the daemon that started the job leads
    write_endpoint_file(path, "10.0.0.11:29400")
    assert current_endpoint(started) == ("10.0.0.11", 29400) == rendezvous_endpoint()
    path.write_text("garbage")  # never from the agent: ignored, not a crash
    assert rendezvous_endpoint() == started
    monkeypatch.delenv(RDZV_ENDPOINT_ENV)
    assert rendezvous_endpoint() is None  # no store given at start: no in-process resize, wherever it is


def test_the_join_queue_follows_the_store_to_its_new_address(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A client of the old store that still answers (a deposed leader's node) is not kept:
    the queue builds one of the new address, where rank 0 now looks."""
    old = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    new = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    path = tmp_path / "rendezvous"
    monkeypatch.setenv(RDZV_ENDPOINT_FILE_ENV, str(path))
    queue = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10)
    first = queue.register("n2", 0, 1, wait_s=60, credential=None)
    write_endpoint_file(path, f"127.0.0.1:{new.port}")
    second = queue.register("n3", 0, 1, wait_s=60, credential=None)
    assert queue.endpoint == ("127.0.0.1", new.port)
    assert (first.number, second.number) == (1, 1)  # each store's own counter
    assert old.check([f"spotvisor/run1/join/t/{first.number}"]) and new.check([f"spotvisor/run1/join/t/{second.number}"])
    assert new.get(f"spotvisor/run1/join/t/{second.number}").decode().count('"n3"') == 1


async def test_the_agent_keeps_the_leaders_endpoint_in_the_nodes_file(tmp_path: Path) -> None:
    agent = NodeAgent(daemon_url="http://127.0.0.1:9", token="t", node_id="n-1", metadata=None,  # type: ignore[arg-type]
                      workdir=tmp_path)
    path = Path(agent.runner.job_env()[RDZV_ENDPOINT_FILE_ENV])
    assert path.parent == tmp_path and not path.exists()
    await agent._follow_store("10.0.0.10:29400")
    assert path.read_text() == "10.0.0.10:29400\n"
    for bad in ("10.0.0.11", 29400, None, "x" * 10 + ":"):  # a reply without one, or a malformed one: kept
        await agent._follow_store(bad)
    assert path.read_text() == "10.0.0.10:29400\n"
    await agent._follow_store("10.0.0.11:29400")  # the new leader's
    assert path.read_text() == "10.0.0.11:29400\n" and not list(tmp_path.glob("*.tmp"))


def test_the_loss_watch_moves_to_the_new_store_while_the_old_one_still_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition, not a death: the deposed leader's store still answers, so the watch's
    wait there never fails. It is renewed every WAIT_S and moves to the address the
    node's file names; the first survivor's wake, set in the new store, reaches it."""
    from trainer.membership import LossWatch, wake_survivors

    old = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    new = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    path = tmp_path / "rendezvous"
    monkeypatch.setenv(RDZV_ENDPOINT_FILE_ENV, str(path))
    monkeypatch.setattr(LossWatch, "WAIT_S", 0.5)
    watch = LossWatch(("127.0.0.1", old.port), "r")
    watch._shut = lambda fds, pg: setattr(watch, "unblocked", watch.unblocked + 1)  # no group here to shut
    watch.follow("a1", 0, set())
    try:
        write_endpoint_file(path, f"127.0.0.1:{new.port}")
        assert until(lambda: watch._client_at == ("127.0.0.1", new.port), 15), "the watch stayed on the old store"
        wake_survivors(("127.0.0.1", new.port), "r", "a1", 1, reason="loss")
        assert until(lambda: watch.unblocked == 1, 15), "the wake in the new store did not reach the watch"
        assert old.check(["spotvisor/r/loss/a1/wake/0"]) is False
    finally:
        watch.stop()
