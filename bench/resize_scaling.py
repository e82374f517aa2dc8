"""How an in-process resize grows with the model, beside the checkpoint-reload path.

``python -m bench.resize_scaling [--sizes 3m,50m,200m] [--wraps ddp,fsdp,deepspeed] [--json OUT]``

For each size of the reference trainer's GPT-2 (byte-level; ``ddp``: ``trainer.run``,
replicated; ``fsdp``: ``trainer.examples.fsdp_dcp``, FSDP2 shards and DCP commits) it runs
real worker processes on this machine, as torchrun starts them (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, one worker per "node", gloo on CPU), with the job's
rendezvous store on 127.0.0.1:

1. two workers train; a third is started with ``SPOTVISOR_JOIN=1`` (a new node's own
   launcher) and joins at step 2: the **grow**. Measured: the survivors' pause (rank 0's
   last step before the grow to the grown attempt's ``started`` line: the new group, the
   model, AdamW state and progress sent to the joiner tensor by tensor, the DDP re-wrap;
   FSDP2: the model rebuilt on the meta device, sharded at 3 and filled peer to peer,
   the joiner placed between the old ranks; DeepSpeed: a new engine, filled peer to
   peer), and the joiner's own time from its admission to its ``started`` line;
2. at step 4 the joiner's node gets an interruption notice: every rank commits, the
   joiner leaves and the two survivors re-form their group: the **shrink** (its
   ``resize_s``, plus the sharded jobs' exchange before the commit, ``stage_s``; the notice commit
   is its own column);
3. the **reload path**, what a restart pays for the state alone: the commit just made
   (save and upload, from its status line) and loading it back into a fresh model and
   optimizer, measured here in one process (DDP: read the shard, deserialize,
   ``load_state_dict``; FSDP2: fetch the DCP files, ``dcp.load``, ``set_state_dict``).
   A torchrun restart adds process start, imports and group set-up on top
   (``make bench``: ``restarts`` and ``grow_hold_s``).

Prints a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.ports import free_port
from trainer.contract import JOIN_CREDENTIAL_ENV
from trainer.credential import Authority

# name -> (n_layer, n_embd, n_head): GPT-2 blocks hold ~12 * n_layer * n_embd^2 parameters
SIZES = {"3m": (4, 256, 4), "50m": (8, 720, 12), "200m": (16, 1024, 16)}

#: --wraps choice -> (the job tests/trainers/elastic_job.py runs, extra trainer flags)
WRAPS = {"ddp": ("reference", ()), "fsdp": ("dcp", ("--wrap", "fsdp")), "deepspeed": ("deepspeed", ())}

#: the elastic test job (``python -m trainers.elastic_job``, ``tests/`` on PYTHONPATH): rank 0
#: waits after step 2 for the joiner's ticket, so the grow lands at step 2; the joiner's node
#: (node2) gets an interruption notice after step 4
TESTS = Path(__file__).resolve().parents[1] / "tests"
JOB_FLAGS = ("--wait-joiners-at", "2", "--notice-at", "4", "--notice-node", "node2")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _steps(node: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for log in (node / "logs").glob("steps-*.jsonl"):
        out += _lines(log)
    return out


def run_size(name: str, workdir: Path, wrap: str = "ddp") -> dict[str, Any]:
    """One size and trainer: the grow, the shrink and the reload path (module docstring). Seconds, bytes."""
    from torch.distributed import TCPStore

    n_layer, n_embd, n_head = SIZES[name]
    job, flags = WRAPS[wrap]
    rdzv = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300))
    master, ckpt = free_port(), (workdir / "ckpt").as_uri()
    argv = ["--checkpoint-uri", ckpt, "--n-layer", str(n_layer), "--n-embd", str(n_embd), "--n-head", str(n_head),
            "--seq-len", "16", "--target-steps", "6", "--checkpoint-interval", "0", "--global-batch-size", "6",
            "--micro-batch-size", "1", "--pg-timeout-s", "300", "--join-timeout-s", "600", "--hold-timeout-s", "5",
            *flags]

    authority = Authority.generate()  # the daemon's join key, as it gives each node a credential

    def start(node: str, env: dict[str, str]) -> subprocess.Popen:
        d = workdir / node
        d.mkdir(parents=True, exist_ok=True)
        cred = authority.issue(run=f"scale-{name}", node=node, now=time.time())
        full = {**os.environ, **env, "OMP_NUM_THREADS": "1", "SPOTVISOR_RUN_ID": f"scale-{name}",
                JOIN_CREDENTIAL_ENV: cred,
                "SPOTVISOR_NODE_ID": node, "SPOTVISOR_SCRATCH_DIR": str(d / "scratch"), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "SPOTVISOR_NOTICE_FILE": str(d / "notices.json"), "SPOTVISOR_STATUS_FILE": str(d / "status.jsonl"),
                "SPOTVISOR_LOG_DIR": str(d / "logs"), "SPOTVISOR_RDZV_ENDPOINT": f"127.0.0.1:{rdzv.port}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
        return subprocess.Popen([sys.executable, "-m", "trainers.elastic_job", "--job", job, *JOB_FLAGS, *argv],
                                env=full, cwd=workdir,
                                stdout=open(d / "out.log", "w"), stderr=subprocess.STDOUT)

    procs = [start(f"node{r}", {"RANK": str(r), "WORLD_SIZE": "2", "GROUP_RANK": str(r),
                                "MASTER_PORT": str(master)}) for r in range(2)]
    status0 = workdir / "node0" / "status.jsonl"
    while not any(x["event"] == "step" for x in _lines(status0)):  # the job trains: the new node boots
        if procs[0].poll() is not None:
            raise RuntimeError(f"{name}: node0 exited {procs[0].returncode}; see {workdir}/node0/out.log")
        time.sleep(0.1)
    procs.append(start("node2", {"RANK": "0", "WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_PORT": str(free_port()),
                                 "SPOTVISOR_JOIN": "1"}))
    codes = [p.wait(timeout=3600) for p in procs]
    if codes[:2] != [0, 0]:
        raise RuntimeError(f"{name}: workers exited {codes}; see {workdir}/node*/out.log")

    s0 = _lines(status0)
    started = [x for x in s0 if x["event"] == "started"]
    grown = next(x for x in started if x.get("joined"))
    shrunk = next(x for x in started if x.get("resized") == "in_process" and not x.get("joined"))
    last_before = max(r["time"] for r in _steps(workdir / "node0") if r["time"] < grown["time"])
    joiner = next(x for x in _lines(workdir / "node2" / "status.jsonl") if x["event"] == "started")
    commit = next(x for x in s0 if x["event"] == "checkpoint_committed" and x.get("reason") == "notice")
    load = {"fsdp": _load_dcp_time, "deepspeed": _load_deepspeed_time}.get(wrap, _load_time)
    load_s, params = load(argv, ckpt, workdir)
    return {"size": name, "wrap": wrap, "params": params, "state_bytes": commit["bytes"],
            "grow_pause_s": round(grown["time"] - last_before, 3), "grow_resize_s": grown["resize_s"],
            "joiner_resize_s": joiner["resize_s"], "shrink_resize_s": shrunk["resize_s"],
            "shrink_stage_s": shrunk.get("stage_s", 0.0), "commit_s": commit["seconds"], "load_s": round(load_s, 3),
            **_traffic(workdir)}


def _traffic(workdir: Path) -> dict[str, Any]:
    """What each rank's resize ``started`` lines say it moved and held (a peer-to-peer reshard's
    figures; empty for a job without them): the largest bytes any one rank sent or received
    in the grow and in the shrink (the leaving rank's sends are what the survivors received
    beyond what they sent each other), rank 0's own, and the largest peak extra memory over
    that rank's new shard."""
    def first(node: str, grow: bool) -> dict[str, Any] | None:
        return next((x for x in _lines(workdir / node / "status.jsonl") if x["event"] == "started"
                     and x.get("resized") == "in_process" and bool(x.get("joined")) == grow), None)

    grow = [x for x in (first(n, True) for n in ("node0", "node1", "node2")) if x]
    shrink = [x for x in (first(n, False) for n in ("node0", "node1")) if x]
    if not all("reshard_received_bytes" in x for x in grow + shrink):
        return {}
    def most(lines: list[dict[str, Any]]) -> int:
        return max(max(x["reshard_sent_bytes"], x["reshard_received_bytes"]) for x in lines)

    leaver_sent = sum(x["reshard_received_bytes"] for x in shrink) - sum(x["reshard_sent_bytes"] for x in shrink)
    memory = [x["peak_extra_bytes"] / x["shard_bytes"] for x in grow + shrink
              if x.get("peak_extra_bytes") is not None and x.get("shard_bytes")]
    return {"grow_max_bytes": most(grow), "shrink_max_bytes": max(most(shrink), leaver_sent),
            "rank0_grow_bytes": grow[0]["reshard_sent_bytes"] + grow[0]["reshard_received_bytes"],
            "rank0_shrink_bytes": shrink[0]["reshard_sent_bytes"] + shrink[0]["reshard_received_bytes"],
            "peak_extra_over_shard": round(max(memory), 2) if memory else None}


def send_seconds(rank: int, nbytes: int) -> float:
    """The best of three: seconds one gloo send of ``nbytes`` takes from rank 0 to rank 1
    of the default group, barrier to barrier. Collective: every rank of the group calls
    it (the others only wait at its barriers)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4 if rank == 1 else 0)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return min(times)


def _link_worker(rank: int, tmp: str, nbytes: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/link-store", rank=rank, world_size=2)
    seconds = send_seconds(rank, nbytes)
    if rank == 1:
        Path(out).write_text(json.dumps(seconds))
    dist.destroy_process_group()


def link_rate(nbytes: int = 256 << 20) -> float:
    """Bytes per second one gloo send moves from one worker process to another on this
    machine (the best of three of ``nbytes``): the link every resize here runs over."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="spotvisor-link-") as tmp:
        out = os.path.join(tmp, "seconds.json")
        mp.start_processes(_link_worker, args=(tmp, nbytes, out), nprocs=2, start_method="spawn")
        return nbytes / json.loads(Path(out).read_text())


def _load_time(argv: list[str], ckpt: str, workdir: Path) -> tuple[float, int]:
    """Seconds to load the newest commit into a fresh model and optimizer, and the parameter count."""
    import torch

    from trainer.checkpoint import latest_committed, load_shard, open_store
    from trainer.run import MODEL_SHARD, build_parser, build_state, load_state

    args = build_parser().parse_args([*argv, "--data", str(Path(__file__))])
    state = build_state(args, torch.device("cpu"))
    store = open_store(ckpt)
    t0 = time.perf_counter()
    manifest = latest_committed(store)
    assert manifest is not None
    load_state(state, load_shard(store, manifest, MODEL_SHARD), torch.device("cpu"))
    return time.perf_counter() - t0, sum(p.numel() for p in state.model.parameters())


def _load_dcp_time(argv: list[str], ckpt: str, workdir: Path) -> tuple[float, int]:
    """Seconds to fetch the newest DCP commit and load it into a fresh model and optimizer
    (one process, no group: DCP without collectives), and the parameter count."""
    import torch

    from trainer.checkpoint import open_store
    from trainer.examples.fsdp_dcp import build_parser
    from trainer.guard import PreemptionGuard
    from trainer.integrations.dcp import DcpCheckpointer
    from trainer.run import build_state
    from trainer.runtime import DistContext, StatusWriter

    args = build_parser().parse_args([*argv, "--data", str(Path(__file__))])
    state = build_state(args, torch.device("cpu"))
    ctx = DistContext(0, 0, 1, None, torch.device("cpu"), False)
    ckpt_io = DcpCheckpointer(ctx, open_store(ckpt), state.model, state.optimizer, scratch=workdir / "reload",
                              status=StatusWriter(None, ctx, "reload"), guard=PreemptionGuard())
    t0 = time.perf_counter()
    if ckpt_io.resume() is None:
        raise RuntimeError(f"no DCP commit in {ckpt}")
    return time.perf_counter() - t0, sum(p.numel() for p in state.model.parameters())


#: run in a fresh interpreter by :func:`_load_deepspeed_time`: a world of one resumes the newest commit
_DS_RELOAD = """
import json, sys
from trainer.examples.deepspeed_zero2 import DeepSpeedJob, _prepare_environment, build_parser
from trainer.batch import ElasticBatch
from trainer.runtime import setup_distributed, teardown_distributed
from trainer.data import load_data, as_samples
_prepare_environment()
args = build_parser().parse_args(sys.argv[1:])
ctx = setup_distributed(300)
job = DeepSpeedJob(args, ctx, ElasticBatch(args.global_batch_size, args.micro_batch_size).plan(1),
                   as_samples(load_data(args), args.seq_len))
job.resume()
r = job.ckpt.last_resume
print(json.dumps({"load_s": r.fetch_s + r.convert_s + r.upload_s + r.load_s, "universal": r.universal,
                  "params": sum(p.numel() for p in job.state.model.parameters())}))
teardown_distributed(ctx)
"""


def _load_deepspeed_time(argv: list[str], ckpt: str, workdir: Path) -> tuple[float, int]:
    """Seconds a restarted DeepSpeed job spends resuming the newest commit (written at DP 3)
    at another world size: fetch, the universal conversion, its upload to the store, and
    ``engine.load_checkpoint``; and the parameter count. In a fresh interpreter (a world of one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPOTVISOR_SCRATCH_DIR": str(workdir / "reload")}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "-c", _DS_RELOAD, *argv, "--data", str(Path(__file__))], env=env,
                         cwd=workdir, capture_output=True, text=True, timeout=3600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the DeepSpeed reload exited {out.returncode}: {out.stderr[-2000:]}")
    got = json.loads(lines[-1])
    if not got["universal"]:
        raise RuntimeError("the DeepSpeed reload did not go through the universal checkpoint")
    return float(got["load_s"]), int(got["params"])


def pick(flag: str, text: str, known: Any) -> list[str]:
    """The comma-separated names of ``text``, each one of ``known``.

    Raises:
        ValueError: one line naming ``flag``, the unknown names and the known ones.
    """
    got = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in got if x not in known]
    if bad or not got:
        raise ValueError(f"{flag}: unknown {', '.join(bad) or 'empty'} (use {', '.join(known)})")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.resize_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="3m,50m,200m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--wraps", default="ddp,fsdp,deepspeed", help=f"comma-separated, of {', '.join(WRAPS)}")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    try:
        sizes, wraps = pick("--sizes", args.sizes, SIZES), pick("--wraps", args.wraps, WRAPS)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="spotvisor-scaling-") as tmp:
        for w in wraps:
            for s in sizes:
                print(f"{w} {s}: running ...", flush=True)
                rows.append(run_size(s, Path(tmp) / f"{w}-{s}", w))
    head = ("trainer", "params", "state MB", "grow: pause", "joiner", "shrink", "commit", "load")
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        shrink = f"{r['shrink_resize_s']:.2f} s"
        if r["shrink_stage_s"]:
            shrink = f"{r['shrink_stage_s'] + r['shrink_resize_s']:.2f} s ({r['shrink_stage_s']:.2f} stage)"
        print(f"| {r['wrap']} | {r['params'] / 1e6:.1f} M | {r['state_bytes'] / 1e6:,.0f} | {r['grow_pause_s']:.2f} s "
              f"| {r['joiner_resize_s']:.2f} s | {shrink} | {r['commit_s']:.2f} s | {r['load_s']:.2f} s |")
    moved = [r for r in rows if "grow_max_bytes" in r]
    if moved:
        rate = link_rate()
        print(f"\npeer-to-peer reshard, against this machine's link (gloo send between two processes: "
              f"{rate / 1e6:,.0f} MB/s):\n")
        head = ("trainer", "params", "grow: most bytes one rank moved", "grow: pause / link floor",
                "shrink: most bytes", "shrink / link floor", "rank 0's own bytes (grow, shrink)",
                "peak extra memory / shard")
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in moved:
            grow_floor, shrink_floor = r["grow_max_bytes"] / rate, r["shrink_max_bytes"] / rate
            shrink_s = r["shrink_stage_s"] + r["shrink_resize_s"]
            r.update(link_bytes_per_s=rate, grow_over_floor=round(r["grow_pause_s"] / grow_floor, 2),
                     shrink_over_floor=round(shrink_s / shrink_floor, 2))
            print(f"| {r['wrap']} | {r['params'] / 1e6:.1f} M | {r['grow_max_bytes'] / 1e6:,.1f} MB "
                  f"| {r['grow_pause_s']:.2f} s / {grow_floor:.2f} s = {r['grow_over_floor']:.2f} "
                  f"| {r['shrink_max_bytes'] / 1e6:,.1f} MB "
                  f"| {shrink_s:.2f} s / {shrink_floor:.2f} s = {r['shrink_over_floor']:.2f} "
                  f"| {r['rank0_grow_bytes'] / 1e6:,.1f} MB, {r['rank0_shrink_bytes'] / 1e6:,.1f} MB "
                  f"| {r['peak_extra_over_shard']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
