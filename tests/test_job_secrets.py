"""job.env and job.secrets (issue 26): what the config accepts, where each value is read
(an owner-only file, SSM and Secrets Manager on moto's server, Alibaba KMS on its fake),
how a failure reads (one line naming the secret and its source, the exit code, nothing
bought), where values travel (the spec's own key, the trainer's environment) and that a
value that reaches a log anyway is masked."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import structlog

from daemon.config import Config, ConfigError, JobSpec, load_config
from daemon.controlnode.job_secrets import (SecretError, check_channel, private_channel, read_secret_file,
                                            resolve_secrets)
from daemon.controlnode.jobspec import SECRETS_KEY, job_spec, shown
from daemon.gpunode.trainer_process import TrainerProcess
from daemon.interfaces import cli
from daemon.model import Node
from daemon.secretref import RESERVED_ENV, SecretRef, check_env_name, parse_secret_ref
from daemon.providers.cloud_secrets import FetchError

ROOT = Path(__file__).resolve().parents[1]


def _secret() -> str:
    return "sv-" + uuid.uuid4().hex  # unique per test: a grep for it finds this test's value only


def _private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _config(secrets: dict[str, str], env: dict[str, str] | None = None, **extra: Any) -> Config:
    return Config.model_validate({"job": {"secrets": secrets, "env": env or {}}, **extra})


# -- the config ------------------------------------------------------------------------------

@pytest.mark.parametrize("source, ref", [
    ("file:/etc/spotvisor/job.env#HF_TOKEN", SecretRef("file", "/etc/spotvisor/job.env", "HF_TOKEN")),
    ("file:/run/secrets/hf", SecretRef("file", "/run/secrets/hf")),
    ("ssm:/team/hf-token?region=us-west-2", SecretRef("ssm", "/team/hf-token", None, "us-west-2")),
    ("secretsmanager:prod/keys#wandb", SecretRef("secretsmanager", "prod/keys", "wandb")),
    ("secretsmanager:arn:aws:secretsmanager:us-east-1:123456789012:secret:k-AbCdEf?region=us-east-1#a",
     SecretRef("secretsmanager", "arn:aws:secretsmanager:us-east-1:123456789012:secret:k-AbCdEf", "a", "us-east-1")),
    ("kms:hf-token?region=cn-hangzhou#token", SecretRef("kms", "hf-token", "token", "cn-hangzhou")),
])
def test_a_source_reads_as_written(source: str, ref: SecretRef) -> None:
    assert parse_secret_ref(source) == ref
    assert str(ref) == source


@pytest.mark.parametrize("job, needle", [
    ({"env": {"RANK": "3"}}, "job.env: RANK is set by spotvisor or torchrun"),
    ({"env": {"SPOTVISOR_NODE_ID": "x"}}, "job.env: SPOTVISOR_NODE_ID is set by spotvisor or torchrun"),
    ({"env": {"HF-TOKEN": "x"}}, "job.env: 'HF-TOKEN' is not an environment variable name"),
    ({"secrets": {"MASTER_PORT": "file:/x"}}, "job.secrets: MASTER_PORT is set by spotvisor or torchrun"),
    ({"secrets": {"HF": "vault:kv/hf"}}, "job.secrets: HF: 'vault:kv/hf' names no secret source"),
    ({"secrets": {"HF": "file:hf.txt"}}, "job.secrets: HF: 'file:hf.txt': the path must be absolute"),
    ({"secrets": {"HF": "ssm:/hf#x?region=us-east-1"}}, "job.secrets: HF: 'ssm:/hf#x?region=us-east-1': an SSM"),
    ({"secrets": {"HF": "ssm:/hf"}}, "job.secrets.HF: ssm:/hf has no region and the config has no aws domain"),
    ({"secrets": {"HF": "kms:hf"}}, "job.secrets.HF: kms:hf has no region and the config has no aliyun domain"),
    ({"env": {"HF": "1"}, "secrets": {"HF": "file:/x"}}, "job.secrets: HF is in job.env too"),
])
def test_check_config_refuses_a_bad_name_or_source_in_one_line(tmp_path: Path, job: dict, needle: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text(json.dumps({"job": job}))
    assert cli.main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_cloud_source_takes_the_region_of_its_clouds_first_domain() -> None:
    c = _config({"HF": "ssm:/hf"}, providers={"aws": {"image_id": "ami-0123"}},
                offers=[{"provider": "aws", "region": "eu-west-1", "instance_type": "g5.xlarge"}])
    assert c.secret_region(parse_secret_ref("ssm:/hf")) == "eu-west-1"
    assert c.secret_region(parse_secret_ref("ssm:/hf?region=us-east-2")) == "us-east-2"


def test_every_name_spotvisor_sets_for_the_trainer_is_reserved(tmp_path: Path) -> None:
    """A new variable in the job spec or the agent's contract must join the reserved list:
    a job.env entry of that name would otherwise silently replace it."""
    config = _config({})
    node = Node(id="n1", ordinal=1, provider="local", region="local", zone="z", instance_type="t", gpus=2,
                price_usd_h=0.0, token="t")
    spec = job_spec(config.model_copy(update={"job": config.job.model_copy(update={"grow": "in_process"})}),
                    node, "abcd")
    tp = TrainerProcess(workdir=tmp_path, node_id="n1", on_change=lambda: None)
    names = (set(spec["env"]) | set(spec["join"]["env"]) | set(tp.job_env()) - set(os.environ)) - {"OMP_NUM_THREADS"}
    torchrun = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"}
    assert [n for n in sorted(names | torchrun) if check_env_name(n) is None] == []
    assert check_env_name("OMP_NUM_THREADS") is None and check_env_name("HF_TOKEN") is None
    assert "OMP_NUM_THREADS" not in RESERVED_ENV


# -- where the values travel -------------------------------------------------------------------

def test_the_spec_carries_env_in_env_and_secrets_apart(tmp_path: Path) -> None:
    config = _config({"HF_TOKEN": "file:/x"}, env={"WANDB_PROJECT": "llama", "OMP_NUM_THREADS": "4"})
    config = config.model_copy(update={"job": config.job.model_copy(update={"grow": "in_process"})})
    node = Node(id="n1", ordinal=1, provider="local", region="local", zone="z", instance_type="t", gpus=1,
                price_usd_h=0.0, token="t")
    value = _secret()
    spec = job_spec(config, node, "abcd", secrets={"HF_TOKEN": value})
    assert spec["env"]["WANDB_PROJECT"] == "llama" and spec["env"]["OMP_NUM_THREADS"] == "4"
    assert spec["join"]["env"]["WANDB_PROJECT"] == "llama"
    assert spec[SECRETS_KEY] == {"HF_TOKEN": value}
    assert value not in json.dumps(spec["env"]) + json.dumps(spec["argv"]) + json.dumps(spec["join"])
    assert value not in json.dumps(shown(spec)) and shown(spec)[SECRETS_KEY] == {"HF_TOKEN": "***"}
    assert SECRETS_KEY not in job_spec(config, node, "abcd")  # none: no key at all
    tp = TrainerProcess(workdir=tmp_path, node_id="n1", on_change=lambda: None)
    tp.job = spec
    env = tp.job_env()
    assert env["HF_TOKEN"] == value and env["WANDB_PROJECT"] == "llama" and env["OMP_NUM_THREADS"] == "4"


def test_secrets_never_leave_in_plain_http_beyond_loopback() -> None:
    check_channel("http://127.0.0.1:8123")
    check_channel("https://10.0.0.5:8123")
    with pytest.raises(SecretError, match=r"plain HTTP on a non-loopback address.*daemon.agent_tls: on"):
        check_channel("http://10.0.0.5:8123")
    assert private_channel(secure=True, peer="10.0.0.7")
    assert private_channel(secure=False, peer="127.0.0.1") and private_channel(secure=False, peer="::1")
    assert not private_channel(secure=False, peer="10.0.0.7") and not private_channel(secure=False, peer=None)


# -- a file on the control node ----------------------------------------------------------------

async def test_a_file_source_reads_a_line_or_the_whole_file(tmp_path: Path) -> None:
    a, b = _secret(), _secret()
    env_file = _private_file(tmp_path / "job.env", f"# comment\nexport HF_TOKEN=\"{a}\"\nOTHER=1\n")
    whole = _private_file(tmp_path / "wandb", f"{b}\n")
    got = await resolve_secrets(_config({"HF_TOKEN": f"file:{env_file}#HF_TOKEN", "WANDB_API_KEY": f"file:{whole}"}))
    assert got == {"HF_TOKEN": a, "WANDB_API_KEY": b}


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
async def test_a_secrets_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = _private_file(tmp_path / "job.env", f"HF_TOKEN={_secret()}\n", mode)
    with pytest.raises(SecretError) as err:
        await resolve_secrets(_config({"HF_TOKEN": f"file:{path}#HF_TOKEN"}))
    assert str(err.value) == (f"job.secrets.HF_TOKEN: file:{path}#HF_TOKEN: {path} is readable or writable by "
                              f"others (mode {mode:04o}; chmod 600 {path})")
    assert err.value.exit_code == 2


def test_a_link_a_missing_file_or_a_missing_key_is_refused(tmp_path: Path) -> None:
    real = _private_file(tmp_path / "real.env", "A=1\n")
    (tmp_path / "link.env").symlink_to(real)
    with pytest.raises(FetchError, match="is a symbolic link"):
        read_secret_file(str(tmp_path / "link.env"), "A")
    with pytest.raises(FetchError, match="No such file or directory"):
        read_secret_file(str(tmp_path / "none.env"), "A")
    with pytest.raises(FetchError, match="has no B= line"):
        read_secret_file(str(real), "B")


# -- AWS, on moto's server ---------------------------------------------------------------------

async def test_ssm_and_secrets_manager_values_are_read(s3_server: str) -> None:
    import boto3

    ssm = boto3.client("ssm", region_name="us-west-2", endpoint_url=s3_server)
    sm = boto3.client("secretsmanager", region_name="us-west-2", endpoint_url=s3_server)
    a, b, c = _secret(), _secret(), _secret()
    name = f"/spotvisor/{uuid.uuid4().hex}/hf"
    ssm.put_parameter(Name=name, Value=a, Type="SecureString")
    plain = f"plain-{uuid.uuid4().hex}"
    sm.create_secret(Name=plain, SecretString=b)
    keyed = f"keyed-{uuid.uuid4().hex}"
    sm.create_secret(Name=keyed, SecretString=json.dumps({"wandb": c, "other": "x"}))
    config = _config({"HF": f"ssm:{name}", "PLAIN": f"secretsmanager:{plain}", "WANDB": f"secretsmanager:{keyed}#wandb"},
                     providers={"aws": {"image_id": "ami-0123"}},
                     offers=[{"provider": "aws", "region": "us-west-2", "instance_type": "g5.xlarge"}])
    got = await resolve_secrets(config, endpoints={"ssm": s3_server, "secretsmanager": s3_server})
    assert got == {"HF": a, "PLAIN": b, "WANDB": c}


@pytest.mark.parametrize("source, needle", [
    ("ssm:/spotvisor/missing?region=us-east-1", "SSM GetParameter in us-east-1: not found (ParameterNotFound"),
    ("secretsmanager:missing-secret?region=us-east-1",
     "Secrets Manager GetSecretValue in us-east-1: not found (ResourceNotFoundException"),
])
async def test_a_missing_aws_secret_is_one_line_naming_it(s3_server: str, source: str, needle: str) -> None:
    with pytest.raises(SecretError) as err:
        await resolve_secrets(_config({"HF_TOKEN": source}), endpoints={"ssm": s3_server, "secretsmanager": s3_server})
    assert str(err.value).startswith(f"job.secrets.HF_TOKEN: {source}: {needle}"), err.value
    assert "\n" not in str(err.value) and err.value.exit_code == 2


async def test_a_json_key_the_secret_lacks_is_one_line(s3_server: str) -> None:
    import boto3

    name = f"keyed-{uuid.uuid4().hex}"
    boto3.client("secretsmanager", region_name="us-east-1", endpoint_url=s3_server).create_secret(
        Name=name, SecretString=json.dumps({"a": _secret()}))
    with pytest.raises(SecretError, match=r"#b: no such field in the secret's JSON"):
        await resolve_secrets(_config({"B": f"secretsmanager:{name}?region=us-east-1#b"}),
                              endpoints={"secretsmanager": s3_server})


# -- Alibaba Cloud KMS, on its fake ------------------------------------------------------------

AK_ID, AK_SECRET = "kms-test-ak", "kms-test-sk"


@pytest.fixture
async def kms(monkeypatch: pytest.MonkeyPatch):
    from fakes.kms import FakeKms

    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", AK_ID)
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", AK_SECRET)
    monkeypatch.delenv("ALIBABA_CLOUD_SECURITY_TOKEN", raising=False)
    async with FakeKms(access_key_id=AK_ID, access_key_secret=AK_SECRET) as fake:
        yield fake


async def test_kms_secrets_are_read_text_binary_and_by_json_key(kms) -> None:
    a, b, c = _secret(), _secret(), _secret()
    kms.put("hf-token", a)
    kms.put("blob", b.encode())
    kms.put("keys", json.dumps({"wandb": c}), region="cn-shanghai")
    config = _config({"HF": "kms:hf-token", "BLOB": "kms:blob", "WANDB": "kms:keys?region=cn-shanghai#wandb"},
                     providers={"aliyun": {"image_id": "m-1", "security_group_id": "sg-1"}},
                     offers=[{"provider": "aliyun", "region": "cn-hangzhou", "instance_type": "ecs.gn7i"}])
    got = await resolve_secrets(config, endpoints={"kms": kms.endpoint})
    assert got == {"HF": a, "BLOB": b, "WANDB": c}
    assert {r["SecretName"] for r in kms.requests} == {"hf-token", "blob", "keys"}
    assert all(r["Version"] == "2016-01-20" and r["Action"] == "GetSecretValue" for r in kms.requests)


async def test_a_missing_or_denied_kms_secret_is_one_line(kms) -> None:
    with pytest.raises(SecretError) as err:
        await resolve_secrets(_config({"HF": "kms:nope?region=cn-hangzhou"}), endpoints={"kms": kms.endpoint})
    assert str(err.value) == ("job.secrets.HF: kms:nope?region=cn-hangzhou: KMS GetSecretValue in cn-hangzhou: "
                              "not found (Forbidden.ResourceNotFound; check the name and the region)")
    kms.put("hf", _secret())
    kms.fail_next("Rejected.Throttling")
    with pytest.raises(SecretError) as err:
        await resolve_secrets(_config({"HF": "kms:hf?region=cn-hangzhou"}), endpoints={"kms": kms.endpoint})
    assert err.value.exit_code == 1, err.value  # throttled: a restart may get past it


# -- failures at start: one line, an exit code, nothing bought -----------------------------------

async def test_a_source_that_does_not_answer_times_out_as_one_line(tmp_path: Path) -> None:
    release = threading.Event()

    def stuck(ref: SecretRef, region: str | None) -> str:
        release.wait(30)  # a read that never answers (released at the end of the test)
        return "late"

    try:
        with pytest.raises(SecretError) as err:
            await resolve_secrets(_config({"HF": "ssm:/hf?region=us-east-1"}), fetch=stuck, timeout_s=0.2)
    finally:
        release.set()
    assert str(err.value) == ("job.secrets.HF: ssm:/hf?region=us-east-1: no answer within 0.2 s "
                              "(check the network and the region)")
    assert err.value.exit_code == 1


@pytest.mark.parametrize("cmd", ["run", "demo"])
def test_the_daemon_stops_before_buying_when_a_secret_cannot_be_read(tmp_path: Path, sockdir: Path, cmd: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _private_file(tmp_path / "job.env", "HF_TOKEN=x1234\n", 0o644)
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(
        "pool: {name: sec, min_nodes: 1, target_nodes: 1, max_nodes: 1}\n"
        f"job: {{secrets: {{HF_TOKEN: 'file:{path}#HF_TOKEN'}}}}\n"
        f"daemon: {{state_dir: '{tmp_path / 'state'}', socket: '{sockdir / 'd.sock'}'}}\n"
        "offers: [{provider: local, zone: local-a}]\n")
    assert cli.main([cmd, "--config", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("timestamp=")]
    assert err == [f"spotvisord {cmd}: job.secrets.HF_TOKEN: file:{path}#HF_TOKEN: {path} is readable or writable "
                   f"by others (mode 0644; chmod 600 {path})"]
    assert not list((tmp_path / "state").rglob("spotvisord.db")), "the store was opened: the daemon got as far as buying"
    assert not list((tmp_path / "state").rglob("instance.log"))


def test_check_reads_every_secret_as_the_daemon_would_and_shows_no_value(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``spotvisord check`` said "all checks ok" for a config whose secret did not exist, and
    ``run`` then refused it: the check tries what the daemon's start does, secrets too."""
    value = _secret()
    good = _private_file(tmp_path / "job.env", f"HF_TOKEN={value}\n")
    cfg = tmp_path / "pool.yaml"
    cfg.write_text(
        f"job: {{secrets: {{HF_TOKEN: 'file:{good}#HF_TOKEN', WANDB_API_KEY: 'file:{tmp_path}/none'}}}}\n"
        f"daemon: {{state_dir: '{tmp_path / 'state'}'}}\n")
    assert cli.main(["check", str(cfg)]) == 1
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert f"ok   job.secrets.HF_TOKEN (file:{good}#HF_TOKEN): read (its value is not shown)" in lines
    (bad,) = [ln for ln in lines if ln.startswith("FAIL job.secrets.WANDB_API_KEY")]
    assert bad.startswith(f"FAIL job.secrets.WANDB_API_KEY (file:{tmp_path}/none): read: ")
    assert bad.endswith("; fix: job.secrets.WANDB_API_KEY: a source that exists, and the control node's permission "
                        "to read it")
    assert lines[-1].startswith("1 of ") and value not in out


# -- a value that reaches a log anyway is masked -----------------------------------------------------

async def test_a_resolved_value_is_masked_in_structlog_and_stdlib_lines(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    from daemon.feed.redaction import Redactor
    from daemon.logs import configure_logging

    value = _secret() + "\"q"  # a quote: JSON and repr escape it, and the escaped form is masked too
    path = _private_file(tmp_path / "v", value)
    redactor = Redactor()  # as spotvisord's main and running_daemon use it
    redactor.add_values((await resolve_secrets(_config({"HF": f"file:{path}"}))).values())
    out = io.StringIO()
    configure_logging("INFO", stream=out, redactor=redactor)
    try:
        structlog.get_logger("t").info("spec_shown", spec={"secrets": {"HF": value}}, raw=value)
        logging.getLogger("spotvisor.test").warning("stray %s", value)
    finally:
        structlog.reset_defaults()
        redactor.uninstall()
        for h in list(logging.getLogger().handlers):
            if getattr(h, "stream", None) is out:
                logging.getLogger().removeHandler(h)
    text = out.getvalue() + caplog.text  # structlog's line, and the stdlib record as a root handler shows it
    assert value not in text and json.dumps(value)[1:-1] not in text and repr(value)[1:-1] not in text, text
    assert "raw='***'" in text and "{'HF': '***'}" in text and "stray ***" in text, text


def test_job_env_is_bounded() -> None:
    with pytest.raises(ValueError, match="over the 65536 the workers' environment can safely take"):
        JobSpec(env={f"V{i}": "x" * 1000 for i in range(80)})


def test_a_config_with_secrets_loads_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("job:\n  env: {WANDB_PROJECT: llama}\n  secrets:\n    HF_TOKEN: file:/etc/spotvisor/job.env#HF_TOKEN\n")
    assert load_config(path).job.secrets == {"HF_TOKEN": "file:/etc/spotvisor/job.env#HF_TOKEN"}
    path.write_text("job:\n  secrets: {HF_TOKEN: 'ssm:/x'}\n")
    with pytest.raises(ConfigError):
        load_config(path)
