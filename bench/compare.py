"""spotvisor against restart-on-preemption and elastic-only, on one job and one preemption trace.

The same training job (the reference trainer ``trainer.run``: the tiny GPT-2 of
``configs/local.yaml``, three local nodes) runs to the same target step three
times on the local provider, each time under the same injected preemption trace,
with the real daemon, real node agents and real ``torchrun`` elastic. Only the
recovery policy differs (:mod:`daemon.control.policies`):

- ``spotvisor``: notice-driven collective commit, elastic shrink, a grow in-process
  (``job.grow: in_process`` in configs/local.yaml);
- ``restart_on_preemption``: periodic commits every K steps; on a node loss stop all,
  relaunch all, resume from the last periodic commit (SkyPilot managed jobs);
- ``elastic_only``: torchrun elastic with periodic commits and no notice handling;
- ``no_preemption``: the default policy and no trace at all: the uninterrupted run each
  system's goodput is also given against (``vs none``).

The trace is a list of preemptions ``WHEN:NODE:LEAD_S``: at ``WHEN`` (``20s``: seconds
after the job first started; ``step40``: once the job reached step 40) the NODE-th
running node (oldest first) gets an interruption notice, and the cloud takes it
LEAD_S seconds later (0: taken at once, no notice). A preemption also waits until
the previous one is absorbed and the job runs at full size again, so every system
meets every preemption, one at a time. The baselines' nodes do not watch the
metadata endpoint, so for them the notice is not published: the node just dies at
its deadline.

Run from the repository root (``make bench`` runs the defaults)::

    python -m bench.compare
    python -m bench.compare --trace 20s:2:30,step120:1:30 --k 10 --launch-delay-s 5 --target-steps 250

It prints a table and the per-preemption profile, and writes ``bench-results.json``
(``--out``). Every figure comes from the trainer's own step and status logs and the
daemon's events, computed the same way for all three systems (see bench/README.md).
Exit status 1 if a system did not complete its job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):  # run as a script: import this checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from bench.ports import free_port  # noqa: E402
from bench.compare_metrics import (NO_PREEMPTION, acceptance, add_relative_goodput, format_profile,  # noqa: E402
                                   format_table, load_run, run_metrics)
from daemon.control.policies import DEFAULT_POLICY, get_policy, policy_names  # noqa: E402
from daemon.providers.chaos import ready_to_fire  # noqa: E402
from daemon.config import ChaosEvent, Config  # noqa: E402
from daemon.model import Event, EventKind, NodeState  # noqa: E402
from daemon.analysis.summary import summarize  # noqa: E402

__all__ = ["TraceEvent", "parse_trace", "inject", "system_config", "run_system", "analyze", "main"]

DEFAULT_OUT = "bench-results.json"
DEFAULT_TRACE = "5s:2:20,40s:3:20,75s:1:20,110s:2:0"
DEFAULT_K = 10
DEFAULT_LAUNCH_DELAY_S = 5.0
DEFAULT_TARGET_STEPS = 300
SYSTEMS = (DEFAULT_POLICY, "restart_on_preemption", "elastic_only", NO_PREEMPTION)


def policy_of(system: str) -> str:
    """The recovery policy a system runs (``no_preemption``: the default, without a trace)."""
    return DEFAULT_POLICY if system == NO_PREEMPTION else system


# --------------------------------------------------------------------------- the trace


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One preemption: at ``at_s`` (seconds after the job first started) or ``at_step``,
    the ``node``-th running node (1 = oldest) gets a notice and is taken ``lead_s`` later
    (0: taken at once, without notice)."""

    node: int
    lead_s: float
    at_s: float | None = None
    at_step: int | None = None

    def __post_init__(self) -> None:
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError("give exactly one of at_s or at_step")
        if self.node < 1:
            raise ValueError(f"node must be >= 1 (the N-th running node), got {self.node}")
        if self.lead_s < 0 or (self.at_s is not None and self.at_s < 0) or (self.at_step is not None and self.at_step < 0):
            raise ValueError(f"negative time in {self}")

    @property
    def label(self) -> str:
        when = f"{self.at_s:g}s" if self.at_s is not None else f"step{self.at_step}"
        return f"{when}:{self.node}:{self.lead_s:g}"

    def chaos_event(self) -> ChaosEvent:
        """The same trigger as a config chaos event (``wait_full_pool``), for :func:`ready_to_fire`."""
        return ChaosEvent(action="notice" if self.lead_s > 0 else "kill", node=self.node, at_s=self.at_s,
                          at_step=self.at_step, lead_s=self.lead_s, wait_full_pool=True)


def parse_trace(text: str) -> tuple[TraceEvent, ...]:
    """``WHEN:NODE:LEAD_S[,...]`` (WHEN = ``20s`` or ``step40``), or a JSON file holding a list
    of ``{"at_s"|"at_step", "node", "lead_s"}``.

    Raises:
        ValueError: an entry that cannot be read (the message names it), or an empty trace.
    """
    path = Path(text)
    if text.endswith(".json") and path.is_file():
        raw = json.loads(path.read_text())
        if not isinstance(raw, list):
            raise ValueError(f"{text}: expected a JSON list of preemptions")
        try:
            events = tuple(TraceEvent(node=int(e["node"]), lead_s=float(e["lead_s"]), at_s=e.get("at_s"),
                                      at_step=e.get("at_step")) for e in raw)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{text}: each preemption needs node, lead_s and at_s or at_step ({exc})") from None
    else:
        out = []
        for entry in (e.strip() for e in text.split(",")):
            parts = entry.split(":")
            if len(parts) != 3:
                raise ValueError(f"trace entry {entry!r}: expected WHEN:NODE:LEAD_S, e.g. 20s:2:30 or step40:1:30")
            when, node, lead = parts
            try:
                if when.endswith("s") and not when.startswith("step"):
                    at: dict[str, Any] = {"at_s": float(when[:-1])}
                elif when.startswith("step"):
                    at = {"at_step": int(when[4:])}
                else:
                    raise ValueError("WHEN is 20s (seconds after the job started) or step40")
                out.append(TraceEvent(node=int(node), lead_s=float(lead), **at))
            except ValueError as exc:
                raise ValueError(f"trace entry {entry!r}: {exc}") from None
        events = tuple(out)
    if not events:
        raise ValueError("the trace is empty")
    return events


def pick_node(sup: Any, slot: int) -> Any | None:
    """The ``slot``-th running node, oldest (lowest ordinal) first; None if there are fewer."""
    running = sorted((n for n in sup.nodes.values() if n.state is NodeState.RUNNING), key=lambda n: n.ordinal)
    return running[slot - 1] if len(running) >= slot else None


async def inject(sup: Any, trace: Sequence[TraceEvent], *, publish_notices: bool, tick_s: float = 0.25) -> None:
    """Fire ``trace`` in order on ``sup``'s local provider, recording one ``chaos_injected``
    event per preemption with ``published_at`` (the notice's time, unix s).

    ``publish_notices`` False: the notice is not put on the node's metadata endpoint
    (nothing there reads it); the node is only taken at its deadline.
    """
    provider = sup.fleet.provider
    previous: tuple[float, str] | None = None
    for i, ev in enumerate(trace):
        trigger = ev.chaos_event()
        while not ready_to_fire(trigger, sup, sup.clock(), previous=previous):
            if sup.job.state.is_terminal():
                return
            await asyncio.sleep(tick_s)  # polling the job's progress, not synchronising
        node = pick_node(sup, ev.node)
        if node is None or node.instance_id is None:
            sup.record(EventKind.CHAOS_INJECTED, None, index=i, trace=ev.label, skipped=True,
                       reason=f"fewer than {ev.node} running nodes")
            continue
        now = sup.clock()
        late_s = None if ev.at_s is None else round(now - sup.job.started_at - ev.at_s, 2)
        try:
            if ev.lead_s == 0:
                await provider.kill(node.instance_id)
                action, published_at = "kill", now
            elif publish_notices:
                deadline = await provider.publish_interruption(node.instance_id, lead_s=ev.lead_s)
                action, published_at = "notice", deadline.timestamp() - ev.lead_s
            else:
                action, published_at = "notice", now
                sup.spawn(_take_later(provider, node.instance_id, ev.lead_s), f"bench:reclaim:{node.id}")
        except (KeyError, RuntimeError) as exc:  # gone (or not booted) since it was picked
            sup.record(EventKind.CHAOS_INJECTED, node.id, index=i, trace=ev.label, skipped=True, reason=str(exc))
            continue
        previous = (now, node.id)
        sup.record(EventKind.CHAOS_INJECTED, node.id, index=i, trace=ev.label, action=action, lead_s=ev.lead_s,
                   published=publish_notices and action == "notice", published_at=published_at,
                   step=sup.job.step, late_s=late_s)
        sup.wake()


async def _take_later(provider: Any, instance_id: str, lead_s: float) -> None:
    await asyncio.sleep(lead_s)  # the notice's lead time, as the cloud gives it
    try:
        await provider.kill(instance_id)
    except KeyError:
        pass  # already gone (a restart-all terminated it first)


# --------------------------------------------------------------------------- running




def system_config(base: dict[str, Any], *, state_dir: Path, k: int, launch_delay_s: float,
                  target_steps: int, grow: str | None = None) -> Config:
    """``base`` (a parsed config) with the bench's parameters, its own state and ports, no chaos, no feed;
    ``grow``: ``job.grow`` (None: the base's)."""
    raw = json.loads(json.dumps(base))  # a deep copy
    raw.setdefault("job", {}).update(target_steps=target_steps, checkpoint_interval_steps=k)
    if grow is not None:
        raw["job"]["grow"] = grow
    raw.setdefault("providers", {}).setdefault("local", {})["launch_delay_s"] = launch_delay_s
    raw.setdefault("rendezvous", {})["port"] = free_port()
    raw.setdefault("daemon", {}).update(state_dir=str(state_dir), socket=str(state_dir.with_suffix(".sock")))
    raw["chaos"] = []
    raw.pop("notify", None)
    return Config.model_validate(raw)


async def run_system(name: str, config: Config, trace: Sequence[TraceEvent], *, timeout_s: float,
                     out: Callable[[str], None], verbose: bool = False) -> dict[str, Any]:
    """Run the job once under ``name``'s policy and ``trace``; its metrics."""
    from daemon.interfaces.cli import format_event, rendezvous_process, running_daemon

    policy = get_policy(policy_of(name))
    t0 = time.time()
    completed = False

    def show(ev: Event) -> None:
        if verbose:
            out("    " + format_event(ev, t0))
        elif ev.kind == EventKind.CHAOS_INJECTED.value:
            d = ev.data
            out(f"    [{ev.time - t0:6.1f}s] preemption {d.get('index')} ({d.get('trace')}): "
                + (f"skipped, {d.get('reason')}" if d.get("skipped") else
                   f"{d.get('action')} on {ev.node} at step {d.get('step')}"
                   + ("" if d.get("published") or d.get("action") == "kill" else " (not published)")))

    with rendezvous_process(config):
        async with running_daemon(config, with_chaos=False, policy=policy) as sup:
            sup.subscribe(show)
            sup.spawn(inject(sup, trace, publish_notices=policy.acts_on_notices), "bench:trace")
            try:
                async with asyncio.timeout(timeout_s):
                    await sup.wait_completed()
                    await sup.wait_released()
                completed = True
            except TimeoutError:
                out(f"    {name}: the job did not complete within {timeout_s:g} s (step {sup.job.step})")
            events = sup.store.events()
    result = analyze(name, config, events)
    result["completed"] = result["completed"] and completed
    return result


def analyze(name: str, config: Config, events: Sequence[Event] | None = None) -> dict[str, Any]:
    """The metrics of the run of ``name`` kept in ``config``'s state dir (its events read
    from the store there when not given)."""
    state = config.daemon.state_path()
    if events is None:
        from daemon.controlnode.store import Store

        store = Store(state / "spotvisord.db").open()
        try:
            events = store.events()
        finally:
            store.close()
    steps, status = load_run(state / "nodes")
    summary = summarize(state / "nodes", events, target_steps=config.job.target_steps,
                        global_batch_size=config.job.global_batch_size)
    description = "the same job with no preemption" if name == NO_PREEMPTION else get_policy(name).description
    return {"policy": description, **run_metrics(steps, status, events, summary),
            "summary": summary, "state_dir": str(state)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=DEFAULT_TRACE,
                   help=f"preemptions WHEN:NODE:LEAD_S,... or a .json file (default {DEFAULT_TRACE})")
    p.add_argument("--k", type=int, default=DEFAULT_K, help=f"periodic commit every K steps (default {DEFAULT_K})")
    p.add_argument("--launch-delay-s", type=float, default=DEFAULT_LAUNCH_DELAY_S,
                   help=f"local provider's launch delay (default {DEFAULT_LAUNCH_DELAY_S:g})")
    p.add_argument("--target-steps", type=int, default=DEFAULT_TARGET_STEPS,
                   help=f"steps the job trains (default {DEFAULT_TARGET_STEPS})")
    p.add_argument("--config", default="configs/local.yaml", help="the job, pool and offers (default configs/local.yaml)")
    p.add_argument("--system", action="append", choices=(*policy_names(), NO_PREEMPTION),
                   help="only these systems (repeatable)")
    p.add_argument("--timeout-s", type=float, default=480.0, help="per system (default 480)")
    p.add_argument("--workdir", type=Path, help="state of the runs (default .spotvisor/bench-<time>)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results file (default {DEFAULT_OUT})")
    p.add_argument("-v", "--verbose", action="store_true", help="print every daemon event")
    p.add_argument("--analyze", type=Path, metavar="WORKDIR",
                   help="run nothing: recompute the figures of the runs kept in WORKDIR (same parameters)")
    args = p.parse_args(argv)
    try:
        trace = parse_trace(args.trace)
    except ValueError as exc:
        p.error(f"--trace: {exc}")
    if args.k < 1 or args.target_steps < 1 or args.launch_delay_s < 0:
        p.error("--k and --target-steps must be >= 1, --launch-delay-s >= 0")
    systems = tuple(dict.fromkeys(args.system)) if args.system else SYSTEMS
    base = yaml.safe_load(Path(args.config).read_text())
    workdir = (args.analyze or args.workdir or Path(".spotvisor") / f"bench-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    if args.analyze is not None:
        systems = tuple(n for n in systems if (workdir / n / "spotvisord.db").exists())
        if not systems:
            p.error(f"--analyze: no run kept in {workdir}")

    from daemon.logs import configure_logging

    configure_logging(level="WARNING")  # stderr; the table goes to stdout
    say = lambda s: print(s, flush=True)  # noqa: E731
    say(f"bench.compare: {', '.join(systems)}; trace {','.join(e.label for e in trace)}; K {args.k}; "
        f"launch delay {args.launch_delay_s:g} s; target {args.target_steps} steps; runs in {workdir}")
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(systems, 1):
        # the baselines grow as torchrun does, by restarting every worker; spotvisor as configured
        config = system_config(base, state_dir=workdir / name, k=args.k, launch_delay_s=args.launch_delay_s,
                               target_steps=args.target_steps,
                               grow=None if name in (DEFAULT_POLICY, NO_PREEMPTION) else "restart")
        if args.analyze is not None:
            results[name] = analyze(name, config)
            continue
        say(f"[{i}/{len(systems)}] {name}: " + ("no trace" if name == NO_PREEMPTION else get_policy(name).description))
        t = time.monotonic()
        try:
            results[name] = asyncio.run(run_system(name, config, () if name == NO_PREEMPTION else trace,
                                                   timeout_s=args.timeout_s, out=say, verbose=args.verbose))
        except KeyboardInterrupt:
            return 130
        except RuntimeError as exc:  # e.g. the rendezvous store could not start
            print(f"bench.compare: {name}: {exc}", file=sys.stderr)
            return 1
        say(f"    done in {time.monotonic() - t:.1f} s" + ("" if results[name]["completed"] else " (NOT completed)"))
    wall_s = time.monotonic() - started

    add_relative_goodput(results)
    took = "analyzed again" if args.analyze is not None else f"{wall_s:.0f} s in all"
    say(f"\nsame job ({args.target_steps} steps, {base.get('pool', {}).get('target_nodes')} nodes), "
        f"same trace, K {args.k}, launch delay {args.launch_delay_s:g} s; {took}")
    say(format_table(results))
    say("\nper preemption, seconds after the notice:")
    say(format_profile(results))
    notes = acceptance(results, trace_len=len(trace))
    if notes:
        say("")
        for line in notes:
            say(line)
    doc = {
        "bench": "compare",
        "time": time.time(),
        "params": {"trace": [e.label for e in trace], "k": args.k, "launch_delay_s": args.launch_delay_s,
                   "target_steps": args.target_steps, "config": args.config,
                   "model_args": base.get("job", {}).get("args", []), "workdir": str(workdir)},
        "wall_s": None if args.analyze is not None else round(wall_s, 1),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.machine()},
        "results": results,
        "acceptance": notes,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    say(f"wrote {args.out}")
    return 0 if all(r["completed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
