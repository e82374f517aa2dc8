"""Pre-flight: GPU memory per offer and checkpoint flush vs the notice window
(daemon/controlnode/preflight.py), its CLI tables, and the supervisor never buying an offer
whose GPUs cannot hold the job."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import RecordingProvider
from daemon.catalog import UnknownGpuError, gpu_memory_gib
from daemon.controlnode import preflight as pf
from daemon.interfaces.cli import main as cli_main
from daemon.config import Config, ModelSpec, load_config
from daemon.model import EventKind, NodeState
from daemon.control.offers import History, Offer, rank_offers
from daemon.controlnode.store import Store
from daemon.controlnode.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9


def setup(**model) -> pf.Setup:
    return pf.resolve(ModelSpec(**model))


def need(world: int = 1, micro: int = 1, **model) -> pf.MemoryEstimate:
    return pf.estimate_memory(setup(**model), world_size=world, micro_batch_size=micro)


def config(model: dict | None, offers: list[dict], *, min_nodes=1, max_nodes=4, **job) -> Config:
    return Config.model_validate({
        "pool": {"name": "pf", "min_nodes": min_nodes, "target_nodes": min_nodes, "max_nodes": max_nodes},
        "job": {"global_batch_size": 64, "micro_batch_size": 1, "model": model, **job},
        "providers": {"aws": {"image_id": "ami-0123"}},
        "offers": [{"provider": "aws", "region": "us-east-1", "zone": "us-east-1a", **o} for o in offers],
    })


# -- the seeds' rules of thumb -----------------------------------------------------------------


def test_7b_full_finetune_unsharded_needs_more_than_48gb_and_more_than_80() -> None:
    e = need(preset="llama-7b", params=7e9)  # bf16 + AdamW, ZeRO-0, one GPU
    # model states are 2 + 2 + 12 bytes per parameter (ZeRO paper, K = 12): 112 GB
    assert e.params_bytes + e.grads_bytes + e.optimizer_bytes == pytest.approx(16 * 7e9)
    assert e.total_bytes > 48 * GB
    assert not e.fits(gpu_memory_gib("L40S"))
    assert not e.fits(gpu_memory_gib("A100-80GB"))
    assert e.fits(gpu_memory_gib("H200"))


def test_13b_needs_an_80gb_gpu_even_sharded_over_8() -> None:
    assert not need(preset="llama-13b").fits(80)  # unsharded: ~208 GB of states
    sharded = need(world=8, preset="llama-13b", zero_stage=3)
    assert sharded.fits(gpu_memory_gib("A100-80GB"))
    assert not sharded.fits(gpu_memory_gib("A100-40GB"))


def test_lora_7b_fits_a_24gb_gpu_where_full_finetune_does_not() -> None:
    lora = need(preset="llama-7b", lora_rank=8, activation_checkpointing=True)
    full = need(preset="llama-7b", activation_checkpointing=True)
    assert lora.fits(gpu_memory_gib("4090")) and lora.fits(gpu_memory_gib("A10G"))
    assert not full.fits(24)
    # the frozen base keeps only its bf16 weights; rank 8 on q/v trains ~4.2 M parameters
    assert lora.params_bytes == pytest.approx(2 * 6.738e9)
    assert lora.optimizer_bytes == pytest.approx(12 * 4 * 32 * 4096 * 8)


# -- the formulas ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, divided", [
    (0, set()), (1, {"optimizer"}), (2, {"optimizer", "grads"}), (3, {"optimizer", "grads", "params"}),
])
def test_zero_stage_divides_states_by_world_size(stage: int, divided: set[str]) -> None:
    one, eight = need(world=1, preset="llama-7b", zero_stage=stage), need(world=8, preset="llama-7b", zero_stage=stage)
    for part in ("params", "grads", "optimizer"):
        ratio = getattr(one, f"{part}_bytes") / getattr(eight, f"{part}_bytes")
        assert ratio == pytest.approx(8 if part in divided else 1), part


def test_zero2_matches_deepspeeds_own_estimate() -> None:
    # deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs(cpu_offload=False):
    # gpu_mem = 2 * total_params + 18 * total_params / total_gpus
    e = need(world=16, preset="llama-7b", zero_stage=2)
    assert e.params_bytes + e.grads_bytes + e.optimizer_bytes == pytest.approx(2 * 6.738e9 + 18 * 6.738e9 / 16)
    z3 = need(world=16, preset="llama-7b", zero_stage=3)  # stage3's estimator: 18 / N (+ the largest layer)
    assert z3.params_bytes + z3.grads_bytes + z3.optimizer_bytes >= 18 * 6.738e9 / 16


@pytest.mark.parametrize("precision, optimizer, per_param", [
    ("bf16", "adamw", 16), ("fp16", "adamw", 16), ("fp32", "adamw", 16),
    ("bf16", "sgd-momentum", 12), ("fp32", "sgd-momentum", 12),
])
def test_model_state_bytes_per_parameter(precision: str, optimizer: str, per_param: int) -> None:
    e = need(preset="llama-7b", precision=precision, optimizer=optimizer)
    assert (e.params_bytes + e.grads_bytes + e.optimizer_bytes) / 6.738e9 == pytest.approx(per_param)


def test_adafactor_keeps_little_more_than_the_master_weights() -> None:
    e = need(preset="llama-7b", optimizer="adafactor")
    assert 4 < e.optimizer_bytes / 6.738e9 < 4.01


def test_activations_follow_korthikanti_and_recomputation_cuts_them() -> None:
    s, b, h, a, L, v = 2048, 1, 4096, 32, 32, 32000
    eager = need(preset="llama-7b", flash_attention=False).activations_bytes
    assert eager == pytest.approx(L * s * b * h * (34 + 5 * a * s / h) + 4 * s * b * v)
    flash = need(preset="llama-7b").activations_bytes
    assert flash == pytest.approx(L * s * b * h * 34 + 4 * s * b * v)
    full = need(preset="llama-7b", activation_checkpointing=True).activations_bytes
    assert full == pytest.approx(L * 2 * s * b * h + s * b * h * 34 + 4 * s * b * v)
    assert need(micro=4, preset="llama-7b").activations_bytes == pytest.approx(4 * flash)


def test_gpu_memory_table_and_size_suffix() -> None:
    assert gpu_memory_gib("A100-40GB") == 40
    assert gpu_memory_gib("A100") == 40  # sold as 40 and 80 GB: the smaller, unless the size is given
    assert gpu_memory_gib("A100-80GB") == 80
    assert gpu_memory_gib("V100-32G") == 32
    assert gpu_memory_gib("A10G-24GB") == 24
    assert gpu_memory_gib("NVIDIA H200") == 141
    assert gpu_memory_gib("none") is None
    with pytest.raises(UnknownGpuError, match="MI300"):
        gpu_memory_gib("MI300")


# -- world size: the smallest valid one is the worst case ----------------------------------------


def test_smallest_valid_world_size_decides_whether_an_offer_is_usable() -> None:
    c = config({"preset": "llama-13b", "zero_stage": 3},
               [{"instance_type": "p4d.24xlarge", "gpu_type": "A100-40GB", "gpus_per_node": 8}])
    (fit,) = pf.offer_fits(c)
    assert (fit.smallest.world_size, fit.largest.world_size) == (8, 32)
    assert fit.largest.fits(40)  # at 4 nodes the shards would fit ...
    assert not fit.smallest.fits(40)  # ... but one node (min_nodes 1) is where the pool can end up
    assert not fit.usable
    # with min_nodes 2 the least sharded world is 16 GPUs, which fits
    (fit2,) = pf.offer_fits(config({"preset": "llama-13b", "zero_stage": 3},
                                   [{"instance_type": "p4d.24xlarge", "gpu_type": "A100-40GB", "gpus_per_node": 8}],
                                   min_nodes=2))
    assert fit2.smallest.world_size == 16 and fit2.usable


def test_unknown_gpu_type_with_a_model_is_a_config_error_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"offers\.0\.gpu_type: .*MI300.*offers\.0\.gpu_memory_gib"):
        config({"preset": "gpt2"}, [{"instance_type": "x", "gpu_type": "MI300"}])
    c = config({"preset": "gpt2"}, [{"instance_type": "x", "gpu_type": "MI300", "gpu_memory_gib": 192}])
    assert pf.offer_fits(c)[0].available_gib == 192
    config(None, [{"instance_type": "x", "gpu_type": "MI300"}])  # no model: no pre-flight, no error


# -- flush deadline ----------------------------------------------------------------------------


def test_7b_zero3_on_8_nodes_is_at_risk_in_a_30s_window_not_in_aws_120s() -> None:
    s = setup(preset="llama-7b", zero_stage=3)
    nbytes = pf.checkpoint_bytes_per_node(s, world_size=64, gpus_per_node=8)
    assert nbytes == pytest.approx(14 * 6.738e9 / 8)  # bf16 weights + fp32 master, m, v; one node in 8
    flush = pf.estimate_flush(nbytes, upload_bytes_s=1e9, save_bytes_s=2e9)
    assert flush.flush_s == pytest.approx(nbytes / 1e9 + nbytes / 2e9)  # ~17.7 s
    gcp = pf.check_deadline(flush, provider="gcp", window_s=30, safety_factor=2.0)
    aws = pf.check_deadline(flush, provider="aws", window_s=120, safety_factor=2.0)
    assert gcp.at_risk and gcp.verdict.startswith("RISK")
    assert not aws.at_risk
    # on 32 nodes each node writes a quarter as much: 30 s is enough
    small = pf.checkpoint_bytes_per_node(s, world_size=256, gpus_per_node=8)
    assert not pf.check_deadline(pf.estimate_flush(small, upload_bytes_s=1e9, save_bytes_s=2e9),
                                 provider="gcp", window_s=30, safety_factor=2.0).at_risk


def test_unsharded_checkpoint_all_lands_on_rank_0s_node() -> None:
    s = setup(preset="llama-7b")
    assert pf.checkpoint_bytes_per_node(s, world_size=64, gpus_per_node=8) == pytest.approx(14 * 6.738e9)
    z2 = setup(preset="llama-7b", zero_stage=2)  # model once (rank 0) + this node's optimizer partitions
    assert pf.checkpoint_bytes_per_node(z2, world_size=64, gpus_per_node=8) == pytest.approx(
        2 * 6.738e9 + 12 * 6.738e9 / 8)
    lora = setup(preset="llama-7b", trainable_fraction=0.01)  # adapters only
    assert pf.checkpoint_bytes_per_node(lora, world_size=1, gpus_per_node=1) == pytest.approx(14 * 6.738e7)


def test_windows_come_from_the_documented_leads_and_the_chaos_schedule() -> None:
    c = config({"preset": "gpt2"}, [{"instance_type": "g5", "gpu_type": "A10G"}])
    assert pf.notice_windows(c) == {"aws": 120.0}
    local = Config.model_validate({"chaos": [{"action": "notice", "node": 1, "at_step": 1, "lead_s": 12},
                                             {"action": "notice", "node": 2, "at_step": 2, "lead_s": 40}]})
    assert pf.notice_windows(local) == {"local": 12}
    assert pf.notice_windows(Config()) == {}  # local without notices: nothing to compare


def test_measured_commit_checks() -> None:
    c = config({"preset": "llama-7b", "zero_stage": 3},
               [{"instance_type": "p5", "gpu_type": "H100", "gpus_per_node": 8}])
    slow = pf.measured_deadline_checks(c, {"bytes": 8e10, "save_s": 30.0, "upload_s": 40.0}, nodes=8)
    (aws,) = slow
    assert aws.at_risk and aws.flush.flush_s == 70.0 and aws.flush.bytes_per_node == 1e10
    data = aws.event_data("measured")
    assert data["throughput_bytes_s"] == 250_000_000 and data["window_s"] == 120.0 and "zero_stage" in data["remedy"]
    (fast,) = pf.measured_deadline_checks(c, {"bytes": 8e10, "save_s": 5.0, "upload_s": 10.0}, nodes=8)
    assert not fast.at_risk
    assert pf.measured_deadline_checks(c, {"bytes": 8e10, "seconds": 0.0, "reused": True}, nodes=8) == []
    (only_seconds,) = pf.measured_deadline_checks(c, {"bytes": 1e9, "seconds": 100.0}, nodes=1)
    assert only_seconds.at_risk  # 120 / 100 < 2


# -- the command line --------------------------------------------------------------------------


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


OFFERS_YAML = """
pool: {min_nodes: 1, target_nodes: 1, max_nodes: 2}
daemon: {agent_host: 10.0.0.10}
rendezvous: {host: 10.0.0.10}
job:
  global_batch_size: 16
  micro_batch_size: 1
  model: {preset: llama-7b}
  checkpoint_uri: s3://ckpt-bucket/llama
providers: {aws: {image_id: ami-0123, iam_instance_profile: spotvisor-node}}
offers:
  - {provider: aws, region: us-east-1, zone: us-east-1a, instance_type: g6e.xlarge, gpu_type: L40S, gpus_per_node: 1}
"""


def test_check_config_lists_the_unusable_offer_and_passes_when_another_fits(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(OFFERS_YAML + "  - {provider: aws, region: us-east-1, zone: us-east-1a, instance_type: "
                    "p5en.48xlarge, gpu_type: H200, gpus_per_node: 8}\n")
    r = run_cli("check-config", str(path))
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip().startswith("#")}
    assert "UNUSABLE" in rows["#0"] and " 48 " in rows["#0"] and "(w=1)" in rows["#0"]
    assert rows["#1"].rstrip().endswith("ok") and "141" in rows["#1"]
    needed = float(rows["#0"].split("(w=1)")[0].split()[-1])
    assert needed == pytest.approx(need(preset="llama-7b").total_gib, abs=0.05)


def test_check_config_exits_2_when_no_offer_can_hold_the_job(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(OFFERS_YAML)
    r = run_cli("check-config", str(path))
    assert r.returncode == 2
    assert "Traceback" not in r.stdout + r.stderr
    assert ": ok" not in r.stdout
    assert "UNUSABLE" in r.stdout
    (problem,) = r.stderr.strip().splitlines()
    assert problem.startswith(f"{path}: offers: no offer can hold the job")
    for fix in ("pool.min_nodes", "zero_stage", "bigger GPU", "activation_checkpointing"):
        assert fix in problem
    # the daemon refuses to start a pool it could never buy a node for
    r = run_cli("run", "--config", str(path))
    assert r.returncode == 2 and r.stderr.strip() == problem


def test_shipped_configs_pass_the_preflight() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        c = load_config(path)
        assert pf.no_fit_message(pf.offer_fits(c)) is None, path.name


def test_preflight_command_answers_for_7b_on_8_and_32_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["preflight", "--preset", "llama-7b", "--zero-stage", "3", "--nodes", "8", "32",
                   "--gpus-per-node", "8", "--throughput-gbs", "1.0"])
    out = capsys.readouterr().out
    assert rc == 0
    flush_rows = {line.split()[0]: line for line in out.split("checkpoint flush")[1].splitlines()[2:]
                  if line.strip()[:1].isdigit()}
    header = out.split("checkpoint flush")[1].splitlines()[1]
    assert "aws 120s" in header and "aliyun 300s" in header and "gcp 30s" in header and "azure 30s" in header
    assert "11.79 GB" in flush_rows["8"] and "RISK" in flush_rows["8"] and "MISS" not in flush_rows["8"]
    assert "2.95 GB" in flush_rows["32"] and "RISK" not in flush_rows["32"]


@pytest.mark.parametrize("argv, needle", [
    (["--preset", "nope"], "preset 'nope' is unknown"),
    ([], "no model"),
    (["--params", "7e9"], "hidden_size, num_layers, num_heads required"),
    (["--preset", "gpt2", "--gpu", "MI300"], "--gpu: gpu_type 'MI300'"),
    (["--preset", "gpt2", "--nodes", "0"], "--nodes must be >= 1"),
    # 0 is a value, not "not given" (it once fell back to the default 1.0 GB/s in silence)
    (["--preset", "gpt2", "--throughput-gbs", "0"], "--throughput-gbs, --save-gbs and --safety-factor must be > 0"),
    (["--preset", "gpt2", "--save-gbs", "0"], "--throughput-gbs, --save-gbs and --safety-factor must be > 0"),
    (["--preset", "gpt2", "--safety-factor", "0"], "--throughput-gbs, --save-gbs and --safety-factor must be > 0"),
])
def test_preflight_command_bad_input_is_one_line_exit_2(argv: list[str], needle: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["preflight", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


# -- the supervisor ----------------------------------------------------------------------------


async def test_supervisor_never_launches_an_unusable_offer_and_reports_measured_risk(tmp_path: Path) -> None:
    c = Config.model_validate({
        "pool": {"name": "pf", "min_nodes": 1, "target_nodes": 2, "max_nodes": 2},
        "job": {"global_batch_size": 16, "micro_batch_size": 1,
                "model": {"preset": "llama-7b", "zero_stage": 0}},
        "daemon": {"verify_commits": False, "state_dir": str(tmp_path / "state"), "reconcile_interval_s": 0.05},
        "chaos": [{"action": "notice", "node": 1, "at_step": 50, "lead_s": 30}],
        "offers": [
            {"instance_type": "small", "gpu_type": "A10G", "gpus_per_node": 1},  # cheapest, first: cannot hold 7B
            {"instance_type": "big", "gpu_type": "H200", "gpus_per_node": 1},
        ],
    })
    both = [Offer(index=i, provider="local", region="local", zone=None, instance_type=t, gpus_per_node=1,
                  price_usd_h=0.5) for i, t in enumerate(("small", "big"))]
    assert rank_offers(both, History(), now=0)[0].index == 0  # without the pre-flight, #0 is bought first
    store = Store(tmp_path / "state" / "sv.db").open()
    provider = RecordingProvider()
    sup = Supervisor(c, provider=provider, store=store)
    try:
        await sup.start(agent_url="http://127.0.0.1:1")
        async with asyncio.timeout(10):
            while len(provider.launched) < 2:
                await asyncio.sleep(0.02)
        for _ in range(3):  # more passes: nothing else is bought
            await sup.reconcile_once()
        assert len(provider.launched) == 2
        assert {n.offer_key for n in sup.nodes.values()} == {sup.config.offers[1].key}
        (unusable,) = store.events(kinds=[EventKind.OFFER_UNUSABLE.value])
        assert unusable.data["offer"].startswith("#0 ") and unusable.data["gpu_gib"] == 24
        assert unusable.data["needed_gib"] > 100
        # at start: 94 GB on rank 0's node at 1 GB/s cannot beat the local 30 s notice
        (estimate,) = store.events(kinds=[EventKind.CHECKPOINT_DEADLINE_RISK.value])
        assert estimate.data["source"] == "estimate" and estimate.data["window_s"] == 30
        assert estimate.data["flush_s"] > 30
        node = next(iter(sup.nodes.values()))
        node.state = NodeState.RUNNING  # its trainer is in the job: rank 0 reports its commits
        sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
            "event": "started", "attempt": "a1", "rank": 0, "world_size": 1, "step": 0}}])
        sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
            "event": "checkpoint_committed", "attempt": "a1", "rank": 0, "step": 10, "bytes": 10**9,
            "save_s": 6.0, "upload_s": 14.0, "seconds": 20.0}}])
        sup.intake.on_reports(node, [{"kind": "trainer_status", "line": {
            "event": "checkpoint_committed", "attempt": "a1", "rank": 0, "step": 20, "bytes": 10**9,
            "save_s": 1.0, "upload_s": 2.0, "seconds": 3.0}}])
        measured = [e for e in store.events(kinds=[EventKind.CHECKPOINT_DEADLINE_RISK.value])
                    if e.data["source"] == "measured"]
        assert [(e.data["step"], e.data["flush_s"], e.data["margin"]) for e in measured] == [(10, 20.0, 1.5)]
    finally:
        await sup.aclose()
        store.close()


def test_a_control_node_without_torch_says_once_what_it_cannot_do() -> None:
    """A ``spotvisor[control]``-only install has no torch: the daemon cannot wake the
    survivors of a silent node (it was logged per attempt, as a failure). The start-up
    says it once, with the install that fixes it."""
    from daemon.controlnode.preflight import control_node_gaps

    assert control_node_gaps(lambda name: True) == []
    (gap,) = control_node_gaps(lambda name: name != "torch")
    assert "--pg-timeout-s" in gap and "pip install 'spotvisor[rendezvous]'" in gap
