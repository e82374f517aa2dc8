"""``python -m bench.spikes.torchft_spike [--replicas 3] [--params-m 3] [--steps 60]``: what torchft gives
and costs, measured (issue 17's evaluation spike).

torchft (pytorch/torchft, PyPI ``torchft``; 0.2.0 measured) keeps training inside running
workers across failures: a Lighthouse (a gRPC quorum server, Rust) forms a quorum of
*replica groups* every step; each group's ``Manager`` runs a reconfigurable process group
(gloo or NCCL) across the groups, aborts it when a peer fails and re-forms it at the next
quorum; a newcomer is healed from a live peer (the state dict over HTTP).

This spike runs ``--replicas`` replica groups of one process each on this machine (gloo,
CPU), each a fault-tolerant DDP over an MLP of ``--params-m`` million parameters with
AdamW, against a Lighthouse on 127.0.0.1, and measures:

- the step time with torchft against the same model trained by one process without it;
- a replica killed with SIGKILL (no notice): the survivors' longest pause between two
  committed steps, and the steps they discarded;

(``SPIKE_FT_DDP=1`` uses torchft's ``DistributedDataParallel`` instead of the Manager's
allreduce per gradient: in 0.2.0 its comm hook fails an assertion on the first failed
allreduce, and every survivor dies with the killed replica.)
- a new replica started after it: the time from its process start to its first
  committed step (healed from a peer), and the survivors' longest pause while it joins.

Needs ``pip install torchft==0.2.0`` (not a dependency of this project). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from bench.ports import free_port




def _model(params_m: float):
    import torch

    width = max(64, int((params_m * 1e6 / 3) ** 0.5))  # three square layers
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, width)), width


def worker(replica: int, lighthouse: str, params_m: float, steps: int, out: Path) -> None:
    """One replica group of one process: fault-tolerant DDP, a JSON line per step."""
    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    t_start = time.time()
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the group's own store
    model, width = _model(params_m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def state_dict():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load_state_dict(sd) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=1, timeout=timedelta(seconds=5),
                      quorum_timeout=timedelta(seconds=30), rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=port, lighthouse_addr=lighthouse, replica_id=f"replica_{replica}",
                      hostname="127.0.0.1")
    # torchft's DistributedDataParallel (0.2.0) dies on the first failed allreduce (its comm
    # hook asserts on the errored path: the very case this measures); the gradients are
    # averaged with the Manager's fault-tolerant allreduce directly, as its docs allow
    ddp = DistributedDataParallel(manager, model) if os.environ.get("SPIKE_FT_DDP") else model
    optim = Optimizer(manager, opt)
    x = torch.randn(8, width)
    with out.open("a") as f:
        f.write(json.dumps({"replica": replica, "event": "started", "time": t_start}) + "\n")
        while manager.current_step() < steps:
            t0 = time.time()
            optim.zero_grad()
            ddp(x).square().mean().backward()
            if ddp is model:
                for w in [manager.allreduce(p.grad) for p in model.parameters()]:
                    w.wait()
            before = manager.current_step()
            optim.step()
            f.write(json.dumps({"replica": replica, "time": time.time(), "step_s": time.time() - t0,
                                "step": manager.current_step(), "committed": manager.current_step() > before,
                                "participants": manager.num_participants()}) + "\n")
            f.flush()
    manager.shutdown()
    del store


def plain_step_s(params_m: float, n: int = 20) -> float:
    import torch

    torch.set_num_threads(1)  # as each replica runs (OMP_NUM_THREADS=1)
    model, width = _model(params_m)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, width)
    t0 = time.time()
    for _ in range(n):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return (time.time() - t0) / n


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []


def _wait(pred, timeout_s: float) -> bool:
    end = time.time() + timeout_s
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)  # a poll of files other processes write: no event to wait on
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spikes.torchft_spike", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--params-m", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.lighthouse, args.params_m, args.steps, args.out)
        return 0
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        print("bench.spikes.torchft_spike: torchft is not installed (pip install torchft==0.2.0)", file=sys.stderr)
        return 2
    import tempfile

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    out = Path(tempfile.mkdtemp()) / "steps.jsonl"
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lh.address(), "OMP_NUM_THREADS": "1"}

    def start(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "bench.spikes.torchft_spike", "--worker", str(i), "--lighthouse",
                                 lh.address(), "--params-m", str(args.params_m), "--steps", str(args.steps),
                                 "--out", str(out)], env=env, stderr=(out.parent / f"replica-{i}.log").open("w"))

    procs = {i: start(i) for i in range(args.replicas)}
    victim, newcomer = args.replicas - 1, args.replicas

    def committed(i: int) -> list[dict]:
        return [x for x in _lines(out) if x.get("replica") == i and x.get("committed")]

    ok = _wait(lambda: all(len(committed(i)) >= 20 for i in range(args.replicas)), 120)
    full = [x for x in _lines(out) if x.get("committed") and x.get("participants") == args.replicas]
    ft_step = sorted(x["step_s"] for x in full)[len(full) // 2] if full else float("nan")
    t_kill = time.time()
    procs[victim].send_signal(signal.SIGKILL)
    ok = ok and _wait(lambda: len([x for x in committed(0) if x["time"] > t_kill and x["participants"]
                                   == args.replicas - 1]) >= 10, 60)
    t_join = time.time()
    procs[newcomer] = start(newcomer)
    ok = ok and _wait(lambda: len(committed(newcomer)) >= 5, 120)
    time.sleep(0.5)
    for i, pr in procs.items():
        if i != victim:
            pr.terminate()
    for pr in procs.values():
        pr.wait(timeout=30)
    lh.shutdown()

    lines = _lines(out)
    s0 = [x for x in lines if x.get("replica") == 0 and "step_s" in x]

    def longest_pause(a: float, b: float) -> float:
        ts = [x["time"] for x in s0 if x["committed"] and a - 5 <= x["time"] <= b]
        return max((t2 - t1 for t1, t2 in zip(ts, ts[1:]) if t2 > a), default=float("nan"))

    discarded = len([x for x in s0 if not x["committed"] and x["time"] > t_kill])
    started = next((x["time"] for x in lines if x.get("replica") == newcomer and x.get("event") == "started"), None)
    first = next((x["time"] for x in lines if x.get("replica") == newcomer and x.get("committed")), None)
    rows = [
        ("model parameters (M)", f"{args.params_m:g}"),
        ("step, one process, one thread, without torchft (s)", f"{plain_step_s(args.params_m):.4f}"),
        (f"step, torchft, {args.replicas} replicas, median (s)", f"{ft_step:.4f}"),
        ("kill -9 of a replica: survivors' longest pause between commits (s)", f"{longest_pause(t_kill, t_join):.2f}"),
        ("kill -9: steps the survivor discarded", str(discarded)),
        ("newcomer: process start to first committed step (s)",
         "-" if started is None or first is None else f"{first - started:.2f}"),
        ("newcomer: spawn (fork+exec) to first committed step (s)", "-" if first is None else f"{first - t_join:.2f}"),
        ("newcomer joins: survivors' longest pause between commits (s)", f"{longest_pause(t_join, time.time()):.2f}"),
        ("completed", "yes" if ok else "NO (timed out)"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
