"""What ``job.env`` and ``job.secrets`` may say: names and secret sources, checked. Pure.

A job's environment reaches its trainer on every node (:mod:`daemon.controlnode.jobspec`,
:mod:`daemon.gpunode.trainer_process`). Two kinds of entries:

- ``job.env: {NAME: value}``: plain settings, written in the config as they are.
- ``job.secrets: {NAME: SOURCE}``: the value is read by the daemon when it starts
  (:mod:`daemon.controlnode.job_secrets`) from ``SOURCE``, one of::

      file:/ABS/PATH            the whole file (one trailing newline dropped)
      file:/ABS/PATH#KEY        the KEY=value line of that file (an EnvironmentFile / .env file)
      ssm:/NAME                 AWS SSM Parameter Store, GetParameter WithDecryption (a name or ARN)
      secretsmanager:NAME       AWS Secrets Manager, GetSecretValue (a name or ARN)
      secretsmanager:NAME#KEY   ... the KEY field of the secret's JSON
      kms:NAME                  Alibaba Cloud KMS secret, GetSecretValue (API 2016-01-20)
      kms:NAME#KEY              ... the KEY field of the secret's JSON

  A cloud source takes ``?region=REGION`` before any ``#KEY``
  (``ssm:/team/hf-token?region=us-west-2``); without it, the region of the config's first
  placement domain of that cloud. ``?`` and ``#`` appear in no SSM, Secrets Manager or KMS
  secret name, so they are free to delimit.

A NAME is a POSIX environment name (``[A-Za-z_][A-Za-z0-9_]*``) and not one of
:data:`RESERVED_ENV` (what spotvisor and torchrun set and rely on) nor a
:data:`RESERVED_PREFIXES` name. ``OMP_NUM_THREADS`` is the job's to tune: spotvisor's ``1``
is a default ``job.env`` may override.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["SecretRef", "parse_secret_ref", "check_env_name", "RESERVED_ENV", "RESERVED_PREFIXES",
           "SCHEMES", "MAX_SECRET_BYTES"]

SCHEMES = ("file", "ssm", "secretsmanager", "kms")
Scheme = Literal["file", "ssm", "secretsmanager", "kms"]

# a resolved secret's value, at most (bytes of UTF-8): Secrets Manager's own cap (SecretString,
# 65,536), and half of what Linux lets one NAME=value string of an exec's environment be
# (MAX_ARG_STRLEN, 131,072)
MAX_SECRET_BYTES = 65536

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_REGION = re.compile(r"^[a-z0-9-]{1,40}$")

# set by spotvisor's daemon or agent (daemon/controlnode/jobspec.py, daemon/gpunode/trainer_process.py,
# trainer/contract.py) or by torchrun for each worker (torch.distributed.run: "Environment
# variables" of https://pytorch.org/docs/stable/elastic/run.html); the job reads them, never sets them
RESERVED_ENV = frozenset({
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "PYTHONUNBUFFERED",
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})
RESERVED_PREFIXES = ("SPOTVISOR_", "TORCHELASTIC_")


def check_env_name(name: str) -> str | None:
    """Why ``name`` cannot be a ``job.env`` / ``job.secrets`` name (one line with the fix), or None."""
    if not _NAME.match(name):
        return f"{name!r} is not an environment variable name (letters, digits and _, not starting with a digit)"
    if name in RESERVED_ENV or name.startswith(RESERVED_PREFIXES):
        return (f"{name} is set by spotvisor or torchrun for every worker (reserved: "
                f"{', '.join(p + '*' for p in RESERVED_PREFIXES)}, {', '.join(sorted(RESERVED_ENV))}); rename it")
    return None


@dataclass(frozen=True, slots=True)
class SecretRef:
    """One parsed secret source. ``ref``: the file path (absolute) or the secret's name or
    ARN; ``key``: the line (file) or JSON field (secretsmanager, kms) to take, None: the
    whole value; ``region``: given with ``?region=``, else None (the config's)."""

    scheme: Scheme
    ref: str
    key: str | None = None
    region: str | None = None

    def __str__(self) -> str:
        """The source as written (never a value: safe to show)."""
        region = f"?region={self.region}" if self.region else ""
        key = f"#{self.key}" if self.key is not None else ""
        return f"{self.scheme}:{self.ref}{region}{key}"


_FIX = ("write file:/abs/path[#KEY], ssm:/name[?region=R], secretsmanager:name[?region=R][#KEY] "
        "or kms:name[?region=R][#KEY]")


def parse_secret_ref(text: str) -> SecretRef:
    """Read ``SOURCE`` (the module docstring). Raises ValueError: one line naming the fix."""
    scheme, sep, rest = text.partition(":")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"{text[:80]!r} names no secret source ({_FIX})")
    rest, hashed, key = rest.partition("#")
    if hashed and not key:
        raise ValueError(f"{text[:80]!r}: nothing after '#' (name the key, or drop the '#')")
    region: str | None = None
    if "?" in rest:
        if scheme == "file":
            raise ValueError(f"{text[:80]!r}: a file source takes no ?region= (remove it)")
        rest, _, query = rest.partition("?")
        name, eq, region = query.partition("=")
        if name != "region" or not eq or not _REGION.match(region):
            raise ValueError(f"{text[:80]!r}: the only option is ?region=REGION, e.g. ?region=us-west-2")
    if not rest or any(c.isspace() for c in rest) or "\0" in rest:
        raise ValueError(f"{text[:80]!r}: the {scheme} source names no {('path' if scheme == 'file' else 'secret')} "
                         f"or has white space in it ({_FIX})")
    if scheme == "file" and not rest.startswith("/"):
        raise ValueError(f"{text[:80]!r}: the path must be absolute (e.g. file:/etc/spotvisor/job.env#HF_TOKEN)")
    if scheme == "ssm" and hashed:
        raise ValueError(f"{text[:80]!r}: an SSM parameter holds one value, no #KEY (remove it)")
    if scheme == "file" and hashed and not _NAME.match(key):
        raise ValueError(f"{text[:80]!r}: #{key} is not a variable name of the file")
    return SecretRef(scheme=scheme, ref=rest, key=key if hashed else None, region=region)  # type: ignore[arg-type]
