"""Exposed-wait detection for INFERENCE: does the compute stream stall on the block loader's copies?

Why: a latency-mode plan streams the traps whose copies hid under the compute measured while profiling. Served
at a smaller batch the same copies no longer hide, and every pass stalls on them (a model profiled at a large
batch and served at batch 1 runs at many times its resident pass: ``docs/benchmarks.md``, "Serving at other
batch sizes"). The engine notices it here and replans (``flextensor.engine.replan``).

What is measured: on a *sampled* pass, two events on the compute stream around each wait for a copy (the
stall, as ``offload_timing="eager"`` measures it) and one at the pass's first and last streamed trap (the span
the waits are compared with). Events are read only once the device has passed them (``query()``), at a later
pass's start: nothing here ever waits for the device. Sampling (the first passes after a plan is installed,
then one pass in ``SAMPLE_EVERY``) keeps the cost to a few event records per streamed trap on a sampled pass.

On a CPU compute device that streams through the loader (a test setting), copies are synchronous: a copy done
inside a trap's entry is the stall, timed with ``perf_counter``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["PassStall", "StallProbe", "SAMPLE_EVERY", "FIRST_SAMPLED"]

#: After the first ``FIRST_SAMPLED`` passes of a plan, one pass in ``SAMPLE_EVERY`` is sampled.
SAMPLE_EVERY = 8
FIRST_SAMPLED = 3


@dataclass(frozen=True)
class PassStall:
    """One sampled pass: the compute stream's total stall on copies and the span of its streamed traps (ms)."""

    wait_ms: float
    span_ms: float


class StallProbe:
    """Samples passes and reports their stall once the device has run them (see the module docstring)."""

    def __init__(self, use_cuda: bool) -> None:
        self.use_cuda = use_cuda
        self.passes = 0
        self.sampling = False
        self._first: Any = None
        self._last: Any = None
        self._waits: list[tuple[Any, Any]] = []
        self._cpu_wait = 0.0
        self._pending: list[tuple[Any, Any, list[tuple[Any, Any]], float]] = []
        self._free: list[Any] = []

    def _event(self) -> Any:
        if self._free:
            return self._free.pop()
        import torch

        return torch.cuda.Event(enable_timing=True)

    def begin_pass(self) -> None:
        """Decide whether this pass is sampled."""
        self.passes += 1
        self.sampling = 0 < self.passes and (self.passes <= FIRST_SAMPLED or self.passes % SAMPLE_EVERY == 0)
        self._first = self._last = None
        self._waits = []
        self._cpu_wait = 0.0

    def wait_for_copy(self, compute: Any, copy_done: Any) -> None:
        """Make ``compute`` wait for ``copy_done`` (the loader's wait), timing the stall on a sampled pass."""
        if not self.sampling:
            compute.wait_event(copy_done)
            return
        before, after = self._event(), self._event()
        before.record(compute)
        compute.wait_event(copy_done)
        after.record(compute)
        self._waits.append((before, after))
        if self._first is None:
            self._first = before
        self._last = after

    def add_cpu_wait(self, seconds: float) -> None:
        """A synchronous copy inside a trap's entry (a CPU compute device streaming through the loader)."""
        if self.sampling:
            self._cpu_wait += seconds
            if self._first is None:
                self._first = time.perf_counter() - seconds

    def end_pass(self, compute: Any) -> None:
        """Close a sampled pass: its span ends at the compute stream's position now."""
        if not self.sampling or self._first is None:
            return
        if self.use_cuda:
            end = self._event()
            end.record(compute)
            self._pending.append((self._first, end, self._waits, 0.0))
        else:
            self._pending.append((self._first, time.perf_counter(), [], self._cpu_wait))
        self._first = None
        self._waits = []

    def poll(self) -> list[PassStall]:
        """Sampled passes the device has finished, oldest first; never waits."""
        done: list[PassStall] = []
        while self._pending:
            first, end, waits, cpu_wait = self._pending[0]
            if not self.use_cuda:
                done.append(PassStall(cpu_wait * 1e3, (end - first) * 1e3))
                self._pending.pop(0)
                continue
            if not end.query():
                break
            self._pending.pop(0)
            wait_ms = sum(float(a.elapsed_time(b)) for a, b in waits)
            done.append(PassStall(wait_ms, float(first.elapsed_time(end))))
            self._free.append(end)
            for a, b in waits:
                self._free.extend((a, b))
        return done

    def quiet(self, passes: int) -> None:
        """Sample nothing for the next ``passes`` passes."""
        self.restart()
        self.passes = -passes

    def restart(self) -> None:
        """A new plan: sample its first passes again; forget passes of the old one."""
        self.passes = 0
        self._pending.clear()
        self._first = None
        self._waits = []
