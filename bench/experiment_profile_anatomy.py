"""Experiment (issue 3, profile phase): where the small-batch profile phase's time goes, pass by pass.

bench_engine holds the profile phase to ``profiling_iters`` ordinary forwards plus one transfer sweep and reports
one ratio per run. This takes the same model and small batch apart:

- every profile pass against a resident twin's pass run just before it (wall, host launch time, GPU time);
- the first pass's copies (the sweep): their start after the pass began (lead), their span and busy time from the
  warm-up copy events, the tail after the last copy, against the sweep at the pinned peak;
- host time spent in the engine's functions, per pass: pass begin/end, trap entry/exit, CUDA marks, reading
  marks (the wait and the ``elapsed_time`` calls apart), the switch to INFERENCE and its parts (planning, the
  strategy, packing, entering INFERENCE, ``prepare_switch``);
- one layer copied in one piece against tensor by tensor, on one stream and alternating between two (the copy
  engine's per-copy cost, and whether a second engine hides it);
- each PROFILING pass read: which clock marked it, its span on both clocks, and (device-marked) the largest
  difference of one window between the clocks (``flextensor.runtime.trap_windows``).

The functions are wrapped in place (``perf_counter`` around each call, about 0.3 us each), so the totals are a
little high; compare passes and parts with each other, not with bench_engine. Three runs in one process:
NthLayer(1), Adaptive, NthLayer(1) again. Prints JSON lines: one per run, one per pass, one per pass read, then
the per-pass function totals for passes 0, 1, 5, 9 and the first inference pass.

Run on the GPU host: ``python bench/experiment_profile_anatomy.py`` (about 30 s).

Ninth session, H200 host, 2026-11-30, measured by the scratch version of this file (the same model, loops and
wrappers, in six calls as the engine changed; this file itself was checked on the CPU only). The host's speed
varied from call to call (twin passes 2.9-9 ms):

- The first pass: lead 0.09-0.18 ms, tail 0.21 ms, the copies' span 78.1-83.3 ms for 4.0 GiB against
  77.7-78.3 ms at the same run's pinned peak; one layer tensor by tensor ran at 54.4-55.0 GB/s against
  55.2-55.5 GB/s in one piece.
- With a CUDA event per trap entry: 17 marks cost 0.10-0.51 ms of host time per pass, reading a pass
  0.12-0.2 ms (of which ``elapsed_time`` 0.06-0.1 ms, the wait 5-16 us). Timed on the host's clock after the
  first pass that kept up: 2 marks, 21-30 us; reading 56-77 us (before the hot path was trimmed).
- The switch: ``plan_inference`` for NthLayer(1) 1.1-1.5 ms before ``prepare_switch`` (pack_block 0.16-0.3 ms
  of it, the per-tensor loops about 0.55 ms), 0.55-0.8 ms after in the quiet calls; for Adaptive, which
  streams nothing on this batch (so packs nothing), 1.26 ms before and 1.19-1.2 ms after, 0.54-0.63 ms of it its
  own planning; ``defer_inference`` 0.14-0.37 ms. ``prepare_switch`` itself took 0.39-0.84 ms at the end of the
  first pass, hidden behind the sweep.

Tenth session, same host, 2026-11-30 (04:30-04:37 UTC), this file as it was at the span-only clock rule (19a1bcb):

- Two streams for the sweep: one layer tensor by tensor 53.6 / 53.8 GB/s on one / two streams (53.0 in one
  piece), and in a scratch engine change that alternated the sweep's copies over two side streams (paired runs,
  one process), the copies' span was 78.1-78.5 ms against 78.05-78.14 ms on one stream, for a peak of 77.95 ms.
  The sweep is at the peak already (0.1-0.6 ms over it); the change was dropped. (Later that morning
  ``experiment_copy_granularity`` found 24 pieces as fast as one copy from a pinned buffer, and the model's
  own registered memory 0.3% under it: the per-piece losses above were that call's noise.)
- Which clock: with every window required to agree on both clocks, the quieter runs never left device marks
  (17 marks a pass, their passes +0.3-0.45 ms over the twin). A device-marked pass read 30-50 us apart on its
  windows (up to 312 us on the first, the sweep's) while its span agreed within 1.3%. With the span alone
  deciding (``flextensor.runtime.trap_windows``), every run marks passes 3-9 on the host clock, and passes 2-8 cost
  +0.15-0.27 ms over the twin in the quiet runs (engine functions about 0.15 ms of it: trap entries and exits
  0.06-0.08, pass begin with reading 0.05, pass end 0.02).
- The switch: ``_end_pass`` 0.74-0.93 ms for NthLayer(1) (``plan_inference`` 0.63-0.82: the strategy 0.13-0.15,
  ``defer_inference`` 0.15-0.21, ``can_defer`` 0.05) and 1.33 ms for Adaptive (its planning 0.56, defer 0.28);
  reading the last pass at the switch 0.12 ms (before 518fbdc, which reads a host-marked last pass from the
  host alone, and 8a6d139, which spares Adaptive its candidates on this batch). The span columns of the runs
  above were then sums of the window durations; this file now reads the span itself.
- This file as it is (05:07 UTC, a slower host: twin passes 3.4-5.2 ms): the spans of passes read on both
  clocks agreed within 1.5%; the last pass, host-marked, read from the host alone. The switch: ``_end_pass``
  0.95-1.16 ms for NthLayer(1) (the strategy 0.15-0.18, ``defer_inference`` 0.22-0.25) and 1.26 ms for
  Adaptive, whose planning took 0.19 ms (0.56 before 8a6d139; ``defer_inference`` 0.45 in that call).
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flextensor as ft  # noqa: E402
import flextensor.planning.basic_strategies as basic  # noqa: E402
import flextensor.deferred_build as deferred_build  # noqa: E402
import flextensor.inference as inference  # noqa: E402
import flextensor.phases as phases  # noqa: E402
import flextensor.planning.strategies as strategies  # noqa: E402
import flextensor.runtime.timing as timing  # noqa: E402
import flextensor.runtime.trap_windows as trap_windows  # noqa: E402
import flextensor.warm_copies as warm_copies  # noqa: E402
from bench_engine import pinned_peak_gbps  # noqa: E402
from common import cuda_forward  # noqa: E402
from experiment_copy_granularity import copy_times_ms  # noqa: E402
from models import BLOCK_PATTERN, ModelSpec, build_model, make_tokens  # noqa: E402

SPENT: dict[tuple[Any, str], list[float]] = defaultdict(list)  # (pass, function) -> seconds per call
CURRENT = {"pass": -1}


def _wrap(owner: Any, name: str) -> None:
    fn = getattr(owner, name)
    key = f"{getattr(owner, '__name__', owner)}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[(CURRENT["pass"], key)].append(time.perf_counter() - start)

    setattr(owner, name, timed)


def _read_windows_ms(self: Any, windows: list) -> list[float]:
    """``TimingCollector.read_windows_ms`` (CUDA), its wait and its ``elapsed_time`` calls timed apart."""
    if not windows:
        return []
    t0 = time.perf_counter()
    windows[-1][1].synchronize()
    t1 = time.perf_counter()
    out = [float(start.elapsed_time(end)) for start, end in windows]
    SPENT[(CURRENT["pass"], "read.wait")].append(t1 - t0)
    SPENT[(CURRENT["pass"], "read.elapsed")].append(time.perf_counter() - t1)
    return out


READS: list[dict] = []  # one per PROFILING pass read: which clock marked it, how far its windows' clocks differ


def _read_pass(clock: Any, record: Any, check_span: bool = True) -> Any:
    """``flextensor.runtime.trap_windows.read_pass``, noting for each pass read whether it was marked on the device, its
    span on both clocks (the device's only where the engine read it: not for the last, host-marked pass) and
    (device-marked) the largest difference of one window between the clocks."""
    reading = trap_windows.read_pass(clock, record, check_span)
    first = record.windows[0] if record.windows else None
    row = {"read_at": CURRENT["pass"], "on_device": record.on_device, "kept_up": reading.kept_up,
           "span_host_ms": _ms(record.host_end - first.host) if first else None}
    if first is not None and (record.on_device or check_span):  # complete: read_pass waited for the end mark
        row["span_device_ms"] = round(clock.read_windows_ms([(first.start, record.end)])[0], 3)
    if record.on_device and reading.device:
        diffs = [reading.device[k] - reading.host[k] for k in reading.device]
        row.update(max_window_diff_us=round(max(diffs, key=abs) * 1e6, 1),
                   windows_agree=all(trap_windows.clocks_agree(reading.device[k], reading.host[k])
                                     for k in reading.device))
    READS.append(row)
    return reading


def instrument() -> None:
    # The traps bind _trap_enter/_trap_exit at offload(), so wrapping the class first reaches them too; phases
    # imports plan_inference and prepare_switch from flextensor.inference at call time.
    for owner, name in [(phases.PhaseMixin, "_begin_pass"), (phases.PhaseMixin, "_end_pass"),
                        (phases.PhaseMixin, "_trap_enter"), (phases.PhaseMixin, "_trap_exit"),
                        (phases.PhaseMixin, "_resolve_windows"), (phases.PhaseMixin, "_recycle_windows"),
                        (phases.PhaseMixin, "_start_inference"), (timing.TimingCollector, "mark"),
                        (warm_copies.WarmCopiesMixin, "_preload_warmup"),
                        (warm_copies.WarmCopiesMixin, "_warm_samples"),
                        (inference, "plan_inference"), (inference, "prepare_switch"), (inference, "pack_block"),
                        (inference, "can_defer"), (inference, "defer_inference"), (inference, "_resolve_budget"),
                        (inference, "bypass_resident_traps"), (deferred_build, "make_provider"),
                        (strategies.AdaptiveStrategy, "plan"), (basic.NthLayerStrategy, "plan")]:
        _wrap(owner, name)
    timing.TimingCollector.read_windows_ms = _read_windows_ms
    phases.read_pass = _read_pass  # phases imported the name


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def one_pass(fn: Callable, x: torch.Tensor) -> tuple[dict, Any, Any]:
    wall, host, start, end = cuda_forward(fn, x)
    return {"wall": wall, "host": host, "gpu": start.elapsed_time(end) / 1e3}, start, end


def run(model: torch.nn.Module, twin: torch.nn.Module, x: torch.Tensor, strategy: Any, label: str,
        peak_gbps: float) -> None:
    SPENT.clear()
    READS.clear()
    config = ft.OffloadConfig(include_patterns=[BLOCK_PATTERN], pinned_memory=True, skip_discovery=True,
                              profiling_iters=10, load_strategy=strategy)
    proxy = ft.offload(model, config=config, name=label)
    manager = ft.get_offload_manager(label)
    rows = []
    gc.disable()  # a collection inside a pass would be charged to whichever function it landed in
    try:
        for i in range(manager.iters_before_inference):
            ordinary, _, _ = one_pass(twin, x)
            CURRENT["pass"] = i
            mine, start, end = one_pass(proxy, x)
            row = {"pass": i, "twin_ms": _ms(ordinary["wall"]), "wall_ms": _ms(mine["wall"]),
                   "host_ms": _ms(mine["host"]), "gpu_ms": _ms(mine["gpu"]),
                   "excess_ms": _ms(mine["wall"] - ordinary["wall"])}
            copies = manager.engine.warm.events  # the sweep's (bytes, start, end) per trap, read at the switch
            if i == 0 and copies:
                nbytes = sum(b for b, _, _ in copies)
                row.update(lead_ms=round(start.elapsed_time(copies[0][1]), 3),
                           span_ms=round(copies[0][1].elapsed_time(copies[-1][2]), 3),
                           busy_ms=round(sum(a.elapsed_time(b) for _, a, b in copies), 3),
                           tail_ms=round(copies[-1][2].elapsed_time(end), 3),
                           sweep_at_peak_ms=_ms(nbytes / (peak_gbps * 1e9)), bytes=nbytes)
            rows.append(row)
    finally:
        gc.enable()
    CURRENT["pass"] = "inference"
    first, _, _ = one_pass(proxy, x)
    manager.wait_for_host_blocks()
    print(json.dumps({"run": label, "twin_median_ms": statistics.median(r["twin_ms"] for r in rows),
                      "phase_ms": round(sum(r["wall_ms"] for r in rows), 3), "first_inference_ms": _ms(first["wall"])}))
    for row in rows:
        print(json.dumps(row))
    for row in READS:
        print(json.dumps(row))
    for (index, key), seconds in sorted(SPENT.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if index in (0, 1, 5, 9, "inference"):
            print(json.dumps({"pass": index, "fn": key, "calls": len(seconds), "sum_ms": _ms(sum(seconds)),
                              "max_ms": _ms(max(seconds))}))
    ft.release(label)


def copy_granularity(layer: torch.nn.Module, peak_gbps: float) -> None:
    """One layer's bytes copied from one pinned buffer: in one piece, tensor by tensor on one stream (as the
    warm-up sweep copies), and tensor by tensor alternating between two streams (can a second copy engine hide
    the gap between two copies?)."""
    sizes = [p.numel() * p.element_size() for p in layer.parameters()]
    total = sum(sizes)
    src = torch.empty(total, dtype=torch.uint8).pin_memory()
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    bounds = list(zip(itertools.accumulate([0] + sizes[:-1]), sizes))
    pieces = [(dst[offset:offset + n], src[offset:offset + n]) for offset, n in bounds]
    one, two = [torch.cuda.current_stream()], [torch.cuda.Stream(), torch.cuda.Stream()]
    variants = {"whole": ([(dst, src)], one), "pieces": (pieces, one), "pieces_two_streams": (pieces, two)}
    ms: dict[str, list[float]] = {mode: [] for mode in variants}
    for mode in list(ms) * 2:
        ms[mode] += copy_times_ms(*variants[mode], repeat=5)
    rates = {f"gbps_{mode}": round(total / statistics.median(v) / 1e6, 2) for mode, v in ms.items()}
    print(json.dumps({"copy_granularity": {"tensors": len(sizes), "bytes": total,
                                           "pinned_peak_gbps": round(peak_gbps, 2), **rates}}))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("experiment_profile_anatomy needs a CUDA device: it times CUDA events and copies")
    instrument()
    spec = ModelSpec(hidden=4096, layers=16, vocab=32000, mlp_ratio=2)
    device = torch.device("cuda")
    model = build_model(spec, device, torch.bfloat16, seed=0)
    x = make_tokens(spec, 1, 128, device)
    twin = copy.deepcopy(model)
    peak = pinned_peak_gbps(spec.block_bytes(torch.bfloat16), device, 5)
    copy_granularity(model.layers[0], peak)
    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    for _ in range(3):
        one_pass(twin, x)
    runs = [("nth1", ft.NthLayerStrategy(1)), ("adaptive", None), ("nth1_again", ft.NthLayerStrategy(1))]
    for label, strategy in runs:
        run(model, twin, x, strategy, label, peak)


if __name__ == "__main__":
    main()
