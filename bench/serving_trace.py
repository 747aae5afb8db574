"""The serving benchmark's model, its batch-size trace, and how a served pass is timed against a resident twin.

Why its own module: ``bench_serving`` runs the same trace in one process and in every worker of a sharing group
(``serving_group``), and both must time and summarise passes the same way. Every offloaded pass is timed right
after a pass of the resident twin (the same weights kept whole on the device) at the same input, so the GPU's
clock drift and other tenants' load fall on both alike.

The trace: ``passes`` batch sizes drawn at random (fixed seed) from the powers of two 1..4096 and odd sizes between
them, as a server sees decode steps and prefills of any length. At the first pass of a size the twin runs once
more before the offloaded pass: whatever a first pass at a shape costs any model in the process (the caching
allocator's new blocks, cuBLAS picking kernels) is paid by the twin, and the offloaded pass's ratio measures what
offloading adds at a new size.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

POWERS_OF_TWO = [2**i for i in range(13)]  # 1 .. 4096
ODD_SIZES = [3, 7, 15, 33, 101, 255, 511, 999, 1537, 3001, 4095]
#: Batch classes the trace is summarised by: (smallest, largest, name).
CLASSES = [(1, 1, "1"), (2, 16, "2-16"), (17, 256, "17-256"), (257, 4096, "257-4096")]


class Layer(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, layers: int, d: int, h: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d, h) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_meta(layers: int, d: int, h: int, dtype: torch.dtype) -> Stack:
    with torch.device("meta"):
        return Stack(layers, d, h).to(dtype).eval()


def build(layers: int, d: int, h: int, dtype: torch.dtype, device: torch.device, *, draw_on: torch.device) -> Stack:
    """The model on ``device``, the same weights in every process: drawn per tensor from a seeded generator on
    ``draw_on`` (a GPU draws a 6 GiB model in a second, a CPU takes tens), then copied to ``device``."""
    model = build_meta(layers, d, h, dtype).to_empty(device=device)
    gen = torch.Generator(device=draw_on).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=draw_on, dtype=dtype).mul_(0.02))
    return model.eval()


def trace(passes: int, seed: int = 0, largest: int = 4096) -> list[int]:
    """``passes`` batch sizes from the powers of two and the odd sizes up to ``largest``: a batch class of
    :data:`CLASSES` drawn uniformly, then a size uniformly within it. Drawn over all sizes at once, class "1"
    (one size of about two dozen) would get a few percent of the passes, and its p99 would be its maximum."""
    sizes = sorted({s for s in POWERS_OF_TWO + ODD_SIZES if s <= largest})
    by_class = [[s for s in sizes if low <= s <= high] for low, high, _ in CLASSES]
    by_class = [members for members in by_class if members]
    rng = random.Random(seed)
    return [rng.choice(rng.choice(by_class)) for _ in range(passes)]


class Timer:
    """One forward pass, timed (device synchronised on CUDA), without autograd."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, model: nn.Module, x: torch.Tensor) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            model(x)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


class Inputs:
    """One input per batch size, made once (the same in every process)."""

    def __init__(self, d: int, dtype: torch.dtype, device: torch.device) -> None:
        self.d, self.dtype, self.device = d, dtype, device
        self._made: dict[int, torch.Tensor] = {}

    def __call__(self, batch: int) -> torch.Tensor:
        x = self._made.get(batch)
        if x is None:
            gen = torch.Generator().manual_seed(batch)
            x = torch.randn(batch, self.d, generator=gen).to(self.dtype).to(self.device)
            self._made[batch] = x
        return x


def serve(model: nn.Module, twin: nn.Module, batches: list[int], inputs: Callable[[int], torch.Tensor],
          timer: Timer, check: bool = True) -> list[dict]:
    """Serve ``batches`` in order; per pass its batch, the offloaded and the twin's seconds, whether it was the
    first pass at that size, and (at a first pass, when ``check``) whether both outputs were equal."""
    seen: set[int] = set()
    records = []
    for batch in batches:
        x = inputs(batch)
        first = batch not in seen
        seen.add(batch)
        record: dict = {"batch": batch, "first": first}
        if first:
            timer(twin, x)  # the first pass at this shape, for any model in the process
            off = timer(model, x)
            res = timer(twin, x)
            if check:
                with torch.no_grad():
                    record["equal"] = bool(torch.equal(model(x), twin(x)))
        else:
            res = timer(twin, x)
            off = timer(model, x)
        record.update(off_s=off, res_s=res)
        records.append(record)
    return records


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def twin_medians(records: list[dict]) -> dict[int, float]:
    """The twin's median seconds at each batch size over the whole trace: the reference of a first pass, which
    is one pass and would otherwise be set against one twin pass (at 3 ms either jitters by a tenth and more)."""
    by_batch: dict[int, list[float]] = {}
    for r in records:
        by_batch.setdefault(r["batch"], []).append(r["res_s"])
    return {batch: statistics.median(times) for batch, times in by_batch.items()}


def summarise(records: list[dict]) -> list[dict]:
    """Per batch class: passes, p50/p99/max of the offloaded and the twin's passes (ms), p99 over the twin's p99,
    the worst first pass at a size over the twin's median at that size (:func:`twin_medians`), and whether every
    checked output was equal."""
    rows = []
    reference = twin_medians(records)
    for low, high, name in CLASSES:
        mine = [r for r in records if low <= r["batch"] <= high]
        if not mine:
            continue
        off = [r["off_s"] * 1e3 for r in mine]
        res = [r["res_s"] * 1e3 for r in mine]
        firsts = [r["off_s"] / reference[r["batch"]] for r in mine if r["first"]]
        rows.append(dict(
            batch_class=name, passes=len(mine),
            off_p50=statistics.median(off), off_p99=percentile(off, 99), off_max=max(off),
            res_p50=statistics.median(res), res_p99=percentile(res, 99), res_max=max(res),
            p99_ratio=percentile(off, 99) / percentile(res, 99),
            first_worst=max(firsts) if firsts else None,
            equal=all(r.get("equal", True) for r in mine),
        ))
    return rows


def repeated(model: nn.Module, twin: nn.Module, x: torch.Tensor, passes: int, timer: Timer) -> dict:
    """``passes`` offloaded passes at one input, each after a twin pass (the twin runs once more first, as at any
    first pass at a shape): each offloaded pass over the twin's median of the same loop; the first, the worst and
    the median of those ratios. Over the twin's median, not over the pass beside it: at a few milliseconds a pass
    jitters by a tenth either way, and one fast twin pass must not make its neighbour look slow."""
    timer(twin, x)
    twin_s, off_s = [], []
    for _ in range(passes):
        twin_s.append(timer(twin, x))
        off_s.append(timer(model, x))
    ref = statistics.median(twin_s)
    ratios = [o / ref for o in off_s]
    return {"first": ratios[0], "worst": max(ratios), "median": statistics.median(ratios), "twin_ms": ref * 1e3,
            "passes_ms": [o * 1e3 for o in off_s]}
