"""A DeepSpeed ZeRO-1/2 engine rebuilt at another data-parallel size in its running processes.

What :class:`trainer.examples.deepspeed_zero2.DeepSpeedJob` does around an in-process
resize (shrink, grow; :mod:`trainer.resize`), on every rank::

    old group   gather_full_state(engine, model)   every parameter's full fp32 master copy,
                                                   its optimizer moments, AdamW's step, the
                                                   param groups' hyperparameters, the LR
                                                   scheduler and the engine's counters
    (the group changes: trainer.runtime.regroup; a joiner takes the state from rank 0)
    new group   release_engine(engine)             its hooks off the model, DeepSpeed's
                                                   process-global groups of the old world dropped
                deepspeed.initialize(...)          a new model and optimizer at the new size
                set_full_state(engine, model, s)   the optimizer's state created, then every
                                                   tensor and counter set from ``s``

The gather and the set go through DeepSpeed's public ZeRO API
(``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` and their
``safe_set_full_*``; https://deepspeed.readthedocs.io/en/latest/zero3.html, "Debugging"):
for ZeRO-1/2 each get is an all-reduce of the ranks' fragments over the data-parallel
group, so every rank of the old group holds the whole state in host memory (12 bytes per
parameter with AdamW) for the moment of the resize. ZeRO-1/2 keep the whole model (the
low-precision parameters) on every rank; they are set from the master copy directly.
ZeRO-3 partitions the parameters too and is refused here (:class:`ValueError`).

The state is a tree of tensors and plain values (:data:`FullState`), so
:func:`trainer.runtime.broadcast_state` can send it to a joiner as it is.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any

import torch

__all__ = ["FullState", "gather_full_state", "set_full_state", "release_engine", "zero_stage"]

log = logging.getLogger(__name__)

#: ``{"params": {name: fp32 tensor}, "optim": {name: {key: fp32 tensor}}, "optim_step": int | None,
#: "groups": [hyperparameters of each param group], "lr_scheduler": state dict | None,
#: "counters": {name: int}}``: tensors of each parameter's full shape, on the CPU.
FullState = dict[str, Any]

#: The engine's own counters of progress (``DeepSpeedEngine`` attributes).
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def zero_stage(engine: Any) -> int:
    """The ZeRO stage ``engine`` runs (0-3)."""
    return int(engine.zero_optimization_stage())


def _check_stage(engine: Any) -> None:
    stage = zero_stage(engine)
    if stage not in (1, 2):
        raise ValueError(f"an in-process resize of a DeepSpeed engine needs ZeRO stage 1 or 2, this one runs "
                         f"stage {stage} (set --resize restart, or zero_optimization.stage 1 or 2)")


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer under ZeRO's wrapper: it steps the flat fp32 partitions."""
    return engine.optimizer.optimizer


def gather_full_state(engine: Any, model: torch.nn.Module) -> FullState:
    """Collective over the engine's data-parallel group: the whole training state, on every rank.

    Args:
        engine: a ``DeepSpeedEngine`` with ZeRO stage 1 or 2, at a step boundary.
        model: the module the engine was built on (its parameters name the state).

    Returns:
        :data:`FullState`, CPU tensors (fp32 master copies and optimizer moments, each of its
        parameter's full shape): about 12 bytes per parameter with AdamW.

    Raises:
        ValueError: the engine runs ZeRO stage 0 or 3.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _check_stage(engine)
    base = _base_optimizer(engine)
    keys = sorted({k for st in base.state.values() for k, v in st.items()
                   if k != "step" and torch.is_tensor(v) and v.dim() > 0})
    steps = {int(st["step"]) for st in base.state.values() if "step" in st}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's partitions are at different steps {sorted(steps)}")
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        params[name] = safe_get_full_fp32_param(p).detach().cpu().clone()
        optim[name] = {k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in keys}
    sched = getattr(engine, "lr_scheduler", None)
    return {
        "params": params,
        "optim": optim,
        "optim_step": next(iter(steps)) if steps else None,
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "counters": {c: int(getattr(engine, c)) for c in _COUNTERS if hasattr(engine, c)},
    }


def _create_optimizer_state(engine: Any) -> None:
    """Have the engine's torch optimizer create its per-partition state (torch optimizers
    create it on their first step): one step on zero gradients, then link each parameter's
    fragment of it, as ZeRO's own first step does (``_lazy_init_hp_params_optimizer_state``,
    which the ``safe_set_full_optimizer_state`` below writes through). The step moves the
    partitions (weight decay) and leaves moments: :func:`set_full_state` overwrites both."""
    base = _base_optimizer(engine)
    params = [p for g in base.param_groups for p in g["params"]]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    base.step()
    for p, g in zip(params, saved):
        p.grad = g
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is None:
        raise RuntimeError(f"this DeepSpeed's {type(engine.optimizer).__name__} cannot link its optimizer state "
                           "to the parameters before a step: use --resize restart")
    link()


def set_full_state(engine: Any, model: torch.nn.Module, state: FullState) -> None:
    """Set a freshly built engine (any data-parallel size) to ``state`` of :func:`gather_full_state`.

    Every rank of the engine's group calls it with the same ``state``; nothing is exchanged:
    each rank copies its own fragments of the fp32 master copies and moments, and the whole
    low-precision model (ZeRO-1/2 keep it on every rank).

    Raises:
        ValueError: the engine runs ZeRO stage 0 or 3.
        KeyError: ``state`` lacks a parameter of ``model`` (another model).
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    _check_stage(engine)
    base = _base_optimizer(engine)
    if state["optim_step"] is not None and not base.state:
        _create_optimizer_state(engine)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            full = state["params"][name]
            safe_set_full_fp32_param(p, full.to(p.device))
            for key, value in state["optim"][name].items():
                safe_set_full_optimizer_state(p, value.to(p.device), key)
            p.data.copy_(full.view_as(p).to(p.device, p.dtype))
    if state["optim_step"] is not None:
        for st in base.state.values():
            st["step"] = (torch.full_like(st["step"], state["optim_step"]) if torch.is_tensor(st["step"])
                          else state["optim_step"])
    for group, saved in zip(base.param_groups, state["groups"]):
        group.update(saved)
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and state["lr_scheduler"] is not None:
        sched.load_state_dict(state["lr_scheduler"])
    for name, value in state["counters"].items():
        setattr(engine, name, value)


def release_engine(engine: Any) -> None:
    """Before a new engine is built in this process: take ``engine``'s hooks off its model
    (``DeepSpeedEngine.destroy``) and drop DeepSpeed's process-global communication state,
    built over the group that is gone (its comm backend ``deepspeed.comm.comm.cdb`` and the
    groups ``deepspeed.utils.groups`` cloned from the old world): the next
    ``deepspeed.initialize`` builds them again over the new default group. The default
    group itself is torch's (:func:`trainer.runtime.regroup` replaces it)."""
    import deepspeed.comm.comm as ds_comm
    from deepspeed.utils import groups as ds_groups

    if engine is not None:
        try:
            engine.destroy()
        except RuntimeError as exc:  # a lost peer's group: nothing left on it to wait for
            log.warning("releasing the old DeepSpeed engine: %s", str(exc).splitlines()[0][:200])
    release = getattr(ds_groups, "_release_process_group_references", None)
    if release is not None:
        release(group=None)
    else:  # an older DeepSpeed without that function: the module's globals themselves
        for name in ("_WORLD_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                     "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
            with contextlib.suppress(AttributeError):
                setattr(ds_groups, name, None)
    ds_comm.cdb = None
    gc.collect()
