"""``python bench/gpu_nccl1.py`` (run by ``bench/gpu_session.sh``): a one-rank NCCL check.

It initialises NCCL on ``cuda:0`` and all-reduces 1 GiB of bf16 twice, printing the
seconds for init plus the first all-reduce, the second all-reduce, and whether the sum
is exact. A world of one moves no bytes: this proves the NCCL build and the device
binding, not bandwidth. Needs CUDA; exit status 1 when the sum is wrong.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=timedelta(seconds=60), device_id=device)
    x = torch.full((2**29,), 3.0, dtype=torch.bfloat16, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    exact = bool((x == 3.0).all())
    print(f"nccl {torch.cuda.nccl.version()} world 1: init+first all-reduce {t1 - t0:.3f} s, "
          f"1 GiB bf16 all-reduce {t2 - t1:.4f} s, exact {exact}")
    dist.destroy_process_group()
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
