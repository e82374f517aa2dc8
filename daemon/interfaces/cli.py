"""spotvisord: the daemon's command line.

- ``spotvisord check-config FILE`` — validate; one line per problem, exit 2; with a
  ``job.model``, the pre-flight tables (GPU memory per offer, checkpoint flush per
  notice window), exit 2 when no offer can hold the job.
- ``spotvisord check FILE`` — the cloud check: live, read-only calls with this machine's
  credentials (credentials, each offer's exact launch request as a dry run, images, quotas,
  each domain's checkpoint store: put/get/delete of a probe object). One line per check,
  ``ok   <what>`` or ``FAIL <what>: <why>; fix: <the fix, naming the config field>``;
  exit 1 when any failed (:mod:`daemon.controlnode.cloud_check`). The daemon runs the
  same checks at start and buys nothing a failed one concerns.
- ``spotvisord preflight [--config FILE] [--preset NAME ...] [--nodes N ...]`` —
  which GPUs hold the model, and can a checkpoint beat the notice
  (:mod:`daemon.interfaces.preflight_cli`).
- ``spotvisord run --config FILE`` — the service (systemd ``spotvisord.service``,
  ``Type=notify`` with watchdog: :mod:`daemon.interfaces.service`). SIGTERM stops the daemon
  and leaves the job's instances running; it exits by itself once the job completed
  and every instance is released.
- ``spotvisord demo --config FILE [--summary-json PATH]`` — run the job to its
  target on the local provider with its chaos schedule, print events as they
  happen and a summary at the end (``make demo``); exit 1 as soon as the job failed
  or was cancelled and its pool is released. A schedule that ends the daemon
  (``kill_daemon``, ``kill_control_node``, ``partition_leader``) runs it as a child,
  ``spotvisord run``, and restarts it as systemd would (:mod:`daemon.interfaces.demo_runner`).
- ``spotvisord rendezvous --host H --port P`` — the c10d rendezvous store
  (``spotvisor-rendezvous.service``), listening on ``H`` only (default 127.0.0.1).

``run`` and ``demo`` hold an exclusive lock on the state directory (``spotvisord.lock``
in it, :func:`daemon.state_dir.state_dir_lock`) for their lifetime, taken before the
store or the control socket is opened; ``demo`` holds the configured directory's and
its run directory's: a second daemon on either exits 2 with one line naming the
directory and the pid that holds it. The state directory must be this uid's; it is
created 0700 and the store 0600 whatever the umask (it holds every node's agent
token), and a link or FIFO planted in it is refused, exit 2 (:mod:`daemon.state_dir`).

``run`` and ``demo`` read the job's secrets (``job.secrets``) before anything else; one that
cannot be read is one line naming it and its source, exit 2 (1 for an outage or a timeout),
and nothing is bought (:mod:`daemon.controlnode.job_secrets`).

Exit codes: 0 ok, 1 runtime failure (job failed, timeout), 2 usage/config error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import functools
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import structlog

from daemon.interfaces import preflight_cli
from daemon.config import Config, ConfigError, load_config, loopback_problem
from daemon.store_access import mount_type, store_access_problem
from daemon.logs import configure_logging
from daemon.interfaces.pipes import quiet_broken_pipe
from daemon.model import Event, EventKind
from daemon.feed.redaction import Redactor
from daemon.providers.base import Provider, create_provider
from daemon.controlnode.job_secrets import SecretError
from daemon.controlnode.store import Store
from daemon.controlnode.workdir import WorkdirError
from daemon.controlnode.placement import DeadlineError
from daemon.state_dir import StateDirBusy, StateDirError, prepare_state_dir, serving, state_dir_lock

if TYPE_CHECKING:  # for annotations only; running_daemon imports it when it runs
    from daemon.control.policies import RecoveryPolicy
    from daemon.ha.leading import Leadership
    from daemon.interfaces.service import SdNotifier
    from daemon.controlnode.rendezvous import RunnerStore, StoreProcess
    from daemon.controlnode.supervisor import Supervisor

__all__ = ["main", "running_daemon", "format_event", "prepare_state_dir", "state_dir_lock", "StateDirBusy"]

log = structlog.get_logger("spotvisor.cli")


@contextlib.asynccontextmanager
async def running_daemon(config: Config, *, with_chaos: bool = True,
                         providers: Mapping[str, Provider] | None = None,
                         policy: "RecoveryPolicy | None" = None,
                         rendezvous: "StoreProcess | RunnerStore | None" = None,
                         redactor: Redactor | None = None,
                         ha: "Leadership | None" = None) -> AsyncIterator["Supervisor"]:
    """Store + provider + supervisor + APIs (+ chaos), closed in reverse order.

    ``providers``: by name, instead of those the config names (tests). ``policy``: the
    recovery policy (default: the default one; the benchmark runs the baselines,
    :mod:`daemon.control.policies`). ``rendezvous``: the store process this run started
    (:func:`rendezvous_process`), or an outside runner's (:func:`_runner_store`), which the
    chaos schedule's ``kill_store`` kills.
    ``redactor``: the process's (:func:`main` gives it to the logging set-up too); the
    job's secret values and the feed's secret URLs are registered with it. Without one
    the run has its own, on the logging handlers while it runs.
    ``ha``: with ``config.ha``, this daemon's part in the election
    (:class:`daemon.ha.leading.Leadership`; default: one of its own): entering waits
    until this daemon leads (a standby waits there), then the store is the pool's in etcd
    and every provider is fenced; ``ha.lost`` says when it leads no more (:func:`_run`
    ends the daemon then).
    Closing never terminates an instance (:meth:`Supervisor.aclose`). Holds the state
    directory's lock while it runs (:func:`daemon.state_dir.serving`).

    Raises:
        StateDirError: the state directory is another daemon's, or not this one's own
            (:mod:`daemon.state_dir`); an ``OSError``, as are a taken port and a bad
            certificate.
        SecretError: a ``job.secrets`` value cannot be read, or could only be sent in plain
            HTTP beyond loopback (:mod:`daemon.controlnode.job_secrets`); nothing is bought.
    """
    # the state dir's lock, for the daemon's life
    with serving(config.daemon.state_path()) as state, contextlib.ExitStack() as redacting:
        own = redactor is None
        redactor = Redactor() if redactor is None else redactor
        if own:
            redactor.install()
            redacting.callback(redactor.uninstall)
        async with contextlib.AsyncExitStack() as stack:
            if config.ha is not None and ha is None:
                from daemon.ha.leading import Leadership

                ha = await stack.enter_async_context(Leadership(config.ha, config.pool.name))
            async with _daemon_in(config, state, with_chaos=with_chaos, providers=providers, policy=policy,
                                  rendezvous=rendezvous, redactor=redactor, ha=ha) as sup:
                yield sup


@contextlib.asynccontextmanager
async def _daemon_in(config: Config, state: Path, *, with_chaos: bool, providers: Mapping[str, Provider] | None,
                     policy: "RecoveryPolicy | None",
                     rendezvous: "StoreProcess | RunnerStore | None", redactor: Redactor,
                     ha: "Leadership | None" = None) -> AsyncIterator["Supervisor"]:
    """:func:`running_daemon` in ``state``, its locked state directory."""
    # these imports (boto3, aiohttp, the supervisor: ~0.6 s of CPU, seconds on a loaded
    # host) off the loop: a caller's own tasks run on it meanwhile (with ha: a lease, once a
    # campaign runs; spotvisord run campaigns only after this start, _stand_by)
    await asyncio.to_thread(_import_all, _START_MODULES)
    from daemon.interfaces.api import ApiServer
    from daemon.providers.chaos import run_chaos
    from daemon.controlnode.supervisor import Supervisor
    from daemon.controlnode.tls import agent_tls
    from daemon.controlnode.job_secrets import check_channel, resolve_secrets

    job_secrets = await resolve_secrets(config)  # before anything is started or bought; SecretError
    redactor.add_values(job_secrets.values())  # from now on no log line shows one
    tls = await agent_tls(config.daemon, state)  # None: plain HTTP on loopback (daemon.agent_tls)
    if ha is None:
        store: Store = Store(state / "spotvisord.db").open()
    agent_args = [
        "--poll-interval-s", f"{config.agent.poll_interval_s:g}",
        "--heartbeat-interval-s", f"{config.agent.heartbeat_interval_s:g}",
        "--metadata-timeout-s", f"{config.agent.metadata_timeout_s:g}",
        "--metadata-alarm-after", str(config.agent.metadata_alarm_after),
        "--metadata-max-backoff-s", f"{config.agent.metadata_max_backoff_s:g}",
    ]

    def made() -> dict[str, Provider]:
        return {name: create_provider(name, spec=getattr(config.providers, name), state_dir=state,
                                      agent_args=agent_args, **_cloud_kwargs(config, name))
                for name in sorted({o.provider for o in config.offers})}

    if providers is not None:
        providers = dict(providers)
    else:  # a leader's loop must answer its lease: the cloud clients (a second of botocore's models) off it
        providers = made() if ha is None else await asyncio.to_thread(made)
    checked = None  # HA: the cloud check the standby ran while it waited
    if ha is not None:  # the standby waits here, with what its start imports loaded and its mirror open
        await asyncio.to_thread(_takeover_imports, config)
        await ha.prepare_store(state / "spotvisord.db")
        latest: list[tuple[float, Any]] = []
        checking = asyncio.create_task(_check_while_standing_by(config, providers, latest), name="ha:standby-check")
        try:
            await ha.lead()
        finally:
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking
        if latest and time.monotonic() - latest[0][0] < STANDBY_CHECK_MAX_AGE_S:
            checked = latest[0][1]  # a takeover's first act does not wait for a new run (seconds under load)
        led_cpu_s = time.process_time()
        store = await ha.open_store(state / "spotvisord.db")  # the pool's, read from etcd
        providers = ha.fenced(providers)  # no launch or terminate but after a fenced commit
    sup = Supervisor(config, providers=providers, store=store, policy=policy,
                     on_crash=None if ha is None else ha.on_task_crash)
    from daemon.feed.notify import Notifier  # the control extra's (main checked it is installed)

    notifier = Notifier(store, config.notify, pool=config.pool.name, redactor=redactor)  # the feed (daemon/feed/notify.py): its own thread
    sup.subscribe(notifier.wake)  # record() hands a wake to the feed's loop; it never waits for a sink
    def new_api() -> ApiServer:
        return ApiServer(sup, agent_host=config.daemon.agent_host, agent_port=config.daemon.agent_port,
                         socket_path=str(config.daemon.socket_path()), ssl_context=None if tls is None else tls.context)

    api = new_api()
    try:
        if ha is None:
            await api.start()
        else:  # the daemon that led before may hold the agent port for its last seconds (same host)
            api = await _bind_retrying(api, new_api, timeout_s=HANDOVER_BIND_S)
        assert api.agent_url is not None
        if job_secrets:
            check_channel(api.agent_url)  # SecretError: never in plain HTTP beyond loopback
        await notifier.start()  # before the supervisor records anything: a new sink misses nothing of this run
        api.metrics.registry.register(notifier)  # type: ignore[arg-type]  # the sinks' backlog and shed counts
        await sup.start(agent_url=api.agent_url, agent_ca_pem=None if tls is None else tls.ca_pem.decode(),
                        job_secrets=job_secrets, checked=checked)
        if ha is not None and ha.led_at is not None:  # a takeover's cost, for whoever sizes the lease
            took_s = asyncio.get_running_loop().time() - ha.led_at
            log.info("ha_serving", pool=config.pool.name, since_lead_s=round(took_s, 3),
                     cpu_s=round(time.process_time() - led_cpu_s, 3), checked_in_standby=checked is not None)
        if with_chaos and config.chaos:
            sup.spawn(run_chaos(sup, list(config.chaos), rendezvous=rendezvous), "chaos")
        yield sup
    finally:
        await sup.aclose()  # nothing is bought, terminated or admitted after this
        if ha is not None:  # the store's last sync (fenced), then the lease revoked: a standby leads at
            await ha.step_down()  # once, not after the feed's drain and the API's close below
        await notifier.aclose()  # up to 3 s to deliver what is queued (the final pool_released); joins its thread
        await api.aclose()
        if ha is not None:
            await ha.aclose()
        store.close()


#: seconds a new leader retries binding the agent port that is in use: the daemon that led
#: before hands over as soon as it stops acting and closes its listeners after (its feed's
#: drain first, 3 s at most); on one host, or with a floating address not yet moved, the
#: port is still its meanwhile
HANDOVER_BIND_S = 15.0


async def _bind_retrying(api: Any, new_api: Callable[[], Any], *, timeout_s: float) -> Any:
    """``api`` started, or if its port is in use (``EADDRINUSE``) a fresh one from ``new_api``
    started every 0.2 s, for up to ``timeout_s`` seconds; the one that bound. Raises the
    last ``OSError`` past the deadline (or any other at once)."""
    import errno

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            await api.start()
            return api
        except OSError as exc:
            await api.aclose()
            if exc.errno != errno.EADDRINUSE or asyncio.get_running_loop().time() > deadline:
                raise
            log.info("ha_agent_port_busy", error=str(exc)[:200])
        await asyncio.sleep(0.2)  # a retry's pace inside the deadline, not synchronisation
        api = new_api()


#: an HA standby runs the cloud check while it waits, every STANDBY_CHECK_EVERY_S seconds, and
#: a takeover uses the newest run if it is younger than STANDBY_CHECK_MAX_AGE_S: under load the
#: check took seconds of the takeover's budget (4.4 s, bench/ha_trials), and a permission or an
#: image gone since is caught by the gate's next run like any other failure
STANDBY_CHECK_EVERY_S = 120.0
STANDBY_CHECK_MAX_AGE_S = 300.0


async def _check_while_standing_by(config: Config, providers: Mapping[str, Any],
                                   latest: list[tuple[float, Any]]) -> None:
    """Run the cloud check now and every :data:`STANDBY_CHECK_EVERY_S` seconds until
    cancelled, keeping the newest run in ``latest`` as ``[(monotonic s, results)]``, and
    after the first run build the agent's wheel (a cloud pool's nodes install it). A check
    never raises for a failure (:func:`run_checks`); one that crashes is logged and leaves
    the leader to run its own."""
    from daemon.controlnode.cloud_probe import run_checks
    from daemon.providers.agent_wheel import AgentWheelError, own_wheel

    wheel = bool({o.provider for o in config.offers} - {"local"})  # a cloud's nodes install it at boot
    while True:
        try:
            results = await run_checks(config, providers)
        except Exception as exc:  # noqa: BLE001  the new leader's own run says what is wrong
            log.warning("standby_cloud_check_crashed", error=repr(exc)[:200])
            latest.clear()
        else:
            latest[:] = [(time.monotonic(), results)]
            log.info("standby_cloud_checked", failed=sum(not r.ok for r in results))
        if wheel:  # built now, the leader it becomes launches at once (daemon.providers.agent_wheel._MADE)
            wheel = False
            try:
                await asyncio.to_thread(own_wheel, config.daemon.agent_wheel,
                                        config.daemon.state_path() / "agent-wheel")
            except AgentWheelError as exc:  # the leader's own try says what is wrong
                log.warning("standby_agent_wheel_failed", error=str(exc)[:200])
        await asyncio.sleep(STANDBY_CHECK_EVERY_S)  # a refresh period, not synchronisation


#: what :func:`_daemon_in` imports when it runs (the feed's Notifier among them: the control
#: extra, checked by main before the daemon starts)
_START_MODULES = ("daemon.interfaces.api", "daemon.providers.chaos", "daemon.controlnode.supervisor",
                  "daemon.controlnode.tls", "daemon.controlnode.job_secrets", "daemon.feed.notify")


def _import_all(names: Sequence[str]) -> None:
    import importlib

    for name in names:
        importlib.import_module(name)


def _takeover_imports(config: Config) -> None:
    """Import what a new leader's start would import lazily (the pre-flight, the cloud
    check of each provider configured), so a takeover spends no CPU on it: on a loaded
    host that CPU is what stands between the lead and the first act."""
    names = ["daemon.controlnode.preflight"]
    kinds = {o.provider for o in config.offers}
    names += [f"daemon.providers.{k}_check" for k in ("aws", "aliyun") if k in kinds]
    _import_all(names)


@contextlib.contextmanager
def rendezvous_process(config: Config):
    """Start the rendezvous stores for a one-shot run, each as its own process: the first
    placement domain's, and every other ``local`` domain's (each has its own endpoint; a
    cloud domain's store runs on that domain's private network, not here). They end with
    this process however this one ends (SIGKILL included): each stops when its standard
    input, a pipe only this process holds the other end of, ends (``--exit-with-stdin``).
    Yields the first domain's (:class:`~daemon.controlnode.rendezvous.StoreProcess`)."""
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(_rendezvous_process(d.rendezvous))
                 for i, d in enumerate(config.domains_resolved()) if i == 0 or d.provider == "local"]
        yield procs[0]  # the first domain's


@contextlib.asynccontextmanager
async def rendezvous_stores(config: Config):
    """:func:`rendezvous_process` from a coroutine: the stores' start (a wait of up to
    30 s for each to listen) and stop (up to 10 s each) run in a thread, never on the
    event loop, which serves signals and the daemon meanwhile."""
    stores = rendezvous_process(config)
    store = await asyncio.to_thread(stores.__enter__)
    try:
        yield store
    finally:
        await asyncio.shield(asyncio.to_thread(stores.__exit__, None, None, None))


@contextlib.contextmanager
def _rendezvous_process(rdzv):
    from daemon.controlnode.rendezvous import StoreProcess

    store = StoreProcess(rdzv.host, rdzv.port)
    try:
        store.start()
        yield store
    finally:
        store.stop()


def format_event(ev: Event, t0: float) -> str:
    """One readable line for a person watching a run."""
    d = dict(ev.data)
    skip = {"trainer_time", "seen_at", "raw", "notice_published_at", "notice_seen_at"}
    fields = " ".join(f"{k}={_short(v)}{_signal_name(k, v)}" for k, v in d.items()
                      if k not in skip and v not in (None, [], ""))
    return f"[{ev.time - t0:7.1f}s] #{ev.seq:<4} {ev.kind:<24} {ev.node or '':<10} {fields}"


def _signal_name(key: str, value: object) -> str:
    """`` (SIGTERM)`` after a negative ``exit_code`` (a process a signal ended, as Python's
    ``returncode`` says it: an agent stopping a node after its notice's commit is -15),
    else empty."""
    if key != "exit_code" or not isinstance(value, int) or isinstance(value, bool) or value >= 0:
        return ""
    try:
        return f" ({signal.Signals(-value).name})"
    except ValueError:
        return ""


def _short(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return ",".join(map(str, v))
    return str(v)


async def _stopped_by_signal(run: Awaitable[int], out: Callable[[str], None]) -> int:
    """``run``'s exit code, or 128 + the signal's number once SIGINT or SIGTERM stopped it:
    the first cancels it (its cleanup runs: the store, the nodes, the lock), a second
    leaves at once (``KeyboardInterrupt``, as Python's own second Ctrl-C).

    The handlers are installed whatever this process inherited: a command started in the
    background of a non-interactive shell (``cmd &``, a CI runner, a test harness) gets
    SIGINT ignored, Python then installs no ``KeyboardInterrupt`` for it, and a demo sent
    SIGINT by pid ran on to its ``--timeout-s`` (``spotvisord run`` handles both signals the
    same way, :mod:`daemon.interfaces.service`). Without handlers, SIGTERM ended the demo
    at once, its cleanup skipped."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    got: list[int] = []

    def on_signal(sig: int) -> None:
        if got:
            raise KeyboardInterrupt  # the second: out of the loop, past any cleanup still running
        got.append(sig)
        task.cancel()

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await run
    except asyncio.CancelledError:
        if not got or task.uncancel() > 0:
            raise  # not ours: someone else cancelled it
        out(f"spotvisor demo: stopped by {signal.Signals(got[0]).name}")
        return 128 + got[0]
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def _demo(config: Config, summary_json: Path | None, timeout_s: float,
                out: Callable[[str], None], *, redactor: Redactor | None = None,
                config_path: str | None = None) -> int:
    from daemon.interfaces.demo_runner import gave_up, needs_runner

    t0 = time.time()
    if config.ha is not None:  # a demo starts from nothing: an old pool in etcd would be resumed, not started
        from daemon.ha.leading import pool_state_in_etcd

        if await pool_state_in_etcd(config.ha, config.pool.name):
            print(f"spotvisord demo: pool.name: etcd already holds the state of a pool {config.pool.name!r} "
                  f"(/spotvisor/{config.pool.name}/), which a demo would resume instead of starting; name another "
                  f"pool, or delete it: etcdctl del --prefix /spotvisor/{config.pool.name}/", file=sys.stderr)
            return 2
    if config_path is not None and needs_runner(config):  # the chaos kills the daemon: it runs as our child
        return await _demo_outside(config, config_path, summary_json, timeout_s, out, t0)
    async with rendezvous_stores(config) as store:
        async with contextlib.AsyncExitStack() as stack:
            ha = None
            if config.ha is not None:  # as `run`: stand by until it leads, end (1) once it leads no more
                from daemon.ha.leading import Leadership

                ha = await stack.enter_async_context(Leadership(
                    config.ha, config.pool.name, on_standby=lambda line: out(f"spotvisor demo: {line}")))
            sup = await stack.enter_async_context(running_daemon(config, rendezvous=store, redactor=redactor, ha=ha))
            ended = asyncio.Event()  # the job failed or was cancelled, its pool released

            def show(ev: Event) -> None:
                out(format_event(ev, t0))
                if gave_up(ev):
                    ended.set()

            sup.subscribe(show)
            out(f"spotvisor demo: pool {config.pool.name}, {config.pool.target_nodes} nodes, "
                f"target {_target(config)}, state in {config.daemon.state_path()}")
            job = asyncio.create_task(_completed(sup), name="demo:job")
            lost = asyncio.create_task(ha.lost.wait() if ha is not None else asyncio.Event().wait(), name="demo:lost")
            gone = asyncio.create_task(ended.wait(), name="demo:ended")
            try:
                await asyncio.wait([job, lost, gone], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (job, lost, gone):
                    t.cancel()
                await asyncio.gather(job, lost, gone, return_exceptions=True)
            if ha is not None and ha.lost.is_set():
                out(f"spotvisor demo: {ha.reason}; stopped (fail closed: another daemon leads)")
                return 1
            if ended.is_set():
                out(f"spotvisor demo: the job ended without completing (the lines above say why); "
                    f"see {config.daemon.state_path()}/nodes/*/trainer.log")
                return 1
            if not job.done() or job.cancelled():
                out(f"spotvisor demo: the job did not complete within {timeout_s:g} s "
                    f"(step {sup.job.step}); see {config.daemon.state_path()}/nodes/*/trainer.log")
                return 1
            job.result()  # its error, if any
            events = sup.store.events()
    return _summary(config, events, t0, summary_json, out)


async def _demo_outside(config: Config, config_path: str, summary_json: Path | None, timeout_s: float,
                        out: Callable[[str], None], t0: float) -> int:
    """The demo as the daemon's service manager (:mod:`daemon.interfaces.demo_runner`)."""
    from daemon.interfaces.demo_runner import run_outside, with_fixed_agent_port

    config = with_fixed_agent_port(config)
    async with rendezvous_stores(config) as store:
        out(f"spotvisor demo: pool {config.pool.name}, {config.pool.target_nodes} nodes, "
            f"target {_target(config)}, state in {config.daemon.state_path()}; "
            "the daemon runs as a child (its chaos kills it), its log in daemon.log there")
        code, events = await run_outside(config, config_path, store=store, timeout_s=timeout_s, out=out,
                                         line=lambda ev: out(format_event(ev, t0)))
    if code != 0:
        return code
    return _summary(config, events, t0, summary_json, out)


def _target(config: Config) -> str:
    """The demo's header's target: a ``job.command`` script without ``job.target_steps``
    has its own (spotvisor reads no step of it)."""
    if config.job.command is not None and "target_steps" not in config.job.model_fields_set:
        return "the script's own"
    return f"{config.job.target_steps} steps"


def _summary(config: Config, events: list[Event], t0: float, summary_json: Path | None,
             out: Callable[[str], None]) -> int:
    """Print (and write) the demo's summary; its exit code."""
    from daemon.analysis.summary import summarize

    summary = summarize(config.daemon.state_path() / "nodes", events, target_steps=config.job.target_steps,
                        global_batch_size=config.job.global_batch_size, wall_s=time.time() - t0)
    released = next((e for e in reversed(events) if e.kind == EventKind.POOL_RELEASED.value), None)
    if released is not None and "cost_usd" in released.data:  # the pool's spot price x hours, at its release
        summary["spot_cost_usd"] = round(float(released.data["cost_usd"]), 4)
    out("summary:")
    for k, v in summary.items():
        if k == "migration_timeline":
            for i, move in enumerate(v, 1):
                out(f"  {'migration ' + str(i):<28} {_move_line(move)}")
            continue
        out(f"  {k:<28} {v}")
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        tmp = summary_json.with_name(summary_json.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(summary_json)
        out(f"summary written to {summary_json}")
    # a demo's state is a run dir under the configured one (_with_run_dir): spotctl looks under .spotvisor
    own = config.daemon.state_path().parent != Path(".spotvisor").resolve()
    out(f"logs: {config.daemon.state_path()}/nodes/<node>/trainer.log; the run's events: "
        f"spotctl {'--config <this config> ' if own else ''}events")
    # job.command: the user's script reports no step; its job completed (every torchrun exited 0)
    return 0 if config.job.command is not None or summary["steps_completed"] == config.job.target_steps else 1


async def _completed(sup: "Supervisor") -> None:
    """The job completed and its pool released."""
    await sup.wait_completed()
    await sup.wait_released()


def _move_line(m: dict) -> str:
    """One migration of the summary: where, why, and its parts in seconds."""
    def secs(key: str) -> str:
        return "?" if m.get(key) is None else f"{m[key]:.1f} s"

    size = "" if not m.get("bytes") else f", {m['bytes'] / 1e6:.0f} MB"
    return (f"{m.get('from')} -> {m.get('to')} ({m.get('reason')}), from the commit of step {m.get('commit_step')}: "
            f"boot {secs('boot_s')} (the job trained on), commit {secs('commit_s')}, copy {secs('copy_s')}{size}, "
            f"first step {secs('first_step_s')}; decision to first step {secs('decision_to_first_step_s')}, "
            f"training paused {secs('paused_s')}")


async def _run(config: Config, watchdog_s: float | None, *, redactor: Redactor | None = None) -> int:
    """The service: READY=1 once up, WATCHDOG=1 from this loop, STOPPING=1 on SIGTERM
    or once the pool is released (:mod:`daemon.interfaces.service`); the job is left running."""
    from daemon.interfaces.service import SdNotifier, on_usr1_dump_tasks, serve

    on_usr1_dump_tasks()  # kill -USR1: every task and what it waits on, in the log
    log.info("spotvisord_starting", pool=config.pool.name, socket=str(config.daemon.socket_path()))
    notifier = SdNotifier.from_env()
    if config.ha is None:
        return await serve(running_daemon(config, redactor=redactor, rendezvous=_runner_store(config)),
                           notifier=notifier, watchdog_interval_s=watchdog_s)
    return await _run_ha(config, watchdog_s, notifier, redactor=redactor)


def _runner_store(config: Config) -> "RunnerStore | None":
    """The rendezvous store of the outside runner this daemon is the child of (``spotvisord
    demo`` when its chaos kills the daemon: :data:`STORE_PID_FILE_ENV` names its pid file),
    for the chaos schedule's ``kill_store``; None under a service manager (the store is its
    own unit)."""
    from daemon.controlnode.rendezvous import RunnerStore
    from daemon.providers.local_instance import STORE_PID_FILE_ENV

    pid_file = os.environ.get(STORE_PID_FILE_ENV)
    if not pid_file:
        return None
    rdzv = config.domains_resolved()[0].rendezvous
    return RunnerStore(Path(pid_file), rdzv.host, rdzv.port)


async def _run_ha(config: Config, watchdog_s: float | None, notifier: "SdNotifier", *,
                  redactor: Redactor | None) -> int:
    """The service as one of the pool's HA daemons: a standby says so once (stderr and
    systemd's STATUS, READY=1 and the watchdog's pings while it waits), then serves once it
    leads. Leadership lost (lease, fence, a ``Deposed`` anywhere): the daemon stops at once,
    fail closed, and returns 1 after one line saying why (systemd ``Restart=`` starts it
    again, as a standby)."""
    from daemon.ha.fence import Deposed
    from daemon.ha.leading import Leadership
    from daemon.interfaces.service import serve

    assert config.ha is not None

    def standby(line: str) -> None:
        print(f"spotvisord run: {line}", file=sys.stderr, flush=True)
        notifier.ready(line)

    async with Leadership(config.ha, config.pool.name, on_standby=standby) as ha:
        # the daemon's start up to the lead (secrets, TLS, providers, imports, the store's mirror)
        # runs while this daemon stands by: what is left once it leads is short (on a loaded host,
        # that start after the lead stalled the keepalives until the lease was lost)
        daemon = running_daemon(config, redactor=redactor, ha=ha)
        entering = asyncio.create_task(daemon.__aenter__(), name="ha:prepare")
        try:
            leads = await _stand_by(ha, notifier, watchdog_s, entering)
        except BaseException:
            await _cancelled(entering)
            raise
        if not leads:
            await _cancelled(entering)
            return 0  # SIGTERM while a standby
        service = asyncio.create_task(serve(_entered(daemon, entering), notifier=notifier,
                                            watchdog_interval_s=watchdog_s), name="service")
        lost = asyncio.create_task(ha.lost.wait(), name="ha:lost")
        try:
            await asyncio.wait([service, lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if not ha.lost.is_set():
            try:
                return service.result()  # SIGTERM or the pool released; or its error
            except Deposed as exc:  # deposed while starting (the store refused a write)
                ha.depose(str(exc))
        service.cancel()  # fail closed: the supervisor stops, nothing more is asked of a provider
        with contextlib.suppress(asyncio.CancelledError, Deposed):
            await service
    print(f"spotvisord run: {ha.reason}; stopped (fail closed: another daemon leads; "
          "restart this one to stand by)", file=sys.stderr, flush=True)
    return 1


async def _cancelled(task: "asyncio.Task[Any]") -> None:
    """Cancel ``task`` and wait for it to end (its cleanup done), whatever it raises."""
    task.cancel()
    with contextlib.suppress(BaseException):  # noqa: BLE001  ended by us: its outcome is moot
        await task


@contextlib.asynccontextmanager
async def _entered(daemon: Any, entering: "asyncio.Task[Supervisor]") -> AsyncIterator["Supervisor"]:
    """``daemon`` (an async context manager) whose ``__aenter__`` runs as ``entering``:
    yields what it enters to, exits it as ``async with`` would."""
    sup = await entering
    try:
        yield sup
    except BaseException as exc:
        if not await daemon.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await daemon.__aexit__(None, None, None)


async def _stand_by(ha: "Leadership", notifier: "SdNotifier", watchdog_s: float | None,
                    entering: "asyncio.Task[Any] | None" = None) -> bool:
    """Wait until ``ha`` leads (True) or SIGTERM/SIGINT (False), pinging systemd's watchdog
    meanwhile (serve() pings once this daemon leads). ``entering``: the daemon's start,
    running meanwhile; its error ends the wait (raised here). With ``entering`` the
    election starts when the start asks to lead (:func:`_daemon_in`, once its imports,
    cloud clients and mirror are ready): a daemon that won first and prepared after held
    its lease through seconds of that work (``ha_loop_stalled`` under load, ``ha_serving``
    6-9 s after the lead)."""
    async def pings(interval_s: float) -> None:
        while True:
            notifier.send(WATCHDOG=1)
            await asyncio.sleep(interval_s)  # the ping period (systemd's WatchdogSec/2), not synchronisation

    stop, loop = asyncio.Event(), asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    async def led() -> None:
        if entering is not None:
            await ha.campaigning.wait()  # the start's own lead() (the one shared wait)
        await ha.lead()

    lead = asyncio.create_task(led(), name="ha:lead")
    others = [asyncio.create_task(stop.wait(), name="ha:signal")]
    if watchdog_s is not None:
        others.append(asyncio.create_task(pings(watchdog_s), name="ha:standby-pings"))
    try:
        await asyncio.wait([lead, others[0], *([entering] if entering is not None else [])],
                           return_when=asyncio.FIRST_COMPLETED)
        if entering is not None and entering.done() and not lead.done() and not stop.is_set():
            entering.result()  # its error (it cannot enter before the lead)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for t in [*others, lead]:
            if not t.done():
                t.cancel()
        await asyncio.gather(*others, lead, return_exceptions=True)
    if lead.cancelled():
        return False
    lead.result()  # its error, if any (the client's connect)
    return True


def _runner_overrides(config: Config, args: argparse.Namespace) -> Config:
    """``run``'s hidden options, given by the demo's runner: the run directory, the control
    socket and the ports it chose, and (``partition_leader``) the etcd endpoints of its
    partition's forwarders (:class:`daemon.ha.partition.Partition`)."""
    daemon = {k: v for k, v in (("state_dir", args.state_dir), ("socket", args.socket),
                                ("agent_port", args.agent_port)) if v is not None}
    if daemon:
        config = config.model_copy(update={"daemon": config.daemon.model_copy(update=daemon)})
    if args.rendezvous_port is not None:
        config = config.model_copy(
            update={"rendezvous": config.rendezvous.model_copy(update={"port": args.rendezvous_port})})
    if args.etcd_endpoints and config.ha is not None:  # the runner's partition: etcd through its forwarders
        config = config.model_copy(
            update={"ha": config.ha.model_copy(update={"endpoints": args.etcd_endpoints.split(",")})})
    return config


def _with_run_dir(config: Config) -> Config:
    """A demo starts from nothing: its own state dir under the configured one."""
    run_dir = config.daemon.state_path() / f"demo-{datetime.now():%Y%m%d-%H%M%S}"
    # the control socket stays where spotctl looks for it (the configured state dir)
    daemon = config.daemon.model_copy(update={"state_dir": str(run_dir), "socket": str(config.daemon.socket_path())})
    return config.model_copy(update={"daemon": daemon})


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spotvisord", description="spotvisor daemon")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check-config", help="validate a config file")
    c.add_argument("file")
    k = sub.add_parser("check", help="check the cloud side of a config (live, read-only: credentials, dry-run "
                                     "launches, images, quotas, checkpoint stores)")
    k.add_argument("file")
    k.add_argument("--timeout-s", type=float, default=60.0, help="seconds each check may take (default %(default)s)")
    r = sub.add_parser("run", help="run the daemon (systemd service)")
    r.add_argument("--config", required=True)
    for flag, kind in (("--state-dir", str), ("--socket", str), ("--agent-port", int), ("--rendezvous-port", int),
                       ("--etcd-endpoints", str)):
        r.add_argument(flag, type=kind, help=argparse.SUPPRESS)  # the demo's runner: its run dir, ports, partition
    d = sub.add_parser("demo", help="run the job on the local provider with its chaos schedule")
    d.add_argument("--config", default="configs/local.yaml")
    d.add_argument("--summary-json", type=Path)
    d.add_argument("--timeout-s", type=float, default=900.0)
    d.add_argument("--rendezvous-port", type=int, help="override rendezvous.port")
    z = sub.add_parser("rendezvous", help="run the c10d rendezvous store")
    z.add_argument("--host", default="127.0.0.1",
                   help="the one address to listen on (default %(default)s; on a cloud the control node's "
                        "private address, reachable from the job's nodes only)")
    z.add_argument("--port", type=int, default=29400, help="TCP port (default %(default)s; 0: a free one)")
    preflight_cli.add_parser(sub)
    return p


def _faked_clouds(env: Mapping[str, str]) -> set[str]:
    """The clouds whose API this process reaches at a local fake, by boto3's own setting
    (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_EC2``): their "instances" run on this machine."""
    return {"aws"} if env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL_EC2") else set()


#: the modules of the control extra (pyproject.toml) that running the daemon imports: the
#: feed's Slack sink, /metrics, the local provider's process trees
CONTROL_PACKAGES = ("slack_sdk", "prometheus_client", "psutil")


def _importable(name: str) -> bool:
    """Whether ``name`` can be imported here, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "rendezvous":
        from daemon.controlnode.rendezvous import main as rdzv_main

        # the one command of a control node that needs torch; found, not imported: a bad
        # --host or a taken port is said before torch's 2-3 s import
        if not _importable("torch"):
            print("spotvisord rendezvous: the store is torch.distributed's TCPStore, and torch is not "
                  "installed here; install it: pip install 'spotvisor[rendezvous]'", file=sys.stderr)
            return 2

        return rdzv_main(["--host", args.host, "--port", str(args.port)])
    if args.cmd == "preflight":
        return preflight_cli.run(args)
    path = args.file if args.cmd in ("check-config", "check") else args.config
    try:
        config = load_config(path)
    except ConfigError as exc:
        for line in exc.problems:  # file-level problems already name the file
            print(line if line.startswith(f"{path}:") else f"{path}: {line}", file=sys.stderr)
        return 2
    unreachable = loopback_problem(config, _faked_clouds(os.environ))
    if unreachable is not None:  # every node bought would be billed without ever registering
        print(f"{path}: {unreachable}", file=sys.stderr)
        return 2
    no_store = store_access_problem(config, _faked_clouds(os.environ), fs_type=mount_type)
    if no_store is not None:  # every node bought would fail its first commit
        print(f"{path}: {no_store}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        configure_logging(level="WARNING")  # on stderr: the check's own lines alone on stdout
        return _cloud_check(config, args.timeout_s, lambda s: print(s, flush=True))
    if args.cmd == "run":
        config = _runner_overrides(config, args)
    report, no_fit = preflight_cli.check_config_report(config)
    if args.cmd == "check-config":
        if not no_fit:
            print(f"{path}: ok (pool {config.pool.name}: {config.pool.min_nodes}..{config.pool.max_nodes} nodes, "
                  f"{len(config.offers)} offer(s), valid world sizes "
                  f"{config.job.valid_world_sizes(config.max_world_size())})")
        print("\n".join(report))
        from daemon.ha.modes import survival

        print("\n".join(survival(config)))
    if no_fit:  # the daemon would never buy a node: run and demo refuse too
        print(f"{path}: {no_fit}", file=sys.stderr)
        return 2
    if args.cmd == "check-config":
        return 0
    missing = [m for m in CONTROL_PACKAGES if not _importable(m)]
    if missing:  # a bare `pip install spotvisor` (a GPU node's, or a walkthrough step that left the extra out)
        print(f"spotvisord {args.cmd}: the control node's packages are not installed here ({', '.join(missing)}); "
              "install them: pip install 'spotvisor[control]'", file=sys.stderr)
        return 2
    from daemon.feed.sinks import resolve_sinks

    redactor = Redactor()  # this process's secrets: the feed's URLs, then the job's values
    try:
        resolve_sinks(config.notify, redactor=redactor)  # the feed's URLs and keys come from the environment
    except ConfigError as exc:
        for line in exc.problems:
            print(f"{path}: {line}", file=sys.stderr)
        return 2
    from daemon.interfaces.listener import agent_connection_caps

    try:  # the agent port's connection caps come from the open-file limit
        agent_connection_caps(config.pool.max_nodes)
    except ValueError as exc:
        print(f"spotvisord {args.cmd}: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "run":
        from daemon.interfaces.service import watchdog_interval_s

        try:
            watchdog_s = watchdog_interval_s()  # systemd's WatchdogSec=, as $WATCHDOG_USEC
        except ValueError as exc:
            print(f"spotvisord run: {exc}", file=sys.stderr)
            return 2
        configure_logging(redactor=redactor)
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(state_dir_lock(config.daemon.state_path()))
            except OSError as exc:
                print(f"spotvisord run: {_state_dir_problem(config, exc)}", file=sys.stderr)
                return 2
            try:
                return asyncio.run(_run(config, watchdog_s, redactor=redactor))
            except SecretError as exc:  # one line naming the secret and its source, never its value
                print(f"spotvisord run: {exc}", file=sys.stderr)
                return exc.exit_code
            except (StateDirError, WorkdirError, DeadlineError) as exc:  # a planted file, a workdir, a late deadline
                print(f"spotvisord run: {exc}", file=sys.stderr)
                return 2
            except OSError as exc:  # e.g. the agent port is taken, the socket's directory is not writable
                print(f"spotvisord run: {exc}", file=sys.stderr)
                return 1
    from daemon.interfaces.demo_runner import needs_runner

    configure_logging(level="WARNING" if args.cmd == "demo" else None, redactor=redactor)
    if args.rendezvous_port:
        config = config.model_copy(
            update={"rendezvous": config.rendezvous.model_copy(update={"port": args.rendezvous_port})})
    with contextlib.ExitStack() as held:
        try:  # the configured directory (the demo's control socket is there), then its run dir under it
            held.enter_context(state_dir_lock(config.daemon.state_path()))
            config = _with_run_dir(config)
            if not needs_runner(config):  # else the daemon, our child, holds its run dir's
                held.enter_context(state_dir_lock(config.daemon.state_path()))
        except OSError as exc:
            print(f"spotvisord demo: {_state_dir_problem(config, exc)}", file=sys.stderr)
            return 2
        try:
            out = functools.partial(print, flush=True)
            return asyncio.run(_stopped_by_signal(_demo(config, args.summary_json, args.timeout_s, out,
                                                        redactor=redactor, config_path=path), out))
        except SecretError as exc:
            print(f"spotvisord demo: {exc}", file=sys.stderr)
            return exc.exit_code
        except (StateDirError, WorkdirError, DeadlineError) as exc:
            print(f"spotvisord demo: {exc}", file=sys.stderr)
            return 2
        except (RuntimeError, OSError) as exc:
            print(f"spotvisord demo: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130


def _cloud_kwargs(config: Config, name: str) -> dict[str, Any]:
    """A cloud provider launches each offer with its domain's spec (daemon/launchspec.py)
    and searches every offer's region (a restarted daemon finds its instances at once);
    the daemon and ``spotvisord check`` make theirs alike, so the check tries the very
    requests the daemon would send."""
    if name == "local":  # each instance its own GPUs, if this machine has enough for the largest pool
        return {"gpus_needed": config.pool.max_nodes * max(o.gpus_per_node for o in config.offers
                                                           if o.provider == "local")}
    return {"launch_spec": config.launch_spec,
            "regions": sorted({o.region for o in config.offers if o.provider == name})}


def _cloud_check(config: Config, timeout_s: float, out: Callable[[str], None]) -> int:
    """``spotvisord check``: every check's line, then exit 0 (all ok) or 1 (any FAIL)."""
    from daemon.controlnode.cloud_check import render_all
    from daemon.controlnode.cloud_probe import check_secrets, run_checks

    async def checks() -> list:
        clouds = {name: create_provider(name, spec=getattr(config.providers, name), agent_args=[],
                                        **_cloud_kwargs(config, name))
                  for name in sorted({o.provider for o in config.offers} & {"aws", "aliyun"})}
        try:
            found = await run_checks(config, clouds.get, timeout_s=timeout_s)  # type: ignore[arg-type]
            return [*found, *await check_secrets(config, timeout_s)]
        finally:
            for p in clouds.values():
                await p.aclose()

    import logging

    # the ECS SDK logs every error answer at ERROR, a dry run's DryRunOperation included: the lines say it all
    logging.getLogger("aliyunsdkcore").setLevel(logging.CRITICAL)
    try:
        results = asyncio.run(checks())
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        out(f"FAIL spotvisord check: {type(exc).__name__}: {str(exc)[:300]}; fix: see the message")
        return 1
    lines = render_all(results)
    for line in lines:
        out(line)
    bad, skipped = (sum(line.startswith(w) for line in lines) for w in ("FAIL", "skip"))
    unsaid = f", {skipped} not checked" if skipped else ""
    out(f"{bad} of {len(lines)} checks failed{unsaid}" if bad else
        f"{len(lines) - skipped} checks ok{unsaid}" if skipped else f"all {len(lines)} checks ok")
    return 1 if bad else 0


def _state_dir_problem(config: Config, exc: Exception) -> str:
    """One line for a state directory that cannot be locked or made."""
    if isinstance(exc, StateDirError):
        return str(exc)
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"daemon.state_dir {config.daemon.state_path()}: {reason}; give a directory this user can write"


if __name__ == "__main__":
    sys.exit(main())
