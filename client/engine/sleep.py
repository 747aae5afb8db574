"""Sleep and wake: an offloaded model gives its device memory back and takes it again, keeping its plan.

Note [sleep and wake]
---------------------
Colocated training and serving (reinforcement-learning post-training) needs the serving model's device memory
for a while and the model back afterwards, unchanged or with new weights. An offloaded model in INFERENCE holds
on its device: the loader's rotating blocks or arena, the copies of host blocks a replan made resident, and the
resident tensors. Everything streamed already lies in host blocks, so :func:`put_to_sleep` only has to free:

- the loader is closed (its in-flight copies finish) and dropped; the streamed tensors, which point at its
  slots between traps, and the tensors of resident blocks become ``meta`` (their bytes stay in the blocks);
- each resident tensor needs a host copy to come back from. Where someone else keeps one (a shared session's
  tensor store holds every resident tensor already: :class:`HostCopy`; it registers that copy with CUDA while the
  model sleeps, Note [a wake at link rate] in ``flextensor.sharing.host_copy``), the tensor just becomes ``meta``.
  Otherwise the tensors on the device are packed into ONE private host block (256-byte aligned, as a streamed
  block is), copied there and freed; that block is registered with CUDA in place when ``pinned_memory`` is on,
  so the wake copies at link rate. When the CPU computes from host memory in place, its tensors are host
  memory already: they are kept as they are, nothing is copied. Either way there is one host copy, never two.
- the caching allocator returns the freed device memory to the driver (``empty_cache``), so other processes
  (the trainer) can allocate it.

The plan, the host blocks, the traps and the patched forwards all stay. While asleep the phase is SLEEPING:
every pass, and every trap entered, raises :class:`~flextensor.errors.ModelAsleepError`. :func:`wake_up`
reverses it: the resident tensors come back from their host copy (one copy per store part, or of the private
block, into one device allocation), the tensors of resident blocks from their blocks, and a new loader is
made with the same schedule, slots and gate as before; the private block is then freed. No pass is profiled
and outputs equal those before the sleep, or those of the new weights a session wrote meanwhile. Device
addresses change: CUDA graphs captured before the sleep must be captured again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

import torch

from flextensor.engine.context import block_loader
from flextensor.engine.hooks import assign_data
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.engine.replan import attach_probe
from flextensor.errors import ModelAsleepError
from flextensor.runtime.host_memory import (BlockLayout, HostBlock, HostBlockProvider, HostRegisterProvider,
                                            PageableProvider, block_views, pack_block, packed_stride)
from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.engine.hooks import Trap

__all__ = ["HostCopy", "SleepState", "SleepingHandler", "put_to_sleep", "wake_up", "restore_on_host"]

logger = logging.getLogger("flextensor.manager")


class HostCopy(Protocol):
    """A host copy of resident tensors kept by someone else, which a sleeping model wakes from (a shared
    session's tensor store), and that keeper's view of the model's sleep (Note [sleep and wake])."""

    def names(self) -> set[str]:
        """Every tensor name (aliases included) whose bytes the copy holds."""
        ...

    def values_on(self, device: torch.device) -> Mapping[str, torch.Tensor]:
        """Each held tensor by name (aliases included), on ``device`` (zero-copy host views on a CPU)."""
        ...

    def fell_asleep(self) -> None:
        """The model freed its device memory and reads no host memory any more."""
        ...

    def wake_ready(self, timeout: float | None = 0.0) -> bool:
        """Whether a wake now copies at link rate, after waiting up to ``timeout`` seconds for the keeper's
        preparation during the sleep (None: no limit)."""
        ...

    def waking(self) -> None:
        """The model is about to read host memory again (may wait, or refuse with an error naming why)."""
        ...


@dataclass(eq=False)
class SleepState:
    """What a sleeping model needs to wake (see Note [sleep and wake])."""

    covered: list[str] = field(default_factory=list)  # resident tensors the HostCopy holds
    kept: dict[str, torch.Tensor] = field(default_factory=dict)  # resident host tensors kept as they are
    layout: BlockLayout | None = None  # the private host block of the resident device tensors
    block: HostBlock | None = None
    provider: HostBlockProvider | None = None
    loader: tuple[list[int], int, Callable[[int], None] | None] | None = None  # schedule, slots, gate
    freed_bytes: int = 0  # device bytes the sleep freed (the engine's own accounting)
    seconds: float = 0.0


class SleepingHandler(PhaseHandler):
    """The SLEEPING phase: refuses every pass and trap until the manager wakes the model."""

    phase = Phase.SLEEPING

    def __init__(self, ctx: EngineContext, state: SleepState, awake: PhaseHandler) -> None:
        super().__init__(ctx)
        self.state = state
        self.awake = awake  # the INFERENCE handler that resumes at the wake

    def _refuse(self) -> None:
        raise ModelAsleepError(f"manager {self.ctx.name!r} is asleep (its device memory was freed by sleep()); "
                               f"call wake() first (ft.wake({self.ctx.name!r}))")

    def begin_pass(self) -> None:
        self._refuse()

    def end_pass(self, ok: bool) -> PhaseHandler:
        return self

    def enter(self, trap: Trap) -> None:
        self._refuse()


def _aliases(ctx: EngineContext, name: str) -> tuple[str, ...]:
    return (name, *ctx.tensors[name].aliases)


def put_to_sleep(ctx: EngineContext, host_copy: HostCopy | None) -> SleepState:
    """Free ``ctx``'s device memory, keeping one host copy of everything (Note [sleep and wake]). The caller
    checked that the engine is in INFERENCE, between passes, with its host blocks installed."""
    if ctx.inference.replan.state == "in_progress":
        raise RuntimeError(f"sleep(): manager {ctx.name!r} is replanning its strategy; run forward passes until "
                           "strategy_replan_status's state is 'done', then sleep")
    if ctx.function_traps is not None:
        raise RuntimeError(f"sleep(): manager {ctx.name!r} uses profile_mode='torch_function', whose tensors are "
                           "not held in host blocks; offload with the default profile_mode to sleep")
    start = time.perf_counter()
    state = SleepState()
    inference = ctx.inference
    loader = inference.loader
    if loader is not None:
        state.loader = (list(loader.schedule), loader.num_slots, loader.host_block_gate)
        state.freed_bytes += loader.device_bytes
        loader.close()
        inference.loader = None
    for name in inference.placement:  # streamed (views of the loader's slots, counted above) or resident blocks
        tensor = ctx.tensors[name].tensor
        if tensor.is_meta:
            continue
        if not ctx.in_place and tensor.device == ctx.device and _in_resident_block(ctx, name):
            state.freed_bytes += tensor_nbytes(tensor)  # a device copy of its block
        _to_meta(tensor)
    held = host_copy.names() if host_copy is not None else set()
    packed: list[str] = []
    for name, entry in ctx.tensors.items():
        tensor = entry.tensor
        if name in inference.placement or tensor.is_meta:
            continue
        if any(alias in held for alias in _aliases(ctx, name)):
            state.covered.append(name)
        elif ctx.in_place or tensor.device != ctx.device:
            state.kept[name] = tensor.data  # host memory already: its own copy
            continue
        else:
            packed.append(name)
            continue
        if tensor.device == ctx.device:
            state.freed_bytes += tensor_nbytes(tensor)
        _to_meta(tensor)
    if packed:
        _pack_resident(ctx, state, packed)
    for name in state.kept:
        _to_meta(ctx.tensors[name].tensor)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
    if host_copy is not None:
        host_copy.fell_asleep()
    state.seconds = time.perf_counter() - start
    logger.info("manager %r: asleep, %.1f MiB of device memory freed in %.1f ms (%d resident tensors in %s)",
                ctx.name, state.freed_bytes / 2**20, state.seconds * 1e3,
                len(state.covered) + len(packed) + len(state.kept),
                "a private host copy" if packed else "the shared host copy" if state.covered else "host memory")
    return state


def _in_resident_block(ctx: EngineContext, name: str) -> bool:
    index = ctx.inference.placement[name][0]
    return ctx.inference.layouts[index].label in ctx.inference.resident_blocks


def _to_meta(tensor: torch.Tensor) -> None:
    assign_data(tensor, torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta"))


def _pack_resident(ctx: EngineContext, state: SleepState, names: list[str]) -> None:
    """The resident device tensors ``names`` into one private host block, then off the device."""
    tensors = [ctx.tensors[name].tensor for name in names]
    layout = pack_block(0, "resident", ((n, t.dtype, t.shape, packed_stride(t)) for n, t in zip(names, tensors)))
    pinned = ctx.device.type == "cuda" and ctx.config.pinned_memory
    provider: HostBlockProvider = HostRegisterProvider() if pinned else PageableProvider()
    try:
        block = provider.allocate(0, layout.nbytes)
        for view, tensor in zip(block_views(block.tensor, layout.tensors), tensors):
            view.copy_(tensor.detach())  # device -> the block's plain pages: synchronous
        provider.finish()  # registered in place once filled (pinned): the wake copies at link rate
    except BaseException:
        provider.close()
        raise
    state.layout, state.block, state.provider = layout, block, provider
    for tensor in tensors:
        state.freed_bytes += tensor_nbytes(tensor)
        _to_meta(tensor)


def wake_up(ctx: EngineContext, state: SleepState, host_copy: HostCopy | None) -> float:
    """Give ``ctx`` its device memory back from the host copies (Note [sleep and wake]); returns the seconds."""
    start = time.perf_counter()
    if host_copy is not None:
        host_copy.waking()
    try:
        _restore_resident(ctx, state, host_copy, ctx.device)
        inference = ctx.inference
        for layout in inference.layouts:
            views = block_views(inference.host_blocks[layout.index].tensor, layout.tensors)
            resident = layout.label in inference.resident_blocks
            for placement, view in zip(layout.tensors, views):
                tensor = ctx.tensors[placement.name].tensor
                if ctx.in_place or state.loader is None or layout.label not in inference.block_of:
                    value = view.to(ctx.device, non_blocking=True) if resident and not ctx.in_place else view
                    assign_data(tensor, value)
                else:  # streamed: the new loader points it at its slot below; a real tensor until then
                    assign_data(tensor, view)
        if state.loader is not None:
            schedule, num_slots, gate = state.loader
            inference.loader = block_loader(ctx, inference.layouts, inference.host_blocks, schedule, num_slots,
                                            small_slot=ctx.plan.small_slot, host_block_gate=gate)
            attach_probe(ctx)
        if ctx.device.type == "cuda":
            torch.cuda.current_stream(ctx.device).synchronize()  # the private block may go now
    except BaseException:
        if host_copy is not None:
            host_copy.fell_asleep()
        raise
    _drop_private(state)
    seconds = time.perf_counter() - start
    logger.info("manager %r: awake in %.1f ms", ctx.name, seconds * 1e3)
    return seconds


def _restore_resident(ctx: EngineContext, state: SleepState, host_copy: HostCopy | None,
                      device: torch.device) -> None:
    """The resident tensors back on ``device`` (or as host views there, for a CPU) from their host copies."""
    if state.covered:
        assert host_copy is not None
        values = host_copy.values_on(device)
        for name in state.covered:
            value = next((values[a] for a in _aliases(ctx, name) if a in values), None)
            if value is None:
                raise RuntimeError(f"manager {ctx.name!r}: the host copy no longer holds resident tensor {name!r}; "
                                   "release() the model and offload it again")
            assign_data(ctx.tensors[name].tensor, value)
    for name, value in state.kept.items():
        assign_data(ctx.tensors[name].tensor, value)
    if state.layout is not None and state.block is not None:
        source = state.block.tensor
        packed = source.to(device, non_blocking=True)
        if packed is source:
            packed = source.clone()  # a CPU playing the device: the private block is freed after the wake
        for placement, view in zip(state.layout.tensors, block_views(packed, state.layout.tensors)):
            assign_data(ctx.tensors[placement.name].tensor, view)


def restore_on_host(ctx: EngineContext, state: SleepState, host_copy: HostCopy | None,
                    preserve_model: bool) -> None:
    """Before ``release()`` of a sleeping model: with ``preserve_model`` the resident tensors get real data
    again, on the host (teardown then moves them where they came from); the private block goes either way."""
    if preserve_model:
        _restore_resident(ctx, state, host_copy, torch.device("cpu"))  # a clone of the private block, if any
        inference = ctx.inference
        for layout in inference.layouts:  # teardown copies them out of their blocks
            for placement, view in zip(layout.tensors,
                                       block_views(inference.host_blocks[layout.index].tensor, layout.tensors)):
                assign_data(ctx.tensors[placement.name].tensor, view)
    _drop_private(state)


def _drop_private(state: SleepState) -> None:
    provider, state.provider = state.provider, None
    state.block = state.layout = None
    if provider is not None:
        provider.close()
