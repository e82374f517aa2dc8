"""HTTP APIs of the daemon (aiohttp).

- **Agent port** (TCP): node agents register, heartbeat and report. Each request
  carries ``Authorization: Bearer <token>``, the node's own token issued at launch;
  a wrong or missing token gets 401.
- **Control socket** (unix, mode 0660): what ``spotctl`` reads.
  ``GET /v1/status`` → job line + nodes; ``GET /v1/events?since=SEQ&kind=K&follow=1``
  → NDJSON, one event per line; with ``follow`` the response stays open and
  streams new events as they are recorded. ``POST /v1/checkpoint`` → the job
  commits at its next step boundary (409 if no trainer runs);
  ``POST /v1/nodes/{id}/drain`` → the node leaves the job cleanly (404 unknown, 409 gone).
"""

from __future__ import annotations

import json
import os
from typing import Any

from aiohttp import web

from daemon.supervisor import Supervisor

__all__ = ["agent_app", "control_app", "ApiServer"]

SUPERVISOR = web.AppKey("supervisor", Supervisor)


async def _agent_body(request: web.Request) -> tuple[Any, dict[str, Any]]:
    sup = request.app[SUPERVISOR]
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="body must be JSON") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a JSON object")
    auth = request.headers.get("Authorization", "")
    token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
    node = sup.authenticate(str(body.get("node_id", "")), token)
    if node is None:
        raise web.HTTPUnauthorized(text="unknown node or bad token")
    return node, body


async def _register(request: web.Request) -> web.Response:
    node, _ = await _agent_body(request)
    return web.json_response(request.app[SUPERVISOR].on_register(node))


async def _heartbeat(request: web.Request) -> web.Response:
    node, body = await _agent_body(request)
    return web.json_response(request.app[SUPERVISOR].on_heartbeat(node, body))


async def _reports(request: web.Request) -> web.Response:
    node, body = await _agent_body(request)
    events = body.get("events")
    if not isinstance(events, list):
        raise web.HTTPBadRequest(text="events must be a list")
    request.app[SUPERVISOR].on_reports(node, events)
    return web.json_response({"ok": True})


def agent_app(sup: Supervisor) -> web.Application:
    app = web.Application()
    app[SUPERVISOR] = sup
    app.router.add_post("/v1/agent/register", _register)
    app.router.add_post("/v1/agent/heartbeat", _heartbeat)
    app.router.add_post("/v1/agent/events", _reports)
    return app


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SUPERVISOR].status())


async def _events(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]
    try:
        since = int(request.query.get("since", "0"))
    except ValueError:
        raise web.HTTPBadRequest(text="since must be an integer event seq") from None
    kinds = [k for k in request.query.getall("kind", []) if k]
    follow = request.query.get("follow") in ("1", "true")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    while True:
        for ev in sup.store.events(since=since, kinds=kinds):
            await resp.write((json.dumps(ev.to_dict()) + "\n").encode())
        since = max(since, sup.store.last_seq())
        if not follow:
            break
        await sup.wait_for_events(since, timeout_s=15.0)
    await resp.write_eof()
    return resp


async def _checkpoint(request: web.Request) -> web.Response:
    rid = request.app[SUPERVISOR].request_checkpoint("manual")
    if rid is None:
        return web.json_response({"error": "no node is running the job's trainer; nothing to checkpoint"},
                                 status=409)
    return web.json_response({"request_id": rid})


async def _drain(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    node_id = request.match_info["node_id"]
    node = sup.nodes.get(node_id)
    if node is None:
        known = ", ".join(n.id for n in sup.nodes.values() if not n.state.is_terminal()) or "none"
        return web.json_response({"error": f"no node {node_id!r} (live nodes: {known})"}, status=404)
    if node.state.is_terminal():
        return web.json_response({"error": f"node {node_id} is already {node.state.value}"}, status=409)
    sup.drain(node, "operator")
    return web.json_response({"node": node.id, "state": node.state.value})


def control_app(sup: Supervisor) -> web.Application:
    app = web.Application()
    app[SUPERVISOR] = sup
    app.router.add_get("/v1/status", _status)
    app.router.add_get("/v1/events", _events)
    app.router.add_post("/v1/checkpoint", _checkpoint)
    app.router.add_post("/v1/nodes/{node_id}/drain", _drain)
    return app


class ApiServer:
    """Both listeners. ``start()`` binds; ``agent_url`` is known after it; ``aclose()`` is idempotent."""

    def __init__(self, sup: Supervisor, *, agent_host: str, agent_port: int, socket_path: str) -> None:
        self.sup = sup
        self.agent_host = agent_host
        self.agent_port = agent_port
        self.socket_path = socket_path
        self._runners: list[web.AppRunner] = []
        self.agent_url: str | None = None

    async def start(self) -> None:
        agent = web.AppRunner(agent_app(self.sup), access_log=None)
        await agent.setup()
        self._runners.append(agent)
        site = web.TCPSite(agent, self.agent_host, self.agent_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.agent_url = f"http://{self.agent_host}:{port}"

        control = web.AppRunner(control_app(self.sup), access_log=None, shutdown_timeout=1.0)
        await control.setup()
        self._runners.append(control)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a stale socket from a killed daemon
        await web.UnixSite(control, self.socket_path).start()
        os.chmod(self.socket_path, 0o660)

    async def aclose(self) -> None:
        while self._runners:
            await self._runners.pop().cleanup()
