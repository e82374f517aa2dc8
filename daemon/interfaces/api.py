"""HTTP APIs of the daemon (aiohttp).

- **Agent port** (TCP; TLS unless it listens on loopback, ``daemon.agent_tls``:
  :mod:`daemon.controlnode.tls`): node agents register, heartbeat, long-poll for commands
  and report. Each request carries ``Authorization: Bearer <token>``, the node's own
  token issued at launch; a wrong or missing token gets 401. With ``job.secrets``, a request
  that came in plain HTTP from a non-loopback address gets 403: the replies carry the
  secrets (:mod:`daemon.controlnode.job_secrets`).

  ========================================  ==============================================
  ``POST /v1/agent/register``               the job spec and ``heartbeat_interval_s``
  ``POST /v1/agent/heartbeat``              step, trainer state, GPU means (:mod:`daemon.gpunode.gpu`),
                                            a ``trainer.log`` chunk (:mod:`daemon.gpunode.nodelog`);
                                            the reply: commands, start/stop, the next
                                            ``heartbeat_interval_s`` (it grows with the pool)
  ``POST /v1/agent/commands``               ``{"wait_s": N}``: held until the node has a
                                            command (or its start/stop decision changed),
                                            at most N s (capped at ``agent.command_wait_s``,
                                            300 s, at a random share: spread re-polls); then the commands
  ``POST /v1/agent/events``                 ``{"events": [...]}``: the agent's reports
  ========================================  ==============================================
  What one peer may spend there is bounded (issue 25): connections, total and per address,
  sized from ``RLIMIT_NOFILE`` (:mod:`daemon.interfaces.listener`); a request's head within
  ``FIRST_REQUEST_S`` of connecting, its body within ``BODY_READ_S`` and at most
  :data:`~daemon.control.bounds.MAX_AGENT_BODY_BYTES` (413 beyond); an idle connection closed after ``KEEPALIVE_S``;
  reports per node by rate, per POST by count (:mod:`daemon.controlnode.report_limits`); a
  stopping daemon waits ``SHUTDOWN_S`` (1 s) for a request in flight, then cancels it.
- **Control socket** (unix, mode 0660): what ``spotctl`` uses. Errors are
  ``{"error": "<one line>"}`` with 400 (bad request), 404 (unknown node) or 409
  (not possible now); spotctl prints the line and exits 2. ``{id}`` is a node id of the
  form :data:`daemon.model.NODE_ID_RE` (else 400); ``SEQ`` a whole number in 0..2^63-1;
  ``S`` seconds in (0, :data:`daemon.model.MAX_NOTICE_LEAD_S`] (a day).

  ========================================  ==============================================
  ``GET /v1/status``                        job (state, step, durations, recoveries, progress:
                                            steps/s, tokens/s, loss, expected finish, deadline
                                            slack, goodput), pool,
                                            nodes (with their GPU sample)
  ``GET /v1/events?since=SEQ&kind=K``       NDJSON, one event per line; ``&follow=1`` keeps
                                            the response open and streams new events
  ``GET /v1/nodes/{id}/log?lines=N``        NDJSON ``{"seq", "line"}``: the node's last N
                                            trainer.log lines as the daemon holds them
                                            (limits: :mod:`daemon.gpunode.nodelog`); ``&follow=1``
                                            streams new lines until the node has terminated
  ``GET /v1/cost``                          spot USD so far, on-demand equivalent, savings
                                            (:func:`daemon.controlnode.metrics.cost_report`)
  ``GET /metrics``                          Prometheus text exposition (:mod:`daemon.controlnode.metrics`)
  ``POST /v1/checkpoint``                   the job commits at its next step boundary
  ``POST /v1/nodes/{id}/drain``             the node commits, then leaves the job
  ``POST /v1/scale`` ``{"nodes": N}``       the pool's target size, within min..max
  ``POST /v1/pause`` / ``POST /v1/resume``  commit and release every node / relaunch (a paused,
                                            failed or cancelled job)
  ``POST /v1/down``                         commit, release every node, end the job cancelled
  ``POST /v1/nodes/{id}/simulate-preemption``  ``{"lead_s": S}``: local provider only, an
                                            interruption notice on the node's metadata
                                            endpoint, as :mod:`daemon.providers.chaos` publishes it
  ========================================  ==============================================

- **Metrics port** (TCP, optional): ``daemon.metrics_port`` serves ``GET /metrics`` on
  ``daemon.metrics_host`` (127.0.0.1, or a private address: it has no authentication, the
  config refuses any other) for a Prometheus scraper (0 = any free port, see
  ``metrics_url``). Its connections are bounded as the agent port's are
  (:data:`~daemon.interfaces.listener.METRICS_CAPS`, the first-request and keep-alive
  timeouts); a request body is never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from daemon.control.bounds import MAX_AGENT_BODY_BYTES, ConnectionCaps
from daemon.control.reports import ReportError, parse_agent
from daemon.controlnode.metrics import (TIMELINE_KINDS, DaemonMetrics, cost_report, egress_usd, job_timeline,
                                        node_gpu_view)
from daemon.model import MAX_EVENT_SEQ, MAX_NOTICE_LEAD_S, EventKind, JobState, Node, NodeState, is_node_id
from daemon.state_dir import chmod_socket, clear_stale_socket
from daemon.controlnode.job_secrets import private_channel
from daemon.controlnode.progress_view import job_progress
from daemon.controlnode.store import NotLeading
from daemon.controlnode.supervisor import Supervisor
from daemon.interfaces.listener import (BODY_READ_S, FIRST_REQUEST_S, KEEPALIVE_S, METRICS_CAPS, SHUTDOWN_S,
                                        AgentListener, LoopAcceptErrors, agent_connection_caps)

__all__ = ["agent_app", "control_app", "ApiServer"]

log = structlog.get_logger("spotvisor.api")

SUPERVISOR = web.AppKey("supervisor", Supervisor)
# how long a report batch's answer waits for the commits it reported to be decided
# (seconds; under the agent's 10 s request timeout, so a slow store never makes it resend)
REPORT_SETTLE_S = 8.0
METRICS = web.AppKey("metrics", DaemonMetrics)
# a follower gets an empty line after this long without news (seconds): the write is how a
# gone reader is noticed, so an abandoned `events -f` / `tail -f` does not hold a handler forever
_FOLLOW_POLL_S = 15.0
# a log follower looks this often whether its node has terminated (seconds)
_TERMINAL_CHECK_S = 1.0
_TAIL_MAX_LINES = 10_000


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _agent_body(request: web.Request) -> tuple[Any, dict[str, Any]]:
    sup = request.app[SUPERVISOR]
    try:
        async with asyncio.timeout(BODY_READ_S):  # a body trickled in byte by byte ends here
            raw = await request.read()  # at most MAX_AGENT_BODY_BYTES: 413 beyond
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the body did not arrive within {BODY_READ_S:g} s") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise web.HTTPBadRequest(text="body must be JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    auth = request.headers.get("Authorization", "")
    token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
    node = sup.agents.authenticate(str(body.get("node_id", "")), token)
    if node is None:
        raise web.HTTPUnauthorized(text="unknown node or bad token")
    if sup.secrets and not private_channel(secure=request.secure, peer=request.remote):
        # a reply may carry the job's secrets (the spec, a restart command): never in plain HTTP beyond loopback
        log.error("agent_plain_http_refused", node_id=node.id, peer=request.remote)
        raise web.HTTPForbidden(text="this daemon hands out job secrets over TLS or loopback only")
    return node, body


async def _told(sup: Supervisor, node: Node, reply: dict[str, Any]) -> web.Response:
    """``reply`` to ``node``'s agent once the state it follows from is durable where the
    pool's next daemon reads it (:meth:`Store.durable`): a start, an admission or a
    command is acted on only if the decision behind it survives this daemon. A daemon
    that leads no more (HA: its lease ran out, its fence was refused) or cannot commit
    (etcd out of reach) answers 503, telling nothing (:meth:`~daemon.controlnode.agent_link.AgentLink.withdraw` puts the
    reply's commands back); the agent asks again, and a new leader answers it from its own
    state."""
    try:
        await sup.store.durable()
    except NotLeading as exc:
        sup.agents.withdraw(node, reply)
        log.warning("agent_reply_withheld", node_id=node.id, reason="not_leading", error=str(exc))
        raise web.HTTPServiceUnavailable(text="this daemon does not lead its pool: ask again") from None
    except Exception as exc:  # noqa: BLE001  the HA store's etcd errors: not durable, so not told
        sup.agents.withdraw(node, reply)  # told at the next poll, once durable
        log.warning("agent_reply_withheld", node_id=node.id, reason="not_durable", error=repr(exc)[:200])
        raise web.HTTPServiceUnavailable(text="the pool's state is not durable yet: ask again") from None
    return web.json_response(reply)


async def _register(request: web.Request) -> web.Response:
    node, body = await _agent_body(request)
    sup = request.app[SUPERVISOR]
    return await _told(sup, node, sup.agents.on_register(node, prewarm=body.get("prewarm") is True))


async def _heartbeat(request: web.Request) -> web.Response:
    node, body = await _agent_body(request)
    sup = request.app[SUPERVISOR]
    return await _told(sup, node, sup.agents.on_heartbeat(node, body))


async def _commands(request: web.Request) -> web.Response:
    """The command long-poll (:meth:`Supervisor.wait_commands`)."""
    node, body = await _agent_body(request)
    wait_s = body.get("wait_s", 0.0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not wait_s >= 0:
        raise web.HTTPBadRequest(text="wait_s must be a number of seconds >= 0")

    def connected() -> bool:
        transport = request.transport
        return transport is not None and not transport.is_closing()

    sup = request.app[SUPERVISOR]
    reply = await sup.agents.wait_commands(node, float(wait_s), connected=connected)
    if reply is None:  # superseded by a newer poll, its client gone, or the daemon closing: nothing taken
        raise web.HTTPServiceUnavailable(text="this long-poll was given up; poll again")
    return await _told(sup, node, reply)


async def _reports(request: web.Request) -> web.Response:
    node, body = await _agent_body(request)
    events = body.get("events")
    if not isinstance(events, list):
        raise web.HTTPBadRequest(text="events must be a list")
    try:
        agent = parse_agent(body.get("agent"))
    except ReportError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None
    sup = request.app[SUPERVISOR]
    sup.intake.on_reports(node, events, agent)
    # a reported commit is recorded once verified (daemon.verify_commits), a resume once
    # its commit is: answered before that, a SIGKILL in between lost the report (the agent
    # never resends an answered one)
    if not await sup.tracker.settled(node.id, REPORT_SETTLE_S):
        log.warning("reports_answered_unsettled", node_id=node.id, timeout_s=REPORT_SETTLE_S)
    # and only once what they changed is durable where the next daemon reads it (HA: etcd);
    # else 503: the agent sends the batch again, and the reports applied already are left
    # out by their numbers (Intake.on_reports)
    return await _told(sup, node, {"ok": True})


@web.middleware
async def _request_started(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    AgentListener.request_started(request.transport)  # its connection's first-request timer stops
    return await handler(request)


def agent_app(sup: Supervisor) -> web.Application:
    app = web.Application(client_max_size=MAX_AGENT_BODY_BYTES, middlewares=[_request_started])
    app[SUPERVISOR] = sup
    app.router.add_post("/v1/agent/register", _register)
    app.router.add_post("/v1/agent/heartbeat", _heartbeat)
    app.router.add_post("/v1/agent/commands", _commands)
    app.router.add_post("/v1/agent/events", _reports)
    return app


# -- control socket: reads ---------------------------------------------------------------------
async def _status(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    status = sup.status()
    status["job"].update(job_timeline(sup.store.events(kinds=TIMELINE_KINDS), sup.clock()).to_dict())
    metrics = request.app[METRICS]
    metrics.refresh()  # the lost steps so far, for goodput
    status["job"]["progress"] = job_progress(sup, sup.clock(), metrics.lost_steps)
    for n in status["nodes"]:
        n["gpu"] = None if NodeState(n["state"]).is_terminal() else node_gpu_view(sup, n["id"])
    return web.json_response(status)


async def _events(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:  # not an integer (or one of more than 4,300 digits)
        since = -1
    if not 0 <= since <= MAX_EVENT_SEQ:
        return _error(400, f"since must be an event seq, a whole number in 0..{MAX_EVENT_SEQ}")
    kinds = [k for k in request.query.getall("kind", []) if k]
    follow = request.query.get("follow") in ("1", "true")
    resp: web.StreamResponse | None = None
    while True:
        # an event is shown only once it is durable where the pool's next daemon reads it
        # (HA: committed under the fence), so no reader ever saw an event a takeover loses
        upto = sup.store.last_seq()
        try:
            await sup.store.durable()
        except Exception as exc:  # noqa: BLE001  NotLeading, or the HA store's etcd errors
            log.warning("events_not_durable", error=repr(exc)[:200])
            if resp is None:
                return _error(503, "this daemon's events are not durable (it no longer leads, or etcd is out of "
                                   "reach): ask again, or ask the daemon that leads")
            break  # a follower reconnects with ?since= and gets the rest from the daemon that leads
        if resp is None:
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
        for ev in sup.store.events(since=since, kinds=kinds):
            if ev.seq > upto:
                break
            await resp.write((json.dumps(ev.to_dict()) + "\n").encode())
        since = max(since, upto)
        if not follow:
            break
        await sup.wait_for_events(since, timeout_s=_FOLLOW_POLL_S)
        if sup.store.last_seq() <= since:
            await resp.write(b"\n")  # keep-alive; readers skip empty lines
    await resp.write_eof()
    return resp


def _node(sup: Supervisor, node_id: str) -> Node | web.Response:
    """The node a ``/v1/nodes/{id}/...`` route names: 400 for a string that is not a node
    id (:data:`daemon.model.NODE_ID_RE`), 404 for one the pool does not have."""
    if not is_node_id(node_id):
        return _error(400, f"{node_id[:80]!r} is not a node id (letters, digits, '.', '_', '-'; "
                           "as `spotctl nodes` shows them)")
    node = sup.nodes.get(node_id)
    if node is None:
        known = ", ".join(n.id for n in sup.nodes.values() if not n.state.is_terminal()) or "none"
        return _error(404, f"no node {node_id!r} (live nodes: {known})")
    return node


async def _log(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]
    node = _node(sup, request.match_info["node_id"])
    if isinstance(node, web.Response):
        return node
    try:
        lines = int(request.query.get("lines", "10"))
    except ValueError:
        return _error(400, "lines must be an integer")
    if not 0 <= lines <= _TAIL_MAX_LINES:
        return _error(400, f"lines must be within 0..{_TAIL_MAX_LINES}")
    follow = request.query.get("follow") in ("1", "true")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    logs = sup.agents.node_logs
    batch = logs.tail(node.id, lines)
    seq = batch[-1].seq if batch else logs.last_seq(node.id)
    quiet_s = 0.0
    while True:
        for ln in batch:
            await resp.write((json.dumps(ln.to_dict()) + "\n").encode())
        if not follow or (node.state.is_terminal() and logs.last_seq(node.id) <= seq):
            break  # a terminated node's agent is gone: its log ends here
        await logs.wait(node.id, seq, timeout_s=_TERMINAL_CHECK_S)
        batch = logs.since(node.id, seq)
        if batch:
            seq, quiet_s = batch[-1].seq, 0.0
        elif (quiet_s := quiet_s + _TERMINAL_CHECK_S) >= _FOLLOW_POLL_S:
            await resp.write(b"\n")  # keep-alive; readers skip empty lines
            quiet_s = 0.0
    await resp.write_eof()
    return resp


async def _cost(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    return web.json_response(cost_report(list(sup.nodes.values()), sup.config.offers, sup.clock(),
                                         egress_usd=egress_usd(sup.store)))


# -- control socket: actions -------------------------------------------------------------------
async def _json_body(request: web.Request) -> dict[str, Any] | web.Response:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the request body must be JSON")
    return body if isinstance(body, dict) else _error(400, "the request body must be a JSON object")


def _trainer_reports(sup: Any) -> bool:
    """False for a ``job.command`` script that has reported no step and no commit: the
    daemon cannot tell that it commits on request, or what it resumes from (a plain
    script reads neither spotvisor's requests nor its store; one with the HF callback
    or the trainer library reports both)."""
    job = sup.job
    return sup.config.job.command is None or job.step is not None or job.last_commit_step is not None


async def _checkpoint(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    rid = sup.operator.request_checkpoint("manual")
    if rid is None:
        return _error(409, "no node is running the job's trainer; nothing to checkpoint")
    return web.json_response({"request_id": rid, "trainer_reports": _trainer_reports(sup)})


async def _drain(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    node = _node(sup, request.match_info["node_id"])
    if isinstance(node, web.Response):
        return node
    if node.state.is_terminal():
        return _error(409, f"node {node.id} is already {node.state.value}")
    sup.operator.drain(node, "operator")
    return web.json_response({"node": node.id, "state": node.state.value})


async def _scale(request: web.Request) -> web.Response:
    body = await _json_body(request)
    if isinstance(body, web.Response):
        return body
    nodes = body.get("nodes")
    if not isinstance(nodes, int) or isinstance(nodes, bool):
        return _error(400, "give the target size as {\"nodes\": N}, N an integer")
    try:
        return web.json_response(request.app[SUPERVISOR].operator.scale(nodes))
    except ValueError as exc:
        return _error(409, str(exc))


async def _pause(request: web.Request) -> web.Response:
    try:
        return web.json_response(request.app[SUPERVISOR].operator.pause())
    except ValueError as exc:
        return _error(409, str(exc))


async def _resume(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    try:  # a failed or cancelled job is the job life's (daemon/controlnode/job_life.py); a paused one the operator's
        reply = sup.life.resume() if sup.job.state in (JobState.FAILED, JobState.CANCELLED) else sup.operator.resume()
        return web.json_response({**reply, "trainer_reports": _trainer_reports(sup)})
    except ValueError as exc:
        return _error(409, str(exc))


async def _down(request: web.Request) -> web.Response:
    try:
        return web.json_response(request.app[SUPERVISOR].life.down())
    except ValueError as exc:
        return _error(409, str(exc))


async def _simulate_preemption(request: web.Request) -> web.Response:
    """Publish an interruption notice on a local node's metadata endpoint (as ``chaos`` does);
    the local provider reclaims the node ``lead_s`` seconds later, as a cloud would."""
    sup = request.app[SUPERVISOR]
    node = _node(sup, request.match_info["node_id"])
    if isinstance(node, web.Response):
        return node
    body = await _json_body(request)
    if isinstance(body, web.Response):
        return body
    lead_s = body.get("lead_s", 30.0)
    if isinstance(lead_s, bool) or not isinstance(lead_s, (int, float)) or not 0 < lead_s <= MAX_NOTICE_LEAD_S:
        return _error(400, f"lead_s must be a number of seconds in (0, {MAX_NOTICE_LEAD_S:g}]")
    provider = sup.fleet.provider_for(node.provider)
    publish = getattr(provider, "publish_interruption", None)
    if provider.name != "local" or publish is None:
        return _error(400, f"simulate-preemption works only on the local provider; node {node.id} runs on "
                           f"{provider.name!r} (on a cloud, use its own fault injection, e.g. AWS FIS)")
    if node.state.is_terminal() or node.instance_id is None:
        return _error(409, f"node {node.id} is {node.state.value}: it has no instance to preempt")
    published = getattr(provider, "notice_published_at", lambda _: None)(node.instance_id)
    if node.state is NodeState.DRAINING or published is not None:
        since = "" if published is None else f" since {time.strftime('%H:%M:%S', time.localtime(published))}"
        return _error(409, f"node {node.id} already has an interruption notice{since} and is leaving the job")
    try:
        deadline = await publish(node.instance_id, lead_s=float(lead_s))
    except (KeyError, RuntimeError) as exc:  # gone meanwhile, or not booted yet
        return _error(409, f"node {node.id}: {exc.args[0] if exc.args else exc}")
    sup.record(EventKind.CHAOS_INJECTED, node.id, action="notice", source="operator", lead_s=float(lead_s),
               deadline=deadline.isoformat(), step=sup.job.step)
    return web.json_response({"node": node.id, "deadline": deadline.timestamp(), "lead_s": float(lead_s)})


@web.middleware
async def _durable_actions(request: web.Request, handler: Any) -> web.StreamResponse:
    """An operator's action (a POST) is acknowledged only once what it changed is durable
    where the pool's next daemon reads it (:meth:`Store.durable`; HA: committed under the
    leader's fence, not left in the outbox a kill would lose). Otherwise 503 with one line:
    the action may not hold, so the operator asks again (every action here is a target or
    a request, asked again to the same effect)."""
    response = await handler(request)
    if request.method != "POST" or not 200 <= response.status < 300:
        return response
    try:
        await request.app[SUPERVISOR].store.durable()
    except NotLeading:
        return _error(503, "this daemon no longer leads its pool: the action may not hold; ask the daemon that leads")
    except Exception as exc:  # noqa: BLE001  the HA store's etcd errors
        log.warning("operator_action_not_durable", path=request.path, error=repr(exc)[:200])
        return _error(503, "the action is not durable yet (etcd out of reach): check `spotctl status` and ask again")
    return response


def control_app(sup: Supervisor, metrics: DaemonMetrics | None = None) -> web.Application:
    metrics = metrics if metrics is not None else DaemonMetrics(sup)
    app = web.Application(middlewares=[_durable_actions])
    app[SUPERVISOR] = sup
    app[METRICS] = metrics
    app.router.add_get("/v1/status", _status)
    app.router.add_get("/v1/events", _events)
    app.router.add_get("/v1/cost", _cost)
    app.router.add_get("/v1/nodes/{node_id}/log", _log)
    app.router.add_get("/metrics", metrics.handler)
    app.router.add_post("/v1/checkpoint", _checkpoint)
    app.router.add_post("/v1/nodes/{node_id}/drain", _drain)
    app.router.add_post("/v1/nodes/{node_id}/simulate-preemption", _simulate_preemption)
    app.router.add_post("/v1/scale", _scale)
    app.router.add_post("/v1/pause", _pause)
    app.router.add_post("/v1/resume", _resume)
    app.router.add_post("/v1/down", _down)
    return app


def metrics_app(metrics: DaemonMetrics) -> web.Application:
    """``GET /metrics`` alone; the request's head starts its connection's clock
    (:class:`~daemon.interfaces.listener.AgentListener`), a body is never read."""
    app = web.Application(client_max_size=1024, middlewares=[_request_started])
    app.router.add_get("/metrics", metrics.handler)
    return app


class ApiServer:
    """The daemon's listeners: agent port, control socket, and (with ``daemon.metrics_port``)
    the metrics port. ``start()`` binds; ``agent_url`` and ``metrics_url`` are known after
    it; ``aclose()`` is idempotent and stops them in reverse order. ``ssl_context``: the
    agent port speaks TLS with it (``https://`` agent URL; :mod:`daemon.controlnode.tls`)."""

    def __init__(self, sup: Supervisor, *, agent_host: str, agent_port: int, socket_path: str,
                 ssl_context: ssl.SSLContext | None = None, caps: ConnectionCaps | None = None,
                 first_request_s: float = FIRST_REQUEST_S) -> None:
        self.sup = sup
        self.agent_host = agent_host
        self.agent_port = agent_port
        self.ssl_context = ssl_context
        self.socket_path = socket_path
        self.caps = caps  # None: from RLIMIT_NOFILE at start (daemon.interfaces.listener)
        self.first_request_s = first_request_s
        self.metrics = DaemonMetrics(sup)  # this daemon's own registry
        self._runners: list[web.AppRunner] = []
        self.listener: AgentListener | None = None
        self.metrics_listener: AgentListener | None = None
        self._accept_errors = LoopAcceptErrors()
        self.agent_url: str | None = None
        self.metrics_url: str | None = None
        self._socket_ino: int | None = None

    async def start(self) -> None:
        """Bind the listeners. Raises ValueError: the open-file limit is too low for the
        agent port (:func:`~daemon.interfaces.listener.agent_connection_caps`); OSError: a
        listener cannot bind."""
        caps = self.caps if self.caps is not None else agent_connection_caps(self.sup.config.pool.max_nodes)
        self._accept_errors.install()
        agent = web.AppRunner(agent_app(self.sup), access_log=None, keepalive_timeout=KEEPALIVE_S,
                              shutdown_timeout=SHUTDOWN_S)
        await agent.setup()
        self._runners.append(agent)
        assert agent.server is not None
        self.listener = AgentListener(agent.server, caps=caps, ssl_context=self.ssl_context,
                                      first_request_s=self.first_request_s)
        port = await self.listener.start(self.agent_host, self.agent_port)
        self.metrics.registry.register(self.listener)  # type: ignore[arg-type]  # a custom collector
        self.metrics.registry.register(self.sup.intake.limiter)  # type: ignore[arg-type]
        self.agent_url = f"{'http' if self.ssl_context is None else 'https'}://{self.agent_host}:{port}"

        control = web.AppRunner(control_app(self.sup, self.metrics), access_log=None, shutdown_timeout=SHUTDOWN_S)
        await control.setup()
        self._runners.append(control)
        clear_stale_socket(Path(self.socket_path))  # a killed daemon's; anything else there is refused
        await web.UnixSite(control, self.socket_path).start()
        chmod_socket(Path(self.socket_path), 0o660)
        self._socket_ino = os.lstat(self.socket_path).st_ino  # aclose removes this socket, not a successor's

        spec = self.sup.config.daemon
        if spec.metrics_port is not None:  # loopback or a private address (the config refuses any other)
            runner = web.AppRunner(metrics_app(self.metrics), access_log=None, shutdown_timeout=SHUTDOWN_S,
                                   keepalive_timeout=KEEPALIVE_S)
            await runner.setup()
            self._runners.append(runner)
            assert runner.server is not None
            self.metrics_listener = AgentListener(runner.server, caps=METRICS_CAPS, name="metrics",
                                                  first_request_s=self.first_request_s)
            mport = await self.metrics_listener.start(spec.metrics_host, spec.metrics_port)
            host = f"[{spec.metrics_host}]" if ":" in spec.metrics_host else spec.metrics_host
            self.metrics_url = f"http://{host}:{mport}/metrics"

    async def aclose(self) -> None:
        for listener in (self.listener, self.metrics_listener):
            if listener is not None:
                await listener.aclose()  # no new connection from here on
        while self._runners:
            await self._runners.pop().cleanup()
        self._accept_errors.uninstall()
        # the control socket goes with the daemon (aiohttp leaves the file): spotctl then says
        # no daemon runs, and an ended demo's record is found; a socket bound there since is left
        with contextlib.suppress(OSError):
            if self._socket_ino is not None and os.lstat(self.socket_path).st_ino == self._socket_ino:
                os.unlink(self.socket_path)
        self._socket_ino = None
