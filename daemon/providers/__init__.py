"""Cloud providers behind one contract (see :mod:`daemon.providers.base`)."""

from daemon.providers.base import (
    AuthError,
    CapacityError,
    Instance,
    NodeSpec,
    Provider,
    ProviderError,
    QuotaError,
    TransientError,
    create_provider,
    register_provider,
)

__all__ = [
    "AuthError",
    "CapacityError",
    "Instance",
    "NodeSpec",
    "Provider",
    "ProviderError",
    "QuotaError",
    "TransientError",
    "create_provider",
    "register_provider",
]
