#!/bin/sh
# The GPU check of issue 17 (bench/gpu_check.py): NCCL and bf16 all-reduce, bf16 matmul,
# in-process shrink, grow and loss on 2-8 local ranks, AdamW's state allocated for a
# reshard (foreach and fused kernels) against a real step's, a buddy copy's arrival in
# host memory through the device's staging area (unpinned and pinned), FSDP2 shards taken
# in memory a rank holds (a resize's, forward and AdamW), and the NVML figures the
# node agent reports, printed as one table. Run it on any CUDA machine at hand and put the
# table in the issue's closing note; without CUDA it is a dry run on gloo and the CPU.
#   bench/gpu_check.sh [--ranks N] [--mb 256] [--params-m 50]
set -eu
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec timeout 290 "$PY" -m bench.gpu_check "$@"
