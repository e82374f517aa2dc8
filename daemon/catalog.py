"""Facts the config and the pre-flight share: model architectures and GPU memory. Pure.

:data:`PRESETS` names the models a config's ``job.model.preset`` may give;
:func:`gpu_memory_gib` reads an offer's ``gpu_type``. The estimates built on them
(memory per GPU, checkpoint flush time) are :mod:`daemon.controlnode.preflight`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Architecture", "PRESETS", "GPU_MEMORY_GIB", "UnknownGpuError", "gpu_memory_gib"]


@dataclass(frozen=True, slots=True)
class Architecture:
    """A model's size: ``params`` (count) and the numbers activations depend on."""

    params: float
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int


# From each model's config.json on the Hugging Face Hub (parameter counts from the
# model cards / safetensors index); gpt2-tiny is configs/local.yaml's demo model.
PRESETS: dict[str, Architecture] = {
    "gpt2-tiny": Architecture(3.26e6, 256, 4, 4, 256),
    "gpt2": Architecture(124.4e6, 768, 12, 12, 50257),  # openai-community/gpt2
    "llama-7b": Architecture(6.738e9, 4096, 32, 32, 32000),  # meta-llama/Llama-2-7b-hf
    "llama-13b": Architecture(13.016e9, 5120, 40, 40, 32000),  # meta-llama/Llama-2-13b-hf
    "llama-70b": Architecture(68.977e9, 8192, 80, 64, 32000),  # meta-llama/Llama-2-70b-hf
    "llama3-8b": Architecture(8.030e9, 4096, 32, 32, 128256),  # meta-llama/Meta-Llama-3-8B
    "mistral-7b": Architecture(7.242e9, 4096, 32, 32, 32000),  # mistralai/Mistral-7B-v0.1
    "qwen2.5-7b": Architecture(7.616e9, 3584, 28, 28, 152064),  # Qwen/Qwen2.5-7B
    "qwen2.5-14b": Architecture(14.770e9, 5120, 48, 40, 152064),  # Qwen/Qwen2.5-14B
}

# Memory per GPU in GiB, by gpu_type, as the vendor markets it (NVIDIA data sheets).
# nvidia-smi reports up to ~6 % less on GDDR parts (ECC, reserved); set an offer's
# gpu_memory_gib for the exact figure. A gpu_type with a size suffix ("A100-40GB",
# "V100-32G") uses the suffix. A name sold in several sizes means its smallest (V100:
# 16 of 16/32; A100, A800: 40 of 40/80): a job judged to fit must fit on whichever the
# cloud hands out (a p4d.24xlarge's A100s have 40 GB; say A100-80GB for a p4de's).
GPU_MEMORY_GIB: dict[str, float] = {
    "T4": 16, "V100": 16, "A10": 24, "A10G": 24, "L4": 24, "3090": 24, "4090": 24,
    "L40S": 48, "A100": 40, "A800": 40, "H100": 80, "H800": 80, "H200": 141,
}
_NO_GPU = frozenset({"NONE", "CPU", ""})
_SIZE_SUFFIX = re.compile(r"^(?P<base>.+?)[-_ ](?P<gib>\d+(?:\.\d+)?)\s*G(?:I?B)?$")


class UnknownGpuError(ValueError):
    """A gpu_type that is not in :data:`GPU_MEMORY_GIB` and carries no size suffix."""


def gpu_memory_gib(gpu_type: str) -> float | None:
    """GiB of memory per GPU for ``gpu_type``; None for a node without GPUs (``none``).

    Raises:
        UnknownGpuError: not in the table and no ``-<N>GB`` suffix.
    """
    name = gpu_type.upper().strip()
    for prefix in ("NVIDIA ", "GEFORCE ", "RTX ", "RTX-", "TESLA "):
        name = name.removeprefix(prefix)
    if name in _NO_GPU:
        return None
    m = _SIZE_SUFFIX.match(name)
    if m:
        return float(m["gib"])
    if name in GPU_MEMORY_GIB:
        return float(GPU_MEMORY_GIB[name])
    raise UnknownGpuError(f"gpu_type {gpu_type!r} is not in the GPU memory table ({', '.join(GPU_MEMORY_GIB)}); "
                          f"name one of those or give the size, e.g. {gpu_type.strip() or 'GPU'}-80GB")
