"""Inference-time offload timing (``offload_timing="eager"`` / ``"cuda_graph"``): per trap transfer, compute and wait.

What is measured, per forward pass and trap:

- ``transfer_ms``: the host-to-device copy of the trap's offloaded block (events around the copy on the side
  stream). The copy is issued while an *earlier* trap computes; it is attributed to the trap that consumes it.
- ``compute_ms``: the trap's forward on the compute stream (events around the patched forward).
- ``wait_ms``: the stall of the compute stream on the copy: events recorded just before and just after the
  compute stream waits for the copy-done event. Zero means the copy was fully hidden.

On CUDA the events are only read when a report is collected (reading forces a sync, which must never happen on
the hot path). On the CPU the same places use ``time.perf_counter`` and the copy is synchronous, so
``wait_ms`` is 0 by construction.

Publication: a pass is stored when the root forward returns (``TimingCollector.end_pass``), so a completed
forward is always visible to ``collect_offload_timing``. A pass captured into a CUDA graph is not a pass that
ran: with ``offload_timing="cuda_graph"`` its records go to the collector's replay store, whose events every
replay records again, and ``ft.update_offload_timing`` publishes them after a replay (Note [timing replayed
passes] in ``flextensor.runtime.graph_timing``); with ``"eager"`` a captured pass is not timed at all (its
events would never be read).

The public dataclasses are the simplified API's: records and snapshots hold the canonical data and all
totals are derived properties, so they cannot drift.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = [
    "CurrentStream",
    "TrapTimingRecord",
    "OffloadTimingSnapshot",
    "TrapTimingStats",
    "OffloadTimingReport",
    "TimingCollector",
    "format_offload_timing_table",
]

logger = logging.getLogger(__name__)


@dataclass
class TrapTimingRecord:
    """Per-trap timing of one forward pass, milliseconds. ``wait_ms == 0`` means the copy was hidden."""

    label: str
    transfer_ms: float = 0.0
    compute_ms: float = 0.0
    wait_ms: float = 0.0


@dataclass
class OffloadTimingSnapshot:
    """Timing data of one forward pass; totals are derived from ``per_trap``."""

    per_trap: Sequence[TrapTimingRecord] = ()

    @property
    def total_wait_ms(self) -> float:
        return sum(r.wait_ms for r in self.per_trap)

    @property
    def total_transfer_ms(self) -> float:
        return sum(r.transfer_ms for r in self.per_trap)

    @property
    def total_compute_ms(self) -> float:
        return sum(r.compute_ms for r in self.per_trap)


def _stats(values: Sequence[float]) -> tuple[float, float, float, float, float]:
    if not values:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    return min(values), max(values), statistics.fmean(values), statistics.median(values), std


@dataclass
class TrapTimingStats:
    """Aggregate statistics of one trap across passes (milliseconds)."""

    label: str
    compute_min: float = 0.0
    compute_max: float = 0.0
    compute_avg: float = 0.0
    compute_median: float = 0.0
    compute_std: float = 0.0
    transfer_min: float = 0.0
    transfer_max: float = 0.0
    transfer_avg: float = 0.0
    transfer_median: float = 0.0
    transfer_std: float = 0.0
    wait_min: float = 0.0
    wait_max: float = 0.0
    wait_avg: float = 0.0
    wait_median: float = 0.0
    wait_std: float = 0.0

    def compute_budget_ms(self, *, conservative: bool = False) -> float:
        """Positive compute budget for re-planning: median, or the minimum when ``conservative``."""
        value = self.compute_min if conservative else self.compute_median
        return max(value, 1e-6)

    @classmethod
    def from_records(cls, label: str, records: Sequence[TrapTimingRecord]) -> "TrapTimingStats":
        values: dict[str, Any] = {"label": label}
        for column in ("compute", "transfer", "wait"):
            lo, hi, avg, med, std = _stats([getattr(r, f"{column}_ms") for r in records])
            values.update({f"{column}_min": lo, f"{column}_max": hi, f"{column}_avg": avg,
                           f"{column}_median": med, f"{column}_std": std})
        return cls(**values)


@dataclass
class OffloadTimingReport:
    """Aggregate over several passes: ``passes`` is canonical, ``per_trap`` precomputed statistics."""

    per_trap: Sequence[TrapTimingStats] = ()
    passes: Sequence[OffloadTimingSnapshot] = ()

    @classmethod
    def from_passes(cls, passes: Sequence[OffloadTimingSnapshot]) -> "OffloadTimingReport":
        by_label: dict[str, list[TrapTimingRecord]] = {}
        for snap in passes:
            for rec in snap.per_trap:
                by_label.setdefault(rec.label, []).append(rec)
        stats = [TrapTimingStats.from_records(label, recs) for label, recs in by_label.items()]
        return cls(per_trap=tuple(stats), passes=tuple(passes))

    @property
    def num_passes(self) -> int:
        return len(self.passes)

    @property
    def total_compute_sum(self) -> float:
        return sum(p.total_compute_ms for p in self.passes)

    @property
    def total_transfer_sum(self) -> float:
        return sum(p.total_transfer_ms for p in self.passes)

    @property
    def total_wait_sum(self) -> float:
        return sum(p.total_wait_ms for p in self.passes)

    @property
    def total_compute_avg(self) -> float:
        return self.total_compute_sum / self.num_passes if self.passes else 0.0

    @property
    def total_transfer_avg(self) -> float:
        return self.total_transfer_sum / self.num_passes if self.passes else 0.0

    @property
    def total_wait_avg(self) -> float:
        return self.total_wait_sum / self.num_passes if self.passes else 0.0

    def compute_budgets_by_profile_label(
        self, profile_labels: Sequence[str], *, conservative: bool = False
    ) -> dict[str, float]:
        """Pair timing row ``i`` with ``profile_labels[i]`` and return each row's compute budget (ms)."""
        return {
            label: stats.compute_budget_ms(conservative=conservative)
            for label, stats in zip(profile_labels, self.per_trap)
        }


def format_offload_timing_table(data: OffloadTimingSnapshot | OffloadTimingReport) -> str:
    """A fixed-width text table of a snapshot (one pass) or a report (averages over passes)."""
    if isinstance(data, OffloadTimingSnapshot):
        rows = [(r.label, r.transfer_ms, r.compute_ms, r.wait_ms) for r in data.per_trap]
        title = "Offload timing (one pass, ms)"
        totals = ("TOTAL", data.total_transfer_ms, data.total_compute_ms, data.total_wait_ms)
    elif isinstance(data, OffloadTimingReport):
        rows = [(s.label, s.transfer_avg, s.compute_avg, s.wait_avg) for s in data.per_trap]
        title = f"Offload timing (average of {data.num_passes} passes, ms)"
        totals = ("TOTAL/pass", data.total_transfer_avg, data.total_compute_avg, data.total_wait_avg)
    else:
        raise TypeError(f"format_offload_timing_table takes an OffloadTimingSnapshot or OffloadTimingReport, "
                        f"got {type(data).__name__}")
    width = max([len("trap"), len(totals[0])] + [len(r[0]) for r in rows])
    header = f"{'trap':<{width}}  {'transfer':>10}  {'compute':>10}  {'wait':>10}"
    lines = [title, header, "-" * len(header)]
    for label, transfer, compute, wait in [*rows, totals]:
        lines.append(f"{label:<{width}}  {transfer:>10.3f}  {compute:>10.3f}  {wait:>10.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Engine-side collector
# ----------------------------------------------------------------------------------------------------------------


class CurrentStream:
    """``torch.cuda.current_stream(device)`` for the per-trap hot path.

    ``torch.cuda.current_stream`` resolves the device index in Python and builds a new ``Stream`` object on every
    call; the engine asks for the compute stream two to four times per trap and pass, which on a launch-bound
    pass (a few ms for 16 layers) is a visible share of the host time. This asks the runtime only for the current
    stream's id (one C call) and hands back the same ``Stream`` object while the id is unchanged, so a caller
    that switches streams (``with torch.cuda.stream(s):``) still gets the right one. Where torch lacks the
    private binding it falls back to ``torch.cuda.current_stream``.
    """

    __slots__ = ("_device", "_index", "_query", "_id", "_stream")

    def __init__(self, device: Any) -> None:
        import torch

        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._query = getattr(torch._C, "_cuda_getCurrentStream", None)
        self._id: int | None = None
        self._stream: Any = None

    def __call__(self) -> Any:
        import torch

        if self._query is None:
            return torch.cuda.current_stream(self._device)
        stream_id, device_index, device_type = self._query(self._index)
        if stream_id != self._id:
            self._stream = torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
            self._id = stream_id
        return self._stream


class _Span:
    """A duration measured either with two CUDA events (read lazily) or as perf_counter seconds."""

    __slots__ = ("start", "end", "seconds")

    def __init__(self) -> None:
        self.start: Any = None
        self.end: Any = None
        self.seconds = 0.0

    def ms(self) -> float:
        if self.start is not None:
            self.end.synchronize()
            return float(self.start.elapsed_time(self.end))
        return self.seconds * 1e3


@dataclass
class _PendingRecord:
    label: str
    compute: _Span = field(default_factory=_Span)
    transfer: _Span | None = None
    wait: _Span | None = None

    def resolve(self) -> TrapTimingRecord:
        return TrapTimingRecord(
            label=self.label,
            transfer_ms=self.transfer.ms() if self.transfer is not None else 0.0,
            compute_ms=self.compute.ms(),
            wait_ms=self.wait.ms() if self.wait is not None else 0.0,
        )


class TimingCollector:
    """Collects spans during INFERENCE passes; resolves them (possibly syncing) only in :meth:`collect`.

    Also the PROFILING clock (:meth:`mark`: one mark per trap entry). Its CUDA events are reused: they go back to
    a pool once read (:meth:`recycle_marks`), because creating an event is a driver call, costly on virtualised
    hosts.
    """

    def __init__(self, use_cuda: bool, device: Any = None, *, replays: Any = None) -> None:
        self.use_cuda = use_cuda
        # Spans opened without a stream record on the device's current stream, looked up cheaply.
        self._stream_now = CurrentStream(device) if use_cuda and device is not None else None
        # Completed passes: records to resolve, or snapshots already read (published replays).
        self._passes: list[list[_PendingRecord] | OffloadTimingSnapshot] = []
        self._current: list[_PendingRecord] | None = None
        self._record: _PendingRecord | None = None
        self._free_events: list[Any] = []
        #: ``offload_timing="cuda_graph"``: the store of captured passes (``flextensor.runtime.graph_timing``).
        #: Its events are external (``torch.cuda.Event(external=True)``): recorded by every replay of a graph.
        self.replays = replays
        self._captured = False  # this pass is being captured into a CUDA graph
        self._untimed = False  # ... and cannot be timed (eager timing): record nothing
        self._warned_capture = False

    # spans -------------------------------------------------------------------------------------------------------
    def _on(self, stream: Any) -> Any:
        """``stream``, or when None the device's current stream (looked up cheaply; None: the event's default)."""
        if stream is not None or self._stream_now is None:
            return stream
        return self._stream_now()

    def _event(self) -> Any:
        if self._free_events:
            return self._free_events.pop()
        import torch

        if self.replays is not None:
            return torch.cuda.Event(enable_timing=True, external=True)
        return torch.cuda.Event(enable_timing=True)

    def start_span(self, stream: Any = None) -> _Span | None:
        """A span starting now on ``stream``; None in a pass that is not timed (captured under eager timing)."""
        if self._untimed:
            return None
        span = _Span()
        if self.use_cuda:
            span.start = self._event()
            span.end = self._event()
            span.start.record(self._on(stream))
        else:
            span.seconds = time.perf_counter()
        return span

    # marks: the PROFILING clock -------------------------------------------------------------------------------------
    def mark(self) -> Any:
        """A point in time on the current stream: a recorded CUDA event, or ``perf_counter`` seconds.

        PROFILING times each trap's *window* between two marks (``flextensor.engine.profiling``): one mark per trap entry
        rather than a span of two events per call, because on a launch-bound pass every event record is host
        time the pass pays (a span of two events per call would double it, several percent of a short pass).
        """
        if not self.use_cuda:
            return time.perf_counter()
        event = self._event()
        event.record(self._on(None))
        return event

    def read_windows_ms(self, windows: Sequence[tuple[Any, Any]]) -> list[float]:
        """Milliseconds between the two marks of each window, waiting for the device once (for the last end
        mark: marks recorded on one stream complete in order); a window with a mark on another stream that is
        still pending then is waited for on its own."""
        if not windows:
            return []
        if not self.use_cuda:
            return [(end - start) * 1e3 for start, end in windows]
        windows[-1][1].synchronize()
        out = []
        for start, end in windows:
            try:
                out.append(float(start.elapsed_time(end)))
            except RuntimeError:  # a mark on another stream (the caller switched streams mid-pass): wait for it
                start.synchronize()
                end.synchronize()
                out.append(float(start.elapsed_time(end)))
        return out

    def mark_at(self, now: float) -> Any:
        """A mark for the host time ``now`` (a ``perf_counter`` reading just taken): on a host clock that very
        reading, so a window's two clocks agree exactly there (``flextensor.runtime.trap_windows``); else :meth:`mark`."""
        return now if not self.use_cuda else self.mark()

    def done(self, mark: Any) -> bool:
        """Whether the device has passed ``mark`` (a host-clock mark always has): reading it then waits for nothing."""
        return not self.use_cuda or bool(mark.query())

    def recycle_marks(self, marks: Sequence[Any]) -> None:
        """Return marks' events to the pool (each mark once; windows share their marks)."""
        if self.use_cuda:
            self._free_events.extend(marks)

    def end_span(self, span: _Span, stream: Any = None) -> None:
        if self.use_cuda:
            span.end.record(self._on(stream))
        else:
            span.seconds = time.perf_counter() - span.seconds

    # pass / trap structure ---------------------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self._current = []
        if self.use_cuda:
            import torch

            self._captured = torch.cuda.is_current_stream_capturing()
            if self._captured and self.replays is None:
                self._current, self._untimed = None, True
                if not self._warned_capture:
                    self._warned_capture = True
                    logger.warning("offload_timing='eager' does not time passes captured in a CUDA graph (their "
                                   "events are never recorded outside the graph); use offload_timing='cuda_graph' "
                                   "and ft.update_offload_timing() after each replay")

    def end_pass(self) -> None:
        if self._captured and self.replays is not None:
            if self._current:
                self.replays.add(self._current, self._on(None))
        elif self._current:
            self._passes.append(self._current)
        self._current = None
        self._record = None
        self._captured = self._untimed = False

    def begin_trap(self, label: str) -> None:
        if self._untimed:
            return
        if self._current is None:  # a trap outside a root pass (a manual block run on its own)
            self._current = []
        self._record = _PendingRecord(label)
        self._current.append(self._record)

    def start_compute(self) -> None:
        """Open the compute span (after the loader made the trap's weights available)."""
        if self._record is not None:
            self._record.compute = self.start_span() or _Span()

    def end_trap(self) -> None:
        if self._record is not None:
            self.end_span(self._record.compute)
            self._record = None

    def attach_transfer(self, transfer: _Span | None, wait: _Span | None) -> None:
        """Attribute a copy (and the stall on it) to the trap now starting."""
        if self._record is not None:
            self._record.transfer = transfer
            self._record.wait = wait

    # reports -----------------------------------------------------------------------------------------------------
    def collect(self) -> OffloadTimingReport | None:
        """Drain the completed passes into a report (``None`` when nothing was measured)."""
        if not self._passes:
            return None
        snapshots = [p if isinstance(p, OffloadTimingSnapshot) else OffloadTimingSnapshot(tuple(r.resolve() for r in p))
                     for p in self._passes]
        self._passes = []
        return OffloadTimingReport.from_passes(snapshots)

    def publish_replays(self, replay_generation: int = -1) -> bool:
        """Store the passes replayed since the last call (``ft.update_offload_timing``); ``False`` when their events
        could not be read. Without a replay store (eager timing, or the CPU) there is nothing to publish."""
        if self.replays is None:
            return True
        try:
            self._passes.extend(self.replays.publish(replay_generation))
        except RuntimeError as exc:  # e.g. a graph captured but never replayed: its events were never recorded
            logger.warning("update_offload_timing: the replayed passes' events could not be read: %s", exc)
            return False
        return True

    def reset(self) -> None:
        """Start a fresh measure window: drop stored passes; replays so far will not be published."""
        self._passes = []
        if self.replays is not None:
            self.replays.forget_replays()
