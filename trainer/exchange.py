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
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_json", "broadcast_json", "MAX_BYTES"]

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


def _check(length: int) -> None:
    if not 0 < length <= MAX_BYTES:
        raise ValueError(f"a peer sent {length} bytes of metadata (at most {MAX_BYTES})")


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


def broadcast_json(obj: Any, *, src: int, group: Any = None) -> Any:
    """``obj`` of rank ``src`` (a global rank, as ``broadcast`` takes it; JSON as in
    :func:`all_gather_json`) on every rank of ``group``; ``obj`` is ignored elsewhere.
    Every rank, ``src`` too, returns it as JSON parsed it (tuples are lists). Collective.

    Raises:
        ValueError: (receivers) the payload is over :data:`MAX_BYTES` or not JSON.
    """
    is_src = dist.get_rank() == src
    data = _encode(obj) if is_src else b""
    device = _device(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    length = int(size.item())
    if not is_src:
        _check(length)
    if is_src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(length, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    return json.loads(data) if is_src else _decode(buf, length)
