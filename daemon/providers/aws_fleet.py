"""The ``launch_method: create_fleet`` path of :mod:`daemon.providers.aws`: one node bought
through an instant EC2 Fleet over a per-node launch template.

Sources: CreateFleet
(https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_CreateFleet.html): with
``Type="instant"`` capacity failures come back in the response's ``Errors[]``
(``ErrorCode``, ``ErrorMessage``), not as an exception; CreateLaunchTemplate /
DeleteLaunchTemplate for the template, which carries what RunInstances would (user-data,
image, interfaces: :func:`~daemon.providers.aws_launch.launch_template_data`). The
template is named after the node's idempotency token, so a retry reuses it; it is deleted
once the fleet has answered (best effort).
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from daemon.control.pool import Offer
from daemon.providers.aws_api import Ec2Api, error_code, instance_view, map_client_error
from daemon.providers.aws_launch import client_token, launch_template_data
from daemon.providers.base import (AuthError, CapacityError, Instance, NodeSpec, ProviderError, QuotaError,
                                   TransientError)

__all__ = ["Ec2Fleet"]

log = structlog.get_logger("spotvisor.provider.aws")

_TEMPLATE_GONE = ("InvalidLaunchTemplateName.NotFoundException", "InvalidLaunchTemplateId.NotFound")


class Ec2Fleet:
    """Buys one instance per call through an instant fleet (see the module docstring).

    Args:
        api: the provider's EC2 calls; each call here is a single attempt (the provider
            retries the whole launch).
        provider: the provider's name, stamped on the instances returned.
    """

    def __init__(self, api: Ec2Api, *, provider: str) -> None:
        self._api = api
        self._provider = provider

    async def launch(self, region: str, offer: Offer, node: NodeSpec, request: dict[str, Any],
                     tags: list[dict[str, str]]) -> Instance:
        """Launch ``node`` for ``offer`` from ``request`` (the RunInstances parameters).

        Raises:
            CapacityError, QuotaError, AuthError, TransientError: the most actionable of the
                fleet's ``Errors[]`` (auth/quota beat capacity beat the rest), or of the call.
            ProviderError: anything else.
        """
        token = client_token(node)
        template = token  # valid launch template name: [a-zA-Z0-9().-/_], ≤ 128
        try:
            await self._api.call_once(region, "create_launch_template", LaunchTemplateName=template,
                                      LaunchTemplateData=launch_template_data(request), ClientToken=token)
        except ProviderError as exc:
            if error_code(exc) != "InvalidLaunchTemplateName.AlreadyExistsException":
                raise
        definitive = False
        try:
            resp = await self._api.call_once(
                region, "create_fleet", Type="instant", ClientToken=token,
                # the request's own tags: the policy launches only pool-tagged instances (aws:RequestTag)
                TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
                SpotOptions={"AllocationStrategy": "price-capacity-optimized",
                             "InstanceInterruptionBehavior": "terminate"},
                LaunchTemplateConfigs=[{
                    "LaunchTemplateSpecification": {"LaunchTemplateName": template, "Version": "$Latest"},
                    "Overrides": [_override(offer, request)],
                }],
                TargetCapacitySpecification={"TotalTargetCapacity": 1, "SpotTargetCapacity": 1,
                                             "DefaultTargetCapacityType": "spot"},
            )
            definitive = True
        finally:
            if definitive:
                await self.delete_template(region, template)
        ids = [i for group in resp.get("Instances", []) for i in group.get("InstanceIds", [])]
        if ids:
            found = await self._api.describe_instances(region, [], instance_ids=ids[:1], retry=False)
            if found:
                return instance_view(found[0], self._provider)
            return Instance(id=ids[0], node_id=node.node_id, provider=self._provider, state="pending",
                            zone=offer.zone, instance_type=offer.instance_type, launched_at=time.time())
        raise _fleet_error(resp.get("Errors", []), what=f"CreateFleet in {region}")

    async def delete_template(self, region: str, template: str) -> None:
        """Delete the launch template (best effort: gone already is fine, a failure is logged)."""
        try:
            await self._api.call_once(region, "delete_launch_template", LaunchTemplateName=template)
        except ProviderError as exc:
            if error_code(exc) in _TEMPLATE_GONE:
                return
            log.warning("aws_launch_template_delete_failed", template=template, error=str(exc))


def _override(offer: Offer, request: dict[str, Any]) -> dict[str, Any]:
    """The fleet's one ``Overrides`` entry: the offer's type, subnet or zone, price cap, group."""
    override: dict[str, Any] = {"InstanceType": offer.instance_type}
    if "SubnetId" in request:
        override["SubnetId"] = request["SubnetId"]  # the subnet fixes the zone
    elif offer.zone:
        override["AvailabilityZone"] = offer.zone
    if offer.max_price_usd_h is not None:
        override["MaxPrice"] = str(offer.max_price_usd_h)
    if offer.placement_group:  # FleetLaunchTemplateOverridesRequest.Placement.GroupName
        override["Placement"] = {"GroupName": offer.placement_group}
    return override


def _fleet_error(errors: list[dict[str, Any]], *, what: str) -> ProviderError:
    """The error to raise for a fleet that launched nothing: the most actionable of ``errors``."""
    if not errors:
        return CapacityError(f"{what}: the fleet launched no instance and reported no error")
    mapped = [map_client_error(str(e.get("ErrorCode", "")), str(e.get("ErrorMessage", ""))[:500],
                               status=None, what=what) for e in errors]
    for kind in (AuthError, QuotaError, CapacityError, TransientError):
        for err in mapped:
            if isinstance(err, kind):
                return err
    return mapped[0]
