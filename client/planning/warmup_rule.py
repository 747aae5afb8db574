"""The warm-up residency rule: whether DISCOVERY/PROFILING keep the offload candidates on the device.

The decision (a pure function, :func:`decide_warmup`, so it is tested with plain numbers)
---------------------------------------------------------------------------------------------
- ``needed``: the bytes of the offload candidates not on the compute device yet.
- Memory mode (``max_gpu_mem_fraction`` or ``set_memory_budget``): available = budget - bytes already resident on
  the device (what ``offload()`` put there: buffers, shared and non-trap tensors). It is also never more than the
  device's free memory less the safety margin below: a budget is a promise of what FlexTensor *may* use, not proof
  that the memory exists, and the forward's activations need room too.
- Latency mode (no budget): available = free device memory (``torch.cuda.mem_get_info``) - a safety margin of
  ``max(10% of the device's total memory, 1 GiB)`` kept for activations, the transfer sweep and the INFERENCE
  build.
- Resident iff ``needed <= available`` (or nothing is needed); else stream (copies per trap call).
- A CPU compute device is *in-place*: the weights already live in the memory the CPU computes from, so nothing is
  copied at all (unchanged behaviour).
- ``override`` ("resident" / "stream", internal, for tests) forces a mode. The manager then also makes the CPU
  copy the candidates (``WarmLoader.same_device_copies``), so both modes' bookkeeping runs end to end on hosts without CUDA.

"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from flextensor.shm.sizes import format_bytes

__all__ = ["WarmupMode", "WarmupDecision", "decide_warmup", "warmup_margin", "WARMUP_MARGIN_FRACTION",
           "WARMUP_MARGIN_MIN_BYTES"]

WARMUP_MARGIN_FRACTION = 0.10
WARMUP_MARGIN_MIN_BYTES = 1 << 30


class WarmupMode(str, enum.Enum):
    RESIDENT = "resident"  # copied once, kept on the device until INFERENCE is built
    STREAM = "stream"  # copied before each trap call, host data put back after it
    IN_PLACE = "in-place"  # CPU compute device: the weights are used where they are


@dataclass(frozen=True)
class WarmupDecision:
    """The chosen warm-up mode, the numbers behind it and a one-line reason (logged)."""

    mode: WarmupMode
    needed_bytes: int
    available_bytes: int | None
    reason: str
    forced: bool = False

    @property
    def resident(self) -> bool:
        return self.mode is WarmupMode.RESIDENT


def warmup_margin(total_bytes: int) -> int:
    """Device memory kept free during a resident warm-up: 10% of the device, at least 1 GiB."""
    return max(int(total_bytes * WARMUP_MARGIN_FRACTION), WARMUP_MARGIN_MIN_BYTES)


def _check_bytes(name: str, value: int | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decide_warmup: {name} must be an int >= 0 (bytes), got {value!r}")


def decide_warmup(
    needed_bytes: int,
    *,
    device_type: str,
    budget_bytes: int | None = None,
    resident_bytes: int = 0,
    free_bytes: int = 0,
    total_bytes: int = 0,
    override: str | None = None,
) -> WarmupDecision:
    """Resident, stream or in-place warm-up (see the module docstring for the rule and why).

    ``free_bytes``/``total_bytes`` describe the device (``mem_get_info``) and are required (total > 0) for a
    CUDA device; ``budget_bytes`` is the memory-mode budget (None: latency mode); ``resident_bytes`` what the
    model already holds on the device.
    """
    _check_bytes("needed_bytes", needed_bytes)
    _check_bytes("budget_bytes", budget_bytes, optional=True)
    _check_bytes("resident_bytes", resident_bytes)
    _check_bytes("free_bytes", free_bytes)
    _check_bytes("total_bytes", total_bytes)
    if override is not None:
        try:
            mode = WarmupMode(override)
        except ValueError:
            raise ValueError(f"warm-up override must be None, 'resident' or 'stream', got {override!r}") from None
        if mode is WarmupMode.IN_PLACE:
            raise ValueError("warm-up override must be None, 'resident' or 'stream', got 'in-place'")
        return WarmupDecision(mode, needed_bytes, None, f"forced to {mode.value} (internal override)", forced=True)
    if device_type != "cuda":
        return WarmupDecision(WarmupMode.IN_PLACE, needed_bytes, None,
                              f"the compute device is {device_type}: warm-up uses the weights where they are "
                              "(no copies)")
    if total_bytes <= 0:
        raise ValueError("decide_warmup: total_bytes (device memory) must be > 0 for a CUDA device")
    if needed_bytes == 0:  # e.g. a model handed over on the device: nothing to copy, nothing to decide
        return WarmupDecision(WarmupMode.RESIDENT, 0, None, "every offload candidate is on the device already")
    margin = warmup_margin(total_bytes)
    physical = free_bytes - margin
    physical_text = f"{format_bytes(free_bytes, 2)} free - {format_bytes(margin, 2)} safety margin"
    if budget_bytes is None:
        available, detail = physical, f"latency mode: {physical_text}"
    else:
        by_budget = budget_bytes - resident_bytes
        detail = f"memory budget {format_bytes(budget_bytes, 2)} - {format_bytes(resident_bytes, 2)} already resident"
        if physical < by_budget:
            available, detail = physical, f"{detail}, capped by {physical_text}"
        else:
            available = by_budget
    if needed_bytes <= available:
        return WarmupDecision(WarmupMode.RESIDENT, needed_bytes, available,
                              f"{format_bytes(needed_bytes, 2)} of offload candidates fit in {format_bytes(available, 2)} available "
                              f"({detail}): copied once, kept on the device until INFERENCE")
    return WarmupDecision(WarmupMode.STREAM, needed_bytes, available,
                          f"{format_bytes(needed_bytes, 2)} of offload candidates exceed the {format_bytes(available, 2)} available "
                          f"({detail}): copied before each trap call instead")
