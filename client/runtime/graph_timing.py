"""Offload timing of CUDA-graph replays (``offload_timing="cuda_graph"``): the passes captured, read after replays.

Note [timing replayed passes]
-----------------------------
A replayed CUDA graph runs no Python: no forward hook, no trap entry, no ``TimingCollector.end_pass``. What it
does run is every node captured, and an event recorded during capture with ``torch.cuda.Event(external=True)``
(PyTorch >= 2.8) becomes an *external* event-record node: each replay records that very event again, on the
device, where the captured pass recorded it. So the timing of a captured pass is kept, not stored:

1. *Capture.* The pass's trap records (transfer, compute and wait spans, each two external events) go to
   :meth:`ReplayTiming.add` instead of the collector's passes, with one more captured node: a one-element
   increment of the pass's *replay counter* (a slot of one small device tensor, allocated when the collector is
   made, never inside a capture). A process serving with several graphs (one per batch size) captures several
   passes; each has its own counter, so a read-back knows which graphs ran.
2. *Replay.* Nothing on the host. The events now hold the latest replay's times; the counter counts replays.
3. *Publish* (``ft.update_offload_timing``, :meth:`ReplayTiming.publish`): one device synchronize, one read of
   the counters, and for every captured pass whose counter moved since the last publish, its records resolved
   into an :class:`~flextensor.runtime.timing.OffloadTimingSnapshot` (the latest replay of that graph).
   ``collect_offload_timing`` then reports them with any eager passes. Call it after each replay to keep:
   replays between two calls overwrite each other's events. A ``replay_generation >= 0`` equal to the last
   published one publishes nothing (a serving hook and ``update_state`` may both announce one replay).

The records of every captured pass stay alive as long as the engine: a graph may be replayed until it is
destroyed, and its external nodes name these events (a destroyed event in a live graph is undefined
behaviour). Each is a few hundred bytes per trap. A pass captured under ``offload_timing="eager"`` is not timed
(its events could never be read: ``flextensor.runtime.timing``).

On a CPU compute device there is no capture: ``"cuda_graph"`` times eager passes as ``"eager"`` does.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from flextensor.runtime.timing import OffloadTimingSnapshot, TimingCollector

__all__ = ["COUNTER_SLOTS", "ReplayTiming", "offload_timing_collector", "is_capturing"]

logger = logging.getLogger(__name__)

#: Captured passes whose replays can be counted (one int64 each on the device: 32 KiB).
COUNTER_SLOTS = 4096


def is_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` (a CUDA device) is capturing a CUDA graph; False on the CPU."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def offload_timing_collector(mode: str, device: torch.device) -> TimingCollector | None:
    """The collector for ``OffloadConfig.offload_timing``: None for ``"off"``; for ``"cuda_graph"`` on CUDA one
    with a :class:`ReplayTiming` store (``RuntimeError`` when this PyTorch cannot record external events)."""
    if mode == "off":
        return None
    use_cuda = device.type == "cuda"
    replays = ReplayTiming(device) if mode == "cuda_graph" and use_cuda else None
    return TimingCollector(use_cuda, device, replays=replays)


class ReplayTiming:
    """The passes captured into CUDA graphs and their read-back after replays (Note [timing replayed passes])."""

    def __init__(self, device: torch.device) -> None:
        try:
            torch.cuda.Event(enable_timing=True, external=True)
        except TypeError as exc:
            raise RuntimeError(
                f"offload_timing='cuda_graph' records external CUDA events (torch.cuda.Event(external=True), "
                f"PyTorch >= 2.8), which torch {torch.__version__} does not have; upgrade PyTorch or use "
                "offload_timing='eager'"
            ) from exc
        self.device = device
        self._counters = torch.zeros(COUNTER_SLOTS, dtype=torch.int64, device=device)
        self._passes: list[Sequence[Any]] = []  # each captured pass's trap records (kept: see the Note)
        self._seen: list[int] = []  # each counted pass's replays at the last publish
        self._last_generation: int | None = None
        self._warned_full = False

    @property
    def captured(self) -> int:
        """Passes captured so far."""
        return len(self._passes)

    def add(self, records: Sequence[Any], stream: Any) -> None:
        """A pass captured on ``stream`` (still capturing): keep its records, count its replays."""
        index = len(self._passes)
        self._passes.append(records)
        if index < COUNTER_SLOTS:
            with torch.cuda.stream(stream):
                self._counters[index].add_(1)  # a node of the graph: runs at each replay
            self._seen.append(0)
        elif not self._warned_full:
            self._warned_full = True
            logger.warning("offload timing: more than %d passes captured in CUDA graphs; replays of the later ones "
                           "are not timed", COUNTER_SLOTS)

    def publish(self, replay_generation: int = -1) -> list[OffloadTimingSnapshot]:
        """Snapshots of the captured passes replayed since the last call (one each: its latest replay)."""
        if replay_generation >= 0 and replay_generation == self._last_generation:
            return []
        counts = self._read_counts()
        snapshots = []
        for index, count in enumerate(counts):
            if count > self._seen[index]:
                snapshots.append(OffloadTimingSnapshot(tuple(r.resolve() for r in self._passes[index])))
                self._seen[index] = count
        if replay_generation >= 0:
            self._last_generation = replay_generation
        return snapshots

    def forget_replays(self) -> None:
        """Replays so far are not published (``reset_offload_timing``: a fresh measure window)."""
        self._seen = self._read_counts()

    def _read_counts(self) -> list[int]:
        counted = len(self._seen)
        if not counted:
            return []
        torch.cuda.synchronize(self.device)  # a replay may run on any stream: wait for all of them
        return [int(v) for v in self._counters[:counted].tolist()]
