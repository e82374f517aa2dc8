"""The ``torchrun.handlers`` entry point of ``--rdzv-backend=spotvisor`` (:mod:`trainer.rendezvous`).

torch loads the group while ``torch.distributed.elastic.rendezvous`` is being imported
(``registry._register_out_of_tree_handlers``), and :mod:`trainer.rendezvous` imports that
package: this module imports nothing of torch, and the handler's module only when torchrun
builds a handler.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["handler_creator", "create"]


def create(params: Any) -> Any:
    """:func:`trainer.rendezvous.create`, imported on first use."""
    from trainer.rendezvous import create as create_handler

    return create_handler(params)


def handler_creator() -> Callable[[Any], Any]:
    """What torch calls for the creator it registers under ``spotvisor``."""
    return create
