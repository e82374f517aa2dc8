"""The job's command line, as the daemon hands it to every node's agent. Pure.

``python -m torch.distributed.run --nnodes=MIN:MAX --rdzv-backend=spotvisor ... -m <job.module> <trainer flags>``
(``python -m trainer.torchrun ...`` on ``job.python``, an image's own interpreter) (or ``... <job.command>``: the user's own script and its own flags, nothing added; the
checkpoint store's URI then rides in ``$SPOTVISOR_CHECKPOINT_URI``) with the rendezvous on the control node (``is_host=false``: no spot node hosts it) and
the environment the trainer's contract names (:mod:`trainer.contract`), then ``job.env``.

The job's secrets (:mod:`daemon.controlnode.job_secrets`) ride in the spec's own
``"secrets"`` map, apart from ``"env"``: the agent adds them to the trainer's environment
only (:meth:`daemon.gpunode.trainer_process.TrainerProcess.job_env`), and whatever shows
a spec can leave that one key out (:func:`shown`).
"""

from __future__ import annotations

from typing import Any, Mapping

from daemon.config import Config
from daemon.controlnode.workdir import CodePin
from daemon.gpunode.metadata.registry import DOCUMENTED_LEAD_S
from daemon.model import TORCHRUN_ARGV, UNREPORTED_MAX_RESTARTS_KEY, Node
from trainer.contract import (CHECKPOINT_URI_ENV, HOLD_TIMEOUT_ENV, JOIN_ENV, OSS_ENDPOINT_ENV, OSS_RAM_ROLE_ENV,
                              RDZV_ENDPOINT_ENV, RUN_ID_ENV, S3_ENDPOINT_ENV, SHUTDOWN_TIMEOUT_ENV, ZYGOTE_PRELOAD_ENV)

__all__ = ["job_spec", "run_id", "shown", "prepares", "SECRETS_KEY", "PLAIN_SHUTDOWN_TIMEOUT_S"]

# job.command: torchrun's wait for its SIGTERMed workers (seconds), past the longest notice
# lead a cloud documents (Alibaba's 5 min); the notice's own deadline is the agent's to enforce
PLAIN_SHUTDOWN_TIMEOUT_S = int(max(DOCUMENTED_LEAD_S.values())) + 30

SECRETS_KEY = "secrets"  # the spec's map of the job's secrets: {NAME: value}


def run_id(config: Config, run_nonce: str) -> str:
    """The job's run id on every node (torchrun's ``--rdzv-id``, ``$SPOTVISOR_RUN_ID``)."""
    return f"{config.job.id}-{run_nonce}"


def prepares(config: Config) -> bool:
    """Whether a node prepares before it is ready (``preparing``): it has a ``job.workdir``
    to fetch or a ``job.setup`` to run (:mod:`daemon.control.setup`)."""
    return bool(config.job.workdir or config.job.setup)


def shown(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` as it may be shown or logged: each secret's value is ``***``."""
    if SECRETS_KEY not in spec:
        return spec
    return {**spec, SECRETS_KEY: {name: "***" for name in spec[SECRETS_KEY]}}


def job_spec(config: Config, node: Node, run_nonce: str, domain: str | None = None,
             secrets: Mapping[str, str] | None = None, *, code: CodePin | None = None) -> dict[str, Any]:
    """The torchrun command line (after ``python``) and environment for ``node``: ``{"argv",
    "env"}``; with ``code`` (the daemon run's pinned ``job.workdir``) ``"workdir": {"uri",
    "sha256", "bytes"}`` in the node's domain's store, and with ``job.setup`` ``"setup":
    {"commands", "timeout_s"}``: the agent fetches, verifies and unpacks the workdir, runs
    the setup there, and only then runs the trainer, in it (:mod:`daemon.gpunode.code`).
    With ``job.grow: in_process`` a ``"join"`` spec of the same shape as the first: the
    node's own ``torchrun --standalone`` whose workers join the running group in-process
    (``SPOTVISOR_JOIN=1``, :mod:`trainer.membership`), started instead when the daemon
    admits the node into a running job. ``run_nonce`` makes the rendezvous id of this pool's
    run (kept in the store).
    ``domain``: the node's placement domain (None: the first); its rendezvous endpoint and
    checkpoint store are the ones the node uses, each on that domain's private network.
    With ``job.python``: ``"python"``, the interpreter the node runs the command with.
    ``secrets``: the job's resolved secrets ``{NAME: value}``, carried as ``"secrets"``
    (absent when there are none)."""
    c, job = config, config.job
    d = config.domain(domain)
    rdzv = d.rendezvous
    rdzv_conf = ",".join(
        [
            "is_host=false",  # the rendezvous store runs on the control node, never on a spot node
            f"last_call_timeout={rdzv.last_call_timeout_s:g}",
            f"keep_alive_interval={rdzv.keep_alive_interval_s:g}",
            f"keep_alive_max_attempt={rdzv.keep_alive_max_attempt}",
            f"join_timeout={rdzv.join_timeout_s:g}",
        ]
    )
    launcher = [
        f"--nnodes={c.pool.min_nodes}:{c.pool.max_nodes}",
        f"--nproc-per-node={node.gpus}",
        # spotvisor's c10d (trainer/rendezvous.py): the store's loss costs no worker restart
        "--rdzv-backend=spotvisor",
        f"--rdzv-endpoint={rdzv.host}:{rdzv.port}",
        f"--rdzv-id={run_id(config, run_nonce)}",
        f"--rdzv-conf={rdzv_conf}",
        # a script that reports nothing on another interpreter (no launcher to report its workers'
        # failures) is seen failing only when its torchrun exits: after job.max_restarts_on_errors
        # tries of its own (daemon/control/tries.py)
        f"--max-restarts={job.max_restarts_on_errors - 1 if job.failures_seen_at_exit_only else rdzv.max_restarts}",
    ]
    hf_launch = [*(["--output-dir", job.output_dir] if job.output_dir else []),
                 *(["--accelerate-config", job.accelerate_config] if job.accelerate_config else [])]
    if job.command is not None and hf_launch:  # restore the newest commit into output_dir, then the script
        trainer = ["-m", "trainer.integrations.hf_launch", *hf_launch, "--", *job.command]
    elif job.command is not None:
        trainer = list(job.command)
    else:
        trainer = [
            "-m", job.module,
            "--target-steps", str(job.target_steps),
            "--global-batch-size", str(job.global_batch_size),
            "--micro-batch-size", str(job.micro_batch_size),
            "--checkpoint-uri", c.checkpoint_uri(d.name),
            "--checkpoint-interval", str(job.checkpoint_interval_steps),
            "--hold-timeout-s", f"{job.hold_timeout_s:g}",
            *job.args,
        ]
    # an image's own interpreter (job.python) has spotvisor's trainer/ on its path but not its
    # torchrun entry point: trainer.torchrun registers the backend, then runs torchrun's main
    torchrun = ["-m", "trainer.torchrun"] if job.python else list(TORCHRUN_ARGV)
    argv = [*torchrun, *launcher, "--monitor-interval=0.5", *trainer]
    env = {
        # c10d's own store sharing off (pytorch#135712: a node joining a surviving group otherwise
        # deadlocks); the spotvisor rendezvous has rank 0's agent host a new one each round instead
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # the survivors of a notice re-form their group here, in-process (trainer.runtime.shrink_process_group)
        RDZV_ENDPOINT_ENV: f"{rdzv.host}:{rdzv.port}",
        RUN_ID_ENV: run_id(config, run_nonce),
    }
    if job.command is not None:  # the user's own script takes no flag of ours: what it may use rides in the env
        env[CHECKPOINT_URI_ENV] = c.checkpoint_uri(d.name)
        # on a notice the agent SIGTERMs torchrun, which forwards it to the workers and, by
        # default, SIGKILLs them 30 s later: wait past any cloud's notice instead (the agent
        # itself SIGKILLs what still runs at the notice's own deadline)
        env[SHUTDOWN_TIMEOUT_ENV] = str(PLAIN_SHUTDOWN_TIMEOUT_S)
        env[HOLD_TIMEOUT_ENV] = f"{job.hold_timeout_s:g}"
    if d.s3_endpoint_url:
        env[S3_ENDPOINT_ENV] = d.s3_endpoint_url
    if d.oss_endpoint:
        env[OSS_ENDPOINT_ENV] = d.oss_endpoint
    if d.provider == "aliyun" and (role := getattr(config.launch_spec(d), "ram_role", None)):
        env[OSS_RAM_ROLE_ENV] = role  # the node has no OSS keys of its own: its instance RAM role's are used
    if job.preload:  # the nodes' zygotes import these before the workers fork (daemon/gpunode/zygote.py)
        env[ZYGOTE_PRELOAD_ENV] = ",".join(job.preload)
    env.update(job.env)  # names checked against spotvisor's own (daemon.secretref); OMP_NUM_THREADS is the job's
    spec: dict[str, Any] = {"argv": argv, "env": env}
    if job.command is not None:  # a notice is a SIGTERM to the script (daemon/gpunode/trainer_process.py)
        spec["notice_signal"] = True
        if not job.failures_seen_at_exit_only:
            # the node's torchrun started without the launcher (its prewarm died) reports nothing
            # but its exit: it gets the small budget there (daemon/control/tries.py)
            spec[UNREPORTED_MAX_RESTARTS_KEY] = job.max_restarts_on_errors - 1
    if code is not None:
        spec["workdir"] = code.spec(d.name)
    if job.setup:
        spec["setup"] = {"commands": list(job.setup), "timeout_s": job.setup_timeout_s}
    if job.python:  # the node's interpreter for torchrun (the agent's own when absent)
        spec["python"] = job.python
    if secrets:
        spec[SECRETS_KEY] = dict(secrets)
    if job.grow == "in_process":
        # no --max-restarts: a worker that fails exits the node's torchrun, and the daemon
        # takes the node out (its workers were never in torchrun's rendezvous to restart in)
        spec["join"] = {"argv": ["-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                                 f"--nproc-per-node={node.gpus}", "--monitor-interval=0.5", *trainer],
                        "env": {**env, JOIN_ENV: "1"}}
    return spec
