"""The reference trainer (``trainer.run``), paced while the world is short of its full size.

An end-to-end run checks that a shrunk job grows back before it ends; with the small
model a step takes ~0.05 s here, so the job could end before a replacement has booted
and imported (10-30 s on a loaded 2-core CI machine) and the grow would never show.
Every rank of a world smaller than ``--full-world`` sleeps ``--pace-s`` before each
step (the world size is the same on every rank, so they stay in step); at the full
world it trains at full speed. A run therefore lasts as long as its grows take, not
a fixed number of steps sized for the slowest day.

``--pace-file``: every step also sleeps ``--pace-s`` while this file exists, so a cell can
hold the job in training across a fault it then checks the recovery of (the store's move
to a new leader's control node), and let it finish at full speed once it has seen it.

``--hold-last K``: the last ``K`` steps are not trained while the world is short of
``--full-world``: every rank holds at the step boundary (``--pace-s`` a pass, the
boundary's decision taken again each time, so a grow, a notice or a loss is handled
there as at any step) until the world is whole. A cell whose check needs the job to end
at its full world then needs no slack steps after the last grow: the run ends a few
steps after it, however long the grow took (the hold stays far below the daemon's
``stall.floor_s``, 300 s).

``--min-step-s``: every step lasts at least this long at any world size (the rank
sleeps what its computation left of it), as a GPU step does to the CPU that waits on
it: a cell that needs the job to train on across a fault of some seconds gets those
seconds from a few steps that cost the CI machine's cores nearly nothing, not from
hundreds of steps of a bigger model.

Run by torchrun as ``-m e2e.paced_trainer`` (``job.module``; the demo's workers start in
the repository root, and the tests put ``tests/`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import sys
import time

from trainer.loop import run_job
from trainer.run import ReferenceJob, build_parser


def paced(base: type) -> type:
    """``base`` (an :class:`~trainer.loop.ElasticJob`) with the pacing of the module docstring."""

    class Paced(base):  # type: ignore[valid-type,misc]
        def train_step(self) -> tuple[float, float, list[int]]:
            t0 = time.monotonic()
            held = bool(self.args.pace_file) and os.path.exists(self.args.pace_file)
            if self.ctx.world_size < self.args.full_world or held:
                time.sleep(self.args.pace_s)
            out = super().train_step()
            time.sleep(max(0.0, self.args.min_step_s - (time.monotonic() - t0)))
            return out

        def _train(self) -> bool:
            # the same on every rank (the world size and the step are), so no rank trains alone
            if (self.ctx.world_size < self.args.full_world
                    and self.state.step >= self.args.target_steps - self.args.hold_last):
                time.sleep(self.args.pace_s)
                return True
            return super()._train()

    return Paced


PacedJob = paced(ReferenceJob)


def main() -> int:
    deepspeed = "--deepspeed" in sys.argv
    if deepspeed:  # the DeepSpeed example's job, paced the same way (configs/local-deepspeed.yaml's e2e)
        from trainer.examples.deepspeed_zero2 import DeepSpeedJob, _prepare_environment
        from trainer.examples.deepspeed_zero2 import build_parser as ds_parser
        p, job, prepare = ds_parser(), paced(DeepSpeedJob), _prepare_environment
    else:
        p, job, prepare = build_parser(), PacedJob, None
    p.add_argument("--deepspeed", action="store_true", help="pace trainer.examples.deepspeed_zero2's job")
    p.add_argument("--full-world", type=int, required=True, help="the world size of the full pool")
    p.add_argument("--pace-s", type=float, default=0.5, help="sleep before each step while the world is smaller")
    p.add_argument("--pace-file", default=None, help="also sleep before each step while this file exists")
    p.add_argument("--min-step-s", type=float, default=0.0, help="every step lasts at least this long (seconds)")
    p.add_argument("--hold-last", type=int, default=0,
                   help="hold before each of the last K steps until the world is whole")
    return run_job(None, job_cls=job, parser=p, prepare=prepare)


if __name__ == "__main__":
    from trainer.runtime import exit_process

    exit_process(main())
