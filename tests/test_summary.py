"""The demo summary counts what the trainer did, from its logs (daemon/analysis/summary.py)."""

from __future__ import annotations

import json
from pathlib import Path

from daemon.model import Event
from daemon.analysis.summary import summarize

G = 4  # global batch size in these synthetic runs


def _write(node_dir: Path, attempt: str, world: int, steps: range, t0: float, *, status: list[dict]) -> None:
    logs = node_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    per_rank = G // world
    for rank in range(world):
        with open(logs / f"steps-{attempt}-rank{rank}.jsonl", "a") as f:
            for i, s in enumerate(steps):
                pos = list(range((s - 1) * G + rank * per_rank, (s - 1) * G + (rank + 1) * per_rank))
                f.write(json.dumps({"attempt": attempt, "rank": rank, "world_size": world, "step": s,
                                    "positions": pos, "loss": 5.0 - s * 0.1, "time": t0 + i}) + "\n")
    with open(node_dir / "status.jsonl", "a") as f:
        for line in status:
            f.write(json.dumps({"attempt": attempt, "world_size": world, "rank": 0, **line}) + "\n")


def test_lineage_counts_lost_steps_and_exact_positions(tmp_path: Path) -> None:
    n = tmp_path / "nodes" / "n1"
    # attempt a: steps 1..12 at world 2; notice commit at 12 then hold -> 0 lost on notice
    _write(n, "a", 2, range(1, 13), 100.0, status=[
        {"event": "started", "time": 99.0, "step": 0},
        {"event": "checkpoint_committed", "time": 112.5, "step": 10, "notice_ids": []},
        {"event": "checkpoint_committed", "time": 113.0, "step": 12, "notice_ids": ["n-1"]},
        {"event": "holding", "time": 113.1, "step": 12},
    ])
    # attempt b: resumes at 12 at world 1, runs to 17, killed (last periodic commit at 15)
    _write(n, "b", 1, range(13, 18), 200.0, status=[
        {"event": "started", "time": 199.0, "step": 12},
        {"event": "checkpoint_committed", "time": 203.0, "step": 15, "notice_ids": []},
    ])
    # attempt c: resumes at 15 at world 2 and finishes at 20
    _write(n, "c", 2, range(16, 21), 300.0, status=[
        {"event": "started", "time": 299.0, "step": 15},
        {"event": "checkpoint_committed", "time": 305.0, "step": 20, "notice_ids": []},
    ])
    events = [
        Event(1, 112.0, "interruption_notice", "n2", {"notice_id": "n-1", "notice_seen_at": 112.2}),
        Event(2, 204.0, "node_lost", "n3", {}),
    ]
    s = summarize(tmp_path / "nodes", events, target_steps=20, global_batch_size=G)
    assert s["steps_completed"] == 20
    assert s["lost_steps_total"] == 2  # steps 16, 17 of attempt b were redone by c
    assert s["lost_steps_on_notice"] == 0
    assert s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["world_sizes"] == [2, 1, 2]
    assert s["preemptions_with_notice"] == 1 and s["nodes_lost_without_notice"] == 1
    assert s["notice_to_commit_s"] == [0.8]
    assert s["notice_to_resume_s"] == [86.8]
    assert s["checkpoints_committed"] == 4  # steps 10, 12, 15, 20
    assert s["loss_last"] < s["loss_first"]


def test_steps_lost_after_a_notice_commit_are_counted_on_notice(tmp_path: Path) -> None:
    n = tmp_path / "nodes" / "n1"
    # attempt a held after its notice commit at 5 but logged steps 6-7 first (hold at 7); b resumed from 5
    _write(n, "a", 1, range(1, 8), 100.0, status=[
        {"event": "started", "time": 99.0, "step": 0},
        {"event": "checkpoint_committed", "time": 105.0, "step": 5, "notice_ids": ["x"]},
        {"event": "holding", "time": 105.1, "step": 7},
    ])
    _write(n, "b", 1, range(6, 11), 200.0, status=[{"event": "started", "time": 199.0, "step": 5}])
    s = summarize(tmp_path / "nodes", [], target_steps=10, global_batch_size=G)
    assert s["lost_steps_total"] == 2
    assert s["lost_steps_on_notice"] == 2


def test_a_skipped_sample_is_reported(tmp_path: Path) -> None:
    n = tmp_path / "nodes" / "n1"
    _write(n, "a", 1, range(1, 4), 100.0, status=[{"event": "started", "time": 99.0, "step": 0}])
    # corrupt: drop step 2's log line for the only rank
    f = n / "logs" / "steps-a-rank0.jsonl"
    lines = [l for l in f.read_text().splitlines() if json.loads(l)["step"] != 2]
    f.write_text("\n".join(lines) + "\n")
    s = summarize(tmp_path / "nodes", [], target_steps=3, global_batch_size=G)
    assert s["steps_completed"] == 2
    assert s["samples_skipped"] == G  # positions of the missing step (range covers 2 steps' worth)


def test_a_rank_killed_before_its_last_log_line_skips_nothing_but_a_gap_is_still_a_skip(tmp_path: Path) -> None:
    """Rank 0 of a world of 2 is killed after step 2's collectives, before its log line:
    rank 1 logged step 2, so rank 0's share was trained on (a logged step had
    every rank in its all-reduce): not skipped, counted as unlogged. A step every rank
    logged with a position missing is a skip."""
    n = tmp_path / "nodes" / "n1"
    _write(n, "a", 2, range(1, 4), 100.0, status=[{"event": "started", "time": 99.0, "step": 0}])
    f = n / "logs" / "steps-a-rank0.jsonl"
    f.write_text("\n".join(l for l in f.read_text().splitlines() if json.loads(l)["step"] != 2) + "\n")
    s = summarize(tmp_path / "nodes", [], target_steps=3, global_batch_size=G)
    assert (s["samples_skipped"], s["samples_unlogged"], s["global_batch_sizes"]) == (0, G // 2, [G])
    # every rank logged step 3, one position short: a skip, whatever
    f = n / "logs" / "steps-a-rank1.jsonl"
    lines = [json.loads(l) for l in f.read_text().splitlines()]
    lines[-1]["positions"] = lines[-1]["positions"][:-1]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = summarize(tmp_path / "nodes", [], target_steps=3, global_batch_size=G)
    assert (s["samples_skipped"], s["samples_unlogged"]) == (1, G // 2)


def test_an_in_process_shrink_is_a_resize_not_a_restart(tmp_path: Path) -> None:
    n = tmp_path / "nodes" / "n1"
    # attempt a at world 2 commits on notice at 6; its survivors go on in-process as attempt b
    _write(n, "a", 2, range(1, 7), 100.0, status=[
        {"event": "started", "time": 99.0, "step": 0},
        {"event": "checkpoint_committed", "time": 106.5, "step": 6, "notice_ids": ["n-1"]},
    ])
    _write(n, "b", 1, range(7, 10), 107.0, status=[
        {"event": "started", "time": 106.6, "step": 6, "resized": "in_process"},
        {"event": "checkpoint_committed", "time": 110.0, "step": 9, "notice_ids": ["rejoin-1"]},
    ])
    # the grow: torchrun restarts every worker at world 2
    _write(n, "c", 2, range(10, 13), 120.0, status=[
        {"event": "started", "time": 119.0, "step": 9},
        {"event": "checkpoint_committed", "time": 123.0, "step": 12, "notice_ids": []},
    ])
    events = [Event(1, 106.0, "interruption_notice", "n2", {"notice_id": "n-1", "notice_seen_at": 106.1})]
    s = summarize(tmp_path / "nodes", events, target_steps=12, global_batch_size=G)
    assert (s["restarts"], s["resizes_in_process"]) == (1, 1)
    assert s["world_sizes"] == [2, 1, 2]
    assert s["lost_steps_total"] == 0 and s["samples_seen_twice"] == 0 and s["samples_skipped"] == 0
    assert s["notice_to_resume_s"] == [0.5]  # the shrink's started line, not the grow's


def test_resumes_before_their_commit_counts_an_inverted_log() -> None:
    from daemon.analysis.summary import resumes_before_their_commit

    def ev(seq: int, kind: str, **data) -> Event:
        return Event(seq, float(seq), kind, None, data)

    causal = [ev(1, "job_resumed", resumed_from=None), ev(2, "checkpoint_committed", step=26),
              ev(3, "job_resumed", resumed_from=26)]
    inverted = [ev(1, "job_resumed", resumed_from=None), ev(2, "job_resumed", resumed_from=26),
                ev(3, "checkpoint_committed", step=26)]
    assert resumes_before_their_commit(causal) == 0
    assert resumes_before_their_commit(inverted) == 1


def test_a_script_that_reports_nothing_leaves_its_figures_unknown_not_zero(tmp_path: Path) -> None:
    """``job.command``: no step log, no status line of the trainer's (only its launcher's
    ``workers_failed``, torchrun restarting it after the notice's SIGTERM). Zero steps,
    zero restarts and zero notices read as "nothing happened" after a run with a notice
    and torchrun restarts (a fresh-clone user trial read exactly that)."""
    (tmp_path / "nodes" / "n1").mkdir(parents=True)
    (tmp_path / "nodes" / "n1" / "status.jsonl").write_text(
        json.dumps({"event": "workers_failed", "time": 12.0, "restarts_left": 99, "state": "failed"}) + "\n")
    events = [Event(1, 10.0, "interruption_notice", "n1", {"notice_id": "x"}),
              Event(2, 20.0, "node_lost", "n2", {})]
    s = summarize(tmp_path / "nodes", events, target_steps=100, global_batch_size=G)
    assert s["steps_completed"] is None and s["restarts"] is None and s["samples_skipped"] is None
    assert s["target_steps"] is None and s["world_sizes"] is None
    assert s["preemptions_with_notice"] == 1 and s["nodes_lost_without_notice"] == 1
    assert "reports no steps" in s["trainer_reports"]


def test_the_trainers_own_global_batch_counts_when_the_config_says_another(tmp_path: Path) -> None:
    """An HF script's Trainer arguments make its global batch (4 here) whatever
    ``job.global_batch_size`` says (6): its steps' samples are not skipped for that
    (a fresh-clone user trial read ``samples_skipped 240`` after a clean 60-step run)."""
    n = tmp_path / "nodes" / "n1"
    _write(n, "a", 2, range(1, 11), 100.0, status=[{"event": "started", "time": 99.0, "step": 0}])
    s = summarize(tmp_path / "nodes", [], target_steps=10, global_batch_size=6)
    assert s["steps_completed"] == 10 and s["global_batch_sizes"] == [G]
    assert s["samples_skipped"] == 0 and s["samples_seen_twice"] == 0 and s["samples_unlogged"] == 0
