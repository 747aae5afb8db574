"""The host-to-device copy cost model the planner and the simulators use, fitted to measured copies."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TransferModel"]


@dataclass(frozen=True)
class TransferModel:
    """Affine host-to-device copy cost: ``seconds(n) = latency_s + n / bandwidth_bytes_per_s`` (0 for n <= 0)."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        bw = float(self.bandwidth_bytes_per_s)
        lat = float(self.latency_s)
        if not math.isfinite(bw) or bw <= 0.0:
            raise ValueError(f"TransferModel.bandwidth_bytes_per_s must be finite and > 0, got {bw!r}")
        if not math.isfinite(lat) or lat < 0.0:
            raise ValueError(f"TransferModel.latency_s must be finite and >= 0, got {lat!r}")
        object.__setattr__(self, "bandwidth_bytes_per_s", bw)
        object.__setattr__(self, "latency_s", lat)

    def seconds(self, nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    def bytes_within(self, seconds: float) -> int:
        """The largest block whose copy takes at most ``seconds`` (0 when even the latency does not fit)."""
        if not seconds > self.latency_s:
            return 0
        n = int(math.floor((seconds - self.latency_s) * self.bandwidth_bytes_per_s))
        while n > 0 and self.seconds(n) > seconds:  # float rounding: never report a block that overshoots
            n -= 1
        return max(n, 0)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> TransferModel:
        """Least-squares fit of ``seconds = latency + bytes / bandwidth`` to measured ``(bytes, seconds)`` pairs.

        Robust on purpose, because the engine may measure as little as one tensor: one sample (or samples of a
        single size) gives a zero-latency line through the origin; a negative fitted latency (noise on small
        copies) is clamped to 0 by refitting through the origin.
        """
        points = [(int(b), float(s)) for b, s in samples]
        if not points:
            raise ValueError("TransferModel.fit needs at least one (bytes, seconds) sample; measure a transfer first")
        for b, s in points:
            if b <= 0 or not math.isfinite(s) or s < 0.0:
                raise ValueError(
                    f"TransferModel.fit: bad sample (bytes={b}, seconds={s}); bytes must be > 0 and seconds a "
                    "finite value >= 0"
                )
        n = len(points)
        mean_x = sum(b for b, _ in points) / n
        mean_y = sum(s for _, s in points) / n
        sxx = sum((b - mean_x) ** 2 for b, _ in points)
        slope = intercept = None
        if sxx > 0.0:
            slope = sum((b - mean_x) * (s - mean_y) for b, s in points) / sxx
            intercept = mean_y - slope * mean_x
        if slope is None or slope <= 0.0 or intercept is None or intercept < 0.0:
            # Through the origin: minimise sum (s - k b)^2  ->  k = sum(b s) / sum(b^2).
            slope = sum(b * s for b, s in points) / sum(float(b) * b for b, _ in points)
            intercept = 0.0
        if not slope > 0.0:
            raise ValueError("TransferModel.fit: every sample took 0 seconds; the bandwidth cannot be estimated")
        return cls(bandwidth_bytes_per_s=1.0 / slope, latency_s=intercept)
