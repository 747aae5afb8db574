"""Setting a model up for its warm-up passes, and the DISCOVERY phase.

:func:`start_warmup` runs inside ``offload()``: it makes one trap per selected module, keeps on the device every
tensor no trap can offload (buffers, parameters outside traps or shared by several traps), pins the candidates'
host storages in place, decides the warm-up mode (``flextensor.engine.warmup``), installs the traps and returns
the first phase's handler: DISCOVERY, or PROFILING with ``skip_discovery`` (the patterns' static candidates
are then taken as exclusive).

DISCOVERY (``discovery_iters`` passes): the :class:`~flextensor.runtime.usage_recorder.UsageRecorder` is
active for the whole pass; each trap gets its candidate weights on the device (the warm loader) and is recorded
as the user of every parameter passed to a torch function while it runs. After the last pass, tensors used by
several traps or outside traps become resident (a kept warm-up copy becomes their device data) and leave the
pinned staging. With a *resident* warm-up the first pass starts by copying every pending candidate to the
device, before the recorder or any trap (:func:`flextensor.engine.warmup.preload`).

A DISCOVERY pass is an eager region (Note [no compiled code under the usage recorder] in
``flextensor.runtime.compile_guard``): a ``torch.compile``'d model and ``compile_fn``'s units run their own
forwards uncompiled while the recorder sees every call, and compile from the first PROFILING pass on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

from torch import nn

from flextensor.configuration.config import OffloadConfig
from flextensor.configuration.patterns import PatternSet, TrapSpec
from flextensor.engine.function_traps import FunctionTrapsHandler, install_function_traps
from flextensor.engine.hooks import Trap
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.engine.profiling import ProfilingHandler
from flextensor.engine.warmup import choose_warmup, overlap_stream, preload, stage
from flextensor.runtime.compile_guard import begin_eager_region, end_eager_region
from flextensor.runtime.usage_recorder import OUTSIDE, UsageRecorder
from flextensor.state import ModelTensor

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.engine.hooks import TrapCallback

__all__ = ["DiscoveryHandler", "select_warmup_traps", "start_warmup"]

logger = logging.getLogger("flextensor.manager")  # the engine logs under the manager's name


def select_warmup_traps(name: str, cfg: OffloadConfig, model: nn.Module,
                        tensors: Mapping[str, ModelTensor]) -> list[TrapSpec]:
    """The traps a warm-up of ``model`` starts with: its modules that ``cfg``'s patterns select (a warning names
    the patterns when none matched). A tensor on ``meta`` is refused (``ValueError``): discovery and profiling
    run the model, so they need its real weights."""
    meta = [n for n, t in tensors.items() if t.tensor.is_meta]
    if meta:
        raise ValueError(
            f"model tensor {meta[0]!r} (and {len(meta) - 1} more) is on the meta device: discovery and profiling "
            "need real weights; load them first, or use offload_from_profile(..., weights=...) with a saved profile"
        )
    specs = PatternSet(cfg.include_patterns, cfg.exclude_patterns).select_traps(model)
    if not specs:
        logger.warning("manager %r: no module matched include_patterns=%r (exclude_patterns=%r); nothing will "
                       "be offloaded", name, cfg.include_patterns, cfg.exclude_patterns)
    return specs


def start_warmup(ctx: EngineContext, specs: Any, enter: TrapCallback, leave: TrapCallback) -> PhaseHandler:
    """Make and install the traps of ``specs`` (pattern matches), place the tensors, and return the handler of
    the first warm-up pass (see the module docstring)."""
    cfg = ctx.config
    owners: dict[str, str] = {}
    for spec in specs:
        for name, _p in spec.params:
            if name in owners:
                ctx.shared.add(name)
            owners.setdefault(name, spec.label)
        ctx.traps[spec.label] = Trap(spec.label, spec.module, spec.param_names)
    candidates = set(owners) - ctx.shared
    traps = None
    if cfg.profile_mode == "torch_function":  # the engine works on shadows of the candidates from here on
        traps = install_function_traps(ctx, {name: owners[name] for name in sorted(candidates)})
    for name, entry in ctx.tensors.items():
        if name not in candidates:
            ctx.to_device(entry.tensor)
    stage(ctx, candidates, background=True)
    choose_warmup(ctx, candidates)
    handler: PhaseHandler
    if cfg.skip_discovery:
        ctx.exclusive = {label: [n for n in t.candidates if n in candidates] for label, t in ctx.traps.items()}
        ctx.warm.stream = overlap_stream(ctx)
        handler = ProfilingHandler(ctx)
    else:
        names_by_id = {id(e.tensor): n for n, e in ctx.tensors.items() if e.kind == "parameter"}
        ctx.profile.recorder = UsageRecorder(names_by_id, ctx.device, non_blocking=ctx.warm.loader.non_blocking)
        handler = DiscoveryHandler(ctx)
    for trap in ctx.traps.values():
        trap.install(enter, leave, ctx.compile_fn)
    return handler if traps is None else FunctionTrapsHandler(handler, traps)


class DiscoveryHandler(PhaseHandler):
    """Which trap uses which parameter (see the module docstring)."""

    phase = Phase.DISCOVERY

    def begin_pass(self) -> None:
        ctx = self.ctx
        if ctx.warm.pending:
            preload(ctx, profiling=False)  # resident warm-up: the one copy of each candidate, ahead of everything
        ctx.profile.pass_sequence = []
        recorder = ctx.profile.recorder
        if recorder is not None:
            recorder.current = OUTSIDE
            recorder.__enter__()
            begin_eager_region()  # nothing compiled runs under the recorder (see the module docstring)

    def end_pass(self, ok: bool) -> PhaseHandler:
        ctx = self.ctx
        profile = ctx.profile
        if profile.recorder is not None:
            end_eager_region()
            profile.recorder.__exit__(None, None, None)
            profile.recorder.clear_copies()
        if not ok:
            return self
        ctx.sequence = list(profile.pass_sequence)
        profile.iteration += 1
        if profile.iteration < ctx.config.discovery_iters:
            return self
        finish_discovery(ctx)
        return ProfilingHandler(ctx)

    def enter(self, trap: Trap) -> None:
        ctx = self.ctx
        recorder = ctx.profile.recorder
        if recorder is not None:
            recorder.enabled = False
        ctx.warm.loader.load(ctx.tensor_objs(trap.candidates))
        ctx.profile.pass_sequence.append(trap.label)
        if recorder is not None:
            recorder.current = trap.label
            recorder.clear_copies()
            recorder.enabled = True

    def exit(self, trap: Trap) -> None:
        ctx = self.ctx
        recorder = ctx.profile.recorder
        if recorder is not None:
            recorder.enabled = False
        ctx.warm.loader.unload()
        if recorder is not None:
            recorder.current = OUTSIDE
            recorder.clear_copies()
            recorder.enabled = True


def finish_discovery(ctx: EngineContext) -> None:
    """Decide which candidates each trap may offload: used by that trap alone (and never outside traps)."""
    recorder = ctx.profile.recorder
    assert recorder is not None
    usage = recorder.usage
    owned = {n for t in ctx.traps.values() for n in t.candidates}
    exclusive: dict[str, list[str]] = {}
    for label, trap in ctx.traps.items():
        if trap.kind == "module":
            names = [n for n in trap.candidates if n not in ctx.shared and usage.get(n, {label}) <= {label}]
        else:
            names = [n for n, users in usage.items()
                     if users == {label} and n not in owned and ctx.tensors[n].kind == "parameter"]
            if names and ctx.function_traps is not None:
                logger.warning("manager %r: offload_block(%r) keeps its %d parameters resident: profile_mode="
                               "'torch_function' streams only parameters of module traps (it moves every other "
                               "parameter to the device at offload())", ctx.name, label, len(names))
                names = []
        exclusive[label] = names
    keep = {n for names in exclusive.values() for n in names}
    made_resident = sorted(owned - keep)
    ctx.warm.loader.commit(ctx.tensor_objs(made_resident), count=False)  # a kept copy is their device data now
    for name in made_resident:
        ctx.to_device(ctx.tensors[name].tensor)
    ctx.warm.staging.release(owned - keep)  # their host copies are no longer read by the warm-up
    ctx.exclusive = exclusive
    ctx.profile.recorder = None
    logger.debug("manager %r: discovery done, %d offloadable tensors in %d traps", ctx.name, len(keep),
                 len(exclusive))
