"""How fast the compute device can read its own memory: the bound latency mode plans every batch size with.

Note [the smallest pass]
------------------------
A latency-mode plan streams a trap when its copy hides under the compute of the traps before it. Compute depends
on the batch; the copy does not. A plan made from a profile at a large batch streams copies that are exposed at a
small one (a 6 GiB model profiled at batch 4096 ran batch 1 at 9x its resident time until replans caught up).

Whatever the batch, a pass reads every weight it uses from device memory at least once, and no kernel reads
faster than the memory's peak rate. So ``trap bytes / peak read rate`` is a lower bound on a trap's compute at
every batch size, the smallest included, and a plan whose copies hide under those bounds hides them at any batch
(``flextensor.engine.switch`` plans latency mode with each trap's compute as the smaller of what the profile
measured and this bound). On a GPU, device memory reads tens of times faster than the host link copies, so such
a plan streams little: latency mode then keeps nearly the whole model resident, as an uncapped model should be,
and a memory budget (``max_gpu_mem_fraction``) is how a user trades latency for device memory.

The rate: the theoretical peak from the device's properties (memory clock x bus width x 2 for double data rate)
when torch exposes them; else a device-to-device copy, timed, whose traffic (read plus write) is taken as
``COPY_EFFICIENCY`` of the peak. Erring high keeps the bound a lower bound. Measured once per device and cached.
On a CPU there is no separate device memory: no bound unless a policy names a rate
(``flextensor.engine.policy.EnginePolicy.device_read_rate``).
"""

from __future__ import annotations

import logging
import threading

import torch

__all__ = ["COPY_EFFICIENCY", "copy_read_rate", "device_read_rate", "peak_read_rate"]

logger = logging.getLogger(__name__)

#: The share of peak memory traffic a plain device-to-device copy reaches (copies reach about 0.85-0.9 on
#: current GPUs): the timed copy's traffic is divided by it, so the rate errs high and the bound low.
COPY_EFFICIENCY = 0.8
_COPY_BYTES = 64 * 1024 * 1024
_COPY_REPEATS = 5

_lock = threading.Lock()
_rates: dict[int, float] = {}


def device_read_rate(device: torch.device) -> float | None:
    """Peak read rate of ``device``'s memory in bytes/s, or None on a non-CUDA device (see the Note above)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        rate = _rates.get(index)
        if rate is None:
            device = torch.device("cuda", index)
            rate = peak_read_rate(device) or copy_read_rate(device)
            _rates[index] = rate
            logger.debug("cuda:%d memory read rate %.0f GB/s", index, rate / 1e9)
    return rate


def peak_read_rate(device: torch.device) -> float | None:
    """The theoretical peak of a CUDA device's memory from its properties, None where torch does not expose the
    memory clock and bus width."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz <= 0 or bus_bits <= 0:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def copy_read_rate(device: torch.device) -> float:
    """The peak estimated from a timed device-to-device copy: its traffic (read plus write) over
    ``COPY_EFFICIENCY``."""
    free, _total = torch.cuda.mem_get_info(device)
    nbytes = max(1 << 20, min(_COPY_BYTES, free // 4))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    try:
        dst.copy_(src)  # the first copy pays one-off costs
        best = float("inf")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(_COPY_REPEATS):
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    finally:
        del src, dst
    return 2.0 * nbytes / max(best, 1e-9) / COPY_EFFICIENCY
