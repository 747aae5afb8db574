"""The warm-up passes' weights on the compute device: :class:`WarmLoader`.

DISCOVERY and PROFILING passes must compute exactly what the plain model computes, so every trap needs its
weights on the compute device while it runs. Two modes, chosen once per offload (``flextensor.engine.warmup``):
*resident* (each weight copied once, kept on the device across trap calls and passes, freed or kept for good
when INFERENCE is built) when the candidates fit in device memory, else *stream* (copied before each trap call,
the host tensor put back after it). On the CPU compute device it copies nothing: the weights already live
there. When the host copies are page-locked (``flextensor.runtime.pinned.in_place``), ``non_blocking`` is set: the copy
is queued on the current stream ahead of the trap's compute (stream order keeps it correct) and the host thread
does not wait for it; the engine synchronizes before it unregisters those pages.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

import torch

from flextensor.runtime.pinned.launch_turns import LaunchTurns
from flextensor.state import tensor_nbytes

__all__ = ["WarmLoader"]

logger = logging.getLogger(__name__)


class WarmLoader:
    """Gives a trap its offloadable tensors on the compute device during DISCOVERY/PROFILING.

    Two modes (chosen by ``flextensor.engine.warmup``; see the module docstring of this file and of that one):

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
        #: Called with each host tensor before its copy: waits for its staging registration when that runs on
        #: a thread (``PinnedStaging.wait_for``), so the copy is a DMA rather than a pageable one.
        self.gate: Callable[[torch.Tensor], object] | None = None
        #: Set with ``gate``: a copy takes the launches' turn, :meth:`unload` (the trap's exit) gives it back once
        #: held long enough and :meth:`pass_ended` always, so the registrations still running do not hold up the
        #: traps' launches (flextensor.runtime.pinned.launch_turns). :meth:`preload`'s caller gives it back itself,
        #: after the events that time the copies.
        self.turns: LaunchTurns | None = None
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
        if self.gate is not None:
            self.gate(host)
        if self.turns is not None:
            self.turns.take()
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

    def ready_to_time(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Wait for every region of ``tensors`` to be tried by the staging (the ``gate``), then take the launches'
        turn: what a timed copy does before its start event, so that the pair times copies, not these waits.
        False when some region is not page-locked (its copy would be pageable: no DMA to time)."""
        gate = self.gate
        pinned = gate is None or all([gate(t.data) for t in tensors])  # every one waited for, then checked
        if self.turns is not None:
            self.turns.take()
        return pinned

    def load_timed(self, tensors: Iterable[torch.Tensor]) -> tuple[int, Any, Any] | None:
        """Stream mode on CUDA: :meth:`load` between two timing events on the stream the copies run on, as
        ``(bytes, start, end)``; None (the copies made, untimed) when nothing needed a copy, some copy would not
        be a DMA from page-locked memory, or the device reached the start event before the last copy was queued
        (it may then have waited for the host inside the pair: after a synchronize, or an allocation that
        blocked the host; a device that lags the host, as in a copy-bound pass, never has)."""
        todo = [t for t in tensors if self._needs_copy(t)]
        if (self.keep or not todo or not self.non_blocking or self.device.type != "cuda"
                or not self.ready_to_time(todo)):
            self.load(todo)
            return None
        stream = self.copy_stream or torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self._load(todo, keep=False)
        end.record(stream)
        if start.query():
            return None
        return sum(tensor_nbytes(t.data) for t in todo), start, end

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
        if self.turns is not None:
            self.turns.give_between_traps()

    def pass_ended(self) -> None:
        """After a forward pass: the launches' turn goes back to the registrations, held or not."""
        if self.turns is not None:
            self.turns.give()

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
        fills their host blocks (``flextensor.engine.build``). Nothing is detached when one is missing or
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
