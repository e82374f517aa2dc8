"""The Hugging Face Trainer integration (trainer/integrations/hf.py) and its example script.

Fast tests run the real ``transformers.Trainer`` in this process at world size 1
(``trainer.examples.hf_finetune.main``); the ``slow`` one resumes across world sizes,
one of them under real ``torchrun`` (gloo), and compares with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from node_files import status_lines, step_records, write_notices
from trainer.batch import BatchError, ElasticBatch
from trainer.checkpoint import FileStore, latest_committed, list_committed, step_dir, write_dir
from trainer.examples import hf_finetune
from trainer.guard import PreemptionGuard
from trainer.integrations.common import DirCheckpointer
from trainer.integrations.hf import (
    HF_FORMAT,
    SAMPLE_POSITIONS_KEY,
    GlobalPositionDataset,
    ResumeError,
    SpotvisorCallback,
    resolve_resume_checkpoint,
    training_args_kwargs,
)
from trainer.runtime import DistContext, StatusWriter, StepLog

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16"]
SOLO = DistContext(0, 0, 1, None, torch.device("cpu"), False)


# --------------------------------------------------------------------------- helpers


def _env(tmp: Path) -> dict[str, str]:
    return {
        "SPOTVISOR_NOTICE_FILE": str(tmp / "notices.json"),
        "SPOTVISOR_STATUS_FILE": str(tmp / "status.jsonl"),
        "SPOTVISOR_LOG_DIR": str(tmp / "logs"),
        "SPOTVISOR_SCRATCH_DIR": str(tmp / "scratch"),
    }


def _main(tmp: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """``hf_finetune.main`` in this process (world size 1), node files under ``tmp``."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in _env(tmp).items():
        monkeypatch.setenv(k, v)
    return hf_finetune.main(["--checkpoint-uri", (tmp / "ckpt").as_uri(), *TINY, *args])


def _hf_folder(folder: Path, step: int, ranks: int = 2) -> None:
    """What the Trainer leaves in checkpoint-N (contents shortened)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(bytes([step % 256]) * 4096)
    (folder / "optimizer.pt").write_bytes(b"optim" * 100 + bytes([step]))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    for r in range(ranks):
        (folder / f"rng_state_{r}.pth").write_bytes(f"rng {r} at {step}".encode())


def _checkpointer(tmp: Path, store: FileStore) -> DirCheckpointer:
    return DirCheckpointer(SOLO, store, tmp / "scratch", StatusWriter(str(tmp / "status.jsonl"), SOLO, "a1"),
                           PreemptionGuard(str(tmp / "notices.json")), keep=5)


def _commit(ckpt: DirCheckpointer, step: int, *, gbs: int = 8, fmt: str | None = HF_FORMAT) -> None:
    ckpt.commit(step, lambda d: _hf_folder(d, step), reason="periodic", decision=None, global_batch_size=gbs,
                data_position={"consumed_samples": step * gbs}, extra={"format": fmt} if fmt else None)


# --------------------------------------------------------------------------- pieces


def test_training_args_keep_the_global_batch_at_every_world_size(tmp_path: Path) -> None:
    batch = ElasticBatch(12, 2)
    for world, accum in ((1, 6), (2, 3), (3, 2), (6, 1)):
        kw = training_args_kwargs(batch, world, output_dir=tmp_path, target_steps=50, checkpoint_interval=10)
        assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] * world == 12
        assert kw["gradient_accumulation_steps"] == accum
    assert kw["train_sampling_strategy"] == "sequential" and kw["save_total_limit"] is None
    assert kw["ignore_data_skip"] is False and kw["save_steps"] == 10 and kw["max_steps"] == 50
    with pytest.raises(BatchError, match="valid world sizes: 1, 2, 3, 6"):
        training_args_kwargs(batch, 4, output_dir=tmp_path, target_steps=50, checkpoint_interval=10)


def test_dataset_items_are_global_positions() -> None:
    base = [{"input_ids": torch.tensor([i])} for i in range(5)]
    ds = GlobalPositionDataset(base, 12, seed=3)
    items = [ds[p] for p in range(12)]
    assert [it[SAMPLE_POSITIONS_KEY] for it in items] == list(range(12))
    epoch0 = sorted(int(it["input_ids"]) for it in items[:5])
    assert epoch0 == [0, 1, 2, 3, 4]  # each epoch is a permutation of the base
    with pytest.raises(IndexError):
        ds[12]


def test_resume_takes_the_newest_committed_never_a_torn_one(tmp_path: Path) -> None:
    store = FileStore((tmp_path / "store").as_uri())
    ckpt = _checkpointer(tmp_path, store)
    _commit(ckpt, 2)
    _commit(ckpt, 4)
    # step 6: a node killed mid-upload: shard files, no manifest
    _hf_folder(tmp_path / "torn6", 6)
    write_dir(store, 6, tmp_path / "torn6")
    # step 8: committed, then a shard cut short in the store
    _commit(ckpt, 8)
    shard = store.root / step_dir(8) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert latest_committed(store).step == 4

    fresh = _checkpointer(tmp_path, store)  # a new incarnation
    manifest, folder = resolve_resume_checkpoint(fresh, global_batch_size=8)
    assert manifest.step == 4 and manifest.extra["format"] == HF_FORMAT
    assert folder.is_dir() and folder.is_relative_to(tmp_path / "scratch")
    assert (folder / "model.safetensors").read_bytes() == bytes([4]) * 4096
    assert sorted(p.name for p in folder.iterdir()) == [
        "model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]


def test_resume_refuses_another_global_batch_or_a_foreign_checkpoint(tmp_path: Path) -> None:
    store = FileStore((tmp_path / "a").as_uri())
    _commit(_checkpointer(tmp_path, store), 3, gbs=8)
    with pytest.raises(ResumeError, match="global_batch_size 8, not 16"):
        resolve_resume_checkpoint(_checkpointer(tmp_path, store), global_batch_size=16)
    other = FileStore((tmp_path / "b").as_uri())
    _commit(_checkpointer(tmp_path, other), 3, fmt=None)
    with pytest.raises(ResumeError, match="not written by the HF Trainer"):
        resolve_resume_checkpoint(_checkpointer(tmp_path, other), global_batch_size=8)
    assert resolve_resume_checkpoint(_checkpointer(tmp_path, FileStore((tmp_path / "c").as_uri())),
                                     global_batch_size=8) == (None, None)


def test_callback_on_notice_saves_commits_holds_and_stops(tmp_path: Path) -> None:
    """One step boundary with an interruption notice, hook by hook (no Trainer)."""
    store = FileStore((tmp_path / "store").as_uri())
    ckpt = _checkpointer(tmp_path, store)
    cb = SpotvisorCallback(ctx=SOLO, checkpointer=ckpt, plan=ElasticBatch(4, 1).plan(1),
                           steplog=StepLog(str(tmp_path / "logs"), SOLO, "a1"), hold_timeout_s=0.0, seed=0,
                           dataset_len=100)
    args = SimpleNamespace(output_dir=str(tmp_path / "out"))
    state, control = TrainerState(global_step=3, max_steps=10), TrainerControl()
    (tmp_path / "out").mkdir()
    _hf_folder(tmp_path / "out" / "checkpoint-3", 3, ranks=3)  # a killed worker's, never committed
    cb.on_train_begin(args, state, control)
    assert not (tmp_path / "out" / "checkpoint-3").exists()
    cb.record([8, 9], 1.0)
    cb.record([10, 11], 1.5)
    write_notices(tmp_path, ("n-1", "interruption"))

    cb.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop

    _hf_folder(tmp_path / "out" / "checkpoint-3", 3, ranks=1)  # the Trainer's _save_checkpoint
    control.should_save = False  # as CallbackHandler.on_save does
    cb.on_save(args, state, control)
    manifest = latest_committed(store)
    assert manifest.step == 3 and manifest.extra["notice_ids"] == ["n-1"] and manifest.extra["reason"] == "notice"
    assert manifest.data_position["consumed_samples"] == 12
    assert {s.name for s in manifest.shards} == {"trainer_state.json", "rng_state_0.pth", "model.safetensors",
                                                 "optimizer.pt"}
    assert not (tmp_path / "out" / "checkpoint-3").exists()  # moved out: rotation cannot touch it
    assert control.should_training_stop is False  # hold timed out (0 s): train on, like trainer.run
    events = [(r["event"], r["step"]) for r in status_lines(tmp_path)]
    assert events == [("started", 3), ("step", 3), ("checkpoint_committed", 3), ("holding", 3)]
    first = step_records(tmp_path, by_time=True)[0]
    assert first["positions"] == [8, 9, 10, 11] and first["loss"] == 2.5

    # the notice is handled: the next boundary does not act on it again
    state.global_step, control = 4, TrainerControl()
    cb.on_step_end(args, state, control)
    assert not control.should_save and not control.should_training_stop


# --------------------------------------------------------------------------- the Trainer, in this process


def test_notice_in_training_commits_then_holds_until_a_peer_leaves(tmp_path: Path, monkeypatch) -> None:
    def peer_left(self, timeout_s, poll_s=0.25):
        raise RuntimeError("Connection closed by peer")  # what gloo raises in the hold's all-reduce

    monkeypatch.setattr(PreemptionGuard, "hold", peer_left)
    write_notices(tmp_path, ("n-1", "interruption"))
    with pytest.raises(RuntimeError, match="closed by peer"):
        _main(tmp_path, monkeypatch, "--target-steps", "5", "--global-batch-size", "4", "--micro-batch-size", "2",
              "--checkpoint-interval", "0")
    events = [(r["event"], r["step"]) for r in status_lines(tmp_path)]
    assert events == [("started", 0), ("step", 1), ("checkpoint_committed", 1), ("holding", 1)]
    committed = status_lines(tmp_path)[2]
    assert committed["notice_ids"] == ["n-1"] and committed["reason"] == "notice" and committed["bytes"] > 0
    manifest = latest_committed(FileStore((tmp_path / "ckpt").as_uri()))
    assert manifest.step == 1 and manifest.extra["notice_ids"] == ["n-1"]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= {
        s.name for s in manifest.shards}
    assert [s["step"] for s in step_records(tmp_path, by_time=True)] == [1]


def test_hold_timeout_trains_on_and_resume_answers_a_new_notice_without_rewriting(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    common = ["--global-batch-size", "4", "--micro-batch-size", "2", "--checkpoint-interval", "2",
              "--hold-timeout-s", "0"]
    write_notices(tmp_path, ("n-1", "interruption"))
    assert _main(tmp_path, monkeypatch, "--target-steps", "3", *common) == 0
    first = status_lines(tmp_path)
    assert [(r["event"], r["step"], r.get("reason")) for r in first if r["event"] != "step"] == [
        ("started", 0, None), ("checkpoint_committed", 1, "notice"), ("holding", 1, None),
        ("checkpoint_committed", 2, "periodic"), ("checkpoint_committed", 3, "final"), ("completed", 3, None)]

    # Restarted at the committed step 3 with a new notice: answered at once, nothing saved again.
    write_notices(tmp_path, ("n-1", "interruption"), ("c-2", "checkpoint"))
    assert _main(tmp_path, monkeypatch, "--target-steps", "5", *common) == 0
    second = status_lines(tmp_path)[len(first):]
    assert second[0]["event"] == "started" and second[0]["resumed_from"] == 3
    commits = [(r["step"], r["reason"], r["notice_ids"], r["reused"]) for r in second
               if r["event"] == "checkpoint_committed"]
    assert commits == [(3, "notice", ["c-2"], True), (4, "periodic", [], False), (5, "final", [], False)]
    steps = step_records(tmp_path, by_time=True)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert [p for s in steps for p in s["positions"]] == list(range(5 * 4))


def test_lora_adapters_commit_and_resume_exactly(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("peft")
    common = ["--lora", "--global-batch-size", "4", "--micro-batch-size", "2", "--checkpoint-interval", "0"]
    a, b = tmp_path / "split", tmp_path / "whole"
    a.mkdir(), b.mkdir()
    assert _main(a, monkeypatch, "--target-steps", "2", *common) == 0
    names = {s.name for s in latest_committed(FileStore((a / "ckpt").as_uri())).shards}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    assert _main(a, monkeypatch, "--target-steps", "4", *common) == 0
    assert _main(b, monkeypatch, "--target-steps", "4", *common) == 0
    split = [s["loss"] for s in step_records(a, by_time=True)]
    whole = [s["loss"] for s in step_records(b, by_time=True)]
    assert split == pytest.approx(whole, rel=1e-5)
    assert whole[-1] < whole[0]


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    assert _main(tmp_path, monkeypatch, "--target-steps", "1", "--global-batch-size", "4",
                 "--micro-batch-size", "3") == 2
    assert "not a multiple of micro_batch_size 3" in capsys.readouterr().err
    assert _main(tmp_path, monkeypatch, "--target-steps", "1", "--data", str(tmp_path / "nope.txt")) == 2
    assert capsys.readouterr().err.startswith("error: data file not found")
    assert _main(tmp_path, monkeypatch, "--target-steps", "1", "--global-batch-size", "4",
                 "--micro-batch-size", "2") == 0
    capsys.readouterr()
    assert _main(tmp_path, monkeypatch, "--target-steps", "2", "--global-batch-size", "8",
                 "--micro-batch-size", "2") == 2
    err = capsys.readouterr().err
    assert "global_batch_size 4, not 8" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- torchrun


def _torchrun(tmp: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    env.update(_env(tmp), OMP_NUM_THREADS="1")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "-m", "trainer.examples.hf_finetune",
           "--checkpoint-uri", (tmp / "ckpt").as_uri(), *TINY, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_resume_at_other_world_sizes_keeps_the_exact_sample_order(tmp_path: Path, monkeypatch) -> None:
    """World size 1 → 2 (torchrun, gloo) → 1: no rng_state file fits the new ranks (and
    one is left over), the global batch stays 8, every position is trained exactly once,
    and the losses are those of an uninterrupted run. World size 1 runs in this process."""
    common = ["--global-batch-size", "8", "--micro-batch-size", "2", "--checkpoint-interval", "0"]
    elastic, whole = tmp_path / "elastic", tmp_path / "whole"
    elastic.mkdir(), whole.mkdir()
    assert _main(elastic, monkeypatch, "--target-steps", "2", *common) == 0
    p = _torchrun(elastic, 2, "--target-steps", "4", *common)
    assert p.returncode == 0, p.stderr[-4000:]
    manifests = {m.step: m for m in list_committed(FileStore((elastic / "ckpt").as_uri()))}
    assert manifests[2].world_size == 1 and manifests[4].world_size == 2
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {s.name for s in manifests[4].shards}
    assert _main(elastic, monkeypatch, "--target-steps", "6", *common) == 0
    started = [(r["world_size"], r["resumed_from"]) for r in status_lines(elastic) if r["event"] == "started"]
    assert started == [(1, None), (2, 2), (1, 4)]

    steps = step_records(elastic, by_time=True)
    by_step: dict[int, list[int]] = {}
    for s in steps:
        by_step.setdefault(s["step"], []).extend(s["positions"])
        assert len(s["positions"]) == 8 // s["world_size"]  # micro x accum per rank
    assert sorted(by_step) == list(range(1, 7))
    for step, positions in by_step.items():
        assert sorted(positions) == list(range((step - 1) * 8, step * 8))  # exact: no gap, no repeat

    assert _main(whole, monkeypatch, "--target-steps", "6", *common) == 0
    losses = {r["step"]: r["loss"] for r in status_lines(elastic) if r["event"] == "step"}
    reference = {r["step"]: r["loss"] for r in status_lines(whole) if r["event"] == "step"}
    assert [losses[s] for s in range(1, 7)] == pytest.approx([reference[s] for s in range(1, 7)], rel=1e-5)
