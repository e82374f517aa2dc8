"""Config schema and ``spotvisord check-config`` (run as the real CLI, in a subprocess)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import pydantic
import yaml

from daemon.config import (Config, ConfigError, DaemonSpec, JobSpec, OfferSpec, format_problems, load_config,
                           loopback_problem, new_job_deadline_problem)

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def check_config(path: Path | str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.interfaces.cli", "check-config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


# --------------------------------------------------------------------------- shipped configs


def test_configs_dir_has_local_yaml() -> None:
    assert ROOT / "configs" / "local.yaml" in CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path: Path) -> None:
    config = load_config(path)
    assert config.offers


def test_local_yaml_values() -> None:
    c = load_config(ROOT / "configs" / "local.yaml")
    assert (c.pool.min_nodes, c.pool.target_nodes, c.pool.max_nodes) == (1, 3, 3)
    assert c.job.valid_world_sizes(64) == [1, 2, 3, 6]
    assert [(e.action, e.node) for e in c.chaos] == [("notice", 2), ("notice", 3), ("kill", 1)]


def test_cli_good_file_exit_0_prints_ok() -> None:
    r = check_config("configs/local.yaml")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("configs/local.yaml: ok")
    assert r.stderr == ""


# --------------------------------------------------------------------------- bad files


BAD = [
    # id, file content, substrings the single problem line must contain
    (
        "unknown_key",
        "job:\n  chekpoint_uri: file:///tmp/x\n",
        ["job.chekpoint_uri: ", "unknown key"],
    ),
    (
        "unknown_top_level_section",
        "pools:\n  target_nodes: 2\n",
        ["pools: ", "unknown key"],
    ),
    (
        "min_above_target",
        "pool:\n  min_nodes: 3\n  target_nodes: 2\n  max_nodes: 3\n",
        ["pool: ", "min_nodes <= target_nodes <= max_nodes", "3 / 2 / 3"],
    ),
    (
        "target_above_max",
        "pool:\n  min_nodes: 1\n  target_nodes: 4\n  max_nodes: 3\n",
        ["pool: ", "1 / 4 / 3"],
    ),
    (
        "global_batch_not_multiple_of_micro",
        "job:\n  global_batch_size: 13\n  micro_batch_size: 2\n",
        ["job: ", "global_batch_size 13", "micro_batch_size 2"],
    ),
    (
        "chaos_both_at_step_and_at_s",
        "chaos:\n  - {action: kill, node: 1, at_step: 5, at_s: 10}\n",
        ["chaos.0: ", "exactly one of at_step or at_s"],
    ),
    (
        "chaos_neither_at_step_nor_at_s",
        "chaos:\n  - {action: kill, node: 1, at_step: 5}\n  - {action: notice, node: 2}\n",
        ["chaos.1: ", "exactly one of at_step or at_s"],
    ),
    (
        "unsupported_checkpoint_scheme",
        "job:\n  checkpoint_uri: gs://bucket/prefix\n",
        ["job: ", "checkpoint_uri 'gs://bucket/prefix'", "file://", "s3://"],
    ),
    (
        "checkpoint_uri_without_scheme",
        "job:\n  checkpoint_uri: /var/ckpt\n",
        ["job: ", "checkpoint_uri '/var/ckpt'"],
    ),
    (
        "not_yaml",
        "pool: [unclosed\n  job: {\n",
        ["not valid YAML", "line "],
    ),
    (
        "empty_file",  # the wrong file, most likely: not the local demo pool its defaults would make
        "# nothing but a comment\n\n",
        ["empty (no section in it)", "configs/local.yaml"],
    ),
    (
        "top_level_list",
        "- pool\n- job\n",
        ["top level must be a mapping"],
    ),
    (
        "top_level_empty_list",
        "[]\n",
        ["top level must be a mapping"],
    ),
    (
        "top_level_scalar",
        "just some words\n",
        ["top level must be a mapping"],
    ),
    (
        "wrong_type",
        "pool:\n  target_nodes: three\n",
        ["pool.target_nodes: ", "integer"],
    ),
    (
        "section_not_a_mapping",
        "daemon: 5\n",
        ["daemon: "],
    ),
    (
        "empty_offers",
        "offers: []\n",
        ["offers: "],
    ),
    (
        "notice_without_lead",
        "chaos:\n  - {action: notice, node: 1, at_step: 3, lead_s: 0}\n",
        ["chaos.0.lead_s: "],
    ),
    (
        "chaos_after_the_last_step",
        "job:\n  target_steps: 150\nchaos:\n  - {action: kill, node: 1, at_step: 150}\n",
        ["chaos.0.at_step: ", "never reached", "job.target_steps 150"],
    ),
    (
        "kill_store_naming_a_node",  # the store is no node's
        "chaos:\n  - {action: kill_store, node: 1, at_step: 3}\n",
        ["chaos.0: ", "kill_store hits the rendezvous store, not a node", "remove node"],
    ),
    (
        "kill_daemon_naming_a_node",  # the daemon is the control node's, no node's
        "chaos:\n  - {action: kill_daemon, node: 1, at_step: 3}\n",
        ["chaos.0: ", "kill_daemon hits the control node, not a node", "remove node"],
    ),
    (
        "kill_control_node_without_a_time",
        "chaos:\n  - {action: kill_control_node, restart_after_s: 2}\n",
        ["chaos.0: ", "give exactly one of at_step or at_s"],
    ),
    (
        "kill_daemon_holding_replacements",  # nothing of the pool's is held by a daemon kill
        "chaos:\n  - {action: kill_daemon, at_step: 3, hold_replacements_for_steps: 5}\n",
        ["chaos.0: ", "hold_replacements_for_steps: kill_daemon does not take it", "remove it"],
    ),
    (
        "kill_control_node_restart_out_of_range",
        "chaos:\n  - {action: kill_control_node, at_s: 3, restart_after_s: -1}\n",
        ["chaos.0.restart_after_s: ", "greater than or equal to 0"],
    ),
    (
        "partition_leader_without_ha",  # nothing to cut the daemon off from: it keeps its state in SQLite
        "chaos:\n  - {action: partition_leader, at_step: 3}\n",
        ["chaos.0.action: ", "partition_leader cuts the leading daemon off from etcd", "add one, or use kill_daemon"],
    ),
    (
        "restart_after_on_a_node_kill",
        "chaos:\n  - {action: kill, node: 1, at_step: 3, restart_after_s: 5}\n",
        ["chaos.0: ", "restart_after_s: only kill_store", "remove it"],
    ),
    (
        "stall_factor_below_one",  # a bound below the step time: every step would be late
        "daemon:\n  stall: {step_factor: 0.5}\n",
        ["daemon.stall.step_factor: ", "greater than or equal to 1"],
    ),
    (
        "cloud_offer_without_region",  # it would default to the local provider's "local"
        "providers:\n  aws: {image_id: ami-0123456789abcdef0}\n"
        "offers:\n  - {provider: aws, instance_type: p4d.24xlarge, gpus_per_node: 8}\n",
        ["offers.0.region: ", "required for provider aws"],
    ),
    (
        "cloud_offer_without_instance_type",
        "providers:\n  aws: {image_id: ami-0123456789abcdef0}\n"
        "offers:\n  - {provider: aws, region: us-east-1, gpus_per_node: 8}\n",
        ["offers.0.instance_type: ", "required for provider aws"],
    ),
    # issue 25, item 9: Python reads no integer of more than 4,300 digits (it raised ValueError)
    ("integer_of_5000_digits", "pool:\n  name: x\n  max_nodes: " + "9" * 5000 + "\n",
     ["line 3: an integer 5000 characters long is out of range"]),
    ("date_that_does_not_exist", "job:\n  deadline: 2023-02-30\n", ["line 2: '2023-02-30' cannot be read",
                                                                      "day is out of range"]),
]


def _assert_problem_output(r: subprocess.CompletedProcess[str], path: Path, expected: list[list[str]]) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == len(expected), lines
    for line, needles in zip(lines, expected):
        assert line.startswith(f"{path}: "), line
        for needle in needles:
            assert needle in line, (needle, line)


@pytest.mark.parametrize(("content", "needles"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_cli_bad_file(tmp_path: Path, content: str, needles: list[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    _assert_problem_output(check_config(path), path, [needles])


def test_cli_binary_garbage(tmp_path: Path) -> None:
    path = tmp_path / "garbage.yaml"
    path.write_bytes(b"\xff\xfe\x00\x80garbage\xc3\x28\n")
    _assert_problem_output(check_config(path), path, [["UTF-8"]])


def test_cli_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    _assert_problem_output(check_config(path), path, [["cannot read", "No such file"]])


def test_cli_directory_instead_of_file(tmp_path: Path) -> None:
    _assert_problem_output(check_config(tmp_path), tmp_path, [["cannot read"]])


def test_cli_one_line_per_problem(tmp_path: Path) -> None:
    path = tmp_path / "many.yaml"
    path.write_text(
        "pool:\n  target_nodes: 2\n  max_nodez: 3\n"
        "job:\n  chekpoint_uri: x\n"
        "chaos:\n  - {action: kill, node: 1}\n"
    )
    _assert_problem_output(
        check_config(path),
        path,
        [
            ["pool.max_nodez: ", "unknown key"],
            ["job.chekpoint_uri: ", "unknown key"],
            ["chaos.0: ", "exactly one of at_step or at_s"],
        ],
    )


def test_cli_offer_without_provider_section(tmp_path: Path) -> None:
    """A cross-section problem (no single field's loc) still names the field path."""
    path = tmp_path / "noprovider.yaml"
    path.write_text("providers:\n  local: null\n")
    _assert_problem_output(check_config(path), path, [["offers.0.provider", "providers.local"]])


def test_an_empty_file_is_refused_not_taken_for_the_local_defaults(tmp_path: Path) -> None:
    """Its defaults are the local demo pool (processes on this machine): an empty file is
    more likely the wrong path or a truncated config than a wish for that (check-config's
    exit 2 and its one line: the "empty_file" case of test_cli_bad_file)."""
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [f"{path}: empty (no section in it); give a config, e.g. a copy of configs/local.yaml"]


def test_load_config_raises_config_error_with_problems(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("job:\n  chekpoint_uri: x\npool:\n  min_nodes: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    assert len(problems) == 2
    assert any(p.startswith("job.chekpoint_uri: unknown key") for p in problems)
    # the nearest known name of the same section, where one is near
    assert "job.chekpoint_uri: unknown key (did you mean 'checkpoint_uri'?)" in problems
    assert any(p.startswith("pool.min_nodes: ") for p in problems)


def test_config_is_frozen() -> None:
    c = Config()
    with pytest.raises(Exception):
        c.pool = None  # type: ignore[misc,assignment]


# --------------------------------------------------------------------------- derived values


def test_checkpoint_uri_substitutes_state_dir(tmp_path: Path) -> None:
    c = Config(daemon=DaemonSpec(state_dir=str(tmp_path / "st")))
    assert c.checkpoint_uri() == f"file://{(tmp_path / 'st').resolve()}/checkpoints"


def test_checkpoint_uri_relative_state_dir_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    c = Config(daemon=DaemonSpec(state_dir=".spotvisor"))
    assert c.checkpoint_uri() == f"file://{tmp_path.resolve()}/.spotvisor/checkpoints"


def test_checkpoint_uri_without_placeholder_unchanged(tmp_path: Path) -> None:
    c = Config(job=JobSpec(checkpoint_uri="s3://bucket/run-1"), daemon=DaemonSpec(state_dir=str(tmp_path)))
    assert c.checkpoint_uri() == "s3://bucket/run-1"


def test_on_demand_offer_needs_the_fallback_switched_on() -> None:
    from daemon.config import Config, format_problems
    import pydantic

    offers = [{"provider": "local"}, {"provider": "local", "market": "on_demand"}]
    with pytest.raises(pydantic.ValidationError) as exc:
        Config.model_validate({"offers": offers})
    assert "pool.on_demand_fallback" in " ".join(format_problems(exc.value))


def test_an_offer_listed_twice_is_refused_by_its_key() -> None:
    # nodes keep their offer's key; two offers with one key would make a node's offer ambiguous
    from daemon.config import Config, format_problems
    import pydantic

    offers = [{"provider": "local", "zone": "a"}, {"provider": "local", "zone": "b"},
              {"provider": "local", "zone": "a", "max_price_usd_h": 2.0}]
    with pytest.raises(pydantic.ValidationError) as exc:
        Config.model_validate({"offers": offers})
    assert format_problems(exc.value) == [
        "offers.2: the same offer as offers.0 (local/local/a/local.cpu/spot); remove one (an offer is its "
        "provider, region, zone, instance type and market)"]


def test_a_replacement_hold_must_end_after_the_fault():
    from daemon.config import ChaosEvent

    assert ChaosEvent(action="notice", node=2, at_step=15, hold_replacements_for_steps=15).hold_replacements_for_steps == 15
    with pytest.raises(ValueError, match="hold_replacements_for_steps"):
        ChaosEvent(action="notice", node=2, at_step=15, hold_replacements_for_steps=0)


def test_the_control_node_faults_take_a_time_and_a_restart_delay_only():
    from daemon.config import ChaosEvent

    ev = ChaosEvent(action="kill_daemon", at_step=25, restart_after_s=2)
    assert (ev.node, ev.restart_after_s) == (None, 2)
    assert ChaosEvent(action="kill_control_node", at_s=10).restart_after_s == 3.0  # the default, as kill_store's



# --------------------------------------------------------------------------- hostile input (issue 13, defect 10)


def one_problem(tmp_path: Path, text: str) -> str:
    """load_config on ``text``: exactly one problem line, returned."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.problems) == 1, info.value.problems
    return info.value.problems[0]


@pytest.mark.parametrize("text", [
    "pool: " + "[" * 1000 + "]" * 1000 + "\n",
    "job:\n  template: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n",
], ids=["lists", "mappings"])
def test_cli_deeply_nested_file_is_one_line(tmp_path: Path, text: str) -> None:
    """A 2 KB file nested 1,000 levels deep was a RecursionError traceback (exit 1)."""
    path = tmp_path / "deep.yaml"
    path.write_text(text)
    _assert_problem_output(check_config(path), path, [["line ", "nested deeper than 64 levels"]])


def test_nesting_through_anchors_is_one_line(tmp_path: Path) -> None:
    """Each anchor nests the one before: the events are flat, the document 1,000 deep."""
    lines = ["x0: &a0 [1]"] + [f"x{i}: &a{i} [*a{i - 1}]" for i in range(1, 1000)]
    text = "anchors:\n" + "".join(f"  {line}\n" for line in lines) + "job:\n  args: *a999\n"
    path = tmp_path / "anchors.yaml"
    path.write_text(text)
    r = check_config(path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "job.args" in r.stderr and "anchors: unknown key" in r.stderr


@pytest.mark.parametrize(("text", "field"), [
    ("daemon:\n  heartbeat_timeout_s: .inf\n", "daemon.heartbeat_timeout_s"),
    ("agent:\n  poll_interval_s: .nan\n", "agent.poll_interval_s"),
    ("rendezvous:\n  join_timeout_s: .inf\n", "rendezvous.join_timeout_s"),
    ("job:\n  flush_safety_factor: .inf\n", "job.flush_safety_factor"),  # ge=1 alone lets inf through
    ("job:\n  hold_timeout_s: .inf\n", "job.hold_timeout_s"),
    ("chaos:\n  - {action: kill, node: 1, at_s: .inf}\n", "chaos.0.at_s"),
], ids=["timeout_inf", "interval_nan", "rdzv_inf", "factor_inf", "hold_inf", "chaos_inf"])
def test_non_finite_numbers_are_refused(tmp_path: Path, text: str, field: str) -> None:
    problem = one_problem(tmp_path, text)
    assert problem.startswith(f"{field}: must be a finite number"), problem


@pytest.mark.parametrize(("text", "field"), [
    ("offers:\n  - {max_price_usd_h: 2500}\n", "offers.0.max_price_usd_h"),  # meant 2.5
    ("offers:\n  - {on_demand_price_usd_h: 9832}\n", "offers.0.on_demand_price_usd_h"),  # meant 98.32
    ("providers:\n  local: {spot_price_usd_h: 1e4}\n", "providers.local.spot_price_usd_h"),
])
def test_a_price_no_instance_costs_is_refused_naming_the_field(tmp_path: Path, text: str, field: str) -> None:
    problem = one_problem(tmp_path, text)  # a slipped decimal point would lift the price cap or skew the cost
    assert problem.startswith(f"{field}: ") and "USD/hour is more than any instance costs (at most 1000" in problem


def test_a_price_at_the_bound_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("offers:\n  - {max_price_usd_h: 1000, on_demand_price_usd_h: 98.32}\n")
    assert load_config(path).offers[0].max_price_usd_h == 1000


@pytest.mark.parametrize(("text", "field"), [
    ("daemon:\n  heartbeat_timeout_s: 1e308\n", "daemon.heartbeat_timeout_s"),
    ("job:\n  hold_timeout_s: 1e300\n", "job.hold_timeout_s"),
    ("chaos:\n  - {action: notice, node: 1, at_s: 5, lead_s: 1e200}\n", "chaos.0.lead_s"),
])
def test_durations_beyond_30_days_are_refused(tmp_path: Path, text: str, field: str) -> None:
    problem = one_problem(tmp_path, text)  # finite, yet a wait on it overflows
    assert problem.startswith(f"{field}: ") and "2592000" in problem, problem


def test_cli_infinite_timeout(tmp_path: Path) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text("daemon:\n  heartbeat_timeout_s: .inf\n")
    _assert_problem_output(check_config(path), path, [["daemon.heartbeat_timeout_s: ", "finite"]])


@pytest.mark.parametrize("size", ["100000", "100000000000000000000"])
def test_max_nodes_has_a_bound_for_every_provider(tmp_path: Path, size: str) -> None:
    problem = one_problem(tmp_path, f"pool: {{target_nodes: 1, max_nodes: {size}}}\n")
    assert problem.startswith("pool.max_nodes: at most 10000 nodes"), problem


def test_local_provider_runs_at_most_64_nodes(tmp_path: Path) -> None:
    """target_nodes 100 on the local provider: the first plan() would start 100 process groups here."""
    pool = "pool: {target_nodes: 100, max_nodes: 100}\njob: {global_batch_size: 100, micro_batch_size: 1}\n"
    problem = one_problem(tmp_path, pool)
    assert problem.startswith("pool.max_nodes: 100 nodes on the local provider"), problem
    assert "providers.local.max_nodes" in problem and "64" in problem
    # the documented override (a big machine, or a simulated fleet as bench/scale.py's)
    path = tmp_path / "ok.yaml"
    path.write_text(pool + "providers:\n  local: {max_nodes: 100}\n")
    assert load_config(path).pool.target_nodes == 100


def test_local_limit_ignores_cloud_pools(tmp_path: Path) -> None:
    path = tmp_path / "aws.yaml"
    path.write_text("pool: {target_nodes: 100, max_nodes: 100}\njob: {global_batch_size: 800, micro_batch_size: 1}\n"
                    "providers:\n  local: null\n  aws: {image_id: ami-0123456789abcdef0}\n"
                    "offers:\n  - {provider: aws, region: us-east-1, instance_type: p4d.24xlarge, gpus_per_node: 8}\n")
    assert load_config(path).pool.max_nodes == 100


def test_target_nodes_must_be_a_valid_world_size(tmp_path: Path) -> None:
    """12 / 2 = 6 micro batches: world sizes 1, 2, 3 (up to 5); spotctl scale 5 refuses 5 too."""
    problem = one_problem(tmp_path, "pool: {min_nodes: 1, target_nodes: 5, max_nodes: 5}\n")
    assert problem.startswith("pool.target_nodes: 5 nodes (world size 5) cannot share job.global_batch_size 12 "
                              "in micro batches of 2"), problem
    assert "node counts that can: 1, 2, 3" in problem


def test_target_nodes_counts_each_nodes_gpus(tmp_path: Path) -> None:
    text = "pool: {target_nodes: 2, max_nodes: 3}\noffers:\n  - {provider: local, gpus_per_node: 2}\n"
    problem = one_problem(tmp_path, text)  # 2 x 2 = 4 ranks cannot split 6 micro batches; 1 x 2 and 3 x 2 can
    assert problem.startswith("pool.target_nodes: 2 nodes (world size 4)"), problem
    assert "node counts that can: 1, 3" in problem


def test_cli_target_nodes_not_a_valid_world_size(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("pool: {min_nodes: 1, target_nodes: 5, max_nodes: 5}\n")
    _assert_problem_output(check_config(path), path, [["pool.target_nodes: ", "1, 2, 3"]])


def test_huge_job_args_are_refused(tmp_path: Path) -> None:
    """10 MB of job.args was accepted, then torchrun failed with 'Argument list too long'
    (200 KB here: past the bound as surely, without parsing 10 MB of YAML)."""
    path = tmp_path / "big.yaml"
    path.write_text("job:\n  args: [" + ", ".join(["x" * 1000] * 200) + "]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith("job.args: 200212 bytes with job.module"), problem  # + "trainer.run\\0"
    assert "65536" in problem


def test_one_argument_longer_than_the_kernel_takes(tmp_path: Path) -> None:
    problem = one_problem(tmp_path, "job:\n  args: [" + "y" * 200_000 + "]\n")
    assert problem.startswith("job.args: "), problem


def test_a_nul_in_job_args_is_refused(tmp_path: Path) -> None:
    problem = one_problem(tmp_path, 'job:\n  args: [--name, "a\\0b"]\n')
    assert problem.startswith("job.args: item 1 contains a NUL character"), problem


def test_job_args_of_a_normal_size_pass(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("job:\n  args: [" + ", ".join(["--flag"] * 5000) + "]\n")
    assert len(load_config(path).job.args) == 5000


def test_state_dir_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("not a directory\n")
    problem = one_problem(tmp_path, f"daemon:\n  state_dir: {f}\n")
    assert problem.startswith(f"daemon.state_dir: {f} is a file, not a directory"), problem
    problem = one_problem(tmp_path, f"daemon:\n  state_dir: {f}/state\n")  # below a file: cannot be created
    assert problem.startswith(f"daemon.state_dir: {f} is a file, not a directory"), problem
    path = tmp_path / "ok.yaml"
    path.write_text(f"daemon:\n  state_dir: {tmp_path}/new/state\n")  # missing: the daemon creates it
    assert load_config(path).daemon.state_path() == tmp_path / "new" / "state"


@pytest.mark.parametrize("host", ["0.0.0.0", "'::'", "'0'", "''", "8.8.8.8", "203.0.113.10", "2001:db8::1",
                                  "'::ffff:8.8.8.8'", "100.64.0.1", "169.254.169.254"])
def test_rendezvous_on_a_wildcard_or_public_address_is_refused(tmp_path: Path, host: str) -> None:
    """The c10d store has no authentication and torchrun unpickles what it reads there."""
    problem = one_problem(tmp_path, f"rendezvous: {{host: {host}}}\n")
    assert problem.startswith("rendezvous.host: "), problem
    assert "no authentication" in problem and "rendezvous.allow_public: true" in problem


@pytest.mark.parametrize("host", ["127.0.0.1", "'::1'", "10.0.0.10", "172.16.0.10", "192.168.1.20", "fd00::10",
                                  "localhost", "control.internal"])
def test_rendezvous_on_a_private_address_or_a_name_passes(tmp_path: Path, host: str) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(f"rendezvous: {{host: {host}}}\n")
    assert load_config(path).rendezvous.host == host.strip("'")


def test_rendezvous_allow_public_is_the_override(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("rendezvous: {host: 0.0.0.0, allow_public: true}\n")
    assert load_config(path).rendezvous.host == "0.0.0.0"


def test_agent_host_wildcard_stays_allowed(tmp_path: Path) -> None:
    """Every agent request carries the node's bearer token (unlike the rendezvous store)."""
    path = tmp_path / "ok.yaml"
    path.write_text("daemon: {agent_host: 0.0.0.0}\n")
    assert load_config(path).daemon.agent_host == "0.0.0.0"


def test_cli_public_rendezvous(tmp_path: Path) -> None:
    path = tmp_path / "pub.yaml"
    path.write_text("rendezvous: {host: 0.0.0.0}\n")
    _assert_problem_output(check_config(path), path, [["rendezvous.host: 0.0.0.0 is a wildcard address",
                                                       "rendezvous.allow_public: true"]])


def test_run_refuses_the_same_config(tmp_path: Path) -> None:
    """spotvisord run validates the same way: exit 2, one line, before anything starts."""
    path = tmp_path / "pub.yaml"
    path.write_text(f"rendezvous: {{host: 0.0.0.0}}\ndaemon: {{state_dir: {tmp_path / 'st'}}}\n")
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    _assert_problem_output(r, path, [["rendezvous.host: "]])
    assert not (tmp_path / "st").exists()


_DEADLINE_BASE = {"pool": {"on_demand_fallback": True}, "providers": {"local": None, "aws": {"image_id": "ami-0123456789abcdef0"}},
                  "offers": [{"provider": "aws", "region": "us-east-1", "instance_type": "p3.2xlarge"},
                             {"provider": "aws", "region": "us-east-1", "instance_type": "p3.2xlarge",
                              "market": "on_demand"}]}


@pytest.mark.parametrize("job, offers, problem", [
    ({"deadline": 10}, None, "job.step_s: a job.deadline needs the seconds per step"),
    ({"deadline": 10, "step_s": 1}, [{"provider": "aws", "region": "us-east-1", "instance_type": "p3.2xlarge"}],
     "needs on-demand offers to fall back on"),
    ({"deadline": 0.1, "step_s": 1.0, "target_steps": 3600}, None,
     "0.1 h cannot be met even on on-demand nodes: 3600 steps x 1 s + 10 min to start = 1.17 h"),
])
def test_a_deadline_that_cannot_work_is_refused_with_the_fix(tmp_path: Path, job, offers, problem) -> None:
    raw = {**_DEADLINE_BASE, "job": job, **({"offers": offers} if offers else {})}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_a_deadline_is_hours_from_submission_or_a_time() -> None:
    c = Config.model_validate({**_DEADLINE_BASE, "job": {"deadline": 10, "step_s": 1.0}})
    assert c.job.deadline_at(1000.0) == 1000.0 + 36_000
    c = Config.model_validate({**_DEADLINE_BASE, "job": {"deadline": "2026-12-05T00:00:00", "step_s": 1.0}})
    assert c.job.deadline_at(0.0) == 1796428800.0  # no offset: UTC


def test_an_unknown_key_names_the_nearest_known_one_of_its_own_section(tmp_path: Path) -> None:
    """A typo gets the name it was likely meant as, looked up in its own section (an offer
    in a list, a nested section); a key nothing is near keeps the pointer to local.yaml."""
    path = tmp_path / "c.yaml"
    path.write_text("pool: {target_nodez: 2}\noffers:\n  - {provider: local, gpus_per_nodes: 1}\n"
                    "daemon: {stall: {first_step_ss: 60}}\nzzz: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert sorted(err.value.problems) == sorted([
        "pool.target_nodez: unknown key (did you mean 'target_nodes'?)",
        "offers.0.gpus_per_nodes: unknown key (did you mean 'gpus_per_node'?)",
        "daemon.stall.first_step_ss: unknown key (did you mean 'first_step_s'?)",
        "zzz: unknown key (check the spelling against configs/local.yaml)"])


def test_an_absolute_deadline_is_judged_against_the_clock_a_new_job_starts_at() -> None:
    at = datetime(2026, 12, 5, tzinfo=timezone.utc).timestamp()
    c = Config.model_validate({**_DEADLINE_BASE, "job": {"deadline": "2026-12-05T00:00:00Z", "step_s": 1.0,
                                                         "target_steps": 3600}})
    assert new_job_deadline_problem(c, at - 2 * 3600) is None  # 2 h left, 1.17 h needed
    near = new_job_deadline_problem(c, at - 3600)
    assert near is not None and near.startswith("job.deadline: 2026-12-05T00:00:00+00:00 is 1.00 h from now, and "
                                                 "the job needs 1.17 h even on on-demand nodes")
    past = new_job_deadline_problem(c, at + 90 * 3600)
    assert past is not None and "is 90.0 h in the past" in past and past.endswith("(e.g. deadline: 72)")
    hours = Config.model_validate({**_DEADLINE_BASE, "job": {"deadline": 10, "step_s": 1.0}})
    assert new_job_deadline_problem(hours, at) is None  # from the submission: judged at load


def test_run_refuses_a_new_job_whose_deadline_has_passed_and_buys_nothing(tmp_path: Path) -> None:
    path = tmp_path / "late.yaml"
    state = tmp_path / "st"
    path.write_text(yaml.safe_dump({
        "pool": {"on_demand_fallback": True},
        "offers": [{"provider": "local"}, {"provider": "local", "market": "on_demand"}],
        "job": {"deadline": "2020-01-01T00:00:00Z", "step_s": 0.5},
        "daemon": {"state_dir": str(state), "socket": str(tmp_path / "d.sock")},
    }))
    check = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "check-config", str(path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0  # the unit's ExecStartPre: a late job already under way must restart
    assert "deadline: a new job is refused: job.deadline: 2020-01-01T00:00:00+00:00 is " in check.stdout
    # which policy would spend it, and why (the default pool: one node)
    assert "deadline: spent by deadline_aware (job.deadline_policy auto: one node)" in check.stdout.splitlines()
    r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "run", "--config", str(path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("spotvisord run: ")]
    assert line.startswith("spotvisord run: job.deadline: 2020-01-01T00:00:00+00:00 is ") and "in the past" in line
    assert "Traceback" not in r.stderr
    from daemon.controlnode.store import Store

    with contextlib.closing(Store(state / "spotvisord.db").open()) as store:
        assert store.events(kinds=["node_launch_requested"]) == []  # nothing bought


async def test_a_job_already_under_way_is_supervised_on_past_its_deadline(tmp_path: Path, sockdir) -> None:
    """Its daemon restarted after the deadline passed: refusing would leave the job unwatched."""
    from conftest import RecordingProvider, started_daemon
    from daemon.controlnode.placement import DeadlineError
    from daemon.controlnode.store import Store

    config = Config.model_validate({
        "pool": {"on_demand_fallback": True},
        "offers": [{"provider": "local"}, {"provider": "local", "market": "on_demand"}],
        "job": {"deadline": "2020-01-01T00:00:00Z", "step_s": 0.5},
        "daemon": {"state_dir": str(tmp_path / "st"), "socket": str(sockdir / "d.sock"), "verify_commits": False},
    })
    with contextlib.closing(Store(tmp_path / "st" / "spotvisord.db").open()) as store:
        with pytest.raises(DeadlineError, match="in the past"):
            async with started_daemon(config, RecordingProvider(), store, str(sockdir / "d.sock")):
                pass
        store.append_event("node_launch_requested", "n1", {"offer": 0})  # the job was submitted before the restart
        async with started_daemon(config, RecordingProvider(), store, str(sockdir / "d.sock")) as (sup, _api):
            await sup.reconcile_once()
            assert sup.status()["placement"]["deadline"]["hours_to_deadline"] < 0  # shown late, not refused


_CLOUD = {"providers": {"aws": {"image_id": "ami-0123456789abcdef0"}},
          "offers": [{"provider": "aws", "region": "us-east-1", "instance_type": "p4d.24xlarge"}]}


@pytest.mark.parametrize("raw, problem", [
    ({"daemon": {"agent_host": "127.0.0.1"}, "rendezvous": {"host": "10.0.0.10"}},
     "daemon.agent_host: 127.0.0.1 is loopback, which the aws nodes of domain 'aws-us-east-1' cannot reach"),
    ({"daemon": {"agent_host": "10.0.0.10"}, "rendezvous": {"host": "localhost"}},
     "rendezvous.host: localhost is loopback, which the aws nodes of domain 'aws-us-east-1' cannot reach"),
], ids=["agent_host", "rendezvous_host"])
def test_a_cloud_pool_with_a_loopback_address_its_nodes_cannot_reach_is_refused(tmp_path: Path, raw, problem) -> None:
    """A config started from local.yaml keeps 127.0.0.1: every node bought would try to reach
    itself, never register, and be billed until the launch timeout, again and again."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**_CLOUD, **raw}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
    for verb in (["check-config", str(path)], ["run", "--config", str(path)]):
        r = subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", *verb], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.startswith(f"{path}: {problem}"), (verb, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_cloud_faked_on_this_machine_may_use_loopback() -> None:
    c = Config.model_validate(_CLOUD)
    assert loopback_problem(c) is not None
    assert loopback_problem(c, faked={"aws"}) is None  # AWS_ENDPOINT_URL: its "instances" run here (moto, ec2sim)
    c = Config.model_validate({**_CLOUD, "providers": {"aws": {"image_id": "ami-0123456789abcdef0",
                                                               "endpoint_url": "http://127.0.0.1:5000"}}})
    assert loopback_problem(c) is None
    assert loopback_problem(Config.model_validate({})) is None  # the local provider's nodes are this machine


@pytest.mark.parametrize("offer, problem", [
    ({"provider": "aws", "region": "us-east1", "instance_type": "p4d.24xlarge"},
     "offers.0: region: 'us-east1' is not an aws region's name (e.g. us-east-1)"),
    ({"provider": "aliyun", "region": "hangzhou", "instance_type": "ecs.gn7i-c8g1.2xlarge"},
     "offers.0: region: 'hangzhou' is not an aliyun region's name (e.g. cn-hangzhou)"),
    ({"provider": "aws", "region": "us-east-1", "zone": "us-west-2a", "instance_type": "p4d.24xlarge"},
     "offers.0: zone: 'us-west-2a' is not in region us-east-1"),
    ({"provider": "aliyun", "region": "cn-hangzhou", "zone": "cn-beijing-h", "instance_type": "ecs.gn7i-c8g1.2xlarge"},
     "offers.0: zone: 'cn-beijing-h' is not in region cn-hangzhou"),
], ids=["aws-region", "aliyun-region", "aws-zone", "aliyun-zone"])
def test_a_region_or_zone_typo_is_one_line_naming_the_offer(tmp_path: Path, offer, problem) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"offers": [offer]}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("provider, region, zone", [
    ("aws", "us-gov-west-1", "us-gov-west-1a"), ("aws", "us-west-2", "us-west-2-lax-1a"), ("aws", "cn-north-1", None),
    ("aliyun", "cn-shanghai-finance-1", "cn-shanghai-finance-1z"), ("aliyun", "ap-southeast-1", "ap-southeast-1a"),
])
def test_the_documented_shapes_of_regions_and_zones_pass(provider: str, region: str, zone: str | None) -> None:
    offer = OfferSpec.model_validate({"provider": provider, "region": region, "zone": zone, "instance_type": "x"})
    assert (offer.region, offer.zone) == (region, zone)


def _mixed(batch: int, target: int = 4) -> dict:
    return {"pool": {"min_nodes": 1, "target_nodes": target, "max_nodes": 4},
            "job": {"global_batch_size": batch, "micro_batch_size": 2},
            "providers": {"aws": {"image_id": "ami-0123456789abcdef0"}},
            "offers": [{"provider": "aws", "region": "us-east-1", "instance_type": "p4d.24xlarge", "gpus_per_node": 8},
                       {"provider": "aws", "region": "us-east-1", "instance_type": "g5.12xlarge", "gpus_per_node": 4}]}


def test_offers_of_mixed_sizes_whose_every_world_size_misses_the_batch_are_refused() -> None:
    """4 nodes of 4 or 8 GPUs make 16..32 ranks in steps of 4, and none of them splits 100
    samples in micro batches of 2: the job could never start (check-config said ok)."""
    with pytest.raises(ValueError, match=r"pool.target_nodes: no world size 4 nodes of these offers make \(4, 8 GPUs "
                                         r"per node\) shares job.global_batch_size 100 .*world sizes that can: "
                                         r"1, 2, 5, 10, 25; change"):
        Config.model_validate(_mixed(100))
    assert Config.model_validate(_mixed(256)).pool.target_nodes == 4  # 16 and 32 split it
    assert Config.model_validate(_mixed(40, target=1)).pool.target_nodes == 1  # one node of 4 GPUs: 40 / (2 x 4)
    # 36 ranks only as 4 + 4 + 4 + 8 + 8 + 8: a sum no one offer makes alone
    assert Config.model_validate({**_mixed(72), "pool": {"min_nodes": 1, "target_nodes": 6, "max_nodes": 6}})


def test_a_target_no_node_count_can_make_says_so_without_a_list_of_none() -> None:
    raw = {"pool": {"min_nodes": 2, "target_nodes": 2, "max_nodes": 3}, "job": {"global_batch_size": 10,
                                                                             "micro_batch_size": 1},
           "offers": [{"provider": "local", "gpus_per_node": 4}], "providers": {"local": {"max_nodes": 4}}}
    with pytest.raises(ValueError, match="no node count in pool.min_nodes..max_nodes can; change "
                                         "job.global_batch_size") as info:
        Config.model_validate(raw)
    assert "one of them" not in str(info.value)


def test_a_key_other_tools_use_names_ours_not_the_nearest_spelling(tmp_path: Path) -> None:
    """A sink's ``kind: slack`` was answered "did you mean 'kinds'?" (the event filter): the key
    meant is ``type``; a word other tools use for one of ours names ours."""
    path = tmp_path / "c.yaml"
    path.write_text("notify: [{name: ops, kind: slack, url_env: SLACK_URL}]\noffers: [{provider: local, gpus: 2}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "notify.0.kind: unknown key (did you mean 'type'?)" in err.value.problems
    assert "offers.0.gpus: unknown key (did you mean 'gpus_per_node'?)" in err.value.problems


@pytest.mark.parametrize("text, problem", [
    ('job: {deadline: "72h"}', "job.deadline: '72h' is neither hours nor a time: give hours from the job's "
                               "submission as a number (deadline: 72) or an ISO time (deadline: 2026-12-10T18:00:00Z)"),
    ("job: {target_steps: 1e4}", "job.target_steps: '1e4' is text to YAML, not a number (write it out: 10000)"),
], ids=["deadline-72h", "steps-1e4"])
def test_a_number_written_as_other_tools_write_it_is_one_line_with_the_form_to_use(tmp_path: Path, text,
                                                                                   problem) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems == [problem]


def test_every_pattern_a_field_has_is_said_in_words(tmp_path: Path) -> None:
    """pool.name: My Pool! was answered with the regular expression; every ``pattern=`` of a
    config field now has words and an example, and a new one without them fails here."""
    import re as re_

    from daemon.config import _PATTERN_WORDS

    patterns = {m for p in (ROOT / "daemon").rglob("*.py") for m in re_.findall(r'pattern=r"([^"]+)"', p.read_text())}
    assert patterns and patterns <= set(_PATTERN_WORDS), patterns - set(_PATTERN_WORDS)
    path = tmp_path / "c.yaml"
    path.write_text("pool: {name: My Pool!}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems == ["pool.name: must be lowercase letters, digits and '-', starting with a letter or "
                                  "digit, at most 63 characters (e.g. llama-ft); got 'My Pool!'"]


def test_check_config_says_a_slack_webhook_url_in_the_file_is_a_credential() -> None:
    """A Slack incoming webhook's URL is its only credential: written inline (``url``) it is
    readable by whoever reads the config; check-config says so, and how to keep it out
    (``url_env``). A signed webhook's URL is not a secret (its key is in ``secret_env``)."""
    from daemon.interfaces.preflight_cli import check_config_report

    def report(sinks: list[dict]) -> list[str]:
        config = Config.model_validate({"offers": [{"provider": "local"}], "notify": sinks})
        return [line for line in check_config_report(config)[0] if line.startswith("feed:")]

    inline = {"name": "ops", "type": "slack", "url": "https://hooks.slack.com/services/T0/B0/x"}
    assert report([inline]) == [
        "feed: notify.0 (ops): its Slack webhook URL is written in this file, and whoever reads the file can post "
        "to the channel; keep it out with url_env (the name of a variable holding it)"]
    assert report([{"name": "ops", "type": "slack", "url_env": "SLACK_URL"}]) == []
    assert report([{"name": "hook", "type": "webhook", "url": "https://example.com/h", "secret_env": "KEY"}]) == []


@pytest.mark.parametrize("raw, line", [
    ({"daemon": None}, "daemon: a section of keys, got nothing (give its keys indented under it, or remove the line)"),
    ({"providers": {"aws": {"image_id": "ami-0123456789abcdef0", "subnet_ids": ["subnet-0abc12345"]}}},
     "providers.aws.subnet_ids: a mapping, got a list (e.g. subnet_ids: {us-east-1a: subnet-0abc12345})"),
    ({"providers": {"aws": {"image_id": "ami-0123456789abcdef0", "zzzz": 1}}},
     "providers.aws.zzzz: unknown key (check the spelling against configs/aws.yaml)"),
    ({"offers": {"provider": "local"}}, "offers: a list, got a dict (one '- ' item per entry)"),
], ids=["empty-section", "list-for-a-mapping", "aws-key-points-at-aws-yaml", "mapping-for-a-list"])
def test_a_section_of_the_wrong_shape_is_said_in_the_configs_words(raw: dict, line: str) -> None:
    """A fresh-clone user trial read "Input should be a valid dictionary or instance of
    DaemonSpec" for an empty ``daemon:``, and was sent to configs/local.yaml, which has no
    aws section, for a misspelt aws key."""
    with pytest.raises(pydantic.ValidationError) as exc:
        Config.model_validate(raw)
    assert format_problems(exc.value, Config) == [line]
