"""DeepSpeed ZeRO-1/2/3 resizes in-process (``trainer.examples.deepspeed_zero2.DeepSpeedJob``:
``stage_state`` / ``reshard`` over :mod:`trainer.integrations.deepspeed_resize`): a new
node's worker joins a running job, a notice shrinks it, a peer killed without notice
makes the survivors reload the newest commit, or, with ``--replicate-shards``, rebuild its
partitions from their copy on the next node; no worker restarts, and across each planned
resize the whole state (fp32 master copies, AdamW's moments and step, the engine's
counters, the model's own parameters) is bit-identical before and after, although the
engine was rebuilt at another data-parallel size and every rank's partition changed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.ports import free_port
from worker_procs import (assert_rebuilt_from_copies, assert_rebuilt_twice, finish, joiner_env, member_env,
                          sharded_events, start_sharded, status_lines, trained, wait_for_status)

pytestmark = pytest.mark.slow

G = 12
RECORDED, GROW_AND_SHRINK, KILL_NODE2 = sharded_events("deepspeed")  # worker_procs.sharded_events


def _start(tmp_path: Path, name: str, env: dict[str, str], rdzv_port: int, ckpt: str, job: tuple[str, ...],
           extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return start_sharded(tmp_path, name, env, rdzv_port, ckpt, job, extra, run_id="deepspeed")


def _started(tmp_path: Path, node: str) -> list[tuple]:
    return [(x["step"], x.get("resized"), x["world_size"], x.get("resumed_from"))
            for x in status_lines(tmp_path, node) if x["event"] == "started"]


@pytest.mark.parametrize("zero_stage", ["1", "2", "3"])
def test_a_deepspeed_job_grows_and_shrinks_without_a_restart_and_keeps_its_state_exact(
        tmp_path: Path, rdzv, zero_stage: str) -> None:
    """ZeRO at world 2; a third worker joins at step 5 (world 3); node0, old rank 0, gets a
    notice at step 8, is stopped the moment its commit is written (as its agent does), and
    the other two go on (world 2) to step 12. Nobody restarts, the joiner reads no commit,
    every step's global batch is trained exactly once, and at both resizes the whole state
    hashes the same before the group changed and after the engine was rebuilt. The
    partitions move peer to peer: the joiner receives only its own (a third of
    the state at most, not all of it), and the survivors of the shrink only what the
    leaver held and what their new partitions lack."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    # a periodic commit every 5 steps: the grow is at one, as a demo's may be (the old ranks
    # commit step 5, admit the joiner, and the new group must not commit step 5 again)
    extra = ("--checkpoint-interval", "5", "--zero-stage", zero_stage)
    procs = [_start(tmp_path, f"node{r}", member_env(r, 2, master, "deepspeed"), rdzv.port, ckpt, GROW_AND_SHRINK,
                    extra) for r in range(2)]
    wait_for_status(tmp_path, "node0", procs[0], '"event":"step"')
    procs.append(_start(tmp_path, "node2", joiner_env(), rdzv.port, ckpt, GROW_AND_SHRINK, extra))
    # node0's agent stops it as soon as its notice is answered by a commit, as a real one does
    wait_for_status(tmp_path, "node0", procs[0], '"reason":"notice"')
    procs[0].terminate()
    outs = finish(procs)
    assert [p.returncode for p in procs] == [-15, 0, 0], "\n".join(outs)

    assert _started(tmp_path, "node1") == [(0, None, 2, None), (5, "in_process", 3, None),
                                           (8, "in_process", 2, 8)], "\n".join(outs)
    # each step committed once: step 5 before the grow, not again by the grown group
    assert [x["step"] for x in status_lines(tmp_path, "node1") if x["event"] == "checkpoint_committed"] == [
        5, 8, 10, 12]
    joiner = status_lines(tmp_path, "node2")
    assert [(x["step"], x["rank"]) for x in joiner if x["event"] == "started"] == [(5, 2), (8, 1)]
    assert not any(x["event"] == "checkpoint_loaded" for x in joiner)  # the state came from its peers
    grown = next(x for x in joiner if x["event"] == "started")
    state_bytes = next(x["bytes"] for x in status_lines(tmp_path, "node0") if x["event"] == "checkpoint_committed")
    assert 0 < grown["reshard_received_bytes"] < state_bytes / 2, grown
    assert grown["reshard_sent_bytes"] == 0
    assert {s: sorted(p) for s, p in trained(tmp_path).items()} == {
        s: list(range((s - 1) * G, s * G)) for s in range(1, 13)}
    for step, world in ((5, 3), (8, 2)):
        before = (tmp_path / f"before-{step}.txt").read_text().split()
        after = (tmp_path / f"after-{step}.txt").read_text().split()
        assert after[0] == before[0] and after[-1] == str(world), (step, before, after)


@pytest.mark.parametrize("zero_stage", ["1", "3"])
def test_a_deepspeed_job_that_loses_a_peer_reloads_the_last_commit_in_process(tmp_path: Path, rdzv,
                                                                              zero_stage: str) -> None:
    """ZeRO-1 (and ZeRO-3) at world 3, a commit every 4 steps; node2's worker is SIGKILLed at step 6 (no
    notice: its partition of the optimizer's state is gone). The two survivors re-form the
    group in their own processes, rebuild the engine at world 2, load step 4 from the commit
    (through DeepSpeed's universal checkpoint) and train on to step 12: steps 5 and 6 are
    trained again (the only loss), every later step once."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "deepspeed"), rdzv.port, ckpt, KILL_NODE2,
                    ("--checkpoint-interval", "4", "--zero-stage", zero_stage)) for r in range(3)]
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0, -9], "\n".join(outs)
    for node in ("node0", "node1"):
        assert _started(tmp_path, node) == [(0, None, 3, None), (4, "in_process", 2, 4)], "\n".join(outs)
    loads = [x for x in status_lines(tmp_path, "node0") if x["event"] == "checkpoint_loaded"]
    assert [(x["step"], x["universal"], x["saved_world_size"]) for x in loads] == [(4, True, 3)], loads
    got = trained(tmp_path)
    want = {s: list(range((s - 1) * G, s * G)) for s in range(1, 13)}
    for s in (5, 6):  # at world 3 before the loss, at 2 after
        assert sorted(got[s]) == sorted(want[s] * 2)
    assert {s: sorted(p) for s, p in got.items() if s not in (5, 6)} == {
        s: p for s, p in want.items() if s not in (5, 6)}


@pytest.mark.parametrize("zero_stage", ["3"])  # ZeRO-2's copies: the every-two-steps cell below
def test_a_deepspeed_job_with_replicated_partitions_loses_no_step_to_a_kill(tmp_path: Path, rdzv,
                                                                            zero_stage: str) -> None:
    """As above with ``--replicate-shards``: after every step each rank's ZeRO partitions
    (fp32 masters and AdamW's moments) are copied to the next node's rank. node2 (old rank
    2) is SIGKILLed before its step 7; its partitions' copy on node0 (its buddy, (2 + 1) %
    3) and the survivors' own put the whole state of step 6 back together, bit-identical to
    step 6's at world 3, and the engine is rebuilt at world 2 from it: no commit loaded, no
    step lost (step 7 failed before anyone completed it and is trained once, at world 2)."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    job = (*KILL_NODE2, "--record-step", "6")
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "deepspeed"), rdzv.port, ckpt, job,
                    ("--checkpoint-interval", "4", "--zero-stage", zero_stage, "--replicate-shards"))
             for r in range(3)]
    assert_rebuilt_from_copies(tmp_path, procs, finish(procs), 6)
    assert {s: sorted(p) for s, p in trained(tmp_path).items()} == {
        s: list(range((s - 1) * G, s * G)) for s in range(1, 13)}


def _replicating(tmp_path: Path, rdzv, job: tuple[str, ...]) -> tuple[list[subprocess.Popen], list[str]]:
    """Three ZeRO-2 workers with ``job``'s events, a commit every 4 steps and their
    partitions copied after every step, run to the end: the processes and their output."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "deepspeed"), rdzv.port, ckpt, job,
                    ("--checkpoint-interval", "4", "--replicate-shards")) for r in range(3)]
    return procs, finish(procs)


def _each_step_trained_once(tmp_path: Path) -> None:
    assert {s: sorted(p) for s, p in trained(tmp_path).items()} == {
        s: list(range((s - 1) * G, s * G)) for s in range(1, 13)}


def test_a_kill_inside_a_deepspeed_copy_costs_one_step(tmp_path: Path, rdzv) -> None:
    """ZeRO-2, a copy after every step: node2 dies after its step 7's optimizer step,
    entering that step's copy. The survivors, at step 7, hold node2's partitions of step 6
    and each a snapshot of its own of step 6 (with the scalars), taken before step 7's
    update: they rebuild the state of step 6 (bit-identical to step 6's at world 3), load
    no commit, and train step 7 again at world 2."""
    job = (*RECORDED, "--kill-at", "6", "--kill-node", "node2", "--kill-in-copy", "--record-step", "6")
    assert_rebuilt_from_copies(tmp_path, *_replicating(tmp_path, rdzv, job), 6)
    _each_step_trained_once(tmp_path)


def test_a_kill_inside_zeros_optimizer_step_goes_back_to_the_snapshots(tmp_path: Path, rdzv) -> None:
    """ZeRO-2, a copy after every step: node2 dies inside step 7's optimizer step, right
    after updating its own partitions; the survivors have updated theirs too (their
    engines still count step 6) and find the peer gone in ZeRO's all-gather of the new
    parameters. Their partitions are of no step they can name, but each keeps a snapshot
    of step 6 (taken before the update) and node0 the copy of node2's: they rebuild step 6
    (bit-identical to step 6's at world 3), load no commit and train step 7 at world 2."""
    job = (*RECORDED, "--kill-at", "6", "--kill-node", "node2", "--kill-in-update", "--record-step", "6")
    procs, outs = _replicating(tmp_path, rdzv, job)
    assert_rebuilt_from_copies(tmp_path, procs, outs, 6)
    assert "stepped their optimizer" not in "".join(outs)
    _each_step_trained_once(tmp_path)


def test_a_second_deepspeed_node_lost_right_after_a_rebuild_costs_no_step(tmp_path: Path, rdzv) -> None:
    """ZeRO-2: node2 is SIGKILLed before its step 7, the survivors rebuild step 6 at world
    2 from the copies, copy their new partitions to each other before training on, and
    node1 dies in the forward pass of that step: node0 rebuilds step 6 again, alone,
    bit-identical to step 6's at world 3, and trains every step exactly once."""
    job = (*KILL_NODE2, "--record-step", "6", "--kill-again", "node1")
    assert_rebuilt_twice(tmp_path, *_replicating(tmp_path, rdzv, job), 6)
    _each_step_trained_once(tmp_path)


def test_deepspeed_partitions_copied_every_two_steps_cost_a_kill_at_most_one_step(tmp_path: Path, rdzv) -> None:
    """``--replicate-every 2`` at ZeRO-2: copies after steps 1 (the first), 2, 4 and 6, each
    rank keeping a snapshot of its own partitions and of the state's scalars (AdamW's step,
    the engine's counters) as of each copy (taken before the next update). node2 is SIGKILLed before its step 8: the
    survivors are at step 7 and the copy of node2's partitions is of step 6, so they go back
    to their snapshots, rebuild the state of step 6 (bit-identical to step 6's at world 3)
    and train step 7 again at world 2: the only step lost, no commit loaded."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    job = (*RECORDED, "--kill-at", "7", "--kill-node", "node2", "--record-step", "6")
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "deepspeed"), rdzv.port, ckpt, job,
                    ("--checkpoint-interval", "4", "--replicate-shards", "--replicate-every", "2"))
             for r in range(3)]
    assert_rebuilt_from_copies(tmp_path, procs, finish(procs), 6)
    got, want = trained(tmp_path), {s: list(range((s - 1) * G, s * G)) for s in range(1, 13)}
    assert sorted(got[7]) == sorted(want[7] * 2)  # at world 3 before the loss, at 2 after
    assert {s: sorted(p) for s, p in got.items() if s != 7} == {s: p for s, p in want.items() if s != 7}
