"""PROFILING-phase measurements that feed the planner: the transfer sweep and the device memory budget.

Kept apart from the manager because both talk to the device directly (copies, memory queries) while the
manager only orchestrates phases.

Transfer sweep: one set of host-to-device copies at the end of PROFILING, at the sizes the planner will ask
about (each trap's offloadable bytes, thinned to a handful spread over the range, plus a small size so the fitted
latency is anchored). Each size is copied a few times and the fastest run kept (the first copy of a size pays
one-off costs). On CUDA the copy is timed with events on a side stream from a pinned buffer when pinning is
configured (what INFERENCE will do); on the CPU with ``perf_counter``.

The sweep's pinned buffer is a plain allocation registered in place for the sweep only (exact size),
not a ``pin_memory=True`` allocation: PyTorch's pinned allocator would round it up to a power of two, page-lock
it with ``cudaHostAlloc`` (much slower per byte) and keep it cached, idle, for the life of the process. Both kinds
of page-locked memory are DMA'd alike. Without a usable cudart binding it falls back to ``pin_memory=True``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Sequence

import torch

__all__ = ["transfer_sweep", "device_memory", "sweep_sizes"]

logger = logging.getLogger(__name__)

_MIN_SECONDS = 1e-9  # a copy never "takes 0 s": keeps the affine fit well defined on fast tiny copies


def sweep_sizes(trap_bytes: Sequence[int], limit: int = 6) -> list[int]:
    """Distinct positive sizes to measure: at most ``limit``, spread over the range, always incl. the largest."""
    sizes = sorted({int(n) for n in trap_bytes if n > 0})
    if not sizes:
        return []
    if len(sizes) > limit:
        step = (len(sizes) - 1) / (limit - 1)
        sizes = sorted({sizes[round(i * step)] for i in range(limit)})
    small = max(4096, sizes[0] // 16)
    if small < sizes[0]:
        sizes.insert(0, small)
    return sizes


def transfer_sweep(device: torch.device, trap_bytes: Sequence[int], *, pinned: bool, repeats: int = 3) -> list[tuple[int, float]]:
    """Measured ``(bytes, seconds)`` host-to-device copy samples for the transfer model."""
    sizes = sweep_sizes(trap_bytes)
    if not sizes:
        return []
    largest = sizes[-1]
    host, registered = _host_buffer(largest, pinned=pinned and device.type == "cuda")
    try:
        return _sweep(device, host, sizes, repeats)
    finally:
        if registered:
            from flextensor.runtime.pinned.in_place import unregister_in_place

            unregister_in_place(host)  # after _sweep returned: every copy from it has completed


def _host_buffer(nbytes: int, *, pinned: bool) -> tuple[torch.Tensor, bool]:
    """``(buffer, registered_in_place)``: see the module docstring for why pinning is done in place."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    if not pinned:
        return host, False
    from flextensor.runtime.pinned.in_place import register_in_place

    if register_in_place(host):
        return host, True
    return host.pin_memory(), False


def _sweep(device: torch.device, host: torch.Tensor, sizes: Sequence[int], repeats: int) -> list[tuple[int, float]]:
    dev = torch.empty(sizes[-1], dtype=torch.uint8, device=device)
    samples: list[tuple[int, float]] = []
    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # The device scope first: torch.cuda.stream() alone restores the *current* device's stream on exit,
        # which sets that device (cuda:0 in a process that never chose one) and creates a context there.
        # torch.cuda.device's exit puts the previous device back only if it already has a context.
        with torch.cuda.device(device), torch.cuda.stream(stream):
            for size in sizes:
                best = float("inf")
                for _ in range(repeats):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    dev.narrow(0, 0, size).copy_(host.narrow(0, 0, size), non_blocking=True)
                    end.record(stream)
                    end.synchronize()  # profiling, not the hot path
                    best = min(best, start.elapsed_time(end) / 1e3)
                samples.append((size, max(best, _MIN_SECONDS)))
        torch.cuda.current_stream(device).wait_stream(stream)
    else:
        for size in sizes:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                dev.narrow(0, 0, size).copy_(host.narrow(0, 0, size))
                best = min(best, time.perf_counter() - t0)
            samples.append((size, max(best, _MIN_SECONDS)))
    return samples


def _meminfo() -> tuple[int, int]:
    """(total, available) host RAM in bytes from /proc/meminfo (the CPU compute device's memory)."""
    from flextensor.shm.preflight import read_meminfo

    fields = read_meminfo()
    total, avail = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
    if total <= 0:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        avail = avail or total
    return total, avail


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the compute device: CUDA ``mem_get_info``, host RAM for the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total), int(free)
    return _meminfo()
