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

:class:`WarmLoader` gives a trap its weights on the compute device for DISCOVERY/PROFILING, so the warm-up
passes compute exactly what the plain model computes. Two modes, chosen once per offload by
``flextensor.warmup``: *resident* (each weight copied once with a plain ``.to``, kept on the device across trap
calls and passes, freed or kept for good when INFERENCE is built) when the candidates fit in device memory,
else *stream* (copied before each trap call, the host tensor put back after it). On the CPU compute device it
copies nothing: the weights already live there. When the host copies are page-locked (``flextensor.staging``),
``non_blocking`` is set: the copy is queued on the current stream ahead of the trap's compute (stream order keeps
it correct) and the host thread does not wait for it. The engine synchronizes before it unregisters those pages.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from flextensor.state import tensor_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.manager import OffloadManager

__all__ = ["OUTSIDE", "Trap", "UsageRecorder", "WarmLoader", "ForwardShim", "assign_data"]

logger = logging.getLogger(__name__)

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
        self._original: Callable[..., Any] | None = None  # the module's forward when installed
        self._target: Callable[..., Any] | None = None  # what the wrapper calls: the original or compiled forward
        self._wrapper: Callable[..., Any] | None = None  # the enter/exit forward installed on the module
        self._direct: Callable[..., Any] | None = None  # what bypass() installs, once built
        self.bypassed = False

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
        self._original, self._target, self._wrapper = original, target, forward
        self._direct = None
        self._installed = True
        self.bypassed = False

    def bypass(self) -> None:
        """From now on the module calls its original (or compiled) forward with no enter/exit around it.

        For an INFERENCE trap that streams nothing and is not timed, the manager has nothing to do at entry or
        exit, and the wrapper cost 2.6 us per call on the H200 host: 16 resident layers, 1.4% of a 3 ms pass.
        The direct forward keeps the original's name, signature and docstring, and this trap's mark
        (``flextensor.replan`` tells module traps by it); :meth:`uninstall` restores the module's own forward as
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

    def prepare_bypass(self) -> None:
        """Build what :meth:`bypass` installs now, ahead of the switch to INFERENCE (where every microsecond is
        the profile phase's; ``functools.update_wrapper`` costs a few per trap)."""
        if self.module is not None and self._installed:
            self._direct_forward()

    def _direct_forward(self) -> Callable[..., Any]:
        direct = self._direct
        if direct is None:
            direct = functools.update_wrapper(functools.partial(self._target), self._original)  # type: ignore[arg-type]
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
    """Gives a trap its offloadable tensors on the compute device during DISCOVERY/PROFILING.

    Two modes (chosen by ``flextensor.warmup``; see the module docstring of this file and of that one):

    - stream (``keep=False``): :meth:`load` copies before the trap call, :meth:`unload` puts the host data back
      after it, so every warm-up pass copies every trap's weights again;
    - resident (``keep=True``): a copy is made once (:meth:`preload` before the first warm-up pass, or :meth:`load`
      when a tensor is first needed) and stays the tensor's data across trap calls and passes; :meth:`unload`
      leaves it. At the INFERENCE build the engine calls :meth:`restore` for the tensors it packs into host blocks
      (their device copies are freed before any device block is allocated) and :meth:`commit` for the ones that
      stay resident (their warm-up copy becomes their device data: no second copy).

    A tensor already on the device is not copied, except those in ``same_device_copies`` (ids; an internal test
    switch: on a CPU compute device the offload candidates are "copied" as clones, as they would be copied from
    the host to a GPU, so the bookkeeping runs on hosts without CUDA). ``copies`` and
    ``copied_bytes`` count every copy made, so tests can check that a resident warm-up copies each tensor once.

    Out of device memory while keeping copies (``torch.OutOfMemoryError``): every kept copy is given back, the
    loader switches to stream mode for the rest of the warm-up (``fell_back``) and says so in one warning.
    """

    def __init__(self, device: torch.device, *, non_blocking: bool = False, keep: bool = False,
                 same_device_copies: Iterable[torch.Tensor] = ()) -> None:
        self.device = device
        self.non_blocking = non_blocking  # only when the host copies are pinned (see the module docstring)
        self.keep = keep
        self.same_device_copies: set[int] = {id(t) for t in same_device_copies}
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # stream mode: put back by unload()
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # resident: id -> (tensor, host data)
        #: When set (CUDA, pinned sources), copies are issued on this stream instead of the current one; the
        #: caller orders the readers (``OffloadManager._preload_warmup``: one event per trap).
        self.copy_stream: Any = None
        self.copies = 0
        self.copied_bytes = 0
        self.fell_back = False
        #: Counts every time kept copies were given up (restore, commit, detach, fall-back): a caller that saw a
        #: trap's tensors all kept at one value may skip :meth:`load` for that trap while it is unchanged.
        self.removals = 0

    # ------------------------------------------------------------------------------------------------ copies
    def _needs_copy(self, tensor: torch.Tensor) -> bool:
        if id(tensor) in self._kept or tensor.is_meta:
            return False
        return tensor.device != self.device or id(tensor) in self.same_device_copies

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        """One warm-up copy of ``host`` on the compute device (a subclass may wrap it, e.g. to count or fail)."""
        if host.device == self.device:  # same_device_copies: a clone keeps dtype, shape and strides
            return host.clone()
        if self.copy_stream is None:
            return host.to(self.device, non_blocking=self.non_blocking)
        # Allocated on the current stream (its pool, where the compute frees and reuses memory), written by the
        # copy stream; record_stream keeps the memory from reuse until that copy ran, even if the copy is
        # dropped early (out-of-memory fallback).
        device_copy = torch.empty_like(host, device=self.device)
        with torch.cuda.stream(self.copy_stream):
            device_copy.copy_(host, non_blocking=True)
        device_copy.record_stream(self.copy_stream)
        return device_copy

    def _load(self, tensors: Iterable[torch.Tensor], keep: bool) -> None:
        for tensor in tensors:
            if not self._needs_copy(tensor):
                continue
            host = tensor.data
            tensor.data = self._copy(host)
            self.copies += 1
            self.copied_bytes += tensor_nbytes(host)
            if keep:
                self._kept[id(tensor)] = (tensor, host)
            else:
                self._saved.append((tensor, host))

    def load(self, tensors: Iterable[torch.Tensor]) -> None:
        """Before a trap call: make ``tensors`` hold device data (kept in resident mode)."""
        tensors = list(tensors)
        if self.keep:
            try:
                self._load(tensors, keep=True)
                return
            except torch.OutOfMemoryError as exc:
                self._fall_back(exc)
        self._load(tensors, keep=False)

    def preload(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Resident mode: copy ``tensors`` now, ahead of any trap. False when not kept (stream mode, or OOM)."""
        if not self.keep:
            return False
        try:
            self._load(tensors, keep=True)
        except torch.OutOfMemoryError as exc:
            self._fall_back(exc)
            return False
        return True

    def unload(self) -> None:
        """After a trap call: put back the host data of what :meth:`load` streamed (kept copies stay)."""
        while self._saved:
            tensor, host = self._saved.pop()
            tensor.data = host

    # ------------------------------------------------------------------------------------------------ kept copies
    def _take(self, tensors: Iterable[torch.Tensor] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self.removals += 1
        if tensors is None:
            taken = list(self._kept.values())
            self._kept.clear()
            return taken
        return [pair for pair in (self._kept.pop(id(t), None) for t in tensors) if pair is not None]

    def restore(self, tensors: Iterable[torch.Tensor] | None = None) -> int:
        """Give kept tensors (all, or those given) their host data back, freeing their device copies; bytes freed."""
        freed = 0
        for tensor, host in self._take(tensors):
            freed += tensor_nbytes(tensor.data)
            tensor.data = host
        return freed

    def holds(self, tensor: torch.Tensor) -> bool:
        """True while ``tensor``'s data is a kept warm-up copy."""
        return id(tensor) in self._kept

    def holds_all(self, tensors: Iterable[torch.Tensor]) -> bool:
        """True when every one of ``tensors`` holds a kept warm-up copy (one call for a whole plan's tensors)."""
        kept = self._kept
        return all(id(t) in kept for t in tensors)

    def detach(self, groups: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Stop keeping the tensors of ``groups`` (all must be kept; one group per host block); they keep their
        device copy as data for now, and their host data is returned, group by group in order, for whoever
        fills their host blocks (``flextensor.deferred_build``). Nothing is detached when one is missing or
        listed twice."""
        groups = [list(tensors) for tensors in groups]
        kept = self._kept
        ids = [id(t) for tensors in groups for t in tensors]
        missing = sum(1 for i in ids if i not in kept)
        if missing:
            raise RuntimeError(f"{missing} tensor(s) have no kept warm-up copy to detach")
        if len(set(ids)) != len(ids):
            raise RuntimeError("a tensor is listed twice in the groups to detach; each block packs a tensor once")
        self.removals += 1
        pop, discard = kept.pop, self.same_device_copies.discard
        hosts = []
        for tensors in groups:
            hosts.append([pop(id(t))[1] for t in tensors])
            for t in tensors:
                discard(id(t))
        return hosts

    def commit(self, tensors: Iterable[torch.Tensor] | None = None, count: bool = True) -> int:
        """Kept tensors (all, or those given) keep their device copy for good; the host data is let go. Bytes
        (0 with ``count=False``: the switch to INFERENCE counts them only for a debug line)."""
        taken = self._take(tensors)
        self.same_device_copies.difference_update(id(t) for t, _host in taken)  # on the device for good now
        # Counted on the host tensors (same dtype and shape): ``.data`` builds a new tensor object per call, and
        # this runs at the switch to INFERENCE for every tensor that stays resident.
        return sum(tensor_nbytes(host) for _t, host in taken) if count else 0

    def _fall_back(self, exc: BaseException) -> None:
        kept = self.restore()  # counts as a removal (restore -> _take)
        self.keep = False
        self.fell_back = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the copies just given back, so the streamed copies find room
        logger.warning("warm-up ran out of device memory while keeping the offload candidates on %s (%s); %d bytes "
                       "of kept copies given back, the remaining warm-up passes copy each trap's weights per call",
                       self.device, str(exc).splitlines()[0] if str(exc) else type(exc).__name__, kept)

    # ------------------------------------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """True while a trap's streamed copies are in place (between :meth:`load` and :meth:`unload`)."""
        return bool(self._saved)

    @property
    def kept_count(self) -> int:
        return len(self._kept)

    @property
    def kept_bytes(self) -> int:
        return sum(tensor_nbytes(t.data) for t, _host in self._kept.values())
