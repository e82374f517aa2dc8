"""``job.command``: the user's own script runs under torchrun with no flag of spotvisor's."""

from __future__ import annotations

import pytest

import json
from pathlib import Path

from daemon.config import Config, ConfigError, load_config
from daemon.controlnode.jobspec import job_spec
from daemon.model import Node
from trainer.contract import CHECKPOINT_URI_ENV

NODE = Node(id="n1", ordinal=1, provider="local", region="local", zone=None, instance_type="t", gpus=2,
            price_usd_h=0.0, token="x")


def _with_job(config: Config, **job: object) -> Config:
    return Config.model_validate({**config.model_dump(mode="json", exclude_unset=True),
                                  "job": {**config.job.model_dump(mode="json", exclude_unset=True,
                                                                  exclude={"module", "args", "grow"}), **job}})


def test_the_script_and_its_own_flags_follow_torchruns_and_nothing_else() -> None:
    config = _with_job(load_config("configs/local.yaml"), command="train.py --save-dir '/ckpt dir' --lr 3e-4")
    spec = job_spec(config, NODE, "abc")
    argv = spec["argv"]
    # torchrun's own flags, then exactly the user's words: no --target-steps, no --checkpoint-uri
    assert argv[argv.index("--monitor-interval=0.5") + 1:] == ["train.py", "--save-dir", "/ckpt dir", "--lr", "3e-4"]
    assert not any(a.startswith(("--target-steps", "--checkpoint-uri", "--global-batch-size")) for a in argv)
    # what spotvisor's integrations need instead rides in the environment
    assert spec["env"][CHECKPOINT_URI_ENV] == config.checkpoint_uri(config.domain(None).name)
    # the in-process join launcher (job.grow: in_process) runs the same words
    if "join" in spec:
        join = spec["join"]["argv"]
        assert join[join.index("--monitor-interval=0.5") + 1:] == argv[argv.index("--monitor-interval=0.5") + 1:]


def test_a_preemption_does_not_use_up_the_scripts_restart_budget() -> None:
    """Each notice fails the survivors' workers mid-collective (their peer left), and
    torchrun counts that against ``--max-restarts``: the old budget of
    ``max_restarts_on_errors - 1`` (2) ended the survivors' torchrun at the third notice.
    Where the launcher reports every failure of the workers (the agent's interpreter), the
    budget is the large one; the daemon counts a crash loop from those reports. Only a
    torchrun nobody reports for keeps the small one: on another interpreter
    (``job.python``), and where the node's launcher died (the spec's fallback)."""
    from daemon.gpunode.trainer_process import unreported
    from daemon.model import UNREPORTED_MAX_RESTARTS_KEY

    base = load_config("configs/local.yaml")
    budget = base.rendezvous.max_restarts
    spec = job_spec(_with_job(base, command="train.py --max-restarts=7"), NODE, "abc")
    assert f"--max-restarts={budget}" in spec["argv"] and budget >= 100
    assert spec[UNREPORTED_MAX_RESTARTS_KEY] == base.job.max_restarts_on_errors - 1 == 2
    plain = unreported(spec["argv"], spec[UNREPORTED_MAX_RESTARTS_KEY])
    assert "--max-restarts=2" in plain and f"--max-restarts={budget}" not in plain
    assert plain[-2:] == ["train.py", "--max-restarts=7"]  # the script's own words are its own
    foreign = job_spec(_with_job(base, command="train.py", python="/opt/conda/bin/python"), NODE, "abc")
    assert "--max-restarts=2" in foreign["argv"] and UNREPORTED_MAX_RESTARTS_KEY not in foreign
    module = job_spec(base, NODE, "abc")
    assert f"--max-restarts={budget}" in module["argv"] and UNREPORTED_MAX_RESTARTS_KEY not in module


def test_a_module_job_keeps_its_flags_and_no_uri_in_the_env() -> None:
    config = load_config("configs/local.yaml")
    spec = job_spec(config, NODE, "abc")
    assert "--target-steps" in spec["argv"] and CHECKPOINT_URI_ENV not in spec["env"]


@pytest.mark.parametrize(
    ("job", "needle"),
    [
        ({"command": ""}, "job.command: empty"),
        ({"command": "--nproc-per-node=8 train.py"}, "job.command: starts with the flag '--nproc-per-node=8'"),
        ({"command": "train.py 'unclosed"}, "job.command: No closing quotation"),
        ({"command": "train.py", "module": "x.y"}, "job: command: give either job.command"),
        ({"command": ["train.py", "a\0b"]}, "job.command: item 1 contains a NUL"),
        # the local provider's nodes share one machine: one absolute output_dir for all collides
        ({"command": "train.py", "output_dir": "/tmp/hfout"}, "job.output_dir: '/tmp/hfout' would be shared"),
    ],
)
def test_a_bad_command_is_one_line_naming_the_field(tmp_path, job: dict, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("daemon: {state_dir: %s}\njob: %s\n" % (tmp_path, json.dumps(job)))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert any(line.startswith(needle) for line in err.value.problems), err.value.problems


def test_a_relative_output_dir_is_each_local_nodes_own_with_a_workdir(tmp_path: Path) -> None:
    """Each local node runs in its own copy of job.workdir; without one they share the
    daemon's directory, and three nodes saving into one ./out failed (a user trial)."""
    (tmp_path / "train.py").write_text("print('training')\n")
    config = _with_job(load_config("configs/local.yaml"), command="train.py", output_dir="out",
                       workdir=str(tmp_path))
    assert config.job.output_dir == "out"
    with pytest.raises((ValueError, ConfigError)) as err:
        _with_job(load_config("configs/local.yaml"), command="train.py", output_dir="out")
    assert "job.output_dir: 'out' is relative to the directory every local node shares without job.workdir" \
        in str(err.value)


def test_job_preload_reaches_the_nodes_zygote_through_the_spec() -> None:
    """job.preload: the modules each node's zygote imports before the workers fork."""
    from trainer.contract import ZYGOTE_PRELOAD_ENV

    config = _with_job(load_config("configs/local.yaml"), command="train.py", preload=["transformers", "datasets"])
    assert job_spec(config, NODE, "abc")["env"][ZYGOTE_PRELOAD_ENV] == "transformers,datasets"
    assert ZYGOTE_PRELOAD_ENV not in job_spec(load_config("configs/local.yaml"), NODE, "abc")["env"]


def test_a_preload_that_is_not_a_module_name_is_one_line_naming_the_field(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("daemon: {state_dir: %s}\njob: {command: train.py, preload: ['os; rm -rf /']}\n" % tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert any(line.startswith("job.preload: item 0") for line in err.value.problems), err.value.problems


def test_a_script_missing_from_the_workdir_is_refused_before_anything_is_bought(tmp_path) -> None:
    import subprocess
    import sys

    work = tmp_path / "my-job"
    (work / "scripts").mkdir(parents=True)
    (work / "scripts" / "train.py").write_text("print('hi')\n")
    path = tmp_path / "c.yaml"

    def check(command: str) -> subprocess.CompletedProcess[str]:
        path.write_text("daemon: {state_dir: %s}\njob: %s\n"
                        % (tmp_path / "state", json.dumps({"command": command, "workdir": str(work)})))
        return subprocess.run([sys.executable, "-m", "daemon.interfaces.cli", "check-config", str(path)],
                              capture_output=True, text=True, timeout=120)

    bad = check("train.py --lr 3e-4")  # the user forgot it is under scripts/
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (f"{path}: job: command: train.py is not a file in job.workdir ({work}), where "
                                  "every node runs it (give its path relative to job.workdir, e.g. command: "
                                  "train.py --lr 3e-4)")
    assert check("scripts/train.py --lr 3e-4").returncode == 0
    assert check("-m scripts.train").returncode == 0  # a module may come from job.setup's installs: not judged
