"""Small metadata between ranks as JSON in tensors, never pickled.

``torch.distributed.all_gather_object`` and ``broadcast_object_list`` pickle on the
sender and unpickle on every receiver, and unpickling runs whatever code the bytes ask
for (https://docs.python.org/3/library/pickle.html, the warning at the top): a peer
that should not be in the group (issue 25: an outsider that joined through the
rendezvous store) would run code in every rank. The membership paths (a grow's node
keys and the state's progress, a loss's steps, the notices at a step boundary) send
only strings, numbers, lists and dicts, so they go as UTF-8 JSON in a ``uint8`` tensor,
after an ``int64`` tensor of the lengths: two collectives, as ``all_gather_object``
makes, and a peer's bytes are parsed, not executed. A payload over
:data:`MAX_BYTES` is refused on every rank that receives it (a length is all it takes
to make a receiver allocate).

Tensors live where the group's backend needs them: the current CUDA device for NCCL,
the CPU otherwise.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json", "decode_tree", "encode_tree", "MAX_BYTES", "TreeError"]

#: The largest payload (bytes of JSON) a rank accepts from a peer.
MAX_BYTES = 1 << 20


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _decode(buf: torch.Tensor, length: int) -> Any:
    return json.loads(buf[:length].cpu().numpy().tobytes())


def _check(length: int, limit: int = MAX_BYTES) -> None:
    if not 0 < length <= limit:
        raise ValueError(f"a peer sent {length} bytes of metadata (at most {limit})")


def all_gather_json(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON: str, int, float, bool, None, lists, dicts with str
    keys; a tuple comes back a list), in rank order of ``group`` (default: the default
    group), the same list on every rank. Collective.

    Raises:
        ValueError: a payload is over :data:`MAX_BYTES`, or is not JSON (every rank raises:
            they all hold the same bytes); ``obj`` is not JSON (this rank only, before any
            collective).
    """
    data = _encode(obj)
    device, n = _device(group), dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    for length in lengths:
        _check(length)
    buf = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [_decode(b, length) for b, length in zip(bufs, lengths)]


def broadcast_json(obj: Any, *, src: int, group: Any = None, limit: int = MAX_BYTES) -> Any:
    """``obj`` of rank ``src`` (a global rank, as ``broadcast`` takes it; JSON as in
    :func:`all_gather_json`) on every rank of ``group``; ``obj`` is ignored elsewhere.
    Every rank, ``src`` too, returns it as JSON parsed it (tuples are lists). Collective.

    Raises:
        ValueError: (receivers) the payload is over ``limit`` bytes (default
            :data:`MAX_BYTES`) or not JSON.
    """
    is_src = dist.get_rank() == src
    data = _encode(obj) if is_src else b""
    device = _device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    length = int(size.item())
    if not is_src:
        _check(length, limit)
    if is_src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(data) if is_src else _decode(buf, length)


class TreeError(ValueError):
    """A value :func:`encode_tree` cannot send, or an encoding :func:`decode_tree` refuses."""


def encode_tree(obj: Any, tensors: list[torch.Tensor], path: str = "") -> Any:
    """``obj`` (a ``state_dict``'s kind of tree: dicts, ordered dicts, lists, tuples,
    tensors, dtypes and plain values) as JSON: each container a one-key object naming its
    kind (``{"D": [[key, value], ...]}``; ``O`` an ``OrderedDict``, ``L`` a list, ``T`` a
    tuple, ``S`` a ``torch.Size``), a tensor ``{"X": [shape, dtype]}`` with the tensor
    appended to ``tensors`` (sent apart, in that order), a dtype ``{"Y": name}``, a
    float that is not finite ``{"F": "nan"}``; None, booleans, integers, finite floats and
    strings as themselves. Dict keys are encoded the same way (an optimizer's state is keyed
    by integers). Nothing is pickled: a receiver parses it (:func:`decode_tree`).

    Raises:
        TreeError: a value of another type (a namedtuple, a set, an object), naming where.
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"X": [list(obj.shape), str(obj.dtype).removeprefix("torch.")]}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else {"F": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"Y": str(obj).removeprefix("torch.")}
    kind = {dict: "D", OrderedDict: "O", list: "L", tuple: "T", torch.Size: "S"}.get(type(obj))
    if kind in ("D", "O"):
        return {kind: [[encode_tree(k, tensors, f"{path}/key"), encode_tree(v, tensors, f"{path}/{k}")]
                       for k, v in obj.items()]}
    if kind is not None:
        return {kind: [encode_tree(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    raise TreeError(f"{path or '/'}: a {type(obj).__name__} cannot be sent to a peer (dicts, lists, tuples, "
                    "tensors, dtypes and plain values can)")


def decode_tree(enc: Any, tensor: Any) -> Any:
    """The tree :func:`encode_tree` encoded, with ``tensor(shape, dtype)`` called for each
    tensor in order (the receiver allocates it; its values come apart).

    Raises:
        TreeError: an encoding :func:`encode_tree` does not make (an unknown kind, a dtype
            torch has not, a negative dimension, an unhashable key).
    """
    if enc is None or isinstance(enc, (bool, int, float, str)):
        return enc
    if not (isinstance(enc, dict) and len(enc) == 1):
        raise TreeError(f"not an encoded tree: {type(enc).__name__}")
    (kind, body), = enc.items()
    if kind in ("D", "O") and isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in body):
        out = OrderedDict() if kind == "O" else {}
        for k, v in body:
            key = decode_tree(k, tensor)
            try:
                out[key] = decode_tree(v, tensor)
            except TypeError:
                raise TreeError(f"an unhashable key ({type(key).__name__})") from None
        return out
    if kind in ("L", "T", "S") and isinstance(body, list):
        items = [decode_tree(v, tensor) for v in body]
        return items if kind == "L" else tuple(items) if kind == "T" else torch.Size(items)
    if kind == "X" and isinstance(body, list) and len(body) == 2:
        shape, name = body
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise TreeError(f"a tensor's shape {shape!r}")
        return tensor(tuple(shape), _dtype(name))
    if kind == "Y":
        return _dtype(body)
    if kind == "F" and body in ("nan", "inf", "-inf"):
        return float(body)
    raise TreeError(f"not an encoded tree: kind {kind!r}")


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise TreeError(f"{name!r} is not a torch dtype")
    return dtype
