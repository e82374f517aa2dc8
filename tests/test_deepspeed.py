"""DeepSpeed integration: commit through the manifest-last protocol, resume at another
world size through DeepSpeed's universal checkpoint (converted once, cached in the store).

The slow test runs real ``torchrun`` (standalone, gloo, DeepSpeed's CPU accelerator)
with this file as the worker script: the example trainer's job, plus a dump of the
full fp32 parameters and Adam moments (assembled from the ZeRO partitions) after each
commit and after resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DUMP_DIR_ENV = "SPOTVISOR_TEST_DS_DUMP_DIR"
MODEL = ["--seq-len", "32", "--n-layer", "2", "--n-embd", "64", "--n-head", "2"]


# --------------------------------------------------------------------------- fast: config and cache


def test_ds_config_keeps_the_global_batch_at_every_valid_world_size() -> None:
    from trainer.batch import BatchError
    from trainer.integrations.deepspeed import ds_config

    for world, accum in ((1, 6), (2, 3), (3, 2), (6, 1)):
        cfg = ds_config(global_batch_size=12, micro_batch_size=2, world_size=world)
        assert cfg["train_batch_size"] == 12
        assert cfg["train_micro_batch_size_per_gpu"] == 2
        assert cfg["gradient_accumulation_steps"] == accum
        assert cfg["zero_optimization"] == {"stage": 2}
        assert cfg["bf16"] == {"enabled": False}
    with pytest.raises(BatchError, match="valid world sizes: 1, 2, 3, 6"):
        ds_config(global_batch_size=12, micro_batch_size=2, world_size=4)
    with pytest.raises(ValueError, match="zero_stage"):
        ds_config(global_batch_size=12, micro_batch_size=2, world_size=1, zero_stage=4)


def _committed(store, tmp_path: Path, step: int, payload: bytes):
    from trainer.checkpoint import Manifest, commit, write_dir

    src = tmp_path / f"src-{step}-{payload.hex()}"
    (src / f"global_step{step}").mkdir(parents=True)
    (src / f"global_step{step}" / "mp_rank_00_model_states.pt").write_bytes(payload)
    (src / "latest").write_text(f"global_step{step}")
    shards = write_dir(store, step, src)
    manifest = Manifest(step=step, world_size=2, global_batch_size=8, data_position={"consumed_samples": 8 * step},
                        shards=tuple(shards), extra={"ds_tag": f"global_step{step}"})
    commit(store, manifest)
    return manifest


def _universal_dir(tmp_path: Path, step: int) -> Path:
    out = tmp_path / "universal"
    (out / f"global_step{step}" / "zero" / "w").mkdir(parents=True)
    for name in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"):
        (out / f"global_step{step}" / "zero" / "w" / name).write_bytes(name.encode() * 10)
    (out / "latest_universal").write_text(f"global_step{step}")
    return out


def test_universal_cache_is_used_only_when_its_marker_and_every_file_hold(tmp_path: Path) -> None:
    from trainer.checkpoint import latest_committed, open_store, step_dir
    from trainer.integrations.deepspeed import (
        cached_universal,
        drop_universal,
        universal_marker_key,
        write_universal,
    )

    store = open_store((tmp_path / "store").as_uri())
    manifest = _committed(store, tmp_path, 3, b"model-a")
    assert cached_universal(store, manifest) is None  # nothing converted yet

    marker = write_universal(store, manifest, _universal_dir(tmp_path, 3), saved_world_size=2)
    assert {s.name for s in marker.shards} == {
        "universal/latest_universal",
        *(f"universal/global_step3/zero/w/{n}" for n in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")),
    }
    got = cached_universal(store, manifest)
    assert got is not None and got.shards == marker.shards and got.world_size == 2
    # The original checkpoint is untouched and still the one resume takes.
    assert latest_committed(store) == manifest

    # Made from other shards (same step, another checkpoint): not this one's cache.
    other = _committed(open_store((tmp_path / "other").as_uri()), tmp_path, 3, b"model-b")
    assert cached_universal(store, other) is None

    # Torn: one file short, or missing -> not trusted.
    key = f"{step_dir(3)}/universal/global_step3/zero/w/exp_avg.pt"
    data = store.get_bytes(key)
    store.put_bytes(key, data[:-1])
    assert cached_universal(store, manifest) is None
    store.delete([key])
    assert cached_universal(store, manifest) is None
    store.put_bytes(key, data)
    assert cached_universal(store, manifest) is not None

    # A marker that does not parse, or no marker at all (files present) -> no cache.
    raw = store.get_bytes(universal_marker_key(3))
    store.put_bytes(universal_marker_key(3), b"{not json")
    assert cached_universal(store, manifest) is None
    store.put_bytes(universal_marker_key(3), raw)
    store.delete([universal_marker_key(3)])
    assert store.list(f"{step_dir(3)}/universal/")  # files without marker
    assert cached_universal(store, manifest) is None

    # drop_universal removes the cache and nothing else.
    store.put_bytes(universal_marker_key(3), raw)
    drop_universal(store, 3)
    assert not store.list(f"{step_dir(3)}/universal")
    assert latest_committed(store) == manifest


def test_example_refuses_an_impossible_batch_with_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.examples.deepspeed_zero2", "--target-steps", "2",
         "--global-batch-size", "7", "--micro-batch-size", "2", "--checkpoint-uri", str(tmp_path / "c")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: global_batch_size 7 is not a multiple of micro_batch_size 2 (pick a global batch that is)"
    ]


def test_frozen_parameters_with_in_process_resizes_are_refused_with_one_line_and_exit_2(tmp_path: Path) -> None:
    """A model with frozen parameters (a frozen embedding here, as an adapter's base
    weights are): an in-process DeepSpeed resize carries ZeRO's partitions of the trained
    parameters and the model made from them, so a frozen one would come out of the
    resize uninitialised on every rank. The job refuses to start that way, naming the fix."""
    code = ("import sys\nfrom trainer.examples.deepspeed_zero2 import DeepSpeedJob, main\n"
            "class Frozen(DeepSpeedJob):\n"
            "    def build_state(self, device=None):\n"
            "        state = super().build_state(device)\n"
            "        state.model.transformer.wte.weight.requires_grad_(False)\n"
            "        return state\n"
            "sys.exit(main(sys.argv[1:], job_cls=Frozen))\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--target-steps", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
         "--checkpoint-uri", str(tmp_path / "c")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: --resize in-process: 1 frozen parameter(s) (transformer.wte.weight, ...)"), line
    assert line.endswith("pass --resize restart") and "Traceback" not in proc.stderr


def test_a_resize_engine_skips_deepspeeds_model_broadcast_and_only_inside_its_block() -> None:
    """A resize's engine is built inside ``no_model_broadcast``: DeepSpeed's broadcast of rank
    0's parameters (its uninitialised copy, at a resize) is a no-op there, as it would
    raise here with no process group; outside the block, and after an error in it, the
    engine broadcasts again (an engine built at start must: every rank takes rank 0's
    initialised model)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from trainer.integrations.deepspeed_resize import no_model_broadcast

    class Probe:  # what _broadcast_model reads first: a broadcast would go through torch.distributed
        dist_backend = "gloo"
        module = torch.nn.Linear(2, 2)

    original = DeepSpeedEngine._broadcast_model
    with no_model_broadcast():
        assert DeepSpeedEngine._broadcast_model(Probe()) is None  # type: ignore[arg-type]
    assert DeepSpeedEngine._broadcast_model is original
    with pytest.raises(RuntimeError), no_model_broadcast():
        raise RuntimeError("the engine failed to build")
    assert DeepSpeedEngine._broadcast_model is original
    with pytest.raises(Exception):  # noqa: B017 - the real broadcast, with no process group here
        DeepSpeedEngine._broadcast_model(Probe())  # type: ignore[arg-type]


# --------------------------------------------------------------------------- slow: real torchrun


def _torchrun(tmp_path: Path, name: str, nproc: int, store: Path, target: int, interval: int) -> dict:
    """Run this file as the worker under ``torchrun --standalone`` (``nproc`` > 1) or alone (a world
    of one, as the example runs without torchrun); returns its status lines and dump folder."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "DS_BUILD_OPS": "0",
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),
        "SPOTVISOR_STATUS_FILE": str(run_dir / "status.jsonl"),
        "SPOTVISOR_LOG_DIR": str(run_dir / "logs"),
        "SPOTVISOR_SCRATCH_DIR": str(tmp_path / "scratch" / name),
        DUMP_DIR_ENV: str(run_dir / "dumps"),
    }
    env.pop("SPOTVISOR_NOTICE_FILE", None)
    if nproc == 1:  # a world of one without torchrun: the store's port from the test's slice, not the
        # example's own pick in the kernel's ephemeral range, where a client socket can take it first
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--monitor-interval=0.5"] if nproc > 1 else []
    cmd = [
        sys.executable, *launcher, str(Path(__file__).resolve()),
        "--target-steps", str(target), "--global-batch-size", "8", "--micro-batch-size", "2",
        "--checkpoint-uri", store.as_uri(), "--checkpoint-interval", str(interval), *MODEL,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    print(f"{name}: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [json.loads(line) for line in (run_dir / "status.jsonl").read_text().splitlines()]
    return {"status": lines, "dumps": run_dir / "dumps"}


def _losses(status: list[dict]) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in status if s["event"] == "step"}


def _loaded(status: list[dict]) -> dict:
    (line,) = [s for s in status if s["event"] == "checkpoint_loaded"]
    return line


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs after resume"


@pytest.mark.slow
def test_resume_at_a_smaller_world_through_the_cached_universal_checkpoint(tmp_path: Path) -> None:
    from trainer.checkpoint import MANIFEST_NAME, step_dir
    from trainer.integrations.deepspeed import universal_marker_key

    store = tmp_path / "store"
    # A: world 2, commits at steps 3 (periodic) and 6 (final).
    a = _torchrun(tmp_path, "a-world2", 2, store, target=6, interval=3)
    assert [s["step"] for s in a["status"] if s["event"] == "checkpoint_committed"] == [3, 6]
    saved = torch.load(a["dumps"] / "commit-3.pt", weights_only=True)
    # Tear step 6: its files stay, its manifest goes. Resume must take step 3.
    (store / step_dir(6) / MANIFEST_NAME).unlink()

    # B: world 1 -> rank 0 converts step 3 to the universal format and caches it in the store.
    b = _torchrun(tmp_path, "b-world1", 1, store, target=3, interval=3)
    loaded = _loaded(b["status"])
    assert (loaded["step"], loaded["saved_world_size"], loaded["world_size"]) == (3, 2, 1)
    assert loaded["universal"] is True and loaded["cached"] is False
    assert loaded["convert_s"] > 0 and loaded["bytes"] > 0
    _assert_same_state(torch.load(b["dumps"] / "resume-3.pt", weights_only=True), saved)
    marker = (store / universal_marker_key(3)).read_bytes()

    # C: world 1 again -> the cached conversion, untouched; training continues as if never resized.
    c = _torchrun(tmp_path, "c-world1", 1, store, target=6, interval=0)
    loaded = _loaded(c["status"])
    assert loaded["universal"] is True and loaded["cached"] is True and loaded["convert_s"] == 0
    assert (store / universal_marker_key(3)).read_bytes() == marker
    _assert_same_state(torch.load(c["dumps"] / "resume-3.pt", weights_only=True), saved)
    want, got = _losses(a["status"]), _losses(c["status"])
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got[step], want[step])

    assert not (tmp_path / "torch_extensions").exists() or not any((tmp_path / "torch_extensions").iterdir()), \
        "DeepSpeed JIT-compiled an op"


# --------------------------------------------------------------------------- the torchrun worker


def _worker(argv: list[str]) -> int:
    """This file under torchrun: the example trainer, dumping the full state after commits and resume."""
    from trainer.examples.deepspeed_zero2 import DeepSpeedJob, main

    dump_dir = Path(os.environ[DUMP_DIR_ENV])

    class DumpingJob(DeepSpeedJob):
        def _dump(self, when: str) -> None:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            state = {}
            for name, p in self.engine.module.named_parameters():  # collective: every rank assembles
                state[f"{name}/module"] = p.detach().cpu().clone()
                state[f"{name}/fp32"] = safe_get_full_fp32_param(p).detach().cpu().clone()
                for key in ("exp_avg", "exp_avg_sq"):
                    state[f"{name}/{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
            if self.ctx.is_leader:
                dump_dir.mkdir(parents=True, exist_ok=True)
                torch.save(state, dump_dir / f"{when}-{self.state.step}.pt")

        def resume(self) -> None:
            super().resume()
            if self.last_committed is not None:
                self._dump("resume")

        def commit(self, *, reason, decision) -> None:  # type: ignore[no-untyped-def]
            super().commit(reason=reason, decision=decision)
            self._dump("commit")

    return main(argv, job_cls=DumpingJob)


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
