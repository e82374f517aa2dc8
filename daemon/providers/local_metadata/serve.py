"""A local instance's own metadata endpoint: a process of the instance, not of the daemon.

Under an outside runner (:mod:`daemon.interfaces.demo_runner`) a local instance outlives
the daemon that launched it, so its metadata endpoint cannot live in that daemon's event
loop. The instance's init (:data:`daemon.providers.local_instance.INSTANCE_INIT`) starts
``python -m daemon.providers.local_metadata.serve --dialect D --fd N --token-file F``
first: it serves the dialect's fake (:func:`daemon.providers.local_metadata.make_fake`) on
the listening socket it inherits as ``N`` (bound to 127.0.0.1 by the provider, which
knows its URL before anything starts), and one more route, :data:`ADMIN_PATH`, through
which whichever daemon runs now publishes an interruption notice
(:func:`publish_interruption`). That route answers loopback peers only, and only with
the bearer token in ``F`` (0600, written by the provider into the node's directory; any
later daemon of the same state directory reads it there).

At the notice's deadline this process reclaims the instance, as the cloud does: SIGTERM
to the init, which SIGKILLs every process of the instance (this one included). No
daemon task has to be alive for it.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import os
import signal
import socket
import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable

from aiohttp import ClientSession, ClientTimeout, web

from daemon.hosts import is_loopback
from daemon.providers.local_metadata import make_fake
from daemon.state_dir import open_private

__all__ = ["ADMIN_PATH", "authorized", "admin_routes", "publish_interruption", "main"]

#: the route a daemon publishes a notice through (POST, JSON ``{"action", "deadline"}``,
#: ``deadline`` in unix seconds); answers ``{"published_at", "deadline"}``
ADMIN_PATH = "/spotvisor/v1/interruption"
_MAX_BODY = 4096


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant time)."""
    if not token or not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].encode(), token.encode())


def admin_routes(endpoint: Callable[[], Any], token: str, *,
                 reclaim: Callable[[], None]) -> Callable[[web.Application], None]:
    """The admin route, as an ``extra_routes`` hook of the fake ``endpoint()`` returns (an
    endpoint of :mod:`daemon.providers.local_metadata`): a notice is published there and
    ``reclaim()`` is called at its deadline (a later notice replaces the earlier one's)."""
    pending: list[asyncio.TimerHandle] = []

    async def interrupt(request: web.Request) -> web.Response:
        if not is_loopback(request.remote or ""):
            return web.json_response({"error": "loopback only"}, status=403)
        if not authorized(request.headers.get("Authorization"), token):
            return web.json_response({"error": "bad or missing bearer token"}, status=401)
        if request.content_length is None or request.content_length > _MAX_BODY:
            return web.json_response({"error": f"a JSON body of at most {_MAX_BODY} bytes"}, status=400)
        try:
            body = await request.json()
            action, deadline = str(body.get("action", "terminate")), float(body["deadline"])
            fake = endpoint()
            fake.publish_interruption(action=action, time=datetime.fromtimestamp(deadline, tz=timezone.utc))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return web.json_response({"error": f"bad notice: {exc}"}, status=400)
        for handle in pending:
            handle.cancel()
        pending[:] = [asyncio.get_running_loop().call_later(max(0.0, deadline - time.time()), reclaim)]
        return web.json_response({"published_at": fake.published_at, "deadline": deadline})

    def add(app: web.Application) -> None:
        app.router.add_post(ADMIN_PATH, interrupt)

    return add


async def publish_interruption(url: str, token: str, *, action: str, deadline: float,
                               timeout_s: float = 5.0) -> float | None:
    """Publish a notice on the instance endpoint at ``url`` through its admin route; the
    unix time it appeared there (None if the endpoint does not say).

    Raises:
        RuntimeError: the endpoint refused it (the status and its answer).
        aiohttp.ClientError, TimeoutError: it could not be reached.
    """
    async with ClientSession(timeout=ClientTimeout(total=timeout_s)) as session:
        async with session.post(url + ADMIN_PATH, json={"action": action, "deadline": deadline},
                                headers={"Authorization": f"Bearer {token}"}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"metadata endpoint {url} refused the notice: {resp.status} "
                                   f"{(await resp.text())[:200]}")
            answer = await resp.json()
    published = answer.get("published_at") if isinstance(answer, dict) else None
    return float(published) if isinstance(published, (int, float)) else None


def _reclaim(init_pid: int) -> None:
    """The notice's time has come: end the instance (SIGTERM to its init, still our parent)."""
    print(f"spotvisor local metadata: notice deadline reached, reclaiming the instance (init {init_pid})",
          file=sys.stderr, flush=True)
    if os.getppid() == init_pid:
        os.kill(init_pid, signal.SIGTERM)


async def _serve(dialect: str, fd: int, token: str) -> None:
    init_pid = os.getppid()  # the instance's init started us
    sock = socket.socket(fileno=fd)
    fake = make_fake(dialect, sock=sock,
                     extra_routes=admin_routes(lambda: fake, token, reclaim=lambda: _reclaim(init_pid)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    await fake.start()
    print(f"spotvisor local metadata: {dialect} endpoint on {fake.url}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await fake.aclose()


def main(argv: list[str] | None = None) -> int:
    """``python -m daemon.providers.local_metadata.serve --dialect D --fd N --token-file F``."""
    p = argparse.ArgumentParser(prog="spotvisor-local-metadata")
    p.add_argument("--dialect", required=True)
    p.add_argument("--fd", type=int, required=True, help="an inherited listening socket")
    p.add_argument("--token-file", required=True, help="the admin route's bearer token (0600)")
    args = p.parse_args(argv)
    with os.fdopen(open_private(args.token_file, os.O_RDONLY), "rb") as f:
        token = f.read(4096).decode().strip()
    if not token:
        print(f"spotvisor local metadata: {args.token_file} is empty", file=sys.stderr)
        return 2
    asyncio.run(_serve(args.dialect, args.fd, token))
    return 0


if __name__ == "__main__":
    sys.exit(main())
