"""PreemptionGuard: notice file parsing, local decisions, and agreement across 2 gloo ranks."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.contract import NoticeKind, parse_notices, read_notice_file
from trainer.guard import Decision, PeerLeftError, PreemptionGuard


def _write(path: Path, notices: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(notices))
    os.replace(tmp, path)


def _notice(nid: str, kind: str) -> dict:
    return {"id": nid, "kind": kind, "time": time.time(), "deadline": None}


# --------------------------------------------------------------------------- single process


def test_missing_file_means_no_notice(tmp_path: Path) -> None:
    g = PreemptionGuard(tmp_path / "absent.json")
    assert g.check() == Decision()
    assert not g.check()


def test_no_file_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTVISOR_NOTICE_FILE", raising=False)
    g = PreemptionGuard()
    assert g.notice_file is None
    assert g.check() == Decision()


def test_default_path_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "notices.json"
    monkeypatch.setenv("SPOTVISOR_NOTICE_FILE", str(f))
    _write(f, [_notice("n-1", "checkpoint")])
    d = PreemptionGuard().check()
    assert d == Decision(checkpoint=True, hold=False, notice_ids=("n-1",), kinds=("checkpoint",))


@pytest.mark.parametrize(
    "content", ["{not json", '{"id": "x"}', "\x00\xff", '"a string"', "[["]
)
def test_garbage_file_does_not_crash_and_warns_once(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "notices.json"
    f.write_text(content, encoding="latin-1")
    g = PreemptionGuard(f)
    with caplog.at_level(logging.WARNING, logger="trainer.guard"):
        for _ in range(3):
            assert g.check() == Decision()
    assert len([r for r in caplog.records if r.name == "trainer.guard"]) == 1


def test_empty_file_is_no_notice(tmp_path: Path) -> None:
    f = tmp_path / "notices.json"
    f.write_text("")
    assert PreemptionGuard(f).check() == Decision()
    f.write_text("[]")
    assert PreemptionGuard(f).check() == Decision()


@pytest.mark.parametrize(
    "kind,hold", [("checkpoint", False), ("interruption", True), ("rejoin", True)]
)
def test_kinds(tmp_path: Path, kind: str, hold: bool) -> None:
    f = tmp_path / "notices.json"
    _write(f, [_notice("n-a", kind)])
    d = PreemptionGuard(f).check()
    assert d.checkpoint and d.hold is hold
    assert d.notice_ids == ("n-a",) and d.kinds == (kind,)
    assert d.leaving_ranks == ((0,) if kind == "interruption" else ())  # only an interruption takes the node


def test_mixed_kinds_hold_wins(tmp_path: Path) -> None:
    f = tmp_path / "notices.json"
    _write(f, [_notice("c1", "checkpoint"), _notice("i1", "interruption"), _notice("c1", "checkpoint")])
    d = PreemptionGuard(f).check()
    assert d == Decision(True, True, ("c1", "i1"), ("checkpoint", "interruption"), leaving_ranks=(0,))


def test_handled_ids_skipped(tmp_path: Path) -> None:
    f = tmp_path / "notices.json"
    _write(f, [_notice("old", "interruption"), _notice("new", "checkpoint")])
    g = PreemptionGuard(f, handled_ids=["old"])
    d = g.check()
    assert d == Decision(True, False, ("new",), ("checkpoint",))
    assert g.check() == d  # still pending until marked
    g.mark_handled(d.notice_ids)
    assert g.check() == Decision()
    assert g.handled_ids == ["old", "new"]


def test_handled_ids_are_bounded(tmp_path: Path) -> None:
    g = PreemptionGuard(tmp_path / "x", handled_ids=[f"n{i}" for i in range(10)], max_handled=4)
    assert g.handled_ids == ["n6", "n7", "n8", "n9"]
    g.mark_handled(["n6"])  # re-marking refreshes it
    assert g.handled_ids == ["n7", "n8", "n9", "n6"]


def test_bad_entries_dropped_good_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "notices.json"
    f.write_text(json.dumps([{"id": "a", "kind": "meteor"}, {"kind": "checkpoint"}, 7, _notice("ok", "checkpoint")]))
    with caplog.at_level(logging.WARNING, logger="trainer.guard"):
        g = PreemptionGuard(f)
        assert g.check().notice_ids == ("ok",)
        g.check()
    assert len(caplog.records) == 3  # one per bad entry, not repeated


def test_parse_notices_fields() -> None:
    notices, problems = parse_notices(
        '[{"id": "n", "kind": "interruption", "time": 5, "deadline": 125.5}, {"id": "m", "kind": "checkpoint"}]'
    )
    assert problems == []
    assert notices[0].kind is NoticeKind.INTERRUPTION and notices[0].deadline == 125.5
    assert notices[1].time is None and notices[1].deadline is None


def test_read_notice_file_missing(tmp_path: Path) -> None:
    assert read_notice_file(tmp_path / "nope") == []


def test_local_hold_returns_after_timeout() -> None:
    g = PreemptionGuard(None)
    t0 = time.monotonic()
    g.hold(0.3, poll_s=0.05)
    assert 0.3 <= time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError):
        g.hold(-1)


# --------------------------------------------------------------------------- two gloo ranks


def _init_url(tmp_path: Path) -> str:
    """The ranks meet through a file, not a port picked in advance: a port found free and
    then bound by the workers can be taken in between (EADDRINUSE under load)."""
    return f"file://{tmp_path}/pg-init"


def _two_rank_worker(rank: int, init: str, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        notice_file = Path(tmp) / f"notices-{rank}.json"  # node-local: only rank 1's node gets one
        guard = PreemptionGuard(notice_file, handled_ids=["stale"])
        if rank == 1:
            _write(notice_file, [_notice("stale", "interruption")])  # handled before: ignored
        out = []
        for step in range(6):
            if rank == 1 and step == 2:
                _write(notice_file, [_notice("stale", "interruption"), _notice("n-1", "interruption")])
            if rank == 0 and step == 4:
                _write(notice_file, [_notice("c-0", "checkpoint")])
            if rank == 1 and step == 4:
                _write(notice_file, [_notice("c-1", "checkpoint")])
            # one rank alone due a periodic commit (a joiner's loop and the old ranks' differ)
            d = guard.check(periodic=(rank, step) in ((0, 2), (1, 3)))
            out.append([step, d.checkpoint, d.hold, list(d.notice_ids), list(d.kinds), d.periodic])
            guard.mark_handled(d.notice_ids)
        t0 = time.monotonic()
        guard.hold(0.6, poll_s=0.05)
        held = time.monotonic() - t0
        Path(tmp, f"result-{rank}.json").write_text(json.dumps({"decisions": out, "held": held}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_decide_at_the_same_step(tmp_path: Path) -> None:
    mp.spawn(_two_rank_worker, args=(_init_url(tmp_path), str(tmp_path)), nprocs=2, join=True)
    r0 = json.loads((tmp_path / "result-0.json").read_text())
    r1 = json.loads((tmp_path / "result-1.json").read_text())
    assert r0["decisions"] == r1["decisions"]
    by_step = {d[0]: d[1:] for d in r0["decisions"]}
    assert by_step[0] == [False, False, [], [], False]
    assert by_step[1] == [False, False, [], [], False]
    assert by_step[2] == [True, True, ["n-1"], ["interruption"], True]  # rank 0's periodic, with a notice
    assert by_step[3] == [False, False, [], [], True]  # handled; rank 1's periodic: both commit
    assert by_step[4] == [True, False, ["c-0", "c-1"], ["checkpoint", "checkpoint"], False]  # union, rank order
    assert by_step[5] == [False, False, [], [], False]
    for r in (r0, r1):
        assert 0.55 <= r["held"] < 5.0


def _peer_leaves_worker(rank: int, init: str, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    guard = PreemptionGuard(None)
    guard.check()
    holding = Path(tmp, "holding")
    if rank == 1:
        deadline = time.monotonic() + 30
        while not holding.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # polling rank 0's marker under the deadline
        time.sleep(0.2)  # simulated: the node is taken a moment into the hold
        os._exit(0)
    t0 = time.monotonic()
    holding.touch()  # rank 0 is entering the hold
    try:
        guard.hold(20.0, poll_s=0.05)
        outcome = "returned"
    except Exception as exc:  # the trainer exits non-zero on it (hold_for_restart)
        outcome = type(exc).__name__
    Path(tmp, "peer-left.json").write_text(json.dumps({"outcome": outcome, "after": time.monotonic() - t0}))
    os._exit(0)


def test_hold_raises_when_a_peer_leaves(tmp_path: Path) -> None:
    mp.spawn(_peer_leaves_worker, args=(_init_url(tmp_path), str(tmp_path)), nprocs=2, join=True)
    r = json.loads((tmp_path / "peer-left.json").read_text())
    assert r["outcome"] == "PeerLeftError"  # one line for the trainer's log, not gloo's traceback
    assert r["after"] < 15.0


def test_a_trainer_holding_exits_1_with_one_line_when_a_peer_leaves(caplog: pytest.LogCaptureFixture) -> None:
    """What the two-rank test above raises becomes exit status 1 (torchrun restarts the
    group) and one warning line naming the commit, not a traceback."""
    class PeerLeaves(PreemptionGuard):
        def hold(self, timeout_s: float, poll_s: float = 0.25) -> None:
            raise PeerLeftError("a peer left the hold (Connection closed by peer [127.0.0.1]:1)")

    g = PeerLeaves(None)
    with caplog.at_level("WARNING"), pytest.raises(SystemExit) as exit_:
        g.hold_for_restart(90.0, step=43)
    assert exit_.value.code == 1
    (rec,) = caplog.records
    assert rec.getMessage() == ("a peer left the hold (Connection closed by peer [127.0.0.1]:1) at step 43; "
                                "exiting for torchrun to restart the group from that commit")


def _node_leaves_worker(rank: int, init: str, tmp: str) -> None:
    # four ranks on two "nodes" (torchrun's GROUP_RANK): ranks 0, 1 on node 0, ranks 2, 3 on node 1
    os.environ["GROUP_RANK"] = str(rank // 2)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=4)
    try:
        notice_file = Path(tmp) / f"notices-node{rank // 2}-rank{rank}.json"
        if rank == 3:  # only one rank of node 1 has read the notice at this boundary
            _write(notice_file, [_notice("n-1", "interruption")])
        d = PreemptionGuard(notice_file).check()
        Path(tmp, f"leaving-{rank}.json").write_text(json.dumps(list(d.leaving_ranks)))
    finally:
        dist.destroy_process_group()


def test_every_rank_of_a_noticed_node_leaves(tmp_path: Path) -> None:
    """The survivors are whole nodes: a rank of the noticed node that read the notice file
    a moment before the agent wrote it still counts as leaving, with its node."""
    mp.spawn(_node_leaves_worker, args=(_init_url(tmp_path), str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        assert json.loads((tmp_path / f"leaving-{rank}.json").read_text()) == [2, 3]
