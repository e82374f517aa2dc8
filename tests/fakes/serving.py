"""How the fakes serve: an aiohttp app on 127.0.0.1 (a random port), in the test's event
loop (:class:`LocalServer`, for the async fakes: ``fakes.ecs``, ``fakes.kms``) or on an
event loop of its own in a daemon thread (:class:`LoopThread`, for the fakes sync code
calls: ``fakes.aws_faults``, ``fakes.oss``); a standard-library handler in a thread
(:func:`http_server`, for a test's own small endpoint)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Generic, Self, TypeVar

from aiohttp import web

T = TypeVar("T")


class LocalServer:
    """Every method on path ``/`` answered by ``self._handle``; aiohttp's lifecycle: the
    constructor does no I/O, ``await start()`` binds 127.0.0.1 (:attr:`endpoint`
    ``"127.0.0.1:PORT"``; again: nothing), ``await aclose()`` stops it (idempotent); an
    async context manager."""

    def __init__(self) -> None:
        self._runner: web.AppRunner | None = None
        self._endpoint: str | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError(f"{type(self).__name__} is not started: call `await start()` first")
        return self._endpoint

    async def start(self) -> Self:
        if self._runner is not None:
            return self
        app = web.Application()
        app.router.add_route("*", "/", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self._endpoint = f"{host}:{port}"
        return self

    async def aclose(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class LoopThread(Generic[T]):
    """An event loop in a daemon thread named ``name``: :meth:`start` runs ``setup()`` on it and
    serves until :meth:`close`, which runs ``teardown(setup's result)`` and closes the loop.
    ``what`` names the owner in errors."""

    def __init__(self, name: str, what: str) -> None:
        self.name, self.what = name, what
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, setup: Callable[[], Awaitable[T]], teardown: Callable[[T], Awaitable[None]]) -> T:
        """Returns once ``setup()`` is done, with its result.

        Raises:
            RuntimeError: started before, or ``setup()`` raised (the cause).
        """
        if self._thread is not None:
            raise RuntimeError(f"{self.what} already started")
        ready = threading.Event()
        out: list[T] = []
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            try:
                out.append(loop.run_until_complete(setup()))
            except BaseException as exc:  # reported to start()
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(teardown(out[0]))
            loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise RuntimeError(f"{self.what} failed to start") from errors[0]
        return out[0]

    def close(self) -> bool:
        """Stop the loop and wait (10 s at most) for its teardown; False if it was not running. Idempotent."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return False
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        return True


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A standard-library HTTP server on 127.0.0.1 (a random port), each request answered by
    ``handler`` in a thread of its own; yields its URL (``http://127.0.0.1:PORT``), shut down
    and closed on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
