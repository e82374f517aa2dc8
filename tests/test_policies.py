"""The least-privilege policies in configs/policies/ match the cloud calls the code can make.

Each action :mod:`tests.policy_derive` finds in daemon/ and trainer/ must be granted by
the policy of the side and cloud it runs on, and each action a policy grants must be one
the code calls, or a non-call grant listed in :data:`NON_CALL_GRANTS` with its reason.
The tests of the test feed the derivation small sources with a new call and show the
check fails naming the action and the policy file.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_derive import CONTROL, NODE, Call, DeriveError, derive, load_sources  # noqa: E402
from policy_derive import OSS_API_ACTIONS, iam_actions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POLICY_DIR = ROOT / "configs" / "policies"

#: (side, cloud) -> the policy file that must grant that side's calls on that cloud.
POLICIES: dict[tuple[str, str], str] = {
    (CONTROL, "aws"): "configs/policies/aws-control-node.json",
    (NODE, "aws"): "configs/policies/aws-gpu-node.json",
    (CONTROL, "aliyun"): "configs/policies/aliyun-control-node.json",
    (NODE, "aliyun"): "configs/policies/aliyun-gpu-node.json",
}

#: Grants no code calls, but a call the code makes needs: policy file -> action ->
#: (the derived action that needs it, why). Allowed only while that action is derived.
NON_CALL_GRANTS: dict[str, dict[str, tuple[str, str]]] = {
    "configs/policies/aws-control-node.json": {
        "iam:PassRole": (
            "ec2:RunInstances",
            "RunInstances / the fleet's launch template carry IamInstanceProfile (the node role); "
            "EC2 checks iam:PassRole on the role, restricted to iam:PassedToService ec2.amazonaws.com "
            "(https://docs.aws.amazon.com/IAM/latest/UserGuide/id_roles_use_passrole.html)"),
        "ec2:CreateTags": (
            "ec2:RunInstances",
            "RunInstances and the launch template carry TagSpecifications; EC2 authorizes ec2:CreateTags "
            "for tag-on-create, scoped with ec2:CreateAction "
            "(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/supported-iam-actions-tagging.html)"),
    },
    "configs/policies/aliyun-control-node.json": {
        "ram:PassRole": (
            "ecs:RunInstances",
            "RunInstances carries RamRoleName (a domain's launch.ram_role); attaching a RAM role to an "
            "instance needs ram:PassRole on that role "
            "(https://www.alibabacloud.com/help/en/ecs/user-guide/attach-an-instance-ram-role-to-an-ecs-instance)"),
    },
}


def granted(policy: Mapping) -> set[str]:
    """Actions a policy document allows. Raises ValueError for constructs this check cannot
    reason about (NotAction, NotResource, a wildcard in an action, a Deny-free '*')."""
    out: set[str] = set()
    for st in policy["Statement"]:
        if "NotAction" in st or "NotResource" in st:
            raise ValueError(f"statement {st.get('Sid', st)} uses NotAction/NotResource")
        if st["Effect"] != "Allow":
            continue
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        for a in actions:
            if "*" in a or "?" in a:
                raise ValueError(f"wildcard action {a!r}: grant exact actions")
            out.add(a)
    return out


def load_policies(root: Path = ROOT) -> dict[str, set[str]]:
    return {rel: granted(json.loads((root / rel).read_text())) for rel in POLICIES.values()}


def problems(calls: Iterable[Call], policies: Mapping[str, set[str]]) -> list[str]:
    """One line per mismatch between the derived calls and the policies (empty: they match)."""
    calls = list(calls)
    out: list[str] = []
    needed: dict[str, dict[str, list[Call]]] = {rel: {} for rel in POLICIES.values()}
    for call in calls:
        for side in call.sides:
            needed[POLICIES[(side, call.cloud)]].setdefault(call.action, []).append(call)
    for rel, actions in needed.items():
        grants = policies[rel]
        for action, sites in sorted(actions.items()):
            if not any(fnmatch.fnmatchcase(action, g) for g in grants):
                where = ", ".join(f"{c.path}:{c.line}" for c in sites[:3])
                out.append(f"{action} is called ({where}: {sites[0].via}) but {rel} does not grant it")
        extra = NON_CALL_GRANTS.get(rel, {})
        for grant in sorted(grants - set(actions)):
            reason = extra.get(grant)
            if reason is None:
                out.append(f"{rel} grants {grant}, which no code in daemon/ or trainer/ calls on this side")
            elif reason[0] not in actions:
                out.append(f"{rel} grants {grant} for {reason[0]}, which no code calls any more")
    return out


# --------------------------------------------------------------------------- the real check


@pytest.fixture(scope="module")
def real_calls() -> list[Call]:
    return derive(load_sources())


def test_policies_grant_exactly_what_the_code_calls(real_calls: list[Call]) -> None:
    assert problems(real_calls, load_policies()) == []


def test_derivation_finds_the_known_calls_on_the_right_side(real_calls: list[Call]) -> None:
    """A floor: the calls the providers and stores make today are found, each on its side."""
    by_side = {(c.action, side) for c in real_calls for side in c.sides}
    for action in ("ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate", "ec2:DeleteLaunchTemplate",
                   "ec2:TerminateInstances", "ec2:DescribeInstances", "ec2:DescribeSpotPriceHistory",
                   "ecs:RunInstances", "ecs:DeleteInstances", "ecs:DescribeInstances",
                   "ecs:DescribeSpotPriceHistory"):
        assert (action, CONTROL) in by_side and (action, NODE) not in by_side, action
    for action in ("s3:PutObject", "s3:GetObject", "s3:ListBucket", "s3:DeleteObject", "s3:AbortMultipartUpload",
                   "oss:PutObject", "oss:GetObject", "oss:ListObjects", "oss:DeleteObject", "oss:ListParts"):
        # the trainer writes the store; the daemon verifies commits and copies checkpoints in a migration
        assert {(action, NODE), (action, CONTROL)} <= by_side, action


def test_every_placeholder_is_explained_in_the_readme() -> None:
    readme = (POLICY_DIR / "README.md").read_text()
    for rel in POLICIES.values():
        for token in set(re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", (ROOT / rel).read_text())):
            assert f"`{token}`" in readme, f"{rel}: placeholder {token} is not explained in README.md"


# --------------------------------------------------------------------------- tests of the test


def _with(extra: Mapping[str, str], *, drop: Iterable[str] = (), edit: Mapping[str, tuple[str, str]] = {}
          ) -> list[Call]:
    sources = dict(load_sources())
    for path in drop:
        del sources[path]
    for path, (old, new) in edit.items():
        assert old in sources[path]
        sources[path] = sources[path].replace(old, new)
    sources.update(extra)
    return derive(sources)


def test_a_new_provider_call_fails_naming_the_action_and_the_policy() -> None:
    snippet = (
        "from daemon.providers.aws import AwsProvider\n"
        "class Volumes(AwsProvider):\n"
        "    async def volumes(self, r):\n"
        "        return await self._call(r, \"describe_volumes\")\n"
    )
    found = problems(_with({"daemon/providers/volumes.py": snippet}), load_policies())
    assert len(found) == 1
    assert "ec2:DescribeVolumes" in found[0] and "configs/policies/aws-control-node.json" in found[0]
    assert "daemon/providers/volumes.py:4" in found[0]


def test_a_call_through_a_client_helper_sharing_a_variable_name_is_found() -> None:
    """Two functions each make their client through a helper into a variable of the same
    name: a call on either is found (it was once dropped silently, the name bound to the
    other service)."""
    snippet = (
        "import boto3\n"
        "def _make_client(service):\n"
        "    return boto3.client(service)\n"
        "def a():\n"
        "    client = _make_client(\"ssm\")\n"
        "    return client.delete_parameter(Name='x')\n"
        "def b():\n"
        "    client = _make_client(\"secretsmanager\")\n"
        "    return client.get_secret_value(SecretId='y')\n"
    )
    found = problems(_with({"daemon/providers/more_secrets.py": snippet}), load_policies())
    assert len(found) == 1 and "ssm:DeleteParameter is called (daemon/providers/more_secrets.py:6" in found[0]


def test_a_grant_the_code_no_longer_needs_fails_naming_it() -> None:
    calls = _with({}, edit={"daemon/providers/aws_fleet.py": ('"delete_launch_template"', "template_op")})
    found = problems(calls, load_policies())
    assert found == ["configs/policies/aws-control-node.json grants ec2:DeleteLaunchTemplate, which no code "
                     "in daemon/ or trainer/ calls on this side"]


def test_a_non_call_grant_goes_when_the_call_that_needs_it_goes(real_calls: list[Call]) -> None:
    calls = [c for c in real_calls if c.action != "ec2:RunInstances"]
    found = problems(calls, load_policies())
    assert any("iam:PassRole for ec2:RunInstances" in line for line in found)
    assert any("ec2:RunInstances" in line and "no code" in line for line in found)


def test_calls_on_the_node_are_held_to_the_gpu_node_policy() -> None:
    snippet = "import boto3\n\ndef who():\n    return boto3.client('sts').get_caller_identity()['Account']\n"
    found = problems(_with({"trainer/whoami.py": snippet}), load_policies())
    assert found == ["sts:GetCallerIdentity is called (trainer/whoami.py:4: call .get_caller_identity() "
                     "(sts GetCallerIdentity)) but configs/policies/aws-gpu-node.json does not grant it"]


def test_aliyun_request_classes_and_oss2_methods_are_found() -> None:
    ecs = ("from aliyunsdkecs.request.v20140526.DescribeDisksRequest import DescribeDisksRequest\n"
           "def build():\n    return DescribeDisksRequest()\n")
    oss = ("import oss2\nfrom trainer.oss_store import OssStore\n"
           "class Meta(OssStore):\n    def size(self, key):\n"
           "        return oss2.Bucket(None, 'e', 'b').head_object(key).content_length\n")
    found = problems(_with({"daemon/controlnode/images.py": ecs, "trainer/meta.py": oss}), load_policies())
    assert any(line.startswith("ecs:DescribeDisks is called (daemon/controlnode/images.py:3")
               and "aliyun-control-node.json" in line for line in found)
    assert all("oss:" not in line for line in found)  # HeadObject -> oss:GetObject, already granted


def test_a_client_made_from_a_variable_service_is_found_through_its_literal() -> None:
    """A helper makes clients from a variable (``session.client(service)``) and callers name
    the service and the operation in literals: the call is found (the cloud check's
    sts/service-quotas calls once went unseen this way)."""
    snippet = (
        "import boto3\n"
        "class Clients:\n"
        "    def call(self, service, op):\n"
        "        return getattr(boto3.session.Session().client(service), op)()\n"
        "def who(c):\n"
        "    return c.call(\"iam\", \"list_users\")\n"
    )
    found = problems(_with({"daemon/providers/whoami.py": snippet}), load_policies())
    assert len(found) == 1 and found[0].startswith("iam:ListUsers is called (daemon/providers/whoami.py:6")


def test_an_oss2_method_missing_from_the_table_stops_the_derivation() -> None:
    snippet = "import oss2\nb = oss2.Bucket(None, 'e', 'b')\nb.put_symlink('a', 'b')\n"
    with pytest.raises(DeriveError, match=r"trainer/link.py:3: oss2 Bucket.put_symlink\(\)"):
        _with({"trainer/link.py": snippet})


def test_the_calls_issue_26_adds_will_be_found_without_changing_the_derivation() -> None:
    """Shapes of what ``spotvisord check``, per-domain launch specs and secrets delivery will
    add (other branches): each call is found, mapped and put on its side."""
    check = (
        "import boto3\n"
        "from daemon.providers.aws import AwsProvider\n"
        "from aliyunsdkecs.request.v20140526.DescribeSecurityGroupsRequest import DescribeSecurityGroupsRequest\n"
        "from aliyunsdkecs.request.v20140526.DescribeAvailableResourceRequest import DescribeAvailableResourceRequest\n"
        "async def run(p: AwsProvider, r, req, session):\n"
        "    session.client('sts').get_caller_identity()\n"
        "    q = session.client('service-quotas', region_name=r)\n"
        "    q.get_service_quota(ServiceCode='ec2', QuotaCode='L-34B43A08')\n"
        "    await p._call_once(r, 'run_instances', DryRun=True, **req)\n"
        "    await p._call(r, 'describe_instance_types', InstanceTypes=['p5.48xlarge'])\n"
        "    await p._call(r, 'describe_images', ImageIds=['ami-1'])\n"
        "    DescribeSecurityGroupsRequest(); DescribeAvailableResourceRequest()\n"
    )
    secrets = (
        "import boto3\n"
        "from aliyunsdkkms.request.v20160120.GetSecretValueRequest import GetSecretValueRequest\n"
        "def fetch(name):\n"
        "    boto3.client('ssm').get_parameter(Name=name, WithDecryption=True)\n"
        "    boto3.client('secretsmanager').get_secret_value(SecretId=name)\n"
        "    return GetSecretValueRequest()\n"
    )
    calls = _with({"daemon/interfaces/check.py": check, "daemon/controlnode/secrets.py": secrets})
    new = {(c.action, c.path) for c in calls if c.path in ("daemon/interfaces/check.py",
                                                           "daemon/controlnode/secrets.py")}
    assert new == {
        ("sts:GetCallerIdentity", "daemon/interfaces/check.py"),
        ("servicequotas:GetServiceQuota", "daemon/interfaces/check.py"),
        ("ec2:RunInstances", "daemon/interfaces/check.py"),
        ("ec2:DescribeInstanceTypes", "daemon/interfaces/check.py"),
        ("ec2:DescribeImages", "daemon/interfaces/check.py"),
        ("ecs:DescribeSecurityGroups", "daemon/interfaces/check.py"),
        ("ecs:DescribeAvailableResource", "daemon/interfaces/check.py"),
        ("ssm:GetParameter", "daemon/controlnode/secrets.py"),
        ("secretsmanager:GetSecretValue", "daemon/controlnode/secrets.py"),
        ("kms:GetSecretValue", "daemon/controlnode/secrets.py"),
    }
    assert all(c.sides == {CONTROL} for c in calls if c.path.endswith(("check.py", "secrets.py")))


# --------------------------------------------------------------------------- the tables, against the SDKs


def test_what_s3store_sends_is_what_the_derivation_says(s3_server: str, tmp_path: Path,
                                                       real_calls: list[Call]) -> None:
    """The S3 store, driven through every method (a multipart upload and a ranged download
    included) against moto: each S3 operation boto3 sends maps to an action the derivation
    found in trainer/storage.py (so the managed-transfer table is not stale)."""
    import uuid

    import boto3

    from trainer.storage import S3Store

    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    bucket = f"policy-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    sent: list[str] = []
    client.meta.events.register("before-call.s3", lambda model, **_: sent.append(model.name))
    mib = 1024 * 1024
    store = S3Store(f"s3://{bucket}/job", client=client, multipart_threshold=5 * mib, multipart_chunksize=5 * mib)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (11 * mib))
    store.put_bytes("a/small", b"1")
    store.put_file("a/big", big)
    assert store.get_bytes("a/small") == b"1"
    store.get_file("a/big", tmp_path / "back")
    assert sorted(store.list("a/")) == ["a/big", "a/small"]
    store.delete(["a/small", "a/big"])
    assert {"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "HeadObject",
            "GetObject", "ListObjectsV2", "DeleteObjects"} <= set(sent)
    derived = {c.action for c in real_calls if c.path == "trainer/storage.py"}
    assert {a for op in sent for a in iam_actions("s3", op)} <= derived


def test_what_ossstore_sends_is_what_the_derivation_says(oss_server, tmp_path: Path,
                                                        real_calls: list[Call]) -> None:
    """The OSS store through every method (multipart and resumed upload, ranged download)
    against the OSS fake: each OSS operation it sends maps to an action the derivation
    found in trainer/oss_store.py."""
    import uuid

    from trainer.oss_store import OssStore

    bucket = f"policy-{uuid.uuid4().hex[:12]}"
    oss_server.create_bucket(bucket)
    store = OssStore(f"oss://{bucket}/job", endpoint=oss_server.endpoint, region="cn-hangzhou",
                     multipart_threshold=100 * 1024, part_size=100 * 1024, num_threads=2,
                     checkpoint_dir=tmp_path / "resume")
    big = tmp_path / "big"
    big.write_bytes(b"y" * (350 * 1024))
    start = len(oss_server.requests)
    oss_server.fail_next(1, 503, op="CompleteMultipartUpload")  # the retry resumes: ListParts
    try:
        store.put_bytes("a/small", b"1")
        store.put_file("a/big", big)
    finally:
        oss_server.reset_faults()
    assert store.get_bytes("a/small") == b"1"
    store.get_file("a/big", tmp_path / "back")
    assert sorted(store.list("a/")) == ["a/big", "a/small"]
    store.delete(["a/small", "a/big"])
    sent = {s.op for s in oss_server.requests[start:]}
    assert {"PutObject", "InitiateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "ListParts",
            "HeadObject", "GetObject", "ListObjectsV2", "DeleteMultipleObjects"} <= sent
    derived = {c.action for c in real_calls if c.path == "trainer/oss_store.py"}
    assert {OSS_API_ACTIONS[op] for op in sent} <= derived
