"""The etcd v3 client: ``aetcd`` (asyncio, gRPC), on every member of the cluster.

aetcd 1.0.0 connects to one ``host:port`` over an insecure channel. This subclass
gives the channel every endpoint (gRPC's ``ipv4:`` target with several addresses and
the ``round_robin`` policy: a member that is down or unreachable leaves the rotation,
so the client rides through the loss of one member of three), and optionally TLS
credentials (``grpc.ssl_channel_credentials``: a production etcd listens with
``--client-cert-auth``; this client then presents its certificate).

The gRPC target syntax: https://github.com/grpc/grpc/blob/master/doc/naming.md
("ipv4:address[:port][,address[:port],...]").
"""

from __future__ import annotations

from typing import Sequence

import aetcd
import grpc
from aetcd import exceptions, rpc, watcher

__all__ = ["EtcdClient", "LeaseCompare", "target_of"]


def target_of(endpoints: Sequence[str]) -> str:
    """``["127.0.0.1:2379", ...]`` → ``"ipv4:127.0.0.1:2379,..."``.

    Raises:
        ValueError: no endpoint, or one that is not ``IPV4:PORT``.
    """
    if not endpoints:
        raise ValueError("no etcd endpoint: give at least one host:port")
    for e in endpoints:
        host, _, port = e.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or host.count(".") != 3:
            raise ValueError(f"etcd endpoint {e!r} is not IPV4:PORT (e.g. 10.0.0.5:2379)")
    return "ipv4:" + ",".join(endpoints)


class EtcdClient(aetcd.Client):
    """:class:`aetcd.Client` on several endpoints (module docstring). ``timeout_s``: each
    request's deadline (seconds; aetcd passes it to every gRPC call)."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        super().__init__(timeout=timeout_s,  # type: ignore[arg-type]  # aetcd types it int; gRPC takes float
                         options={"grpc.lb_policy_name": "round_robin",
                                  "grpc.initial_reconnect_backoff_ms": 100,
                                  "grpc.max_reconnect_backoff_ms": 1000,
                                  # a new leader reads the pool's state in pages (daemon/ha/store.py);
                                  # gRPC's default cap (4 MiB) is near a page of big rows
                                  "grpc.max_receive_message_length": 256 << 20})
        self.timeout_s = timeout_s
        self._target = target_of(endpoints)
        self._credentials = credentials

    async def connect(self) -> None:
        """Open the channel (no I/O happens until the first request)."""
        if self._connected.is_set():
            return
        opts = list(self._options.items())
        self.channel = (grpc.aio.secure_channel(self._target, self._credentials, options=opts)
                        if self._credentials is not None else grpc.aio.insecure_channel(self._target, options=opts))
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()

    async def keepalive(self, lease_id: int, *, timeout_s: float) -> rpc.LeaseKeepAliveResponse | None:
        """One ``LeaseKeepAlive`` (aetcd's ``refresh_lease``) with its own deadline in
        seconds, not the client's: a renewal answered late still renewed the lease (the
        elector counts it from the moment it was sent). None: the stream ended unanswered.

        Raises:
            aetcd.exceptions.ClientError: etcd unreachable, or no answer by the deadline.
        """
        await self.connect()
        try:
            async for reply in self.leasestub.LeaseKeepAlive([rpc.LeaseKeepAliveRequest(ID=lease_id)],
                                                             timeout=timeout_s, metadata=self.metadata):
                return reply
        except rpc.AioRpcError as exc:
            exceptions._handle_exception(exc)
            raise
        return None

    async def range_page(self, key: bytes, range_end: bytes | None = None, *, limit: int = 0,
                         revision: int = 0) -> rpc.RangeResponse:
        """One ``KV.Range`` request (https://etcd.io/docs/v3.4/learning/api/#range; aetcd's
        ``get_range`` sends neither a limit nor a revision): the keys in ``[key, range_end)``
        (``range_end`` None: ``key`` alone), in key order, at most ``limit`` of them (0: all),
        as of ``revision`` (0: now). The reply's ``header.revision`` is the store's revision
        the read saw, ``more`` says whether keys past ``limit`` remain.

        Raises:
            aetcd.exceptions.ClientError: etcd unreachable, timed out, or ``revision``
                compacted (``RevisionCompactedError``).
        """
        await self.connect()
        req = rpc.RangeRequest(key=key, limit=limit, revision=revision,
                               sort_order=rpc.RangeRequest.ASCEND, sort_target=rpc.RangeRequest.KEY)
        if range_end is not None:
            req.range_end = range_end
        try:
            return await self.kvstub.Range(req, timeout=self._timeout, metadata=self.metadata)
        except rpc.AioRpcError as exc:
            exceptions._handle_exception(exc)  # raises aetcd's error for the gRPC status
            raise


class LeaseCompare(aetcd.transactions.BaseCompare):
    """A txn compare on a key's lease (etcd's ``Compare.LEASE`` target, since 3.3;
    aetcd has no helper for it): ``LeaseCompare(key) == lease_id``."""

    def build_compare(self, compare: rpc.Compare) -> None:
        compare.target = rpc.Compare.LEASE
        compare.lease = int(self.value)
