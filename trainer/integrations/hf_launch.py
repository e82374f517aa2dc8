"""Run the user's own HF Trainer script under spotvisor's torchrun: restore, then hand over.

``job.output_dir`` / ``job.accelerate_config`` (with ``job.command``) make the daemon
start every worker as::

    torchrun <spotvisor's flags> -m trainer.integrations.hf_launch \\
        [--output-dir DIR] [--accelerate-config FILE] -- <job.command>

On every worker start (the first, and each restart torchrun makes after a notice, a
lost node or a joining one), before the user's script runs:

1. ``--accelerate-config``: the environment ``accelerate launch --config_file FILE``
   would give the script (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_*``,
   ``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_MIXED_PRECISION``, ...), computed by
   accelerate's own functions (``_validate_launch_command``, then
   ``prepare_deepspeed_cmd_env`` or ``prepare_multi_gpu_env``). The processes, ranks and
   rendezvous stay torchrun's: the config's ``num_processes``/``num_machines``/
   ``main_process_*`` are not used.
2. ``--output-dir`` (the script's ``TrainingArguments.output_dir``, relative to its
   working directory): the process group is joined (it stays up for the script:
   accelerate and DeepSpeed adopt an initialized one) and the newest committed
   checkpoint in ``$SPOTVISOR_CHECKPOINT_URI`` is fetched onto every node, sha256-checked
   (a corrupt one is discarded and the previous one taken; a torn one, without its
   manifest, is never considered: :meth:`DirCheckpointer.fetch_latest`). Every
   ``checkpoint-*`` folder in the output dir is removed (never committed, or older), and
   the fetched one becomes ``DIR/checkpoint-<step>``: ``get_last_checkpoint(DIR)`` and
   ``resume_from_checkpoint=True`` find it, and the Trainer's own data skip resumes at
   the exact position.
3. The user's command runs in this process (``runpy``; ``sys.argv`` as the script
   expects it).
4. When it returns (or calls ``sys.exit(0)``), every rank meets at a barrier and leaves
   the process group, the script's ``atexit`` handlers run, and the process ends
   without the interpreter's finalization (:func:`~trainer.integrations.common.end_worker`:
   a gloo thread could abort it, and torchrun would report the finished job as failed).
   A script that exits non-zero ends the same way with its code (no barrier: a peer may
   be gone), one that raises with its traceback and 1, as Python would say it: ended by
   the interpreter's finalization, the same gloo thread turned a clean-clone run's
   ``sys.exit(3)`` into SIGABRT (tests/test_hf_launch_exit.py, 2026-12-05).

Exit 2 with one line for a config that can never run (bad accelerate config, a
checkpoint not written by the HF callback, no ``--`` command).
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import shutil
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

__all__ = ["accelerate_env", "restore", "main"]

log = logging.getLogger("trainer.integrations.hf_launch")

#: Variables of accelerate's launch environment that are about the launch itself (torchrun's here).
_LAUNCH_ONLY = ("PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "OMP_NUM_THREADS")


class LaunchError(Exception):
    """A setting this job can never run with; ``str()`` is one line."""


def accelerate_env(config_file: str | os.PathLike[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The variables ``accelerate launch --config_file config_file`` sets for its script
    (those differing from ``base``, default ``os.environ``), less the launch's own
    (ranks, ports, ``PYTHONPATH``).

    Raises:
        LaunchError: the file is missing or accelerate cannot read it (one line).
    """
    base = dict(os.environ if base is None else base)
    path = Path(config_file)
    if not path.is_file():
        raise LaunchError(f"job.accelerate_config: {path} not found (relative to the job's working directory)")
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

        args = launch_command_parser().parse_args(
            ["--config_file", str(path), "--num_machines", "1", "--main_process_port", "0", "spotvisor-script"])
        args, defaults, mp_from_config = _validate_launch_command(args)
        args.num_machines = 1  # the ranks are torchrun's: one "machine" as accelerate sees its launch
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            if mp_from_config:
                fields.append("mixed_precision")
            args.deepspeed_fields_from_accelerate_config = ",".join(fields)
            _, env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu or args.use_megatron_lm:
            env = prepare_multi_gpu_env(args)
        else:
            env = dict(base)
            env["ACCELERATE_MIXED_PRECISION"] = str(args.mixed_precision)
    except (ValueError, TypeError, KeyError, OSError, ImportError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LaunchError(f"job.accelerate_config: {path}: {first}") from None
    return {k: v for k, v in env.items() if k not in _LAUNCH_ONLY and base.get(k) != v}


def restore(output_dir: str | os.PathLike[str], *, pg_timeout_s: float = 1800.0) -> int | None:
    """Put the newest committed checkpoint at ``output_dir/checkpoint-<step>`` on every node.
    Collective: joins the process group (``gloo``, ``nccl`` on CUDA) and leaves it up.

    Returns the step restored, or None when nothing is committed (or no
    ``$SPOTVISOR_CHECKPOINT_URI``). Raises LaunchError for a checkpoint this callback did
    not write; StorageError when the store fails.
    """
    from trainer.checkpoint import open_store
    from trainer.contract import CHECKPOINT_URI_ENV
    from trainer.guard import PreemptionGuard
    from trainer.integrations.common import DirCheckpointer
    from trainer.runtime import StatusWriter, barrier, normalize_uri, scratch_dir, setup_distributed

    uri = os.environ.get(CHECKPOINT_URI_ENV, "").strip()
    if not uri:
        return None
    ctx = setup_distributed(pg_timeout_s)
    checkpointer = DirCheckpointer(ctx, open_store(normalize_uri(uri)), scratch_dir("hf"),
                                   StatusWriter(None, ctx, "restore"), PreemptionGuard(notice_file=""))
    manifest, local = checkpointer.fetch_latest()
    out = Path(output_dir)
    if ctx.is_local_leader:
        out.mkdir(parents=True, exist_ok=True)
        for stale in out.glob("checkpoint-*"):  # never committed, or older than the newest commit
            shutil.rmtree(stale, ignore_errors=True)
    if manifest is not None and local is not None and ctx.is_local_leader:
        if manifest.extra.get("format") != "hf-trainer":
            raise LaunchError(f"checkpoint step {manifest.step} in {uri} was not written by the HF callback "
                              "(use another checkpoint_uri)")
        shutil.move(os.fspath(local), os.fspath(out / f"checkpoint-{manifest.step}"))
    barrier(ctx)
    if ctx.is_leader:
        log.info("restored committed step %s into %s", manifest.step if manifest else None, out)
    return manifest.step if manifest is not None else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.integrations.hf_launch",
                                description="Restore the newest committed HF checkpoint, then run the user's script.")
    p.add_argument("--output-dir", help="the script's TrainingArguments.output_dir")
    p.add_argument("--accelerate-config", help="an accelerate config file (DeepSpeed, FSDP)")
    p.add_argument("--pg-timeout-s", type=float, default=1800.0, help="process-group timeout (HF's ddp_timeout)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py ARGS... or -- -m MODULE ARGS...")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command == ["-m"]:
        print("error: no command after -- (the user's script and its flags)", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if args.accelerate_config:
            os.environ.update(accelerate_env(args.accelerate_config))
            if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
                from trainer.integrations.deepspeed import disable_jit_ops

                # on a CPU node DeepSpeed would JIT-build its shared-memory all-reduce (minutes
                # of C++ at the first start of a fresh node) that training never uses
                disable_jit_ops()
        if args.output_dir:
            restore(args.output_dir, pg_timeout_s=args.pg_timeout_s)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as exc:  # the script's own sys.exit(): 0 (or None) is a script that finished
        return _exit_code(exc.code)
    except Exception:  # noqa: BLE001 - the script's own error: said as Python says it, then ended as above
        traceback.print_exc()
        return 1
    return 0


def _exit_code(code: object) -> int:
    """The exit status ``sys.exit(code)`` gives (None: 0; an int: itself; anything else is
    printed to stderr, 1), as CPython's ``handle_system_exit`` does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # the status the kernel keeps
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    from trainer.integrations.common import end_worker

    end_worker(main())  # every rank leaves the group together; no interpreter finalization
