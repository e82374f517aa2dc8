"""The node bootstrap every cloud instance runs at first boot (its user-data).

A cloud-init shell script (root, bash). It writes the agent's environment file (daemon
URL, node id, the node's own token, the metadata dialect) with mode 0600, installs the
agent when the node has a wheel to install (``NodeSpec.agent_wheel``, published by the
daemon: :mod:`daemon.providers.agent_wheel`), and starts ``spotvisor-agent.service``.

The install, for a stock image (AWS Deep Learning AMI, Alibaba's GPU images):

1. the ``spotvisor`` system user, if missing (``useradd --system``);
2. skipped from here if ``/usr/local/bin/spotvisor-agent --version`` already says the
   daemon's version (a baked image, or a second run);
3. the wheel, fetched from its signed URL (``curl``, else the image's ``python3``
   ``urllib``; a ``file://`` URL is copied) and checked against its sha256: on a
   mismatch the script exits 1 before anything is installed;
4. a virtualenv of its own, :data:`VENV` (``python -m venv`` of the first Python >= 3.11
   with ``venv`` and ``ensurepip`` among ``python3``, ``python3.13`` .. ``python3.11``,
   ``/opt/conda/bin/python3``, ``/opt/pytorch/bin/python3``), the wheel with
   ``--no-deps`` and then :data:`~daemon.providers.agent_wheel.AGENT_REQUIREMENTS` only
   (no torch); pip's own settings (``/etc/pip.conf``, ``PIP_*``) apply, so a mirror works;
5. ``/usr/local/bin/spotvisor-agent`` linked to the venv's, the unit installed from the
   package (``daemon/gpunode/spotvisor-agent.service``, a copy of
   ``systemd/spotvisor-agent.service``), and only ``trainer/`` of the wheel extracted
   into :data:`TRAINER_PYTHONPATH` for a trainer on the image's Python (``job.python``;
   the agent puts it on that trainer's ``PYTHONPATH``: :mod:`daemon.gpunode.trainer_process`).

The image's Python, its packages and its torch are never written to.

``$SPOTVISOR_ROOT`` (empty on a node) prefixes every path the script writes, so a test
runs it as it is under a directory of its own.

With an ``https://`` daemon URL the node gets the daemon's CA certificate
(``NodeSpec.ca_cert_pem``, :mod:`daemon.controlnode.tls`): the script writes it to
:data:`CA_FILE` (0644: a certificate is public; the agent runs as ``spotvisor``) and
names it in the environment file as ``SPOTVISOR_DAEMON_CA_FILE``, which the agent
reads as its ``--ca-file``: it then trusts that CA only.

The token is a per-node secret: it is in the user-data (which only the instance
and the account can read), never in a log line or an event. So is the wheel's signed
URL, which expires (a bit after the launch timeout).
"""

from __future__ import annotations

import re
import shlex

from daemon.providers.base import NodeSpec
from trainer.contract import TRAINER_PYTHONPATH_ENV
from daemon.providers.scratch import scratch_snippet

__all__ = ["render_user_data", "CA_FILE", "VENV", "TRAINER_PYTHONPATH", "AGENT_BIN", "MAX_USER_DATA_BYTES"]

CA_FILE = "/etc/spotvisor/daemon-ca.pem"
VENV = "/opt/spotvisor/venv"
TRAINER_PYTHONPATH = "/opt/spotvisor/pythonpath"
AGENT_BIN = "/usr/local/bin/spotvisor-agent"  # systemd/spotvisor-agent.service's ExecStart
# EC2 takes at most 16 KiB of user data before base64 (RunInstances UserData,
# https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/user-data.html); Alibaba 32 KiB
# after it (RunInstances UserData, https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-runinstances),
# which 16 KiB (21.4 KiB in base64) keeps too
MAX_USER_DATA_BYTES = 16 * 1024
# PEM certificates only: the CA goes into the script through a quoted here-document
_PEM_CERTS = re.compile(r"(-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]+-----END CERTIFICATE-----\n?)+")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_VERSION = re.compile(r"^[0-9A-Za-z.+!_-]{1,64}$")

_TEMPLATE = """#!/bin/bash
# spotvisor node bootstrap for {node_id} (pool {pool})
set -euo pipefail
R="${{SPOTVISOR_ROOT:-}}"
install -d -m {etc_mode} "$R/etc/spotvisor"
umask 077
{ca_block}cat > "$R/etc/spotvisor/agent.env" <<'SPOTVISOR_ENV'
SPOTVISOR_DAEMON_URL={daemon_url}
SPOTVISOR_NODE_ID={node_id}
SPOTVISOR_AGENT_TOKEN={token}
SPOTVISOR_METADATA_DIALECT={dialect}
{ca_env}{extra_env}SPOTVISOR_ENV
umask 022
{install_block}{scratch}systemctl daemon-reload
systemctl enable --now spotvisor-agent.service
"""

_NO_INSTALL = r"""command -v spotvisor-agent >/dev/null || {{ echo "spotvisor bootstrap: no spotvisor-agent on this image \
and no agent wheel to install" >&2; exit 1; }}
"""

# {url}, {sha}, {version}: shell-quoted; {requirements}: shell-quoted words
_INSTALL = r"""say() {{ echo "spotvisor bootstrap: $*" >&2; }}
getent passwd spotvisor >/dev/null || useradd --system --user-group --no-create-home \
  --home-dir /var/lib/spotvisor-agent --shell /usr/sbin/nologin spotvisor
V={version}
if [ "$("$R{agent_bin}" --version 2>/dev/null || true)" = "spotvisor-agent $V" ]; then
  say "spotvisor-agent $V is installed: skipping the install"
else
  URL={url}
  SHA={sha}
  T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
  W="$T/spotvisor-$V-py3-none-any.whl"
  case "$URL" in
    file://*) cp -- "${{URL#file://}}" "$W" ;;
    *) if command -v curl >/dev/null; then
         curl -fsS --retry 5 --retry-connrefused --max-time 300 -o "$W" "$URL"
       else
         python3 -c 'import sys, urllib.request as u; u.urlretrieve(sys.argv[1], sys.argv[2])' "$URL" "$W"
       fi ;;
  esac
  GOT="$(sha256sum "$W" | cut -d' ' -f1)"
  [ "$GOT" = "$SHA" ] || {{ say "agent wheel sha256 $GOT, expected $SHA: refusing to install it"; exit 1; }}
  find_py() {{
    for c in python3 python3.13 python3.12 python3.11 /opt/conda/bin/python3 /opt/pytorch/bin/python3; do
      if command -v "$c" >/dev/null && "$c" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' \
          2>/dev/null; then echo "$c"; return 0; fi
    done
    return 1
  }}
  PY="$(find_py || true)"
  # Ubuntu's own python3 (24.04: 3.12) ships venv's ensurepip in a separate package
  if [ -z "$PY" ] && command -v apt-get >/dev/null \
      && python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "installing python3-venv for the agent's own virtualenv"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv >&2 || true
    PY="$(find_py || true)"
  fi
  [ -n "$PY" ] || {{ say "no Python >= 3.11 with venv and ensurepip on this image (Ubuntu 24.04 images have one)"; exit 1; }}
  VE="$R{venv}"
  rm -rf "$VE"
  "$PY" -m venv "$VE"
  "$VE/bin/python" -m pip install --quiet --no-deps "$W"
  "$VE/bin/python" -m pip install --quiet {requirements}
  P="$R{pythonpath}"
  rm -rf "$P"
  "$VE/bin/python" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("trainer/")])' "$W" "$P"
  install -d "$R/etc/systemd/system" "$R$(dirname {agent_bin})"
  "$VE/bin/python" -c 'import importlib.resources as r
print(r.files("daemon.gpunode").joinpath("spotvisor-agent.service").read_text(), end="")' \
    > "$R/etc/systemd/system/spotvisor-agent.service"
  chmod 0644 "$R/etc/systemd/system/spotvisor-agent.service"
  ln -sfn "$VE/bin/spotvisor-agent" "$R{agent_bin}"
  say "installed spotvisor-agent $V in {venv}"
fi
"""


def _install_block(node: NodeSpec) -> str:
    from daemon.providers.agent_wheel import AGENT_REQUIREMENTS

    w = node.agent_wheel
    if w is None:
        return _NO_INSTALL.format()
    if not _SHA256.fullmatch(w.sha256):
        raise ValueError(f"node bootstrap: agent_wheel.sha256={w.sha256!r} is not a sha256 (64 hex digits)")
    if not _VERSION.fullmatch(w.version):
        raise ValueError(f"node bootstrap: agent_wheel.version={w.version!r} is not a version")
    if not w.url.startswith(("https://", "http://", "file:///")) or any(c in w.url for c in "\n\r\0"):
        raise ValueError("node bootstrap: agent_wheel.url must be an https://, http:// or file:/// URL on one line")
    return _INSTALL.format(url=shlex.quote(w.url), sha=w.sha256, version=shlex.quote(w.version),
                           requirements=" ".join(shlex.quote(r) for r in AGENT_REQUIREMENTS),
                           venv=VENV, pythonpath=TRAINER_PYTHONPATH, agent_bin=AGENT_BIN)


def render_user_data(node: NodeSpec, *, dialect: str, scratch: bool = False) -> str:
    """The user-data script (text, at most :data:`MAX_USER_DATA_BYTES`: EC2's limit) that
    installs (with ``node.agent_wheel``) and starts this node's agent.
    ``scratch``: first make the instance-store NVMe disks its checkpoint scratch
    (:func:`daemon.providers.scratch.scratch_snippet`).

    Raises:
        ValueError: a field holds characters that cannot go in an env file line, the
            wheel's reference is malformed, or the script is over the size limit.
    """
    fields = {"daemon_url": node.daemon_url, "node_id": node.node_id, "token": node.token,
              "dialect": dialect, "pool": node.pool}
    for name, value in fields.items():
        if not value or any(c in value for c in "\n\r'\"$`\\ ") or shlex.quote(value) != value:
            raise ValueError(f"node bootstrap: {name}={value!r} cannot go into the agent's env file")
    ca = None if node.ca_cert_pem is None else node.ca_cert_pem.replace("\r\n", "\n")
    if ca is not None and not _PEM_CERTS.fullmatch(ca.strip() + "\n"):
        raise ValueError("node bootstrap: ca_cert_pem is not PEM certificates (BEGIN/END CERTIFICATE blocks)")
    # the agent (user spotvisor) reads the CA file there; agent.env stays 0600, root's
    ca_block = "" if ca is None else (f"cat > \"$R{CA_FILE}\" <<'SPOTVISOR_CA'\n{ca.strip()}\nSPOTVISOR_CA\n"
                                      f"chmod 0644 \"$R{CA_FILE}\"\n")
    ca_env = "" if ca is None else f"SPOTVISOR_DAEMON_CA_FILE={CA_FILE}\n"
    extra_env = "" if node.agent_wheel is None else f"{TRAINER_PYTHONPATH_ENV}={TRAINER_PYTHONPATH}\n"
    script = _TEMPLATE.format(**fields, etc_mode="0700" if ca is None else "0755", ca_block=ca_block, ca_env=ca_env,
                              extra_env=extra_env, install_block=_install_block(node),
                              scratch=scratch_snippet() if scratch else "")
    if len(script.encode()) > MAX_USER_DATA_BYTES:
        raise ValueError(f"node bootstrap: the user data is {len(script.encode())} bytes, over EC2's "
                         f"{MAX_USER_DATA_BYTES} (a CA bundle or URL too long)")
    return script
