"""When an instance a listing leaves out may be taken as gone: the cloud's listing lags.

EC2's API is eventually consistent: "if you run a command to modify or describe the
resource that you just created, its ID might not have propagated throughout the system";
AWS's advice is to describe again with a backoff "starting with a couple of seconds of
wait time, and increasing gradually up to a few minutes" ("Eventual consistency in the
Amazon EC2 API", https://docs.aws.amazon.com/ec2/latest/devguide/eventual-consistency.html).
A node just launched whose instance the next ``DescribeInstances`` leaves out is not
gone: taking it for lost would terminate a booting instance and buy another.

The rule (:func:`absent_means_gone`): an instance absent from a listing is gone once it
was seen (a listing of this daemon's showed it, or its agent registered from it: it was
there, and now it is not), or once its provider's
lag (:attr:`daemon.providers.base.Provider.listing_lag_s`, seconds: 0 for the local
provider, whose listing is the truth, a few minutes for a cloud) has passed since its
node's launch was requested. Meanwhile the node's agent is the other witness: a node
that never registers or stops heartbeating is lost by the heartbeat timeout whatever
the listing says. Pure: the clock is passed in.
"""

from __future__ import annotations

__all__ = ["absent_means_gone"]


def absent_means_gone(*, listed_before: bool, requested_at: float, now: float, lag_s: float) -> bool:
    """Whether an instance missing from a listing taken at ``now`` (unix s) is gone.

    ``listed_before``: a listing of this daemon's has shown the instance, or its agent has
    registered; ``requested_at``:
    when its node's launch was requested (unix s); ``lag_s``: how long the provider's
    listing may leave a new instance out (seconds, >= 0)."""
    return listed_before or now - requested_at >= lag_s
