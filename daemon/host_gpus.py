"""The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them: the
variable's items when it is set (as CUDA reads it: an empty value shows none), else the
``/dev/nvidia<N>`` device files (the NVIDIA driver's, one per GPU). The standard library
only: the node's launcher reads it before its zygote forks (:mod:`daemon.gpunode.zygote`),
the local provider when it pins GPUs (:mod:`daemon.providers.local_gpus`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["host_gpus"]

_DEVICE = re.compile(r"^nvidia(\d+)$")


def host_gpus(environ: Mapping[str, str], dev: str = "/dev") -> list[str]:
    """The GPU ids (as ``CUDA_VISIBLE_DEVICES`` names them) this process may hand out."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    try:
        names = os.listdir(dev)
    except OSError:
        return []
    return [m.group(1) for m in sorted((_DEVICE.match(n) for n in names if _DEVICE.match(n)),
                                       key=lambda m: int(m.group(1)))]
