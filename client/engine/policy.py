"""``EnginePolicy``: the engine's paths that the device would otherwise choose, chosen by the caller instead.

Why: the engine picks its warm-up mode from the device's free memory (``flextensor.planning.warmup_rule``) and
computes on a CPU from the host blocks in place (Note [CPU in place] in ``flextensor.engine.build``). Tests and
experiments on hosts without a GPU still have to run the GPU's paths: a forced "resident" or "stream" warm-up,
and streaming through the block loader on a CPU. A policy is a value handed to the engine at ``offload()``, so
nothing outside a manager sets its attributes, and every path it can force is named here.

Where a policy comes from, first match wins: the manager's own (:meth:`OffloadManager.set_engine_policy
<flextensor.manager.OffloadManager.set_engine_policy>`), else the process default
(:func:`set_default_engine_policy`, which a test fixture sets and restores), else :class:`EnginePolicy()`: the
device decides everything.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

__all__ = ["EnginePolicy", "default_engine_policy", "set_default_engine_policy"]

WarmupChoice = Literal["resident", "stream"]


@dataclass(frozen=True)
class EnginePolicy:
    """What the engine does regardless of the device (the defaults leave every choice to it)."""

    #: Force the warm-up mode: "resident" (candidates copied to the device while profiling) or "stream". On a
    #: CPU the candidates are then "copied" too, as a GPU would, so that bookkeeping runs without one.
    warmup: WarmupChoice | None = None
    #: A CPU compute device streams through the block loader as a GPU does, instead of computing in place.
    stream_on_cpu: bool = False
    #: The device memory's read rate (bytes/s) that bounds latency-mode compute from below (Note [the smallest
    #: pass] in ``flextensor.runtime.device_read_rate``), instead of the device's own; on a CPU, where the
    #: device has none of its own, this is how a test plans with the bound. ``float("inf")`` turns it off.
    device_read_rate: float | None = None

    def __post_init__(self) -> None:
        if self.warmup not in (None, "resident", "stream"):
            raise ValueError(f"EnginePolicy.warmup must be None, 'resident' or 'stream', got {self.warmup!r}")
        if not isinstance(self.stream_on_cpu, bool):
            raise ValueError(f"EnginePolicy.stream_on_cpu must be a bool, got {self.stream_on_cpu!r}")
        rate = self.device_read_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
            raise ValueError(f"EnginePolicy.device_read_rate must be None or a number > 0 (bytes/s), got {rate!r}")


_lock = threading.Lock()
_default = EnginePolicy()


def default_engine_policy() -> EnginePolicy:
    """The policy of managers that set none of their own."""
    return _default


def set_default_engine_policy(policy: EnginePolicy) -> EnginePolicy:
    """Make ``policy`` the process default for every later ``offload()`` of a manager without a policy of its
    own; returns the previous default, for the caller to restore."""
    global _default
    if not isinstance(policy, EnginePolicy):
        raise TypeError(f"expected an EnginePolicy, got {type(policy).__name__}")
    with _lock:
        previous, _default = _default, policy
    return previous
