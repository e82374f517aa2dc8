"""Every cloud API action the code in ``daemon/`` and ``trainer/`` can call, found statically.

Used by ``tests/test_policies.py`` to hold ``configs/policies/*.json`` to the code: each
action derived here must be granted by the policy of the side (control node, GPU node)
and cloud it runs on, and each grant must be an action derived here (or an allow-listed
non-call grant such as ``iam:PassRole``).

How a call is found, by AST, with no list of files or call sites to keep up to date:

- **boto3 services in reach.** A module's *services* are the boto3 services whose client
  is created (``<x>.client("svc", ...)`` / ``<x>.resource("svc")``, a literal service
  name botocore knows) in the module or in any project module it imports, directly or
  not (imports inside functions count).
- **boto3 calls.** In a module with services in reach: every string literal passed as an
  argument to any call (``self._call(region, "run_instances")``, ``_call_once(...)``,
  ``get_paginator("list_objects_v2")``, ``generate_presigned_url("get_object")``) and
  every attribute call (``client.put_object(...)``, ``sts.get_caller_identity()``) whose
  name is an operation of one of those services, by botocore's own service model
  (``operation_names`` through ``xform_name``). boto3's managed transfers
  (``upload_file``, ``download_fileobj``, ``copy`` ...) expand to the operations
  s3transfer sends (:data:`S3_TRANSFER_OPS`). A name that is an operation of two services
  in reach is an error (say which by creating that client in the module).
- **boto3 API -> IAM action.** Identity (``ec2:RunInstances``) except where the Service
  Authorization Reference maps an operation to other actions (:data:`IAM_ACTION_OVERRIDES`,
  S3 mostly).
- **Alibaba ECS / KMS / ... (aliyun-python-sdk-*)**: a ``XxxRequest`` class imported from
  ``aliyunsdk<product>.request.v<date>`` and instantiated -> ``<product>:Xxx``;
  ``RpcRequest("Ecs", "2014-05-26", "Xxx")`` / ``CommonRequest(product=..., action_name=...)``
  with literals likewise; the Tea SDKs (``alibabacloud_<product><date>``):
  ``models.XxxRequest(...)`` -> ``<product>:Xxx``.
- **oss2**: a method called on an object assigned from ``oss2.Bucket(...)``, and the
  module-level helpers (``oss2.resumable_upload``, ``oss2.ObjectIteratorV2`` ...), through
  :data:`OSS2_CALLS` (OSS API -> RAM action). A method missing from the table is an
  error, never silently skipped.

Which side a call is on: ``daemon/`` runs on the control node except ``daemon/gpunode/``,
which runs on the GPU node with ``trainer/``. A module is on a side when it is in the
import closure of that side's roots; so the checkpoint store (``trainer/storage.py``,
``trainer/oss_store.py``) is on both sides: the daemon verifies commits
(``daemon/controlnode/manifests.py``) and copies checkpoints when it migrates the job
(``daemon/controlnode/migrator.py``).

Sources: botocore's service models; the Service Authorization Reference
(https://docs.aws.amazon.com/service-authorization/latest/reference/list_amazons3.html,
table "API operations defined by Amazon S3"; "Required permissions for Amazon S3 API
operations", https://docs.aws.amazon.com/AmazonS3/latest/userguide/using-with-s3-policy-actions.html);
OSS's RAM actions, https://www.alibabacloud.com/help/en/oss/user-guide/ram-policy-overview
(object-level operations table); s3transfer and oss2 sources for what their managed
transfers send.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import botocore.session
from botocore import xform_name

__all__ = [
    "Call", "DeriveError", "derive", "load_sources", "side_of", "iam_actions", "IAM_ACTION_OVERRIDES",
    "OSS2_CALLS", "OSS_API_ACTIONS", "S3_TRANSFER_OPS",
]

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "trainer")
CONTROL, NODE = "control", "node"

#: boto3's managed-transfer client methods (injected by boto3, not in the service model)
#: -> the S3 operations s3transfer may send for them (upload: one PutObject below the
#: threshold, else a multipart upload, aborted on failure; download: HeadObject, then
#: GetObject, ranged above the threshold; copy: HeadObject, CopyObject or UploadPartCopy).
S3_TRANSFER_OPS: dict[str, tuple[str, ...]] = {
    "upload_file": ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
                    "AbortMultipartUpload"),
    "upload_fileobj": ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
                       "AbortMultipartUpload"),
    "download_file": ("HeadObject", "GetObject"),
    "download_fileobj": ("HeadObject", "GetObject"),
    "copy": ("HeadObject", "CopyObject", "CreateMultipartUpload", "UploadPartCopy", "CompleteMultipartUpload",
             "AbortMultipartUpload"),
}

#: (service, API operation) -> the IAM actions it needs, where that is not ``service:Operation``.
#: Service Authorization Reference, list_amazons3 ("API operations defined by Amazon S3") and
#: the S3 user guide's "Required permissions for Amazon S3 API operations".
IAM_ACTION_OVERRIDES: dict[tuple[str, str], tuple[str, ...]] = {
    ("s3", "HeadObject"): ("s3:GetObject",),
    ("s3", "ListObjectsV2"): ("s3:ListBucket",),
    ("s3", "ListObjects"): ("s3:ListBucket",),
    ("s3", "HeadBucket"): ("s3:ListBucket",),
    ("s3", "CreateMultipartUpload"): ("s3:PutObject",),
    ("s3", "UploadPart"): ("s3:PutObject",),
    ("s3", "CompleteMultipartUpload"): ("s3:PutObject",),
    ("s3", "UploadPartCopy"): ("s3:GetObject", "s3:PutObject"),
    ("s3", "CopyObject"): ("s3:GetObject", "s3:PutObject"),
    ("s3", "DeleteObjects"): ("s3:DeleteObject",),
    ("s3", "ListParts"): ("s3:ListMultipartUploadParts",),
    ("s3", "ListMultipartUploads"): ("s3:ListBucketMultipartUploads",),
    ("s3", "GetObjectAttributes"): ("s3:GetObject", "s3:GetObjectAttributes"),
}

#: botocore service name -> IAM service prefix, where they differ.
_IAM_PREFIX = {"s3api": "s3"}

#: oss2 calls -> OSS RAM actions. Bucket methods by name; module-level helpers as "oss2.<name>".
#: OSS API -> action: https://www.alibabacloud.com/help/en/oss/user-guide/ram-policy-overview
#: (HeadObject / GetObjectMeta -> oss:GetObject; Initiate/UploadPart/CompleteMultipartUpload ->
#: oss:PutObject; DeleteMultipleObjects -> oss:DeleteObject; ListObjectsV2 -> oss:ListObjects).
#: oss2 2.19 resumable.py: resumable_upload sends PutObject below the threshold, else
#: InitiateMultipartUpload / UploadPart / CompleteMultipartUpload and ListParts (PartIterator)
#: to resume; resumable_download sends HeadObject then GetObject (ranged).
OSS2_CALLS: dict[str, tuple[str, ...]] = {
    "put_object": ("oss:PutObject",),
    "put_object_from_file": ("oss:PutObject",),
    "get_object": ("oss:GetObject",),
    "get_object_to_file": ("oss:GetObject",),
    "head_object": ("oss:GetObject",),
    "get_object_meta": ("oss:GetObject",),
    "object_exists": ("oss:GetObject",),
    "delete_object": ("oss:DeleteObject",),
    "batch_delete_objects": ("oss:DeleteObject",),
    "list_objects": ("oss:ListObjects",),
    "list_objects_v2": ("oss:ListObjects",),
    "init_multipart_upload": ("oss:PutObject",),
    "upload_part": ("oss:PutObject",),
    "complete_multipart_upload": ("oss:PutObject",),
    "abort_multipart_upload": ("oss:AbortMultipartUpload",),
    "list_parts": ("oss:ListParts",),
    "list_multipart_uploads": ("oss:ListMultipartUploads",),
    "copy_object": ("oss:GetObject", "oss:PutObject"),
    "sign_url": ("oss:GetObject",),  # the signer needs the permission of what the URL does (GET here)
    "oss2.resumable_upload": ("oss:PutObject", "oss:ListParts"),
    "oss2.resumable_download": ("oss:GetObject",),
    "oss2.ObjectIterator": ("oss:ListObjects",),
    "oss2.ObjectIteratorV2": ("oss:ListObjects",),
    "oss2.PartIterator": ("oss:ListParts",),
    "oss2.MultipartUploadIterator": ("oss:ListMultipartUploads",),
}
#: OSS API operation -> RAM action, from the same OSS page (object- and bucket-level tables).
OSS_API_ACTIONS: dict[str, str] = {
    "PutObject": "oss:PutObject", "InitiateMultipartUpload": "oss:PutObject", "UploadPart": "oss:PutObject",
    "CompleteMultipartUpload": "oss:PutObject", "AbortMultipartUpload": "oss:AbortMultipartUpload",
    "ListParts": "oss:ListParts", "ListMultipartUploads": "oss:ListMultipartUploads",
    "GetObject": "oss:GetObject", "HeadObject": "oss:GetObject", "GetObjectMeta": "oss:GetObject",
    "DeleteObject": "oss:DeleteObject", "DeleteMultipleObjects": "oss:DeleteObject",
    "ListObjects": "oss:ListObjects", "ListObjectsV2": "oss:ListObjects",
}
#: oss2.Bucket attributes that are not requests (no RAM action).
_OSS2_LOCAL = frozenset({"bucket_name", "endpoint", "auth"})

_TEA_MODULE = re.compile(r"^alibabacloud_([a-z_]+?)\d{8}(?:\.models)?$")


class DeriveError(Exception):
    """The derivation met a call it cannot map to an action (fail closed: fix the table or the code)."""


@dataclass(frozen=True)
class Call:
    """One cloud API call site: ``action`` (``ec2:RunInstances``) at ``path:line``, on ``sides``."""

    action: str
    cloud: str  # "aws" or "aliyun"
    path: str
    line: int
    via: str  # what was seen, e.g. 'literal "run_instances" (ec2 RunInstances)'
    sides: frozenset[str] = frozenset()


# --------------------------------------------------------------------------- botocore model


@functools.lru_cache(maxsize=None)
def _session() -> botocore.session.Session:
    return botocore.session.get_session()


@functools.lru_cache(maxsize=None)
def boto_services() -> frozenset[str]:
    return frozenset(_session().get_available_services())


@functools.lru_cache(maxsize=None)
def boto_ops(service: str) -> dict[str, str]:
    """snake_case method name -> API operation name, from botocore's service model."""
    model = _session().get_service_model(service)
    return {xform_name(op): op for op in model.operation_names}


def iam_actions(service: str, op: str) -> tuple[str, ...]:
    override = IAM_ACTION_OVERRIDES.get((service, op))
    if override is not None:
        return override
    prefix = _session().get_service_model(service).signing_name or service
    return (f"{_IAM_PREFIX.get(prefix, prefix)}:{op}",)


# --------------------------------------------------------------------------- sources and imports


def load_sources(root: Path = ROOT) -> dict[str, str]:
    """``{"daemon/providers/aws.py": text, ...}`` for every .py file under daemon/ and trainer/."""
    out: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            out[path.relative_to(root).as_posix()] = path.read_text()
    return out


def module_name(path: str) -> str:
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def side_of(path: str) -> str:
    """The side a file's own code runs on (before imports): control or node."""
    return NODE if path.startswith(("daemon/gpunode/", "trainer/")) else CONTROL


def _imported_names(tree: ast.AST, mod: str, is_pkg: bool) -> set[str]:
    """Every dotted name ``tree`` imports anywhere (function bodies too), with its parents:
    the project's modules among them are its edges in the import graph."""
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                found.add(".".join(parts[:i]))
    return found


def _closure(start: Iterable[str], graph: Mapping[str, set[str]]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo.extend(graph.get(m, ()))
    return seen


# --------------------------------------------------------------------------- per-module scan


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _client_service(call: ast.Call) -> str | None:
    """The boto3 service of ``x.client("svc", ...)`` / ``boto3.resource(service_name="svc")``,
    and of a wrapper named like one (``_aws_client("ssm", region)``): a literal service name
    handed to any ``*client`` / ``*resource`` function brings that service into reach."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name is None or not name.endswith(("client", "resource")):
        return None
    svc = _str(call.args[0]) if call.args else None
    for kw in call.keywords:
        if kw.arg == "service_name":
            svc = _str(kw.value)
    return svc if svc in boto_services() else None


@functools.lru_cache(maxsize=None)
def _scan(path: str, text: str) -> _ModuleScan:
    """One module's scan, made once per text: the tests derive the whole tree a dozen times
    with one module added or edited, and a scan was 80 % of a derivation's 3 CPU-s."""
    return _ModuleScan(path, text)


@functools.lru_cache(maxsize=None)
def _calls(scan: _ModuleScan, services: frozenset[str]) -> tuple[Call, ...]:
    return tuple(scan.calls(set(services)))


class _ModuleScan:
    """What one module holds: clients it creates, oss2 buckets, and candidate call sites.
    Not changed after it is made (:func:`_scan` shares one between derivations)."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.tree = ast.parse(text, filename=path)
        mod = module_name(path)
        self.imported_names = frozenset(_imported_names(self.tree, mod, path.endswith("__init__.py")))
        self.services: set[str] = set()
        # dotted target -> every service assigned to that name in the module (two functions'
        # ``client`` variables are one name here: a call on it may be either's)
        self.boto_receivers: dict[str, set[str]] = {}
        self.oss_receivers: set[str] = set()
        self.aliases: dict[str, str] = {}  # local name -> imported dotted name
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        uses_boto = any(v.startswith(("boto3", "botocore")) for v in self.aliases.values())
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                svc = _client_service(node)
                if svc:
                    self.services.add(svc)
            # a module that uses boto3 and names a service in a literal anywhere (a client made
            # from a variable: ``session.client(service)`` behind ``call("sts", ...)``) has it in
            # reach: over-approximate, never drop a call silently
            if uses_boto and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in boto_services():
                self.services.add(node.value)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                kinds = self._value_kinds(node.value)
                for t in targets:
                    d = _dotted(t)
                    if d is None:
                        continue
                    for kind in kinds:
                        if kind == "oss2":
                            self.oss_receivers.add(d)
                        else:
                            self.boto_receivers.setdefault(d, set()).add(kind)

    def _resolve(self, dotted: str | None) -> str | None:
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def _value_kinds(self, value: ast.AST) -> set[str]:
        kinds: set[str] = set()
        for sub in ast.walk(value):
            if isinstance(sub, ast.Call):
                svc = _client_service(sub)
                if svc:
                    kinds.add(svc)
                if self._resolve(_dotted(sub.func)) in ("oss2.Bucket", "oss2.api.Bucket", "oss2.CryptoBucket"):
                    kinds.add("oss2")
        return kinds

    def calls(self, services: set[str]) -> list[Call]:
        """The cloud calls in this module, given the boto3 services in its reach."""
        out: list[Call] = []
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Call):
                continue
            out.extend(self._aliyun(node))
            out.extend(self._oss2(node))
            if services:
                out.extend(self._boto(node, services))
        return out

    # -- boto3 ---------------------------------------------------------------
    def _boto(self, node: ast.Call, services: set[str]) -> list[Call]:
        out: list[Call] = []
        for arg in list(node.args) + [kw.value for kw in node.keywords]:
            lit = _str(arg)
            if lit is not None and re.fullmatch(r"[a-z][a-z0-9_]*", lit):
                out.extend(self._boto_name(lit, services, node, f'literal "{lit}"', receiver=None))
        func = node.func
        if isinstance(func, ast.Attribute):
            recv = func.value
            if isinstance(recv, ast.Call) and _client_service(recv):
                svc: set[str] | None = {_client_service(recv)}  # type: ignore[set-item]
            else:
                svc = self.boto_receivers.get(_dotted(recv) or "")
            if _dotted(recv) not in self.oss_receivers:
                out.extend(self._boto_name(func.attr, services, node, f"call .{func.attr}()", receiver=svc))
        return out

    def _boto_name(self, name: str, services: set[str], node: ast.Call, via: str, *,
                   receiver: set[str] | None) -> list[Call]:
        cands = receiver if receiver else services
        if name in S3_TRANSFER_OPS and "s3" in cands:
            if via.startswith("literal"):
                return []  # "copy" etc. as a literal is no managed transfer
            return [Call(a, "aws", self.path, node.lineno, f"{via} (s3 managed transfer: {op})")
                    for op in S3_TRANSFER_OPS[name] for a in iam_actions("s3", op)]
        hits = sorted(s for s in cands if name in boto_ops(s))
        if not hits:
            return []
        if len(hits) > 1:
            raise DeriveError(f"{self.path}:{node.lineno}: {via} is an operation of {hits}; "
                              "create the client in this module so the service is known")
        svc = hits[0]
        op = boto_ops(svc)[name]
        return [Call(a, "aws", self.path, node.lineno, f"{via} ({svc} {op})") for a in iam_actions(svc, op)]

    # -- oss2 ----------------------------------------------------------------
    def _oss2(self, node: ast.Call) -> list[Call]:
        func = node.func
        resolved = self._resolve(_dotted(func))
        if resolved and resolved.startswith("oss2.") and resolved in OSS2_CALLS:
            return [Call(a, "aliyun", self.path, node.lineno, f"{resolved}()") for a in OSS2_CALLS[resolved]]
        if isinstance(func, ast.Attribute) and _dotted(func.value) in self.oss_receivers:
            if func.attr in _OSS2_LOCAL:
                return []
            if func.attr not in OSS2_CALLS:
                raise DeriveError(f"{self.path}:{node.lineno}: oss2 Bucket.{func.attr}() is not in "
                                  "tests/policy_derive.py OSS2_CALLS; add its RAM action (cite the OSS doc)")
            return [Call(a, "aliyun", self.path, node.lineno, f"oss2 Bucket.{func.attr}()") for a in OSS2_CALLS[func.attr]]
        return []

    # -- Alibaba RPC SDKs ------------------------------------------------------
    def _aliyun(self, node: ast.Call) -> list[Call]:
        resolved = self._resolve(_dotted(node.func)) or ""
        m = re.fullmatch(r"aliyunsdk([a-z0-9]+)\.request\.v\d+\.\w+\.(\w+)Request", resolved)
        if m:
            return [Call(f"{m.group(1)}:{m.group(2)}", "aliyun", self.path, node.lineno, f"{m.group(2)}Request()")]
        t = _TEA_MODULE.match(resolved.rsplit(".", 1)[0]) if "." in resolved else None
        if t and resolved.endswith("Request"):
            action = resolved.rsplit(".", 1)[1][: -len("Request")]
            return [Call(f"{t.group(1).replace('_', '')}:{action}", "aliyun", self.path, node.lineno, f"{resolved}()")]
        last = resolved.rsplit(".", 1)[-1]
        if last in ("RpcRequest", "RoaRequest", "CommonRequest"):
            args = [_str(a) for a in node.args]
            kw = {k.arg: _str(k.value) for k in node.keywords}
            product = kw.get("product") or (args[0] if args else None)
            action = kw.get("action_name") or (args[2] if len(args) > 2 else None)
            if product and action:
                return [Call(f"{product.lower()}:{action}", "aliyun", self.path, node.lineno, f"{last}({product}, {action})")]
            if last != "CommonRequest":
                raise DeriveError(f"{self.path}:{node.lineno}: {last}(...) without literal product and action")
        return []


# --------------------------------------------------------------------------- the derivation


def derive(sources: Mapping[str, str]) -> list[Call]:
    """Every cloud call site in ``sources`` (``{relative path: text}``), each with its sides.

    Raises:
        DeriveError: a call that cannot be mapped to an action (an unknown oss2 method, an
            operation name two services in reach share, an RPC request without literals).
    """
    scans = {p: _scan(p, t) for p, t in sources.items()}
    mods = {module_name(p): p for p in scans}
    known = set(mods)
    graph = {module_name(p): s.imported_names & known for p, s in scans.items()}
    reach = {m: _closure([m], graph) for m in graph}
    sides = {side: _closure([module_name(p) for p in scans if side_of(p) == side], graph)
             for side in (CONTROL, NODE)}
    out: list[Call] = []
    for path, scan in scans.items():
        mod = module_name(path)
        services = set().union(*(scans[mods[m]].services for m in reach[mod]))
        on = frozenset(side for side, members in sides.items() if mod in members)
        for call in _calls(scan, frozenset(services)):
            out.append(Call(call.action, call.cloud, call.path, call.line, call.via, on))
    return sorted(out, key=lambda c: (c.action, c.path, c.line))
