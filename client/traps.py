"""Traps (patched forwards and manual blocks) and the warm-up helpers of DISCOVERY and PROFILING.

A :class:`Trap` wraps one module's ``forward`` with an *instance-level* attribute (the class is untouched, so
``isinstance``, other instances, ``state_dict`` keys and module identity are unchanged). The wrapper calls the
manager's ``_trap_enter`` before and ``_trap_exit`` after the original forward; ``_trap_enter`` runs *outside*
the ``try`` so a refused entry (nesting) never runs the exit half. Manual ``offload_block`` traps have no
module and use the same enter/exit through a context manager.

During DISCOVERY a :class:`UsageRecorder` (a ``TorchFunctionMode`` active for the whole root forward) records
which trap - or code outside every trap - passes each model parameter to a torch function. It also makes
warm-up robust on a GPU: a parameter still on the host when some code uses it (another trap's weight, a weight
used outside traps) is swapped for a cached device copy in the call's arguments. Tensors used by more than one
trap, or outside traps, stay resident.

:class:`WarmLoader` gives a trap its weights on the compute device for DISCOVERY/PROFILING (a plain ``.to``
before the trap; the host tensor is put back after it), so the warm-up passes compute exactly what the plain
model computes. On the CPU compute device it does nothing: the weights already live there. When the host copies
are page-locked (``flextensor.staging``), ``non_blocking`` is set: the copy is queued on the current stream ahead
of the trap's compute (stream order keeps it correct) and the host thread does not wait for it. The engine
synchronizes before it unregisters those pages.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.manager import OffloadManager

__all__ = ["OUTSIDE", "Trap", "UsageRecorder", "WarmLoader", "ForwardShim", "assign_data"]

OUTSIDE = "<outside traps>"


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

    def install(self, manager: "OffloadManager", compile_fn: Callable[[nn.Module], nn.Module] | None = None) -> None:
        """Patch ``module.forward`` with the enter/exit wrapper (idempotent)."""
        module = self.module
        if module is None or self._installed:
            return
        self._had_instance_forward = "forward" in module.__dict__
        self._previous = module.__dict__.get("forward")
        original = module.forward  # bound method (or the previous instance-level callable)
        target: Callable[..., Any] = original
        if compile_fn is not None:
            target = compile_fn(ForwardShim(original))
        enter, leave = manager._trap_enter, manager._trap_exit

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            enter(self)
            try:
                return target(*args, **kwargs)
            finally:
                leave(self)

        forward.__flextensor_trap__ = self.label  # type: ignore[attr-defined]
        module.forward = forward  # instance attribute: the class stays untouched
        self._installed = True

    def uninstall(self) -> None:
        module = self.module
        if module is None or not self._installed:
            return
        if self._had_instance_forward:
            module.forward = self._previous
        else:
            module.__dict__.pop("forward", None)
        self._installed = False

    def __repr__(self) -> str:
        return f"Trap({self.label!r}, kind={self.kind!r}, candidates={len(self.candidates)})"


class UsageRecorder(TorchFunctionMode):
    """Records ``tensor name -> {trap labels}`` for model parameters passed to torch functions.

    ``enabled`` is switched off while the engine itself touches parameters (``.data`` swaps), so engine work is
    neither recorded nor rewritten.
    """

    def __init__(self, names_by_id: dict[int, str], device: torch.device, *, non_blocking: bool = False) -> None:
        super().__init__()
        self.names_by_id = names_by_id
        self.device = device
        self.non_blocking = non_blocking
        self.current = OUTSIDE
        self.enabled = True
        self.usage: dict[str, set[str]] = {}
        self._copies: dict[int, torch.Tensor] = {}

    def clear_copies(self) -> None:
        self._copies.clear()

    def _visit(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        name = self.names_by_id.get(id(value))
        if name is None:
            return value
        self.usage.setdefault(name, set()).add(self.current)
        if value.device != self.device and value.device.type != "meta":
            copy = self._copies.get(id(value))
            if copy is None:
                copy = value.detach().to(self.device, non_blocking=self.non_blocking)
                self._copies[id(value)] = copy
            return copy
        return value

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.enabled and self.names_by_id:
            args, kwargs = tree_map(self._visit, (args, kwargs))
        return func(*args, **kwargs)


class WarmLoader:
    """Puts a trap's offloadable tensors on the compute device for one warm-up trap call, then back."""

    def __init__(self, device: torch.device, *, non_blocking: bool = False) -> None:
        self.device = device
        self.non_blocking = non_blocking  # only when the host copies are pinned (see the module docstring)
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def load(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.device != self.device:
                host = tensor.data
                tensor.data = host.to(self.device, non_blocking=self.non_blocking)
                self._saved.append((tensor, host))

    def unload(self) -> None:
        while self._saved:
            tensor, host = self._saved.pop()
            tensor.data = host

    @property
    def active(self) -> bool:
        return bool(self._saved)
