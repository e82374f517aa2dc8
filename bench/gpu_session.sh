#!/bin/bash
# A lent GPU machine's whole check in one call: bench/gpu_check.sh, a one-rank NCCL all-reduce,
# and the reference (DDP) and FSDP2 trainers on CUDA at a real size (GPT-2, 24 x 1024, 227 M
# parameters) under plain torchrun: train, commit, resume. Figures and logs to $OUT (or /tmp/out).
# Packages the machine lacks travel as wheels in .whl/ (the device tool's README says how).
#   bench/gpu_session.sh        sizes: L=24 E=1024 H=16 S=512 PM=200 in the environment
set -u
[ ! -d .whl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PY=${PY:-python3}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
L=${L:-24}; E=${E:-1024}; H=${H:-16}; S=${S:-512}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/env.txt
python3 -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" | tee -a $OUT/env.txt
echo "== gpu_check"; timeout 200 bash bench/gpu_check.sh --ranks 2 --params-m ${PM:-200} 2>&1 | tee $OUT/gpu_check.txt
echo "== nccl world 1"; timeout 60 python3 bench/gpu_nccl1.py 2>&1 | tail -3 | tee $OUT/nccl1.txt
# the zygote (daemon/gpunode/zygote.py) is off where NVIDIA devices are until this passes:
# CUDA initialised in a worker forked from a parent that imported torch and transformers
echo "== zygote: workers forked on cuda"; timeout 150 python3 -m bench.worker_start --n 3 --device cuda --out $OUT/worker_start.json 2>&1 | tail -5 | tee $OUT/zygote.txt
ARGS="--seq-len $S --n-layer $L --n-embd $E --n-head $H --global-batch-size 16 --micro-batch-size 8 --checkpoint-interval 10"
run() { echo "start $(date +%T.%N)";  timeout ${T:-150} python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m "$@" 2>&1 | grep -v Warning ; }
echo "== ddp train to 20, commit at 10, 20"; rm -rf /tmp/ck; T=200 run trainer.run $ARGS --target-steps 20 --checkpoint-uri file:///tmp/ck | tee $OUT/ddp1.txt | grep -E "step|commit|resum|rror" | tail -12
echo "== ddp resume to 25"; T=120 run trainer.run $ARGS --target-steps 25 --checkpoint-uri file:///tmp/ck | tee $OUT/ddp2.txt | grep -E "step|commit|resum|load|rror" | head -12
echo "== fsdp2 train to 15"; rm -rf /tmp/ckf; T=150 run trainer.examples.fsdp_dcp --wrap fsdp $ARGS --target-steps 15 --checkpoint-uri file:///tmp/ckf | tee $OUT/fsdp1.txt | grep -E "step|commit|resum|load|rror" | tail -8
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
