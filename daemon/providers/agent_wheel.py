"""The agent's wheel: the daemon's own code, published to the job's store for a node's bootstrap.

A node on a stock image (AWS Deep Learning AMI, Alibaba's GPU images) installs the agent
from a wheel of this very daemon (same version, same code), fetched from the job's
checkpoint store through a signed URL and checked against its sha256
(:mod:`daemon.providers.bootstrap`). This module finds that wheel, publishes it once, and
signs the URL each launch hands to its node.

Where the wheel comes from (:func:`own_wheel`), in this order:

1. ``daemon.agent_wheel``: a wheel file the operator built (``pip wheel --no-deps .``, a
   CI artifact); its version must be the daemon's.
2. The source tree the daemon runs from (an editable or in-place install, or a checkout
   on ``sys.path``): ``pip wheel --no-deps --no-build-isolation`` of that tree, with
   ``SOURCE_DATE_EPOCH`` fixed so the same code gives the same bytes (and the same key).
   A build takes 4 s on 2 idle cores and over 30 s on loaded ones, so it is kept in a
   per-user cache by the digest of the files it is built from (:func:`source_digest`):
   a daemon restarted on the same code (a crash, an HA takeover, a redeploy of the same
   commit) takes it from there. The cache is :func:`cache_dir`; one the daemon's user does
   not own, or that others can write, is not used (a wheel there runs on every node).
3. The installed distribution (``pip install spotvisor``): its files, as ``RECORD``
   lists them, packed back into a wheel (:func:`repack_installed`).

Why build rather than download: the nodes must run exactly the daemon's code (the agent
protocol changes with it), and a control node needs no index to publish it.

The object's key is content-addressed, ``agent/<sha256>/spotvisor-<version>-py3-none-any.whl``:
publishing is skipped when the store already holds that key with that size.

The agent installs with ``--no-deps`` plus :data:`AGENT_REQUIREMENTS`, the third-party
packages the agent process imports (tests/test_agent_wheel.py checks the agent imports
nothing else); never torch or transformers, which the image's own Python keeps.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import fcntl
import hashlib
import importlib.metadata
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import structlog
from botocore.config import Config

from daemon.providers.base import AgentWheelRef

__all__ = ["AGENT_REQUIREMENTS", "AgentWheelError", "Wheel", "AgentWheels", "own_wheel", "daemon_version",
           "repack_installed", "publish", "signed_url", "source_digest", "cache_dir", "KEY_PREFIX"]

log = structlog.get_logger("spotvisor.agent_wheel")

# What the agent process needs beyond the standard library and spotvisor's own packages
# (its imports: aiohttp for the daemon and the metadata endpoints, structlog, tenacity,
# pynvml for GPU samples). The specifiers are pyproject.toml's; the one list the
# bootstrap installs into the agent's own virtualenv.
AGENT_REQUIREMENTS: tuple[str, ...] = ("aiohttp>=3.9,<4", "structlog>=24.1", "tenacity>=9.2", "nvidia-ml-py>=12")

DIST = "spotvisor"
KEY_PREFIX = "agent"
_BUILD_TIMEOUT_S = 600.0
_REPRODUCIBLE_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry


class AgentWheelError(Exception):
    """The daemon cannot have, or publish, its agent wheel; the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class Wheel:
    """A wheel file of the daemon: ``path``, ``version``, ``sha256`` (hex of its bytes)."""

    path: Path
    version: str
    sha256: str

    @property
    def key(self) -> str:
        """Its key in a store: content-addressed, the wheel's own file name kept for pip."""
        return f"{KEY_PREFIX}/{self.sha256}/{self.path.name}"


def daemon_version() -> str:
    """This daemon's version (the installed ``spotvisor`` distribution's).

    Raises:
        AgentWheelError: spotvisor is not installed (run from a bare checkout).
    """
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise AgentWheelError("spotvisor is not installed (pip install -e . or pip install spotvisor), so the "
                              "daemon has no version for its agent wheel") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel_version(path: Path) -> str | None:
    """The version in a wheel's file name (``name-version-...whl``), None if it is not one."""
    parts = path.name[:-4].split("-") if path.name.endswith(".whl") else []
    return parts[1] if len(parts) >= 5 and parts[0].replace("_", "-").lower() == DIST else None


def _source_tree() -> Path | None:
    """The source tree this daemon runs from, or None (an installed wheel)."""
    try:
        direct = importlib.metadata.distribution(DIST).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        direct = None
    if direct:
        info = json.loads(direct)
        url = info.get("url", "")
        if "dir_info" in info and url.startswith("file://"):
            root = Path(url[len("file://"):])
            if (root / "pyproject.toml").is_file():
                return root
    import daemon  # a checkout on sys.path (python -m daemon... from the tree)

    root = Path(daemon.__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "daemon" / "gpunode").is_dir() and \
        "site-packages" not in root.parts else None


#: what a source build reads besides the packages (pyproject.toml's packages.find include)
_BUILD_INPUTS = ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "README.md", "LICENSE")
_PACKAGES = ("daemon", "trainer")


def source_digest(source: Path, version: str) -> str:
    """The sha256 (hex) of what a wheel of ``source`` is built from: ``version``, the build
    files (:data:`_BUILD_INPUTS`) and every file under the packages but ``__pycache__``,
    each as its path relative to ``source`` and its bytes. Blocking (about 170 files)."""
    h = hashlib.sha256(f"spotvisor-agent-wheel/1 {version}\n".encode())
    for f in _source_files(source):
        data = f.read_bytes()
        h.update(f"{f.relative_to(source).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _source_files(source: Path) -> list[Path]:
    """What a wheel of ``source`` is built from, sorted: the build files
    (:data:`_BUILD_INPUTS`) and every file under the packages but ``__pycache__``.

    Raises:
        OSError: ``source`` cannot be read.
    """
    files = [source / name for name in _BUILD_INPUTS if (source / name).is_file()]
    for pkg in _PACKAGES:
        files += [f for f in (source / pkg).rglob("*") if f.is_file() and "__pycache__" not in f.parts]
    return sorted(files)


def cache_dir() -> Path:
    """Where built agent wheels are kept between runs: ``$SPOTVISOR_CACHE_DIR``, else
    systemd's ``$CACHE_DIRECTORY`` (``CacheDirectory=``), else ``$XDG_CACHE_HOME/spotvisor``,
    else ``~/.cache/spotvisor``; its ``agent-wheels/`` folder."""
    base = os.environ.get("SPOTVISOR_CACHE_DIR") or os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "spotvisor")
    return Path(base) / "agent-wheels"


def _private_dir(path: Path) -> bool:
    """Make ``path`` (mode 0700) if missing; True if it is a directory this user owns that
    no one else can write. False on any OSError (read-only home, no permission)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _cached_build(source: Path, out_dir: Path, version: str) -> Path:
    """A wheel of ``source`` in ``out_dir``: from the cache when one was built from the same
    files (:func:`source_digest`), else built (once at a time per digest across processes:
    an ``flock``) and kept there. Without a usable cache, built into ``out_dir``."""
    cache = cache_dir()
    try:
        digest = source_digest(source, version)
    except OSError as exc:
        log.warning("agent_wheel_cache_skipped", reason=f"reading {source}: {exc}"[:300])
        return _build_from_source(source, out_dir)
    if not _private_dir(cache):
        log.warning("agent_wheel_cache_skipped", cache=str(cache), reason="not a directory of this user's alone")
        return _build_from_source(source, out_dir)
    try:
        hit = _kept(cache, digest, source)
    except OSError as exc:  # the cache failed under us (full disk, removed): build as without one
        log.warning("agent_wheel_cache_skipped", cache=str(cache), reason=str(exc)[:300])
        return _build_from_source(source, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / hit.name
    tmp = target.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(hit, tmp)  # the daemon's own copy: the cache may be cleaned while it runs
    except OSError:
        shutil.copyfile(hit, tmp)
    os.replace(tmp, target)
    return target


def _kept(cache: Path, digest: str, source: Path) -> Path:
    """The cached wheel of ``digest``, built into the cache first if it holds none (under an
    ``flock``: a second daemon building the same code waits and takes the first's wheel;
    an entry is a folder renamed into place whole, so a build cut off leaves none).

    Raises:
        OSError: the cache cannot be read or written.
        AgentWheelError: the build failed.
    """
    kept = cache / digest
    with open(cache / f"{digest}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            hits = sorted(kept.glob("*.whl")) if kept.is_dir() else []
            if len(hits) == 1:
                return hits[0]
            shutil.rmtree(kept, ignore_errors=True)
            tmp = cache / f"{digest}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            built = _build_from_source(source, tmp)
            os.replace(tmp, kept)
            return kept / built.name
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_from_source(source: Path, out_dir: Path) -> Path:
    """A wheel of ``source`` built in ``out_dir`` from a private copy of exactly the files
    :func:`source_digest` hashes: setuptools writes ``build/`` and ``*.egg-info`` into the
    tree it builds, so two builds of one checkout at once (two daemons, each with its own
    cache) would race there, a stale ``build/lib`` could put a deleted module into the
    wheel, and the user's checkout would get files it did not have."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tree, wheels = Path(tmp) / "src", Path(tmp) / "wheel"
        env = {**os.environ, "SOURCE_DATE_EPOCH": _REPRODUCIBLE_EPOCH, "PIP_NO_INDEX": "1"}
        try:
            for f in _source_files(source):
                copy = tree / f.relative_to(source)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(f, copy)  # the mode too: the wheel records it
            r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                                "--wheel-dir", str(wheels), str(tree)], env=env, capture_output=True, text=True,
                               timeout=_BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AgentWheelError(f"building the agent wheel from {source}: {exc}") from exc
        built = sorted(wheels.glob("*.whl"))
        if r.returncode != 0 or len(built) != 1:
            last = (r.stderr.strip().splitlines() or ["no wheel"])[-1][:300]
            raise AgentWheelError(f"building the agent wheel from {source} failed: {last} (set daemon.agent_wheel "
                                  "to a wheel built with `pip wheel --no-deps .`)")
        target = out_dir / built[0].name
        os.replace(built[0], target)
    return target


def _tag(wheel_meta: str) -> str:
    """The compressed tag set of a wheel's file name from its WHEEL file's ``Tag:`` lines."""
    tags = [line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")]
    if not tags:
        return "py3-none-any"
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    return "-".join(".".join(p) for p in parts)


def repack_installed(name: str, out_dir: Path) -> Path:
    """The installed distribution ``name`` packed back into a wheel in ``out_dir``: its
    files as its ``RECORD`` lists them (under its site-packages only: console scripts are
    made again by pip from ``entry_points.txt``; no ``__pycache__``), a new ``RECORD``
    (PEP 376/427: ``path,sha256=<urlsafe b64>,size``). Blocking.

    Raises:
        AgentWheelError: not installed, or a listed file cannot be read.
    """
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise AgentWheelError(f"{name} is not installed, so there is no distribution to pack") from None
    files = dist.files or []
    info_dir = next((f.parts[0] for f in files if f.parts[0].endswith(".dist-info")), None)
    if info_dir is None:
        raise AgentWheelError(f"{name}: no .dist-info in its RECORD (installed another way: set daemon.agent_wheel)")
    skip = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    wheel_meta = dist.read_text("WHEEL") or ""
    norm = dist.metadata["Name"].replace("-", "_")
    target = out_dir / f"{norm}-{dist.version}-{_tag(wheel_meta)}.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    tmp = target.with_suffix(".tmp")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for f in sorted(files, key=str):
                rel = f.as_posix()
                if rel.startswith("..") or "__pycache__" in f.parts or \
                        (f.parts[0] == info_dir and f.name in skip):
                    continue
                data = Path(dist.locate_file(f)).read_bytes()
                z.writestr(zipfile.ZipInfo(rel, date_time=(1980, 1, 1, 0, 0, 0)), data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                writer.writerow([rel, f"sha256={digest}", len(data)])
            writer.writerow([f"{info_dir}/RECORD", "", ""])
            z.writestr(zipfile.ZipInfo(f"{info_dir}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)), record.getvalue())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise AgentWheelError(f"packing the installed {name} into a wheel: {exc}") from exc
    return target


#: the wheels this process made, by (configured, out_dir, version): an HA standby builds its
#: wheel while it waits (daemon/interfaces/cli.py), and the leader it becomes takes it from here
_MADE: dict[tuple[str | None, str, str], Wheel] = {}
_MAKING = threading.Lock()


def own_wheel(configured: str | None, out_dir: Path) -> Wheel:
    """The daemon's own wheel (see the module's docstring for where it comes from). Blocking
    (a build takes seconds, 4 s on 2 idle cores and over 30 s on loaded ones); ``out_dir``:
    where a built wheel is kept. Made once per process for the same arguments.

    Raises:
        AgentWheelError: no wheel can be had, or ``configured`` is not this daemon's version.
    """
    version = daemon_version()
    with _MAKING:  # one build at a time: a second caller takes the first one's wheel
        made = _MADE.get((configured, str(out_dir), version))
        if made is not None and made.path.is_file():
            return made
        wheel = _own_wheel(configured, out_dir, version)
        _MADE[(configured, str(out_dir), version)] = wheel
        return wheel


def _own_wheel(configured: str | None, out_dir: Path, version: str) -> Wheel:
    if configured:
        path = Path(os.path.expanduser(configured))
        if not path.is_file():
            raise AgentWheelError(f"daemon.agent_wheel: {path}: no such file (build one with `pip wheel --no-deps .`)")
        if _wheel_version(path) != version:
            raise AgentWheelError(f"daemon.agent_wheel: {path.name} is not spotvisor {version}, the daemon's version "
                                  "(the nodes must run the daemon's own code: build the wheel from this install)")
    else:
        source = _source_tree()
        path = _cached_build(source, out_dir, version) if source is not None else repack_installed(DIST, out_dir)
        if _wheel_version(path) != version:
            raise AgentWheelError(f"the agent wheel built from {source or 'the installed spotvisor'} is "
                                  f"{path.name}, not spotvisor {version} (reinstall: pip install -e .)")
    return Wheel(path=path, version=version, sha256=_sha256(path))


def publish(store: Any, wheel: Wheel) -> bool:
    """Put ``wheel`` at its key in ``store`` (a :class:`trainer.storage.CheckpointStore`),
    unless the store holds that key with its size already. Blocking. True if uploaded.

    Raises:
        trainer.storage.StorageError: the store failed.
    """
    size = wheel.path.stat().st_size
    if store.list(wheel.key).get(wheel.key) == size:
        return False
    store.put_file(wheel.key, wheel.path)
    return True


def signed_url(store: Any, key: str, expires_s: int) -> str:
    """A URL a node can GET ``key`` of ``store`` from, without credentials, for ``expires_s``
    seconds: S3 a presigned GET (SigV4, boto3 ``generate_presigned_url``), OSS a signed URL
    (``oss2.Bucket.sign_url``), a file store the object's ``file://`` URI (a node on the
    same machine or file system; no expiry). Blocking only for credential look-ups.

    Raises:
        AgentWheelError: a store this module cannot sign for, or the signing failed.
    """
    from trainer.storage import FileStore, S3Store

    try:
        if isinstance(store, FileStore):
            return store._path(key).as_uri()
        if isinstance(store, S3Store):
            # SigV4 (boto3 would sign a presigned URL with SigV2 in us-east-1, which regions
            # opened since 2014 refuse), in the region of the store's client: a presigned
            # URL is not redirected to the bucket's region as the SDK's own calls are
            client = store._client  # type: ignore[attr-defined]
            signer = boto3.client("s3", region_name=client.meta.region_name, endpoint_url=store.endpoint_url,
                                  config=Config(signature_version="s3v4"))
            return signer.generate_presigned_url(
                "get_object", Params={"Bucket": store.bucket, "Key": store._key(key)}, ExpiresIn=expires_s)
        from trainer.oss_store import OssStore

        if isinstance(store, OssStore):
            return store._bucket.sign_url("GET", store._key(key), expires_s, slash_safe=True)
    except AgentWheelError:
        raise
    except Exception as exc:  # noqa: BLE001 - an SDK's credential or signing error, for the operator
        raise AgentWheelError(f"signing a URL for {store.uri}/{key}: {type(exc).__name__}: {exc}") from exc
    raise AgentWheelError(f"cannot sign a URL for {store!r}")


class AgentWheels:
    """The daemon's agent wheel, published once per store, and a signed URL per launch.

    ``configured``: ``daemon.agent_wheel``; ``work_dir``: where a built wheel is kept;
    ``open_store(domain) -> (uri, store)``: the domain's checkpoint store; ``expires_s``: a
    URL's lifetime (a bit over the launch timeout: the node fetches it while booting).
    Constructor does no I/O. A failure is not remembered: the next launch tries again.
    """

    def __init__(self, *, configured: str | None, work_dir: Path, open_store: Any, expires_s: int) -> None:
        self.configured, self.work_dir, self.expires_s = configured, work_dir, expires_s
        self._open_store = open_store
        self._wheel: Wheel | None = None
        self._published: dict[str, Any] = {}  # store uri -> the store, published there
        self._lock = asyncio.Lock()

    async def ref(self, domain: str) -> AgentWheelRef:
        """The wheel for a node of ``domain``: published there first (once), then signed.

        Raises:
            AgentWheelError: no wheel, the store refused it, or the URL cannot be signed.
        """
        async with self._lock:  # one build and one upload, whatever the number of launches waiting
            if self._wheel is None:
                self._wheel = await asyncio.to_thread(own_wheel, self.configured, self.work_dir)
                log.info("agent_wheel_ready", wheel=self._wheel.path.name, sha256=self._wheel.sha256)
            wheel = self._wheel
            uri, store = await asyncio.to_thread(self._open_store, domain)
            if uri not in self._published:
                from trainer.storage import StorageError

                try:
                    uploaded = await asyncio.to_thread(publish, store, wheel)
                except (StorageError, OSError) as exc:
                    raise AgentWheelError(f"publishing the agent wheel to {uri}: {exc}"[:500]) from exc
                self._published[uri] = store
                log.info("agent_wheel_published", store=uri, key=wheel.key, uploaded=uploaded)
        url = await asyncio.to_thread(signed_url, store, wheel.key, self.expires_s)
        return AgentWheelRef(url=url, sha256=wheel.sha256, version=wheel.version)
