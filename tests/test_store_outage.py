"""The trainer's own users of the rendezvous store ride out its loss (issue 29).

Against the real store process, SIGKILLed and started again empty on the same port (the
chaos schedule's ``kill_store``): rank 0's join check never makes a step boundary wait
while the store is down and finds joiners again once it is back; a joiner whose ticket
the restart lost queues again and is admitted; the loss watch waits for the store with
backoff (a handful of connect tries, never a spin) and is woken through the new store; a
survivor of a loss waits for the store on a fixed beat, bounded, where it is now; the
members of a group being formed (a shrink's survivors, a grow's) whose store is killed
under them wait for it and form the group in the new one, with a member that only ever
knew the new store.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from daemon.controlnode.rendezvous import StoreProcess
from trainer import membership
from trainer.contract import RDZV_ENDPOINT_ENV, RDZV_ENDPOINT_FILE_ENV, RUN_ID_ENV, write_endpoint_file
from trainer.credential import NodeCredential, Verifier
from trainer.membership import JoinQueue, LossWatch, StoreRetry, wake_survivors
from trainer.resize import Resizer
from trainer.store_retry import wait_for_store
from worker_procs import AUTHORITY, store_process, until as _until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store() -> Iterator[StoreProcess]:
    with store_process() as proc:
        yield proc


def _leader(store: StoreProcess, monkeypatch: pytest.MonkeyPatch) -> Resizer:
    """Rank 0's resizer of a 2-rank group whose batch splits over 3 ranks too."""
    monkeypatch.setenv(RDZV_ENDPOINT_ENV, f"127.0.0.1:{store.port}")
    monkeypatch.setenv(RUN_ID_ENV, "r")
    job = SimpleNamespace(
        ctx=SimpleNamespace(is_leader=True, initialized=True, world_size=2), resizes_in_process=True,
        args=SimpleNamespace(pg_timeout_s=30.0), G=6, plan=SimpleNamespace(micro_batch_size=1),
        credential=NodeCredential(AUTHORITY.issue(run="r", node="n1", now=time.time())))
    return Resizer(job)


def test_store_retry_backs_off_and_says_when_it_is_back() -> None:
    now = [0.0]
    retry = StoreRetry(clock=lambda: now[0])
    assert retry.due() and not retry.failed_before
    waits = []
    for _ in range(6):
        retry.failed(OSError("refused"), what="x")
        waits.append(retry.wait_s())
        now[0] += retry.wait_s()
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]  # capped: a store back is seen within 4 s
    retry.ok()
    assert retry.due() and not retry.failed_before


def test_rank_0s_join_check_never_waits_for_a_store_down_and_finds_joiners_after(
        store: StoreProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    leader = _leader(store, monkeypatch)
    assert leader.joiners_waiting() == 0  # connected, nobody waits
    store.kill()
    t0 = time.monotonic()
    boundaries = [leader.joiners_waiting() for _ in range(200)]  # 200 step boundaries during the outage
    assert boundaries == [0] * 200
    assert time.monotonic() - t0 < 3.0  # one probe, then nothing until the next try is due
    store.start()  # empty
    joiner = JoinQueue(("127.0.0.1", store.port), "r", timeout_s=10)
    joiner.register("n3", 0, 1, wait_s=300, credential=NodeCredential(AUTHORITY.issue(run="r", node="n3",
                                                                                      now=time.time())))
    assert _until(lambda: leader.joiners_waiting() == 1), "rank 0 did not see the joiner after the restart"


def test_a_joiner_whose_ticket_the_restart_lost_queues_again_and_is_admitted(store: StoreProcess) -> None:
    endpoint = ("127.0.0.1", store.port)
    joiner = JoinQueue(endpoint, "r", timeout_s=10)
    ticket = joiner.register("n3", 0, 1, wait_s=300, credential=NodeCredential(AUTHORITY.issue(
        run="r", node="n3", now=time.time())))
    admitted: list[object] = []
    t = threading.Thread(target=lambda: admitted.append(joiner.wait(ticket)), daemon=True)
    t.start()
    store.kill()
    store.start()  # empty: the ticket is gone
    leader = JoinQueue(endpoint, "r", timeout_s=10, verifier=Verifier(AUTHORITY.public_key, "r"))
    picks: list = []
    assert _until(lambda: bool(picks.extend(leader.ready(2, lambda w: True)) or picks)), "no ticket queued again"
    assert [p.node for p in picks] == ["n3"]
    leader.admit(picks, prefix="p/grow/1", first_rank=2, world_size=3)
    t.join(timeout=30)
    assert len(admitted) == 1 and (admitted[0].rank, admitted[0].world_size) == (2, 3)


def test_the_loss_watch_waits_for_the_store_with_backoff_and_is_woken_after(
        store: StoreProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    tries = []
    real = membership.store_reachable
    monkeypatch.setattr(membership, "store_reachable", lambda *a, **k: tries.append(time.monotonic()) or real(*a, **k))
    watch = LossWatch(("127.0.0.1", store.port), "r")
    watch._shut = lambda fds, pg: setattr(watch, "unblocked", watch.unblocked + 1)  # no group here to shut
    watch.follow("a1", 0)
    try:
        store.kill()
        assert _until(lambda: watch._retry.failed_before, 10), "the loss watch did not see the store go"
        down_at = time.monotonic()
        assert _until(lambda: time.monotonic() - down_at > 6, 10)
        during = [t for t in tries if t > down_at]
        assert len(during) <= 6  # 0.5, 1, 2, 4 s apart: a handful of probes, no spin
        store.start()
        assert _until(lambda: not watch._retry.failed_before, 15), "the loss watch did not reconnect"
        wake_survivors(("127.0.0.1", store.port), "r", "a1", 2, reason="loss")
        assert _until(lambda: watch.unblocked == 1, 15), "the wake through the new store did not reach the watch"
    finally:
        watch.stop()


def test_a_survivor_waits_for_a_store_on_a_fixed_beat_and_gives_up_after_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now, probes = [0.0], []
    monkeypatch.delenv(RDZV_ENDPOINT_FILE_ENV, raising=False)

    def probe(endpoint: tuple[str, int]) -> bool:
        probes.append(now[0])
        return False

    got = wait_for_store(("10.0.0.1", 29400), 3.0, what="x", clock=lambda: now[0], probe=probe,
                         sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got is None and now[0] == 3.0
    assert probes == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]  # on the beat, not a backoff: survivors arrive together


def test_a_survivor_waiting_for_the_store_follows_it_to_a_new_leader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RDZV_ENDPOINT_FILE_ENV, str(tmp_path / "rendezvous"))
    now, asked = [0.0], []

    def probe(endpoint: tuple[str, int]) -> bool:
        asked.append(endpoint)
        if len(asked) == 3:  # the new leader's word reaches the node's file
            write_endpoint_file(tmp_path / "rendezvous", "10.0.0.2:29500")
        return endpoint == ("10.0.0.2", 29500)

    got = wait_for_store(("10.0.0.1", 29400), 300.0, what="x", clock=lambda: now[0], probe=probe,
                         sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert got == ("10.0.0.2", 29500) and asked[-1] == got and asked[0] == ("10.0.0.1", 29400)


def test_a_survivor_waiting_for_a_killed_store_goes_on_once_it_is_back(store: StoreProcess) -> None:
    store.kill()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(wait_for_store(("127.0.0.1", store.port), 120.0, what="x")),
                         daemon=True)
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive() and got == []  # still waiting: the store is down
    store.start()  # empty, on the same port
    t.join(timeout=30)
    assert got == [("127.0.0.1", store.port)]



def _regroup_worker(index: int, first: int, port: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    from trainer.runtime import DistContext, regroup

    rank = first + index
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "3", "GROUP_RANK": str(rank), "GROUP_WORLD_SIZE": "3",
                       "LOCAL_RANK": "0"})
    ctx = DistContext(0, 0, 1, "gloo", torch.device("cpu"), False)
    new = regroup(ctx, rank, 3, "test/regroup/1", ("127.0.0.1", port), 60.0, store_wait_s=60.0)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"rank": new.rank, "world": dist.get_world_size(),
                                                         "sum": t.item()}))
    dist.destroy_process_group()


def _waiting_in(port: int, ranks: int) -> bool:
    """Whether ``ranks`` members have written their addresses under the test's key in the
    store at ``port`` (gloo's ``<prefix>/0//cpu//0/<rank>``) and so wait there for the rest."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        keys = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5)).list_keys()
    except Exception:  # noqa: BLE001 - not up yet
        return False
    return sum(k.startswith("test/regroup/1/") and k.endswith(tuple(f"//cpu//0/{r}" for r in range(3)))
               for k in keys) >= ranks


def _joined(procs, deadline: float) -> None:
    while not procs.join(timeout=max(0.0, deadline - time.monotonic())):  # raises if a member failed
        assert time.monotonic() < deadline, "the members did not form their group in time"


@pytest.mark.timeout(300)
def test_members_forming_a_group_ride_out_a_store_killed_under_them(store: StoreProcess, tmp_path: Path) -> None:
    # two of three members meet in the store and wait there for the third; the store is
    # SIGKILLed and started again, empty, on the same port (what a control node's kill
    # does to a shrink's survivors, or a grow's members, mid-regroup); the third member
    # arrives after, and knows only the new store: all three form the group
    import torch.multiprocessing as mp

    first = mp.start_processes(_regroup_worker, args=(0, store.port, str(tmp_path)), nprocs=2, join=False,
                               start_method="spawn")
    late = None
    try:
        assert _until(lambda: _waiting_in(store.port, 2), 120.0)
        store.kill()
        store.start()
        late = mp.start_processes(_regroup_worker, args=(2, store.port, str(tmp_path)), nprocs=1, join=False,
                                  start_method="spawn")
        deadline = time.monotonic() + 120.0
        _joined(first, deadline)
        _joined(late, deadline)
    finally:
        for p in first.processes + (late.processes if late is not None else []):
            if p.is_alive():
                p.kill()
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1, 2)]
    assert [g["rank"] for g in got] == [0, 1, 2]
    assert all(g["world"] == 3 and g["sum"] == 6.0 for g in got)
