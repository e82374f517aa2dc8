"""Two roles, two installs (pyproject.toml's extras): a control node runs ``spotvisord`` and
``spotctl`` without torch and transformers (``spotvisor[control]``), a GPU node runs the agent
and the trainer without the daemon's own packages (``spotvisor[node]``).

Each check runs in a fresh interpreter whose import system refuses the other role's
packages (a meta-path finder raising ``ImportError``, as a missing package does), so no
second virtualenv is needed. Which packages those are is read from pyproject.toml's extras
and mapped to the modules they install by :func:`importlib.metadata.packages_distributions`.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]

# the modules of the control node's path: the entry points, the service, the supervisor's parts
CONTROL_MODULES = ["daemon.interfaces.cli", "daemon.interfaces.ctl", "daemon.interfaces.service",
                   "daemon.interfaces.api", "daemon.controlnode.supervisor", "daemon.feed.notify",
                   "daemon.providers.aws", "daemon.providers.aliyun", "daemon.providers.local",
                   "daemon.providers.chaos", "daemon.analysis.summary", "daemon.controlnode.workdir",
                   "daemon.controlnode.manifests", "daemon.controlnode.migrator"]
NODE_MODULES = ["daemon.gpunode.agent", "daemon.gpunode.launcher", "trainer.run", "trainer.loop",
                "trainer.checkpoint", "trainer.oss_store", "trainer.membership"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _modules_of(extra: str) -> set[str]:
    """The top-level modules the distributions of ``extra`` install (its own names only)."""
    dists = {_norm(Requirement(r).name) for r in EXTRAS[extra] if Requirement(r).name != PROJECT["name"]}
    return {mod for mod, owners in importlib.metadata.packages_distributions().items()
            if any(_norm(d) in dists for d in owners)}


_RUN = r'''
import contextlib, importlib, importlib.abc, io, json, sys
BLOCKED = set(json.loads(sys.argv[1]))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {name!r} (refused: the other role's package)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
out = {"imported": [], "commands": {}}
for m in json.loads(sys.argv[2]):
    importlib.import_module(m)
    out["imported"].append(m)
for label, (module, func, argv) in json.loads(sys.argv[3]).items():
    main = getattr(importlib.import_module(module), func)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    out["commands"][label] = [code, stdout.getvalue(), stderr.getvalue()]
out["loaded"] = sorted({k.split(".")[0] for k in sys.modules} & BLOCKED)
print(json.dumps(out))
'''


def _run_without(blocked: set[str], modules: list[str], commands: dict[str, tuple[str, str, list[str]]]) -> dict:
    r = subprocess.run([sys.executable, "-c", _RUN, json.dumps(sorted(blocked)), json.dumps(modules),
                        json.dumps(commands)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_extras_split_the_roles() -> None:
    base = {_norm(Requirement(r).name) for r in PROJECT["dependencies"]}
    node = {_norm(Requirement(r).name) for r in EXTRAS["node"]}
    control = {_norm(Requirement(r).name) for r in EXTRAS["control"]}
    assert {"torch", "transformers"} <= node
    assert not {"torch", "transformers"} & (base | control)
    assert not node & control
    test = Requirement(next(r for r in EXTRAS["test"] if Requirement(r).name == PROJECT["name"]))
    assert {"node", "control", "rendezvous", "bench", "deepspeed", "hf"} <= test.extras  # make install: all


def test_the_control_node_runs_without_torch_and_transformers() -> None:
    blocked = _modules_of("node")
    assert {"torch", "transformers"} <= blocked
    got = _run_without(blocked, CONTROL_MODULES, {
        "spotvisord --help": ("daemon.interfaces.cli", "main", ["--help"]),
        "spotctl --help": ("daemon.interfaces.ctl", "main", ["--help"]),
        "spotvisord check-config": ("daemon.interfaces.cli", "main", ["check-config", "configs/local.yaml"]),
        "spotvisord rendezvous": ("daemon.interfaces.cli", "main", ["rendezvous", "--port", "0"]),
    })
    assert got["imported"] == CONTROL_MODULES and got["loaded"] == []
    code, out, _ = got["commands"]["spotvisord --help"]
    assert code == 0 and "usage: spotvisord" in out and "demo" in out
    code, out, _ = got["commands"]["spotctl --help"]
    assert code == 0 and "usage: spotctl" in out
    code, out, err = got["commands"]["spotvisord check-config"]
    assert code == 0 and "configs/local.yaml: ok" in out, err
    # the one command that needs torch says so in one line
    code, _, err = got["commands"]["spotvisord rendezvous"]
    assert code == 2 and err.strip().splitlines() == [
        "spotvisord rendezvous: the store is torch.distributed's TCPStore, and torch is not installed here; "
        "install it: pip install 'spotvisor[rendezvous]'"]


def test_a_gpu_node_runs_without_the_daemons_packages() -> None:
    blocked = _modules_of("control")
    assert {"slack_sdk", "prometheus_client"} <= blocked
    got = _run_without(blocked, NODE_MODULES, {
        "spotvisor-agent --help": ("daemon.gpunode.agent", "main", ["--help"]),
    })
    assert got["imported"] == NODE_MODULES and got["loaded"] == []
    code, out, err = got["commands"]["spotvisor-agent --help"]
    assert code == 0 and "usage:" in out, err


def test_the_daemon_without_the_control_extra_says_what_to_install() -> None:
    """A bare ``pip install spotvisor`` (a walkthrough step that left ``[control]`` out) ran
    ``check-config`` and then died in ``run`` with a traceback (``No module named
    'prometheus_client.metrics_core'``). ``check-config`` and ``check`` need none of the
    extra; ``run`` and ``demo`` say what to install, in one line."""
    blocked = _modules_of("control")
    got = _run_without(blocked, ["daemon.interfaces.cli"], {
        "check-config": ("daemon.interfaces.cli", "main", ["check-config", "configs/local.yaml"]),
        "run": ("daemon.interfaces.cli", "main", ["run", "--config", "configs/local.yaml"]),
        "demo": ("daemon.interfaces.cli", "main", ["demo", "--config", "configs/local.yaml"]),
    })
    code, out, err = got["commands"]["check-config"]
    assert code == 0 and "configs/local.yaml: ok" in out, err
    for verb in ("run", "demo"):
        code, out, err = got["commands"][verb]
        assert code == 2 and out == "", (verb, err)
        (line,) = err.strip().splitlines()
        assert line.startswith(f"spotvisord {verb}: the control node's packages are not installed here (")
        assert line.endswith("install them: pip install 'spotvisor[control]'") and "prometheus_client" in line
