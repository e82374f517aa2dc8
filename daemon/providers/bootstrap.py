"""The node bootstrap every cloud instance runs at first boot (its user-data).

A cloud-init shell script: it writes the agent's environment file (daemon URL,
node id, the node's own token, the metadata dialect) with mode 0600 and starts
``spotvisor-agent.service`` (``systemd/spotvisor-agent.service``). The image is
expected to have spotvisor installed (``pip install spotvisor``); the script
installs it only if the command is missing.

The token is a per-node secret: it is in the user-data (which only the instance
and the account can read), never in a log line or an event.
"""

from __future__ import annotations

import shlex

from daemon.providers.base import NodeSpec

__all__ = ["render_user_data"]

_TEMPLATE = """#!/bin/bash
# spotvisor node bootstrap for {node_id} (pool {pool})
set -euo pipefail
install -d -m 0700 /etc/spotvisor
umask 077
cat > /etc/spotvisor/agent.env <<'SPOTVISOR_ENV'
SPOTVISOR_DAEMON_URL={daemon_url}
SPOTVISOR_NODE_ID={node_id}
SPOTVISOR_AGENT_TOKEN={token}
SPOTVISOR_METADATA_DIALECT={dialect}
SPOTVISOR_ENV
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
    return _TEMPLATE.format(**fields)
