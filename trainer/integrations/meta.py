"""A model built on the meta device (shapes only, no initialisation), then allocated:
for state that is about to be overwritten (a resize's, a peer's), at no cost of
initialising it first (3 s of CPU for 150 M parameters; 0.03 s on the meta device)."""

from __future__ import annotations

import torch

__all__ = ["allocate_optimizer_state", "materialize", "on_meta", "rebuild_optimizer"]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether ``model`` is built on the meta device (shapes only, nothing allocated)."""
    return any(p.is_meta for p in model.parameters())


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


def allocate_optimizer_state(opt: torch.optim.Optimizer, *, zeroed: bool = False) -> bool:
    """Give every parameter of ``opt`` the state its optimizer's first step would create,
    allocated and not computed, for state about to be overwritten (a resize's): each
    tensor of a parameter's shape ``torch.empty_like`` it (uninitialised; a DTensor for a
    DTensor parameter, as the step would make), ``step`` a copy of a first step's.

    The form of the state is read off a first step of the same optimizer class, with the
    same group's hyperparameters, over a 3 x 2 probe parameter on the parameter's device:
    nothing of it is assumed. An optimizer whose state holds anything else (a tensor of
    another shape, a value other than ``step``: Adafactor's factored moments) is left
    untouched and False returned: the caller then takes the step on zero gradients
    itself, as it does for a group whose parameters differ in dtype or device. Creating
    AdamW's state this way skips the step's arithmetic over the whole shard and its zero
    gradients (0.8-1.0 s per rank at 200 M parameters on 2 CPU cores).

    An optimizer that has state already (Adagrad creates it when constructed) is left
    alone too, and False returned. ``zeroed``: the tensors are zeros, not uninitialised,
    for state of which only a part is overwritten (ZeRO's flat partitions: the padding
    after the last parameter's fragment is no parameter's).
    """
    from torch.distributed.tensor import DTensor

    if opt.state:
        return False  # made already (Adagrad makes it at construction), or stepped
    forms: list[list[tuple[str, torch.Tensor, bool]]] = []
    for group in opt.param_groups:
        if not group["params"]:
            forms.append([])
            continue
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in group["params"]]
        local = locals_[0]
        if any(t.dtype != local.dtype or t.device != local.device for t in locals_):
            return False  # one probe stands for the whole group
        probe = torch.nn.Parameter(torch.zeros((3, 2), dtype=local.dtype, device=local.device))
        try:
            trial = type(opt)([{**{k: v for k, v in group.items() if k != "params"}, "params": [probe]}])
        except (TypeError, ValueError, RuntimeError):
            return False  # an optimizer that cannot be built from its groups alone
        probe.grad = torch.zeros_like(probe)
        trial.step()
        form = []
        for key, value in trial.state[probe].items():
            if torch.is_tensor(value) and value.shape == probe.shape:
                form.append((key, value, True))
            elif key == "step" and torch.is_tensor(value) and value.dim() == 0:
                form.append((key, value, False))
            else:
                return False
        forms.append(form)
    make = torch.zeros_like if zeroed else torch.empty_like
    for group, form in zip(opt.param_groups, forms):
        for p in group["params"]:
            opt.state[p] = {key: (make(p, dtype=value.dtype) if like else value.clone())
                            for key, value, like in form}
    return True
