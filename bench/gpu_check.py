"""``python -m bench.gpu_check [--ranks N] [--mb 256] [--params-m 50]`` (``bench/gpu_check.sh``):
the GPU check of issue 17, one table in well under 5 minutes.

It starts ``N`` local ranks itself (the environment torchrun would give them: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as a node's launcher would without
torchrun's elastic agent, and measures on each machine what restart-free elasticity is
built from:

- **init**: ``init_process_group`` (NCCL on CUDA with one GPU per rank, else gloo);
- **all-reduce**: ``--mb`` MB of bf16, its bus bandwidth (``2 (N-1)/N × bytes / s``, as
  nccl-tests reports it) and whether the sum is exact;
- **matmul**: bf16 TFLOP/s of one rank's device (8192² on CUDA; 256² on the CPU, where bf16 matmuls
  are slow and the dry run only shows that the step runs);
- **shrink**: the last rank leaves at a step boundary; the others re-form the group in
  their processes (:func:`trainer.runtime.shrink_process_group`) and all-reduce again;
- **grow**: the rank that left joins back (a new group of ``N``, the same store) and
  receives a model of ``--params-m`` M parameters (bf16) by broadcast from rank 0, the
  peer-to-peer path in-process grow takes instead of the object store;
- **loss**: one rank is killed with SIGKILL in the middle of the run (no notice); the
  survivors' next all-reduce fails (gloo: connection closed; NCCL: the group's timeout,
  ``--loss-timeout-s``), they abort the group and re-form it without the dead rank;
- **optimizer state for a reshard**: on one rank's device, AdamW's state allocated for a
  resize (:func:`trainer.integrations.meta.allocate_optimizer_state`, the FSDP2 and ZeRO
  paths) against the state a real step creates, for the foreach and the fused kernels
  (fused keeps ``step`` on the device): the same form, and once the values are set the
  next step bit-identical;
- **buddy copy to host memory**: the device half of a ``--replicate-shards`` copy's
  arrival (:class:`trainer.integrations.replicas.BuddyReplica`'s staged path, without the
  peer): the shard of a ``--params-m`` model with AdamW (12 bytes a parameter) through a
  staging area of ``STAGING_BYTES`` on the device into host memory, unpinned (as built)
  and pinned (not built: whether it would pay), GB/s each and whether the bytes arrived;
- **FSDP2 shards in memory held**: :func:`adopt_check`, the new shards of a resize taken
  as views of memory the rank holds (the grow's survivors, a shrink back);
- **NVML**: what the node agent reports per GPU (:class:`daemon.gpunode.gpu.NvmlSampler`).

Without CUDA it runs the same steps on gloo and the CPU (a dry run: the test suite runs
it so the script is known to work before a GPU is at hand). With one GPU, NCCL cannot put
two ranks on it: the multi-rank steps run on gloo and the table says so. The NCCL path
of the loss step (a timed-out collective, then ``_abort_process_group`` before the group
is re-formed) has not run yet: no machine with two GPUs has been at hand. Exit status 1
when a step fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from bench.ports import free_port




def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allreduce(ctx, mb: float) -> tuple[float, bool]:
    """Seconds for one all-reduce of ``mb`` MB of bf16 (after a warm-up) and whether it summed exactly."""
    import torch
    import torch.distributed as dist

    n = max(1, int(mb * 1e6 / 2))
    x = torch.full((n,), float(ctx.rank + 1), dtype=torch.bfloat16, device=ctx.device)
    dist.all_reduce(x)  # warm-up (NCCL sets its channels up on the first call)
    x.fill_(float(ctx.rank + 1))
    _sync(ctx.device)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    _sync(ctx.device)
    dt = time.perf_counter() - t0
    expected = ctx.world_size * (ctx.world_size + 1) / 2  # small integers: exact in bf16
    return dt, bool((x == expected).all().item())


def _matmul_tflops(device) -> float:
    import torch

    k = 8192 if device.type == "cuda" else 256
    a = torch.randn(k, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(k, k, dtype=torch.bfloat16, device=device)
    a @ b
    _sync(device)
    reps = 10 if device.type == "cuda" else 2
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * k**3 * reps / (time.perf_counter() - t0) / 1e12


def worker(args: argparse.Namespace) -> int:
    """One rank: every step in order, a JSON line of its figures on stdout (rank 0's
    figures are the table's)."""
    import torch
    import torch.distributed as dist

    from trainer.runtime import DistContext, env_world, shrink_process_group

    rank, local_rank, world = env_world()
    use_nccl = args.backend == "nccl"
    device = torch.device("cuda", local_rank) if use_nccl else (
        torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    if use_nccl:
        torch.cuda.set_device(device)
    endpoint = ("127.0.0.1", int(os.environ["MASTER_PORT"]))
    store = dist.TCPStore(*endpoint, is_master=False, timeout=timedelta(seconds=60))
    out: dict[str, object] = {"rank": rank, "backend": args.backend, "device": str(device)}

    t0 = time.perf_counter()
    dist.init_process_group(args.backend, store=dist.PrefixStore("init", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), **({"device_id": device} if use_nccl else {}))
    ctx = DistContext(rank, local_rank, world, args.backend, device, True)
    out["init_s"] = time.perf_counter() - t0
    dt, exact = _allreduce(ctx, args.mb)
    out.update(allreduce_s=dt, allreduce_exact=exact, busbw_gb_s=2 * (world - 1) / world * args.mb * 1e6 / dt / 1e9)
    out["matmul_tflops"] = _matmul_tflops(device)

    # shrink: the last rank leaves at a step boundary; it waits, then joins back (grow)
    leaver = world - 1
    survivors = list(range(world - 1))
    t0 = time.perf_counter()
    if rank == leaver:
        dist.destroy_process_group()
    else:
        ctx = shrink_process_group(ctx, survivors, "shrink", endpoint, timeout_s=60)
        _, out["shrink_exact"] = _allreduce(ctx, 1)
        out["shrink_s"] = time.perf_counter() - t0
        dist.destroy_process_group()

    # grow: every rank (the one that left included) forms a group of `world`; rank 0 sends the model
    t0 = time.perf_counter()
    dist.init_process_group(args.backend, store=dist.PrefixStore("grow", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), **({"device_id": device} if use_nccl else {}))
    ctx = DistContext(rank, local_rank, world, args.backend, device, True)
    out["grow_group_s"] = time.perf_counter() - t0
    params = torch.full((int(args.params_m * 1e6),), 1.0 if rank == 0 else 0.0, dtype=torch.bfloat16, device=device)
    t1 = time.perf_counter()
    dist.broadcast(params, src=0)
    _sync(device)
    out["grow_state_s"] = time.perf_counter() - t1
    out["grow_s"] = time.perf_counter() - t0
    out["grow_exact"] = bool((params == 1.0).all().item())

    # loss: the victim dies without notice after one more all-reduce; the others find out
    # from a failed collective, abort the group and re-form it without it
    victim = world - 1
    dist.barrier()
    if rank == victim:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        x = torch.ones(1024, device=device)
        for _ in range(1000):  # the victim's socket closes while these run
            dist.all_reduce(x, async_op=True).wait(timeout=timedelta(seconds=args.loss_timeout_s))
            _sync(device)
        out["loss_detected"] = False
    except Exception as exc:  # gloo: "Connection closed by peer"; NCCL: a timeout or an abort
        out["loss_detected"] = True
        out["loss_error"] = type(exc).__name__
    out["loss_detect_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    if use_nccl:  # a communicator that lost a peer is aborted, not shut down (that would wait for the peer)
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
    ctx = shrink_process_group(ctx, [r for r in range(world) if r != victim], "loss", endpoint, timeout_s=60)
    _, out["loss_exact"] = _allreduce(ctx, 1)
    out["loss_reform_s"] = time.perf_counter() - t1
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    return 0


def optimizer_state_check(device) -> str:
    """The reshard's allocated AdamW state on ``device`` (module docstring): ``"ok"`` for
    each kernel, or what differed."""
    import torch

    from trainer.integrations.meta import allocate_optimizer_state

    verdicts = []
    for kernel in ("foreach", "fused"):
        flags = {"foreach": True} if kernel == "foreach" else {"fused": True}
        g = torch.Generator(device="cpu").manual_seed(0)
        trained = [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in ((64, 32), (32,))]
        ref = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1, **flags)
        grads = [[torch.randn(p.shape, generator=g).to(device) for p in trained] for _ in range(2)]
        for p, gr in zip(trained, grads[0]):
            p.grad = gr
        ref.step()
        resized = [torch.nn.Parameter(torch.empty_like(p)) for p in trained]
        opt = torch.optim.AdamW(resized, lr=1e-2, weight_decay=0.1, **flags)
        if not allocate_optimizer_state(opt):
            verdicts.append(f"{kernel}: not allocated")
            continue
        same = all(list(opt.state[q]) == list(ref.state[p]) and all(
            (opt.state[q][k].shape, opt.state[q][k].dtype, opt.state[q][k].device)
            == (ref.state[p][k].shape, ref.state[p][k].dtype, ref.state[p][k].device) for k in ref.state[p])
            for p, q in zip(trained, resized))
        with torch.no_grad():
            for p, q in zip(trained, resized):
                q.copy_(p)
                for k in ref.state[p]:
                    opt.state[q][k].copy_(ref.state[p][k])
        for o, params in ((ref, trained), (opt, resized)):
            for p, gr in zip(params, grads[1]):
                p.grad = gr
            o.step()
        exact = all(torch.equal(p, q) for p, q in zip(trained, resized))
        verdicts.append(f"{kernel}: {'ok' if same and exact else 'form differs' if not same else 'step differs'}")
    return ", ".join(verdicts)


def adopt_check(device) -> str:
    """A resize's new shards in memory a rank holds already (:func:`trainer.integrations.
    fsdp_shards.adopt`), on ``device``: an FSDP2 model over a group of one takes views of
    larger memory holding other values as its parameters and AdamW's moments. ``"ok"``
    when every tensor was taken, the forward computes with that memory's values and
    AdamW's step updates it in place (the rows around the views untouched, the
    parameters still reading it after); else what differed. Sets up and destroys its
    own process group (NCCL on CUDA, else gloo) through a file store."""
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.integrations.fsdp_shards import ShardMover, adopt, fsdp_params

    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1, timeout=timedelta(seconds=60), **({"device_id": device} if cuda else {}))
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(device)
            fully_shard(model, mesh=init_device_mesh(device.type, (1,)))
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            x = torch.randn((5, 4), generator=g).to(device)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            mover = ShardMover(argparse.Namespace(state=argparse.Namespace(model=model, optimizer=opt)))
            params, memories, taken = fsdp_params(model), [], []
            for slot in list(mover._slots()):
                t = slot[2]
                local = t.to_local() if hasattr(t, "to_local") else t
                memory = torch.full((local.shape[0] + 4, *local.shape[1:]), -7.0, device=device)
                view = memory.narrow(0, 2, local.shape[0])  # rows 2.. of a larger, older shard's memory
                view.copy_(local.detach() * 2)  # other values than the model's: the forward must read them
                taken.append(adopt(slot, view, params))
                memories.append(memory)
            if not all(taken):
                return f"not taken: {taken.count(False)} of {len(taken)} tensors"
            w1, b1, w2, b2 = (m[2:-2] for m in (memories[0], memories[3], memories[6], memories[9]))
            if not torch.allclose(model(x), torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)):
                return "the forward reads other memory"
            before = [m.clone() for m in memories]
            model(x).sum().backward()
            opt.step()
            _sync(device)
            if not all(not torch.equal(m[2:-2], b[2:-2]) for m, b in zip(memories, before)):
                return "AdamW's step did not update the memory taken"
            if not all(torch.equal(m[:2], b[:2]) and torch.equal(m[-2:], b[-2:]) for m, b in zip(memories, before)):
                return "the step wrote past the views"
            if not all(torch.equal(p.to_local().detach(), memories[i][2:-2])
                       for i, p in zip((0, 3, 6, 9), model.parameters())):
                return "a parameter no longer reads the memory taken"
            return "ok"
        finally:
            dist.destroy_process_group()


def replica_copy_check(device, mb: float) -> tuple[str, bool]:
    """``mb`` MB of fp32 on ``device`` through a staging area there into host memory, round
    by round as a buddy copy arrives (module docstring): the rate unpinned and, on CUDA,
    pinned, and whether every byte arrived both times."""
    import torch

    from trainer.integrations.replicas import STAGING_BYTES, _host_buffer, rounds

    n = max(1, int(mb * 1e6 / 4))
    src = torch.arange(n, dtype=torch.float32, device=device)
    area = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=device)
    want, out, exact = src.cpu(), [], True
    for pinned in (False, True) if device.type == "cuda" else (False,):
        host = torch.empty(n, dtype=torch.float32, pin_memory=True) if pinned else _host_buffer((n,), src)
        _sync(device)
        t0 = time.perf_counter()
        for pieces in rounds([src.shape], [4], STAGING_BYTES):
            at = 0
            for _, start, k in pieces:
                piece = area.narrow(0, at, k * 4).view(torch.float32)
                piece.copy_(src.narrow(0, start, k))  # where the peer's send lands
                host.narrow(0, start, k).copy_(piece, non_blocking=pinned)
                at = -(-(at + k * 4) // 16) * 16
        _sync(device)
        dt = time.perf_counter() - t0
        same = torch.equal(host, want)
        exact = exact and same
        out.append(f"{'pinned' if pinned else 'unpinned'} {n * 4 / dt / 1e9:.2f} GB/s{'' if same else ' (bytes differ)'}")
    return ", ".join(out), exact


def nvml_rows() -> list[tuple[str, str]]:
    try:
        from daemon.gpunode.gpu import NvmlSampler
    except ImportError as exc:
        return [("NVML", f"not importable ({exc})")]
    s = NvmlSampler()
    try:
        samples = s.sample()
    finally:
        s.close()
    if samples is None:
        return [("NVML", f"absent: {s.reason}")]
    return [(f"NVML GPU {g.index} ({g.name})", f"sm {g.sm_util_pct}% mem {(g.mem_used_bytes or 0) / 2**30:.1f}/"
             f"{(g.mem_total_bytes or 0) / 2**30:.1f} GiB") for g in samples]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, help="local ranks (default: the GPUs, 2 to 8; 2 without CUDA)")
    p.add_argument("--mb", type=float, default=256.0, help="all-reduce size, MB of bf16")
    p.add_argument("--params-m", type=float, default=50.0, help="the model the newcomer receives, M parameters")
    p.add_argument("--loss-timeout-s", type=float, default=10.0,
                   help="how long a collective waits for a dead peer (NCCL finds out only by this timeout)")
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = args.ranks or min(8, max(2, gpus))
    if ranks < 2:
        p.error("--ranks: at least 2 (one leaves, one grows back)")
    backend = "nccl" if gpus >= ranks else "gloo"
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks),
           "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "bench.gpu_check", "--worker", "--backend", backend,
                               "--mb", str(args.mb), "--params-m", str(args.params_m),
                               "--loss-timeout-s", str(args.loss_timeout_s)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, text=True)
             for r in range(ranks)]
    outs = []
    try:
        for pr in procs:
            stdout, _ = pr.communicate(timeout=args.timeout_s)
            outs.append(stdout)
    except subprocess.TimeoutExpired:
        for pr in procs:
            pr.kill()
        print(f"bench.gpu_check: timed out after {args.timeout_s:g} s", file=sys.stderr)
        return 1
    del store
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    try:
        optim_state = optimizer_state_check(device)
    except Exception as exc:  # a kernel this device lacks: say so in the table, fail the check
        optim_state = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    try:
        adopted = adopt_check(device)
    except Exception as exc:  # FSDP2's internals moved (another torch): say so in the table, fail the check
        adopted = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    replica_mb = args.params_m * 12
    try:
        replica_copy, replica_ok = replica_copy_check(device, replica_mb)
    except Exception as exc:  # the device's memory or copy engine: say so in the table, fail the check
        replica_copy, replica_ok = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", False
    wall = time.perf_counter() - t0
    lines = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    r0 = next((x for x in lines if x["rank"] == 0), None)
    if r0 is None:
        print("bench.gpu_check: rank 0 reported nothing (its error is above)", file=sys.stderr)
        return 1
    why = "" if backend == "nccl" else (" (no CUDA: a dry run)" if gpus == 0 else
                                        f" ({gpus} GPU for {ranks} ranks: NCCL needs a GPU per rank)")
    rows = [
        ("torch", f"{torch.__version__}, CUDA {torch.version.cuda or '-'}"),
        ("GPUs", str(gpus) + (f" ({torch.cuda.get_device_name(0)})" if gpus else "")),
        ("ranks, backend, device", f"{ranks}, {backend}{why}, {r0['device']}"),
        ("init_process_group (s)", f"{r0['init_s']:.3f}"),
        (f"all-reduce {args.mb:g} MB bf16 (s)", f"{r0['allreduce_s']:.4f}"),
        ("all-reduce bus bandwidth (GB/s)", f"{r0['busbw_gb_s']:.2f}"),
        ("bf16 matmul (TFLOP/s, one rank)", f"{r0['matmul_tflops']:.3g}"),
        (f"shrink {ranks} -> {ranks - 1} in-process (s)", f"{r0['shrink_s']:.3f}"),
        (f"grow {ranks - 1} -> {ranks}: group (s)", f"{r0['grow_group_s']:.3f}"),
        (f"grow: {args.params_m:g} M bf16 parameters from rank 0 (s)", f"{r0['grow_state_s']:.3f}"),
        ("loss without notice: detected by a failed collective (s)",
         f"{r0['loss_detect_s']:.3f} ({r0.get('loss_error', 'not detected')})"),
        (f"loss: group re-formed without it, {ranks} -> {ranks - 1} (s)", f"{r0['loss_reform_s']:.3f}"),
        ("every collective summed exactly", str(all(r0[k] for k in ("allreduce_exact", "shrink_exact", "grow_exact",
                                                                     "loss_exact")))),
        (f"optimizer state allocated for a reshard ({device.type})", optim_state),
        (f"buddy copy: {replica_mb:g} MB {device.type} -> host through staging", replica_copy),
        (f"FSDP2 shards in memory held, forward and AdamW ({device.type})", adopted),
        *nvml_rows(),
        ("wall (s)", f"{wall:.1f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    ok = r0["loss_detected"] and all(r0[k] for k in ("allreduce_exact", "shrink_exact", "grow_exact", "loss_exact")) \
        and optim_state == "foreach: ok, fused: ok" and replica_ok and adopted == "ok"
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
