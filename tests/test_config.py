"""Config schema and ``spotvisord check-config`` (run as the real CLI, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.config import Config, ConfigError, DaemonSpec, JobSpec, load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def check_config(path: Path | str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "check-config", str(path)],
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


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing but a comment\n")
    assert load_config(path) == Config()
    r = check_config(path)
    assert r.returncode == 0, r.stderr
    assert ": ok" in r.stdout


def test_load_config_raises_config_error_with_problems(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("job:\n  chekpoint_uri: x\npool:\n  min_nodes: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = info.value.problems
    assert len(problems) == 2
    assert any(p.startswith("job.chekpoint_uri: unknown key") for p in problems)
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
    from daemon.config import Config, ConfigError, format_problems  # noqa: F401
    import pydantic

    offers = [{"provider": "local"}, {"provider": "local", "market": "on_demand"}]
    with pytest.raises(pydantic.ValidationError) as exc:
        Config.model_validate({"offers": offers})
    assert "pool.on_demand_fallback" in " ".join(format_problems(exc.value))


def test_a_replacement_hold_must_end_after_the_fault():
    from daemon.config import ChaosEvent

    assert ChaosEvent(action="notice", node=2, at_step=15, hold_replacements_for_steps=15).hold_replacements_for_steps == 15
    with pytest.raises(ValueError, match="hold_replacements_for_steps"):
        ChaosEvent(action="notice", node=2, at_step=15, hold_replacements_for_steps=0)
