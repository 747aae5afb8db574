"""The resident warm-up's copies: pinning their sources, the one sweep, and ordering the traps after it.

Why a module of its own
-----------------------
When the offload candidates fit on the device (``flextensor.warmup`` decides), DISCOVERY/PROFILING keep one
device copy of each (``flextensor.traps.WarmLoader``). This mixin of :class:`~flextensor.manager.OffloadManager`
does the work around those copies, in the order it happens:

1. ``offload()``: :meth:`_stage` registers the candidates' host storages in place (``flextensor.staging``), so
   the copies are direct DMA and may be queued (``non_blocking``); :meth:`_choose_warmup` records the decision
   and the names still to copy; with DISCOVERY skipped, :meth:`_overlap_stream` makes the side stream the first
   pass will copy on.
2. The first warm-up pass, before any trap: :meth:`_preload_warmup` copies every pending candidate once, trap
   by trap, between CUDA timing events. In a PROFILING pass the copies run on the side stream and each trap's
   compute waits only for its own group's copy (:meth:`_wait_warm_copy`, called at its entry), so the pass's
   compute overlaps the sweep.
3. The switch to INFERENCE: :meth:`_warm_samples` turns the sweep's events into ``(bytes, seconds)`` samples,
   the transfer measurement the planner fits (no second sweep).

Ordering: all copies and their events are recorded on one stream, in trap order; a trap's compute waits for
its group's end event, and everything after the pass (or a trap the pass did not enter) waits for the last one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from flextensor.phases import Phase
from flextensor.state import tensor_nbytes
from flextensor.warmup import choose_warmup

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.staging import PinnedStaging
    from flextensor.state import ModelTensor
    from flextensor.traps import Trap, WarmLoader
    from flextensor.warmup import WarmupDecision

__all__ = ["WarmCopiesMixin"]

logger = logging.getLogger("flextensor.manager")  # the manager's own lines, as in flextensor.phases


class WarmCopiesMixin:
    """The resident warm-up's copies for :class:`~flextensor.manager.OffloadManager` (see the module docs)."""

    if TYPE_CHECKING:  # attributes the manager owns
        name: str
        _device: torch.device
        _phase: Phase | None
        _tensors: dict[str, ModelTensor]
        _traps: dict[str, Trap]
        _staging: PinnedStaging
        _warm: WarmLoader
        _warmup: WarmupDecision | None
        _warmup_override: str | None
        _warm_pending: list[str]
        _warm_events: list[tuple[int, Any, Any]]
        _warm_ready: dict[str | None, Any]
        _warm_last: Any
        _warm_stream: Any

        def _config(self) -> Any: ...
        def _tensor_objs(self, names: Any) -> list[torch.Tensor]: ...

    def _stage(self, candidates: set[str]) -> None:
        """Pin the candidates' host storages in place for the warm-up copies (``flextensor.staging``)."""
        if not candidates or not self._staging.wanted(self._config(), self._device):
            return
        self._staging.stage({n: self._tensors[n].tensor for n in sorted(candidates)}, self._device)
        # Unless staging failed, every host candidate is now page-locked (by us, or already before).
        self._warm.non_blocking = not self._staging.failed

    def _choose_warmup(self, candidates: set[str]) -> None:
        """Resident or streamed warm-up copies (``flextensor.warmup``); resident ones are copied at the first pass."""
        decision = choose_warmup(self, candidates)
        self._warmup = decision
        self._warm.keep = decision.resident
        forced_copies = self._warmup_override is not None and self._device.type != "cuda"
        if forced_copies:  # tests: the CPU "copies" the candidates too, as a GPU would, so the bookkeeping runs
            self._warm.same_device_copies = {id(self._tensors[n].tensor) for n in candidates}
        if decision.resident:
            self._warm_pending = sorted(n for n in candidates
                                        if forced_copies or self._tensors[n].tensor.device != self._device)

    def _overlap_stream(self) -> Any:
        """The side stream the first PROFILING pass's warm-up copies will run on, made now, in ``offload()``.

        The first stream a process makes creates PyTorch's whole stream pool (tens of ``cudaStreamCreate``,
        4.6 ms measured on an H200 host). Made at the first pass, that set-up held back the first copy of the
        sweep by as long; here it is part of setting the model up, where the host registration already is.
        None when there will be no overlapped preload (no resident copies pending, CPU, pageable sources).
        """
        if not self._warm_pending or self._device.type != "cuda" or not self._warm.non_blocking:
            return None
        return torch.cuda.Stream(device=self._device)

    def _preload_warmup(self) -> None:
        """Start of a warm-up pass: copy the pending resident candidates (once), before any trap or timing.

        Trap by trap, between CUDA timing events when the copies come from page-locked memory: this one sweep of
        the offloaded weights is also the transfer measurement the planner fits (:meth:`_warm_samples`), so the
        switch to INFERENCE does not sweep again.

        In a PROFILING pass (DISCOVERY skipped, so each trap's weights are its own) the copies run on a side
        stream and each trap's compute waits only for its own group's copy (:meth:`_wait_warm_copy`): the
        pass's compute overlaps the sweep instead of following it. This relies on what skipping DISCOVERY
        already means (INFERENCE streams each trap's weights only while that trap runs): a trap's weights are
        read inside its own forward, not by pre-hooks, other traps or code between traps. A DISCOVERY pass has
        not yet learnt which trap uses what, so there the copies stay on the compute stream, ahead of everything.
        """
        names, self._warm_pending = self._warm_pending, []
        if not names:
            return
        pending = set(names)
        labelled = [(label, [n for n in trap.candidates if n in pending]) for label, trap in self._traps.items()]
        grouped = {n for _label, group in labelled for n in group}
        groups = [(None, [n for n in names if n not in grouped])] + [(label, g) for label, g in labelled if g]
        timed = self._device.type == "cuda" and self._warm.non_blocking
        compute = torch.cuda.current_stream(self._device) if timed else None
        stream = compute
        if timed and self._phase is Phase.PROFILING:
            stream, self._warm_stream = self._warm_stream or torch.cuda.Stream(device=self._device), None
            stream.wait_stream(compute)  # memory the compute freed may be handed to these copies
            self._warm.copy_stream = stream
        ready: dict[str | None, Any] = {}
        ordered = stream is compute  # True once every reader is ordered after the side-stream copies
        try:
            for label, group in groups:
                if not group:
                    continue
                start = end = None
                if timed:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                if not self._warm.preload(self._tensor_objs(group)):
                    self._warm_events = []
                    ready.clear()
                    return  # stream mode (out of device memory): the planner sweeps instead
                if timed:
                    end.record(stream)
                    self._warm_events.append((sum(tensor_nbytes(self._tensors[n].tensor) for n in group), start, end))
                    ready[label] = end
            if stream is not compute and ready:
                outside = ready.pop(None, None)
                if outside is not None:  # candidates of no trap: whoever reads them, they are there first
                    compute.wait_event(outside)
                self._warm_ready = ready
                self._warm_last = self._warm_events[-1][2]
                ordered = True
        finally:
            self._warm.copy_stream = None
            if not ordered:  # out of memory, or an error part-way: copies already made stay; order them now
                compute.wait_stream(stream)
        logger.debug("manager %r: %d warm-up tensors (%d bytes) copied to %s and kept", self.name, len(names),
                     self._warm.kept_bytes, self._device)

    def _wait_warm_copy(self, label: str | None) -> None:
        """Order the compute stream after trap ``label``'s warm-up copy (``None``: after all of them)."""
        event = self._warm_last if label is None else self._warm_ready.pop(label, None)
        if label is None:
            self._warm_ready, self._warm_last = {}, None
        if event is not None:
            torch.cuda.current_stream(self._device).wait_event(event)

    def _warm_samples(self) -> list[tuple[int, float]]:
        """``(bytes, seconds)`` of the resident warm-up's copies per trap (empty when not measured).

        One wait serves every pair: ``_preload_warmup`` records all of them, in order, on one stream, so once the
        last end event completed every earlier event has too (long finished anyway: the profiling passes ran on
        these copies)."""
        events, self._warm_events = self._warm_events, []
        if events:
            events[-1][2].synchronize()
        samples = [(nbytes, start.elapsed_time(end) / 1e3) for nbytes, start, end in events]
        return [s for s in samples if s[0] > 0 and s[1] > 0]
