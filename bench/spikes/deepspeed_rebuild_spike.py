"""Can a DeepSpeed ZeRO-2 engine be rebuilt at another data-parallel size in the same
process? A measured spike for issue 17 (``python -m bench.spikes.deepspeed_rebuild_spike``).

Three ranks (gloo on CPU, DeepSpeed's CPU accelerator, the reference trainer's GPT-2 and
``trainer.integrations.deepspeed.ds_config``) train three steps at world 3. Then, at a
step boundary, every rank gathers each parameter's full fp32 master copy and AdamW
moments (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``:
collectives over the ZeRO partitions), rank 2 leaves, and ranks 0 and 1, in their
processes:

1. destroy the default group and form a new one of 2 through the same TCPStore
   (``trainer.runtime.regroup``'s way);
2. forget DeepSpeed's process-global communication state: ``deepspeed.comm``'s backend
   (``cdb``) and the groups ``deepspeed.utils.groups`` cloned from the old world;
3. ``deepspeed.initialize`` a new model and optimizer at world 2, take one throwaway
   optimizer step (AdamW has no state to set before its first), set every full tensor
   back (``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``) and AdamW's
   step count (the throwaway step counted one; bias correction reads it);
4. hash the full state again (it must equal the hash at world 3) and train one step.

Prints, per phase, seconds on rank 0 and whether the state survived. No test imports
this module: it records what was measured, and why DeepSpeed jobs keep the restart path.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

from bench.ports import free_port

STEPS = 3


def _digest(engine, model) -> str:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(safe_get_full_fp32_param(p).detach().cpu().numpy().tobytes())
        for key in ("exp_avg", "exp_avg_sq"):
            state = safe_get_full_optimizer_state(p, key)
            if state is not None:
                h.update(state.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def worker() -> int:
    import argparse

    from trainer.examples.deepspeed_zero2 import _prepare_environment

    _prepare_environment()
    import torch
    import torch.distributed as dist

    from trainer.integrations.deepspeed import disable_jit_ops, ds_config
    from trainer.run import build_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("w3", store), rank=rank, world_size=world)
    import deepspeed

    disable_jit_ops()
    args = argparse.Namespace(n_layer=2, n_embd=64, n_head=4, seq_len=32, seed=0, lr=1e-3)
    out: dict = {"rank": rank}

    def engine_at(world_size: int):
        state = build_state(args, torch.device("cpu"))
        config = ds_config(global_batch_size=6, micro_batch_size=1, world_size=world_size, zero_stage=2)
        engine, _, _, _ = deepspeed.initialize(model=state.model, optimizer=state.optimizer, config=config)
        return engine, state.model

    def step(engine, n: int) -> float:
        torch.manual_seed(100 + n)
        x = torch.randint(0, 256, (1, 32))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    engine, model = engine_at(world)
    for i in range(STEPS * engine.gradient_accumulation_steps()):
        step(engine, i)
    t0 = time.perf_counter()
    before = _digest(engine, model)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    full = {n: (safe_get_full_fp32_param(p).clone(), {k: safe_get_full_optimizer_state(p, k).clone()
                                                       for k in ("exp_avg", "exp_avg_sq")})
            for n, p in model.named_parameters()}
    # AdamW's step count (bias correction) lives in the base optimizer's state of each flat partition
    adam_steps = sorted({int(st["step"]) for st in engine.optimizer.optimizer.state.values() if "step" in st})
    out["gather_s"] = round(time.perf_counter() - t0, 3)
    out["adam_step_world3"] = adam_steps
    out["digest_world3"] = before
    dist.barrier()
    if rank == world - 1:
        print(json.dumps(out), flush=True)
        return 0
    t1 = time.perf_counter()
    del engine, model
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("w2", store), rank=rank, world_size=world - 1)
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups

    ds_comm.cdb = None  # its backend wraps the destroyed world
    for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP"):
        if hasattr(ds_groups, name):
            setattr(ds_groups, name, None)
    out["regroup_s"] = round(time.perf_counter() - t1, 3)
    try:
        t2 = time.perf_counter()
        engine, model = engine_at(world - 1)
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
        for i in range(engine.gradient_accumulation_steps()):  # AdamW's state exists only after an
            step(engine, -1 - i)                                 # optimizer step: a throwaway one, overwritten
        for n, p in model.named_parameters():
            fp32, moments = full[n]
            safe_set_full_fp32_param(p, fp32)
            for k, v in moments.items():
                safe_set_full_optimizer_state(p, v, k)
        out["adam_step_after_set"] = sorted({int(st["step"]) for st in engine.optimizer.optimizer.state.values()})
        for st in engine.optimizer.optimizer.state.values():  # the throwaway step counted one: set it back
            st["step"] = torch.full_like(st["step"], adam_steps[0]) if torch.is_tensor(st["step"]) else adam_steps[0]
        out["rebuild_s"] = round(time.perf_counter() - t2, 3)
        out["digest_world2"] = _digest(engine, model)
        out["same_state"] = out["digest_world2"] == before
        out["world_after"] = dist.get_world_size()
        out["dp_world_size"] = engine.dp_world_size if hasattr(engine, "dp_world_size") else None
        out["loss_after"] = round(step(engine, 99), 4)
    except Exception as exc:  # what the spike is about: record it
        import traceback

        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        out["where"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.line}" for f in frames]
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3",
           "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "3"}
    procs = [subprocess.Popen([sys.executable, "-m", "bench.spikes.deepspeed_rebuild_spike", "--worker"],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(3)]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        lines = [x for x in out.splitlines() if x.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else {"exit": p.returncode, "stderr": err[-800:]})
    del store
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(worker() if "--worker" in sys.argv else main())
