"""The rendezvous store moves with an HA takeover (issue 29): the new leader serves it
from its own control node, every heartbeat reply says where it is, the agent keeps that
in the node's endpoint file, and every new store client of the workers goes there."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from daemon.gpunode.agent import NodeAgent
from trainer.contract import RDZV_ENDPOINT_ENV, RDZV_ENDPOINT_FILE_ENV, write_endpoint_file
from trainer.credential import NodeCredential, Verifier
from trainer.membership import Admission, JoinQueue, Ticket
from trainer.runtime import rendezvous_endpoint
from trainer.store_retry import current_endpoint, parse_endpoint
from worker_procs import AUTHORITY, until


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
    watch.follow("a1", 0)
    try:
        write_endpoint_file(path, f"127.0.0.1:{new.port}")
        assert until(lambda: watch._client_at == ("127.0.0.1", new.port), 15), "the watch stayed on the old store"
        wake_survivors(("127.0.0.1", new.port), "r", "a1", 1, reason="loss")
        assert until(lambda: watch.unblocked == 1, 15), "the wake in the new store did not reach the watch"
        assert old.check(["spotvisor/r/loss/a1/wake/0"]) is False
    finally:
        watch.stop()


Moved = tuple[dist.TCPStore, dist.TCPStore, Path]


@pytest.fixture
def moved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Moved:
    """The old leader's store, the new leader's, and the node's endpoint file (naming the old)."""
    old, new = (dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
                for _ in range(2))
    path = tmp_path / "rendezvous"
    monkeypatch.setenv(RDZV_ENDPOINT_FILE_ENV, str(path))
    write_endpoint_file(path, f"127.0.0.1:{old.port}")
    return old, new, path


def _credential(node: str) -> NodeCredential:
    return NodeCredential(AUTHORITY.issue(run="run1", node=node, now=time.time()))


def test_a_joiner_queued_in_the_old_store_is_admitted_through_the_new_one(moved: Moved) -> None:
    """The leader is cut off during a grow: the joiner queued in its store, then rank 0 and
    the joiner both move to the new leader's (empty). Rank 0 admitted ticket 1 in the old
    store earlier (a grow before); the joiner's new ticket 1 is still a new ticket to it."""
    old, new, path = moved
    rank0 = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10, verifier=Verifier(AUTHORITY.public_key, "run1"))
    earlier = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10)
    earlier.register("n2", 0, 1, wait_s=300, credential=_credential("n2"))
    assert [t.node for t in rank0.ready(1, lambda w: True)] == ["n2"]
    rank0.admit(rank0.ready(1, lambda w: True), prefix="p/grow/1", first_rank=1, world_size=2)  # ticket 1
    joiner = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10)
    ticket = joiner.register("n3", 0, 1, wait_s=300, credential=_credential("n3"))
    assert ticket.number == 2
    admitted: list[Admission] = []
    t = threading.Thread(target=lambda: admitted.append(joiner.wait(ticket)), daemon=True)
    t.start()
    write_endpoint_file(path, f"127.0.0.1:{new.port}")  # the new leader's word, before rank 0 saw ticket 2
    picks: list[Ticket] = []
    assert until(lambda: bool(picks.extend(rank0.ready(2, lambda w: True)) or picks)), "no ticket in the new store"
    assert [(p.number, p.node) for p in picks] == [(1, "n3")]  # the new store's ticket 1: not the old one's
    rank0.admit(picks, prefix="p/grow/2", first_rank=2, world_size=3)
    t.join(timeout=30)
    assert [(a.rank, a.world_size, a.prefix) for a in admitted] == [(2, 3, "p/grow/2")]


def test_an_admission_written_in_the_old_store_before_the_move_still_counts(moved: Moved) -> None:
    old, new, path = moved
    rank0 = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10, verifier=Verifier(AUTHORITY.public_key, "run1"))
    joiner = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10)
    ticket = joiner.register("n3", 0, 1, wait_s=300, credential=_credential("n3"))
    joiner.store.check(["x"])  # its client of the old store is open, as a waiting joiner's is
    rank0.admit(rank0.ready(1, lambda w: True), prefix="p/grow/1", first_rank=1, world_size=2)
    write_endpoint_file(path, f"127.0.0.1:{new.port}")  # it moved before the joiner looked again
    admission = joiner.wait(ticket)
    assert (admission.rank, admission.world_size) == (1, 2)
    assert not new.check(["spotvisor/run1/join/t/1"])  # not queued again: it was admitted


def test_a_ticket_number_another_joiner_took_in_a_store_back_empty_is_not_kept(moved: Moved) -> None:
    old, new, path = moved
    mine = JoinQueue(("127.0.0.1", old.port), "run1", timeout_s=10)
    ticket = mine.register("n3", 0, 1, wait_s=300, credential=_credential("n3"))
    write_endpoint_file(path, f"127.0.0.1:{new.port}")
    other = JoinQueue(("127.0.0.1", new.port), "run1", timeout_s=10)
    theirs = other.register("n4", 0, 1, wait_s=300, credential=_credential("n4"))
    assert ticket.number == theirs.number == 1
    again = mine._moved(ticket)[0]
    assert again.number == 2 and again.expires == ticket.expires  # its own ticket, not n4's number
    assert '"n3"' in new.get("spotvisor/run1/join/t/2").decode()
