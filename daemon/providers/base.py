"""The Provider contract: how the daemon buys, finds and releases spot capacity.

Every method is a coroutine and must not block the event loop (SDK calls go
through ``asyncio.to_thread``). Cancelling a call may leave the cloud-side
operation done or not done; ``describe(tag)`` is the source of truth afterwards,
which is why every instance carries the pool tag.

Errors form one tree; SDK errors are translated at the adapter edge (``from exc``):

- :class:`CapacityError` — no capacity for this offer now: try the next offer and
  back this one off.
- :class:`QuotaError` — an account limit: fatal for this provider until changed.
- :class:`AuthError` — credentials missing or refused: fatal, one clear message.
- :class:`TransientError` — throttling, 5xx, timeouts: retry (tenacity) with jitter.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable

from daemon.control.pool import Offer

# Tags every instance carries, so a restarted daemon finds its pool again (describe(tag)).
POOL_TAG = "spotvisor-pool"
NODE_TAG = "spotvisor-node"

__all__ = [
    "POOL_TAG",
    "NODE_TAG",
    "ProviderError",
    "CapacityError",
    "PriceError",
    "QuotaError",
    "AuthError",
    "TransientError",
    "Instance",
    "NodeSpec",
    "AgentWheelRef",
    "Provider",
    "register_provider",
    "create_provider",
]


class ProviderError(Exception):
    """Base of every provider failure."""


class CapacityError(ProviderError):
    """The offer has no spot capacity now (retry elsewhere, back this offer off)."""


class PriceError(CapacityError):
    """The offer's price cap is under the current spot price (AWS ``SpotMaxPriceTooLow``,
    Alibaba ``InvalidSpotPriceLimit.LowerThanPublicPrice``). A CapacityError, so the pool
    tries the next offer and backs this one off until the price falls again."""


class QuotaError(ProviderError):
    """An account quota or limit stops the launch (no retry helps)."""


class AuthError(ProviderError):
    """Credentials are missing or refused (no retry helps)."""


class TransientError(ProviderError):
    """Throttling, a 5xx or a timeout: the same call may succeed on retry."""


@dataclass(frozen=True, slots=True)
class AgentWheelRef:
    """Where a node fetches the agent from (:mod:`daemon.providers.agent_wheel`): ``url``
    (a presigned S3 GET, a signed OSS URL, or a ``file://`` URI), the wheel's ``sha256``
    (hex) and ``version`` (the daemon's)."""

    url: str
    sha256: str
    version: str


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """What a new node needs to join: its identity and where the daemon is.

    ``token``: the node agent's own bearer token for the daemon's agent port.
    ``tags``: key → value, always including ``spotvisor-pool``.
    ``ca_cert_pem``: with an ``https://`` ``daemon_url``, the CA certificate (PEM) the
    agent trusts, and no other (:mod:`daemon.controlnode.tls`; the agent's ``--ca-file``);
    None: plain HTTP, or the node's own trust store.
    ``agent_wheel``: the agent to install at boot (:mod:`daemon.providers.bootstrap`);
    None: the image carries it.
    """

    node_id: str
    pool: str
    token: str
    daemon_url: str
    tags: dict[str, str] = field(default_factory=dict)
    ca_cert_pem: str | None = None
    agent_wheel: AgentWheelRef | None = None


@dataclass(frozen=True, slots=True)
class Instance:
    """A provider's instance. ``state``: pending | running | gone; times unix seconds."""

    id: str
    node_id: str
    provider: str
    state: str
    zone: str | None = None
    instance_type: str | None = None
    launched_at: float | None = None


class Provider(abc.ABC):
    """A source of spot instances. ``installs_agent``: its instances boot from the user
    data of :mod:`daemon.providers.bootstrap`, which installs the agent from the daemon's
    wheel (``NodeSpec.agent_wheel``; the daemon publishes it before such a launch).
    ``listing_lag_s``: how long its listing may leave a new instance out (seconds)."""

    name: str = ""
    installs_agent: bool = False
    #: seconds a new instance may be missing from :meth:`describe` (an eventually
    #: consistent listing: :mod:`daemon.control.listing`); 0: the listing is the truth
    listing_lag_s: float = 0.0
    #: its launch carries a client token derived from the node (:class:`NodeSpec`): the same
    #: launch sent again returns the first one's instance (:mod:`daemon.control.launch_replay`)
    idempotent_launch: bool = False

    @abc.abstractmethod
    async def launch(self, offer: Offer, node: NodeSpec) -> Instance:
        """Start one spot instance for ``offer``, tagged with ``node.pool``.

        Returns as soon as the provider accepted the request (the instance may still
        be booting). Raises CapacityError, QuotaError, AuthError, TransientError.
        """

    @abc.abstractmethod
    async def terminate(self, instance_id: str) -> None:
        """Release an instance; idempotent (an unknown or gone instance is not an error)."""

    @abc.abstractmethod
    async def describe(self, tag: str) -> list[Instance]:
        """Instances of pool ``tag`` that are pending or running."""

    @abc.abstractmethod
    async def spot_price(self, offer: Offer) -> float | None:
        """Current spot price of ``offer`` in USD/hour, or None when unknown."""

    async def spot_stock(self, offer: Offer) -> bool | None:
        """Whether the cloud says ``offer``'s spot capacity is in stock now, without buying
        any: True in stock, False sold out, None when this provider cannot tell (the
        default). A recommendation, not a promise: a launch may still be refused. Read by
        the availability record (:mod:`daemon.control.availability`) for every domain the
        job could move to. Raises ProviderError subclasses."""
        return None

    async def aclose(self) -> None:
        """Release the provider's own resources (clients, helper tasks). Idempotent."""


_REGISTRY: dict[str, Callable[..., Provider]] = {}


def register_provider(name: str) -> Callable[[Callable[..., Provider]], Callable[..., Provider]]:
    """Class decorator: make a provider constructible by name. Clashing names are errors."""

    def deco(factory: Callable[..., Provider]) -> Callable[..., Provider]:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"provider {name!r} is already registered by {_REGISTRY[name]!r}")
        _REGISTRY[name] = factory
        return factory

    return deco


def create_provider(name: str, **kwargs: object) -> Provider:
    """Build a registered provider. Raises ValueError for an unknown name."""
    if name in ("local", "aws", "aliyun") and name not in _REGISTRY:
        import importlib

        importlib.import_module(f"daemon.providers.{name}")  # registers itself
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown provider {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(**kwargs)
