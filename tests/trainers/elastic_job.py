"""The elastic test job: the reference trainer (or the FSDP2 example) with scripted events
at given steps, for the in-process resize tests (tests/test_grow.py,
tests/test_elastic_data.py, tests/test_fsdp_resize.py, tests/test_shrink.py) and
``bench/resize_scaling.py``.

Run in real worker processes as ``python -m trainers.elastic_job [job flags] [trainer
flags]`` with ``tests/`` on ``PYTHONPATH`` (``worker_procs.start_worker`` starts it so);
the job flags below are read first, every other flag goes to the trainer's own parser
(``trainer.run`` or ``trainer.examples.fsdp_dcp``). It uses the public hooks of
:class:`trainer.loop.ElasticJob` (``train_step``, ``batch``, ``stage_state``,
``reshard``, ``close``, ``_joiners_waiting``) and writes what it records under ``$OUT``.

Example, the grow tests' job (test_grow.py): ``--wait-joiners-at 5 --admit-from 5
--notice-at 8 --notice-node node0 --digest-at-end``: rank 0 admits nobody before step 5
and waits after it until a joiner has queued its ticket, so the grow lands at step 5; node0 (rank 0, the committer) gets an
interruption notice after step 8, so the survivors shrink there; every worker that
reaches the target writes ``final-<pid>.json``, a digest of its model and AdamW state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer.loop import ElasticJob
from trainer.membership import JoinQueue, run_id
from trainer.runtime import exit_process, rendezvous_endpoint


def job_parser() -> argparse.ArgumentParser:
    """The scripted events' flags (a step is the step just trained; a node is ``$SPOTVISOR_NODE_ID``)."""
    p = argparse.ArgumentParser(prog="python -m trainers.elastic_job", allow_abbrev=False, add_help=False)
    p.add_argument("--job", choices=("reference", "dcp", "deepspeed"), default="reference",
                   help="reference: trainer.run.ReferenceJob; dcp: trainer.examples.fsdp_dcp.DcpJob; "
                        "deepspeed: trainer.examples.deepspeed_zero2.DeepSpeedJob")
    p.add_argument("--wait-joiners-at", type=int, default=None, metavar="STEP",
                   help="rank 0 (not a joiner) waits after STEP until --joiners tickets are queued")
    p.add_argument("--joiners", type=int, default=1, help="the tickets --wait-joiners-at waits for")
    p.add_argument("--admit-from", type=int, default=None, metavar="STEP",
                   help="see no joiner before STEP (a joiner boots faster than a model loads)")
    p.add_argument("--notice-at", type=int, default=None, metavar="STEP",
                   help="after STEP, --notice-node writes an interruption notice to its notice file")
    p.add_argument("--notice-node", default="node0")
    p.add_argument("--kill-at", type=int, default=None, metavar="STEP",
                   help="--kill-node sends itself --kill-signal before training the step after STEP (no notice)")
    p.add_argument("--kill-node", default="node2")
    p.add_argument("--kill-signal", choices=("KILL", "STOP"), default="KILL",
                   help="KILL: the worker is gone; STOP: it stops dead, its connections open and silent "
                        "(a powered-off instance's)")
    p.add_argument("--kill-in-forward", action="store_true",
                   help="--kill-node dies in the forward pass of the step after --kill-at, once its last "
                        "transformer block has run (the others are then inside that step's collectives)")
    p.add_argument("--kill-in-copy", action="store_true",
                   help="--kill-node dies after the optimizer step of the step after --kill-at, entering its "
                        "--replicate-shards copy (the others are then in that copy's exchange)")
    p.add_argument("--kill-again", default=None, metavar="NODE",
                   help="NODE dies in the forward pass of the first step it trains after the job lost a node "
                        "(at the smaller world, its shards copied again or not)")
    p.add_argument("--kill-mid-copy", action="store_true",
                   help="with --kill-in-copy (--job dcp): post the copy's receive from its predecessor, then die "
                        "at once, with the predecessor's send under way (its own buddy receives nothing)")
    p.add_argument("--kill-in-update", action="store_true",
                   help="(--job deepspeed) --kill-node dies inside ZeRO's optimizer step of the step after "
                        "--kill-at, right after its own partitions' update (the others are then in ZeRO's "
                        "all-gather of the new parameters, their partitions a step ahead of their engine)")
    p.add_argument("--kill-in-commit", choices=("entering", "after-manifest"), default=None,
                   help="--kill-node dies in the commit of step --kill-at instead: on entering it (the "
                        "others wait in its collectives), or (rank 0) right after it wrote the manifest, "
                        "before the others heard")
    p.add_argument("--slow-node", default=None, help="this node sleeps --slow-s before the step after --slow-at")
    p.add_argument("--slow-s", type=float, default=0.3)
    p.add_argument("--slow-at", type=int, default=None, metavar="STEP", help="only then (default: every step)")
    p.add_argument("--digest-at-end", action="store_true",
                   help="a worker that reaches the target writes $OUT/final-<pid>.json: its model and AdamW digest")
    p.add_argument("--record-samples", action="store_true",
                   help="append every sample read to $OUT/samples-<node>.jsonl ([position, input_ids, labels]); "
                        "a stream's examples tokenized so far to $OUT/examples-<node>")
    p.add_argument("--record-resizes", action="store_true",
                   help="rank 0 writes $OUT/before-<step>.txt and after-<step>.txt: the full state's sha256 "
                        "before stage_state and after reshard, and the world size")
    p.add_argument("--record-step", type=int, default=None, metavar="STEP",
                   help="rank 0 writes $OUT/step-<STEP>.txt after training STEP: the full state's sha256, "
                        "as --record-resizes does")
    p.add_argument("--data-kind", choices=("builtin", "map", "stream"), default="builtin",
                   help="map: --data as the user's own torch map-style Dataset of texts; stream: "
                        "trainer.data.load_data (--streaming); builtin: the trainer's default")
    return p


def write_notice(node: str) -> None:
    """An interruption notice in this worker's notice file, written as the agent writes it."""
    path = os.environ["SPOTVISOR_NOTICE_FILE"]
    with open(path + ".tmp", "w") as f:
        json.dump([{"id": "n" + node.removeprefix("node"), "kind": "interruption", "time": 0.0,
                    "deadline": None}], f)
    os.replace(path + ".tmp", path)


def deepspeed_state_digest(job: ElasticJob) -> str:
    """sha256 of the full state of a DeepSpeed ZeRO job (a collective: every rank calls it):
    the fp32 master copies, the optimizer's moments and step, the engine's counters (but
    ``micro_steps``), and the model's own parameters (what the forward pass reads)."""
    from trainer.integrations.deepspeed_resize import gather_full_state

    state = gather_full_state(job.engine, job.state.model)
    h = hashlib.sha256()
    for name in sorted(state["params"]):
        h.update(name.encode())
        h.update(state["params"][name].numpy().tobytes())
        for key, t in sorted(state["optim"][name].items()):
            h.update(key.encode())
            h.update(t.numpy().tobytes())
    # micro_steps is the world size's own (global_steps x its accumulation steps: set_scalars)
    counters = sorted((k, v) for k, v in state["counters"].items() if k != "micro_steps")
    h.update(repr((state["optim_step"], counters)).encode())
    import deepspeed

    params = list(job.state.model.parameters())
    # ZeRO-3 partitions the model's own parameters too: gathered whole for the hash
    with deepspeed.zero.GatheredParameters(params, enabled=job.engine.zero_optimization_stage() == 3):
        for p in params:
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def full_state_digest(job: ElasticJob) -> str:
    """sha256 of the full model and optimizer state of an FSDP2 job (a collective: every rank calls it)."""
    if hasattr(job, "engine"):
        return deepspeed_state_digest(job)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(job.ddp, options=opts)
    optim = get_optimizer_state_dict(job.ddp, job.state.optimizer, options=opts)
    h = hashlib.sha256()
    for k in sorted(model):
        h.update(k.encode())
        h.update(model[k].numpy().tobytes())
    for k in sorted(optim.get("state", {})):
        for name, t in sorted(optim["state"][k].items()):
            h.update(f"{k}.{name}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def scripted(base: type[ElasticJob], opts: argparse.Namespace) -> type[ElasticJob]:
    """``base`` with the events ``opts`` asks for."""
    node = os.environ.get("SPOTVISOR_NODE_ID", "")
    out_dir = os.environ.get("OUT", ".")

    class Scripted(base):  # type: ignore[valid-type,misc]
        first_world: int | None = None

        def train_step(self):
            self.first_world = self.first_world or self.ctx.world_size
            if opts.kill_again == node and self.ctx.world_size < self.first_world:
                self.state.model.transformer.h[-1].register_forward_hook(
                    lambda *_: os.kill(os.getpid(), signal.SIGKILL))
            if (opts.kill_at is not None and self.state.step == opts.kill_at and node == opts.kill_node
                    and opts.kill_in_commit is None):
                if opts.kill_in_forward:
                    self.state.model.transformer.h[-1].register_forward_hook(
                        lambda *_: os.kill(os.getpid(), getattr(signal, "SIG" + opts.kill_signal)))
                elif opts.kill_in_update:
                    base = self.engine.optimizer.optimizer  # ZeRO's torch optimizer over the partitions
                    update = base.step

                    def update_then_die(*args, **kwargs):
                        update(*args, **kwargs)
                        os.kill(os.getpid(), getattr(signal, "SIG" + opts.kill_signal))

                    base.step = update_then_die
                elif opts.kill_in_copy:  # FSDP2's shards, or DeepSpeed's partitions
                    copier = self.replicas if opts.job == "deepspeed" else self.shards

                    def die_in_copy():
                        if opts.kill_mid_copy:
                            from trainer.integrations.replicas import per_node

                            rank, world, held = self.ctx.rank, self.ctx.world_size, self.shards.replica.copy
                            frm = (rank - per_node()) % world
                            dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty_like(t), frm, tag=i)
                                                    for i, t in enumerate(held.tensors)])
                        os.kill(os.getpid(), getattr(signal, "SIG" + opts.kill_signal))

                    copier.after_step = die_in_copy
                else:
                    os.kill(os.getpid(), getattr(signal, "SIG" + opts.kill_signal))
            if node == opts.slow_node and opts.slow_at in (None, self.state.step):
                time.sleep(opts.slow_s)  # computes that much longer (a straggler)
            out = super().train_step()
            if (self.state.step == opts.wait_joiners_at and self.ctx.rank == 0 and not self.joined_in_process):
                q = JoinQueue(rendezvous_endpoint(), run_id())
                # the tickets themselves, not only their numbers: a joiner takes its number (add)
                # before it writes its ticket (set), and this boundary's check needs the ticket
                q.store.wait([f"t/{i}" for i in range(1, opts.joiners + 1)])
            if self.state.step == opts.notice_at and node == opts.notice_node:
                write_notice(node)
            if self.state.step == opts.record_step:
                self._record("step")
            return out

        def commit(self, *, reason, decision):
            if opts.kill_in_commit and self.state.step == opts.kill_at and node == opts.kill_node:
                if opts.kill_in_commit == "entering":
                    os.kill(os.getpid(), signal.SIGKILL)
                from trainer.integrations import common

                wrote = common.Committer._commit_manifest

                def then_die(committer, *args, **kwargs):
                    out = wrote(committer, *args, **kwargs)
                    os.kill(os.getpid(), signal.SIGKILL)  # the manifest is in the store; nobody heard
                    return out

                common.Committer._commit_manifest = then_die
            return super().commit(reason=reason, decision=decision)

        def _joiners_waiting(self):
            if opts.admit_from is not None and self.state.step < opts.admit_from:
                return 0
            return super()._joiners_waiting()

        def batch(self, positions):
            x, y = super().batch(positions)
            if opts.record_samples:
                with open(os.path.join(out_dir, "samples-%s.jsonl" % node), "a") as f:
                    for p, a, b in zip(positions, x.tolist(), y.tolist()):
                        f.write(json.dumps([p, a, b]) + "\n")
                if self.streaming:  # how many examples this worker has tokenized so far
                    with open(os.path.join(out_dir, "examples-%s" % node), "w") as f:
                        f.write(str(self.dataset.examples_read))
            return x, y

        def _record(self, when: str) -> None:
            d = full_state_digest(self)
            if self.ctx.rank == 0:
                with open(os.path.join(out_dir, "%s-%d.txt" % (when, self.state.step)), "w") as f:
                    f.write("%s world %d" % (d, self.ctx.world_size))

        def stage_state(self, keep):
            if opts.record_resizes:
                self._record("before")
            super().stage_state(keep)

        def reshard(self, *, from_commit):
            got = super().reshard(from_commit=from_commit)
            if opts.record_resizes:
                self._record("after")
            return got

        def close(self):
            super().close()
            if not opts.digest_at_end or self.state.step < self.args.target_steps:
                return  # a node that left
            opt = self.state.optimizer
            digest = [float(sum(p.double().sum() for p in self.state.model.parameters())),
                      float(sum(s["exp_avg_sq"].double().sum() for s in opt.state.values()))]
            with open(os.path.join(out_dir, "final-%s.json" % os.getpid()), "w") as f:
                f.write(repr(digest))

    return Scripted


class Docs(torch.utils.data.Dataset):
    """The user's own map-style dataset: one JSON document per line of ``path``."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]


def map_data(args: argparse.Namespace) -> Any:
    from trainer.data import MapSamples, load_tokenizer

    return MapSamples(Docs(args.data[0]), args.seq_len, load_tokenizer(args.tokenizer))


def main(argv: Sequence[str] | None = None) -> int:
    opts, rest = job_parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    if opts.job == "deepspeed":
        from trainer.examples import deepspeed_zero2

        return deepspeed_zero2.main(rest, job_cls=scripted(deepspeed_zero2.DeepSpeedJob, opts))
    if opts.job == "dcp":
        from trainer.examples import fsdp_dcp

        return fsdp_dcp.main(rest, job_cls=scripted(fsdp_dcp.DcpJob, opts))
    from trainer import run

    kw: dict[str, Callable[[argparse.Namespace], Any]] = {}
    if opts.data_kind == "map":
        kw["data"] = map_data
    elif opts.data_kind == "stream":
        from trainer.data import load_data

        kw["data"] = load_data  # --streaming --data: trainer.stream.JsonlStream
    return run.main(rest, job_cls=scripted(run.ReferenceJob, opts), **kw)


if __name__ == "__main__":
    exit_process(main())
