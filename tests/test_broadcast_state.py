"""A joiner (or a survivor a step behind) takes a peer's state (``trainer.runtime.
broadcast_state``): the same nested structure, tensors and plain values, with nothing
unpickled (the structure goes as JSON, ``trainer.exchange.encode_tree``; it used to be
pickled, so a peer's bytes could run code in the receiver, and torch 2.13's pytree spec
logged a ``FutureWarning`` on every receiving rank of every grow)."""

from __future__ import annotations

import json
import math
import warnings
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.exchange import TreeError, decode_tree, encode_tree


def _state() -> dict:
    model = OrderedDict([("wte.weight", torch.arange(12.0).reshape(3, 4)), ("ln.bias", torch.ones(4))])
    optim = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((3, 4), 0.5)}},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "params": [0, 1]}]}
    return {"model": model, "optimizer": optim, "step": 7, "mask": torch.tensor([True, False]),
            "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "scale": float("inf")}


def _same(got: dict, want: dict) -> bool:
    return (list(got["model"]) == list(want["model"]) and isinstance(got["model"], OrderedDict)
            and all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
            and torch.equal(got["optimizer"]["state"][0]["exp_avg"], want["optimizer"]["state"][0]["exp_avg"])
            and got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
            and isinstance(got["optimizer"]["param_groups"][0]["betas"], tuple)
            and got["step"] == 7 and torch.equal(got["mask"], want["mask"]) and got["dtype"] is torch.bfloat16
            and isinstance(got["size"], torch.Size) and got["size"] == want["size"] and math.isinf(got["scale"]))


class _Refused:
    """Stands in for ``pickle.Unpickler`` in torch's object collectives."""

    def __init__(self, *_: object) -> None:
        raise AssertionError("a peer's bytes were unpickled")


def _worker(rank: int, tmp: str) -> None:
    from trainer.runtime import broadcast_state

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    dist.distributed_c10d._unpickler = _Refused
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = broadcast_state(_state() if rank == 0 else None, src=0, device=torch.device("cpu"))
    refused = None
    try:  # a value no receiver could rebuild: every rank is told, none waits for tensors
        broadcast_state({"ids": {1, 2}} if rank == 0 else None, src=0, device=torch.device("cpu"))
    except TreeError as exc:
        refused = str(exc)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps({"same": _same(got, _state()), "refused": refused,
                                                         "warnings": [str(w.message) for w in seen]}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_receiver_gets_the_state_whole_unpickled_and_logs_no_torch_warning(tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(str(tmp_path),), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["same"] for g in got] == [True, True], got
    assert got[1]["warnings"] == [], got[1]
    assert all(g["refused"] and "/ids: a set cannot be sent" in g["refused"] for g in got), got


def test_the_encoding_is_parsed_never_run() -> None:
    tensors: list[torch.Tensor] = []
    enc = encode_tree({3: [(1, "a")], "n": float("nan")}, tensors)
    assert json.loads(json.dumps(enc, allow_nan=False)) == enc  # plain JSON, no NaN literal
    back = decode_tree(enc, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    assert back[3] == [(1, "a")] and math.isnan(back["n"])
    for bad in ({"Y": "os.system"}, {"Y": "Tensor"}, {"X": [[-1], "float32"]}, {"Q": []}, [1],
                {"D": [[{"L": []}, 1]]}, {"X": [[2], "float32"], "L": []}):
        with pytest.raises(TreeError):
            decode_tree(bad, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    with pytest.raises(TreeError, match=r"/x/0: a Point cannot be sent"):
        from collections import namedtuple

        encode_tree({"x": [namedtuple("Point", "a b")(1, 2)]}, [])
