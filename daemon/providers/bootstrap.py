"""The node bootstrap every cloud instance runs at first boot (its user-data).

A cloud-init shell script: it writes the agent's environment file (daemon URL,
node id, the node's own token, the metadata dialect) with mode 0600 and starts
``spotvisor-agent.service`` (``systemd/spotvisor-agent.service``). The image is
expected to have spotvisor installed (``pip install spotvisor``); the script
installs it only if the command is missing.

With an ``https://`` daemon URL the node gets the daemon's CA certificate
(``NodeSpec.ca_cert_pem``, :mod:`daemon.controlnode.tls`): the script writes it to
:data:`CA_FILE` (0644: a certificate is public; the agent runs as ``spotvisor``) and
names it in the environment file as ``SPOTVISOR_DAEMON_CA_FILE``, which the agent
reads as its ``--ca-file``: it then trusts that CA only.

The token is a per-node secret: it is in the user-data (which only the instance
and the account can read), never in a log line or an event.
"""

from __future__ import annotations

import re
import shlex

from daemon.providers.base import NodeSpec

__all__ = ["render_user_data", "CA_FILE"]

CA_FILE = "/etc/spotvisor/daemon-ca.pem"
# PEM certificates only: the CA goes into the script through a quoted here-document
_PEM_CERTS = re.compile(r"(-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]+-----END CERTIFICATE-----\n?)+")

_TEMPLATE = """#!/bin/bash
# spotvisor node bootstrap for {node_id} (pool {pool})
set -euo pipefail
install -d -m {etc_mode} /etc/spotvisor
umask 077
{ca_block}cat > /etc/spotvisor/agent.env <<'SPOTVISOR_ENV'
SPOTVISOR_DAEMON_URL={daemon_url}
SPOTVISOR_NODE_ID={node_id}
SPOTVISOR_AGENT_TOKEN={token}
SPOTVISOR_METADATA_DIALECT={dialect}
{ca_env}SPOTVISOR_ENV
command -v spotvisor-agent >/dev/null || python3 -m pip install --quiet spotvisor
systemctl daemon-reload
systemctl enable --now spotvisor-agent.service
"""


def render_user_data(node: NodeSpec, *, dialect: str) -> str:
    """The user-data script (text, < 16 KiB: EC2's limit) that starts this node's agent.

    Raises:
        ValueError: a field holds characters that cannot go in an env file line.
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
    ca_block = "" if ca is None else (f"cat > {CA_FILE} <<'SPOTVISOR_CA'\n{ca.strip()}\nSPOTVISOR_CA\n"
                                      f"chmod 0644 {CA_FILE}\n")
    ca_env = "" if ca is None else f"SPOTVISOR_DAEMON_CA_FILE={CA_FILE}\n"
    return _TEMPLATE.format(**fields, etc_mode="0700" if ca is None else "0755", ca_block=ca_block, ca_env=ca_env)
