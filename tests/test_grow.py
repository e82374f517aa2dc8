"""In-process grow: a new node's workers join the running group at a step boundary and
take the state from rank 0; nobody restarts (``trainer.membership``,
``trainer.loop.ElasticJob.grow`` / ``join_running``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import TCPStore

from bench.ports import free_port
from trainer.checkpoint import FileStore, Manifest, list_committed, load_shard
from trainer.contract import JOIN_ENV, RUN_ID_ENV
from trainer.credential import NodeCredential, Verifier
from trainer.membership import EXPIRY_MARGIN_S, MAX_READS_PER_STEP, JoinQueue, JoinRefused, JoinTimeout
from worker_procs import (AUTHORITY, finish, joiner_env, member_env, start_worker, status_lines, trained,
                          wait_for_status)


def _queue(rdzv: TCPStore, run: str = "r") -> JoinQueue:
    """The queue of run ``run``, checking tickets as a rank 0 with a credential of the tests' daemon does."""
    return JoinQueue(("127.0.0.1", rdzv.port), run, timeout_s=10, verifier=Verifier(AUTHORITY.public_key, run))


def _cred(node: str, run: str = "r") -> NodeCredential:
    return NodeCredential(AUTHORITY.issue(run=run, node=node, now=time.time()))


def _even(world: int) -> bool:
    return world % 2 == 0


# -- the queue, against a real TCPStore ------------------------------------------------------


def test_nobody_waiting_is_nothing_to_admit(rdzv) -> None:
    assert _queue(rdzv).ready(2, lambda w: True) == []


def test_a_node_is_admitted_only_with_all_its_workers(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    a0 = joiner.register("n3", 0, 2, wait_s=300, credential=_cred("n3"))
    assert leader.ready(2, lambda w: True) == []  # its second worker has not queued yet
    a1 = joiner.register("n3", 1, 2, wait_s=300, credential=_cred("n3"))
    assert [t.number for t in leader.ready(2, lambda w: True)] == [a0.number, a1.number]


def test_only_a_world_size_the_batch_splits_over(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    assert leader.ready(2, _even) == []  # 3 ranks: the global batch does not split
    joiner.register("n4", 0, 1, wait_s=300, credential=_cred("n4"))
    assert [t.node for t in leader.ready(2, _even)] == ["n3", "n4"]  # 4 does


def test_admission_reaches_the_joiner_and_the_queue_moves_on(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    t = joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    pick = leader.ready(2, lambda w: True)
    leader.admit(pick, prefix="p/grow/1", first_rank=2, world_size=3)
    a = joiner.wait(t)
    assert (a.prefix, a.rank, a.world_size, a.first_rank, a.ranks) == ("p/grow/1", 2, 3, 2, (2,))
    assert leader.ready(3, lambda w: True) == []  # admitted once
    assert _queue(rdzv).ready(3, lambda w: True) == []  # also for a new rank 0 (after a shrink)


def test_a_joiner_placed_among_the_old_ranks_learns_every_joiners_rank(rdzv) -> None:
    """A sharded job's grow places its joiners where the fewest bytes move
    (p2p_reshard.grow_ranks): each admission names every joiner's rank, which the joiners
    need to meet rank 0 over a group of just them."""
    joiner, leader = _queue(rdzv), _queue(rdzv)
    tickets = [joiner.register(n, 0, 1, wait_s=300, credential=_cred(n)) for n in ("n3", "n4")]
    leader.admit(leader.ready(2, lambda w: True), prefix="p/grow/1", first_rank=2, world_size=4, ranks=[1, 3])
    assert [(a.rank, a.ranks) for a in map(joiner.wait, tickets)] == [(1, (1, 3)), (3, (1, 3))]


@pytest.mark.parametrize(("rank", "ranks"), [(0, [0]), (2, [2, 2]), (5, [5]), (2, "x"), (2, [1])])
def test_an_admission_naming_ranks_no_grow_has_is_refused(rdzv, rank, ranks) -> None:
    """What rank 0 never writes (rank 0 taken, a rank twice, past the world, not a list,
    without the joiner's own): the joiner refuses it in one line and exits, it does not
    join a group it cannot meet."""
    joiner, leader = _queue(rdzv), _queue(rdzv)
    t = joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    leader.admit(leader.ready(2, lambda w: True), prefix="p/grow/1", first_rank=2, world_size=3)
    body = json.loads(leader.store.get(f"a/{t.number}"))
    leader.store.set(f"a/{t.number}", json.dumps({**body, "rank": rank, "ranks": ranks}))
    with pytest.raises(JoinRefused, match="not a grow this worker can join"):
        joiner.wait(t)


def test_a_ticket_near_its_expiry_is_left_and_its_joiner_withdraws(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    t = joiner.register("n3", 0, 1, wait_s=EXPIRY_MARGIN_S - 29.9, credential=_cred("n3"))
    assert leader.ready(2, lambda w: True) == []
    with pytest.raises(JoinTimeout, match="n3"):
        joiner.wait(t)
    assert leader.ready(2, lambda w: True) == []  # withdrawn: never admitted later


def test_queues_of_two_runs_are_apart(rdzv) -> None:
    _queue(rdzv, "other").register("n9", 0, 1, wait_s=300, credential=_cred("n9", "other"))
    assert _queue(rdzv, "r").ready(1, lambda w: True) == []


# -- who may join: a credential the daemon issued, proved by the node itself (issue 25, item 11) --


def test_a_ticket_without_a_credential_is_refused_and_its_joiner_told(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    t = joiner.register("n3", 0, 1, wait_s=300, credential=None)
    assert leader.ready(2, lambda w: True) == []
    with pytest.raises(JoinRefused, match="refused node n3's ticket 1 \\(no certificate\\)"):
        joiner.wait(t)
    assert leader.ready(2, lambda w: True) == [] and leader.refused == 1  # read and refused once
    assert _queue(rdzv).ready(2, lambda w: True) == []  # a later rank 0 does not read it again


def test_a_ticket_copied_to_a_new_number_is_refused_and_does_not_displace_its_node(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    t = joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    copy = int(joiner.store.add("tickets", 1))  # an outsider read it off the store and queued it again
    joiner.store.set(f"t/{copy}", joiner.store.get(f"t/{t.number}"))
    assert [x.number for x in leader.ready(2, lambda w: True)] == [t.number]  # not the newer copy
    assert leader.refused == 1


def test_a_credential_of_another_node_or_key_is_refused(rdzv) -> None:
    from trainer.credential import Authority

    joiner, leader = _queue(rdzv), _queue(rdzv)
    joiner.register("n4", 0, 1, wait_s=300, credential=_cred("n3"))  # n3's credential, queued as n4
    forged = NodeCredential(Authority.generate().issue(run="r", node="n5", now=time.time()))
    joiner.register("n5", 0, 1, wait_s=300, credential=forged)
    assert leader.ready(2, lambda w: True) == [] and leader.refused == 2


def test_a_rank_0_without_a_credential_admits_nobody(rdzv) -> None:
    _queue(rdzv).register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    leader = JoinQueue(("127.0.0.1", rdzv.port), "r", timeout_s=10, verifier=None)
    assert leader.ready(2, lambda w: True) == [] and leader.refused == 1


def test_a_malformed_ticket_is_refused_and_the_queue_goes_on(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    for junk in (b"\xff not json", b"[]", b'{"node": "n9"}', b'{"node": "n9", "local_rank": "x"}'):
        n = int(joiner.store.add("tickets", 1))
        joiner.store.set(f"t/{n}", junk)
    t = joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    assert [x.number for x in leader.ready(2, lambda w: True)] == [t.number]
    assert leader.refused == 4


def test_a_flooded_queue_costs_a_step_boundedly_many_reads(rdzv, monkeypatch) -> None:
    """An outsider adds a billion to the ticket count: rank 0 reads at most
    MAX_READS_PER_STEP tickets at a boundary, and training goes on."""
    leader = _queue(rdzv)
    leader.store.add("tickets", 10**9)  # numbers no joiner ever writes
    reads = []
    read = leader._read
    monkeypatch.setattr(leader, "_read", lambda number, now: reads.append(number) or read(number, now))
    assert leader.ready(2, lambda w: True) == []
    assert len(reads) == MAX_READS_PER_STEP


def test_a_loss_round_leaves_out_an_outsiders_and_a_copied_entry(rdzv) -> None:
    """The survivors' round after a loss is a way into the group too: an outsider's entry
    (no proof) and a survivor's entry copied to a new number are left out; both survivors
    agree on a group of the two of them. A survivor without a credential is refused."""
    import threading

    from torch.distributed import PrefixStore

    from trainer.membership import SurvivorRound, settle_survivors

    endpoint = ("127.0.0.1", rdzv.port)
    store = PrefixStore("spotvisor/r/loss/a7", TCPStore("127.0.0.1", rdzv.port, is_master=False,
                                                        timeout=timedelta(seconds=30)))
    store.set(f"m/{int(store.add('count', 1))}", json.dumps({"rank": 1, "node": "intruder"}))
    out: dict[str, object] = {}
    rounds = {node: SurvivorRound(endpoint, "r", "a7", rank, 3, timeout_s=30) for node, rank in (("n1", 0), ("n3", 2))}
    for r in rounds.values():  # both said they are coming: n1's settle waits for n3 however slow its thread is
        r.coming()

    def survivor(node: str) -> None:
        out[node] = rounds[node].settle(settle_s=3.0, credential=_cred(node), node=node)

    first = threading.Thread(target=survivor, args=("n1",))
    first.start()
    store.wait(["m/2"])
    store.set(f"m/{int(store.add('count', 1))}", store.get("m/2"))  # n1's entry again, under a new number
    second = threading.Thread(target=survivor, args=("n3",))
    second.start()
    first.join()
    second.join()
    prefix = "spotvisor/r/loss/a7/group"
    assert out == {"n1": (0, 2, prefix), "n3": (1, 2, prefix)}
    with pytest.raises(JoinRefused, match="no join credential"):
        settle_survivors(endpoint, "r", "a8", 0, 2, settle_s=0.01, credential=None, node="n1", timeout_s=30)


def test_a_loss_round_waits_for_a_rank_that_answered_however_late_it_comes(rdzv) -> None:
    """Three ranks; rank 2 is lost (it never answers). Rank 1 answers the round (as its
    loss watch does when woken) but is still computing: it registers only after rank 0's
    settle window has ended. The round waits for it: both get the group of two, and
    nobody is turned away as late."""
    import threading

    from trainer.membership import SurvivorRound

    endpoint = ("127.0.0.1", rdzv.port)
    store = TCPStore("127.0.0.1", rdzv.port, is_master=False, timeout=timedelta(seconds=30))
    straggler = SurvivorRound(endpoint, "r", "a9", 1, 3, timeout_s=30)
    straggler.coming()
    out: dict[int, object] = {}
    first = threading.Thread(target=lambda: out.__setitem__(0, SurvivorRound(endpoint, "r", "a9", 0, 3, timeout_s=30)
                                                             .settle(settle_s=0.2, credential=_cred("n0"), node="n0")))
    first.start()
    store.wait(["spotvisor/r/loss/a9/expected"])  # rank 0's window is over: it saw who answered
    assert json.loads(store.get("spotvisor/r/loss/a9/expected")) == [0, 1]
    assert not store.check(["spotvisor/r/loss/a9/closed"])  # and it waits for rank 1
    out[1] = straggler.settle(settle_s=0.2, credential=_cred("n1"), node="n1")
    first.join()
    prefix = "spotvisor/r/loss/a9/group"
    assert out == {0: (0, 2, prefix), 1: (1, 2, prefix)}


def test_a_loss_round_closes_at_its_bound_without_a_rank_that_answered_and_died(rdzv) -> None:
    """Rank 1 answered the round and never came (lost in turn): the round closes
    ``timeout_s`` after the first arrival without it, and a late entry is turned away."""
    from trainer.membership import SurvivorRound

    endpoint = ("127.0.0.1", rdzv.port)
    dead = SurvivorRound(endpoint, "r", "a10", 1, 2, timeout_s=30)
    dead.coming()
    alone = SurvivorRound(endpoint, "r", "a10", 0, 2, timeout_s=1.0)
    assert alone.settle(settle_s=0.1, credential=_cred("n0"), node="n0") == (0, 1, "spotvisor/r/loss/a10/group")
    with pytest.raises(JoinTimeout, match="after it closed"):
        dead.settle(settle_s=0.1, credential=_cred("n1"), node="n1")


# -- the whole grow, in real worker processes --------------------------------------------------

# the grow tests' job (tests/trainers/elastic_job.py): rank 0 waits after step 5 until every
# expected ticket is queued (--joiners), and admits nobody before (a joiner forked from a
# zygote queues within a step or two), so a grow lands at step 5; node0 (rank 0, the
# committer) gets an interruption notice at step 8; the workers that finish write a digest
# of their model and AdamW state
GROW_AT_FIVE = ("--wait-joiners-at", "5", "--admit-from", "5", "--notice-at", "8", "--notice-node", "node0",
                "--digest-at-end")

G = 12


def _start(tmp_path: Path, name: str, env: dict[str, str], rdzv_port: int, ckpt: str, *,
           job: tuple[str, ...] = GROW_AT_FIVE, joiners: int = 1,
           extra: tuple[str, ...] = ("--join-timeout-s", "120", "--hold-timeout-s", "3"),
           fork: bool = True) -> subprocess.Popen:
    """One worker of node ``name`` as its launcher starts it (``env``: torchrun's variables),
    running the elastic test job with the flags ``job`` (``joiners``: the tickets rank 0 waits
    for; ``fork``: :func:`worker_procs.start_worker`'s)."""
    argv = [*job, "--joiners", str(joiners),
            "--checkpoint-uri", ckpt, "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
            "--target-steps", "12", "--checkpoint-interval", "0", "--global-batch-size", str(G),
            "--micro-batch-size", "2", "--pg-timeout-s", "60", *extra]
    return start_worker(tmp_path, name, env, rdzv_port, argv, run_id="grow", fork=fork)


def _assert_every_batch_once(tmp_path: Path, steps: int) -> None:
    """The step logs name the step completed: step s trained positions (s-1)*G .. s*G-1, once."""
    assert {s: sorted(p) for s, p in trained(tmp_path).items()} == {s: list(range((s - 1) * G, s * G))
                                                                    for s in range(1, steps + 1)}


def _assert_same_state(tmp_path: Path, finishers: int) -> None:
    """Every worker that finished wrote the same digest of its model and AdamW state."""
    digests = [f.read_text() for f in tmp_path.glob("final-*.json")]
    assert len(digests) == finishers and len(set(digests)) == 1, digests


@pytest.mark.slow
def test_a_new_node_joins_the_running_group_without_a_restart(tmp_path: Path, rdzv) -> None:
    """Two workers train (world 2); a third, started with SPOTVISOR_JOIN=1 as a new node's
    launcher starts it, joins at step 5. Then node0, rank 0 and the committer, gets a
    notice at step 8: the other two, one of them the joiner (whose own launcher has another
    torchrun run id), shrink in-process and finish. Nobody restarts. Every step's global
    batch is trained exactly once, and the two that finish end with the same model and
    optimizer state: the joiner got rank 0's."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = [_start(tmp_path, f"node{r}", member_env(r, 2, master, "grow"), rdzv.port, ckpt) for r in range(2)]
    # the new node boots while the job trains (its first steps are in the status file); its
    # launcher is its own (torchrun --standalone): RANK 0 of a world of 1
    wait_for_status(tmp_path, "node0", procs[0], '"event":"step"')
    procs.append(_start(tmp_path, "node2", joiner_env(), rdzv.port, ckpt))
    outs = finish(procs)
    # node0 left after its notice commit (no agent stops it here: it exits after its hold)
    assert [p.returncode for p in procs] == [1, 0, 0], "\n".join(outs)

    started = [(x["step"], x.get("resized"), x["world_size"]) for x in status_lines(tmp_path, "node1")
               if x["event"] == "started"]
    assert started == [(0, None, 2), (5, "in_process", 3), (8, "in_process", 2)], "\n".join(outs)  # one process
    started = [x for x in status_lines(tmp_path, "node2") if x["event"] == "started"]
    assert [(x["step"], x["resized"], x.get("joined"), x["rank"]) for x in started] == [
        (5, "in_process", 1, 2), (8, "in_process", None, 1)]
    assert [x["step"] for x in status_lines(tmp_path, "node2") if x["event"] == "completed"] == [12]

    _assert_every_batch_once(tmp_path, 12)
    _assert_same_state(tmp_path, 2)


# the grow at step 5 without the notice: the world goes 2 -> 3 and stays
OUTSIDER_JOB = ("--wait-joiners-at", "5", "--admit-from", "5", "--digest-at-end")


@pytest.mark.slow
def test_an_outsider_on_the_network_never_joins_and_a_node_with_a_credential_does(tmp_path: Path, rdzv) -> None:
    """Issue 25, item 11. Two workers train; node2, a node the daemon admitted (it has a
    credential), queues to join. An outsider who reaches the rendezvous store then queues
    three tickets: node2's ticket copied off the store (a replay), one with no credential
    (what any joiner wrote before credentials), and one with a credential from another key
    (forged). Rank 0 refuses all three (each gets ``refused: ...`` as its admission and one
    log line) and admits node2 only: the world goes 2 -> 3, never further, and the three
    that finish hold the same model and optimizer state."""
    from torch.distributed import PrefixStore

    from trainer.credential import Authority

    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = [_start(tmp_path, f"node{r}", member_env(r, 2, master, "grow"), rdzv.port, ckpt, job=OUTSIDER_JOB,
                    joiners=4) for r in range(2)]
    try:
        wait_for_status(tmp_path, "node0", procs[0], '"event":"step"')
        procs.append(_start(tmp_path, "node2", joiner_env(), rdzv.port, ckpt,
                            job=OUTSIDER_JOB, joiners=4))
        # the outsider: a plain store client on the private network, no credential of its own
        store = PrefixStore("spotvisor/grow/join", TCPStore("127.0.0.1", rdzv.port, is_master=False,
                                                            timeout=timedelta(seconds=120)))
        store.wait(["t/1"])
        genuine = store.get("t/1").decode()  # node2's ticket
        replay = int(store.add("tickets", 1))
        store.set(f"t/{replay}", genuine)
        bare = int(store.add("tickets", 1))
        store.set(f"t/{bare}", json.dumps({"node": "intruder", "local_rank": 0, "local_world": 1,
                                           "expires": time.time() + 300}))
        forged = NodeCredential(Authority.generate().issue(run="grow", node="intruder2", now=time.time()))
        n = int(store.add("tickets", 1))
        fields = {"node": "intruder2", "local_rank": 0, "local_world": 1, "expires": time.time() + 300}
        store.set(f"t/{n}", json.dumps({**fields, **forged.prove("ticket", {**fields, "run": "grow", "number": n})}))
        answers = []
        for ticket in (replay, bare, n):  # each answered: an admission, or a refusal
            store.wait([f"a/{ticket}"])
            answers.append(store.get(f"a/{ticket}").decode())
            assert answers[-1].startswith("refused: "), answers
        outs = finish(procs)
    finally:
        for p in procs:
            if p.poll() is None:  # the assertions' failure, not finish's
                p.kill()
                p.communicate()
    assert "signature" in answers[0] and "not signed by this job's daemon" in answers[2], answers
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outs)
    assert outs[0].count("refused join ticket") == 3, outs[0]
    for node in ("node0", "node1", "node2"):
        assert max(x["world_size"] for x in status_lines(tmp_path, node) if x["event"] == "started") == 3
    joined = [x for x in status_lines(tmp_path, "node2") if x["event"] == "started"]
    assert [(x["resized"], x.get("joined"), x["rank"], x["world_size"]) for x in joined] == [("in_process", 1, 2, 3)]
    _assert_every_batch_once(tmp_path, 12)
    _assert_same_state(tmp_path, 3)


# -- the daemon's side: the join launcher, admission, a failed joiner ---------------------------


def test_the_job_spec_gives_a_join_launcher_only_for_in_process_grows() -> None:
    from daemon.config import load_config
    from daemon.controlnode.jobspec import job_spec
    from daemon.model import Node

    config = load_config("configs/local.yaml")
    node = Node(id="n1", ordinal=1, provider="local", region="local", zone=None, instance_type="t", gpus=2,
                price_usd_h=0.0, token="x")
    spec = job_spec(config, node, "abc")
    join = spec["join"]
    # the node's own launcher: not in torchrun's rendezvous (the survivors' agents never see it)
    assert "--standalone" in join["argv"] and not any(a.startswith("--rdzv") for a in join["argv"])
    assert "--nproc-per-node=2" in join["argv"]
    assert join["argv"][join["argv"].index("-m", 2):] == spec["argv"][spec["argv"].index("-m", 2):]  # same trainer
    assert join["env"][JOIN_ENV] == "1" and JOIN_ENV not in spec["env"]
    assert join["env"][RUN_ID_ENV] == spec["env"][RUN_ID_ENV] == f"{config.job.id}-abc"  # one queue for both
    restart = config.model_copy(update={"job": config.job.model_copy(update={"grow": "restart"})})
    assert "join" not in job_spec(restart, node, "abc")


def test_a_joined_node_whose_trainer_fails_leaves_and_is_replaced() -> None:
    from daemon.control import actions as a
    from daemon.control.lifecycle import NodeState, TrainerState
    from daemon.control.reactions import on_trainer_exit

    view = a.NodeView(id="n3", state=NodeState.RUNNING, gpus=1, created_at=0.0, trainer=TrainerState.EXITED)
    assert on_trainer_exit(view, exit_code=1, joined_in_process=True) == [a.Leave("n3", "joined in-process, "
                                                                                 "trainer exited 1")]
    assert on_trainer_exit(view, exit_code=0, joined_in_process=True) == []  # the job's end
    assert on_trainer_exit(view, exit_code=1, joined_in_process=False) == []  # torchrun's restarts are torchrun's


def _pool(*nodes: tuple[str, str], attempt: str = "a7", world: int = 3, job: str = "running"):
    from daemon.control import actions as a
    from daemon.control.lifecycle import JobState, NodeState

    views = tuple(a.NodeView(id=n, state=NodeState.LOST, gpus=1, created_at=0.0, attempt=att) for n, att in nodes)
    return a.PoolState(nodes=views, job=JobState(job), attempt=attempt, world_size=world)


def test_a_node_lost_in_the_running_attempt_wakes_its_survivors() -> None:
    from daemon.control import actions as a
    from daemon.control.policies import Spotvisor
    from daemon.control.reactions import on_loss_without_notice

    s = _pool(("n1", "a7"), ("n2", "a6"), ("n3", ""))
    assert on_loss_without_notice(s, ["n1", "n2", "n3"]) == [a.WakeSurvivors("a7", 3, ("n1",))]
    assert Spotvisor().after_loss(s, ["n1"], now=0.0) == [a.WakeSurvivors("a7", 3, ("n1",))]  # the default policy's
    assert on_loss_without_notice(s, ["n2", "n3"]) == []  # left an earlier attempt; never reported one
    assert on_loss_without_notice(_pool(("n1", "a7"), job="pending"), ["n1"]) == []  # no job running
    assert on_loss_without_notice(_pool(("n1", "a7"), world=1), ["n1"]) == []  # nobody to wake


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n1", "n2", "n3", "n4"]), st.sampled_from(["", "a6", "a7"])),
                unique_by=lambda t: t[0]),
       st.sets(st.sampled_from(["n1", "n2", "n3", "n4", "n9"])))
def test_survivors_are_woken_exactly_when_a_lost_node_held_ranks_of_the_running_attempt(nodes, lost) -> None:
    from daemon.control.reactions import on_loss_without_notice

    out = on_loss_without_notice(_pool(*nodes), sorted(lost))
    held = sorted(n for n, att in nodes if n in lost and att == "a7")
    assert [(w.attempt, w.world_size, list(w.lost)) for w in out] == ([("a7", 3, held)] if held else [])


async def test_the_daemon_writes_the_wake_into_the_lost_nodes_rendezvous_store(spot_daemon, rdzv,
                                                                              monkeypatch) -> None:
    """``WakeSurvivors`` sets every rank's wake key of the attempt in the rendezvous store,
    under the run id, that the lost node's job spec gave its workers; a store out of reach
    is a log line, not a crash."""
    from daemon.control.actions import WakeSurvivors
    from daemon.model import Node

    h = spot_daemon
    config = h.sup.config
    h.sup.config = config.model_copy(update={"rendezvous": config.rendezvous.model_copy(update={"port": rdzv.port})})
    h.sup.nodes["n2"] = Node(id="n2", ordinal=2, provider="local", region="local", zone=None, instance_type="t",
                             gpus=1, price_usd_h=0.0, token="x")
    run = h.sup.job_spec(h.sup.nodes["n2"])["env"][RUN_ID_ENV]
    h.sup.act(WakeSurvivors("a7", 3, ("n2",)))
    keys = [f"spotvisor/{run}/loss/a7/wake/{r}" for r in range(3)]
    await asyncio.to_thread(rdzv.wait, keys, timedelta(seconds=30))  # the action's task writes them
    assert [rdzv.get(k) for k in keys] == [b"daemon: n2 lost"] * 3
    monkeypatch.setattr("daemon.controlnode.actuator.WAKE_TIMEOUT_S", 0.5)
    await h.sup.actuator.wake_survivors(WakeSurvivors("a8", 2, ("n2",)), ("127.0.0.1", free_port()), run)  # logged


# -- a peer lost without notice, in-process --------------------------------------------------

# node2's worker is killed (SIGKILL: no notice, no commit) as the others start step 7;
# node1 computes 0.3 s longer every step
LOSS_JOB = ("--kill-at", "6", "--kill-node", "node2", "--slow-node", "node1", "--slow-s", "0.3", "--digest-at-end")


@pytest.mark.slow
def test_a_peer_killed_without_notice_costs_no_step_and_no_restart(tmp_path: Path, rdzv) -> None:
    """Three workers; node2's is SIGKILLed at step 6, with periodic commits off. The two
    survivors' collective fails, they re-form the group in their own processes and train
    step 7 again at world 2: every step's global batch exactly once, no commit read back
    (there is none), the same model and optimizer on both at the end."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "loss"), rdzv.port, ckpt, job=LOSS_JOB)
             for r in range(3)]
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0, -9], "\n".join(outs)

    for node in ("node0", "node1"):
        started = [(x["step"], x.get("resized"), x["world_size"], x.get("lost_ranks")) for x in status_lines(tmp_path, node)
                   if x["event"] == "started"]
        assert started == [(0, None, 3, None), (6, "in_process", 2, 1)]  # the same processes throughout
    _assert_every_batch_once(tmp_path, 12)
    _assert_same_state(tmp_path, 2)


# periodic commits every 3 steps; a worker dies in the commit of step 6
IN_COMMIT_EXTRA = ("--join-timeout-s", "120", "--hold-timeout-s", "3", "--checkpoint-interval", "3",
                   "--keep-checkpoints", "1000")


def _commits(tmp_path: Path) -> dict[int, Manifest]:
    return {m.step: m for m in list_committed(FileStore(tmp_path / "ckpt"))}


@pytest.mark.slow
def test_a_peer_killed_entering_a_commit_costs_no_step_and_no_restart(tmp_path: Path, rdzv) -> None:
    """node2's worker is SIGKILLed as the commit of step 6 begins, the others inside its
    collectives. They re-form the group in their processes and commit step 6 at world 2
    (no manifest was written: there is nothing to reuse), then train on: every step's
    global batch exactly once, the same state on both."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    job = ("--kill-at", "6", "--kill-node", "node2", "--kill-in-commit", "entering", "--digest-at-end")
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "loss"), rdzv.port, ckpt, job=job,
                    extra=IN_COMMIT_EXTRA) for r in range(3)]
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0, -9], "\n".join(outs)
    for node in ("node0", "node1"):
        started = [(x["step"], x.get("resized"), x["world_size"]) for x in status_lines(tmp_path, node)
                   if x["event"] == "started"]
        assert started == [(0, None, 3), (6, "in_process", 2)]  # the same processes throughout
    commits = _commits(tmp_path)
    assert sorted(commits) == [3, 6, 9, 12] and commits[6].world_size == 2
    _assert_every_batch_once(tmp_path, 12)
    _assert_same_state(tmp_path, 2)


@pytest.mark.slow
def test_a_rank_0_killed_after_its_manifest_leaves_that_commit_as_it_was(tmp_path: Path, rdzv) -> None:
    """node0's worker, rank 0, writes the manifest of step 6 and is SIGKILLed before the
    others hear of it. The survivors re-form in process, find the manifest in the store
    and count step 6 as committed: they do not write its shards again under it (it stays
    the world-3 commit, every shard intact), and train on with no restart."""
    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    job = ("--kill-at", "6", "--kill-node", "node0", "--kill-in-commit", "after-manifest", "--digest-at-end")
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "loss"), rdzv.port, ckpt, job=job,
                    extra=IN_COMMIT_EXTRA) for r in range(3)]
    outs = finish(procs)
    assert [p.returncode for p in procs] == [-9, 0, 0], "\n".join(outs)
    for node in ("node1", "node2"):
        started = [(x["step"], x.get("resized"), x["world_size"]) for x in status_lines(tmp_path, node)
                   if x["event"] == "started"]
        assert started == [(0, None, 3), (6, "in_process", 2)]
    commits = _commits(tmp_path)
    assert sorted(commits) == [3, 6, 9, 12] and commits[6].world_size == 3  # rank 0's, kept
    store = FileStore(tmp_path / "ckpt")
    for shard in commits[6].shards:
        load_shard(store, commits[6], shard.name)  # size and sha256 as the manifest says
    assert "was committed before the lost peer's rank 0 could say so" in "\n".join(outs)
    _assert_every_batch_once(tmp_path, 12)
    _assert_same_state(tmp_path, 2)


# node2's worker stops dead at step 6 (SIGSTOP: its connections stay open and silent, as
# a powered-off instance's do: its peers' collective neither fails nor returns); node1
# straggles in that step only, computing 3 s longer than its earlier steps took
SILENT_JOB = ("--kill-at", "6", "--kill-node", "node2", "--kill-signal", "STOP", "--slow-node", "node1",
              "--slow-at", "6", "--slow-s", "3", "--digest-at-end")


@pytest.mark.slow
def test_the_daemon_wakes_the_survivors_of_a_silent_node(tmp_path: Path, rdzv) -> None:
    """Three workers, a collective timeout of 60 s; node2's worker goes silent at step 6 (SIGSTOP).
    The survivors block in their all-reduce on it. The daemon, which learns of the loss from
    the node's heartbeats or the provider, wakes every rank of the running attempt
    (:func:`trainer.membership.wake_survivors`, as the supervisor's ``WakeSurvivors`` action
    does): the two survivors re-form without node2 in their own processes at once, not
    after the 60 s timeout, and lose no step. node1 is still computing when it is woken
    and reaches the round 3 s after node0, 2 s after its 1 s settle window (no window
    sized on its earlier, fast steps covers it): it answered the round at once, so the
    round waits for it and it is a survivor, not a newcomer."""
    from trainer.membership import wake_survivors

    master, ckpt = free_port(), (tmp_path / "ckpt").as_uri()
    procs = [_start(tmp_path, f"node{r}", member_env(r, 3, master, "silent"), rdzv.port, ckpt, job=SILENT_JOB,
                    fork=False)  # a fresh interpreter: the test reads the worker's own state in /proc
             for r in range(3)]
    try:
        deadline = time.monotonic() + 120
        while Path(f"/proc/{procs[2].pid}/stat").read_text().split(")")[1].split()[0] != "T":
            assert procs[2].poll() is None, procs[2].communicate()[0]
            assert time.monotonic() < deadline, "node2 never stopped itself (SIGSTOP) within 120 s"
            time.sleep(0.05)  # a polling period under the deadline above
        stopped_at = time.time()
        running = [x for x in status_lines(tmp_path, "node0") if x["event"] == "started"][-1]
        wake_survivors(("127.0.0.1", rdzv.port), "grow", running["attempt"], running["world_size"], reason="daemon")
        outs = finish(procs[:2])
    finally:
        procs[2].kill()
        procs[2].communicate()
    assert [p.returncode for p in procs[:2]] == [0, 0], "\n".join(outs)
    for node in ("node0", "node1"):
        started = [x for x in status_lines(tmp_path, node) if x["event"] == "started"]
        assert [(x["step"], x.get("resized"), x["world_size"], x.get("lost_ranks")) for x in started] == [
            (0, None, 3, None), (6, "in_process", 2, 1)]
        assert started[-1]["time"] - stopped_at < 30, "the survivors waited for the collective timeout"
    _assert_every_batch_once(tmp_path, 12)
    _assert_same_state(tmp_path, 2)


def test_the_scaling_bench_refuses_an_unknown_size(capsys) -> None:
    from bench.resize_scaling import main

    assert main(["--sizes", "3m,7b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --sizes: unknown 7b (use 3m, 50m, 200m)"]


def test_a_worker_queued_twice_counts_once(rdzv) -> None:
    joiner, leader = _queue(rdzv), _queue(rdzv)
    joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    # its worker started again before it was admitted
    again = joiner.register("n3", 0, 1, wait_s=300, credential=_cred("n3"))
    assert [t.number for t in leader.ready(2, lambda w: True)] == [again.number]
