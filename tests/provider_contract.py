"""The Provider contract as a pytest mixin (STYLE.md item 13).

Subclass :class:`ProviderContract` in a backend's test module and define three fixtures:

- ``provider``: a started :class:`~daemon.providers.base.Provider`;
- ``offer``: an :class:`~daemon.control.pool.Offer` it can launch;
- ``node_spec``: a factory ``node_spec(pool=None) -> NodeSpec`` returning a new node
  (unique ``node_id``) each call; ``pool=None`` means this test's own pool, unique
  to the test so other tests' instances never show up.

Optional class attribute ``unknown_instance_id``: an id in the provider's format
that names no instance.

The tests assume the backend is read-after-write consistent (fakes, local); a
real-cloud subclass should add its own waiting.
"""

from __future__ import annotations

import uuid

from daemon.providers.base import Instance


class ProviderContract:
    unknown_instance_id: str = "i-0123456789abcdef0"

    async def test_launch_describe_terminate(self, provider, offer, node_spec) -> None:
        node = node_spec()
        inst = await provider.launch(offer, node)
        assert isinstance(inst, Instance)
        assert inst.node_id == node.node_id
        assert inst.state in ("pending", "running")
        assert inst.instance_type == offer.instance_type
        if offer.zone is not None:
            assert inst.zone == offer.zone

        listed = {i.id: i for i in await provider.describe(node.pool)}
        assert inst.id in listed
        assert listed[inst.id].node_id == node.node_id
        assert listed[inst.id].state in ("pending", "running")

        await provider.terminate(inst.id)
        assert inst.id not in {i.id for i in await provider.describe(node.pool)}

    async def test_terminate_twice_is_fine(self, provider, offer, node_spec) -> None:
        inst = await provider.launch(offer, node_spec())
        await provider.terminate(inst.id)
        await provider.terminate(inst.id)

    async def test_terminate_unknown_is_fine(self, provider) -> None:
        await provider.terminate(self.unknown_instance_id)

    async def test_describe_other_pool_is_empty(self, provider, offer, node_spec) -> None:
        node = node_spec()
        inst = await provider.launch(offer, node)
        try:
            assert await provider.describe(f"other-{uuid.uuid4().hex[:8]}") == []
            assert [i.id for i in await provider.describe(node.pool)] == [inst.id]
        finally:
            await provider.terminate(inst.id)

    async def test_spot_price_is_a_price_or_none(self, provider, offer) -> None:
        price = await provider.spot_price(offer)
        assert price is None or (isinstance(price, float) and price >= 0)
