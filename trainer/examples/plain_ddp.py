"""A plain torchrun DDP script, the kind spotvisor runs unchanged (``job.command``).

It uses only what torchrun gives every worker (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and the rendezvous in the environment, read by ``init_process_group()``) and its own
flags. It imports nothing of spotvisor's. What makes it survive spot instances:

- it saves to its own ``--save-dir`` every ``--save-every`` steps, and on SIGTERM at
  the next step boundary (every rank holds the same weights under DDP, so whichever
  rank is told saves: the one on the node being taken);
- it resumes from the newest save it finds there, at whatever world size torchrun
  gives it.

Under spotvisor, a node's interruption notice reaches the script as a SIGTERM to its
workers, and ``$SPOTVISOR_NOTICE`` names a JSON file with the deadline (unix seconds)
and the seconds left, read here with plain ``json.load`` only to say how long the save
may take. The node is replaced in its placement domain and torchrun restarts the group
from the newest save. Nothing commits for the script: a save that is not done by the
deadline is lost, and the group resumes from the one before.

Run it yourself::

    torchrun --nproc-per-node=2 trainer/examples/plain_ddp.py --save-dir /tmp/ckpt --steps 200

or under spotvisor (``configs/*.yaml``)::

    job:
      command: trainer/examples/plain_ddp.py --save-dir /shared/ckpt --steps 200

``--save-dir`` must be reachable from every node (a shared disk; on the local provider
every node is on this machine). Each save appends one line to ``<save-dir>/events.jsonl``
(``periodic``, ``sigterm`` with the notice it read, or ``final``), and so does each
start of the group (``resumed``, by rank 0, with the world size): a log of what the
script did.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_stop = {"signal": None}


def _on_sigterm(signum: int, frame: object) -> None:
    _stop["signal"] = signum  # saved at the next step boundary: never mid-step


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-s", type=float, default=0.0, help="sleep per step (a stand-in for real work)")
    return p.parse_args(argv)


def _newest(save_dir: Path) -> Path | None:
    saves = sorted(save_dir.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return saves[-1] if saves else None


def _save(save_dir: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, why: str,
          notice: object = None) -> None:
    """Write ``step-<N>.pt`` atomically (a unique tmp name, then rename), then log it."""
    rank = dist.get_rank()
    tmp = save_dir / f".step-{step}.{rank}.{os.getpid()}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, save_dir / f"step-{step}.pt")
    with open(save_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": why, "step": step, "rank": rank, "world_size": dist.get_world_size(),
                            "time": time.time(), "notice": notice}) + "\n")


def _notice() -> dict | None:
    """The notice spotvisor wrote for this node, if any (plain JSON; absent elsewhere)."""
    path = os.environ.get("SPOTVISOR_NOTICE")
    if not path or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    args.save_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    step = 0
    newest = _newest(args.save_dir)
    if newest is not None:
        state = torch.load(newest, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    ddp = DistributedDataParallel(model)
    target = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))  # the function to learn
    print(f"rank {rank}/{world}: resuming at step {step} from {newest}", flush=True)
    if rank == 0:
        with open(args.save_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"event": "resumed", "step": step, "rank": rank, "world_size": world,
                                "time": time.time(), "from": None if newest is None else newest.name}) + "\n")
    # from here a SIGTERM saves at the next step boundary; before, it ends the process at once
    # (nothing to save yet, and a worker blocked in init_process_group would not see a flag)
    signal.signal(signal.SIGTERM, _on_sigterm)
    while step < args.steps:
        g = torch.Generator().manual_seed(step * 1000 + rank)  # the same data for a step, whoever trains it
        x = torch.randn(args.batch, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), (x @ target).to(device))
        opt.zero_grad()
        loss.backward()  # DDP's all-reduce: a peer gone fails here, and torchrun restarts the group
        opt.step()
        step += 1
        if _stop["signal"] is not None:
            notice = _notice()
            deadline = None if notice is None else notice.get("deadline")
            left = "" if deadline is None else f", {deadline - time.time():.0f} s to the deadline"
            print(f"rank {rank}: SIGTERM at step {step}{left}", flush=True)
            _save(args.save_dir, step, model, opt, "sigterm", notice)
            dist.destroy_process_group()  # the peers' collectives fail now, not at this process's teardown
            return 128 + signal.SIGTERM
        if rank == 0 and step % args.save_every == 0:
            _save(args.save_dir, step, model, opt, "periodic")
        if args.step_s:
            time.sleep(args.step_s)
    if rank == 0:
        _save(args.save_dir, step, model, opt, "final")
        print(f"done: {args.steps} steps, loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
