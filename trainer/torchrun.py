"""``python -m trainer.torchrun ARGS``: torchrun, with ``--rdzv-backend=spotvisor`` registered.

On spotvisor's own interpreter torch finds the backend by its ``torchrun.handlers``
entry point (``pyproject.toml``, :mod:`trainer.torchrun_plugin`). An image's own
interpreter (``job.python``) reaches spotvisor's ``trainer/`` through ``PYTHONPATH``
(:mod:`daemon.gpunode.trainer_process`) but has no installed distribution, so no entry
point: without this module its torchrun knows only c10d's backend, and a restart of the
rendezvous store ends every worker on that node. This module registers the same creator
in torch's registry (``rendezvous_handler_registry.register``, torch 2.13
``torch/distributed/elastic/rendezvous/api.py``; registering the creator the entry point
already registered is a no-op) and runs torchrun's own ``main`` with the arguments
unchanged: every flag, the exit status and the error report are torchrun's.
"""

from __future__ import annotations

__all__ = ["main", "register"]


def register() -> None:
    """Register :mod:`trainer.rendezvous`'s handler under ``spotvisor`` unless the entry
    point did. Raises ``ImportError`` on a torch without c10d's dynamic rendezvous."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from trainer.rendezvous import BACKEND
    from trainer.torchrun_plugin import create

    rendezvous_handler_registry.register(BACKEND, create)


def main(argv: list[str] | None = None) -> None:
    """torchrun's ``main(argv)`` (None: ``sys.argv[1:]``) after :func:`register`."""
    register()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main()
