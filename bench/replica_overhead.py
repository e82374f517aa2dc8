"""What copying each rank's FSDP2 shards (or DeepSpeed ZeRO partitions) to another node
after every step costs in steady state.

``python -m bench.replica_overhead [--job dcp|deepspeed] [--sizes 200m] [--every 1,2] [--steps 10] [--json OUT]``

For each size of the reference GPT-2 (``bench.resize_scaling.SIZES``), two worker
processes, one per "node", train ``trainer.examples.fsdp_dcp`` (FSDP2; ``--job
deepspeed``: ``trainer.examples.deepspeed_zero2``, ZeRO-2) on gloo and the CPU, the
job's rendezvous store on 127.0.0.1: without ``--replicate-shards``, then with it at each
``--replicate-every`` of ``--every``. Measured from rank 0's step log: the mean seconds
between consecutive steps after the first two (set-up and the first copy's buffers
excluded; the mean, since with copies every N steps every Nth step is the slower one), and the overhead ``with / without - 1``; and the bytes each rank copies per
copy (its shards: every parameter's rows and AdamW's moments). Prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.ports import free_port
from bench.resize_scaling import SIZES, TESTS, _steps, pick


def run(name: str, workdir: Path, *, every: int, steps: int, job: str = "dcp") -> dict[str, Any]:
    """Two workers train ``steps`` steps, copying every ``every`` steps (0: no copies);
    returns rank 0's mean step seconds."""
    from torch.distributed import TCPStore

    n_layer, n_embd, n_head = SIZES[name]
    rdzv = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    master, ckpt = free_port(), (workdir / "ckpt").as_uri()
    argv = ["--job", job, "--checkpoint-uri", ckpt, "--n-layer", str(n_layer), "--n-embd", str(n_embd),
            "--n-head", str(n_head), "--seq-len", "16", "--target-steps", str(steps), "--checkpoint-interval", "0",
            "--global-batch-size", "6", "--micro-batch-size", "1", "--pg-timeout-s", "300",
            *(["--wrap", "fsdp"] if job == "dcp" else []),
            *(["--replicate-shards", "--replicate-every", str(every)] if every else [])]
    procs = []
    for r in range(2):
        d = workdir / f"node{r}"
        d.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "GROUP_RANK": str(r), "MASTER_PORT": str(master),
               "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
               "SPOTVISOR_RUN_ID": f"overhead-{name}", "SPOTVISOR_NODE_ID": f"node{r}",
               "SPOTVISOR_SCRATCH_DIR": str(d / "scratch"), "SPOTVISOR_STATUS_FILE": str(d / "status.jsonl"),
               "SPOTVISOR_LOG_DIR": str(d / "logs"), "SPOTVISOR_NOTICE_FILE": str(d / "notices.json"),
               "SPOTVISOR_RDZV_ENDPOINT": f"127.0.0.1:{rdzv.port}",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
        procs.append(subprocess.Popen([sys.executable, "-m", "trainers.elastic_job", *argv], env=env, cwd=workdir,
                                      stdout=open(d / "out.log", "w"), stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=3600) for p in procs]
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: workers exited {codes}; see {workdir}/node*/out.log")
    times = sorted(r["time"] for r in _steps(workdir / "node0"))
    gaps = [b - a for a, b in zip(times[2:], times[3:])]
    # the mean, not the median: copying every N steps makes every Nth step slower
    return {"step_s": statistics.fmean(gaps), "steps_timed": len(gaps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=("dcp", "deepspeed"), default="dcp",
                   help="FSDP2 (dcp, the default) or DeepSpeed ZeRO-2 (deepspeed)")
    p.add_argument("--sizes", default="200m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--every", default="1,2", help="comma-separated --replicate-every values to run")
    p.add_argument("--steps", type=int, default=10, help="steps per run (the first two are not timed)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    try:
        sizes = pick("--sizes", args.sizes, SIZES)
        items = [e.strip() for e in args.every.split(",") if e.strip()]
        everies = [int(e) for e in items if e.isdigit()]
        if not everies or len(everies) != len(items) or min(everies) < 1:
            raise ValueError(f"--every: {args.every!r} is not a list of positive integers (e.g. 1,2)")
        if args.steps < 5:
            raise ValueError(f"--steps: {args.steps} leaves too few steps to time (use 5 or more)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="spotvisor-overhead-") as tmp:
        for s in sizes:
            n_layer, n_embd, _ = SIZES[s]
            row: dict[str, Any] = {"size": s}
            for every in (0, *everies):
                print(f"{s} {'--replicate-every ' + str(every) if every else 'no copies'}: running ...", flush=True)
                t0 = time.perf_counter()
                got = run(s, Path(tmp) / f"{s}-{every}", every=every, steps=args.steps, job=args.job)
                row[f"every_{every}"] = {**got, "wall_s": round(time.perf_counter() - t0, 1)}
            # each rank's shards: half of every parameter's rows, and AdamW's two moments of them
            import torch

            from trainer.run import build_parser, build_state

            model_args = build_parser().parse_args(["--n-layer", str(n_layer), "--n-embd", str(n_embd), "--n-head",
                                                    str(SIZES[s][2]), "--seq-len", "16", "--data", __file__,
                                                    "--checkpoint-uri", "file:///unused", "--target-steps", "1"])
            model_args.vocab_size = 256
            params = sum(p.numel() for p in build_state(model_args, torch.device("meta")).model.parameters())
            row.update(params=params, copied_bytes=params * 4 * 3 // 2)
            for every in everies:
                x = row[f"every_{every}"]
                x["overhead"] = round(x["step_s"] / row["every_0"]["step_s"] - 1, 4)
            rows.append(row)
    print("\n| params | copies | step | overhead | copied per rank per copy |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['params'] / 1e6:.1f} M | none | {r['every_0']['step_s']:.3f} s | | |")
        for every in everies:
            x = r[f"every_{every}"]
            print(f"| {r['params'] / 1e6:.1f} M | every {every} | {x['step_s']:.3f} s | {100 * x['overhead']:+.1f} % "
                  f"| {r['copied_bytes'] / 1e6:,.0f} MB |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
