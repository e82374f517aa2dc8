"""DcpCheckpointer: sharded DCP checkpoints reshard across world sizes; torn ones are never loaded.

The acceptance (slow): a state saved at world size 3 (ranks on two simulated nodes,
each with its own node-local scratch folder) loads at 2 and at 4, and at 1 into an
unwrapped model, with every parameter and optimizer tensor identical (``torch.equal``)
to the full state gathered at 3 — for FSDP2 (sharded, uneven shards) and for DDP.
The rest runs in this process without a process group (DCP without collectives).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from conftest import new_bucket
from trainer.checkpoint import (
    FileStore,
    Manifest,
    S3Store,
    commit,
    latest_committed,
    list_committed,
    scan,
    step_dir,
    write_dir,
)
from trainer.guard import PreemptionGuard
from trainer.integrations.dcp import (
    DCP_FORMAT,
    METADATA_NAME,
    DcpCheckpointer,
    DcpError,
    ForeignCheckpointError,
)
from trainer.runtime import DistContext, StatusWriter

VOCAB, DIM, HIDDEN = 11, 6, 7  # dim 0 of 11, 7 and 6 rows: uneven shards at 2, 3 and 4 ranks
G = 12  # global batch size recorded in the manifests


class Tiny(nn.Module):
    """A two-block language model with GPT-2's parts (embedding, MLP blocks, LayerNorm, head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def _build(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (4, 5), generator=gen)
    logits = model(x)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """A copy of the model + optimizer state as full, unsharded CPU tensors (on rank 0; collective)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return copy.deepcopy({"model": msd, "optim": osd})  # unsharded, they may be the live tensors


def _mismatches(a: object, b: object, path: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ (tensors by torch.equal: dtype, shape, every value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [m for k in a for m in _mismatches(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in _mismatches(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _solo_ckpt(tmp: Path, store, model, opt, **kw) -> DcpCheckpointer:
    ctx = DistContext(0, 0, 1, None, torch.device("cpu"), False)
    status = StatusWriter(str(tmp / "status.jsonl"), ctx, "a1")
    return DcpCheckpointer(ctx, store, model, opt, scratch=tmp / "scratch", status=status,
                           guard=PreemptionGuard(None), **kw)


def _commit(ckpt: DcpCheckpointer, step: int):
    return ckpt.commit(step, reason="periodic", decision=None, global_batch_size=G,
                       data_position={"consumed_samples": step * G, "seed": 0})


# --------------------------------------------------------------------------- several worlds (slow)


def _layout(world: int) -> list[int]:
    """Node index of each rank: two simulated nodes, the first one holding the extra rank."""
    first = (world + 1) // 2
    return [0 if r < first else 1 for r in range(world)]


def _wrap(kind: str, model: nn.Module, world: int) -> nn.Module:
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return nn.parallel.DistributedDataParallel(model)


def _worker(rank: int, world: int, phase: str, tmp: str) -> None:
    from datetime import timedelta

    tmp_path = Path(tmp)
    dist.init_process_group("gloo", init_method=(tmp_path / f"pg-{phase}-{world}").as_uri(), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        layout = _layout(world)
        node = layout[rank]
        ctx = DistContext(rank, layout[:rank].count(node), world, "gloo", torch.device("cpu"), True)
        for kind in ("fsdp", "ddp"):
            # save: seed 0 and two steps; load: another init, no optimizer state yet.
            model = _wrap(kind, _build(0 if phase == "save" else 1), world)
            opt = _opt(model)
            store = FileStore((tmp_path / f"store-{kind}").as_uri())
            ckpt = DcpCheckpointer(ctx, store, model, opt, scratch=tmp_path / f"scratch-w{world}-n{node}",
                                   status=StatusWriter(None, ctx, phase), guard=PreemptionGuard(None))
            out: dict = {}
            if phase == "save":
                for step in range(2):
                    _train_step(model, opt, step, rank)
                r = _commit(ckpt, 2)
                out = {"save_s": r.save_s, "upload_s": r.upload_s, "bytes": r.bytes}
            else:
                before = _full_state(model, opt)
                if rank == 0:
                    torch.save(before, tmp_path / f"before-{kind}-w{world}.pt")
                manifest = ckpt.resume()
                assert manifest is not None and manifest.step == 2, manifest
                out = {"fetch_s": ckpt.last_load.fetch_s, "load_s": ckpt.last_load.load_s,
                       "data_position": manifest.data_position, "saved_world_size": manifest.world_size}
            full = _full_state(model, opt)
            if phase != "save":
                _train_step(model, opt, 2, rank)  # the loaded shards train on
            if rank == 0:
                torch.save(full, tmp_path / f"full-{kind}-w{world}.pt")
                (tmp_path / f"info-{kind}-w{world}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _run_world(world: int, phase: str, tmp: Path) -> None:
    """Run ``_worker`` on ``world`` ranks; raises when any rank fails (the others are killed).

    Forked, not spawned: a spawned rank re-imports torch and this module (~5 s each
    on two busy cores), a forked one shares them.
    """
    mp.start_processes(_worker, args=(world, phase, str(tmp)), nprocs=world, join=True, start_method="fork")


@pytest.mark.slow
def test_a_state_saved_at_world_3_loads_at_2_4_and_1_identically(tmp_path: Path) -> None:
    _run_world(3, "save", tmp_path)
    for kind in ("fsdp", "ddp"):
        store = FileStore((tmp_path / f"store-{kind}").as_uri())
        manifest = latest_committed(store)
        # Both nodes uploaded their part: one file per rank plus the coordinator's .metadata.
        assert {s.name for s in manifest.shards} == {METADATA_NAME, "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
        assert manifest.world_size == 3 and manifest.extra["format"] == DCP_FORMAT
    for world in (2, 4):
        _run_world(world, "load", tmp_path)
    for kind in ("fsdp", "ddp"):
        ref = torch.load(tmp_path / f"full-{kind}-w3.pt", weights_only=True)
        assert ref["optim"]["state"], "the reference has optimizer state"
        for world in (2, 4):
            before = torch.load(tmp_path / f"before-{kind}-w{world}.pt", weights_only=True)
            assert _mismatches(before["model"], ref["model"]), "the fresh model already equalled the saved one"
            got = torch.load(tmp_path / f"full-{kind}-w{world}.pt", weights_only=True)
            assert _mismatches(got, ref) == [], (kind, world)
            info = json.loads((tmp_path / f"info-{kind}-w{world}.json").read_text())
            assert info["data_position"] == {"consumed_samples": 2 * G, "seed": 0}
            assert info["saved_world_size"] == 3
        # World 1: an unwrapped model in this process, no process group.
        model = _build(1)
        opt = _opt(model)
        ckpt = _solo_ckpt(tmp_path / f"solo-{kind}", FileStore((tmp_path / f"store-{kind}").as_uri()), model, opt)
        assert ckpt.resume().step == 2
        assert _mismatches(_full_state(model, opt), ref) == [], (kind, 1)


# --------------------------------------------------------------------------- one process


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return FileStore((tmp_path / "store").as_uri())
    endpoint = request.getfixturevalue("s3_server")
    return S3Store(f"s3://{new_bucket(endpoint, 'dcp')}/job", endpoint_url=endpoint)


def _trained(steps: int, seed: int = 0):
    model = _build(seed)
    opt = _opt(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(steps):
        _train_step(model, opt, step, 0)
        sched.step()
    return model, opt, sched


def test_round_trip_restores_model_optimizer_and_extras(store, tmp_path: Path) -> None:
    model, opt, sched = _trained(3)
    ckpt = _solo_ckpt(tmp_path, store, model, opt, stateful={"lr_scheduler": sched})
    r = _commit(ckpt, 3)
    assert r.bytes == sum(s.size for s in r.manifest.shards) > 0 and r.save_s >= 0 and r.upload_s >= 0
    assert {s.name for s in r.manifest.shards} == {METADATA_NAME, "__0_0.distcp"}
    line = json.loads((tmp_path / "status.jsonl").read_text().splitlines()[-1])
    assert line["event"] == "checkpoint_committed" and line["step"] == 3 and line["bytes"] == r.bytes
    saved = _full_state(model, opt)

    fresh, fopt, fsched = _trained(0, seed=1)  # optimizer never stepped: no state yet
    loader = _solo_ckpt(tmp_path / "other", store, fresh, fopt, stateful={"lr_scheduler": fsched})
    manifest = loader.resume()
    assert manifest.step == 3 and manifest.data_position == {"consumed_samples": 3 * G, "seed": 0}
    assert _mismatches(_full_state(fresh, fopt), saved) == []
    assert fsched.state_dict() == sched.state_dict() and fopt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert loader.last_load.step == 3 and loader.last_load.bytes == r.bytes and loader.last_load.load_s >= 0
    assert not any((tmp_path / "other" / "scratch").iterdir()), "the resume folder is removed"


def test_nothing_committed_leaves_the_state_alone(tmp_path: Path) -> None:
    model, opt, _ = _trained(1)
    before = _full_state(model, opt)
    ckpt = _solo_ckpt(tmp_path, FileStore((tmp_path / "store").as_uri()), model, opt)
    assert ckpt.resume() is None and ckpt.last_load is None
    assert _mismatches(_full_state(model, opt), before) == []


def test_a_refusing_check_leaves_the_state_alone(tmp_path: Path) -> None:
    store = FileStore((tmp_path / "store").as_uri())
    model, opt, _ = _trained(1)
    _commit(_solo_ckpt(tmp_path, store, model, opt), 1)
    fresh, fopt, _ = _trained(0, seed=1)
    before = _full_state(fresh, fopt)
    ckpt = _solo_ckpt(tmp_path / "other", store, fresh, fopt)

    def refuse(manifest: Manifest) -> None:
        assert manifest.step == 1 and manifest.global_batch_size == G
        raise RuntimeError("trained with another global batch")

    with pytest.raises(RuntimeError, match="another global batch"):
        ckpt.resume(check=refuse)
    assert _mismatches(_full_state(fresh, fopt), before) == [] and ckpt.last_load is None
    assert not any((tmp_path / "other" / "scratch").iterdir()), "the fetched folder is removed"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the test's own dcp.save
def test_a_torn_dcp_checkpoint_is_never_loaded(store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _trained(1)
    ckpt = _solo_ckpt(tmp_path, store, model, opt)
    _commit(ckpt, 1)
    good = _full_state(model, opt)
    _train_step(model, opt, 1, 0)

    # 1. Killed inside dcp.save after the shard, before .metadata: nothing is committed...
    def killed(self, metadata, results):
        raise OSError("killed before .metadata")

    torn = tmp_path / "torn"
    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "finish", killed)
        with pytest.raises(DcpError, match="killed before"):
            _commit(ckpt, 2)
        with pytest.raises(CheckpointException):  # the same crash, into a folder this test keeps
            dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), storage_writer=FileSystemWriter(torn))
    assert (torn / "__0_0.distcp").exists() and not (torn / METADATA_NAME).exists()
    assert [d.step for d in scan(store)] == [1]
    # ...and even with its shard uploaded (the node died during the upload) it is not a checkpoint.
    write_dir(store, 2, torn)
    assert [d.step for d in scan(store) if not d.committed] == [2]

    # 2. Committed, then its .metadata lost from the store: torn (a listed shard is missing).
    _commit(ckpt, 3)
    store.delete([f"{step_dir(3)}/{METADATA_NAME}"])
    # 3. Committed, then its .metadata overwritten (same size): corrupt, found by sha256 on fetch.
    _commit(ckpt, 4)
    key = f"{step_dir(4)}/{METADATA_NAME}"
    store.put_bytes(key, bytes(len(store.get_bytes(key))))
    # 4. A manifest (format dcp) whose shards lack .metadata.
    commit(store, Manifest(step=5, world_size=1, global_batch_size=G, data_position={"consumed_samples": 5 * G},
                           shards=tuple(write_dir(store, 5, torn)), extra={"format": DCP_FORMAT}))
    assert [m.step for m in list_committed(store)] == [5, 4, 1]

    fresh, fopt, _ = _trained(0, seed=1)
    manifest = _solo_ckpt(tmp_path / "other", store, fresh, fopt).resume()
    assert manifest.step == 1
    assert _mismatches(_full_state(fresh, fopt), good) == []
    assert [m.step for m in list_committed(store)] == [1]


def test_a_checkpoint_of_another_trainer_is_refused(tmp_path: Path) -> None:
    store = FileStore((tmp_path / "store").as_uri())
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.pt").write_bytes(b"not dcp")
    commit(store, Manifest(step=5, world_size=1, global_batch_size=G, data_position={},
                           shards=tuple(write_dir(store, 5, src))))
    model, opt, _ = _trained(0)
    with pytest.raises(ForeignCheckpointError, match="not a DCP checkpoint"):
        _solo_ckpt(tmp_path, store, model, opt).resume()
    assert [m.step for m in list_committed(store)] == [5], "a foreign checkpoint is not deleted"


def test_a_checkpoint_of_another_shape_fails_loudly(tmp_path: Path) -> None:
    store = FileStore((tmp_path / "store").as_uri())
    model, opt, _ = _trained(1)
    _commit(_solo_ckpt(tmp_path, store, model, opt), 1)
    other = nn.Linear(3, 3)
    with pytest.raises(DcpError, match="does the checkpoint fit"):
        _solo_ckpt(tmp_path / "o", store, other, _opt(other)).resume()


def test_reserved_stateful_names_are_refused(tmp_path: Path) -> None:
    model, opt, _ = _trained(0)
    with pytest.raises(ValueError, match="reserved"):
        _solo_ckpt(tmp_path, FileStore((tmp_path / "s").as_uri()), model, opt, stateful={"model": model})


# --------------------------------------------------------------------------- the example trainer (slow)

REPO = Path(__file__).resolve().parents[1]
TINY_GPT2 = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
             "--global-batch-size", "12", "--micro-batch-size", "2"]


def _example(tmp: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    dist_env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_env}
    env.update(OMP_NUM_THREADS="1", SPOTVISOR_NOTICE_FILE=str(tmp / "notices.json"),
               SPOTVISOR_STATUS_FILE=str(tmp / "status.jsonl"), SPOTVISOR_LOG_DIR=str(tmp / "logs"),
               SPOTVISOR_SCRATCH_DIR=str(tmp / "scratch"))
    launcher = ([str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "trainer.examples.fsdp_dcp", "--checkpoint-uri", (tmp / "ckpt").as_uri(),
           *TINY_GPT2, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_the_fsdp_example_resumes_at_another_world_size_without_losing_a_sample(tmp_path: Path) -> None:
    p = _example(tmp_path, 2, "--target-steps", "3", "--checkpoint-interval", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    p = _example(tmp_path, 1, "--target-steps", "5")
    assert p.returncode == 0, p.stderr[-3000:]

    status = [json.loads(line) for line in (tmp_path / "status.jsonl").read_text().splitlines()]
    key = [(r["event"], r["world_size"], r["step"]) for r in status if r["event"] != "step"]
    assert key == [("started", 2, 0), ("checkpoint_committed", 2, 2), ("checkpoint_committed", 2, 3),
                   ("completed", 2, 3), ("checkpoint_loaded", 1, 3), ("started", 1, 3),
                   ("checkpoint_committed", 1, 5), ("completed", 1, 5)]
    loaded = next(r for r in status if r["event"] == "checkpoint_loaded")
    assert loaded["saved_world_size"] == 2 and loaded["bytes"] > 0
    manifests = list_committed(FileStore((tmp_path / "ckpt").as_uri()))
    assert [(m.step, m.world_size, m.extra["wrap"]) for m in manifests] == [
        (5, 1, "none"), (3, 2, "fsdp"), (2, 2, "fsdp")]
    # Every global position of steps 1..5 trained exactly once, across both world sizes.
    positions: dict[int, list[int]] = {}
    for f in (tmp_path / "logs").glob("steps-*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            positions.setdefault(r["step"], []).extend(r["positions"])
    assert {s: sorted(p) for s, p in positions.items()} == {s: list(range((s - 1) * G, s * G)) for s in range(1, 6)}
    losses = [r["loss"] for r in status if r["event"] == "step"]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
