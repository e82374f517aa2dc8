"""A DeepSpeed ZeRO engine (stage 1, 2 or 3) rebuilt at another data-parallel size in its running processes.

What :class:`trainer.examples.deepspeed_zero2.DeepSpeedJob` does around an in-process
resize (shrink, grow; :mod:`trainer.resize`) or a loss's rebuild from the copies
(:mod:`trainer.integrations.deepspeed_replicas`), on every rank::

    old group   deepspeed_p2p.stage(...)           each rank keeps its partitions, the
                                                   old layout's tables all-gathered, the
                                                   scalars (AdamW's step, the param groups'
                                                   hyperparameters, the LR scheduler, the
                                                   engine's counters: :func:`scalars`)
    (the group changes: trainer.runtime.regroup; a joiner takes the tables from rank 0)
    new group   release_engine(engine)             its hooks off the model, DeepSpeed's
                                                   process-global groups of the old world dropped
                deepspeed.initialize(...)          a new model and optimizer at the new size,
                                                   without DeepSpeed's broadcast of rank 0's
                                                   parameters (:func:`no_model_broadcast`)
                deepspeed_p2p.fill(...)            the optimizer's state created
                                                   (:func:`create_optimizer_state`), every
                                                   partition filled peer to peer, the model
                                                   made from it, the scalars set (:func:`set_scalars`)

:func:`gather_full_state` gives the whole state on every rank through DeepSpeed's public
ZeRO API (``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``;
https://deepspeed.readthedocs.io/en/latest/zero3.html, "Debugging": an all-reduce of the
ranks' fragments per tensor for ZeRO-1/2, an all-gather for ZeRO-3; 12 bytes per parameter
with AdamW): the tests hash it before and after a resize. No resize uses it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

import torch

from trainer.integrations.meta import allocate_optimizer_state

__all__ = ["FullState", "create_optimizer_state", "gather_full_state", "no_model_broadcast", "optimizer_step",
           "release_engine", "scalars", "set_scalars", "zero_stage"]

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


def _check_stage(engine: Any) -> int:
    stage = zero_stage(engine)
    if stage not in (1, 2, 3):
        raise ValueError(f"an in-process resize of a DeepSpeed engine needs ZeRO stage 1, 2 or 3, this one runs "
                         f"stage {stage} (set --resize restart, or zero_optimization.stage 1, 2 or 3)")
    return stage


def _base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer under ZeRO's wrapper: it steps the flat fp32 partitions."""
    return engine.optimizer.optimizer


def gather_full_state(engine: Any, model: torch.nn.Module) -> FullState:
    """Collective over the engine's data-parallel group: the whole training state, on every rank.

    Args:
        engine: a ``DeepSpeedEngine`` with ZeRO stage 1, 2 or 3, at a step boundary.
        model: the module the engine was built on (its parameters name the state).

    Returns:
        :data:`FullState`, CPU tensors (fp32 master copies and optimizer moments, each of its
        parameter's full shape): about 12 bytes per parameter with AdamW.

    Raises:
        ValueError: the engine runs ZeRO stage 0.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _check_stage(engine)
    base = _base_optimizer(engine)
    keys = sorted({k for st in base.state.values() for k, v in st.items()
                   if k != "step" and torch.is_tensor(v) and v.dim() > 0})
    params: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        params[name] = safe_get_full_fp32_param(p).detach().cpu().clone()
        optim[name] = {k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in keys}
    return {"params": params, "optim": optim, **scalars(engine)}


def optimizer_step(engine: Any) -> int | None:
    """The torch optimizer's step count over this rank's partitions (None: no state yet).

    Raises:
        RuntimeError: the partitions are at different steps.
    """
    steps = {int(st["step"]) for st in _base_optimizer(engine).state.values() if "step" in st}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's partitions are at different steps {sorted(steps)}")
    return next(iter(steps)) if steps else None


def scalars(engine: Any) -> dict[str, Any]:
    """The state's values other than tensors, the same on every rank: ``optim_step``
    (:func:`optimizer_step`), ``groups`` (the param groups' hyperparameters),
    ``lr_scheduler`` (its state dict, or None) and ``counters`` (the engine's)."""
    base = _base_optimizer(engine)
    sched = getattr(engine, "lr_scheduler", None)
    return {
        "optim_step": optimizer_step(engine),
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups],
        "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        "counters": {c: int(getattr(engine, c)) for c in _COUNTERS if hasattr(engine, c)},
    }


def create_optimizer_state(engine: Any, stage: int) -> None:
    """Have the engine's torch optimizer create its per-partition state (torch optimizers
    create it on their first step): one step on zero gradients, then, for ZeRO-1/2, link
    each parameter's fragment of it, as ZeRO's own first step does
    (``_lazy_init_hp_params_optimizer_state``, which ``safe_set_full_optimizer_state``
    writes through). ZeRO-3 steps its optimizer one sub-group at a time, the group's
    ``params`` set to that flat partition only for the step (``_optimizer_step``), and
    reads the state directly: the same here. The step moves the partitions (weight
    decay) and leaves moments: the peer-to-peer fill overwrites both
    (:func:`trainer.integrations.deepspeed_p2p.fill`). ZeRO-1/2's
    state is allocated in the step's form instead, zeroed (the partitions' padding is no
    parameter's: nothing overwrites it), where the optimizer allows it
    (:func:`~trainer.integrations.meta.allocate_optimizer_state`)."""
    base = _base_optimizer(engine)
    if stage == 3:  # ZeRO-3 hands the optimizer one flat partition at a time (its sub-groups)
        z3 = engine.optimizer
        for sub, flat in enumerate(z3.fp32_partitioned_groups_flat):
            group = base.param_groups[z3.sub_group_to_group_id[sub]]
            params, grad = group["params"], flat.grad
            group["params"], flat.grad = [flat], torch.zeros_like(flat)
            try:
                base.step()
            finally:
                group["params"], flat.grad = params, grad
        return
    if not allocate_optimizer_state(base, zeroed=True):  # its form, without the step's arithmetic
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


def set_scalars(engine: Any, state: dict[str, Any]) -> None:
    """Set a rebuilt engine's values other than tensors from ``state`` (:func:`scalars`):
    AdamW's step count on every partition, the param groups' hyperparameters, the LR
    scheduler and the engine's counters.

    ``micro_steps`` is set to ``global_steps`` times the new engine's gradient accumulation
    steps, not carried over: DeepSpeed takes the accumulation boundary from it
    (``(micro_steps + 1) % gradient_accumulation_steps() == 0``), and a count made at
    another world size (another number of micro-batches per step) is mostly not a
    multiple of the new one. Carried over, the optimizer stepped after the first
    micro-batch of each step and took the rest into the next step's update (a grow from
    2 to 3 ranks at step 5 of a global batch of 12 in micro-batches of 2: 15 micro-steps,
    2 per step from then on)."""
    base = _base_optimizer(engine)
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
    if hasattr(engine, "micro_steps"):  # the next micro-batch is the first of a step (a resize is at a boundary)
        engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()


@contextlib.contextmanager
def no_model_broadcast() -> Iterator[None]:
    """``deepspeed.initialize`` inside it skips the engine's broadcast of every parameter
    from the data-parallel group's first rank: ``DeepSpeedEngine._configure_distributed_model``
    calls ``_broadcast_model`` for any model not built under ``zero.Init`` (DeepSpeed
    0.19.8, runtime/engine.py), so a resize's engine, over a model allocated and not
    initialised, sent rank 0's garbage to every rank (807 MB each at 200 M parameters in
    fp32) before :func:`deepspeed_p2p.fill <trainer.integrations.deepspeed_p2p.fill>` set
    every value anyway. Only for an engine whose every parameter is set after it. Patches
    the class for the block (one thread builds engines); a DeepSpeed without that method
    is left alone, and then broadcasts, slower but right."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine.__dict__.get("_broadcast_model")
    if original is None:
        yield
        return
    DeepSpeedEngine._broadcast_model = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original  # type: ignore[method-assign]


def release_engine(engine: Any) -> None:
    """Before a new engine is built in this process: take ``engine``'s hooks off its model
    (``DeepSpeedEngine.destroy``) and drop DeepSpeed's process-global communication state,
    built over the group that is gone (its comm backend ``deepspeed.comm.comm.cdb`` and the
    groups ``deepspeed.utils.groups`` cloned from the old world), and restart ZeRO-3's
    parameter and module numbering (:func:`_restart_zero3_ids`): the next
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
    _restart_zero3_ids()
    gc.collect()


def _restart_zero3_ids() -> None:
    """ZeRO-3 numbers parameters and modules from process-global counters (``Init.param_id``
    and the mutable default ``count`` of ``DeepSpeedZeRoOffload._register_deepspeed_module``,
    DeepSpeed 0.19) and checks at each forward that every rank traced the same module ids
    (``assert_ints_same_as_other_ranks``). A joiner's process numbers its first engine from
    0; the survivors' rebuilt one would go on from their old engine's last id: both start
    again from 0, so every rank of the new group numbers the same model alike."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    defaults = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__
    if defaults and isinstance(defaults[0], list) and defaults[0]:
        defaults[0][0] = 0
