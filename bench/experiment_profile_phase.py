"""Experiment (profile phase): why are some resident warm-up passes slower than resident passes?

Warm-up (PROFILING) passes of ``NthLayerStrategy(1)`` can measure slower than the default strategy's and the
plain resident model's on the same model and input. During PROFILING the strategy plays no part, so the
suspects are the order of the runs, the state left by earlier runs, and the host-side cost of the traps.
This runs the same offload several times in alternating order and, per pass, records the wall time
(synchronized), the time until ``model()`` returns (host launch time) and the GPU time between two events
around the pass; for one pass of each run a ``torch.profiler`` table of the host side.

Run on the GPU host: ``python bench/experiment_profile_phase.py`` (about a minute). Prints JSON lines.

"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flextensor as ft  # noqa: E402
from common import cuda_forward  # noqa: E402
from models import BLOCK_PATTERN, ModelSpec, build_model, default_dtype, make_tokens  # noqa: E402


def one_pass(fn, tokens) -> dict:
    wall, launch, start, end = cuda_forward(fn, tokens)
    return {"wall_ms": wall * 1e3, "launch_ms": launch * 1e3, "gpu_ms": start.elapsed_time(end)}


def host_profile(fn, tokens) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():
        fn(tokens)
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return [(r.key, round(r.self_cpu_time_total / 1e3, 3), r.count) for r in rows]


def event_costs(n: int = 32, rounds: int = 50) -> dict:
    """Host time per pass of ``n`` timing events: created anew each pass vs reused from a pool."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for e in events:
            e.record()
        events[-1].synchronize()
    fresh = (time.perf_counter() - start) / rounds
    pool = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    start = time.perf_counter()
    for _ in range(rounds):
        for e in pool:
            e.record()
        pool[-1].synchronize()
    reused = (time.perf_counter() - start) / rounds
    return {"events_per_pass": n, "fresh_ms": fresh * 1e3, "reused_ms": reused * 1e3}


def main() -> None:
    print(json.dumps({"run": "events", **event_costs()}), flush=True)
    device = torch.device("cuda")
    dtype = default_dtype(device)
    spec = ModelSpec()
    model = build_model(spec, device, dtype, seed=0)
    tokens = make_tokens(spec, 1, 128, device)
    for _ in range(3):
        one_pass(model, tokens)
    resident = [one_pass(model, tokens) for _ in range(10)]
    print(json.dumps({"run": "resident", "passes": resident, "profile": host_profile(model, tokens)}), flush=True)
    model.to("cpu")
    gc.collect()
    torch.cuda.empty_cache()
    runs = ["adaptive", "nth", "adaptive", "nth"]
    for i, kind in enumerate(runs):
        strategy = ft.NthLayerStrategy(1) if kind.startswith("nth") else None
        cfg = ft.OffloadConfig(include_patterns=[BLOCK_PATTERN], pinned_memory=True, skip_discovery=True,
                               profiling_iters=10, load_strategy=strategy)
        name = f"{kind}{i}"
        t0 = time.perf_counter()
        proxy = ft.offload(model, config=cfg, name=name)
        setup_s = time.perf_counter() - t0
        manager = ft.get_offload_manager(name)
        passes = []
        prof = None
        for k in range(manager.iters_before_inference):
            if k == 5:
                prof = host_profile(proxy, tokens)
                passes.append({"profiled": True})
                continue
            passes.append(one_pass(proxy, tokens))
        after = [one_pass(proxy, tokens) for _ in range(3)]
        manager.wait_for_host_blocks()
        streamed = [one_pass(proxy, tokens) for _ in range(3)]
        print(json.dumps({"run": name, "setup_s": setup_s, "passes": passes, "after_switch": after,
                          "streamed": streamed, "profile": prof}), flush=True)
        del proxy
        ft.release(name)
        gc.collect()


if __name__ == "__main__":
    main()
