"""A node's preparation before its trainer may start: ``job.workdir`` fetched, verified
and unpacked, then ``job.setup`` run. The agent's side of :mod:`daemon.controlnode.code_delivery`.

1. **Fetch** (:func:`fetch`, blocking: in a thread): the job spec's ``"workdir": {"uri",
   "sha256", "bytes"}`` names the archive in the node's domain's checkpoint store
   (``<checkpoint_uri>/code/<sha256>.tar.gz``), read through the trainer's own store
   classes (:func:`trainer.checkpoint.open_store`) with the node's credentials. An object
   of another size is not downloaded. The download's sha256 must be the pinned one:
   otherwise nothing is unpacked or run (fail closed).
2. **Unpack** into ``<agent workdir>/code/<sha256>`` with tarfile's ``data`` filter (PEP 706:
   no absolute path, no ``..``, no link leading outside, no device), first into a temporary
   directory renamed into place, so the directory exists only whole. A version already
   unpacked (an agent restarted) is used as it is.
3. **Setup** (:func:`run_setup`): each command of ``"setup": {"commands", "timeout_s"}`` by
   ``bash -c``, in order, in the unpacked workdir, with the trainer's environment; their
   output is appended to the node's ``trainer.log`` (shipped to the daemon with the
   heartbeats: ``spotctl tail NODE``). The first non-zero exit fails it; so does the
   whole setup running past ``timeout_s`` (its process group is killed).

Every failure is a :class:`PrepareError` naming its stage (``fetch``, ``verify``,
``unpack``, ``setup``, ``timeout``, :data:`daemon.control.reports.SETUP_STAGES`), which
the agent reports as ``setup_failed``; its trainer never starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from daemon.gpunode.nodelog import mask_secrets, read_tail
from trainer.contract import OSS_ENDPOINT_ENV, OSS_RAM_ROLE_ENV, S3_ENDPOINT_ENV

__all__ = ["PrepareError", "fetch", "run_setup", "last_line", "needs_preparing", "prepare_node", "FETCH_TIMEOUT_S"]

FETCH_TIMEOUT_S = 1800.0  # the most a fetch may take (seconds) when the spec has no setup timeout
_TAIL_BYTES = 4096
MAX_LINE_CHARS = 400


class PrepareError(Exception):
    """The preparation failed at ``stage``; ``exit_code`` of a setup command; ``str()`` is one line."""

    def __init__(self, stage: str, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.stage, self.exit_code = stage, exit_code


def _split(uri: str) -> tuple[str, str]:
    root, _, key = uri.rpartition("/")
    if not root or not key or "://" not in root:
        raise PrepareError("fetch", f"workdir uri {uri!r} is not <store>/<key>")
    return root, key


def fetch(workdir: dict[str, Any], agent_dir: Path, *, s3_endpoint_url: str | None = None,
          oss_endpoint: str | None = None) -> Path:
    """Fetch, verify and unpack the job spec's ``workdir``; returns the unpacked directory.
    Blocking (store I/O, hashing, unpacking).

    Raises:
        PrepareError: ``fetch`` (store unreachable, object missing or of another size),
            ``verify`` (sha256 mismatch: nothing unpacked), ``unpack`` (the archive is
            refused by the ``data`` filter or broken).
    """
    from trainer.checkpoint import open_store
    from trainer.storage import CheckpointError

    sha, size, uri = workdir.get("sha256"), workdir.get("bytes"), workdir.get("uri")
    if not (isinstance(sha, str) and len(sha) == 64 and isinstance(size, int) and isinstance(uri, str)):
        raise PrepareError("fetch", "the job spec's workdir is not {uri, sha256, bytes}")
    code_root = agent_dir / "code"
    dest = code_root / sha
    if dest.is_dir():
        return dest
    code_root.mkdir(parents=True, exist_ok=True)
    root, key = _split(uri)
    part = code_root / f".{sha}.tar.gz.part"
    try:
        try:
            store = open_store(root, s3_endpoint_url=s3_endpoint_url, oss_endpoint=oss_endpoint)
            found = store.list(key).get(key)
            if found != size:
                raise PrepareError("fetch", f"{uri}: {'missing' if found is None else f'{found} bytes'}, the "
                                            f"daemon published {size} bytes")
            store.get_file(key, part)
        except (CheckpointError, ValueError, OSError) as exc:
            raise PrepareError("fetch", f"{uri}: {exc}") from None
        with open(part, "rb") as f:
            got = hashlib.file_digest(f, "sha256").hexdigest()
        if got != sha:
            raise PrepareError("verify", f"{uri}: sha256 {got} is not the pinned {sha}; nothing was unpacked or run")
        tmp = Path(tempfile.mkdtemp(prefix=f".{sha}-", dir=code_root))
        try:
            with tarfile.open(part, "r:gz") as tar:
                tar.extractall(tmp, filter="data")
            os.replace(tmp, dest)
        except (tarfile.TarError, OSError, EOFError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if dest.is_dir():  # another unpack of the same version won
                return dest
            raise PrepareError("unpack", f"{uri}: {exc}") from None
    finally:
        part.unlink(missing_ok=True)
    return dest


def last_line(log_path: Path, since: int = 0) -> str:
    """The last non-empty line written to ``log_path`` after byte ``since`` (at most
    :data:`MAX_LINE_CHARS` characters; "" none). Blocking (reads the file's tail)."""
    tail = read_tail(log_path, since=since, max_bytes=_TAIL_BYTES)
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return lines[-1][:MAX_LINE_CHARS] if lines else ""


async def run_setup(commands: list[str], *, cwd: Path, env: dict[str, str], log_path: Path,
                    timeout_s: float) -> float:
    """Run ``commands`` (module docstring, step 3); returns the seconds they took.

    Raises:
        PrepareError: ``setup`` (a command exited non-zero: its ``exit_code``, its last
            output line as the message) or ``timeout`` (past ``timeout_s`` seconds).
    """
    started = time.monotonic()
    since = log_path.stat().st_size if log_path.exists() else 0
    proc: asyncio.subprocess.Process | None = None
    try:
        async with asyncio.timeout(timeout_s):
            for i, cmd in enumerate(commands):
                with open(log_path, "ab") as out:
                    out.write(f"[spotvisor] job.setup {i + 1}/{len(commands)}: {cmd}\n".encode())
                    out.flush()
                    proc = await asyncio.create_subprocess_exec(
                        "bash", "-c", cmd, cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)  # its own group: killed whole
                code = await proc.wait()
                proc = None
                if code != 0:
                    line = await asyncio.to_thread(last_line, log_path, since)
                    raise PrepareError("setup", line or f"command {i + 1} exited {code}", exit_code=code)
    except TimeoutError:
        line = await asyncio.to_thread(last_line, log_path, since)
        raise PrepareError("timeout", f"past job.setup_timeout_s ({timeout_s:g} s)" + (f"; last: {line}" if line
                                                                                      else "")) from None
    finally:
        if proc is not None and proc.returncode is None:  # timed out or cancelled: the whole group goes
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
    with open(log_path, "ab") as out:
        out.write(f"[spotvisor] job.setup done in {time.monotonic() - started:.1f} s\n".encode())
    return time.monotonic() - started


def needs_preparing(job: dict[str, Any]) -> bool:
    """Whether the job spec has a workdir to fetch or a setup to run before the trainer may start."""
    return bool(job.get("workdir") or job.get("setup"))


async def prepare_node(runner: Any, *, report: Callable[..., None], beat_now: asyncio.Event,
                       beat_sent: asyncio.Event, ship_log_s: float = 5.0) -> bool:
    """The agent's preparation of its node (the module docstring), then the prewarm: fetch
    and unpack ``runner.job``'s workdir, run its setup, and on success set ``runner.code_dir``
    and ``runner.prepared``, start the prewarm (:meth:`TrainerProcess.prewarm`) and report
    ``code_ready``; on a :class:`PrepareError`, have the heartbeats ship ``trainer.log``
    (``beat_now``; ``beat_sent`` is set after each heartbeat; at most ``ship_log_s`` seconds
    each, twice: one in flight may hold an older chunk) and report ``setup_failed``: the
    trainer never starts. ``runner``: the agent's :class:`~daemon.gpunode.trainer_process.TrainerProcess`.
    Returns whether the node is prepared."""
    job, workdir = runner.job, runner.workdir
    spec, setup = job.get("workdir"), job.get("setup") or {}
    sha = spec.get("sha256", "") if isinstance(spec, dict) else ""
    env = job.get("env", {})
    try:
        code_dir = None
        if isinstance(spec, dict):
            s3, oss = env.get(S3_ENDPOINT_ENV), env.get(OSS_ENDPOINT_ENV)
            if env.get(OSS_RAM_ROLE_ENV):  # the node's RAM role: its OSS credentials, for the agent's fetch too
                os.environ.setdefault(OSS_RAM_ROLE_ENV, env[OSS_RAM_ROLE_ENV])
            timeout_s = float(setup.get("timeout_s") or FETCH_TIMEOUT_S)
            try:
                async with asyncio.timeout(timeout_s):
                    code_dir = await asyncio.to_thread(fetch, spec, workdir, s3_endpoint_url=s3, oss_endpoint=oss)
            except TimeoutError:
                raise PrepareError("fetch", f"{spec.get('uri')}: not fetched within {timeout_s:g} s") from None
        runner.code_dir = code_dir
        setup_s = None
        if setup.get("commands"):
            setup_s = await run_setup(list(setup["commands"]), cwd=code_dir or workdir, env=runner.job_env(),
                                      log_path=workdir / "trainer.log", timeout_s=float(setup["timeout_s"]))
    except PrepareError as exc:
        runner.code_dir = None
        for _ in range(2):
            beat_sent.clear()
            beat_now.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ship_log_s):
                    await beat_sent.wait()
        said = mask_secrets(str(exc), job.get("secrets"))  # the job's secrets reach the setup: never an event
        report("setup_failed", stage=exc.stage, exit_code=exc.exit_code, last_line=said[:MAX_LINE_CHARS], sha256=sha)
        return False
    runner.prepared = True
    await runner.prewarm()
    report("code_ready", sha256=sha, setup_s=None if setup_s is None else round(setup_s, 2),
           trainer=runner.state.value)
    return True
