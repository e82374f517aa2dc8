"""spotvisord configuration: one pydantic schema, read from YAML.

The file has one section per part of the architecture (``pool``, ``job``,
``rendezvous``, ``agent``, ``daemon``, ``providers``, ``domains``, ``migration``,
``offers``, ``chaos``, ``notify``).
Unknown keys are errors (a typo must not silently become a default), and so are
numbers that are not finite (``.inf``, ``.nan``: "no timeout" is not a setting) and
documents nested deeper than :data:`MAX_NESTING` levels.

``load_config(path)`` raises :class:`ConfigError` whose ``problems`` are one line
each, ``<field path>: <what is wrong> (<how to fix it>)``; ``spotvisord
check-config`` prints them and exits 2.
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
import os
import re
import shlex
import string
from datetime import datetime, timezone
from pathlib import Path
import typing
from typing import Annotated, Any, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from daemon.control.offers import offer_key
from daemon.model import EventKind
from daemon.hosts import address_of, exposed_address, is_loopback
from daemon.catalog import PRESETS, UnknownGpuError, gpu_memory_gib
from daemon.secretref import SecretRef, check_env_name, parse_secret_ref
from trainer.batch import ElasticBatch, BatchError
from daemon.launchspec import (AliyunDomainLaunch, AliyunLaunchSpec, AwsDomainLaunch, AwsLaunchSpec, resolve_aliyun,
                               resolve_aws)

__all__ = [
    "ConfigError",
    "Config",
    "loopback_problem",
    "new_job_deadline_problem",
    "PoolSpec",
    "JobSpec",
    "ModelSpec",
    "RendezvousSpec",
    "AgentSpec",
    "DaemonSpec",
    "StallSpec",
    "HaSpec",
    "LocalProviderSpec",
    "AwsProviderSpec",
    "AliyunProviderSpec",
    "AwsDomainLaunch",
    "AliyunDomainLaunch",
    "AwsLaunchSpec",
    "AliyunLaunchSpec",
    "ProvidersSpec",
    "OfferSpec",
    "DomainSpec",
    "DomainRendezvous",
    "MigrationSpec",
    "Domain",
    "ChaosEvent",
    "CONTROL_NODE_FAULTS",
    "DAEMON_FAULTS",
    "SinkSpec",
    "WEBHOOK_MAX_BATCH",
    "SLACK_MAX_BATCH",
    "MAX_NESTING",
    "MAX_POOL_NODES",
    "LOCAL_MAX_NODES",
    "MAX_JOB_ARGS_BYTES",
    "MAX_JOB_ENV_BYTES",
    "load_config",
    "format_problems",
]


class ConfigError(Exception):
    """A configuration file that cannot be used. ``problems``: one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class _Spec(BaseModel):
    # allow_inf_nan=False: every float of the config is finite (an infinite timeout or
    # interval would stall or spin whatever waits on it)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# The longest duration any setting may give (seconds): 30 days. A timeout of 1e308 s is
# finite, yet waits on it overflow (threading's TIMEOUT_MAX is about 9.2e9 s here).
MAX_DURATION_S = 30 * 86400.0
# a price per node (USD/hour) above which a value is a slip of the decimal point, not an
# instance: the dearest cloud instances list at a few hundred USD/hour on demand
MAX_PRICE_USD_H = 1000.0
# job.workdir's default cap: its files' total size (bytes)
WORKDIR_MAX_BYTES = 256 * 2**20
PositiveS = Annotated[float, Field(gt=0, le=MAX_DURATION_S)]

# what a deadline allows for starting the job on on-demand nodes: an instance's boot, the
# agent, torchrun's rendezvous and the first load (seconds; a GPU instance boots in 2-5 min)
DEADLINE_START_S = 600.0

# events per request of a feed sink (``SinkSpec.max_batch``) when the config names none; a
# Slack message holds at most 50 blocks: a header, a footer and two blocks per event
# (daemon.feed.feed_messages.slack_digest) leave room for 24
WEBHOOK_MAX_BATCH = 100
SLACK_MAX_BATCH = 24

# a config is a few levels deep (notify.0.template.KIND is the deepest: 4); a document
# nested much deeper is hostile or broken, and PyYAML's composer recurses once per level
MAX_NESTING = 64

# the most nodes one pool (one daemon) may have, on any provider. The daemon is one
# Python process: bench/scale.py measures it at 1,000 nodes; at the default heartbeat
# budget (daemon.max_heartbeats_per_second 25) 10,000 nodes are told a 400 s heartbeat
# interval, so a lost node is noticed only after half an hour; and 10,000 nodes of 8
# GPUs are 80,000 ranks in one torchrun round. Larger: run several pools.
MAX_POOL_NODES = 10_000

# the local provider's default cap (providers.local.max_nodes): each of its nodes is
# processes on this machine (an agent, torchrun and its workers, ~1 GB of memory)
LOCAL_MAX_NODES = 64

# job.module and job.args are the tail of torchrun's command line (and of each worker's).
# Linux refuses an exec whose argv and environment exceed ARG_MAX (2 MiB with the usual
# 8 MiB stack; E2BIG "Argument list too long") or one string over MAX_ARG_STRLEN
# (131072 bytes); 64 KiB leaves room for spotvisor's own flags and the environment.
MAX_JOB_ARGS_BYTES = 65536

# job.env's values, all together (bytes of NAME=value, as the kernel counts them): the
# workers' environment shares ARG_MAX with their command line (job.args, 64 KiB above)
MAX_JOB_ENV_BYTES = 65536


class PoolSpec(_Spec):
    """Pool size in nodes. The reconciler keeps ``target_nodes`` running.

    Each size is at most :data:`MAX_POOL_NODES` (10,000; why: see there) and, with a
    local offer, ``pool.max_nodes`` at most ``providers.local.max_nodes``.
    ``target_nodes`` must give a world size the global batch splits over (as ``spotctl
    scale`` requires) when every offer has the same ``gpus_per_node``.
    """

    name: str = Field("default", pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    min_nodes: int = Field(1, ge=1)
    target_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(1, ge=1)
    # what a rebalance recommendation (elevated risk of interruption) triggers:
    # ignore | checkpoint (commit now, keep running) | replace (launch a replacement
    # now; drain this node once the replacement is ready)
    rebalance_policy: Literal["ignore", "checkpoint", "replace"] = "checkpoint"
    # allow offers with ``market: on_demand``, used only while no spot offer is usable
    on_demand_fallback: bool = False

    @field_validator("min_nodes", "target_nodes", "max_nodes")
    @classmethod
    def _bounded(cls, n: int) -> int:
        if n > MAX_POOL_NODES:
            raise ValueError(f"at most {MAX_POOL_NODES} nodes, got {n} (one daemon runs one pool of up to "
                             f"{MAX_POOL_NODES} nodes; for more, run several pools)")
        return n

    @model_validator(mode="after")
    def _sizes(self) -> "PoolSpec":
        if not self.min_nodes <= self.target_nodes <= self.max_nodes:
            raise ValueError(
                f"need min_nodes <= target_nodes <= max_nodes, got "
                f"{self.min_nodes} / {self.target_nodes} / {self.max_nodes} "
                "(fix the three sizes)"
            )
        return self


class ModelSpec(_Spec):
    """The model the job trains, for the memory-fit and flush-deadline pre-flight
    (formulas and sources: ``daemon/controlnode/preflight.py``).

    Give ``preset`` (``daemon.catalog.PRESETS``: llama-7b, qwen2.5-7b, ...) or
    ``params`` (count) with ``hidden_size``, ``num_layers`` and ``num_heads``; fields
    given next to a preset override it. ``precision`` bf16/fp16 = mixed precision with
    fp32 master weights. ``zero_stage``: ZeRO 0..3 over all ranks (FSDP FULL_SHARD = 3).
    LoRA: ``lora_rank`` (on ``lora_targets`` hidden x hidden matrices per layer, e.g.
    q_proj and v_proj) or ``trainable_fraction``.
    """

    preset: str | None = None
    params: float | None = Field(None, gt=0)
    hidden_size: int | None = Field(None, ge=1)
    num_layers: int | None = Field(None, ge=1)
    num_heads: int | None = Field(None, ge=1)
    vocab_size: int | None = Field(None, ge=1)
    seq_len: int = Field(2048, ge=1)
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    optimizer: Literal["adamw", "sgd-momentum", "adafactor"] = "adamw"
    zero_stage: Literal[0, 1, 2, 3] = 0
    lora_rank: int | None = Field(None, ge=1)
    lora_targets: int = Field(2, ge=1)
    trainable_fraction: float | None = Field(None, gt=0, le=1)
    activation_checkpointing: bool = False
    flash_attention: bool = True  # FlashAttention / SDPA: no s x s attention scores kept
    cuda_overhead_gib: float = Field(1.5, ge=0)  # CUDA context, NCCL, cuBLAS workspaces
    fragmentation: float = Field(0.10, ge=0, le=1)  # caching-allocator margin on the estimate

    @model_validator(mode="after")
    def _shape(self) -> "ModelSpec":
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r} is unknown (use one of {', '.join(PRESETS)}, "
                             "or give params, hidden_size, num_layers, num_heads)")
        if self.preset is None:
            missing = [n for n in ("params", "hidden_size", "num_layers", "num_heads") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"{', '.join(missing)} required without a preset (add them, or set preset: llama-7b)")
        if self.lora_rank is not None and self.trainable_fraction is not None:
            raise ValueError("give lora_rank or trainable_fraction, not both")
        return self


class JobSpec(_Spec):
    """The training job every node runs under ``torchrun``.

    ``module`` is run as ``python -m MODULE`` by each worker; spotvisor adds the
    flags below (``--target-steps`` ...) and then ``args``. ``module`` and ``args``
    together take at most :data:`MAX_JOB_ARGS_BYTES` (64 KiB, each string counted in
    UTF-8 with its terminating NUL, as the kernel counts it) and hold no NUL character.

    ``env``: ``{NAME: value}`` added to the trainer's environment on every node (at most
    :data:`MAX_JOB_ENV_BYTES` in all). ``secrets``: ``{NAME: SOURCE}``, each value read by
    the daemon at start from ``SOURCE`` (``file:/path[#KEY]``, ``ssm:/name``,
    ``secretsmanager:name[#KEY]``, ``kms:name[#KEY]``, cloud ones with an optional
    ``?region=``: :mod:`daemon.secretref`) and handed to the trainers only, over the agent
    channel (:mod:`daemon.controlnode.job_secrets`). Names: POSIX, none of spotvisor's or
    torchrun's own, none in both maps.
    """

    id: str = Field("job", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    module: str = "trainer.run"
    args: list[str] = []
    # the user's own script, run unchanged: what follows torchrun's flags, e.g.
    # "train.py --lr 3e-4 --save-dir /ckpt" or "-m mypkg.train" (a string is split as a
    # shell would, without running one). spotvisor adds no flag to it: the script gets
    # torchrun's environment and spotvisor's (trainer/contract.py: the checkpoint store's
    # URI, the notice file). Instead of job.module/job.args
    command: list[str] | None = None
    # with job.command, an HF Trainer script with trainer.add_callback(SpotvisorCallback()):
    # its TrainingArguments.output_dir (relative to its working directory). Before the script
    # starts (each worker start), the newest committed checkpoint is put there as
    # checkpoint-<step>, for trainer.train(resume_from_checkpoint=True) to resume from
    output_dir: str | None = Field(None, min_length=1, max_length=4096)
    # with job.command: an accelerate config file (DeepSpeed ZeRO, FSDP), relative to the
    # working directory; the script gets the environment `accelerate launch --config_file`
    # would give it, under spotvisor's torchrun and rendezvous
    accelerate_config: str | None = Field(None, min_length=1, max_length=4096)
    target_steps: int = Field(100, ge=1)
    global_batch_size: int = Field(12, ge=1)
    micro_batch_size: int = Field(2, ge=1)
    checkpoint_uri: str = "file://{state_dir}/checkpoints"
    checkpoint_interval_steps: int = Field(20, ge=1)
    s3_endpoint_url: str | None = None
    oss_endpoint: str | None = None  # e.g. https://oss-cn-hangzhou.aliyuncs.com; needed for oss://
    hold_timeout_s: PositiveS = 90.0
    # the interpreter torchrun and its workers run on, on each node: e.g. the image's
    # /opt/conda/bin/python or /usr/bin/python3 on the Deep Learning AMI, with its own
    # torch. spotvisor's trainer package reaches it through PYTHONPATH (the bootstrap
    # puts trainer/ alone in /opt/spotvisor/pythonpath), never the agent's virtualenv.
    # Absent: the agent's own interpreter (which then needs torch)
    python: str | None = None
    # how a new node enters the running job: "restart" (the survivors commit, hold, and
    # torchrun restarts every worker with it) or "in_process" (its workers join the running
    # group at a step boundary and take the state from a peer; no worker restarts:
    # trainer/membership.py; needs a trainer built on trainer.loop.ElasticJob that can
    # resize in-process, like trainer.run)
    grow: Literal["restart", "in_process"] = "restart"
    # pre-flight (daemon/controlnode/preflight.py): absent model → memory and flush checks skipped
    model: ModelSpec | None = None
    flush_safety_factor: float = Field(2.0, ge=1)  # notice window / flush time below this = at risk
    upload_throughput_bytes_s: float = Field(1e9, gt=0)  # per node to the store, until measured
    save_throughput_bytes_s: float = Field(2e9, gt=0)  # per node to local disk, until measured
    # finish by then at the least cost (the deadline_aware policy): hours from the job's
    # submission (its first launch request), or a time (ISO 8601, UTC when no offset)
    deadline: float | datetime | None = None
    # how the deadline is spent: deadline_aware (Uniform Progress: on-demand fills in when the
    # job falls behind its line), home_zone (the job waits out its domain's outages on the
    # slack and moves only when one outlasts it: daemon/control/homezone.py), or auto:
    # home_zone for a pool of several nodes with grow: in_process, deadline_aware otherwise
    # (what the replays measured: daemon.control.policies.deadline_policy)
    deadline_policy: Literal["auto", "deadline_aware", "home_zone"] = "auto"
    # seconds per step at the pool's target size, on the offers' GPUs: what the deadline
    # plans with (needed with a deadline; measure it with a short run)
    step_s: float | None = Field(None, gt=0)
    # code delivery (daemon/controlnode/workdir.py, daemon/gpunode/code.py): a directory on the
    # control node, packed at daemon start (deterministic tar.gz, .git and __pycache__ left out,
    # and names matching workdir_exclude: fnmatch patterns of the relative path or the name),
    # uploaded once per content hash to each domain's checkpoint store under code/, and
    # unpacked on each node as its trainer's working directory (and on its PYTHONPATH). The
    # version is pinned per daemon run: an edit reaches new nodes after a daemon restart.
    workdir: str | None = None
    workdir_exclude: list[str] = []
    workdir_max_bytes: int = Field(WORKDIR_MAX_BYTES, ge=1, le=16 * 2**30)  # the files' total size
    # shell commands run once per node (bash -c, in the workdir, with the job's environment)
    # after the workdir is unpacked and before the trainer starts; their output goes to the
    # node's trainer.log (spotctl tail NODE). A failure (non-zero exit, or past setup_timeout_s)
    # fails the node, which is replaced; setup_max_failures failures in a row stop the buying
    setup: list[str] = []
    setup_timeout_s: PositiveS = 1800.0
    # modules each node's zygote imports before torchrun's workers fork from it
    # (daemon/gpunode/zygote.py): your script's heavy imports, e.g. [transformers, datasets];
    # trainer.* modules need none (they name their own)
    preload: list[str] = Field([], max_length=64)
    setup_max_failures: int = Field(3, ge=1, le=1000)
    # the trainer's tries in a row that may fail without progress (exit non-zero, or stall, with
    # no new step; a preemption's never counts): the one that makes this many ends the job
    # "failed", every node released, checkpoints kept (daemon/control/tries.py; spotctl resume)
    max_restarts_on_errors: int = Field(3, ge=1, le=1000)

    @field_validator("preload")
    @classmethod
    def _preload(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            if len(name) > 200 or not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"item {i} {name[:60]!r} is not a module name (dotted Python names, e.g. transformers)")
        return v

    @field_validator("command", mode="before")
    @classmethod
    def _command_words(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return shlex.split(v)
            except ValueError as exc:
                raise ValueError(f"{exc} (quote it as a shell would, or give a list of words)") from None
        return v

    @field_validator("command")
    @classmethod
    def _command(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v or not v[0].strip() or v == ["-m"]:
            raise ValueError("empty (give the script and its own flags, e.g. command: train.py --lr 3e-4)")
        if v[0].startswith("-") and v[0] != "-m":
            raise ValueError(f"starts with the flag {v[0]!r} (give the script first, or -m MODULE; torchrun's "
                             "own flags come from the pool and rendezvous settings)")
        for i, word in enumerate(v):
            if "\0" in word:
                raise ValueError(f"item {i} contains a NUL character, which no command line can carry (remove it)")
        size = sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in v)
        if size > MAX_JOB_ARGS_BYTES:
            raise ValueError(f"{size} bytes, over the {MAX_JOB_ARGS_BYTES} a command line can safely take "
                             "(put long settings in a file the job reads)")
        return v

    @field_validator("setup", mode="before")
    @classmethod
    def _setup_commands(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v  # one command as a string

    @field_validator("setup")
    @classmethod
    def _setup_text(cls, v: list[str]) -> list[str]:
        for i, cmd in enumerate(v):
            if "\0" in cmd or not cmd.strip():
                raise ValueError(f"item {i} is empty or holds a NUL character (give a shell command, e.g. "
                                 "'pip install -r requirements.txt')")
        if sum(len(c.encode("utf-8", "surrogatepass")) + 1 for c in v) > MAX_JOB_ARGS_BYTES:
            raise ValueError(f"over {MAX_JOB_ARGS_BYTES} bytes of commands (put them in a script in job.workdir "
                             "and run that)")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir_dir(cls, v: str | None) -> str | None:
        if v is None:
            return None
        path = Path(os.path.expanduser(v))
        if not path.is_dir():
            raise ValueError(f"{v!r} is not a directory on this machine (give the directory holding the job's "
                             "code, e.g. workdir: ~/my-job)")
        return str(path.resolve())

    env: dict[str, str] = {}
    secrets: dict[str, str] = {}

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            problem = check_env_name(name)
            if problem is not None:
                raise ValueError(problem)
            if "\0" in value:
                raise ValueError(f"{name}: the value contains a NUL character, which no environment can carry")
        size = sum(len(f"{k}={v}".encode("utf-8", "surrogatepass")) + 1 for k, v in env.items())
        if size > MAX_JOB_ENV_BYTES:
            raise ValueError(f"{size} bytes, over the {MAX_JOB_ENV_BYTES} the workers' environment can safely take "
                             "(put long settings in a file the job reads)")
        return env

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, secrets: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        for name, source in secrets.items():
            problem = check_env_name(name)
            if problem is None and name in (info.data.get("env") or {}):
                problem = f"{name} is in job.env too (give it in one of them)"
            if problem is None:
                try:
                    parse_secret_ref(source)
                except ValueError as exc:
                    problem = f"{name}: {exc}"
            if problem is not None:
                raise ValueError(problem)
        return secrets

    @field_validator("deadline", mode="before")
    @classmethod
    def _deadline_text(cls, v: Any) -> Any:
        """A deadline written as text must read as hours or an ISO time: pydantic's own
        answer to ``72h`` is one line per member of the union, naming neither form."""
        if not isinstance(v, str):
            return v
        try:
            float(v)
            return v
        except ValueError:
            pass
        try:
            datetime.fromisoformat(v.strip().replace("Z", "+00:00").replace("z", "+00:00"))
            return v
        except ValueError:
            raise ValueError(f"{v!r} is neither hours nor a time: give hours from the job's submission as a number "
                             "(deadline: 72) or an ISO time (deadline: 2026-12-10T18:00:00Z)") from None

    @field_validator("python")
    @classmethod
    def _interpreter(cls, python: str | None) -> str | None:
        if python is not None and (not python.startswith("/") or any(c in python for c in "\0\n")):
            raise ValueError(f"{python!r} is not an absolute path (give the node's interpreter, e.g. "
                             "/opt/conda/bin/python)")
        return python

    @field_validator("args")
    @classmethod
    def _argv(cls, args: list[str], info: ValidationInfo) -> list[str]:
        for i, a in enumerate(args):
            if "\0" in a:
                raise ValueError(f"item {i} contains a NUL character, which no command line can carry (remove it)")
        module = info.data.get("module", "")
        size = sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in (module, *args))
        if size > MAX_JOB_ARGS_BYTES:
            raise ValueError(
                f"{size} bytes with job.module, over the {MAX_JOB_ARGS_BYTES} a command line can safely take "
                "(torchrun would fail with 'Argument list too long'; put long settings in a file the job reads)"
            )
        return args

    @model_validator(mode="after")
    def _one_entry(self) -> "JobSpec":
        if self.command is None and (extra := sorted(self.model_fields_set & {"output_dir", "accelerate_config"})):
            raise ValueError(f"{extra[0]}: needs job.command (the HF Trainer script it belongs to)")
        if self.command is not None and self.model_fields_set & {"module", "args"}:
            given = " and ".join(f"job.{f}" for f in ("module", "args") if f in self.model_fields_set)
            raise ValueError(f"command: give either job.command (your own script, unchanged) or {given} "
                             "(a trainer that takes spotvisor's flags), not both")
        script = None if self.command is None or self.command[0] == "-m" else self.command[0]
        if script is not None and self.workdir is not None and not os.path.isabs(script) \
                and not (Path(self.workdir) / script).is_file():
            raise ValueError(f"command: {script} is not a file in job.workdir ({self.workdir}), where every node "
                             "runs it (give its path relative to job.workdir, e.g. command: train.py --lr 3e-4)")
        if self.command is not None and self.grow == "in_process":
            raise ValueError("grow: in_process needs spotvisor's elastic trainer (trainer.loop.ElasticJob) to take "
                             "a new node in its running workers; job.command runs your own script, which torchrun "
                             "restarts to grow (remove job.grow, or set it to restart)")
        return self

    @model_validator(mode="after")
    def _batch(self) -> "JobSpec":
        try:
            ElasticBatch(self.global_batch_size, self.micro_batch_size)
        except BatchError as exc:
            raise ValueError(str(exc)) from None
        scheme = self.checkpoint_uri.split("://", 1)[0] if "://" in self.checkpoint_uri else ""
        if scheme not in ("file", "s3", "oss"):
            raise ValueError(
                f"checkpoint_uri {self.checkpoint_uri!r} has no supported scheme "
                "(use file:///path, s3://bucket/prefix or oss://bucket/prefix)"
            )
        if scheme == "oss" and not self.oss_endpoint:
            raise ValueError(
                "oss_endpoint: an oss:// checkpoint_uri needs the bucket's endpoint "
                "(e.g. oss_endpoint: https://oss-cn-hangzhou.aliyuncs.com)"
            )
        return self

    def valid_world_sizes(self, max_world_size: int) -> list[int]:
        return ElasticBatch(self.global_batch_size, self.micro_batch_size).valid_world_sizes(
            max_world_size
        )

    @property
    def failures_seen_at_exit_only(self) -> bool:
        """A script that reports nothing (``command``) on another interpreter than the
        agent's (``python``): its torchrun runs without spotvisor's launcher, which reports
        each failure of its workers (``workers_failed``), so they are seen only when it
        exits, and it gets ``max_restarts_on_errors - 1`` restarts of its own
        (daemon/control/tries.py). Elsewhere torchrun keeps its large budget, which a
        preemption's worker failures (a peer gone mid-collective) must not use up."""
        return self.command is not None and self.python is not None

    def deadline_at(self, submitted_at: float) -> float | None:
        """The deadline in unix seconds for a job submitted at ``submitted_at`` (None: none)."""
        if self.deadline is None:
            return None
        if isinstance(self.deadline, datetime):
            d = self.deadline if self.deadline.tzinfo else self.deadline.replace(tzinfo=timezone.utc)
            return d.timestamp()
        return submitted_at + float(self.deadline) * 3600.0


class RendezvousSpec(_Spec):
    """The c10d rendezvous store (its own process) and torchrun's timeouts.

    Defaults are tuned for fast local re-rendezvous (torch defaults: last call
    30 s, keep-alive 5 s x 3: torch.distributed.elastic.rendezvous.dynamic_rendezvous,
    https://pytorch.org/docs/stable/elastic/rendezvous.html).

    ``start_wait_s``: at the job's start, how long the torchruns of the nodes admitted
    together wait for each other before their first round, and that round is not
    completed without one of them until then (:mod:`trainer.rendezvous`, "start
    cohort"): without it the first round forms ``last_call_timeout_s`` after the
    first torchrun arrives, with whoever came by then, and the job restarts for each
    late one (a torchrun's start-up differs by seconds to tens of seconds between nodes).

    ``host``: where the store listens and every node's torchrun connects. The store
    has no authentication, and torchrun's dynamic rendezvous unpickles the state it
    reads there, so whoever can reach the port can run code on every node. An IP
    literal must therefore be loopback (127.0.0.0/8, ::1) or private (10.0.0.0/8,
    172.16.0.0/12, 192.168.0.0/16, IPv6 fc00::/7); a wildcard (0.0.0.0, ::, "")
    or any other address (public, documentation, link-local, shared 100.64.0.0/10)
    is refused unless ``allow_public: true``, which says the port is reachable only
    by the job's nodes by other means (a security group, a VPN's own ACLs). A host
    name is accepted (it cannot be judged offline).
    """

    # before ``host``: its validator reads this one (pydantic validates fields in order)
    allow_public: bool = False
    host: str = "127.0.0.1"
    port: int = Field(29400, ge=1, le=65535)
    last_call_timeout_s: PositiveS = 3.0
    keep_alive_interval_s: PositiveS = 1.0
    keep_alive_max_attempt: int = Field(3, ge=1)
    join_timeout_s: PositiveS = 600.0
    max_restarts: int = Field(1000, ge=0)
    start_wait_s: float = Field(60.0, ge=0, le=MAX_DURATION_S)  # 0: no wait (the first round as c10d forms it)

    @field_validator("host")
    @classmethod
    def _private(cls, host: str, info: ValidationInfo) -> str:
        why = exposed_address(host)
        if why is not None and not info.data.get("allow_public", False):
            raise ValueError(
                f"{host or repr(host)} is {why}; the c10d store has no authentication and torchrun unpickles "
                "what it reads there, so whoever reaches it runs code on every node (give the control node's "
                "private address, e.g. 10.0.0.10, reachable only by the job's nodes; or set "
                "rendezvous.allow_public: true if a firewall already limits the port to them)"
            )
        return host


class AgentSpec(_Spec):
    """Node agent timing. ``metadata_alarm_after``: failed metadata polls in a row
    before the agent raises a ``metadata_unreachable`` alarm (a failed poll is never
    a notice; it is retried with exponential backoff capped at ``metadata_max_backoff_s``)."""

    poll_interval_s: PositiveS = 1.0
    heartbeat_interval_s: PositiveS = 1.0
    metadata_timeout_s: PositiveS = 2.0
    metadata_alarm_after: int = Field(5, ge=1)
    metadata_max_backoff_s: PositiveS = 5.0
    # the longest the daemon holds a node's command long-poll (seconds). Each is held a
    # uniform random share of this, so nodes that registered together re-poll evenly
    # spread. 300 s is Nomad's and Consul's default blocking-query wait (1,000 idle nodes
    # re-poll ~7 times a second); set it under the idle timeout of any proxy between the
    # agents and the daemon (AWS ALB's default: 60 s)
    command_wait_s: float = Field(300.0, gt=0, le=600)


class StallSpec(_Spec):
    """When the daemon calls the job stalled and restarts its trainers in place
    (:mod:`daemon.control.stall`). Seconds.

    ``first_step_s``: from a (re)start of the job, of an attempt, or a change in which
    nodes train, to the first step: rendezvous, import and loading the checkpoint (give
    a large model's load room: a stall here restarts it). ``floor_s`` and
    ``step_factor``: once steps come, no step for ``max(floor_s, step_factor x the
    median recent step interval)`` is a stall. ``exit_grace_s``: every trainer of the
    job exited (not all with 0) this long is a stall (doubled after each restart that
    brought no step, at most ``first_step_s``).
    """

    first_step_s: PositiveS = 900.0
    floor_s: PositiveS = 300.0
    step_factor: float = Field(20.0, ge=1, le=1e6)
    exit_grace_s: PositiveS = 10.0


class HaSpec(_Spec):
    """The highly available control plane (issue 29): this daemon is one of two or three
    on separate control nodes; one leads the pool by an etcd lease, and the pool's state
    lives in etcd (daemon/ha/). Absent: the embedded default (one daemon, SQLite).

    ``endpoints``: every etcd member's client ``IPV4:PORT`` (3 or 5 members: a quorum
    survives one or two down). ``name``: this daemon's name, unique among the pool's
    daemons (written in the leader key). ``lease_s``: the leader's lease TTL (seconds):
    a dead leader is replaced within about ``lease_s`` plus half a second, and a leader
    cut off from etcd stops acting before it ends. An endpoint off loopback needs TLS
    with a client certificate (``ca_file``, ``cert_file``, ``key_file``): etcd without
    ``--client-cert-auth`` lets whoever reaches it write the pool's state.
    """

    endpoints: list[str] = Field(min_length=1, max_length=7)
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    lease_s: int = Field(5, ge=2, le=60)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    # every control node's agent URL (https://<agent_host>:<agent_port>, this one's too):
    # the nodes are given them all and follow whichever daemon leads
    # (daemon/gpunode/daemon_link.py), so no floating address or DNS name has to follow the
    # leader. Empty: the nodes are given this daemon's own URL only
    agent_urls: list[str] = Field([], max_length=7)

    @field_validator("agent_urls")
    @classmethod
    def _agent_urls(cls, urls: list[str]) -> list[str]:
        from daemon.gpunode.daemon_link import daemon_urls

        if urls:
            try:
                return daemon_urls(",".join(urls))
            except ValueError as exc:
                raise ValueError(str(exc).replace("--daemon-url", "an agent URL", 1)) from None
        return urls

    @field_validator("endpoints")
    @classmethod
    def _endpoints(cls, endpoints: list[str]) -> list[str]:
        for e in endpoints:
            host, _, port = e.rpartition(":")
            if not port.isdigit() or not 0 < int(port) < 65536 or address_of(host) is None or ":" in host:
                raise ValueError(f"{e!r} is not IPV4:PORT (e.g. 10.0.0.5:2379: every etcd member's client address)")
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("an endpoint is listed twice (give each etcd member once)")
        return endpoints

    @model_validator(mode="after")
    def _tls(self) -> "HaSpec":
        files = (self.ca_file, self.cert_file, self.key_file)
        if any(files) and not all(files):
            raise ValueError("ha: give ca_file, cert_file and key_file together (TLS with a client certificate)")
        if not all(files) and not all(is_loopback(e.rpartition(":")[0]) for e in self.endpoints):
            raise ValueError("ha.endpoints off loopback need TLS with a client certificate: set ha.ca_file, "
                             "ha.cert_file and ha.key_file (etcd --client-cert-auth)")
        return self


class DaemonSpec(_Spec):
    """The daemon's own state and listeners.

    ``state_dir``: a directory (created when missing); an existing file there, or a
    file on its path, is an error. ``agent_host``: where the agent API listens; a
    wildcard or public address is allowed there, unlike ``rendezvous.host``, because
    every agent request carries its node's bearer token. Keep the port on the nodes'
    private network all the same.

    ``agent_tls``: whether the agent port speaks TLS (:mod:`daemon.controlnode.tls`).
    ``auto`` (default): TLS unless ``agent_host`` is loopback (127.0.0.0/8, ::1,
    ``localhost``: the local provider's agents on this machine keep plain HTTP).
    ``on``: always. ``off``: plain HTTP, refused for any other address (the tokens would
    cross the network readable). With TLS the daemon makes its own CA under
    ``<state_dir>/tls/`` at first start and hands its certificate to every node it
    launches; or give the operator's files, all three: ``tls_cert_file`` (PEM, naming
    ``agent_host`` in its subjectAltName), ``tls_key_file``, ``tls_ca_file`` (what the
    nodes trust).
    """

    state_dir: str = ".spotvisor"
    socket: str | None = None
    agent_host: str = "127.0.0.1"
    agent_port: int = Field(0, ge=0, le=65535)
    # after ``agent_host``: its validator reads that one (pydantic validates fields in order)
    agent_tls: Literal["auto", "on", "off"] = "auto"
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    heartbeat_timeout_s: PositiveS = 20.0
    # the whole pool sends at most this many heartbeats a second: each node is told an
    # interval of max(agent.heartbeat_interval_s, live nodes / this), and its lost-node
    # timeout grows with what it was told (daemon/control/pool.py, as Nomad's max_heartbeats_per_second).
    # 25, not Nomad's 50: a heartbeat costs this Python daemon about 0.9 ms of CPU with the
    # kernel's share (bench/scale.py), so 25 a second keep them near 2 % of one core on a
    # small control node whatever the pool's size; 1,000 nodes are told 40 s
    max_heartbeats_per_second: float = Field(25.0, gt=0)
    # from a launch request to the node's agent registering (seconds), for every offer that
    # names no ``launch_timeout_s`` of its own. 600 s, not 180 s: a p4d/p5 spot instance
    # spends 1-3 min from RunInstances to ``running``, then a Deep Learning AMI's first boot
    # loads the NVIDIA and EFA drivers, fabric manager and cloud-init (3-5 min more), then the
    # bootstrap starts the agent; a timeout below that kills nodes that would have joined
    # (each one billed) in a loop that never fills the pool, while one above it only delays
    # the replacement of a launch that truly hung (DEADLINE_START_S assumes the same)
    launch_timeout_s: PositiveS = 600.0
    # how a cloud node gets its agent (daemon/providers/bootstrap.py): "wheel" (default:
    # its user data installs this daemon's own wheel, published to the job's store, into
    # /opt/spotvisor/venv on any stock image) or "image" (the image carries spotvisor
    # and its unit: `sudo make install-systemd` at image build)
    agent_install: Literal["wheel", "image"] = "wheel"
    # with agent_install: wheel, the wheel to publish (`pip wheel --no-deps .`, same
    # version as the daemon); absent: built from the daemon's source tree, or packed
    # from its installed distribution (daemon/providers/agent_wheel.py)
    agent_wheel: str | None = None
    rejoin_timeout_s: PositiveS = 90.0
    reconcile_interval_s: PositiveS = 1.0
    # Prometheus: /metrics is always served on the control socket; with a port it is
    # also served on metrics_host:PORT for a scraper (0 = any free port; absent = off).
    # /metrics has no authentication: metrics_host is loopback (default) or a private
    # address of the control node (10/8, 172.16/12, 192.168/16, fc00::/7) that only the
    # scraper reaches (a security group, as for the agent port); anything else is refused
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # gpu_underutilized: a running node's mean SM utilization (percent) stays below
    # this for the window (seconds); one event per episode (daemon/gpunode/gpu.py)
    gpu_underutilized_pct: float = Field(50.0, gt=0, le=100)
    gpu_underutilized_window_s: PositiveS = 300.0
    # a reported checkpoint commit is recorded only once its manifest is read from the
    # job's store and verifies (the control node needs read access to the store); off
    # only for trainers that write no manifests (the tests' stand-ins, the scale bench)
    verify_commits: bool = True
    # a job with no progress (every trainer exited, or no step for a bound from its step
    # time) is reported (job_stalled) and its trainers restarted in place (daemon/control/stall.py)
    stall: StallSpec = StallSpec()
    # a directory the daemons of one control node share (same uid): each whose deadline
    # policy reads the availability record (home_zone) writes there what it has seen of
    # each market's spot capacity, and starts from the others' record of a market it has
    # not seen itself (daemon/controlnode/market_memory.py). Absent: each pool has only
    # its own past (its event store's 48 h)
    market_dir: str | None = None

    @field_validator("state_dir")
    @classmethod
    def _a_directory(cls, state_dir: str) -> str:
        path = Path(os.path.expanduser(state_dir))
        try:
            existing = next((p for p in (path, *path.parents) if p.exists()), None)
            if existing is not None and not existing.is_dir():
                raise ValueError(f"{existing} is a file, not a directory (give a directory; spotvisord creates "
                                 "a missing one)")
        except OSError:  # e.g. no permission to look: the daemon says so when it creates it
            pass
        return state_dir

    @field_validator("metrics_host")
    @classmethod
    def _metrics_private(cls, host: str) -> str:
        why = exposed_address(host)
        if why is None and not is_loopback(host) and address_of(host) is None:
            why = "a host name (it may resolve to a public address)"
        if why is not None:
            raise ValueError(
                f"{host or repr(host)} is {why}; /metrics has no authentication, so it is served on loopback "
                "or a private network only (give 127.0.0.1, or the control node's private address, e.g. "
                "10.0.0.10, with a security group that admits only your Prometheus; or scrape through an "
                "SSH tunnel or an authenticating proxy)"
            )
        return host

    @field_validator("agent_tls", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare on / off as true / false
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("agent_tls")
    @classmethod
    def _no_plain_tokens(cls, mode: str, info: ValidationInfo) -> str:
        host = info.data.get("agent_host")
        if mode == "off" and host is not None and not cls.is_loopback(host):
            raise ValueError(
                f"off would send every node's bearer token in plain HTTP to agent_host {host or repr(host)}, "
                "which is not a loopback address (set daemon.agent_tls: auto or on: the daemon makes its own CA "
                "and gives it to the nodes it launches; or set daemon.agent_host: 127.0.0.1)"
            )
        return mode

    @field_validator("tls_cert_file", "tls_key_file", "tls_ca_file")
    @classmethod
    def _a_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            path = Path(os.path.expanduser(value))
            try:
                missing = not path.is_file()
            except OSError:  # e.g. no permission to look: the daemon says so when it reads it
                missing = False
            if missing:
                raise ValueError(f"{path}: no such file (give the PEM file's path, or remove the three "
                                 "tls_*_file keys: the daemon then makes its own CA)")
        return value

    @model_validator(mode="after")
    def _tls_files(self) -> "DaemonSpec":
        names = ("tls_cert_file", "tls_key_file", "tls_ca_file")
        given = [n for n in names if getattr(self, n) is not None]
        if given and len(given) < len(names):
            missing = [n for n in names if n not in given]
            raise ValueError(f"{', '.join(missing)}: required with {', '.join(given)} (give all three of "
                             f"{', '.join(names)}, or none: the daemon then makes its own CA)")
        if given and self.agent_tls == "off":
            raise ValueError("tls_cert_file, tls_key_file, tls_ca_file given but agent_tls is off (set "
                             "daemon.agent_tls: on, or remove the three files)")
        return self

    # ``host`` is ``localhost`` or a loopback address (:func:`daemon.hosts.is_loopback`)
    is_loopback = staticmethod(is_loopback)

    def agent_tls_on(self) -> bool:
        """Whether the agent port speaks TLS: ``on``; ``auto`` with a non-loopback
        ``agent_host`` or the operator's files; never with ``off``."""
        if self.agent_tls == "auto":
            return not self.is_loopback(self.agent_host) or self.tls_cert_file is not None
        return self.agent_tls == "on"

    def state_path(self) -> Path:
        return Path(os.path.expanduser(self.state_dir)).resolve()

    def market_path(self) -> Path | None:
        return None if self.market_dir is None else Path(os.path.expanduser(self.market_dir)).resolve()

    def socket_path(self) -> Path:
        if self.socket:
            return Path(os.path.expanduser(self.socket)).resolve()
        return self.state_path() / "spotvisord.sock"


class LocalProviderSpec(_Spec):
    """The embedded provider: an instance is a process group on this machine.

    ``max_nodes``: the most nodes a pool with a local offer may have (its
    ``pool.max_nodes``); default :data:`LOCAL_MAX_NODES` (64). Raise it for a machine
    that holds more, or for a simulated fleet (bench/scale.py).
    """

    launch_delay_s: float = Field(1.0, ge=0, le=MAX_DURATION_S)
    max_nodes: int = Field(LOCAL_MAX_NODES, ge=1, le=MAX_POOL_NODES)
    # each simulated node's metadata endpoint speaks one cloud's dialect, cycled
    # over the nodes in launch order (e.g. [aws, aliyun, gcp, azure] mixes clouds)
    metadata_dialects: list[Literal["aws", "aliyun", "gcp", "azure"]] = Field(["aws"], min_length=1)
    spot_price_usd_h: float = Field(0.0, ge=0, le=MAX_PRICE_USD_H)


class AwsProviderSpec(_Spec):
    """AWS EC2 spot capacity (boto3). Credentials come from boto3's standard chain
    (environment, profile, instance role), never from this file.

    The launch fields here are the defaults of every AWS placement domain; a domain's
    ``launch:`` block (:class:`daemon.launchspec.AwsDomainLaunch`) overrides them for its
    region (AMIs, subnets and security groups are region-scoped). ``image_id`` may be left
    out when every AWS domain gives its own.

    ``subnet_ids``: availability zone → subnet id (an offer's zone picks its subnet).
    ``root_volume_gib``: root EBS volume size in GiB (absent: the AMI's); ``root_volume_type``:
    its type (gp3). ``efa``: EFA interfaces (one per network card) where the instance type
    supports them. ``instance_store_scratch``: the type's instance-store NVMe disks become
    the node's checkpoint scratch. ``endpoint_url``: only for tests or VPC endpoints.
    """

    image_id: str | None = Field(None, pattern=r"^ami-[0-9a-f]+$")
    subnet_ids: dict[str, str] = {}
    security_group_ids: list[str] = []
    iam_instance_profile: str | None = None
    key_name: str | None = None
    root_volume_gib: int | None = Field(None, ge=1, le=16384)
    root_volume_type: Literal["gp3", "gp2", "io1", "io2"] = "gp3"
    efa: bool = True
    instance_store_scratch: bool = True
    launch_method: Literal["run_instances", "create_fleet"] = "run_instances"
    endpoint_url: str | None = None
    agent_metadata_dialect: Literal["aws"] = "aws"


class AliyunProviderSpec(_Spec):
    """Alibaba Cloud ECS preemptible (spot) capacity (aliyun-python-sdk-ecs).
    Credentials come from the SDK's chain (``ALIBABA_CLOUD_ACCESS_KEY_ID`` /
    ``ALIBABA_CLOUD_ACCESS_KEY_SECRET``, profile, RAM role), never from this file.

    The launch fields are the defaults of every Alibaba domain; a domain's ``launch:``
    block (:class:`daemon.launchspec.AliyunDomainLaunch`) overrides them for its region.
    ``image_id`` / ``security_group_id`` may be left out when every Alibaba domain gives its own.

    ``vswitch_ids``: zone id → vSwitch id. ``ram_role``: the instance RAM role
    (``RamRoleName``). ``system_disk_gib`` (20..2048) / ``system_disk_category``: the system
    disk (absent: ECS's defaults). ``endpoint``: only for tests (``127.0.0.1:PORT``, plain HTTP).
    """

    image_id: str | None = None
    security_group_id: str | None = None
    vswitch_ids: dict[str, str] = {}
    ram_role: str | None = Field(None, pattern=r"^[A-Za-z0-9.-]{1,64}$")
    key_pair_name: str | None = None
    system_disk_gib: int | None = Field(None, ge=20, le=2048)
    system_disk_category: Literal["cloud_efficiency", "cloud_ssd", "cloud_essd", "cloud_auto", "cloud_essd_entry",
                                  "cloud"] | None = None
    spot_strategy: Literal["SpotAsPriceGo", "SpotWithPriceLimit"] = "SpotWithPriceLimit"
    endpoint: str | None = None


class ProvidersSpec(_Spec):
    local: LocalProviderSpec | None = LocalProviderSpec()
    aws: AwsProviderSpec | None = None
    aliyun: AliyunProviderSpec | None = None


#: a cloud region's name: AWS ``us-east-1``, ``us-gov-west-1``, ``cn-north-1``, ``eu-isoe-west-1``
#: (docs.aws.amazon.com/global-infrastructure/latest/regions/aws-regions.html); Alibaba ``cn-hangzhou``,
#: ``ap-southeast-1``, ``cn-shanghai-finance-1`` (alibabacloud.com/help/en/ecs/regions-and-zones)
_REGION_SHAPES = {
    "aws": (r"[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-\d+", "us-east-1"),
    "aliyun": (r"[a-z]{2}-[a-z]+(-[a-z0-9]+)*", "cn-hangzhou"),
}


class OfferSpec(_Spec):
    """One way to buy a node: provider, place, instance type, GPUs, price cap."""

    provider: Literal["local", "aws", "aliyun"] = "local"
    region: str = "local"
    zone: str | None = None
    # the placement domain (``domains:``) it belongs to; absent: the one domain of its provider and region
    domain: str | None = None
    instance_type: str = "local.cpu"
    gpu_type: str = "none"
    gpus_per_node: int = Field(1, ge=1, le=64)
    max_price_usd_h: float | None = Field(None, ge=0, le=MAX_PRICE_USD_H)
    # GiB per GPU; absent: from gpu_type (daemon.controlnode.preflight.GPU_MEMORY_GIB; "none" = no GPU, no limit)
    gpu_memory_gib: float | None = Field(None, gt=0)
    market: Literal["spot", "on_demand"] = "spot"
    # the on-demand list price of this instance type here (USD/hour), for ``spotctl cost``'s
    # on-demand equivalent and savings; absent: that node's savings are shown as unknown
    on_demand_price_usd_h: float | None = Field(None, ge=0, le=MAX_PRICE_USD_H)
    # from its launch request to its agent registering (seconds), else the node is
    # terminated as launch_timeout; absent: daemon.launch_timeout_s (600 s, why: see there)
    launch_timeout_s: PositiveS | None = None

    @model_validator(mode="after")
    def _place(self) -> "OfferSpec":
        """A cloud region's and zone's names have a documented shape, and a zone's name
        begins with its region's (AWS: ``us-east-1`` and ``us-east-1a``, a Local Zone
        ``us-west-2-lax-1a``; Alibaba: ``cn-hangzhou`` and ``cn-hangzhou-h``, ``ap-southeast-1a``). A typo in
        either passed check-config, and the daemon then asked the wrong region, or
        launched into a zone its subnets do not serve."""
        shape = _REGION_SHAPES.get(self.provider)
        if shape is None or "region" not in self.model_fields_set:  # no region: the config says it is required
            return self
        pattern, example = shape
        if not re.fullmatch(pattern, self.region):
            raise ValueError(f"region: {self.region!r} is not an {self.provider} region's name (e.g. {example})")
        if self.zone is not None and not self.zone.startswith(self.region):
            raise ValueError(f"zone: {self.zone!r} is not in region {self.region} (a zone's name begins with its "
                             "region's; fix the zone or the region)")
        return self

    def memory_gib(self) -> float | None:
        """GiB of memory per GPU: ``gpu_memory_gib``, else from ``gpu_type`` (None: no GPU).

        Raises:
            daemon.catalog.UnknownGpuError: ``gpu_type`` is not in the table and has no size suffix.
        """
        return self.gpu_memory_gib if self.gpu_memory_gib is not None else gpu_memory_gib(self.gpu_type)

    @property
    def key(self) -> str:
        """The offer's stable key (:func:`daemon.control.offers.offer_key`)."""
        return offer_key(self.provider, self.region, self.zone, self.instance_type, self.market)


_DOMAIN_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"


class DomainRendezvous(_Spec):
    """A domain's own rendezvous endpoint: ``host`` and ``port`` on that domain's private
    network, under the same trust rule as the top-level ``rendezvous`` (no wildcard or
    public address unless ``allow_public``); torchrun's timeouts are the top-level
    section's, the same in every domain."""

    allow_public: bool = False  # before ``host``: its validator reads this one
    host: str
    port: int = Field(29400, ge=1, le=65535)

    _private = field_validator("host")(RendezvousSpec._private.__func__)  # type: ignore[attr-defined]


class DomainSpec(_Spec):
    """A placement domain: a provider and region, plus an optional placement group or
    cluster network. Every node of one job attempt sits in one domain, on its private
    network; a move to another domain is a whole-job migration (``migration:``).

    ``checkpoint_uri`` / ``rendezvous``: the domain's own store and rendezvous endpoint,
    each reachable on its private network. The first domain defaults to
    ``job.checkpoint_uri`` and the top-level ``rendezvous``; every other domain must
    give both. ``mix_zones`` / ``mix_gpu_types``: whether one job attempt's nodes may
    come from several zones / GPU types of the domain (false pins the attempt to those of
    its first node). ``egress_usd_per_gb``: USD per GB (10^9 bytes) to copy a checkpoint
    out of this domain's store to another domain (inter-region transfer or internet
    egress; AWS lists 0.02 between US regions and 0.09 to the internet, first 10 TB:
    https://aws.amazon.com/ec2/pricing/on-demand/#Data_Transfer).
    """

    name: str = Field(pattern=_DOMAIN_NAME)
    provider: Literal["local", "aws", "aliyun"] = "local"
    region: str = "local"
    placement_group: str | None = None
    mix_zones: bool = True
    mix_gpu_types: bool = True
    checkpoint_uri: str | None = None
    s3_endpoint_url: str | None = None
    oss_endpoint: str | None = None
    rendezvous: DomainRendezvous | None = None
    egress_usd_per_gb: float = Field(0.0, ge=0)
    # what its instances are launched with, over the provider section's defaults
    # (daemon/launchspec.py: AwsDomainLaunch for aws, AliyunDomainLaunch for aliyun)
    launch: AwsDomainLaunch | AliyunDomainLaunch | None = None

    @field_validator("launch", mode="wrap")
    @classmethod
    def _launch_of_provider(cls, value: Any, handler: Any, info: ValidationInfo) -> Any:
        if value is None or isinstance(value, (AwsDomainLaunch, AliyunDomainLaunch)):
            return value
        provider = info.data.get("provider", "local")
        kind = {"aws": AwsDomainLaunch, "aliyun": AliyunDomainLaunch}.get(provider)
        if kind is None:
            raise ValueError(f"the {provider} provider has no launch settings (remove launch)")
        if isinstance(value, dict):
            for key in value:
                if key not in kind.model_fields:
                    raise ValueError(f"{key} is not a launch setting of an {provider} domain (valid: {kind.keys()})")
        return kind.model_validate(value)  # its errors come out at domains.N.launch.FIELD


class MigrationSpec(_Spec):
    """When the job moves to another placement domain (only with more than one).

    ``patience_s``: how long the job's domain may stay unable to bring the pool back to
    its target (every offer of the domain out of capacity or over its price cap) before
    the job moves. ``boot_timeout_s``: how long the target domain has to bring up nodes
    for a valid world size before the move is given up (``migration_failed``; the job
    stays). ``min_saving_fraction``: also move, without a shortage, when another domain's
    usable offers are at least this much cheaper per GPU-hour and the saving over
    ``payback_h`` hours pays for the move (its egress); null: move only on a shortage.
    ``cooldown_s``: no new move this long after one ends (seconds).
    """

    enabled: bool = True
    patience_s: float = Field(300.0, gt=0, le=MAX_DURATION_S)
    boot_timeout_s: float = Field(900.0, gt=0, le=MAX_DURATION_S)
    min_saving_fraction: float | None = Field(None, gt=0, lt=1)
    payback_h: float = Field(24.0, gt=0)
    cooldown_s: float = Field(1800.0, ge=0, le=MAX_DURATION_S)


class Domain:
    """A resolved placement domain: its name, place, store, rendezvous and offers.

    ``offers``: indices into ``config.offers``. ``rendezvous``: the endpoint (with the
    top-level section's timeouts). ``launch``: its ``launch:`` block (None: the provider
    section's defaults alone); ``index``: its position in ``domains:`` (None: the implicit
    domain of a config without ``domains:``). Built by :meth:`Config.domains_resolved`.
    """

    __slots__ = ("name", "provider", "region", "placement_group", "mix_zones", "mix_gpu_types",
                 "checkpoint_uri", "s3_endpoint_url", "oss_endpoint", "rendezvous", "egress_usd_per_gb", "offers",
                 "launch", "index")

    def __init__(self, **kw: Any) -> None:
        for k in self.__slots__:
            setattr(self, k, kw[k])

    def __repr__(self) -> str:
        return f"Domain({self.name}: {self.provider}/{self.region}, offers {self.offers})"


#: the chaos actions that hit the control node (no ``node``; each restarts what it killed)
CONTROL_NODE_FAULTS = ("kill_store", "kill_daemon", "kill_control_node", "partition_leader")
#: those of them that end the daemon itself: only an outside runner starts it again
DAEMON_FAULTS = ("kill_daemon", "kill_control_node", "partition_leader")


class ChaosEvent(_Spec):
    """A fault the local provider injects.

    ``notice``: publish an interruption notice on the node's metadata endpoint,
    then SIGKILL its process group ``lead_s`` later (as the cloud would).
    ``kill``: SIGKILL the node's process group with no notice.

    ``node`` is the ordinal of the node in launch order (1 = first launched).
    The event fires when the job has reached ``at_step`` (or ``at_s`` seconds
    after the job first started); with ``wait_full_pool`` it also waits until the
    job runs at the pool's target size, so a demo's shape does not depend on the
    machine's speed.

    ``kill_store``: SIGKILL the rendezvous store (the first placement domain's, which
    ``spotvisord demo`` runs as its child) and start it again, empty, ``restart_after_s``
    later, as its unit's ``Restart=`` would; no ``node``. Under ``spotvisord run`` the
    store is its own unit: the event is recorded as skipped.

    ``kill_daemon``: the daemon records the event, then SIGKILLs itself; it is started again
    on the same state directory ``restart_after_s`` later, as ``Restart=`` would.
    ``kill_control_node``: the same, and the rendezvous store is SIGKILLed with it and
    started again, empty, on the same port, with the daemon. Both need an outside runner:
    ``spotvisord demo`` becomes one when its schedule holds either (it runs the daemon as
    its child, and the local instances outlive the daemon); under ``spotvisord run``
    systemd restarts the daemon, and the event is recorded as skipped. No ``node``. A
    restarted daemon fires only the events no earlier daemon recorded.

    ``partition_leader`` (needs ``ha:``): the leading daemon is cut off from etcd for
    ``restart_after_s`` seconds, its nodes and its rendezvous store still in reach. It
    cannot renew its lease, so it stops fail closed (exit 1, one line saying why) before
    the lease ends; the outside runner (``spotvisord demo``) heals the partition after
    ``restart_after_s`` and starts it again, as ``Restart=on-failure`` would, and it leads
    again from the pool's state in etcd. The nodes train on meanwhile. Under ``spotvisord
    run`` the event is recorded as skipped. No ``node``.

    ``hold_replacements_for_steps``: from the fault on, launched instances do not
    boot until the job, resumed after the fault (at the smaller world size), has
    trained that many steps (the schedule waits for it before the next event), so the
    job provably trains at the smaller world size for a while whatever the machine's
    speed. Counted from the resume, not from ``at_step``: a fast job may be well past
    ``at_step`` by the time its notice commit lands.
    """

    action: Literal["notice", "kill", "capacity_out", "kill_store", "kill_daemon", "kill_control_node",
                    "partition_leader"]
    node: int | None = Field(None, ge=1)
    at_step: int | None = Field(None, ge=0)
    at_s: float | None = Field(None, ge=0, le=MAX_DURATION_S)
    lead_s: float = Field(30.0, ge=0, le=MAX_DURATION_S)
    wait_full_pool: bool = True
    hold_replacements_for_steps: int | None = Field(None, ge=1)
    # capacity_out: the placement domain whose offers answer every launch with a capacity
    # error, for ``for_s`` seconds (as a region out of a GPU type does)
    domain: str | None = None
    for_s: float = Field(600.0, gt=0, le=MAX_DURATION_S)
    # kill_store, kill_daemon, kill_control_node: seconds from the kill to the restart;
    # partition_leader: seconds the partition lasts
    restart_after_s: float = Field(3.0, ge=0, le=MAX_DURATION_S)

    @model_validator(mode="after")
    def _when(self) -> "ChaosEvent":
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError("give exactly one of at_step or at_s (when the fault fires)")
        if self.action in CONTROL_NODE_FAULTS:
            if self.node is not None:
                what = "the rendezvous store" if self.action == "kill_store" else "the control node"
                raise ValueError(f"node: {self.action} hits {what}, not a node (remove node)")
            for name in ("hold_replacements_for_steps", "domain"):
                if name in self.model_fields_set and self.action in DAEMON_FAULTS:
                    raise ValueError(f"{name}: {self.action} does not take it (remove it)")
        elif "restart_after_s" in self.model_fields_set:
            raise ValueError(f"restart_after_s: only {', '.join(CONTROL_NODE_FAULTS)} restart something "
                             f"({self.action} does not; remove it)")
        if self.action == "capacity_out":
            if self.domain is None:
                raise ValueError("domain: capacity_out names the placement domain that runs out (domains.*.name)")
        elif self.node is None and self.action not in CONTROL_NODE_FAULTS:
            raise ValueError(f"node: {self.action} names the node it hits (1 = the first launched)")
        return self


class SinkSpec(_Spec):
    """One feed sink (:mod:`daemon.feed.sinks`): where events go, which ones, and how they read.

    ``type``: ``slack`` (an incoming webhook; Block Kit message) or ``webhook`` (JSON
    body signed with HMAC-SHA256, see :mod:`daemon.feed.signing`). The URL is ``url`` or,
    to keep a secret out of this file, ``url_env`` (the name of an environment
    variable holding it; read when the daemon starts). ``secret_env``: the variable
    holding a webhook's signing key (required for ``webhook``; Slack hooks are not
    signed). ``kinds``: event kinds to send (``'*'`` = all), minus ``exclude_kinds``.
    ``template``: event kind (or ``'*'``) -> text, ``str.format`` fields ``{seq}``,
    ``{time}`` (unix s), ``{iso}`` (UTC), ``{kind}``, ``{node}``, ``{pool}``, ``{title}``,
    ``{emoji}``, the node's ``{provider}`` ``{instance_type}`` ``{region}`` ``{zone}``, and
    every key of the event's data (``{step}``, ``{seconds}``, ...); a field the event
    lacks reads ``?``. ``timeout_s``:
    one request (seconds); ``max_backoff_s``: cap of the retry backoff (seconds).
    ``max_batch``: most events one request carries (a backlog goes out in batches of
    this many); default 100 for ``webhook``, 24 for ``slack`` (at most 24 there: a
    message holds 50 blocks).
    """

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    type: Literal["slack", "webhook"]
    url: str | None = Field(None, pattern=r"^https?://\S+$")
    url_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    secret_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    kinds: list[str] = ["*"]
    exclude_kinds: list[str] = []
    template: dict[str, str] = {}
    timeout_s: PositiveS = 10.0
    max_backoff_s: PositiveS = 60.0
    max_batch: int = WEBHOOK_MAX_BATCH  # events per request; unset: by type, see _default_batch

    @model_validator(mode="before")
    @classmethod
    def _default_batch(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_batch") is None:
            return {**data, "max_batch": SLACK_MAX_BATCH if data.get("type") == "slack" else WEBHOOK_MAX_BATCH}
        return data

    @field_validator("max_batch")
    @classmethod
    def _positive_batch(cls, n: int) -> int:
        if n < 1:
            raise ValueError(f"events per request must be at least 1, got {n} (e.g. max_batch: {WEBHOOK_MAX_BATCH})")
        return n

    @field_validator("kinds", "exclude_kinds")
    @classmethod
    def _known_kinds(cls, kinds: list[str]) -> list[str]:
        for k in kinds:
            _check_kind(k)
        return kinds

    @field_validator("template")
    @classmethod
    def _templates(cls, template: dict[str, str]) -> dict[str, str]:
        for kind, text in template.items():
            _check_kind(kind)
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
            except ValueError as exc:
                raise ValueError(f"{kind}: not a str.format template ({exc}; write {{{{ for a literal brace)") from None
            for f in fields:
                if f == "" or f.split(".", 1)[0].split("[", 1)[0].isdigit():
                    raise ValueError(f"{kind}: positional field {{{f}}} (name a field, e.g. {{step}})")
        return template

    @model_validator(mode="after")
    def _where(self) -> "SinkSpec":
        if (self.url is None) == (self.url_env is None):
            raise ValueError("give exactly one of url or url_env (url_env keeps the URL out of this file)")
        if self.type == "webhook" and self.secret_env is None:
            raise ValueError("secret_env: a webhook sink signs its requests (name the variable holding the key)")
        if self.type == "slack" and self.secret_env is not None:
            raise ValueError("secret_env: Slack incoming webhooks are not signed (remove it)")
        if self.type == "slack" and self.max_batch > SLACK_MAX_BATCH:
            raise ValueError(f"max_batch: a Slack message holds at most {SLACK_MAX_BATCH} events (50 blocks), "
                             f"got {self.max_batch} (set max_batch: {SLACK_MAX_BATCH} or less)")
        return self


def _check_kind(kind: str) -> None:
    valid = [k.value for k in EventKind]
    if kind != "*" and kind not in valid:
        raise ValueError(f"unknown event kind {kind!r} (valid: '*', {', '.join(valid)})")


class Config(_Spec):
    pool: PoolSpec = PoolSpec()
    job: JobSpec = JobSpec()
    rendezvous: RendezvousSpec = RendezvousSpec()
    agent: AgentSpec = AgentSpec()
    daemon: DaemonSpec = DaemonSpec()
    providers: ProvidersSpec = ProvidersSpec()
    domains: list[DomainSpec] = []
    migration: MigrationSpec = MigrationSpec()
    offers: list[OfferSpec] = Field(default_factory=lambda: [OfferSpec()], min_length=1)
    chaos: list[ChaosEvent] = []
    notify: list[SinkSpec] = []
    ha: HaSpec | None = None  # None: the embedded default (one daemon, SQLite, no etcd)

    @model_validator(mode="after")
    def _domains(self) -> "Config":
        """Every offer in exactly one placement domain; no job across two (issue 15)."""
        _resolve_domains(self)
        return self

    @model_validator(mode="after")
    def _ha_agent_tls(self) -> "Config":
        """Nodes that follow the leader among several control nodes trust one CA for all of them."""
        d = self.daemon
        if self.ha and len(self.ha.agent_urls) > 1 and d.agent_tls_on() and d.tls_ca_file is None:
            raise ValueError("ha.agent_urls: each daemon's own CA would be trusted by its own nodes only; give "
                             "daemon.tls_cert_file, tls_key_file and tls_ca_file on every control node (one CA, each "
                             "certificate naming its agent_host)")
        return self

    @model_validator(mode="after")
    def _secret_regions(self) -> "Config":
        """Every cloud secret source has a region: its own ``?region=`` or a domain of its cloud's."""
        for name, source in self.job.secrets.items():
            ref = parse_secret_ref(source)
            if ref.scheme != "file" and self.secret_region(ref) is None:
                cloud = "aliyun" if ref.scheme == "kms" else "aws"
                raise ValueError(f"job.secrets.{name}: {ref} has no region and the config has no {cloud} "
                                 f"domain to take it from (add ?region=REGION before any #KEY)")
        return self

    def secret_region(self, ref: "SecretRef") -> str | None:
        """The region a cloud secret source is read in: its ``?region=``, else the region of
        the first placement domain of its cloud (aws for ssm / secretsmanager, aliyun for kms)."""
        if ref.region is not None:
            return ref.region
        cloud = "aliyun" if ref.scheme == "kms" else "aws"
        return next((d.region for d in self.domains_resolved() if d.provider == cloud), None)

    @model_validator(mode="after")
    def _cross(self) -> "Config":
        keys = [o.key for o in self.offers]
        for i, key in enumerate(keys):
            if key in keys[:i]:
                raise ValueError(f"offers.{i}: the same offer as offers.{keys.index(key)} ({key}); "
                                 "remove one (an offer is its provider, region, zone, instance type and market)")
        for i, offer in enumerate(self.offers):
            if offer.market == "on_demand" and not self.pool.on_demand_fallback:
                raise ValueError(
                    f"offers.{i}.market: on_demand offers are a fallback that is off "
                    "(set pool.on_demand_fallback: true, or remove the offer)"
                )
            # (a local offer may be on_demand: its nodes are process groups like the spot ones,
            # which lets a local run plan against job.deadline; bench/dashboard_png.py does)
            if getattr(self.providers, offer.provider, None) is None:
                raise ValueError(
                    f"offers.{i}.provider: {offer.provider!r} has no providers.{offer.provider} "
                    "section (add one or remove the offer)"
                )
        if self.job.model is not None:  # the memory pre-flight needs each offer's GPU memory
            for i, offer in enumerate(self.offers):
                try:
                    offer.memory_gib()
                except UnknownGpuError as exc:
                    raise ValueError(f"offers.{i}.gpu_type: {exc} (set offers.{i}.gpu_memory_gib)") from None
        for i, offer in enumerate(self.offers):
            if offer.provider != "local":
                for key, example in (("region", "us-east-1 / cn-hangzhou"), ("instance_type", "p4d.24xlarge")):
                    if key not in offer.model_fields_set:
                        raise ValueError(f"offers.{i}.{key}: required for provider {offer.provider} "
                                         f"(e.g. {example})")
        local = self.providers.local
        has_local = any(o.provider == "local" for o in self.offers)
        if local is not None and has_local and self.pool.max_nodes > local.max_nodes:
            raise ValueError(
                f"pool.max_nodes: {self.pool.max_nodes} nodes on the local provider, which runs each as processes "
                f"on this machine; at most providers.local.max_nodes ({local.max_nodes}) (lower pool.max_nodes, "
                "or raise providers.local.max_nodes if this machine holds them)"
            )
        max_world = self.max_world_size()
        valid = self.job.valid_world_sizes(max_world)
        if not valid:
            raise ValueError(
                f"job.global_batch_size {self.job.global_batch_size} with micro_batch_size "
                f"{self.job.micro_batch_size} allows no world size up to {max_world} "
                "(make global_batch_size a multiple of micro_batch_size x world size)"
            )
        if (problem := _target_problem(self, valid)) is not None:
            raise ValueError(problem)
        self._check_deadline()
        names = [s.name for s in self.notify]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"notify.{i}.name: sink {name!r} is named twice (give each sink its own name)")
        for i, ev in enumerate(self.chaos):
            if ev.action == "partition_leader" and self.ha is None:
                raise ValueError(f"chaos.{i}.action: partition_leader cuts the leading daemon off from etcd, and "
                                 "this config has no ha: section (add one, or use kill_daemon)")
            if ev.action == "notice" and ev.lead_s <= 0:
                raise ValueError(f"chaos.{i}.lead_s: a notice needs a lead time > 0 (or use action: kill)")
            if ev.at_step is not None and ev.at_step >= self.job.target_steps:
                raise ValueError(f"chaos.{i}.at_step: {ev.at_step} is never reached, the job ends at "
                                 f"job.target_steps {self.job.target_steps} (use a smaller step)")
        return self

    @model_validator(mode="after")
    def _local_output_dir(self) -> "Config":
        if (problem := _local_output_dir_problem(self)) is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _launch_specs(self) -> "Config":
        """Every cloud domain resolves to a launch spec (an image at least), and no
        region-scoped id is shared by two regions: an AMI id, a security group id, an
        Alibaba custom image (``m-...``) or security group names a resource of one region,
        so the same id in a second region cannot launch there."""
        seen: dict[tuple[str, str, str], tuple[str, str]] = {}  # (provider, field, id) -> (region, domain)
        for d in _resolve_domains(self):
            if d.provider not in ("aws", "aliyun") or getattr(self.providers, d.provider) is None:
                continue
            spec = self.launch_spec(d.name)  # ValueError: no image / group, named by field
            where = _launch_path(d)
            if isinstance(spec, AwsLaunchSpec):
                ids = [("image_id", spec.image_id), *(("security_group_ids", g) for g in spec.security_group_ids)]
            else:
                ids = [("security_group_id", spec.security_group_id)]
                if spec.image_id.startswith("m-"):  # a custom image (a public image's id is the same everywhere)
                    ids.append(("image_id", spec.image_id))
            for name, value in ids:
                other = seen.setdefault((d.provider, name, value), (d.region, d.name))
                if other[0] != d.region:
                    what = {"image_id": "an image id names an image in one region only",
                            "security_group_ids": "a security group belongs to one region's VPC",
                            "security_group_id": "a security group belongs to one region's VPC"}[name]
                    how = (f", e.g. from aws ec2 copy-image --source-region {other[0]} --region {d.region}"
                           if (d.provider, name) == ("aws", "image_id") else "")
                    raise ValueError(f"{where}.{name}: {value} is already domain {other[1]}'s in {other[0]}, and {what} "
                                     f"(set {where}.{name} to {d.name}'s own in {d.region}{how})")
        return self

    def launch_spec(self, target: "str | Domain | OfferSpec | Any | None" = None) -> AwsLaunchSpec | AliyunLaunchSpec:
        """What an instance is launched with: the domain's ``launch:`` fields over the
        provider section's (:mod:`daemon.launchspec`). Pure.

        ``target``: a domain name, a :class:`Domain`, an offer (:class:`OfferSpec` or the
        planner's ``daemon.control.offers.Offer``: its domain is the config's offer with
        the same key, else the first domain of its provider and region), or None (the first
        domain).

        Raises:
            KeyError: no such domain, or an offer in no domain of this config.
            ValueError: the domain's provider launches nothing (local), or the spec lacks
                an image / security group (one line naming the field and the fix).
        """
        domain = self._domain_for(target)
        provider = getattr(self.providers, domain.provider, None)
        if domain.provider == "aws" and provider is not None:
            return resolve_aws(provider, domain.launch, domain=domain.name, region=domain.region,  # type: ignore[arg-type]
                               where=_launch_path(domain))
        if domain.provider == "aliyun" and provider is not None:
            return resolve_aliyun(provider, domain.launch, domain=domain.name, region=domain.region,  # type: ignore[arg-type]
                                  where=_launch_path(domain))
        raise ValueError(f"domain {domain.name!r}: the {domain.provider} provider has no launch spec")

    def launch_timeout_s(self, offer_key: str | None) -> float:
        """Seconds a node bought from offer ``offer_key`` may take from its launch request to
        its agent registering: the offer's ``launch_timeout_s``, else ``daemon.launch_timeout_s``
        (also for a key no offer of this config has any more)."""
        for o in self.offers:
            if o.key == offer_key and o.launch_timeout_s is not None:
                return o.launch_timeout_s
        return self.daemon.launch_timeout_s

    def launch_field(self, target: Any, name: str) -> str:
        """Where ``name`` of ``target``'s launch spec is set, as a config path for an error's
        fix: ``domains.N.launch.NAME`` when that domain's ``launch:`` block sets it, else
        ``providers.<provider>.NAME`` (``target``: as :meth:`launch_spec`). Pure."""
        try:
            d = self._domain_for(target)
        except KeyError:
            return f"providers.{getattr(target, 'provider', 'aws')}.{name}"
        field = name.split(".")[0]
        if d.index is not None and d.launch is not None and field in d.launch.model_fields_set:
            return f"domains.{d.index}.launch.{name}"
        return f"providers.{d.provider}.{name}"

    def _domain_for(self, target: Any) -> Domain:
        if target is None or isinstance(target, str):
            return self.domain(target)
        if isinstance(target, Domain):
            return target
        name = getattr(target, "domain", None) if isinstance(target, OfferSpec) else None
        if name is None:
            name = self.domain_of_key(getattr(target, "key", None))
        if name is not None:
            return self.domain(name)
        for d in _resolve_domains(self):  # an offer this config does not list: its place's domain
            if (d.provider, d.region) == (getattr(target, "provider", None), getattr(target, "region", None)):
                return d
        raise KeyError(f"no placement domain for offer {getattr(target, 'key', target)!r}")

    def _check_deadline(self) -> None:
        """A deadline needs a step time to plan with and on-demand offers to fall back on,
        and must leave room for the job on on-demand nodes (boot, start, every step)."""
        job = self.job
        if job.deadline is None:
            return
        if job.step_s is None:
            raise ValueError("job.step_s: a job.deadline needs the seconds per step at the pool's target size "
                             "(measure it with a short run), to know how much slack there is")
        if not any(o.market == "on_demand" for o in self.offers):
            raise ValueError("job.deadline: spending to a deadline needs on-demand offers to fall back on (add an "
                             "offer with market: on_demand and set pool.on_demand_fallback: true)")
        if not isinstance(job.deadline, datetime):
            need_h = (job.target_steps * job.step_s + DEADLINE_START_S) / 3600.0
            if job.deadline < need_h:
                raise ValueError(
                    f"job.deadline: {job.deadline:g} h cannot be met even on on-demand nodes: {job.target_steps} steps "
                    f"x {job.step_s:g} s + {DEADLINE_START_S / 60:.0f} min to start = {need_h:.2f} h (give at least "
                    f"that, fewer job.target_steps, or a faster step)")

    def valid_node_counts(self) -> list[int] | None:
        """Node counts in ``pool.min_nodes..pool.max_nodes`` whose world size the global
        batch splits over, ascending; None when the offers differ in ``gpus_per_node``
        (the world size then depends on which nodes admission picks)."""
        gpus = {o.gpus_per_node for o in self.offers}
        if len(gpus) != 1:
            return None
        (g,) = gpus
        lo, hi = self.pool.min_nodes, self.pool.max_nodes
        return [w // g for w in self.job.valid_world_sizes(self.max_world_size()) if w % g == 0 and lo <= w // g <= hi]

    def valid_world_sizes(self) -> list[int]:
        """World sizes up to :meth:`max_world_size` that the global batch splits over, ascending."""
        return self.job.valid_world_sizes(self.max_world_size())

    def max_world_size(self) -> int:
        """The largest world size the pool can reach: ``pool.max_nodes`` × the most GPUs an offer has."""
        return self.pool.max_nodes * max(o.gpus_per_node for o in self.offers)

    def checkpoint_uri(self, domain: str | None = None) -> str:
        """The checkpoint store's URI in ``domain`` (default: the first domain), with
        ``{state_dir}`` filled in."""
        uri = self.domain(domain).checkpoint_uri
        return uri.replace("{state_dir}", str(self.daemon.state_path()))

    def spending_policy(self) -> str:
        """The name of the recovery policy the daemon runs: ``job.deadline_policy`` resolved
        (:func:`daemon.control.policies.deadline_policy`) with a deadline, the default without."""
        from daemon.control.policies import DEFAULT_POLICY, deadline_policy
        if self.job.deadline is None:
            return DEFAULT_POLICY
        return deadline_policy(self.job.deadline_policy, target_nodes=self.pool.target_nodes, grow=self.job.grow)[0]

    def domains_resolved(self) -> list[Domain]:
        """The placement domains, in config order (the first is where a job starts)."""
        return _resolve_domains(self)

    def domain(self, name: str | None = None) -> Domain:
        """Domain ``name`` (None: the first). Raises KeyError: no such domain."""
        resolved = _resolve_domains(self)
        if name is None:
            return resolved[0]
        for d in resolved:
            if d.name == name:
                return d
        raise KeyError(f"no placement domain {name!r} (domains: {', '.join(d.name for d in resolved)})")

    def domain_of_offer(self, index: int) -> str:
        """The name of the domain offer ``index`` belongs to."""
        for d in _resolve_domains(self):
            if index in d.offers:
                return d.name
        raise KeyError(f"offer {index} has no domain")  # _resolve_domains makes this impossible

    def domain_of_key(self, key: str | None) -> str | None:
        """The domain of the offer whose stable key is ``key`` (a node's ``offer_key``);
        None when no offer of this config has that key (an offer removed since)."""
        for i, o in enumerate(self.offers):
            if o.key == key:
                return self.domain_of_offer(i)
        return None


def _resolve_domains(c: Config) -> list[Domain]:
    """The config's placement domains with their offers. Raises ValueError (one line
    naming the field and the fix) for offers across two implicit domains, an offer in no
    domain or in an ambiguous one, a second domain without its own store or rendezvous."""
    specs = list(c.domains)
    if not specs:  # one implicit domain: the offers' provider and region
        places = list(dict.fromkeys((o.provider, o.region) for o in c.offers))
        if len(places) > 1:
            listed = ", ".join(f"{p}/{r}" for p, r in places)
            raise ValueError(
                f"offers: they span {len(places)} placement domains ({listed}) and one job never spans two "
                "networks (its all-reduce would cross them); declare domains: with a checkpoint_uri and a "
                "rendezvous for each, so the job moves between them whole (configs/multi-cloud.yaml), or keep "
                "the offers of one provider and region")
        (provider, region), = places
        specs = [DomainSpec(name=_slug(f"{provider}-{region}"), provider=provider, region=region)]
    names = [d.name for d in specs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ValueError(f"domains.{i}.name: {name!r} is named twice (give each domain its own name)")
    members: dict[str, list[int]] = {d.name: [] for d in specs}
    for i, o in enumerate(c.offers):
        if o.domain is not None:
            spec = next((d for d in specs if d.name == o.domain), None)
            if spec is None:
                raise ValueError(f"offers.{i}.domain: no domain named {o.domain!r} (domains: {', '.join(names)})")
            if (spec.provider, spec.region) != (o.provider, o.region):
                raise ValueError(f"offers.{i}.domain: {o.domain!r} is {spec.provider}/{spec.region}, the offer "
                                 f"{o.provider}/{o.region} (a domain is one provider and region)")
            members[spec.name].append(i)
            continue
        matches = [d for d in specs if (d.provider, d.region) == (o.provider, o.region)]
        if not matches:
            raise ValueError(f"offers.{i}: {o.provider}/{o.region} is in no placement domain (add a domains: "
                             "entry for it, or remove the offer)")
        if len(matches) > 1:
            raise ValueError(f"offers.{i}.domain: {o.provider}/{o.region} has {len(matches)} domains "
                             f"({', '.join(d.name for d in matches)}); say which one")
        members[matches[0].name].append(i)
    out: list[Domain] = []
    for i, d in enumerate(specs):
        if not members[d.name]:
            raise ValueError(f"domains.{i}: {d.name!r} has no offers (add offers in {d.provider}/{d.region}, "
                             "or remove the domain)")
        if i > 0 and d.checkpoint_uri is None:
            raise ValueError(f"domains.{i}.checkpoint_uri: {d.name!r} needs its own checkpoint store, "
                             "reachable on its private network (e.g. s3://bucket-in-that-region/prefix)")
        if i > 0 and d.rendezvous is None:
            raise ValueError(f"domains.{i}.rendezvous: {d.name!r} needs its own rendezvous endpoint on its "
                             "private network (host and port)")
        uri = d.checkpoint_uri or c.job.checkpoint_uri
        if uri.startswith("oss://") and not (d.oss_endpoint or c.job.oss_endpoint):
            raise ValueError(f"domains.{i}.oss_endpoint: an oss:// checkpoint_uri needs the bucket's endpoint "
                             "(e.g. https://oss-cn-hangzhou.aliyuncs.com)")
        if "://" not in uri or uri.split("://", 1)[0] not in ("file", "s3", "oss"):
            raise ValueError(f"domains.{i}.checkpoint_uri: {uri!r} has no supported scheme "
                             "(use file:///path, s3://bucket/prefix or oss://bucket/prefix)")
        top = c.rendezvous
        rdzv = top if d.rendezvous is None else top.model_copy(update={
            "host": d.rendezvous.host, "port": d.rendezvous.port, "allow_public": d.rendezvous.allow_public})
        out.append(Domain(name=d.name, provider=d.provider, region=d.region, placement_group=d.placement_group,
                          mix_zones=d.mix_zones, mix_gpu_types=d.mix_gpu_types, checkpoint_uri=uri,
                          s3_endpoint_url=d.s3_endpoint_url or c.job.s3_endpoint_url,
                          oss_endpoint=d.oss_endpoint or c.job.oss_endpoint, rendezvous=rdzv,
                          egress_usd_per_gb=d.egress_usd_per_gb, offers=tuple(members[d.name]), launch=d.launch,
                          index=i if c.domains else None))
    endpoints = [(d.rendezvous.host, d.rendezvous.port) for d in out]
    for i, ep in enumerate(endpoints):
        if ep in endpoints[:i]:
            raise ValueError(f"domains.{i}.rendezvous: {ep[0]}:{ep[1]} is also domain "
                             f"{out[endpoints.index(ep)].name!r}'s (each domain has its own)")
    for i, ev in enumerate(c.chaos):
        if ev.domain is not None and ev.domain not in names:
            raise ValueError(f"chaos.{i}.domain: no domain named {ev.domain!r} (domains: {', '.join(names)})")
    return out


def _launch_path(d: Domain) -> str:
    """Where a domain's launch fields are set: ``domains.N.launch``, or the provider section
    for the implicit domain of a config without ``domains:``."""
    return f"providers.{d.provider}" if d.index is None else f"domains.{d.index}.launch"


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text.lower()).strip("-")[:63] or "default"


def _known_keys(model: type[BaseModel] | None, path: tuple[Any, ...]) -> list[str]:
    """The field names of the section at ``path`` under ``model`` (list indexes and dict
    keys are stepped over), or [] where the path leaves the models."""
    for part in path:
        if model is None:
            return []
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        model = _model_in(field.annotation)
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


#: keys other tools' configs use for one of ours, where spelling alone would point elsewhere
#: (a sink's ``kind:`` read as ``kinds``, the event filter, not ``type``)
_SYNONYMS = {"kind": "type", "webhook_url": "url_env", "instance": "instance_type",
             "gpus": "gpus_per_node", "price": "max_price_usd_h"}


#: each ``pattern=`` a config field has, in words, with an example (pydantic's own message
#: quotes the regular expression)
_PATTERN_WORDS = {
    r"^[a-z0-9][a-z0-9-]{0,62}$": "lowercase letters, digits and '-', starting with a letter or digit, at most 63 "
                                  "characters (e.g. llama-ft)",
    r"^[a-z0-9][a-z0-9_-]{0,62}$": "lowercase letters, digits, '_' and '-', starting with a letter or digit, at most "
                                   "63 characters (e.g. ops-slack)",
    r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$": "letters, digits, '_', '.' and '-', starting with a letter or digit, at "
                                          "most 64 characters (e.g. llama-ft-2)",
    r"^ami-[0-9a-f]+$": "an AMI id: ami- and hex digits (e.g. ami-0123456789abcdef0)",
    r"^sg-[0-9a-z]+$": "a security group id: sg- and letters or digits (e.g. sg-bp1abc)",
    r"^[A-Za-z0-9.-]{1,64}$": "a RAM role name: letters, digits, '.' and '-', at most 64 characters",
    r"^https?://\S+$": "an http:// or https:// URL without spaces",
    r"^[A-Za-z_][A-Za-z0-9_]*$": "an environment variable's name (e.g. SLACK_WEBHOOK_URL)",
}


def _whole(v: Any) -> int | None:
    """``v``, text such as ``1e4`` or ``1_000``, as the whole number it says; else None."""
    try:
        f = float(v) if isinstance(v, str) else None
    except ValueError:
        return None
    return int(f) if f is not None and math.isfinite(f) and f == int(f) else None


#: what each mapping field of the config looks like, for an error that got another shape
_MAPPING_EXAMPLES = {"subnet_ids": "subnet_ids: {us-east-1a: subnet-0abc12345}",
                     "vswitch_ids": "vswitch_ids: {cn-hangzhou-h: vsw-bp1abc}", "env": "env: {NAME: value}",
                     "secrets": "secrets: {HF_TOKEN: 'ssm:/team/hf-token'}"}


def _example_config(loc: tuple[Any, ...]) -> str:
    """The shipped config that shows the section at ``loc``: configs/aws.yaml for AWS's,
    aliyun.yaml for Alibaba's, ha.yaml for ``ha``, multi-cloud.yaml for ``domains``,
    else local.yaml."""
    parts = {str(p) for p in loc}
    for key, name in (("aws", "aws.yaml"), ("aliyun", "aliyun.yaml"), ("ha", "ha.yaml"), ("domains", "multi-cloud.yaml")):
        if key in parts:
            return f"configs/{name}"
    return "configs/local.yaml"


def format_problems(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """One line per pydantic error: ``field.path: message``. ``model``: the validated
    model, for an unknown key's nearest known name."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            known = _known_keys(model, tuple(err["loc"][:-1]))
            key = str(err["loc"][-1])
            near = [_SYNONYMS[key]] if _SYNONYMS.get(key) in known else []  # a word other tools use for it
            near = near or difflib.get_close_matches(key, known, n=1)
            msg = (f"unknown key (did you mean {near[0]!r}?)" if near
                   else f"unknown key (check the spelling against {_example_config(err['loc'])})")
        elif err["type"] == "model_type":
            got = "nothing" if err.get("input") is None else f"a {type(err.get('input')).__name__}"
            msg = f"a section of keys, got {got} (give its keys indented under it, or remove the line)"
        elif err["type"] == "dict_type":
            example = _MAPPING_EXAMPLES.get(str(err["loc"][-1]), "{key: value}")
            msg = f"a mapping, got a {type(err.get('input')).__name__} (e.g. {example})"
        elif err["type"] == "list_type":
            msg = f"a list, got a {type(err.get('input')).__name__} (one '- ' item per entry)"
        elif err["type"] == "int_parsing" and _whole(err.get("input")) is not None:  # YAML reads 1e4 as text
            msg = f"{err['input']!r} is text to YAML, not a number (write it out: {_whole(err['input'])})"
        elif err["type"] == "string_pattern_mismatch" and (err.get("ctx") or {}).get("pattern") in _PATTERN_WORDS:
            msg = f"must be {_PATTERN_WORDS[err['ctx']['pattern']]}; got {err.get('input')!r}"
        elif err["type"] == "finite_number":
            msg = f"must be a finite number, got {err.get('input')!r} (give a number, e.g. 30)"
        elif err["type"] == "missing":
            msg = "required (add it)"
        elif err["type"] == "less_than_equal" and loc.endswith("_usd_h"):
            msg = (f"{err.get('input')!r} USD/hour is more than any instance costs (at most {MAX_PRICE_USD_H:g}; "
                   "a slipped decimal point?)")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return lines


def _local_output_dir_problem(config: Config) -> str | None:
    """Why ``job.output_dir`` would be shared by the local provider's nodes, or None. They
    are processes of one machine: an absolute ``output_dir`` would be every node's, and
    their saves and restores of ``checkpoint-N`` collide (``save failed:
    FileNotFoundError``). A relative one is under each node's own working directory: its
    copy of ``job.workdir``; without one, the directory the daemon was started in, which
    every local node shares (a fresh-clone user trial's three nodes all saved into ``./out``)."""
    out = config.job.output_dir
    if out is None or not any(o.provider == "local" for o in config.offers):
        return None
    if os.path.isabs(out):
        return (f"job.output_dir: {out!r} would be shared by every local node (they run on this one machine) and "
                "their checkpoint saves would collide; give a path relative to the job's working directory, which "
                "each node has its own of (e.g. output_dir: out)")
    if config.job.workdir is None:
        return (f"job.output_dir: {out!r} is relative to the directory every local node shares without job.workdir "
                "(they run on this one machine) and their checkpoint saves would collide; add job.workdir: the "
                "directory holding your script (each node runs in its own copy)")
    return None


def _target_problem(config: Config, valid: list[int]) -> str | None:
    """Why ``pool.target_nodes`` nodes cannot split the global batch, or None. ``valid``:
    the world sizes that split it, ascending. With offers alike in ``gpus_per_node``, the
    node counts that can are named. With offers that differ, the world size depends on
    which offers are bought (every sum of that many nodes' GPUs): None when at least one
    of those sums is valid (admission picks one), else the job could never start."""
    counts, target, job = config.valid_node_counts(), config.pool.target_nodes, config.job
    if counts is not None:
        if target in counts:
            return None
        return (f"pool.target_nodes: {target} nodes (world size {target * config.offers[0].gpus_per_node}) cannot "
                f"share job.global_batch_size {job.global_batch_size} in micro batches of {job.micro_batch_size} ("
                + (f"node counts that can: {', '.join(map(str, counts))}; set target_nodes to one of them)" if counts
                   else "no node count in pool.min_nodes..max_nodes can; change job.global_batch_size)"))
    gpus = sorted({o.gpus_per_node for o in config.offers})
    cap = valid[-1]
    sums = 1  # bit w set: w GPUs is a sum of the nodes counted so far (bounded by the largest valid size)
    for _ in range(target):
        sums = functools.reduce(operator.or_, (sums << g for g in gpus)) & ((1 << (cap + 1)) - 1)
    if any(sums >> w & 1 for w in valid):
        return None
    return (f"pool.target_nodes: no world size {target} nodes of these offers make ({', '.join(map(str, gpus))} "
            f"GPUs per node) shares job.global_batch_size {config.job.global_batch_size} in micro batches of "
            f"{config.job.micro_batch_size} (world sizes that can: {', '.join(map(str, valid))}; change "
            "target_nodes, the offers or global_batch_size)")


def loopback_problem(config: Config, faked: Iterable[str] = ()) -> str | None:
    """Why the nodes of a cloud domain cannot reach the control node, or None: a cloud
    node is another machine, and reaches neither the daemon's agent port nor a
    rendezvous store on this machine's loopback, so it would never register, be billed
    until ``daemon.launch_timeout_s``, and be bought again (a config begun from
    local.yaml keeps 127.0.0.1). Not judged for a provider whose endpoint is a local
    fake whose "instances" run on this machine: the config's ``endpoint_url`` /
    ``endpoint``, or one of ``faked`` (the caller's reading of the environment, e.g.
    ``AWS_ENDPOINT_URL``). Judged by ``check-config``, ``check``, ``run`` and ``demo``,
    not at load: a test builds such configs for its local fakes."""
    faked = set(faked)
    if config.providers.aws is not None and config.providers.aws.endpoint_url:
        faked.add("aws")
    if config.providers.aliyun is not None and config.providers.aliyun.endpoint:
        faked.add("aliyun")
    for d in config.domains_resolved():
        if d.provider == "local" or d.provider in faked:
            continue
        where = f"the {d.provider} nodes of domain {d.name!r}"
        if is_loopback(config.daemon.agent_host):
            return (f"daemon.agent_host: {config.daemon.agent_host} is loopback, which {where} cannot reach (give "
                    "the control node's private address, e.g. agent_host: 10.0.0.10)")
        if is_loopback(d.rendezvous.host):
            own = d.index not in (None, 0) and config.domains[d.index].rendezvous is not None
            field = f"domains.{d.index}.rendezvous.host" if own else "rendezvous.host"
            return (f"{field}: {d.rendezvous.host} is loopback, which {where} cannot reach (give the private "
                    "address of the host its store runs on, e.g. 10.0.0.10)")
    return None


def new_job_deadline_problem(config: Config, now: float) -> str | None:
    """Why a job submitted at ``now`` (unix s) cannot meet its ``job.deadline`` even on
    on-demand nodes, or None. A deadline in hours is judged at load
    (:meth:`Config._check_deadline`); an absolute one only against a clock: the daemon asks
    this before a job's first launch (a daemon restarted for a job already under way,
    now late, keeps supervising it)."""
    job = config.job
    if not isinstance(job.deadline, datetime) or job.step_s is None:
        return None
    left_h = (job.deadline_at(now) - now) / 3600.0  # type: ignore[operator]
    need_h = (job.target_steps * job.step_s + DEADLINE_START_S) / 3600.0
    if left_h >= need_h:
        return None
    when = f"{-left_h:,.1f} h in the past" if left_h < 0 else f"{left_h:,.2f} h from now"
    return (f"job.deadline: {job.deadline.isoformat()} is {when}, and the job needs {need_h:.2f} h even on "
            f"on-demand nodes ({job.target_steps} steps x {job.step_s:g} s + {DEADLINE_START_S / 60:.0f} min to "
            "start); give a later time, or hours from the job's submission (e.g. deadline: 72)")


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config.

    Raises:
        ConfigError: the file is missing, empty, not YAML, nested deeper than
            :data:`MAX_NESTING` levels, or fails the schema; ``problems`` has one line
            per problem naming the field path and the fix.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{p}: cannot read ({exc.strerror}); give the path of a YAML config"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"{p}: not UTF-8 text (bad byte at offset {exc.start}); give the path of a YAML config"]
        ) from None
    try:
        deep_line = _too_deep(text)
        if deep_line is not None:
            raise ConfigError([f"{p}: line {deep_line} nested deeper than {MAX_NESTING} levels "
                               "(a config is a few levels deep; check the brackets)"])
        raw = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader
        if raw is None:  # an empty file, or only comments: most likely the wrong file, not the local demo pool
            raise ConfigError([f"{p}: empty (no section in it); give a config, e.g. a copy of configs/local.yaml"])
    except _BadScalar as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else "?"
        raise ConfigError([f"{p}: line {line}: {exc.problem}"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([f"{p}:{where} not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{p}: the top level must be a mapping of sections (pool:, job:, ...)"])
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_problems(exc, Config)) from None
    except RecursionError:  # aliases nesting each other: flat events, a deep document
        raise ConfigError([f"{p}: nested too deeply (a config is a few levels deep; check its anchors)"]) from None


class _BadScalar(yaml.constructor.ConstructorError):
    """A scalar YAML recognises but its type refuses (an integer of more digits than Python
    reads, a date that does not exist); ``problem`` is one line, ``problem_mark`` where it is."""


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with every scalar its constructor refuses (``ValueError``)
    reported as :class:`_BadScalar` at its line (the field's own bounds judge the rest)."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except ValueError as exc:
            raise _BadScalar(None, None, f"{str(node.value)[:40]!r} cannot be read ({str(exc)[:120]}); fix the value",
                             node.start_mark) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python reads no integer of more than 4,300 digits (sys.get_int_max_str_digits)
            raise _BadScalar(None, None, f"an integer {len(str(node.value))} characters long is out of range "
                                         "(no setting takes one of more than a few digits); fix the value",
                             node.start_mark) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def _too_deep(text: str) -> int | None:
    """The line (1-based) where ``text`` first nests deeper than :data:`MAX_NESTING`
    collections, or None. PyYAML's parser (events) is a loop; its composer recurses."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                return event.start_mark.line + 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return None
