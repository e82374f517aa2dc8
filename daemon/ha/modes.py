"""What each control-plane mode survives, as ``spotvisord check-config`` prints it. Pure
(no etcd client import: the embedded mode needs none)."""

from __future__ import annotations

from typing import Any

__all__ = ["MIN_SAFE_LEASE_S", "survival"]

#: below this lease (seconds) check-config warns: a keepalive (every lease/4) and a loop
#: stalled a second or two on a loaded host are enough to lose the lead
MIN_SAFE_LEASE_S = 4


def leader_renew_s(lease_s: float) -> float:
    """Seconds between the leader's keepalives for ``ha.lease_s`` (as
    :func:`daemon.ha.leading.leader_config` sets them: four per TTL, at most every 1.5 s)."""
    return min(1.5, lease_s / 4)


def survival(config: Any) -> list[str]:
    """Lines saying what the configured mode survives and what it does not (``config``: a
    :class:`daemon.config.Config`)."""
    ha = config.ha
    if ha is None:
        return [
            "control plane: embedded (one daemon, SQLite under daemon.state_dir; no etcd)",
            "  survives: a daemon restart on the same control node (state, events and nodes are on its disk)",
            "  survives: a rendezvous store restart (the workers train on; torchrun's spotvisor backend and the "
            "trainers put their round and join queue back)",
            "  does not survive: the control node's loss (its disk holds the pool's state); "
            "add an `ha:` section (configs/ha.yaml) for that",
        ]
    members = len(ha.endpoints)
    quorum = members // 2 + 1
    down = members - quorum
    lines = [
        f"control plane: HA (daemon {ha.name!r}, etcd {members} member(s), leader lease {ha.lease_s} s)",
        f"  survives: the leader daemon's kill -9 or its control node's loss (a standby leads within about "
        f"{ha.lease_s + 1} s and reads the pool's state from etcd); a leader paused or cut off from etcd "
        f"(it stops acting before its lease ends; its purchases and terminations are fenced)",
    ]
    if down:
        lines.append(f"  survives: {down} etcd member(s) of {members} down (a quorum of {quorum} remains)")
    lines.append(f"  does not survive: {down + 1} etcd member(s) of {members} down (no quorum: "
                 "no daemon may act until it returns; training goes on, changes wait)")
    if len(ha.agent_urls) > 1:
        lines.append(f"  agents: given the {len(ha.agent_urls)} control nodes' URLs (ha.agent_urls), they follow "
                     "whichever daemon leads")
    else:
        lines.append("  agents: they reach whichever daemon leads at daemon.agent_host:daemon.agent_port; list every "
                     "control node's URL in ha.agent_urls, or give that a floating address or a DNS name that "
                     "follows the leader (a standby does not listen)")
    lines.append("  rendezvous store: each daemon's own (its rendezvous.host:port, on its control node); the "
                 "leader's heartbeat replies tell every node where it is, the workers' store clients follow, and "
                 "a store started empty gets the running round back")
    if members < 3:
        lines.append("  warning: fewer than 3 etcd members: one member's loss stops the control plane")
    if ha.lease_s < MIN_SAFE_LEASE_S:
        lines.append(f"  warning: ha.lease_s {ha.lease_s} s is under {MIN_SAFE_LEASE_S} s: a loaded control node "
                     f"misses keepalives (sent every {leader_renew_s(ha.lease_s):g} s) and its leader steps down with "
                     f"nothing wrong; the takeover bound is about the lease plus one poll (0.5 s), so "
                     f"ha.lease_s: {MIN_SAFE_LEASE_S}-5 costs little")
    return lines
