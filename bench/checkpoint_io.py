"""Checkpoint I/O per trainer integration and store: bytes, save, upload, fetch, load.

For each integration this builds the demo model (the GPT-2 of ``configs/local.yaml``:
``--seq-len 128 --n-layer 4 --n-embd 256 --n-head 4``, 3.2 M parameters), trains one
optimizer step so AdamW has its moments, and then, once per store and repeat, commits
one checkpoint through the integration's own commit path into a fresh prefix, resumes
it into a freshly built model/optimizer/engine, and checks that the weights and AdamW
moments came back bit for bit (a bench that measured a broken load would be no use):

- ``ddp``: :class:`trainer.run.ReferenceJob`'s single shard (``_write_checkpoint``:
  ``state_to_bytes`` + ``write_shard`` + ``commit``); resume is ``latest_committed`` +
  ``load_shard`` (download + sha256) + ``load_state``.
- ``dcp``: :class:`~trainer.integrations.dcp.DcpCheckpointer` (``dcp.save`` of the
  unwrapped model at world 1, as :mod:`trainer.examples.fsdp_dcp` runs alone), resume
  through its ``resume()``.
- ``deepspeed``: :class:`~trainer.integrations.deepspeed.DeepSpeedCheckpointer` over the
  ZeRO-2 engine of :mod:`trainer.examples.deepspeed_zero2` (CPU accelerator, fp32),
  resume through its ``resume()`` at the same world size. Row ``ds-universal``: the
  resume another world size takes (fetch the original, ``ds_to_universal``, upload the
  cache marker-last, load in universal mode). A world of one cannot resume at world 2,
  so the checkpointer is told the engine has 2 data-parallel ranks; the conversion does
  not depend on the target world size, and the universal load goes into the world-1 engine.
- ``hf``: a :class:`~trainer.integrations.hf.SpotvisorTrainer` with its
  :class:`~trainer.integrations.hf.SpotvisorCallback` trains one step; the Trainer's own
  ``_save_checkpoint`` writes ``checkpoint-1`` and ``on_save`` commits it. Resume is
  :func:`~trainer.integrations.hf.resolve_resume_checkpoint`, then the loads
  ``Trainer.train(resume_from_checkpoint=...)`` makes (weights, trainer state,
  optimizer + scheduler, RNG) into a fresh Trainer whose optimizer is built.

Columns (seconds of wall time; median of ``--repeat`` runs):

- ``bytes``: the committed checkpoint (every shard the manifest lists; the manifest itself not);
  ds-universal: the universal cache beside it.
- ``save_s``: the framework's save, to bytes (ddp) or to node-local disk (the rest), as
  the integration reports it in its status line.
- ``upload_s``: shards to the store plus the manifest commit (ddp reports both; for the
  directory integrations the manifest commit is timed by wrapping
  ``trainer.integrations.common.commit`` and added).
- ``fetch_s``: newest-committed lookup + download + sha256 check (ds-universal: of the
  original that is converted).
- ``load_s``: into the fresh model/optimizer/engine (building them is excluded).
- ``conv_s``: ds-universal only, ``ds_to_universal``; its ``upload_s`` is the cache upload.

Everything runs in this process on loopback: one gloo process group of world size 1
(a FileStore rendezvous), file:// in a temporary directory, s3:// on moto's
``ThreadedMotoServer`` and oss:// on the project's ``tests/fakes/oss.py``, both on
127.0.0.1 with dummy credentials. The fakes share this process (and its GIL) with the
client, so s3/oss figures include the fake's own CPU; they are not a network.

Run from the repository root::

    python -m bench.checkpoint_io                        # or: python bench/checkpoint_io.py
    python -m bench.checkpoint_io --stores file,s3 --model small --repeat 5 --json /tmp/ckpt_io.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: import this checkout's packages
    sys.path.insert(0, str(ROOT))

__all__ = ["Sample", "MODELS", "INTEGRATIONS", "STORES", "measure", "main"]

INTEGRATIONS = ("ddp", "dcp", "deepspeed", "hf")
STORES = ("file", "s3", "oss")
#: Model flags of trainer.run: ``demo`` is configs/local.yaml's, ``small`` configs/local-deepspeed.yaml's.
MODELS = {
    "demo": ("--seq-len", "128", "--n-layer", "4", "--n-embd", "256", "--n-head", "4"),
    "small": ("--seq-len", "64", "--n-layer", "2", "--n-embd", "128", "--n-head", "4"),
}
GLOBAL_BATCH = 2  # = micro batch: one forward/backward per optimizer step at world 1
STEP = 1  # every checkpoint is taken after one optimizer step
BUCKET = "spotvisor-bench"
OSS_REGION = "cn-hangzhou"
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}
_OSS_ENV = {"OSS_ACCESS_KEY_ID": "spotvisor-bench-ak", "OSS_ACCESS_KEY_SECRET": "spotvisor-bench-sk"}
_COLUMNS = ("save_s", "upload_s", "fetch_s", "load_s", "conv_s")


@dataclass(frozen=True, slots=True)
class Sample:
    """One commit + resume of one integration against one store (seconds; bytes)."""

    integration: str
    store: str
    bytes: int
    save_s: float | None
    upload_s: float
    fetch_s: float
    load_s: float
    conv_s: float | None = None  # ds-universal only (which saves nothing: save_s None)


# --------------------------------------------------------------------------- environment


def _prepare_environment(tmp: Path) -> None:
    """Before torch.distributed / deepspeed are used: a world of one, CPU DeepSpeed, dummy keys, no node files."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      DS_BUILD_OPS="0", TORCH_EXTENSIONS_DIR=str(tmp / "torch_extensions"),
                      SPOTVISOR_SCRATCH_DIR=str(tmp / "scratch"), **_AWS_ENV, **_OSS_ENV)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the trainers' default; else accelerate picks one mid-run
    for name in ("SPOTVISOR_STATUS_FILE", "SPOTVISOR_LOG_DIR", "SPOTVISOR_NOTICE_FILE", "MASTER_PORT"):
        os.environ.pop(name, None)


@contextlib.contextmanager
def _process_group(tmp: Path) -> Iterator[Any]:
    """A gloo group of world size 1 (FileStore rendezvous in ``tmp``); yields its DistContext."""
    import torch
    import torch.distributed as dist

    from trainer.runtime import DistContext

    store = dist.FileStore(str(tmp / "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield DistContext(0, 0, 1, "gloo", torch.device("cpu"), True)
    finally:
        dist.destroy_process_group()


class _Stores:
    """file:// under ``tmp``, s3:// on moto, oss:// on FakeOss; each :meth:`open` is a fresh prefix.

    Servers start in ``__enter__`` (only those asked for) and stop in reverse order.
    """

    def __init__(self, kinds: tuple[str, ...], tmp: Path) -> None:
        self.kinds, self.tmp = kinds, tmp
        self._stack = contextlib.ExitStack()
        self._s3_client: Any = None
        self._oss: Any = None
        self._n = 0

    def __enter__(self) -> _Stores:
        try:
            if "s3" in self.kinds:
                import boto3
                from moto.server import ThreadedMotoServer

                server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
                server.start()
                self._stack.callback(server.stop)
                logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's access log
                host, port = server.get_host_and_port()
                self._s3_client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
                self._s3_client.create_bucket(Bucket=BUCKET)
            if "oss" in self.kinds:
                sys.path.insert(0, str(ROOT / "tests"))
                from fakes.oss import FakeOss

                self._oss = self._stack.enter_context(FakeOss(
                    access_key_id=_OSS_ENV["OSS_ACCESS_KEY_ID"], access_key_secret=_OSS_ENV["OSS_ACCESS_KEY_SECRET"],
                    region=OSS_REGION))
                self._oss.create_bucket(BUCKET)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def open(self, kind: str, integration: str) -> Any:
        from trainer.checkpoint import FileStore, S3Store

        self._n += 1
        name = f"{integration}-{self._n:03d}"
        if kind == "file":
            return FileStore((self.tmp / "store" / name).as_uri())
        if kind == "s3":
            return S3Store(f"s3://{BUCKET}/{name}", client=self._s3_client)
        if kind == "oss":
            from trainer.oss_store import OssStore

            return OssStore(f"oss://{BUCKET}/{name}", endpoint=self._oss.endpoint, region=OSS_REGION,
                            checkpoint_dir=self.tmp / "oss-records")
        raise ValueError(f"unknown store kind {kind!r}")


class _ManifestTimer:
    """Times ``trainer.checkpoint.commit`` as the directory integrations call it (the manifest write)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def wrapping(self) -> Iterator[_ManifestTimer]:
        import trainer.integrations.common as common

        original = common.commit

        def timed(store: Any, manifest: Any) -> None:
            t0 = time.perf_counter()
            try:
                original(store, manifest)
            finally:
                self.seconds += time.perf_counter() - t0

        self.seconds = 0.0
        common.commit = timed
        try:
            yield self
        finally:
            common.commit = original


# --------------------------------------------------------------------------- checks


def _same_params(what: str, want: Any, got: Any) -> None:
    import torch

    a, b = dict(want.named_parameters()), dict(got.named_parameters())
    if a.keys() != b.keys():
        raise RuntimeError(f"{what}: parameter names differ after load")
    for name, p in a.items():
        if not torch.equal(p.detach().cpu(), b[name].detach().cpu()):
            raise RuntimeError(f"{what}: parameter {name} differs after load")


def _same_adam(what: str, want: Any, got: Any) -> None:
    import torch

    pa = [p for g in want.param_groups for p in g["params"]]
    pb = [p for g in got.param_groups for p in g["params"]]
    compared = 0
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        sx, sy = want.state.get(x, {}), got.state.get(y, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in sx:
                if not (key in sy and torch.equal(sx[key], sy[key])):
                    raise RuntimeError(f"{what}: AdamW {key} of parameter {i} differs after load")
                compared += 1
    if not compared:
        raise RuntimeError(f"{what}: the source optimizer has no AdamW moments to compare")


def _same_zero_state(what: str, want: Any, got: Any) -> None:
    """DeepSpeed ZeRO: the fp32 master partitions and their AdamW moments (the engines' inner optimizer)."""
    import torch

    inner_a, inner_b = want.optimizer.optimizer, got.optimizer.optimizer
    pa = [p for g in inner_a.param_groups for p in g["params"]]
    pb = [p for g in inner_b.param_groups for p in g["params"]]
    for i, (x, y) in enumerate(zip(pa, pb, strict=True)):
        if not torch.equal(x.detach(), y.detach()):
            raise RuntimeError(f"{what}: fp32 master partition {i} differs after load")
    _same_adam(what, inner_a, inner_b)


# --------------------------------------------------------------------------- integrations


class _Bench:
    """What every integration shares: the process group, job flags, batch plan and tokens."""

    def __init__(self, ctx: Any, model_flags: tuple[str, ...], tmp: Path) -> None:
        import torch

        from trainer.batch import ElasticBatch
        from trainer.data import VOCAB_SIZE
        from trainer.run import build_parser

        self.ctx, self.tmp = ctx, tmp
        self.args = build_parser().parse_args([
            "--target-steps", str(STEP), "--global-batch-size", str(GLOBAL_BATCH),
            "--micro-batch-size", str(GLOBAL_BATCH), "--checkpoint-uri", (tmp / "unused").as_uri(),
            "--checkpoint-interval", "0", *model_flags])
        self.plan = ElasticBatch(GLOBAL_BATCH, GLOBAL_BATCH).plan(1)
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB_SIZE, (64 * (self.args.seq_len + 1),), generator=gen)
        self.timer = _ManifestTimer()

    def guard(self) -> Any:
        from trainer.guard import PreemptionGuard

        return PreemptionGuard("")  # no notice file: nothing to answer

    def position(self, dataset_len: int) -> dict[str, int]:
        from trainer.runtime import data_position

        return data_position(STEP, GLOBAL_BATCH, self.args.seed, dataset_len)

    def scratch(self, name: str) -> Path:
        path = self.tmp / "scratch" / name
        shutil.rmtree(path, ignore_errors=True)
        return path


def _trained(job: Any) -> Any:
    """``job`` resumed from its empty store, wrapped, and one optimizer step further."""
    if job.wrap_before_resume:
        job.wrap()
        job.resume()
    else:
        job.resume()
        job.wrap()
    job.train_step()
    return job


def _ddp(b: _Bench) -> Callable[[Any, str], list[Sample]]:
    from trainer.checkpoint import latest_committed, load_shard
    from trainer.run import MODEL_SHARD, ReferenceJob, build_state, load_state

    job = _trained(ReferenceJob(b.args, b.ctx, b.plan, b.tokens))

    def run(store: Any, kind: str) -> list[Sample]:
        job.store, job.last_committed, job.committed_step = store, None, None  # a fresh store: nothing committed
        nbytes, _, save_s, upload_s = job._write_checkpoint(job.state.step, "bench")
        fresh = build_state(b.args, b.ctx.device)
        t0 = time.perf_counter()
        manifest = latest_committed(store)
        data = load_shard(store, manifest, MODEL_SHARD)
        t1 = time.perf_counter()
        load_state(fresh, data, b.ctx.device)
        t2 = time.perf_counter()
        _same_params("ddp", job.state.model, fresh.model)
        _same_adam("ddp", job.state.optimizer, fresh.optimizer)
        return [Sample("ddp", kind, int(nbytes), save_s, upload_s, t1 - t0, t2 - t1)]

    return run


def _dcp(b: _Bench) -> Callable[[Any, str], list[Sample]]:
    from trainer.examples.fsdp_dcp import DcpJob
    from trainer.integrations.dcp import DcpCheckpointer
    from trainer.run import build_state

    job = _trained(DcpJob(b.args, b.ctx, b.plan, b.tokens))

    def run(store: Any, kind: str) -> list[Sample]:
        ckpt = DcpCheckpointer(b.ctx, store, job.ddp, job.state.optimizer, scratch=b.scratch("dcp"),
                               status=job.status, guard=b.guard())
        with b.timer.wrapping() as t:
            r = ckpt.commit(job.state.step, reason="bench", decision=None, global_batch_size=GLOBAL_BATCH,
                            data_position=b.position(len(job.dataset)))
        fresh = build_state(b.args, b.ctx.device)
        loader = DcpCheckpointer(b.ctx, store, fresh.model, fresh.optimizer, scratch=b.scratch("dcp-resume"),
                                 status=job.status, guard=b.guard())
        if loader.resume() is None or loader.last_load is None:
            raise RuntimeError("dcp: nothing to resume from right after a commit")
        _same_params("dcp", job.state.model, fresh.model)
        _same_adam("dcp", job.state.optimizer, fresh.optimizer)
        ll = loader.last_load
        return [Sample("dcp", kind, r.bytes, r.save_s, r.upload_s + t.seconds, ll.fetch_s, ll.load_s)]

    return run


def _deepspeed(b: _Bench) -> Callable[[Any, str], list[Sample]]:
    import importlib

    from trainer.examples.deepspeed_zero2 import DeepSpeedJob
    from trainer.integrations.deepspeed import DeepSpeedCheckpointer

    class AsIfWorld2(DeepSpeedCheckpointer):
        """Resumes as if the engine had 2 data-parallel ranks: the universal path, on a world of one."""

        @property
        def dp_world_size(self) -> int:
            return 2

    importlib.import_module("deepspeed.checkpoint.ds_to_universal")  # now, not inside the first conv_s
    job = _trained(DeepSpeedJob(b.args, b.ctx, b.plan, b.tokens))

    def checkpointer(cls: type, engine: Any, store: Any, name: str) -> Any:
        return cls(engine, b.ctx, store, scratch=b.scratch(name), status=job.status, guard=b.guard(),
                   global_batch_size=GLOBAL_BATCH)

    def resume(cls: type, store: Any, name: str) -> Any:
        fresh = DeepSpeedJob(b.args, b.ctx, b.plan, b.tokens)  # fresh model, AdamW and engine
        fresh.build_engine()
        ckpt = checkpointer(cls, fresh.engine, store, name)
        if ckpt.resume() is None or ckpt.last_resume is None:
            raise RuntimeError(f"{name}: nothing to resume from right after a commit")
        _same_params(name, job.engine.module, fresh.engine.module)
        _same_zero_state(name, job.engine, fresh.engine)
        return ckpt.last_resume

    def run(store: Any, kind: str) -> list[Sample]:
        ckpt = checkpointer(DeepSpeedCheckpointer, job.engine, store, "ds")
        with b.timer.wrapping() as t:
            r = ckpt.commit(job.state.step, reason="bench", decision=None,
                            data_position=b.position(len(job.dataset)), client_state={"attempt": job.attempt})
        plain = resume(DeepSpeedCheckpointer, store, "ds-resume")
        univ = resume(AsIfWorld2, store, "ds-universal")
        if plain.universal or not univ.universal or univ.cached:
            raise RuntimeError(f"deepspeed: unexpected resume paths {plain} / {univ}")
        return [Sample("deepspeed", kind, r.bytes, r.save_s, r.upload_s + t.seconds, plain.fetch_s, plain.load_s),
                Sample("ds-universal", kind, univ.bytes, None, univ.upload_s, univ.fetch_s, univ.load_s,
                       univ.convert_s)]

    return run


def _hf(b: _Bench) -> Callable[[Any, str], list[Sample]]:
    from transformers import PrinterCallback, TrainerState, TrainingArguments, default_data_collator
    from transformers.utils import logging as hf_logging

    from trainer.batch import ElasticBatch
    from trainer.data import TokenDataset
    from trainer.examples.hf_finetune import build_model
    from trainer.integrations.common import DirCheckpointer
    from trainer.integrations.hf import (
        GlobalPositionDataset,
        SpotvisorCallback,
        SpotvisorTrainer,
        resolve_resume_checkpoint,
        training_args_kwargs,
    )
    from trainer.runtime import StatusWriter, StepLog

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dataset = TokenDataset(b.tokens, b.args.seq_len)
    model_args = argparse.Namespace(**vars(b.args), lora=False)

    def trainer(store: Any, name: str) -> tuple[Any, DirCheckpointer]:
        status = StatusWriter(None, b.ctx, "bench")
        ckpt = DirCheckpointer(b.ctx, store, b.scratch(name), status, b.guard(), keep=2)
        targs = TrainingArguments(
            **training_args_kwargs(ElasticBatch(GLOBAL_BATCH, GLOBAL_BATCH), 1, output_dir=b.scratch(f"{name}-out"),
                                   target_steps=STEP, checkpoint_interval=0, seed=b.args.seed),
            learning_rate=b.args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, logging_strategy="no", use_cpu=True,
            ddp_find_unused_parameters=False)
        callback = SpotvisorCallback(ctx=b.ctx, checkpointer=ckpt, plan=b.plan, steplog=StepLog(None, b.ctx, "bench"),
                                     hold_timeout_s=0.0, seed=b.args.seed, dataset_len=len(dataset))
        t = SpotvisorTrainer(
            model=build_model(model_args), args=targs,
            train_dataset=GlobalPositionDataset(dataset, STEP * GLOBAL_BATCH, seed=b.args.seed,
                                                to_features=lambda s: {"input_ids": s[0], "labels": s[0]}),
            data_collator=default_data_collator, spotvisor=callback)
        t.remove_callback(PrinterCallback)  # its metrics line
        return t, ckpt

    def run(store: Any, kind: str) -> list[Sample]:
        source, ckpt = trainer(store, "hf")
        with b.timer.wrapping() as t:
            source.train()  # one step; SpotvisorCallback.on_save commits the Trainer's checkpoint-1
        manifest = ckpt.last_committed
        if manifest is None or manifest.step != STEP:
            raise RuntimeError("hf: the Trainer did not commit step 1")
        t0 = time.perf_counter()
        got, local = resolve_resume_checkpoint(DirCheckpointer(b.ctx, store, b.scratch("hf-resume"),
                                                               StatusWriter(None, b.ctx, "bench"), b.guard()),
                                               global_batch_size=GLOBAL_BATCH)
        fetch_s = time.perf_counter() - t0
        if got is None or local is None:
            raise RuntimeError("hf: nothing to resume from right after a commit")
        fresh, _ = trainer(store, "hf-fresh")
        fresh.create_optimizer_and_scheduler(num_training_steps=STEP)
        # What Trainer.train(resume_from_checkpoint=local) loads, in its order.
        t1 = time.perf_counter()
        fresh._load_from_checkpoint(str(local))
        fresh.state = TrainerState.load_from_json(str(local / "trainer_state.json"))
        fresh._load_optimizer_and_scheduler(str(local))
        fresh._load_rng_state(str(local))
        load_s = time.perf_counter() - t1
        shutil.rmtree(local, ignore_errors=True)
        if fresh.state.global_step != STEP:
            raise RuntimeError(f"hf: loaded trainer state is at step {fresh.state.global_step}")
        _same_params("hf", source.model, fresh.model)
        _same_adam("hf", source.optimizer, fresh.optimizer)
        nbytes = sum(s.size for s in manifest.shards)
        upload_s = float(manifest.extra["upload_s"]) + t.seconds
        return [Sample("hf", kind, nbytes, float(manifest.extra["save_s"]), upload_s, fetch_s, load_s)]

    return run


_RUNNERS = {"ddp": _ddp, "dcp": _dcp, "deepspeed": _deepspeed, "hf": _hf}


# --------------------------------------------------------------------------- measure + report


def measure(*, integrations: tuple[str, ...], stores: tuple[str, ...], model: str, repeat: int,
            tmp: Path) -> tuple[list[Sample], int]:
    """Every integration x store, ``repeat`` times. Returns the samples and the model's parameter count."""
    from trainer.run import build_model

    # The Trainer prints its metrics: keep stdout for the table.
    with contextlib.redirect_stdout(sys.stderr), _process_group(tmp) as ctx, _Stores(stores, tmp) as opened:
        b = _Bench(ctx, MODELS[model], tmp)
        n_params = sum(p.numel() for p in build_model(b.args).parameters())
        samples: list[Sample] = []
        for name in integrations:
            run = _RUNNERS[name](b)  # build + one optimizer step: not timed
            for _ in range(repeat):
                for kind in stores:
                    samples += run(opened.open(kind, name), kind)
        return samples, n_params


def _summary(samples: list[Sample]) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str], list[Sample]] = {}
    for s in samples:
        rows.setdefault((s.integration, s.store), []).append(s)
    first = {name: i for i, name in reversed(list(enumerate(s.integration for s in samples)))}
    out = []
    for (integration, store), group in sorted(rows.items(), key=lambda kv: (first[kv[0][0]], STORES.index(kv[0][1]))):
        row: dict[str, Any] = {"integration": integration, "store": store, "n": len(group),
                               "bytes": int(statistics.median(s.bytes for s in group))}
        for col in _COLUMNS:
            values = [getattr(s, col) for s in group if getattr(s, col) is not None]
            row[col] = statistics.median(values) if values else None
        out.append(row)
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    head = f"{'integration':<13} {'store':<5} {'bytes':>11} " + " ".join(f"{c:>8}" for c in _COLUMNS)
    lines = [head]
    for r in rows:
        cells = " ".join(f"{r[c]:>8.3f}" if r[c] is not None else f"{'-':>8}" for c in _COLUMNS)
        lines.append(f"{r['integration']:<13} {r['store']:<5} {r['bytes']:>11,} {cells}")
    return "\n".join(lines)


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    picked = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in picked if x not in allowed]
    if bad or not picked:
        raise argparse.ArgumentTypeError(f"{flag} takes a comma list of {', '.join(allowed)}; got {text!r}")
    return picked


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint_io", description=__doc__.split("\n")[0])
    p.add_argument("--stores", default=",".join(STORES), type=lambda t: _choices(t, STORES, "--stores"),
                   help=f"comma list of {', '.join(STORES)} (default all)")
    p.add_argument("--integrations", default=",".join(INTEGRATIONS),
                   type=lambda t: _choices(t, INTEGRATIONS, "--integrations"),
                   help=f"comma list of {', '.join(INTEGRATIONS)} (default all)")
    p.add_argument("--model", choices=tuple(MODELS), default="demo",
                   help="demo: configs/local.yaml's GPT-2 (3.2 M parameters); small: local-deepspeed.yaml's (0.44 M)")
    p.add_argument("--repeat", type=int, default=3, help="runs per integration and store; the table shows medians")
    p.add_argument("--json", metavar="PATH", help="also write the samples and medians as JSON here")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")

    tmp = Path(tempfile.mkdtemp(prefix="sv-bench-ckpt-"))
    _prepare_environment(tmp)
    from daemon.logs import configure_logging

    configure_logging(level="WARNING")  # stderr; the table goes to stdout
    from trainer.runtime import configure_threads

    configure_threads()  # as the trainers do: OMP_NUM_THREADS, default 1
    try:
        started = time.monotonic()
        samples, n_params = measure(integrations=args.integrations, stores=args.stores, model=args.model,
                                    repeat=args.repeat, tmp=tmp)
        wall_s = time.monotonic() - started
    except ImportError as exc:  # deepspeed is an extra, moto a dev dependency
        print(f"error: {exc} (install it, or leave its integration/store out with --integrations/--stores)",
              file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = _summary(samples)
    import torch

    print(f"checkpoint I/O, model {args.model} ({n_params / 1e6:.2f} M parameters, AdamW after one step), "
          f"world 1 (gloo, CPU, {torch.get_num_threads()} torch thread(s)), median of {args.repeat}, "
          f"{wall_s:.1f} s wall incl. set-up")
    print(_table(rows))
    if args.json:
        doc = {
            "bench": "checkpoint_io",
            "time": time.time(),
            "model": args.model,
            "model_flags": list(MODELS[args.model]),
            "parameters": n_params,
            "repeat": args.repeat,
            "stores": list(args.stores),
            "integrations": list(args.integrations),
            "wall_s": round(wall_s, 3),
            "machine": {"python": platform.python_version(), "platform": platform.platform(),
                        "processor": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__},
            "results": rows,
            "samples": [asdict(s) for s in samples],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
