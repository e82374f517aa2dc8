"""The daemon's process of :mod:`bench.scale`: what ``spotvisord run`` runs, with a
simulated provider, and a profiler.

- :class:`SimProvider` (registered as ``bench-sim``) serves the pool's offers.
  ``launch`` POSTs ``{instance_id, node_id, token, daemon_url, gpus}`` (the
  :class:`~daemon.providers.base.NodeSpec` the daemon made, with the node's real
  bearer token) to the fleet's ``/launch`` (:mod:`bench.scale_sim`) and returns a
  ``pending`` instance once the fleet accepted it, as a cloud's API returns before the
  VM boots. ``terminate`` POSTs ``/terminate``. ``describe`` answers from the
  provider's own table (launched and not terminated), with no request: a simulated
  instance leaves only through ``terminate``, so the table is the truth, and the
  reconcile pass costs what it costs with a cloud whose describe is cheap.
- :func:`main` runs :func:`daemon.interfaces.cli.running_daemon` under :func:`daemon.interfaces.service.serve`
  (store, supervisor, agent API, notifier; logging at INFO to stderr, which the bench
  sends to a file) with that provider for the config's ``local`` offers.
- Its event-loop stalls are watched from the bench's process (:mod:`bench.loopwatch`):
  a timer inside it cost it as much CPU as the whole daemon.
- ``SPOTVISOR_BENCH_PROFILE=PATH``: cProfile from SIGUSR1 to SIGUSR2, written to
  ``PATH`` and ``PATH.txt`` (:func:`_profile_on_signals`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as a script: import this checkout's daemon package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.interfaces.cli import running_daemon  # noqa: E402
from daemon.config import load_config  # noqa: E402
from daemon.logs import configure_logging  # noqa: E402
from daemon.control.pool import Offer  # noqa: E402
from daemon.providers.base import (Instance, NodeSpec, Provider, TransientError, create_provider,  # noqa: E402
                                   register_provider)
from daemon.interfaces.service import SdNotifier, serve  # noqa: E402

__all__ = ["SimProvider", "main", "PROFILE_ENV"]

PROFILE_ENV = "SPOTVISOR_BENCH_PROFILE"


# -- the provider --------------------------------------------------------------------------------------
@register_provider("bench-sim")
class SimProvider(Provider):
    """Instances are simulated agents in the fleet process at ``cloud_url``; see the module docstring.

    Constructor does no I/O; the HTTP session is made on the first call. ``aclose``
    closes it and, like a cloud provider, leaves the instances running.
    """

    name = "bench-sim"

    def __init__(self, *, cloud_url: str, spot_price_usd_h: float = 1.0, timeout_s: float = 30.0) -> None:
        self.cloud_url = cloud_url.rstrip("/")
        self.spot_price_usd_h = spot_price_usd_h
        self.timeout_s = timeout_s
        self._live: dict[str, Instance] = {}
        self._pool: dict[str, str] = {}  # instance id → pool tag
        self._seq = 0
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def _call(self, path: str, body: dict[str, Any]) -> None:
        try:
            async with self._http().post(f"{self.cloud_url}{path}", json=body) as r:
                if r.status != 200:
                    raise TransientError(f"fleet {path}: HTTP {r.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TransientError(f"fleet {path}: {type(exc).__name__}: {exc}") from exc

    async def launch(self, offer: Offer, node: NodeSpec) -> Instance:
        self._seq += 1
        iid = f"sim-{self._seq:05d}"
        await self._call("/launch", {"instance_id": iid, "node_id": node.node_id, "token": node.token,
                                     "daemon_url": node.daemon_url, "gpus": offer.gpus_per_node})
        inst = Instance(id=iid, node_id=node.node_id, provider=offer.provider, state="pending", zone=offer.zone,
                        instance_type=offer.instance_type, launched_at=time.time())
        self._live[iid] = inst
        self._pool[iid] = node.pool
        return inst

    async def terminate(self, instance_id: str) -> None:
        if self._live.pop(instance_id, None) is not None:
            await self._call("/terminate", {"instance_id": instance_id})

    async def describe(self, tag: str) -> list[Instance]:
        return [i for iid, i in self._live.items() if self._pool[iid] == tag]

    async def spot_price(self, offer: Offer) -> float | None:
        return self.spot_price_usd_h

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


# -- the process ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m bench.scale_daemon --config FILE --cloud-url URL``: spotvisord's service
    loop, with the simulated provider serving the pool's (local) offers."""
    p = argparse.ArgumentParser(prog="python -m bench.scale_daemon", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--cloud-url", required=True, help="the fleet's control endpoint (bench.scale_sim)")
    a = p.parse_args(argv)

    config = load_config(a.config)
    configure_logging()  # INFO, as spotvisord run
    provider = create_provider("bench-sim", cloud_url=a.cloud_url)

    async def go() -> int:
        return await serve(running_daemon(config, with_chaos=False, providers={"local": provider}),
                           notifier=SdNotifier(None), watchdog_interval_s=None)

    out = os.environ.get(PROFILE_ENV)
    if out:
        _profile_on_signals(out)
    return asyncio.run(go())


def _profile_on_signals(out: str) -> None:
    """cProfile of a window of the daemon: SIGUSR1 starts it, SIGUSR2 stops it and writes
    ``out`` (pstats) and ``out.txt`` (top functions by own and by cumulative time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()

    def stop(*_: Any) -> None:
        prof.disable()
        prof.dump_stats(out)
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text).strip_dirs()
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(60)
        Path(out + ".txt").write_text(text.getvalue())

    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    signal.signal(signal.SIGUSR2, stop)


if __name__ == "__main__":
    sys.exit(main())
