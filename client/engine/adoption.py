"""``TensorManagerState`` <-> a live manager: exporting the INFERENCE allocation, and adopting a saved or
published state (straight to INFERENCE without discovery/profiling).

Everything that can be checked is checked *before* the model is touched, so a refused state leaves the model as
it was: the schema (when decoding), the transfer mode, the model fingerprint (naming the first differing tensor),
trap labels (module paths must exist), every offloaded tensor's placement (inside its block, size consistent with
dtype and shape, strides that stay inside the extent), supplied host blocks (count, dtype, size), and that every
meta tensor has a source (a supplied host block for offloaded tensors, else ``weights``).

Host block sources, in order of preference:

- ``host_blocks`` given (a shared session attaching SHM segments, or any caller holding prefilled blocks): used
  as-is, never copied; offloaded parameters become views into them. The caller keeps them alive and pinned (the
  engine neither pins nor frees them).
- otherwise the configured provider allocates fresh blocks (an SHM follower's provider attaches the creator's,
  which are already filled) and the engine copies each offloaded tensor in from the model, or from ``weights``
  when the model tensor is on ``meta``.

Resident tensors are moved to the compute device (from ``weights`` when on meta).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from flextensor.engine.build import Weight, build_inference, bypass_untimed_traps
from flextensor.engine.function_traps import (FunctionTrapsHandler, build_indirect, check_adoptable,
                                              install_function_traps)
from flextensor.engine.hooks import Trap
from flextensor.engine.inference import InferenceHandler
from flextensor.engine.warmup import stage
from flextensor.planning.plan_model import effective_blocks
from flextensor.runtime.host_memory import BlockLayout, TensorPlacement
from flextensor.shm._version import __version__
from flextensor.state import (
    BlockState,
    TensorManagerState,
    TensorState,
    TimingState,
    TrapState,
    describe_mismatch,
    dtype_from_name,
    dtype_name,
    model_fingerprint,
    ModelTensor,
    model_tensors,
    tensor_nbytes,
)

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.configuration.config import OffloadConfig
    from flextensor.engine.context import EngineContext
    from flextensor.engine.hooks import TrapCallback
    from flextensor.engine.phase import PhaseHandler

__all__ = ["CheckedState", "adopt_state", "check_state", "export_state", "layouts_from_state"]


class CheckedState(NamedTuple):
    """A state validated against a model, before anything of the model was touched (:func:`check_state`)."""

    state: TensorManagerState
    tensors: dict[str, ModelTensor]
    modules: dict[str, nn.Module | None]  # trap label -> its module (None for a manual block)
    layouts: list[BlockLayout]


def layouts_from_state(state: TensorManagerState) -> list[BlockLayout]:
    """Block layouts of ``state``, validated (``ValueError`` naming the block or tensor at fault)."""
    labels = {t.label for t in state.traps}
    per_block: dict[int, list[TensorPlacement]] = {b.index: [] for b in state.blocks}
    for position, block in enumerate(state.blocks):
        if block.index != position:
            raise ValueError(f"state block #{position} has index {block.index}; blocks must be numbered 0..n-1 in order")
        if block.label not in labels:
            raise ValueError(f"state block {block.index} belongs to trap {block.label!r}, which is not among the traps")
        if block.nbytes <= 0:
            raise ValueError(f"state block {block.index} has size {block.nbytes}; it must be positive")
    for t in state.tensors:
        if not t.offloaded:
            continue
        if t.block not in per_block:
            raise ValueError(f"offloaded tensor {t.name!r} names block {t.block}, which the state does not have")
        block = state.blocks[t.block]
        dtype = dtype_from_name(t.dtype)
        numel = 1
        for size in t.shape:
            numel *= size
        itemsize = dtype.itemsize
        if t.nbytes != numel * itemsize:
            raise ValueError(f"offloaded tensor {t.name!r}: nbytes {t.nbytes} != numel {numel} x itemsize {itemsize}")
        if len(t.stride) != len(t.shape) or any(s < 0 for s in t.stride):
            raise ValueError(f"offloaded tensor {t.name!r}: stride {t.stride} does not fit shape {t.shape}")
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride)) if numel else 0
        if extent > numel:
            raise ValueError(f"offloaded tensor {t.name!r}: stride {t.stride} reaches beyond its {numel} elements")
        if t.byte_offset < 0 or t.byte_offset % itemsize or t.byte_offset + t.nbytes > block.nbytes:
            raise ValueError(
                f"offloaded tensor {t.name!r}: bytes [{t.byte_offset}, {t.byte_offset + t.nbytes}) do not fit "
                f"(aligned) in block {block.index} of {block.nbytes} bytes"
            )
        if t.trap != block.label:
            raise ValueError(f"offloaded tensor {t.name!r} belongs to trap {t.trap!r} but sits in the block of {block.label!r}")
        per_block[t.block].append(TensorPlacement(t.name, dtype, tuple(t.shape), tuple(t.stride), t.byte_offset, t.nbytes))
    layouts = []
    for block in state.blocks:
        placements = sorted(per_block[block.index], key=lambda p: p.byte_offset)
        for a, b in zip(placements, placements[1:]):
            if a.byte_offset + a.nbytes > b.byte_offset:
                raise ValueError(f"offloaded tensors {a.name!r} and {b.name!r} overlap in block {block.index}")
        if not placements:
            raise ValueError(f"state block {block.index} (trap {block.label!r}) holds no tensor")
        layouts.append(BlockLayout(block.index, block.label, block.nbytes, tuple(placements)))
    missing = [b.label for b in state.blocks if b.label not in state.schedule]
    if missing:
        raise ValueError(f"offloaded trap(s) {missing} never appear in the state's schedule")
    return layouts


def _check_host_blocks(state: TensorManagerState, host_blocks: Sequence[torch.Tensor]) -> None:
    if len(host_blocks) != len(state.blocks):
        raise ValueError(f"{len(host_blocks)} host blocks supplied but the state has {len(state.blocks)} blocks")
    for block, host in zip(state.blocks, host_blocks):
        if not isinstance(host, torch.Tensor) or host.dtype != torch.uint8 or host.dim() != 1 \
                or host.device.type != "cpu" or host.numel() < block.nbytes:
            raise ValueError(
                f"host block {block.index} (trap {block.label!r}) must be a 1-D uint8 CPU tensor of at least "
                f"{block.nbytes} bytes, got {type(host).__name__} "
                f"{getattr(host, 'dtype', None)} {tuple(getattr(host, 'shape', ()))} on {getattr(host, 'device', None)}"
            )


def check_state(
    model: nn.Module,
    state: TensorManagerState,
    cfg: OffloadConfig,
    *,
    host_blocks: Sequence[torch.Tensor] | None = None,
    weights: Mapping[str, object] | None = None,  # only its keys are read here
) -> CheckedState:
    """Validate ``state`` against ``model`` (see the module docstring); the model is not touched."""
    if not isinstance(state, TensorManagerState):
        raise TypeError(f"offload_from_state expects a TensorManagerState, got {type(state).__name__}")
    if state.transfer_mode != cfg.transfer_mode:
        raise ValueError(
            f"the state was made with transfer_mode={state.transfer_mode!r} but the config selects "
            f"{cfg.transfer_mode!r}; use the same transfer mode or re-profile"
        )
    tensors = model_tensors(model)
    if model_fingerprint(tensors) != state.fingerprint:
        raise ValueError(f"the profile/state was made for another model: {describe_mismatch(tensors, state)}")
    modules: dict[str, nn.Module | None] = {}
    for trap in state.traps:
        if trap.kind == "module":
            try:
                modules[trap.label] = model.get_submodule(trap.label)
            except AttributeError as exc:
                raise ValueError(f"the state's trap {trap.label!r} is not a submodule of this model") from exc
            if modules[trap.label] is model:
                raise ValueError("the state names the root module as a trap; that is not supported")
        elif trap.kind == "block":
            modules[trap.label] = None
        else:
            raise ValueError(f"the state's trap {trap.label!r} has unknown kind {trap.kind!r}")
    unknown = [label for label in state.schedule if label not in modules]
    if unknown:
        raise ValueError(f"the state's schedule names trap(s) {sorted(set(unknown))} that are not among its traps")
    layouts = layouts_from_state(state)
    if host_blocks is not None:
        _check_host_blocks(state, host_blocks)
    saved = state.tensor_map()
    for name, entry in tensors.items():
        if not entry.tensor.is_meta:
            continue
        if saved[name].offloaded and host_blocks is not None:
            continue
        if weights is None or not any(k in weights for k in (name, *entry.aliases)):
            raise ValueError(
                f"tensor {name!r} is on the meta device and neither a host block nor weights supply it; pass "
                "weights={name: tensor} (e.g. safetensors.torch.load_file(path)) or host_blocks"
            )
    return CheckedState(state, tensors, modules, layouts)


def adopt_state(
    ctx: EngineContext,
    checked: CheckedState,
    enter: TrapCallback,
    leave: TrapCallback,
    *,
    host_blocks: Sequence[torch.Tensor] | None = None,
    weights: Mapping[str, Weight] | None = None,
    host_block_gate: Callable[[int], None] | None = None,
) -> PhaseHandler:
    """Build INFERENCE for a checked state on a fresh context and install its traps (``enter``/``leave`` are the
    manager's trap callbacks). On failure the caller tears the context down."""
    state, modules, layouts = checked.state, checked.modules, checked.layouts
    cfg = ctx.config
    for saved in state.traps:
        owned = [t.name for t in state.tensors if t.trap == saved.label]
        ctx.traps[saved.label] = Trap(saved.label, modules[saved.label], owned, kind=saved.kind)
    ctx.exclusive = {label: list(t.candidates) for label, t in ctx.traps.items()}
    ctx.plan.compute_s = dict(state.timings.compute_s)
    ctx.plan.samples = [(int(b), float(s)) for b, s in state.timings.transfer_samples]
    ctx.plan.strategy_name = state.strategy
    ctx.plan.explanation = list(state.explanation)
    ctx.plan.small_slot = state.small_slot_bytes
    ctx.adopted = True
    num_slots = effective_blocks(cfg.num_blocks, cfg.min_blocks, len(layouts))
    if cfg.transfer_mode == "raw_block_transfer":  # the arena the plan was sized with (a budget may have shrunk it)
        num_slots = state.num_blocks
    if cfg.profile_mode == "torch_function":
        check_adoptable(ctx, host_blocks)
        traps = install_function_traps(ctx, {n: label for label, t in ctx.traps.items() for n in t.candidates})
        stage(ctx, {n for t in ctx.traps.values() for n in t.candidates})
        build_indirect(ctx, layouts, list(state.schedule), num_slots)
        for trap in ctx.traps.values():
            trap.install(enter, leave, ctx.compile_fn)
        return FunctionTrapsHandler(InferenceHandler(ctx), traps)  # no bypass: every trap needs the mode
    build_inference(ctx, layouts, list(state.schedule), num_slots, host_blocks=host_blocks, weights=weights,
                    block_names=[b.name for b in state.blocks], host_block_gate=host_block_gate)
    for trap in ctx.traps.values():
        trap.install(enter, leave, ctx.compile_fn)
    bypass_untimed_traps(ctx, set(ctx.inference.block_of))  # the traps exist now: the build's call saw none
    return InferenceHandler(ctx)


def export_state(ctx: EngineContext) -> TensorManagerState:
    """A snapshot of the live INFERENCE allocation (placements, block sizes and names, timings, plan); the
    caller checks that the engine is in INFERENCE with its host blocks installed."""
    owner_of: dict[str, str] = {}
    for label, names in ctx.exclusive.items():
        for n in names:
            owner_of.setdefault(n, label)
    # Blocks a replan made resident are exported as resident tensors, the streamed ones renumbered in order: the
    # state describes the plan in force (Note [replanning] in flextensor.engine.replan).
    streamed = [(l, name) for l, name in zip(ctx.inference.layouts, _block_names(ctx))
                if l.label not in ctx.inference.resident_blocks]
    renumber = {layout.index: i for i, (layout, _block) in enumerate(streamed)}
    tensors = []
    for name, entry in ctx.tensors.items():
        t = entry.tensor
        placed = ctx.inference.placement.get(name)
        if placed is not None and placed[0] not in renumber:
            placed = None
        if placed is not None:  # its place in a streamed host block
            index, p = placed
            stride, storage_offset, block, byte_offset = list(p.stride), 0, renumber[index], p.byte_offset
        else:
            stride, storage_offset, block, byte_offset = list(t.stride()), int(t.storage_offset()), -1, 0
        tensors.append(TensorState(name=name, kind=entry.kind, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                   stride=stride, storage_offset=storage_offset, nbytes=tensor_nbytes(t),
                                   persistent=entry.persistent, aliases=list(entry.aliases),
                                   trap=owner_of.get(name, ""), offloaded=placed is not None, block=block,
                                   byte_offset=byte_offset))
    order = list(dict.fromkeys(ctx.sequence))
    order += [label for label in ctx.traps if label not in order]
    return TensorManagerState(
        library_version=__version__,
        fingerprint=model_fingerprint(ctx.tensors),
        transfer_mode=ctx.config.transfer_mode,
        num_blocks=ctx.inference.loader.num_slots if ctx.inference.loader is not None else ctx.config.num_blocks,
        small_slot_bytes=ctx.plan.small_slot,
        traps=[TrapState(label=label, kind=ctx.traps[label].kind) for label in order if label in ctx.traps],
        schedule=list(ctx.sequence),
        tensors=tensors,
        blocks=[BlockState(index=renumber[l.index], label=l.label, nbytes=l.nbytes, name=name) for l, name in streamed],
        timings=TimingState(compute_s=dict(ctx.plan.compute_s), transfer_samples=list(ctx.plan.samples)),
        strategy=ctx.plan.strategy_name,
        explanation=list(ctx.plan.explanation),
    )


def _block_names(ctx: EngineContext) -> list[str]:
    """Each block's name ('' for private memory, and for profile_mode="torch_function", which has no host blocks:
    it streams from the parameters)."""
    blocks = ctx.inference.host_blocks
    return [b.name for b in blocks] if blocks else [""] * len(ctx.inference.layouts)
