"""Experiment (profile phase): where the small-batch profile phase's time goes, pass by pass.

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
import flextensor.engine.build as build  # noqa: E402
import flextensor.engine.profiling as profiling  # noqa: E402
import flextensor.engine.switch as switch  # noqa: E402
import flextensor.engine.phase_driver as phase_driver  # noqa: E402
import flextensor.standalone_namespace as standalone_namespace  # noqa: E402
import flextensor.planning.strategies as strategies  # noqa: E402
import flextensor.runtime.timing as timing  # noqa: E402
import flextensor.runtime.trap_windows as trap_windows  # noqa: E402
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
    # The traps bind the phase driver's trap_enter/trap_exit at offload(), so wrapping the class first reaches them
    # too; a function one engine module imported from another by name is wrapped where it is called.
    handler = profiling.ProfilingHandler
    driver = phase_driver.PhaseDriver
    for owner, name in [(driver, "begin_pass"), (driver, "end_pass"), (driver, "trap_enter"), (driver, "trap_exit"),
                        (handler, "begin_pass"), (handler, "end_pass"), (handler, "enter"), (handler, "exit"),
                        (profiling, "resolve_windows"), (profiling, "recycle_windows"), (timing.TimingCollector, "mark"),
                        (profiling, "preload"), (switch, "warm_samples"),
                        (profiling, "plan_switch"), (profiling, "prepare_switch"), (profiling, "enter_inference"),
                        (switch, "pack_block"), (build, "can_defer"), (build, "defer_inference"),
                        (switch, "resolve_device_budget"), (build, "bypass_untimed_traps"),
                        (standalone_namespace, "make_provider"),
                        (strategies.AdaptiveStrategy, "plan"), (basic.NthLayerStrategy, "plan")]:
        _wrap(owner, name)
    timing.TimingCollector.read_windows_ms = _read_windows_ms
    profiling.read_pass = _read_pass  # profiling imported the name


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
