"""What a grow's placement of its joiners saves in the FSDP2 peer-to-peer exchange alone.

``python -m bench.reshard_exchange [--sizes 200m] [--grows 2:3,2:4] [--reps 9] [--json OUT]``

For each size of the reference trainer's GPT-2 (byte-level, the shapes of
:mod:`bench.resize_scaling`'s sizes, each parameter with AdamW's two moments) and each
grow ``old:new``, ``new`` worker processes (gloo on CPU, one thread each) hold the old
shards as ``torch.chunk`` lays them and carry out
:func:`trainer.integrations.p2p_reshard.exchange` into freshly allocated new shards,
the joiners either *appended* (ranks ``old .. new - 1``, as a grow placed them before)
or *placed* (:func:`trainer.integrations.p2p_reshard.grow_ranks`). The two alternate,
``--reps`` times each; the table gives each one's median and fastest exchange (barrier
to barrier), the bytes it moved over the link in all, the busiest rank's (sent or
received), and that rank's bytes over a gloo send from rank 0 to rank 1 timed by the
same processes after the exchanges (:func:`bench.resize_scaling.send_seconds`, as
:func:`~bench.resize_scaling.link_rate` times it): the link's floor. Nothing else
of a resize is in it (the new group, the model's rebuild: :mod:`bench.resize_scaling`).

Prints a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.resize_scaling import SIZES, pick, send_seconds

MODES = ("appended", "placed")
LINK_BYTES = 256 << 20  # the send the link is timed with, as bench.resize_scaling.link_rate


def shapes(size: str) -> list[tuple[int, ...]]:
    """Every tensor of the byte-level GPT-2 of ``size`` and AdamW's two moments of it, in
    :meth:`trainer.integrations.fsdp_shards.ShardMover.local_shards`' order."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head = SIZES[size]
    config = GPT2Config(vocab_size=256, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return [tuple(p.shape) for p in model.parameters() for _ in range(3)]


def parse_grows(text: str) -> list[tuple[int, int]]:
    """``"2:3,2:4"`` -> ``[(2, 3), (2, 4)]``.

    Raises:
        ValueError: one line naming ``--grows`` and the fix.
    """
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        old, _, new = item.partition(":")
        if not (old.isdigit() and new.isdigit() and 1 <= int(old) < int(new) <= 16):
            raise ValueError(f"--grows: {item!r} is not OLD:NEW with 1 <= OLD < NEW <= 16 (e.g. 2:3)")
        out.append((int(old), int(new)))
    if not out:
        raise ValueError("--grows: empty (e.g. 2:3,2:4)")
    return out


def _worker(rank: int, tmp: str, tensors: list[tuple[int, ...]], old: int, new: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from trainer.integrations.p2p_reshard import chunk_rows, exchange, grow_ranks, plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=new)
    rows = [s[0] for s in tensors]
    row_bytes = [4 * (int(torch.Size(s[1:]).numel())) for s in tensors]
    pieces = plan(rows, old, new)
    holders = {"appended": list(range(old)), "placed": grow_ranks(rows, row_bytes, old, new - old)[:old]}
    out: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(reps):
        for mode in MODES:
            mine = {i: [torch.ones((chunk_rows(n, old, i)[1], *s[1:])) for n, s in zip(rows, tensors)]
                    for i, r in enumerate(holders[mode]) if r == rank}
            fresh = [torch.empty((chunk_rows(n, new, rank)[1], *s[1:])) for n, s in zip(rows, tensors)]
            dist.barrier()
            t0 = time.perf_counter()
            t = exchange(pieces, mine, fresh, rows=rows, old_world=old, new_world=new, holders=holders[mode],
                         takers=list(range(new)))
            dist.barrier()
            out[mode].append({"seconds": time.perf_counter() - t0, "sent": t.sent_bytes,
                              "received": t.received_bytes})
            del mine, fresh
    link_s = send_seconds(rank, LINK_BYTES)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({**out, "link_s": link_s}))
    dist.destroy_process_group()


def run_grow(size: str, old: int, new: int, reps: int) -> dict[str, Any]:
    """One size and grow, both modes (module docstring). Seconds, bytes, bytes per second."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="spotvisor-exchange-") as tmp:
        mp.start_processes(_worker, args=(tmp, shapes(size), old, new, reps), nprocs=new, start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(new)]
    row: dict[str, Any] = {"size": size, "old": old, "new": new, "reps": reps,
                           "link_bytes_per_s": round(LINK_BYTES / ranks[1]["link_s"])}
    for mode in MODES:
        seconds = [max(r[mode][i]["seconds"] for r in ranks) for i in range(reps)]
        first = [r[mode][0] for r in ranks]
        row[mode] = {"median_s": round(statistics.median(seconds), 4), "min_s": round(min(seconds), 4),
                     "moved_bytes": sum(x["sent"] for x in first),
                     "busiest_bytes": max(max(x["sent"], x["received"]) for x in first)}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.reshard_exchange", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="200m", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--grows", default="2:3,2:4", help="comma-separated OLD:NEW world sizes (default 2:3,2:4)")
    p.add_argument("--reps", type=int, default=9, help="exchanges per placement, alternating (default 9)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    try:
        sizes, grows = pick("--sizes", args.sizes, SIZES), parse_grows(args.grows)
        if args.reps < 1:
            raise ValueError(f"--reps: {args.reps} (use 1 or more)")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for size in sizes:
        for old, new in grows:
            print(f"{size} {old} -> {new}: running ...", flush=True)
            rows.append(run_grow(size, old, new, args.reps))
    links = ", ".join(f"{r['link_bytes_per_s'] / 1e6:,.0f}" for r in rows)
    print(f"\nexchange of a grow, {args.reps} each (link: a gloo send from rank 0 to rank 1, "
          f"timed in each run: {links} MB/s)\n")
    head = ("size", "grow", "joiners", "median", "fastest", "moved in all", "busiest rank", "median / link floor")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        for mode in MODES:
            m = r[mode]
            floor = m["busiest_bytes"] / r["link_bytes_per_s"]
            m["over_floor"] = round(m["median_s"] / floor, 2)
            print(f"| {r['size']} | {r['old']} -> {r['new']} | {mode} | {m['median_s']:.2f} s | {m['min_s']:.2f} s "
                  f"| {m['moved_bytes'] / 1e6:,.0f} MB | {m['busiest_bytes'] / 1e6:,.0f} MB "
                  f"| {m['median_s']:.2f} s / {floor:.2f} s = {m['over_floor']:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
