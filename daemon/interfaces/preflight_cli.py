"""The pre-flight as text: the tables ``spotvisord check-config`` prints, and the
``spotvisord preflight`` command that answers "which GPU holds my model, and can a
checkpoint get out inside the notice?" (estimates: :mod:`daemon.controlnode.preflight`).

    spotvisord preflight --preset llama-7b --zero-stage 3 --nodes 8 32 --gpus-per-node 8
    spotvisord preflight --config configs/aws.yaml            # the config's offers and pool
    spotvisord preflight --params 7e9 --hidden-size 4096 --num-layers 32 --num-heads 32

Exit codes: 0 answered, 2 bad input (one line naming the flag or field) or, with a
config, no offer that can hold the job.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from pydantic import ValidationError

from daemon.catalog import PRESETS, UnknownGpuError, gpu_memory_gib
from daemon.controlnode import preflight as pf
from daemon.config import (Config, ConfigError, ModelSpec, format_problems, load_config,
                           new_job_deadline_problem)
from daemon.gpunode.metadata.registry import DOCUMENTED_LEAD_S

__all__ = ["memory_lines", "deadline_lines", "check_config_report", "add_parser", "run"]

DEFAULT_GPUS = ["T4", "A10G", "L40S", "A100-40GB", "A100-80GB", "H100", "H200"]
_MODEL_FLAGS = ("preset", "params", "hidden_size", "num_layers", "num_heads", "vocab_size", "seq_len",
                "precision", "optimizer", "zero_stage", "lora_rank", "trainable_fraction")


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def memory_lines(fits: list[pf.OfferFit]) -> list[str]:
    """The per-offer memory table: GiB available, needed at the smallest and largest
    valid world size, verdict."""
    rows = [("offer", "GPU", "GiB", "need@smallest", "need@largest", "verdict")]
    for f in fits:
        def need(e: pf.MemoryEstimate | None) -> str:
            return "-" if e is None else f"{e.total_gib:.1f} (w={e.world_size})"
        verdict = ("no valid world size" if f.smallest is None else
                   "ok" if f.usable and f.available_gib is not None else
                   "ok (no GPU limit)" if f.usable else "UNUSABLE: does not fit")
        avail = "-" if f.available_gib is None else f"{f.available_gib:g}"
        rows.append((f.label, f.gpu_type, avail, need(f.smallest), need(f.largest), verdict))
    return _table(rows, right={2})


def deadline_lines(checks: list[pf.DeadlineCheck]) -> list[str]:
    rows = [("provider", "window_s", "world", "nodes", "bytes/node", "save_s", "upload_s", "flush_s", "verdict")]
    for c in checks:
        f = c.flush
        rows.append((c.provider, f"{c.window_s:g}", str(c.world_size or "-"), str(c.nodes or "-"),
                     _gb(f.bytes_per_node), f"{f.save_s:.1f}", f"{f.upload_s:.1f}", f"{f.flush_s:.1f}", c.verdict))
    return _table(rows, right={1, 2, 3, 4, 5, 6, 7})


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def spending_line(config: Config) -> str:
    """``deadline: spent by P (why)``: the policy a job with ``job.deadline`` runs, and why
    that one (:func:`daemon.control.policies.deadline_policy`)."""
    from daemon.control.policies import deadline_policy

    name, why = deadline_policy(config.job.deadline_policy, target_nodes=config.pool.target_nodes,
                                grow=config.job.grow)
    return f"deadline: spent by {name} ({why})"


def check_config_report(config: Config) -> tuple[list[str], str | None]:
    """Lines for stdout, and the one problem line (exit 2) when no offer can hold the job."""
    late = new_job_deadline_problem(config, time.time())
    head = [] if late is None else [f"deadline: a new job is refused: {late} (one under way runs on, late)"]
    if config.job.deadline is not None:
        head.append(spending_line(config))
    head += [f"feed: notify.{i} ({sink.name}): its Slack webhook URL is written in this file, and whoever reads "
             "the file can post to the channel; keep it out with url_env (the name of a variable holding it)"
             for i, sink in enumerate(config.notify) if sink.type == "slack" and sink.url is not None]
    if config.job.model is None:
        return [*head, "pre-flight: skipped (no job.model section; add one to check GPU memory and flush time)"], None
    job = config.job
    setup = pf.resolve(job.model)
    fits = pf.offer_fits(config)
    unusable = frozenset(f.index for f in fits if not f.usable)
    out = [f"memory per GPU (GiB), {setup.describe()}, micro batch {job.micro_batch_size}:", *memory_lines(fits)]
    checks = pf.estimated_deadline_checks(config, unusable)
    if checks:
        out += [f"checkpoint flush on the busiest node (upload {_gb(job.upload_throughput_bytes_s)}/s, save "
                f"{_gb(job.save_throughput_bytes_s)}/s; at risk below {job.flush_safety_factor:g}x):",
                *deadline_lines(checks)]
        if any(c.at_risk for c in checks):
            out.append(f"  at risk: {pf.REMEDY}")
    else:
        out.append("checkpoint flush: no notice window to compare (a local pool without chaos notices)")
    return [*head, *out], pf.no_fit_message(fits)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("preflight", help="which GPUs hold the model, and can a checkpoint beat the notice?")
    p.add_argument("--config", help="a config: its job.model, pool and offers (flags below override the model)")
    m = p.add_argument_group("model (job.model)")
    m.add_argument("--preset", help=f"one of {', '.join(PRESETS)}")
    m.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    m.add_argument("--hidden-size", type=int)
    m.add_argument("--num-layers", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--seq-len", type=int)
    m.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    m.add_argument("--optimizer", choices=["adamw", "sgd-momentum", "adafactor"])
    m.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3])
    m.add_argument("--lora-rank", type=int)
    m.add_argument("--trainable-fraction", type=float)
    m.add_argument("--activation-checkpointing", action="store_true", default=None)
    m.add_argument("--micro-batch-size", type=int, help="default: the config's, else 1")
    w = p.add_argument_group("world and store")
    w.add_argument("--nodes", type=int, nargs="+", help="node counts to compare, e.g. 8 32")
    w.add_argument("--gpus-per-node", type=int, default=8)
    w.add_argument("--gpu", action="append", help=f"GPU types to compare (default {' '.join(DEFAULT_GPUS)})")
    w.add_argument("--throughput-gbs", type=float, help="upload GB/s (1e9 bytes/s) per node (default 1.0)")
    w.add_argument("--save-gbs", type=float, help="local save GB/s per node (default 2.0)")
    w.add_argument("--safety-factor", type=float, help="window / flush below this is at risk (default 2.0)")


def run(args: argparse.Namespace, out: Callable[[str], None] = print,
        err: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> int:
    """``spotvisord preflight``. Returns the exit code."""
    config: Config | None = None
    if args.config:
        try:
            config = load_config(args.config)
        except ConfigError as exc:
            for line in exc.problems:
                err(line if line.startswith(f"{args.config}:") else f"{args.config}: {line}")
            return 2
    fields: dict[str, Any] = {}
    if config is not None and config.job.model is not None:
        fields = config.job.model.model_dump(exclude_unset=True)
    given = {k: getattr(args, k) for k in (*_MODEL_FLAGS, "activation_checkpointing") if getattr(args, k) is not None}
    if "preset" in given and "params" not in given:
        fields.pop("params", None)
    fields.update(given)
    if not fields:
        err("spotvisord preflight: no model (give --preset NAME, or --params N with --hidden-size, --num-layers, "
            "--num-heads, or --config FILE with a job.model section)")
        return 2
    for name, value in (("--nodes", args.nodes or [1]), ("--gpus-per-node", [args.gpus_per_node]),
                        ("--micro-batch-size", [args.micro_batch_size or 1])):
        if min(value) < 1:
            err(f"spotvisord preflight: {name} must be >= 1 (got {min(value)})")
            return 2
    try:
        spec = ModelSpec.model_validate(fields)
    except ValidationError as exc:
        for line in format_problems(exc):
            err(f"spotvisord preflight: {line}")
        return 2
    job = config.job if config is not None else None
    # a flag given as 0 is that value (refused below), not "not given"
    upload = args.throughput_gbs * 1e9 if args.throughput_gbs is not None else (
        job.upload_throughput_bytes_s if job else 1e9)
    save = args.save_gbs * 1e9 if args.save_gbs is not None else (job.save_throughput_bytes_s if job else 2e9)
    safety = args.safety_factor if args.safety_factor is not None else (job.flush_safety_factor if job else 2.0)
    if min(upload, save, safety) <= 0:
        err("spotvisord preflight: --throughput-gbs, --save-gbs and --safety-factor must be > 0")
        return 2
    micro = args.micro_batch_size or (job.micro_batch_size if job else 1)
    if config is not None and not args.nodes:
        assert job is not None
        job = job.model_copy(update={"model": spec, "upload_throughput_bytes_s": upload,
                                     "save_throughput_bytes_s": save, "flush_safety_factor": safety,
                                     "micro_batch_size": micro})
        lines, problem = check_config_report(config.model_copy(update={"job": job}))
        for line in lines:
            out(line)
        if problem:
            err(f"{args.config}: {problem}")
            return 2
        return 0
    try:
        gpus = [(g, gpu_memory_gib(g)) for g in (args.gpu or DEFAULT_GPUS)]
    except UnknownGpuError as exc:
        err(f"spotvisord preflight: --gpu: {exc}")
        return 2
    _scenarios(pf.resolve(spec), nodes=args.nodes or [1], gpus_per_node=args.gpus_per_node, micro=micro,
               gpus=gpus, upload=upload, save=save, safety=safety, out=out)
    return 0


def _gpu_header(gpu: str, gib: float | None) -> str:
    if gib is None:
        return f"{gpu} (no GPU)"
    return gpu if gpu.upper().endswith((f"{gib:g}G", f"{gib:g}GB", f"{gib:g}GIB")) else f"{gpu} {gib:g}G"


def _scenarios(setup: pf.Setup, *, nodes: list[int], gpus_per_node: int, micro: int,
               gpus: list[tuple[str, float | None]], upload: float, save: float, safety: float,
               out: Callable[[str], None]) -> None:
    out(f"model: {setup.describe()}, micro batch {micro}")
    out(f"memory per GPU (GiB; needed = (params + grads + optimizer + activations + buffers) x "
        f"{1 + setup.fragmentation:g} + {setup.cuda_overhead_gib:g}):")
    rows = [("nodes", "gpus/node", "world", "params", "grads", "optim", "activ", "buffers", "needed",
             *(_gpu_header(g, gib) for g, gib in gpus))]
    for n in nodes:
        e = pf.estimate_memory(setup, world_size=n * gpus_per_node, micro_batch_size=micro)
        parts = (e.params_bytes, e.grads_bytes, e.optimizer_bytes, e.activations_bytes, e.buffers_bytes)
        rows.append((str(n), str(gpus_per_node), str(e.world_size), *(f"{x / pf.GIB:.2f}" for x in parts),
                     f"{e.total_gib:.1f}", *("fits" if e.fits(gib) else "no" for _, gib in gpus)))
    for line in _table(rows, right=set(range(9))):
        out(line)
    windows = dict(sorted(DOCUMENTED_LEAD_S.items(), key=lambda kv: -kv[1]))
    out(f"checkpoint flush on the busiest node (upload {_gb(upload)}/s, save {_gb(save)}/s per node; "
        f"at risk below {safety:g}x the notice window):")
    rows = [("nodes", "world", "bytes/node", "save_s", "upload_s", "flush_s",
             *(f"{p} {w:g}s" for p, w in windows.items()))]
    risky = False
    for n in nodes:
        world = n * gpus_per_node
        nbytes = pf.checkpoint_bytes_per_node(setup, world_size=world, gpus_per_node=gpus_per_node)
        f = pf.estimate_flush(nbytes, upload_bytes_s=upload, save_bytes_s=save)
        checks = [pf.check_deadline(f, provider=p, window_s=w, safety_factor=safety) for p, w in windows.items()]
        risky = risky or any(c.at_risk for c in checks)
        rows.append((str(n), str(world), f"{_gb(nbytes)} ({nbytes:.3g} B)", f"{f.save_s:.1f}", f"{f.upload_s:.1f}",
                     f"{f.flush_s:.1f}", *(c.verdict for c in checks)))
    for line in _table(rows, right={0, 1, 2, 3, 4, 5}):
        out(line)
    if risky:
        out(f"  at risk: {pf.REMEDY}")
