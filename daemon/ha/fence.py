"""Fenced commits: what the leader decides (a purchase, a termination, an admission) is
written through an etcd txn that holds only while this daemon still leads, and the
provider is called only after that txn succeeded.

The txn's compares (etcd's KV.Txn, https://etcd.io/docs/v3.4/learning/api/#transaction):

- ``create_revision(leader) == fence``: the key is the one this daemon created (a key
  re-created by another daemon has a larger create_revision; a deleted one has 0);
- ``lease(leader) == lease_id``: and it is still under this daemon's lease.

A deposed leader (its lease expired while it was stopped or cut off, or revoked) fails
the compare: :meth:`Fence.commit` raises :class:`Deposed`, the elector is told
(``FenceRejected``), and the caller never reaches the provider. Before the txn, the
elector's own clock gate (:meth:`~daemon.ha.elector.Elector.may_act`) is checked, and
again between the txn and the call: a leader paused right after its txn sees its
deadline passed when it resumes. What no fence covers is a pause *inside* the provider
call (its request already on the wire); the cloud's idempotency token (EC2's
``ClientToken``, the intent key's name) makes a retry by the next leader a no-op.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Sequence, TypeVar

from daemon.control import leadership as ld
from daemon.controlnode.store import NotLeading
from daemon.ha.client import LeaseCompare
from daemon.ha.elector import Elector

__all__ = ["Deposed", "Fence"]

T = TypeVar("T")


class Deposed(NotLeading):
    """This daemon does not lead (any more): nothing was written, nothing may be called."""


class Fence:
    """Fenced txns for ``elector``'s pool (module docstring)."""

    def __init__(self, elector: Elector) -> None:
        self.elector = elector
        self.client = elector.client

    def compares(self, fence: int, lease_id: int) -> list[Any]:
        tx = self.client.transactions
        return [tx.create(self.elector.key) == fence, LeaseCompare(self.elector.key) == lease_id]

    async def commit(self, ops: Sequence[Any], *, extra_compares: Sequence[Any] = ()) -> list[Any]:
        """Apply ``ops`` (aetcd txn ops: ``client.transactions.put(...)``, ...) iff this
        daemon leads; returns the txn's answers.

        Raises:
            Deposed: the clock gate is shut or etcd refused the compare (nothing written).
            aetcd.exceptions.ClientError, grpc errors: etcd unreachable (unknown whether
                applied only if the error is a timeout: a retry must be idempotent).
        """
        fence, lease_id = self.elector.fence, self.elector.lease_id
        if not self.elector.may_act() or fence is None or lease_id is None:
            raise Deposed(f"{self.elector.name} does not lead {self.elector.pool}")
        ok, answers = await self.client.transaction(
            compare=[*self.compares(fence, lease_id), *extra_compares], success=list(ops), failure=[])
        if not ok:
            self.elector.observe(ld.FenceRejected(fence))
            raise Deposed(f"{self.elector.name}'s fence {fence} was refused: another daemon leads {self.elector.pool}")
        return answers

    async def then_call(self, ops: Sequence[Any], call: Callable[[], Awaitable[T]]) -> T:
        """:meth:`commit` ``ops`` (the intent: what is about to be bought or terminated),
        then ``call()`` (the provider), unless the clock gate shut in between.

        Raises:
            Deposed: before the provider was called.
        """
        await self.commit(ops)
        if not self.elector.may_act():
            raise Deposed(f"{self.elector.name}'s lease ran out after its intent was written")
        return await call()
