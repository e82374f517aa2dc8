"""The ``ha:`` config section and what ``spotvisord check-config`` says each mode survives
(the real CLI, in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from daemon.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _write(tmp_path: Path, ha: dict) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"ha": ha}))
    return p


def test_no_ha_section_is_the_embedded_default_and_says_what_it_does_not_survive() -> None:
    assert load_config(ROOT / "configs" / "local.yaml").ha is None
    r = _cli("check-config", "configs/local.yaml")
    assert r.returncode == 0, r.stderr
    assert "control plane: embedded" in r.stdout
    assert "does not survive: the control node's loss" in r.stdout


def test_the_ha_example_says_what_it_survives() -> None:
    config = load_config(ROOT / "configs" / "ha.yaml")
    assert config.ha is not None and config.ha.lease_s == 5 and len(config.ha.endpoints) == 3
    r = _cli("check-config", "configs/ha.yaml")
    assert r.returncode == 0, r.stderr
    assert "control plane: HA" in r.stdout
    assert "survives: 1 etcd member(s) of 3 down" in r.stdout
    assert "does not survive: 2 etcd member(s) of 3 down" in r.stdout
    assert "kill -9" in r.stdout


@pytest.mark.parametrize("ha, needle", [
    ({"name": "a", "endpoints": ["10.0.0.5:2379"]}, "need TLS with a client certificate"),
    ({"name": "a", "endpoints": ["127.0.0.1:2379"], "ca_file": "/x"}, "together"),
    ({"name": "a", "endpoints": ["etcd-1:2379"]}, "is not IPV4:PORT"),
    ({"name": "a", "endpoints": ["127.0.0.1:2379", "127.0.0.1:2379"]}, "listed twice"),
    ({"name": "a", "endpoints": []}, "ha.endpoints"),
    ({"name": "A/b", "endpoints": ["127.0.0.1:2379"]}, "ha.name"),
    ({"name": "a", "endpoints": ["127.0.0.1:2379"], "lease_s": 1}, "ha.lease_s"),
    ({"endpoints": ["127.0.0.1:2379"]}, "ha.name"),
    ({"name": "a", "endpoints": ["127.0.0.1:2379"], "agent_urls": ["http://10.0.0.2:7480"]},
     "ha.agent_urls: an agent URL http://10.0.0.2:7480 is plain http"),
    ({"name": "a", "endpoints": ["127.0.0.1:2379"], "agent_urls": ["http://127.0.0.1:7480"] * 2}, "names a URL twice"),
])
def test_bad_ha_values_are_one_clear_line_each(tmp_path: Path, ha: dict, needle: str) -> None:
    path = _write(tmp_path, ha)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert any(needle in line for line in exc.value.problems), exc.value.problems
    r = _cli("check-config", str(path))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_off_loopback_with_tls_files_is_accepted(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, {"name": "a", "endpoints": ["10.0.0.5:2379", "10.0.0.6:2379", "10.0.0.7:2379"],
                                           "ca_file": "/etc/etcd/ca.pem", "cert_file": "/etc/etcd/c.pem",
                                           "key_file": "/etc/etcd/c.key"}))
    assert config.ha is not None and config.ha.endpoints[0] == "10.0.0.5:2379"


@pytest.mark.parametrize("lease_s, warned", [(2, True), (3, True), (4, False), (5, False)])
def test_a_lease_under_4_s_is_accepted_with_one_warning_line(tmp_path: Path, lease_s: int, warned: bool) -> None:
    path = _write(tmp_path, {"name": "a", "endpoints": ["127.0.0.1:2379", "127.0.0.1:2380", "127.0.0.1:2381"],
                             "lease_s": lease_s})
    r = _cli("check-config", str(path))
    assert r.returncode == 0, r.stderr  # a warning, not an error
    lines = [line for line in r.stdout.splitlines() if "ha.lease_s" in line]
    if warned:
        assert len(lines) == 1 and "warning" in lines[0] and "under 4 s" in lines[0], lines
        assert "misses keepalives" in lines[0] and "takeover bound" in lines[0]
    else:
        assert lines == []


def test_nodes_given_every_control_node_need_one_ca_for_all(tmp_path: Path) -> None:
    """ha.agent_urls over TLS: each daemon's own CA would be trusted by its own nodes only."""
    ha = {"name": "a", "endpoints": ["127.0.0.1:2379"], "agent_urls": ["https://10.0.0.2:7480", "https://10.0.0.3:7480"]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"ha": ha, "daemon": {"agent_host": "10.0.0.2"}}))
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert any(line.startswith("ha.agent_urls: each daemon's own CA") and "tls_ca_file" in line
               for line in exc.value.problems), exc.value.problems
    files = {"tls_cert_file": str(tmp_path / "a.pem"), "tls_key_file": str(tmp_path / "a.key"),
             "tls_ca_file": str(tmp_path / "ca.pem")}
    for f in files.values():
        Path(f).write_text("x")
    path.write_text(yaml.safe_dump({"ha": ha, "daemon": {"agent_host": "10.0.0.2", **files}}))
    assert load_config(path).ha.agent_urls == ha["agent_urls"]  # type: ignore[union-attr]


def test_a_node_is_given_this_daemons_url_first_then_the_other_control_nodes() -> None:
    from types import SimpleNamespace

    from daemon.controlnode.launch_calls import agent_urls

    ha = SimpleNamespace(agent_urls=["http://127.0.0.1:7001", "http://127.0.0.1:7002/"])
    core = SimpleNamespace(agent_url="http://127.0.0.1:7002", config=SimpleNamespace(ha=ha))
    assert agent_urls(core) == "http://127.0.0.1:7002,http://127.0.0.1:7001"  # type: ignore[arg-type]
    core.config.ha = None
    assert agent_urls(core) == "http://127.0.0.1:7002"  # type: ignore[arg-type]
