"""A model built on the meta device (shapes only, no initialisation), then allocated:
for state that is about to be overwritten (a resize's, a peer's), at no cost of
initialising it first (3 s of CPU for 150 M parameters; 0.03 s on the meta device)."""

from __future__ import annotations

import torch

__all__ = ["materialize", "rebuild_optimizer"]


def rebuild_optimizer(opt: torch.optim.Optimizer, names: dict[int, str],
                       params: dict[str, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The same optimizer (class, groups, every group's hyperparameters) over new parameter objects.

    ``names`` maps ``id(old parameter)`` to its name; ``params`` maps the name to the new one.

    Raises:
        ValueError: the optimizer already has state (it must be rebuilt before its first step).
    """
    if opt.state:
        raise ValueError("the optimizer has state already: shard the model before the first step")
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [params[names[id(p)]] for p in g["params"]]}
        for g in opt.param_groups
    ]
    return type(opt)(groups)


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-device ``model`` (built without initialisation) on ``device``,
    uninitialised, in place, keeping tied parameters tied (``Module.to_empty`` gives each
    module its own copy of a parameter two modules share, e.g. GPT-2's ``lm_head`` and
    ``wte``; FSDP2's sharded parameters stay shared)."""
    first: dict[int, str] = {}
    aliases: list[tuple[str, str]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases.append((name, first[id(p)]))
        else:
            first[id(p)] = name
    model.to_empty(device=device)
    for alias, name in aliases:
        owner, _, attr = alias.rpartition(".")
        shared = model.get_parameter(name)
        if model.get_parameter(alias) is not shared:
            setattr(model.get_submodule(owner), attr, shared)
