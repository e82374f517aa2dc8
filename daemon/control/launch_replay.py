"""Whether a launch a daemon died in is sent again under its own client token. Pure.

A daemon killed inside ``provider.launch`` leaves its node ``requested``. The next daemon
(a restart, or a new HA leader) adopts the node's instance when its listing shows it
(:meth:`daemon.controlnode.fleet.Fleet.settle_unowned`). When it does not, the request
may still be on the wire, or EC2's eventually consistent listing may leave a new instance
out for a while ("Eventual consistency in the Amazon EC2 API",
https://docs.aws.amazon.com/ec2/latest/devguide/eventual-consistency.html). Giving the node
up and buying another then costs one more instance for as long as the late one takes to
be listed and terminated.

Sending the same launch again costs nothing of that. EC2 and ECS answer a request whose
``ClientToken`` an earlier one carried with that request's instance, and create it now if
the first never arrived; the same token with any other parameter is refused
(``IdempotentParameterMismatch``: https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-idempotency.html,
https://www.alibabacloud.com/help/en/ecs/developer-reference/api-ecs-2014-05-26-runinstances).
So the replay must be the first call byte for byte. Its parameters come from the node
(id, random token, tags: stored), the config (offer, launch spec) and what the call was
built from when it was sent, which the daemon stores with the node before the
call (:func:`sent`): the agent wheel's signed URL (a new signing gives another URL), the
daemon URLs the node was given (a new HA leader lists itself first) and the agents' CA.

A node's ``launch_call`` is ``{"sent": False}`` from its request until then; None on a
row from a daemon that did not record it (never replayed: what it sent is unknown).
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["NOT_SENT", "REPLAY_MARGIN_S", "replay_refusal", "sent"]

#: a node's ``launch_call`` from its request until its call is built
NOT_SENT: dict[str, Any] = {"sent": False}
#: seconds the wheel's signed URL must stay valid after a replay: the node boots and fetches it
REPLAY_MARGIN_S = 300.0


def _urls(daemon_url: object) -> set[str]:
    return {u.strip().rstrip("/") for u in str(daemon_url or "").split(",") if u.strip()}


def sent(daemon_url: str, ca_sha256: str | None, wheel: Mapping[str, str] | None,
         valid_until: float | None) -> dict[str, Any]:
    """A node's ``launch_call`` once its call is built: what :func:`replay_refusal` and a
    replay read. ``ca_sha256``: the agents' CA certificate's digest (None: plain HTTP);
    ``wheel``: the agent wheel's ``url``, ``sha256`` and ``version`` (None: the image has
    the agent); ``valid_until``: when the wheel's signed URL expires (unix seconds; None: no
    wheel)."""
    return {"sent": True, "daemon_url": daemon_url, "ca_sha256": ca_sha256,
            "wheel": None if wheel is None else dict(wheel), "valid_until": valid_until}


def replay_refusal(call: Mapping[str, Any] | None, now: float, *, idempotent: bool, offer_known: bool,
                   daemon_url: str, ca_sha256: str | None) -> str | None:
    """Why the launch of a ``requested`` node that no listing shows cannot be sent again
    (the node is then given up: ``node_launch_failed``, ``interrupted``); None: it can.

    ``call``: the node's ``launch_call``; ``now``: unix seconds; ``idempotent``: its
    provider's launch carries a client token (EC2, ECS); ``offer_known``: its offer is
    still in the config; ``daemon_url`` and ``ca_sha256``: what this daemon would give a
    node now (as :func:`sent` takes them). A call never sent is sent now, as its first,
    whatever the provider. Pure."""
    if not offer_known:
        return "its offer is no longer in the config"
    if call is None:
        return "what its launch call was sent with was not recorded"
    if not call.get("sent"):  # the provider was never called (the record is written, and
        return None           # under HA synced, before the call): a first call, any provider
    if not idempotent:
        return "its provider's launch has no client token to send it again under"
    if _urls(call.get("daemon_url")) != _urls(daemon_url):
        return "the control nodes' agent URLs changed since its launch"
    if call.get("ca_sha256") != ca_sha256:
        return "the agents' CA changed since its launch"
    valid_until = call.get("valid_until")
    if valid_until is not None and float(valid_until) - now < REPLAY_MARGIN_S:
        return f"its agent wheel's signed URL expires in under {REPLAY_MARGIN_S:g} s"
    return None
