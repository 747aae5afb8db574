"""Patching forwards: traps around module forwards, the root forward that frames a pass, and undoing both.

A :class:`Trap` wraps one module's ``forward`` with an *instance-level* attribute (the class is untouched, so
``isinstance``, other instances, ``state_dict`` keys and module identity are unchanged). The wrapper calls an
``enter`` callback before and a ``leave`` callback after the original forward; ``enter`` runs *outside* the
``try`` so a refused entry (nesting) never runs the exit half. Manual ``offload_block`` traps have no module and
use the same callbacks through a context manager. :class:`RootForward` patches the model's own ``forward`` the
same way with ``begin``/``end`` callbacks, so the engine sees where a pass starts and ends.

torch.compile never compiles the patched forwards' own frames (``skip_frames``): the engine's steps run as plain
Python, outside any graph, and the model's (or the trap's) own forward is compiled as a frame of its own (Note
[engine steps outside compiled graphs] in ``flextensor.runtime.compile_guard``). In an eager region (a DISCOVERY
pass) they run the model's own forwards uncompiled instead (Note [no compiled code under the usage recorder]).

Installing and uninstalling are a symmetric pair on each object: whatever forward the instance had before
(none, or one set by someone else) is what ``uninstall`` puts back. The callbacks belong to the manager, which
dispatches them to the current phase handler; nothing here knows the phases.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable

import torch
from torch import nn

from flextensor.runtime.compile_guard import call_eagerly, dynamo_active, in_eager_region, skip_frames

__all__ = ["Trap", "RootForward", "ForwardShim", "assign_data", "bypass_resident_traps"]

logger = logging.getLogger(__name__)

TrapCallback = Callable[["Trap"], None]


def assign_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``tensor`` (a Parameter or buffer object) hold ``value``'s data, keeping its Python identity.

    ``tensor.data = value`` is the cheap path (a pointer swap) but refuses a change between ``meta`` and a real
    device; for those, ``torch.utils.swap_tensors`` exchanges the whole tensor implementation with a fresh
    object of the same class, so modules, optimizers and user references still see the same object.
    """
    if tensor.is_meta == value.is_meta:
        tensor.data = value
        return
    if isinstance(tensor, nn.Parameter):
        replacement: torch.Tensor = nn.Parameter(value, requires_grad=tensor.requires_grad)
    else:
        replacement = value.detach()
        if type(tensor) is not torch.Tensor:
            replacement = replacement.as_subclass(type(tensor))
    try:
        torch.utils.swap_tensors(tensor, replacement)
    except RuntimeError:
        if not value.is_meta:
            raise
        # Something (torch.compile's guards, for one) holds a weakref to the tensor, so it cannot be swapped.
        # Dropping to meta only serves to free memory of a model about to be discarded: an empty tensor on its
        # current device frees the same memory.
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


class ForwardShim(nn.Module):
    """A parameterless module around a trap's original forward, handed to ``compile_fn``.

    ``compile_fn`` must not receive the trap module itself: compiling it would call the module (hence the patched
    forward) again and recurse. The shim holds no parameters, so the compiled graph reads the trap module's
    parameters as they are at call time (the loader's device views).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self._fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)


class Trap:
    """One trap: a module path (``kind="module"``) or a manual block name (``kind="block"``)."""

    def __init__(self, label: str, module: nn.Module | None, candidates: list[str], kind: str = "module") -> None:
        self.label = label
        self.module = module
        self.kind = kind
        self.candidates = list(candidates)  # statically offloadable tensor names (patterns)
        self._installed = False
        self._previous: Any = None
        self._had_instance_forward = False
        self._original: Callable[..., Any] | None = None  # the module's forward when installed
        self._target: Callable[..., Any] | None = None  # what the wrapper calls: the original or compiled forward
        self._wrapper: Callable[..., Any] | None = None  # the enter/exit forward installed on the module
        self._direct: Callable[..., Any] | None = None  # what bypass() installs, once built
        self.bypassed = False

    def install(self, enter: TrapCallback, leave: TrapCallback,
                compile_fn: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """Patch ``module.forward`` with the enter/leave wrapper (idempotent)."""
        module = self.module
        if module is None or self._installed:
            return
        self._had_instance_forward = "forward" in module.__dict__
        self._previous = module.__dict__.get("forward")
        original = module.forward  # bound method (or the previous instance-level callable)
        target: Callable[..., Any] = original
        if compile_fn is not None:
            target = compile_fn(ForwardShim(original))
        trap = self

        compiled = target is not original

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if dynamo_active():  # inside torch.compile'd code: the engine's steps must not be compiled
                call_eagerly(enter, trap)
                try:
                    if in_eager_region():  # Note [no compiled code under the usage recorder]
                        return call_eagerly(original, *args, **kwargs)
                    return target(*args, **kwargs)
                finally:
                    call_eagerly(leave, trap)
            enter(trap)
            try:
                if compiled and in_eager_region():  # Note [no compiled code under the usage recorder]
                    return original(*args, **kwargs)
                return target(*args, **kwargs)
            finally:
                leave(trap)

        skip_frames(forward)  # Note [engine steps outside compiled graphs] in flextensor.runtime.compile_guard
        forward.__flextensor_trap__ = self.label  # type: ignore[attr-defined]
        module.forward = forward  # instance attribute: the class stays untouched
        self._original, self._target, self._wrapper = original, target, forward
        self._direct = None
        self._installed = True
        self.bypassed = False

    def bypass(self) -> None:
        """From now on the module calls its original (or compiled) forward with no enter/exit around it.

        For an INFERENCE trap that streams nothing and is not timed, the manager has nothing to do at entry or
        exit, and the wrapper's few microseconds per call add up to a percent or more of a short pass.
        The direct forward keeps the original's name, signature and docstring, and this trap's mark
        (``flextensor.units`` tells module traps by it); :meth:`uninstall` restores the module's own forward as
        before. A bypassed trap no longer refuses to nest (it never enters): nesting is refused in the warm-up
        passes, and adoption, which runs none, installs the traps of a plan that was profiled. A forward that
        someone replaced after :meth:`install` (a hook wrapping ours) is left alone: it may rely on the wrapper.
        """
        module = self.module
        if module is None or not self._installed or self.bypassed:
            return
        if module.__dict__.get("forward") is not self._wrapper:
            logger.debug("trap %r: the module's forward was replaced after the trap was installed; not bypassed",
                         self.label)
            return
        module.forward = self._direct_forward()
        self.bypassed = True

    def unbypass(self) -> None:
        """Undo :meth:`bypass`: the enter/exit wrapper runs again (a replan streams or times this trap now)."""
        module, wrapper = self.module, self._wrapper
        if module is None or wrapper is None or not self.bypassed:  # bypassed: installed, so it has a wrapper
            return
        if module.__dict__.get("forward") is self._direct:
            module.forward = wrapper
        self.bypassed = False

    def prepare_bypass(self) -> None:
        """Build what :meth:`bypass` installs now, ahead of the switch to INFERENCE (where every microsecond is
        the profile phase's; ``functools.update_wrapper`` costs a few per trap)."""
        if self.module is not None and self._installed:
            self._direct_forward()

    def _direct_forward(self) -> Callable[..., Any]:
        direct = self._direct
        if direct is None:
            target, original = self._target, self._original
            assert target is not None and original is not None, "only an installed trap is bypassed"
            direct = functools.update_wrapper(functools.partial(target), original)
            direct.__flextensor_trap__ = self.label  # type: ignore[attr-defined]
            self._direct = direct
        return direct

    def uninstall(self) -> None:
        module = self.module
        if module is None or not self._installed:
            return
        if self._had_instance_forward:
            module.forward = self._previous
        else:
            module.__dict__.pop("forward", None)
        self._installed = False
        self.bypassed = False
        self._original = self._target = self._wrapper = None

    def __repr__(self) -> str:
        return f"Trap({self.label!r}, kind={self.kind!r}, candidates={len(self.candidates)})"


class RootForward:
    """The model's own ``forward``, patched to call ``begin()`` before and ``end(ok)`` after each outermost call.

    A nested call (the model calling itself, or a hook calling the model inside a pass) runs the original
    directly. ``begin`` raising leaves no pass open; ``end`` always runs once ``begin`` succeeded.
    """

    def __init__(self, model: nn.Module, begin: Callable[[], None], end: Callable[[bool], None]) -> None:
        self.model = model
        self.depth = 0
        self._had_forward = "forward" in model.__dict__
        self._previous: Any = model.__dict__.get("forward")  # the instance-level forward replaced, if any
        original = model.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return original(*args, **kwargs)
            eager = dynamo_active()  # inside torch.compile'd code: the engine's steps must not be compiled
            self.depth = 1
            try:
                call_eagerly(begin) if eager else begin()
            except BaseException:
                self.depth = 0
                raise
            ok = False
            try:
                if eager and in_eager_region():  # Note [no compiled code under the usage recorder]
                    out = call_eagerly(original, *args, **kwargs)
                else:
                    out = original(*args, **kwargs)
                ok = True
                return out
            finally:
                self.depth = 0
                call_eagerly(end, ok) if eager else end(ok)

        skip_frames(forward)  # Note [engine steps outside compiled graphs] in flextensor.runtime.compile_guard
        model.forward = forward

    def uninstall(self) -> None:
        if self._had_forward:
            self.model.forward = self._previous
        else:
            self.model.__dict__.pop("forward", None)


def bypass_resident_traps(traps: Iterable[Trap], streamed: set[str]) -> None:
    """INFERENCE: module traps outside ``streamed`` call their forward directly (:meth:`Trap.bypass`). Traps not
    installed yet (adoption installs them after the build) are left alone; adoption calls this again once they
    are. The caller skips this when offload timing is on (it times every trap call)."""
    for trap in traps:
        if trap.kind == "module" and trap.label not in streamed:
            trap.bypass()
