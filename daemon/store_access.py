"""Whether the nodes of each cloud placement domain can read and write its checkpoint store.

The control node proves its own access to each store (``spotvisord check`` puts a probe
object, reads it back and deletes it: :mod:`daemon.controlnode.cloud_probe`). A node has
other credentials: what its launch gives it (an instance profile, an instance RAM role)
and what ``job.secrets`` / ``job.env`` put in its workers' environment. A node with none
is bought, boots, trains, and fails its first commit; its interruption notice then has
nothing to commit to. :func:`store_access_problem` judges that from the config alone,
before anything is bought; ``check-config``, ``check``, ``run`` and ``demo`` refuse a
config it finds a problem in (exit 2, one line naming the field and the fix).

What each store's client reads on a node (the trainer's :func:`trainer.checkpoint.open_store`):

- ``s3://``: boto3's default chain (https://docs.aws.amazon.com/boto3/latest/guide/credentials.html):
  ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` in the environment, else, on EC2, the
  instance profile's role through the instance metadata service. boto3 knows nothing
  of an ECS instance's RAM role: an Alibaba node needs the keys.
- ``oss://``: oss2 (:mod:`trainer.oss_store`): ``OSS_ACCESS_KEY_ID`` and
  ``OSS_ACCESS_KEY_SECRET`` in the environment, else the domain's ``launch.ram_role``
  (Alibaba's instance metadata service; an EC2 node has none).
- ``file://``: the node's own disk, which no other node reads, unless the path is a
  network filesystem mounted at the same path on the control node and on every node
  (NFS, EFS, Alibaba NAS, Lustre, a FUSE mount of a bucket): the daemon reads each
  commit's manifest there before it counts (``daemon.verify_commits``), so the control
  node's own mount is what is judged (:func:`mount_type`, the one function here that
  reads the machine).

Nothing here proves that the credentials work (a role without the permission, a wrong
key): the first commit does, and the control node's probe proves the bucket exists. A
credential baked into an image cannot be seen from the config, so it does not count.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from daemon.config import Config, Domain

__all__ = ["store_access_problem", "mount_type", "NETWORK_FILESYSTEMS"]

#: the environment variables each store's client takes a key pair from on a node
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
OSS_KEYS = ("OSS_ACCESS_KEY_ID", "OSS_ACCESS_KEY_SECRET")

#: filesystem types (``/proc/self/mounts``' third field) whose files other machines see
#: too; a ``fuse.*`` mount (s3fs, ossfs, JuiceFS, sshfs, ...) counts as one
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "ceph", "glusterfs", "beegfs", "gpfs",
                                 "orangefs", "fuse"})


def store_access_problem(config: Config, faked: Iterable[str] = (),
                         fs_type: Callable[[str], str | None] = lambda path: None) -> str | None:
    """Why the nodes of a cloud domain could not read and write its checkpoint store (one
    line: the config field, what is missing, the fix), or None when every domain's nodes
    have credentials for theirs. Pure.

    ``faked``: the clouds whose "instances" run on this machine (a local fake's endpoint,
    as :func:`daemon.config.loopback_problem` takes them): their nodes have this
    machine's environment and disk, and are not judged; nor is the ``local`` provider's.
    ``fs_type``: the filesystem type of a path on the control node (:func:`mount_type`;
    None: unknown, which does not count as a network filesystem).
    """
    faked = set(faked)
    if config.providers.aws is not None and config.providers.aws.endpoint_url:
        faked.add("aws")
    if config.providers.aliyun is not None and config.providers.aliyun.endpoint:
        faked.add("aliyun")
    given = set(config.job.secrets) | set(config.job.env)
    for d in config.domains_resolved():
        if d.provider == "local" or d.provider in faked:
            continue
        problem = _domain_problem(config, d, given, fs_type)
        if problem is not None:
            return problem
    return None


def _domain_problem(config: Config, d: Domain, given: set[str], fs_type: Callable[[str], str | None]) -> str | None:
    uri = config.checkpoint_uri(d.name)
    scheme = uri.split("://", 1)[0]
    nodes = f"the {d.provider} nodes of domain {d.name!r}"
    has_aws_keys, has_oss_keys = set(AWS_KEYS) <= given, set(OSS_KEYS) <= given
    if scheme == "file":
        path = uri.split("://", 1)[1]
        kind = fs_type(path)
        if kind is not None and (kind in NETWORK_FILESYSTEMS or kind.startswith("fuse.")):
            return None
        field = (f"domains.{d.index}.checkpoint_uri" if d.index is not None
                 and config.domains[d.index].checkpoint_uri is not None else "job.checkpoint_uri")
        store = "s3://bucket/prefix" if d.provider == "aws" else "oss://bucket/prefix with oss_endpoint"
        return (f"{field}: {uri} is each {d.provider} node's own disk in domain {d.name!r} ({kind or 'unknown'} on "
                "the control node, not a network filesystem): no replacement node, and not the daemon, which verifies "
                f"every commit, can read a checkpoint another node wrote; use {store}, or a network filesystem "
                "mounted at that path on the control node and (job.setup) on every node")
    role_field = "iam_instance_profile" if d.provider == "aws" else "ram_role"
    role = _launch_value(config, d, role_field)
    if scheme == "s3" and not has_aws_keys and not (d.provider == "aws" and role):
        if d.provider == "aws":
            return (f"{config.launch_field(d, role_field)}: {nodes} have no credentials for {uri}: give them an "
                    "instance profile whose role may s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket "
                    f"there, or put {' and '.join(AWS_KEYS)} in job.secrets")
        return (f"job.secrets: {nodes} reach {uri} with boto3, which cannot use an instance RAM role: put "
                f"{' and '.join(AWS_KEYS)} (an AccessKey allowed on the bucket) in job.secrets, or use "
                "oss://bucket/prefix with oss_endpoint, which the domain's launch.ram_role serves")
    if scheme == "oss" and not has_oss_keys and not (d.provider == "aliyun" and role):
        if d.provider == "aliyun":
            return (f"{config.launch_field(d, role_field)}: {nodes} have no credentials for {uri}: give them an "
                    "instance RAM role allowed oss:GetObject, oss:PutObject, oss:DeleteObject and oss:ListObjects "
                    f"on the bucket, or put {' and '.join(OSS_KEYS)} in job.secrets")
        return (f"job.secrets: {nodes} have no credentials for {uri} (an instance profile does not sign OSS "
                f"requests): put {' and '.join(OSS_KEYS)} in job.secrets")
    return None


def _launch_value(config: Config, d: Domain, name: str) -> str | None:
    """The domain's launch field ``name``, or None (also when the launch spec is incomplete:
    another check names what it lacks)."""
    try:
        return getattr(config.launch_spec(d), name, None)
    except (ValueError, KeyError):
        return None


def mount_type(path: str, mounts: str | None = None) -> str | None:
    """The filesystem type of the mount holding ``path`` on this machine (its deepest
    existing ancestor's), from ``mounts`` (``/proc/self/mounts``' text; read when None), or
    None when it cannot be told (no such file: not Linux). Blocking, small."""
    if mounts is None:
        try:
            with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
                mounts = f.read()
        except OSError:
            return None
    target = os.path.abspath(path)
    while not os.path.exists(target) and target != os.path.dirname(target):
        target = os.path.dirname(target)
    target = os.path.realpath(target)
    best, kind = -1, None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # the kernel writes a space, tab, newline and backslash in a mount point as octal escapes
        point = (fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
                 .replace("\\134", "\\"))
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # the last of equal mount points is the one on top
            best, kind = len(point), fields[2]
    return kind
