"""``profile_mode="torch_function"``: the indirect runtime, which never touches the offloaded parameters.

Note [function traps]
---------------------
The other profile modes move a trap's weights by reassigning each parameter's ``.data`` (to a warm-up copy, a
host-block view, a slot of the rotating device blocks). Some models do not tolerate that (parameter classes that
refuse attribute assignment, code that holds on to a parameter's storage). Here the engine works on *shadows*
instead: for every offload candidate (a parameter of one trap, not shared with another) it makes a plain tensor
that aliases the parameter's storage, and puts the shadow in the engine's tensor table in the parameter's place.
Warm-up copies, PROFILING loads, the block loader's slot views and the resident copies all go to the shadow's
``.data``; the parameter keeps its storage from ``offload()`` to ``release()``.

:class:`FunctionTraps`, a ``TorchFunctionMode``, connects the two: while a forward pass runs (and while a trap
is called outside one) it rewrites every argument of every torch call that is a candidate parameter, or a view
of one made outside the mode, into the shadow (or the same view of the shadow). ``F.linear(x, self.weight)``,
``self.weight.t()``, ``self.weight.device`` and ``torch.ops.aten.*`` calls all go through torch functions, so a
module's forward sees the device copy however it reaches its parameters. A tied parameter is one object, so it
has one shadow (and a parameter used by several traps is never a candidate: it is resident as in every mode).
Tensors that are not candidates (buffers, parameters outside traps or shared by traps) are placed on the
compute device as in the other modes, by reassignment; so are the parameters a manual ``offload_block`` uses
(they are not known at ``offload()``), which therefore stay resident here (with a warning at the end of
DISCOVERY, ``flextensor.engine.discovery``).

INFERENCE streams from the parameters themselves: each streamed parameter's host storage (page-locked in place
when ``pinned_memory``) is the source of one per-tensor copy into the loader's slot (``transfer_mode="strategy"``:
a packed block copy would need the parameters to live in packed host blocks, which is patching the model).
No host block is allocated, so host memory holds the offloaded weights once, in the model.

What the mode cannot see, and the errors that say so
----------------------------------------------------
- A parameter that reaches an ATen operator without passing through a torch function the mode rewrites (code
  under ``torch._C.DisableTorchFunction()``, a parameter inside an object the mode does not look into) would be
  read from the host. During DISCOVERY a ``TorchDispatchMode`` (:class:`HiddenReads`) watches for the
  candidates themselves at the operator level and raises ``RuntimeError`` naming the trap, the parameter and the
  fix. (With ``skip_discovery`` there is no DISCOVERY pass, so no such check.)
- A streamed parameter used outside the trap that streams it (data-dependent code DISCOVERY did not see, or
  ``skip_discovery``): its slot holds another trap's weights then. The mode raises ``RuntimeError`` instead of
  computing on stale data (or, in PROFILING, on the host copy).
- Parameter subclasses with their own ``__torch_function__`` are refused at ``offload()``: rewriting their
  arguments to plain tensors would skip their semantics.

Traps are never bypassed in this mode (``Trap.bypass``): a resident trap's parameters are shadowed too, so its
calls need the mode, also outside a pass. Composition, not a second set of phases: :class:`FunctionTrapsHandler`
wraps each phase's own handler, which works on the shadows as it works on parameters in the other modes.

Costs: every torch call of a pass pays the rewrite (a Python walk over its arguments), and the mode is not
``torch.compile``-compatible (``compile_fn`` is refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from flextensor.engine.hooks import assign_data
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.runtime.host_memory import BlockLayout
from flextensor.runtime.loaders.block_loader import BlockLoader

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.engine.hooks import Trap

__all__ = ["FunctionTraps", "FunctionTrapsHandler", "HiddenReads", "build_indirect", "check_adoptable",
           "install_function_traps", "release_function_traps"]

_OTHER_MODE = "profile_mode='view' (or 'getter')"


class Shadowed(NamedTuple):
    """One candidate parameter, the engine's shadow of it, and the trap that owns it."""

    name: str
    param: torch.Tensor
    shadow: torch.Tensor
    trap: str


def _flat(values: Iterable[Any]) -> bool:
    """No container among ``values`` (pytree's walk costs microseconds per call; a plain loop does not)."""
    return not any(isinstance(value, (list, tuple, dict)) for value in values)


def _where(label: str | None) -> str:
    return f"by trap {label!r}" if label is not None else "outside any trap"


def _misuse(entry: Shadowed, label: str | None, func: Any, state: str) -> RuntimeError:
    """The error for a candidate used where its shadow holds no valid device copy."""
    return RuntimeError(
        f"parameter {entry.name!r} is offloaded with trap {entry.trap!r} but was used {_where(label)} "
        f"({getattr(func, '__name__', func)}), where its device copy {state}: profile_mode='torch_function' "
        f"gives a trap's parameters their device copies only while that trap runs. Keep it resident: run "
        f"DISCOVERY on inputs that take this path (skip_discovery=False: a tensor used outside its trap stays "
        f"resident), or leave {entry.trap!r} out of include_patterns; or use {_OTHER_MODE}"
    )


class FunctionTraps(TorchFunctionMode):
    """Rewrites candidate parameters (and views of them made outside the mode) into their shadows.

    ``enabled`` is off while the engine's own trap work runs (it handles shadows, never parameters).
    ``current`` is the trap running now (``None`` between traps). Checks, set per phase: ``on_device`` (PROFILING)
    refuses a shadow that is not on the compute device; ``streamed`` (INFERENCE: parameter id -> trap label)
    refuses a streamed parameter outside its trap.
    """

    def __init__(self, entries: Iterable[Shadowed], device: torch.device) -> None:
        super().__init__()
        self.entries: dict[int, Shadowed] = {id(e.param): e for e in entries}
        self.device = device
        self.enabled = True
        self.current: str | None = None
        self.on_device = False
        self.streamed: dict[int, str] = {}
        self._depth = 0
        self._func: Any = None

    # -- the mode on the stack ---------------------------------------------------------------------------------
    def activate(self) -> None:
        """Enter the mode (once: a trap called inside a pass finds it active already)."""
        if self._depth == 0:
            self.__enter__()
        self._depth += 1

    def deactivate(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.__exit__(None, None, None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The engine's own work on shadows: nothing to rewrite."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    # -- rewriting ---------------------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.enabled:
            self._func = func
            if _flat(args) and _flat(kwargs.values()):  # most calls: a few tensors and scalars, no containers
                args = tuple(map(self._rewrite, args))
                if kwargs:
                    kwargs = {key: self._rewrite(value) for key, value in kwargs.items()}
            else:
                args, kwargs = tree_map(self._rewrite, (args, kwargs))
        return func(*args, **kwargs)

    def _rewrite(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        entry = self.entries.get(id(value))
        if entry is not None:
            self._check(entry)
            return entry.shadow
        base = value._base
        if base is None:
            return value
        entry = self.entries.get(id(base))
        if entry is None:
            return value
        self._check(entry)
        return self._view_of_shadow(value, entry)

    def _check(self, entry: Shadowed) -> None:
        owner = self.streamed.get(id(entry.param))
        if owner is not None and owner != self.current:
            raise _misuse(entry, self.current, self._func, "is a slot holding another trap's weights")
        if self.on_device and entry.shadow.device != self.device:
            raise _misuse(entry, self.current, self._func, f"is not on {self.device} (it is on the host)")

    def _view_of_shadow(self, view: torch.Tensor, entry: Shadowed) -> torch.Tensor:
        """The view ``view`` takes of ``entry.param``, taken of the shadow instead (same element offsets)."""
        param, shadow = entry.param, entry.shadow
        if view.dtype != param.dtype or shadow.stride() != param.stride():
            raise RuntimeError(
                f"a view of parameter {entry.name!r} (trap {entry.trap!r}) made outside the forward pass reached "
                f"{getattr(self._func, '__name__', self._func)}, and profile_mode='torch_function' cannot take the "
                f"same view of its device copy (dtype {view.dtype} against {param.dtype}, or a layout the copy "
                f"does not keep); make the view inside the module's forward, or use {_OTHER_MODE}"
            )
        offset = shadow.storage_offset() + view.storage_offset() - param.storage_offset()
        return shadow.as_strided(view.size(), view.stride(), offset)


class HiddenReads(TorchDispatchMode):
    """DISCOVERY only: a candidate parameter reaching an ATen operator escaped :class:`FunctionTraps`."""

    def __init__(self, traps: FunctionTraps) -> None:
        super().__init__()
        self.traps = traps

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Without this, torch wraps __torch_dispatch__ to keep dynamo out of it, importing torch._dynamo (seconds)
        # at its first call; nothing is compiled under this mode.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        entries = self.traps.entries
        for value in tree_flatten((args, kwargs))[0]:
            entry = entries.get(id(value)) if isinstance(value, torch.Tensor) else None
            if entry is not None:
                label = self.traps.current
                module = f"module {label!r}" if label is not None else "code outside any trap"
                raise RuntimeError(
                    f"{module} reads parameter {entry.name!r} through a path profile_mode='torch_function' cannot "
                    f"rewrite: the parameter itself reached {func}, not through a torch function the mode sees "
                    "(e.g. code under torch._C.DisableTorchFunction(), or the parameter inside an object the mode "
                    f"does not look into), so the operator would read its host copy. Use {_OTHER_MODE}, or leave "
                    f"{entry.trap!r} out of include_patterns"
                )
        return func(*args, **kwargs)


class FunctionTrapsHandler(PhaseHandler):
    """A phase handler with :class:`FunctionTraps` around each pass and trap call (composed, not inherited: the
    inner handler is the phase's own, working on shadows)."""

    def __init__(self, inner: PhaseHandler, traps: FunctionTraps) -> None:
        super().__init__(inner.ctx)
        self.inner = inner
        self.phase = inner.phase
        self.traps = traps
        traps.on_device = inner.phase is Phase.PROFILING
        self._hidden: HiddenReads | None = HiddenReads(traps) if inner.phase is Phase.DISCOVERY else None

    def begin_pass(self) -> None:
        self.inner.begin_pass()  # DISCOVERY's recorder goes on the stack first: it sees shadows, as it should
        self.traps.activate()
        if self._hidden is not None:
            self._hidden.__enter__()

    def end_pass(self, ok: bool) -> PhaseHandler:
        if self._hidden is not None:
            self._hidden.__exit__(None, None, None)
        self.traps.deactivate()
        following = self.inner.end_pass(ok)
        return self if following is self.inner else FunctionTrapsHandler(following, self.traps)

    def enter(self, trap: Trap) -> None:
        with self.traps.paused():
            self.inner.enter(trap)
        self.traps.current = trap.label
        self.traps.activate()

    def exit(self, trap: Trap) -> None:
        self.traps.deactivate()
        self.traps.current = None
        with self.traps.paused():
            self.inner.exit(trap)


def _own_torch_function(param: torch.Tensor) -> bool:
    """True when ``param``'s class defines a ``__torch_function__`` of its own (not Tensor's or Parameter's)."""
    for cls in type(param).__mro__:
        impl = cls.__dict__.get("__torch_function__")
        if impl is not None:
            return cls is not torch.Tensor and impl is not torch._C._disabled_torch_function_impl
    return False


def install_function_traps(ctx: EngineContext, owners: Mapping[str, str]) -> FunctionTraps:
    """Put a shadow in ``ctx.tensors`` for each candidate in ``owners`` (name -> trap label) and return the mode
    (also kept as ``ctx.function_traps``). Refuses what the indirect runtime cannot serve, before any change."""
    if ctx.compile_fn is not None:
        raise ValueError("compile_fn cannot be used with profile_mode='torch_function' (its TorchFunctionMode is not "
                         "torch.compile-compatible); drop compile_fn or use profile_mode='view'")
    params = {name: ctx.tensors[name].tensor for name in owners}
    for name, param in params.items():
        if _own_torch_function(param):
            raise ValueError(
                f"parameter {name!r} (trap {owners[name]!r}) is a {type(param).__name__} with its own "
                "__torch_function__; profile_mode='torch_function' would hand plain tensors to the functions it "
                f"overrides. Use {_OTHER_MODE}, or leave {owners[name]!r} out of include_patterns"
            )
        if param.device.type != "cpu":
            raise ValueError(
                f"parameter {name!r} (trap {owners[name]!r}) is on {param.device}: profile_mode='torch_function' "
                "streams from the parameters' own storage and never moves them, so they must be on the CPU; load "
                f"the model on the CPU, or use {_OTHER_MODE}"
            )
    entries = []
    with torch._C.DisableTorchFunction():  # a plain tensor, whatever mode the caller has active
        for name, param in params.items():
            shadow = param.detach()
            entries.append(Shadowed(name, param, shadow, owners[name]))
            ctx.tensors[name] = dataclasses.replace(ctx.tensors[name], tensor=shadow)
    traps = FunctionTraps(entries, ctx.device)
    ctx.function_traps = traps
    return traps


def check_adoptable(ctx: EngineContext, host_blocks: Sequence[torch.Tensor] | None) -> None:
    """Adopting a state in this mode streams from the model's parameters: they must be there, not supplied."""
    if host_blocks is not None:
        raise ValueError("profile_mode='torch_function' streams from the model's own parameters and cannot adopt "
                         f"supplied host blocks (a shared session's); use {_OTHER_MODE}")
    meta = [name for name, entry in ctx.tensors.items() if entry.tensor.is_meta]
    if meta:
        raise ValueError(f"tensor {meta[0]!r} is on the meta device: profile_mode='torch_function' computes from the "
                         f"model's own parameters; load the weights into the model first, or use {_OTHER_MODE}")


def build_indirect(ctx: EngineContext, layouts: Sequence[BlockLayout], schedule: Sequence[str],
                   num_slots: int) -> None:
    """INFERENCE for a plan: streamed shadows get their host data (the parameters' storage) back and a loader
    that copies from it per tensor; every other tensor goes to the device for good. No host block is made."""
    traps = ctx.function_traps
    assert traps is not None
    streamed = {p.name: layout for layout in layouts for p in layout.tensors}
    warm = ctx.warm
    warm.loader.unload()
    freed = warm.loader.restore(ctx.tensor_objs(sorted(streamed)))
    warm.loader.commit(count=False)  # the resident ones' warm-up copies are their device data now
    if freed and ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    for name, entry in ctx.tensors.items():
        if name not in streamed:
            ctx.to_device(entry.tensor)
    warm.staging.release([n for n in ctx.tensors if n not in streamed])  # streamed storages stay page-locked
    missing = [layout.label for layout in layouts if layout.label not in schedule]
    if missing:
        raise ValueError(f"offloaded trap(s) {missing} never appear in the trap schedule {list(schedule)}")
    inference = ctx.inference
    inference.layouts = list(layouts)
    for layout in layouts:
        for place in layout.tensors:
            inference.placement[place.name] = (layout.index, place)
    ctx.sequence = list(schedule)
    if ctx.in_place or not layouts:  # Note [CPU in place]: the shadows already alias the parameters
        inference.block_of = {}
        return
    block_of = {layout.label: layout.index for layout in layouts}
    shadows = [ctx.tensor_objs(p.name for p in layout.tensors) for layout in layouts]
    inference.block_of = block_of
    inference.loader = BlockLoader(
        device=ctx.device,
        layouts=layouts,
        host_blocks=(),
        params=shadows,
        schedule=[block_of[label] for label in schedule if label in block_of],
        num_slots=num_slots,
        small_slot=ctx.plan.small_slot,
        per_tensor=True,
        timing=ctx.timing,
        host_views=[[shadow.data for shadow in group] for group in shadows],  # before the loader parks them
    )
    by_name = {entry.name: entry for entry in traps.entries.values()}
    traps.streamed = {id(by_name[name].param): layout.label for name, layout in streamed.items()}


def release_function_traps(ctx: EngineContext, preserve_model: bool) -> None:
    """Teardown, first step: the parameters take their places back in ``ctx.tensors`` (they never changed, so
    there is nothing to copy back); with ``preserve_model=False`` the streamed ones are dropped to ``meta``."""
    traps, ctx.function_traps = ctx.function_traps, None
    if traps is None:
        return
    for entry in traps.entries.values():
        ctx.tensors[entry.name] = dataclasses.replace(ctx.tensors[entry.name], tensor=entry.param)
    placed, ctx.inference.placement = ctx.inference.placement, {}
    traps.streamed = {}
    if not preserve_model:
        for name in placed:
            param = ctx.tensors[name].tensor
            assign_data(param, torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta"))
