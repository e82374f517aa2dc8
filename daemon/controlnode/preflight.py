"""Pre-flight: will the job fit on an offer's GPUs, and can a checkpoint be flushed
inside a spot notice window?

Both questions are answered before anything is bought (``spotvisord check-config``,
``spotvisord preflight``, and the supervisor at start), and the second again after
every ``checkpoint_committed`` from the figures the trainer measured.

**Memory per GPU** (bytes), for Ψ parameters of which a fraction f is trained,
ZeRO sharding degree N_d = world size (every rank is a data-parallel rank):

- model states — ZeRO paper, Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054
  §3.1 and Figure 1: mixed precision with fp32 master weights holds 2Ψ (16-bit
  params) + 2Ψ (16-bit grads) + KΨ (optimizer), K = 12 for Adam (fp32 master,
  momentum, variance). Here K = 4 (master) + 8 (AdamW) | 4 (SGD momentum) |
  ≈ 8/h (Adafactor's factored second moment: a row and a column vector per matrix,
  Shazeer & Stern 2018, https://arxiv.org/abs/1804.04235). fp32 training: 4Ψ + 4Ψ
  + KΨ with K = 8 | 4 | ≈ 8/h. ZeRO-1 divides the optimizer term by N_d, ZeRO-2
  also the gradients, ZeRO-3 (= FSDP FULL_SHARD) all three. LoRA: the frozen base
  keeps its params only; gradients and optimizer state exist for fΨ.
  With ZeRO >= 1 in 16-bit, DeepSpeed also keeps an fp32 gradient partition for the
  optimizer step, 4Ψ/N_d more, counted with the optimizer term: ZeRO-2 then comes to
  DeepSpeed's own ``estimate_zero2_model_states_mem_needs`` figure, 2Ψ + 18Ψ/N_d
  ("18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit").
- activations — Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198 §4.1 eq. (1):
  s·b·h·(34 + 5·a·s/h) bytes per transformer layer (16-bit activations, no tensor
  parallelism), s = sequence length, b = micro batch, h = hidden size, a = heads.
  The 5as/h term is the stored attention scores, softmax and dropout mask; FlashAttention
  (Dao et al. 2022, https://arxiv.org/abs/2205.14135) never stores them, so with
  ``flash_attention`` a layer holds 34sbh. Full activation recomputation (§4.2)
  keeps 2sbh per layer, plus one layer's full set while it is recomputed. The logits
  for the loss add 4·s·b·v (fp32, §4.3). fp32 activations double the 16-bit figures.
  The MLP term assumes a 4h GeLU MLP; SwiGLU models (LLaMA, Qwen) come within ~15 %.
- ZeRO-3 gathers one layer's full parameters at a time and prefetches the next:
  2 · max(12h², v·h) parameters in 16-bit (PyTorch FSDP docs, ``backward_prefetch``).
- plus ``fragmentation`` (default 10 %) on all of the above for the caching
  allocator, and a fixed ``cuda_overhead_gib`` (default 1.5 GiB) for the CUDA
  context, NCCL and cuBLAS workspaces, which the allocator never reports (PyTorch
  docs, "CUDA semantics", memory management).

**Checkpoint bytes** (what a commit writes): the model in its working precision plus
the optimizer state including fp32 master weights (DeepSpeed's layout: 2Ψ + 12Ψ for
mixed-precision Adam); LoRA saves only the adapters and their state. The busiest
node is rank 0's: ZeRO-0 writes everything there; ZeRO-1/2 write the model once
(rank 0) and each rank its optimizer partition; ZeRO-3/FSDP each rank its shard.

**Flush time** on that node = bytes / save throughput (local write) + bytes / upload
throughput (to the object store), compared with each provider's notice window
(:data:`daemon.gpunode.metadata.registry.DOCUMENTED_LEAD_S`; the local provider's window is
its chaos schedule's shortest notice lead). The window must also cover the rest of
the current step and one metadata poll; that is what ``flush_safety_factor`` is for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from daemon.catalog import PRESETS, Architecture
from daemon.gpunode.metadata.registry import DOCUMENTED_LEAD_S

if TYPE_CHECKING:
    from daemon.config import Config, OfferSpec

__all__ = [
    "GIB",
    "offer_gib",
    "Setup",
    "resolve",
    "MemoryEstimate",
    "activation_bytes",
    "estimate_memory",
    "checkpoint_bytes_per_node",
    "Flush",
    "estimate_flush",
    "DeadlineCheck",
    "check_deadline",
    "REMEDY",
    "NO_FIT_FIX",
    "OfferFit",
    "world_size_bounds",
    "offer_fits",
    "no_fit_message",
    "notice_windows",
    "estimated_deadline_checks",
    "measured_deadline_checks",
    "Startup",
    "at_start",
]

GIB = 2**30

REMEDY = (
    "commit background checkpoints more often (job.checkpoint_interval_steps), put fewer bytes "
    "on each node (a higher job.model.zero_stage, more nodes), or use a faster store/network"
)
NO_FIT_FIX = (
    "more nodes (pool.min_nodes), a higher job.model.zero_stage, a bigger GPU, "
    "or job.model.activation_checkpointing: true"
)


@dataclass(frozen=True, slots=True)
class Setup:
    """A resolved ``job.model``: what the estimates need. Fields as in ``ModelSpec``;
    ``trainable_fraction`` is 1.0 for a full fine-tune."""

    name: str
    params: float
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    seq_len: int = 2048
    precision: str = "bf16"  # fp32 | bf16 | fp16 (16-bit: mixed precision, fp32 master weights)
    optimizer: str = "adamw"  # adamw | sgd-momentum | adafactor
    zero_stage: int = 0  # 0..3; FSDP FULL_SHARD = 3, SHARD_GRAD_OP = 2
    trainable_fraction: float = 1.0
    activation_checkpointing: bool = False
    flash_attention: bool = True
    cuda_overhead_gib: float = 1.5
    fragmentation: float = 0.10

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter (and per gradient) in the working precision."""
        return 4 if self.precision == "fp32" else 2

    @property
    def optimizer_bytes(self) -> float:
        """K: optimizer-state bytes per trained parameter (fp32 master weights included)."""
        master = 0 if self.precision == "fp32" else 4
        states = {"adamw": 8.0, "sgd-momentum": 4.0, "adafactor": 8.0 / self.hidden_size}[self.optimizer]
        return master + states

    def describe(self) -> str:
        lora = "" if self.trainable_fraction >= 1 else f", LoRA ({self.trainable_fraction:.3%} trained)"
        precision = self.precision if self.precision == "fp32" else f"{self.precision} mixed precision"
        return (f"{self.name} ({self.params:.3g} params), {precision}, {self.optimizer}, "
                f"ZeRO-{self.zero_stage}{lora}, seq {self.seq_len}, activation checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}")


def resolve(spec: Any) -> Setup:
    """A :class:`Setup` from a ``daemon.config.ModelSpec`` (preset values, then the
    spec's own fields on top). LoRA's trained fraction, when given as ``lora_rank``:
    rank r on ``lora_targets`` h×h matrices per layer adds 2·h·r parameters each
    (Hu et al. 2021, https://arxiv.org/abs/2106.09685)."""
    base = PRESETS[spec.preset] if spec.preset else None

    def pick(name: str) -> Any:
        own = getattr(spec, name)
        return own if own is not None else getattr(base, name)

    arch = Architecture(*(pick(n) for n in ("params", "hidden_size", "num_layers", "num_heads", "vocab_size")))
    fraction = 1.0
    if spec.trainable_fraction is not None:
        fraction = spec.trainable_fraction
    elif spec.lora_rank is not None:
        lora = spec.lora_targets * arch.num_layers * 2 * arch.hidden_size * spec.lora_rank
        fraction = min(1.0, lora / arch.params)
    return Setup(
        name=spec.preset or "model", params=arch.params, hidden_size=arch.hidden_size,
        num_layers=arch.num_layers, num_heads=arch.num_heads, vocab_size=arch.vocab_size, seq_len=spec.seq_len,
        precision=spec.precision, optimizer=spec.optimizer, zero_stage=spec.zero_stage, trainable_fraction=fraction,
        activation_checkpointing=spec.activation_checkpointing, flash_attention=spec.flash_attention,
        cuda_overhead_gib=spec.cuda_overhead_gib, fragmentation=spec.fragmentation,
    )


# -- memory ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Bytes per GPU at ``world_size`` ranks. ``total_bytes`` adds the margins."""

    world_size: int
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float  # ZeRO-3's gathered layers
    fragmentation: float
    overhead_bytes: float

    @property
    def total_bytes(self) -> float:
        work = self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.buffers_bytes
        return work * (1.0 + self.fragmentation) + self.overhead_bytes

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def fits(self, gib: float | None) -> bool:
        """True when it fits ``gib`` GiB per GPU; None (no GPU) has no limit."""
        return gib is None or self.total_bytes <= gib * GIB


def activation_bytes(setup: Setup, micro_batch_size: int) -> float:
    """Activation bytes per GPU for one micro batch (Korthikanti et al. 2022; module docstring)."""
    s, b, h = setup.seq_len, micro_batch_size, setup.hidden_size
    per_layer = s * b * h * (34 + (0 if setup.flash_attention else 5 * setup.num_heads * s / h))
    if setup.activation_checkpointing:
        layers = setup.num_layers * 2 * s * b * h + per_layer
    else:
        layers = setup.num_layers * per_layer
    return layers * (2 if setup.precision == "fp32" else 1) + 4 * s * b * setup.vocab_size


def estimate_memory(setup: Setup, *, world_size: int, micro_batch_size: int) -> MemoryEstimate:
    """Per-GPU memory when training ``setup`` on ``world_size`` ranks (ZeRO degree =
    world size). Formulas and sources: module docstring."""
    if world_size < 1 or micro_batch_size < 1:
        raise ValueError(f"world_size and micro_batch_size must be >= 1, got {world_size}, {micro_batch_size}")
    psi, trained = setup.params, setup.params * setup.trainable_fraction
    stage, n = setup.zero_stage, world_size
    params = psi * setup.param_bytes / (n if stage >= 3 else 1)
    grads = trained * setup.param_bytes / (n if stage >= 2 else 1)
    grad32 = 4.0 if stage >= 1 and setup.precision != "fp32" else 0.0  # DeepSpeed's fp32 gradient partition
    optim = trained * (setup.optimizer_bytes + grad32) / (n if stage >= 1 else 1)
    h = setup.hidden_size
    buffers = 2 * max(12 * h * h, setup.vocab_size * h) * setup.param_bytes if stage >= 3 and n > 1 else 0.0
    return MemoryEstimate(
        world_size=n, params_bytes=params, grads_bytes=grads, optimizer_bytes=optim,
        activations_bytes=activation_bytes(setup, micro_batch_size), buffers_bytes=buffers,
        fragmentation=setup.fragmentation, overhead_bytes=setup.cuda_overhead_gib * GIB,
    )


# -- checkpoint flush --------------------------------------------------------------------------
def checkpoint_bytes_per_node(setup: Setup, *, world_size: int, gpus_per_node: int) -> float:
    """Bytes the busiest node (rank 0's, ``gpus_per_node`` ranks of ``world_size``)
    writes per commit. See the module docstring for the layout by ZeRO stage."""
    trained = setup.params * setup.trainable_fraction
    model = trained * setup.param_bytes  # LoRA: the adapters only; the base is reloaded
    optim = trained * setup.optimizer_bytes
    share = min(1.0, gpus_per_node / world_size)
    if setup.zero_stage == 0:
        return model + optim
    if setup.zero_stage in (1, 2):
        return model + optim * share
    return (model + optim) * share


@dataclass(frozen=True, slots=True)
class Flush:
    """One node's commit: ``bytes_per_node`` written at ``upload_bytes_s`` after a local
    save of ``save_s`` seconds. Seconds, bytes, bytes/second."""

    bytes_per_node: float
    upload_bytes_s: float
    save_s: float
    upload_s: float

    @property
    def flush_s(self) -> float:
        return self.save_s + self.upload_s


def estimate_flush(bytes_per_node: float, *, upload_bytes_s: float, save_bytes_s: float) -> Flush:
    """Flush time before the job has run: bytes ÷ throughput for the save and the upload."""
    return Flush(bytes_per_node, upload_bytes_s, bytes_per_node / save_bytes_s, bytes_per_node / upload_bytes_s)


@dataclass(frozen=True, slots=True)
class DeadlineCheck:
    """A flush against one provider's notice window. ``margin`` = window_s / flush_s;
    at risk below ``safety_factor``; a miss below 1 (the flush outlasts the window)."""

    provider: str
    window_s: float
    flush: Flush
    safety_factor: float
    world_size: int | None = None
    nodes: int | None = None

    @property
    def margin(self) -> float:
        return math.inf if self.flush.flush_s <= 0 else self.window_s / self.flush.flush_s

    @property
    def at_risk(self) -> bool:
        return self.margin < self.safety_factor

    @property
    def verdict(self) -> str:
        m = self.margin
        word = "ok" if not self.at_risk else ("MISS" if m < 1 else "RISK")
        return f"{word} x{m:.1f}" if math.isfinite(m) else word

    def event_data(self, source: str) -> dict[str, Any]:
        """The ``checkpoint_deadline_risk`` event's fields (``source``: estimate | measured)."""
        f = self.flush
        return {
            "source": source, "provider": self.provider, "world_size": self.world_size, "nodes": self.nodes,
            "bytes_per_node": int(f.bytes_per_node), "throughput_bytes_s": round(f.upload_bytes_s),
            "save_s": round(f.save_s, 2), "upload_s": round(f.upload_s, 2), "flush_s": round(f.flush_s, 2),
            "window_s": self.window_s, "margin": round(self.margin, 2), "safety_factor": self.safety_factor,
            "remedy": REMEDY,
        }


def check_deadline(flush: Flush, *, provider: str, window_s: float, safety_factor: float,
                   world_size: int | None = None, nodes: int | None = None) -> DeadlineCheck:
    return DeadlineCheck(provider, window_s, flush, safety_factor, world_size, nodes)


# -- against a config --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OfferFit:
    """One offer's verdict. ``available_gib`` None: no GPU (no limit). ``smallest`` /
    ``largest``: estimates at the smallest / largest valid world size the pool can run
    with this offer (None when no valid world size includes it). Unusable = the
    smallest (least sharded, the worst case after nodes are lost) does not fit."""

    index: int
    label: str
    gpu_type: str
    available_gib: float | None
    smallest: MemoryEstimate | None
    largest: MemoryEstimate | None

    @property
    def usable(self) -> bool:
        return self.smallest is None or self.smallest.fits(self.available_gib)


def _label(i: int, o: "OfferSpec") -> str:
    return f"#{i} {o.provider}/{o.zone or o.region}/{o.instance_type}"


def offer_gib(o: "OfferSpec") -> float | None:
    return o.memory_gib()


def world_size_bounds(config: "Config", index: int) -> tuple[int, int] | None:
    """Smallest and largest valid world size with a node of offer ``index`` in it.

    The pool runs ``min_nodes``..``max_nodes`` nodes; the others may come from any
    offer, so the bounds are g + (min_nodes-1)·g_min and g + (max_nodes-1)·g_max,
    filtered by the job's valid world sizes (global batch ÷ micro batch).
    """
    gs = [o.gpus_per_node for o in config.offers]
    g = gs[index]
    lo = g + (config.pool.min_nodes - 1) * min(gs)
    hi = g + (config.pool.max_nodes - 1) * max(gs)
    valid = [w for w in config.job.valid_world_sizes(hi) if w >= lo]
    return (valid[0], valid[-1]) if valid else None


def offer_fits(config: "Config") -> list[OfferFit]:
    """Every offer's memory verdict; [] when the config has no ``job.model``."""
    if config.job.model is None:
        return []
    setup = resolve(config.job.model)
    mb = config.job.micro_batch_size
    fits = []
    for i, o in enumerate(config.offers):
        bounds = world_size_bounds(config, i)
        lo = hi = None
        if bounds is not None:
            lo = estimate_memory(setup, world_size=bounds[0], micro_batch_size=mb)
            hi = estimate_memory(setup, world_size=bounds[1], micro_batch_size=mb)
        fits.append(OfferFit(i, _label(i, o), o.gpu_type, offer_gib(o), lo, hi))
    return fits


def no_fit_message(fits: list[OfferFit]) -> str | None:
    """One line when no offer can hold the job (naming the fix), else None."""
    if not fits or any(f.usable for f in fits):
        return None
    need = min((f.smallest for f in fits if f.smallest is not None), key=lambda e: e.total_bytes)
    return (f"offers: no offer can hold the job (needs {need.total_gib:.1f} GiB per GPU at world size "
            f"{need.world_size}, the largest GPU offered has {max(f.available_gib or 0 for f in fits):g} GiB); "
            f"fix: {NO_FIT_FIX}")


def notice_windows(config: "Config") -> dict[str, float]:
    """Notice window (s) per provider the offers use: the documented lead for a cloud,
    the shortest chaos notice lead for the local provider (omitted without one)."""
    leads = {"aws": DOCUMENTED_LEAD_S["aws"], "aliyun": DOCUMENTED_LEAD_S["aliyun"]}
    chaos = [e.lead_s for e in config.chaos if e.action == "notice"]
    if chaos:
        leads["local"] = min(chaos)
    return {p: leads[p] for p in sorted({o.provider for o in config.offers}) if p in leads}


def estimated_deadline_checks(config: "Config", unusable: frozenset[int] = frozenset()) -> list[DeadlineCheck]:
    """Per provider, the worst (longest) estimated flush over its usable offers, each at
    the smallest valid world size with it (fewest nodes → most bytes per node)."""
    if config.job.model is None:
        return []
    setup, job = resolve(config.job.model), config.job
    windows = notice_windows(config)
    worst: dict[str, DeadlineCheck] = {}
    for i, o in enumerate(config.offers):
        bounds = world_size_bounds(config, i)
        if i in unusable or o.provider not in windows or bounds is None:
            continue
        w = bounds[0]
        nbytes = checkpoint_bytes_per_node(setup, world_size=w, gpus_per_node=o.gpus_per_node)
        flush = estimate_flush(nbytes, upload_bytes_s=job.upload_throughput_bytes_s,
                               save_bytes_s=job.save_throughput_bytes_s)
        check = check_deadline(flush, provider=o.provider, window_s=windows[o.provider],
                               safety_factor=job.flush_safety_factor, world_size=w,
                               nodes=math.ceil(w / o.gpus_per_node))
        if o.provider not in worst or flush.flush_s > worst[o.provider].flush.flush_s:
            worst[o.provider] = check
    return list(worst.values())


def measured_deadline_checks(config: "Config", line: Mapping[str, Any], *, nodes: int,
                             world_size: int | None = None) -> list[DeadlineCheck]:
    """Checks from a trainer's ``checkpoint_committed`` line (``bytes``: all shards;
    ``save_s``, ``upload_s``: rank 0's node, as ``DirCheckpointer`` reports them; or only
    ``seconds``, as the reference trainer does) against every notice window, ``nodes``
    in the job. The measured flush time is compared as is; ``bytes_per_node`` (and the
    throughput derived from it) assumes an even spread over the nodes when
    ``job.model.zero_stage`` >= 1, everything on one node otherwise.

    A reused commit (nothing written) or one without timings gives [].
    """
    total, seconds = line.get("bytes"), line.get("seconds")
    save_s, upload_s = line.get("save_s"), line.get("upload_s")
    if line.get("reused") or not isinstance(total, (int, float)) or total <= 0:
        return []
    if not isinstance(save_s, (int, float)) or not isinstance(upload_s, (int, float)):
        if not isinstance(seconds, (int, float)):
            return []
        save_s, upload_s = 0.0, float(seconds)
    if save_s + upload_s <= 0:
        return []
    stage = config.job.model.zero_stage if config.job.model is not None else 0
    per_node = total if stage == 0 or nodes <= 1 else total / nodes
    flush = Flush(per_node, per_node / upload_s if upload_s > 0 else math.inf, save_s, upload_s)
    return [check_deadline(flush, provider=p, window_s=w, safety_factor=config.job.flush_safety_factor,
                           world_size=world_size, nodes=nodes)
            for p, w in notice_windows(config).items()]


@dataclass(frozen=True, slots=True)
class Startup:
    """What the supervisor does with the pre-flight at start: never launch ``unusable``
    offers (indices), record ``events`` (kind, data), log ``note`` if any."""

    unusable: frozenset[int] = frozenset()
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    note: str | None = None


def at_start(config: "Config") -> Startup:
    """The start-up pre-flight: ``offer_unusable`` per offer that cannot hold the job,
    ``checkpoint_deadline_risk`` per provider whose estimated flush is at risk."""
    if config.job.model is None:
        return Startup(note="no job.model section: memory and flush-deadline pre-flight skipped")
    fits = offer_fits(config)
    unusable = frozenset(f.index for f in fits if not f.usable)
    events: list[tuple[str, dict[str, Any]]] = []
    for f in fits:
        if not f.usable and f.smallest is not None:
            events.append(("offer_unusable", {
                "offer": f.label, "gpu_type": f.gpu_type, "gpu_gib": f.available_gib,
                "needed_gib": round(f.smallest.total_gib, 1), "world_size": f.smallest.world_size,
                "fix": NO_FIT_FIX}))
    for check in estimated_deadline_checks(config, unusable):
        if check.at_risk:
            events.append(("checkpoint_deadline_risk", check.event_data("estimate")))
    return Startup(unusable, events)


#: what the control node lacks without torch (a ``spotvisor[control]``-only install)
NO_TORCH_NOTE = (
    "torch is not installed on this control node: a node lost without notice cannot be "
    "announced to the survivors through the rendezvous store (trainer.membership.wake_survivors), "
    "so they re-form only at their collective's timeout (--pg-timeout-s) instead of at once; "
    "install it here: pip install 'spotvisor[rendezvous]'")


def control_node_gaps(has_module: Callable[[str], bool]) -> list[str]:
    """What this control node's install cannot do, one line each (logged once at start);
    ``has_module(name)``: whether the module can be imported here (no import is done:
    ``importlib.util.find_spec(name) is not None``)."""
    return [] if has_module("torch") else [NO_TORCH_NOTE]
