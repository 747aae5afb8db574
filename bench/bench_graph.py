"""Benchmark of CUDA-graph replay of an offloaded model: replay against the eager offloaded pass and resident.

One transformer-like model (``bench/models.py``, default ~4.5 GiB bf16, every layer streamed with
``NthLayerStrategy(1)``), a resident twin of it on the device, one run so every ratio compares numbers taken
seconds apart on the same machine. At a small batch (transfer-bound: a layer's copy takes longer than its
compute) and a large batch (compute-bound), per batch:

1. The eager offloaded pass, before any capture (the loader prefetches across pass boundaries), timed
   alternately with the twin's eager pass.
2. One forward of each captured into a CUDA graph (``torch.cuda.graph``, after the usual warm-up passes), then
   four passes timed in turn, ``--repeat`` times: the offloaded graph's replay, the offloaded model's eager pass
   after the capture (every pass self-contained from then on: Note [loader under CUDA-graph capture] in
   ``flextensor.runtime.loaders.block_loader``), the twin's eager pass, the twin's replay.
   Goals: transfer-bound replay throughput >= 0.97x the eager offloaded pass (1.); compute-bound replay
   <= 1.05x the resident twin's replay.
3. ``offload_timing="cuda_graph"``: the model offloaded again with replay timing, its small-batch graph replayed
   ``--repeat`` times with ``ft.update_offload_timing`` after each; the per-pass transfer / compute / wait read
   back from the graph's external events, and the replay time with timing on against the replay without.

Every pass is timed whole, ``torch.cuda.synchronize`` on both sides; medians. Outputs: the replay against the
eager offloaded pass and the twin (max abs difference). Needs CUDA; ``--quick`` runs a small model (seconds).

Run: ``scripts/gpu-suite.sh bench bench_graph`` (~1-2 min on the H200 host). A full run writes its tables into
docs/benchmarks.md (``--no-docs`` skips that; a ``--quick`` run never does).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gib, median, report, table  # noqa: E402
from models import (  # noqa: E402
    BLOCK_PATTERN, ModelSpec, add_model_arguments, build_model, default_dtype, make_tokens,
)

import flextensor as ft  # noqa: E402

GOAL_TRANSFER_BOUND = 0.97  # replay throughput / eager offloaded throughput, at least
GOAL_COMPUTE_BOUND = 1.05  # offloaded replay time / resident replay time, at most
BATCHES = ("small", "large")


def seconds(fn: Callable[[], object]) -> float:
    """One call, synchronized before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each function, called in turn ``repeat`` times after one warm-up round."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for round_ in range(repeat + 1):
            for name, fn in fns.items():
                s = seconds(fn)
                if round_:
                    samples[name].append(s)
    return {name: median(values) for name, values in samples.items()}


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` captured after two warm-up calls on a side stream (torch.cuda.graph's documented recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def offload(model: torch.nn.Module, args: argparse.Namespace, name: str, **extra) -> ft.OffloadManager:
    config = ft.OffloadConfig(include_patterns=[BLOCK_PATTERN], pinned_memory=True, skip_discovery=True,
                              profiling_iters=args.profiling_iters, load_strategy=ft.NthLayerStrategy(1), **extra)
    ft.offload(model, config, name=name)
    return ft.get_offload_manager(name)


def warm_up(model: torch.nn.Module, manager: ft.OffloadManager, tokens: torch.Tensor) -> None:
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(tokens)
        manager.wait_for_host_blocks()
        model(tokens)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def main_run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    dtype = default_dtype(device)
    spec = ModelSpec(hidden=args.hidden, layers=args.layers, vocab=args.vocab, mlp_ratio=args.mlp_ratio)
    model = build_model(spec, device, dtype, seed=args.seed)
    twin = copy.deepcopy(model)  # resident: the reference every offloaded number is compared with
    tokens = {"small": make_tokens(spec, *args.small, device), "large": make_tokens(spec, *args.large, device)}
    r: dict = {"spec": spec.to_dict(), "dtype": str(dtype).replace("torch.", ""), "model_bytes": spec.total_bytes(dtype),
               "stream_bytes": spec.layers * spec.block_bytes(dtype), "small_shape": args.small,
               "large_shape": args.large, "repeat": args.repeat}
    model.to("cpu")  # as a user hands it over: weights in host memory
    gc.collect()
    torch.cuda.empty_cache()
    manager = offload(model, args, "graph")
    warm_up(model, manager, tokens["small"])
    r["num_slots"] = manager.loader.num_slots
    print("eager passes before any capture", flush=True)
    for batch in BATCHES:
        x = tokens[batch]
        r[batch] = {"eager_before": interleaved({"offloaded": lambda: model(x), "twin": lambda: twin(x)},
                                                args.repeat)}
    for batch in BATCHES:
        print(f"graphs at the {batch} batch", flush=True)
        x = tokens[batch]
        graph, out = capture(lambda: model(x))
        twin_graph, twin_out = capture(lambda: twin(x))
        with torch.no_grad():
            eager_out = model(x)
            twin_eager = twin(x)
        graph.replay()
        torch.cuda.synchronize()
        r[batch]["diff_vs_eager_offloaded"] = max_diff(out, eager_out)
        r[batch]["diff_vs_twin"] = max_diff(out, twin_eager)
        r[batch]["twin_graph_diff"] = max_diff(twin_out, twin_eager)
        r[batch]["after"] = interleaved({"replay": graph.replay, "eager_after": lambda: model(x),
                                         "twin_eager": lambda: twin(x), "twin_replay": twin_graph.replay},
                                        args.repeat)
        del graph, twin_graph, out, twin_out
        gc.collect()
    r["captures"] = manager.loader.captures
    ft.release("graph")
    gc.collect()
    torch.cuda.empty_cache()

    print("offload_timing='cuda_graph'", flush=True)
    timed = offload(model, args, "graph_timed", offload_timing="cuda_graph")
    x = tokens["small"]
    warm_up(model, timed, x)
    graph, _ = capture(lambda: model(x))
    ft.reset_offload_timing("graph_timed")
    replay_s = []
    for generation in range(args.repeat):
        replay_s.append(seconds(graph.replay))
        ft.update_offload_timing("graph_timed", replay_generation=generation)
    report_ = ft.collect_offload_timing("graph_timed")
    r["timed"] = {"replay_s": median(replay_s), "passes": report_.num_passes if report_ else 0}
    if report_ is not None:
        r["timed"].update(transfer_ms=report_.total_transfer_avg, compute_ms=report_.total_compute_avg,
                          wait_ms=report_.total_wait_avg, table=ft.format_offload_timing_table(report_))
    del graph
    ft.release("graph_timed")
    return r


def ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"


def build_sections(r: dict) -> list[tuple[str, str]]:
    spec = r["spec"]
    model_rows = [["model", f"{gib(r['model_bytes'])} {r['dtype']}, hidden {spec['hidden']}, {spec['layers']} layers"],
                  ["streamed per pass", f"{gib(r['stream_bytes'])} (every layer, {r['num_slots']} device slots)"],
                  ["small / large batch", f"{tuple(r['small_shape'])} / {tuple(r['large_shape'])}"],
                  ["passes per median", str(r["repeat"])]]
    rows, goals = [], []
    for batch in BATCHES:
        b = r[batch]
        before, after = b["eager_before"], b["after"]
        rows.append([f"{batch} ({'transfer' if batch == 'small' else 'compute'}-bound)", ms(before["twin"]),
                     ms(after["twin_replay"]), ms(before["offloaded"]), ms(after["eager_after"]), ms(after["replay"]),
                     f"{before['offloaded'] / after['replay']:.3f}x",
                     f"{after['replay'] / after['twin_replay']:.3f}x",
                     f"{b['diff_vs_eager_offloaded']:.2g} / {b['diff_vs_twin']:.2g}"])
    small, large = r["small"], r["large"]
    throughput = small["eager_before"]["offloaded"] / small["after"]["replay"]
    compute = large["after"]["replay"] / large["after"]["twin_replay"]
    goals.append([f"transfer-bound replay throughput >= {GOAL_TRANSFER_BOUND}x the eager offloaded pass",
                  f"{throughput:.3f}x", "met" if throughput >= GOAL_TRANSFER_BOUND else "NOT met"])
    goals.append([f"compute-bound offloaded replay <= {GOAL_COMPUTE_BOUND}x the resident replay", f"{compute:.3f}x",
                  "met" if compute <= GOAL_COMPUTE_BOUND else "NOT met"])
    t = r["timed"]
    timing_rows = [["replays timed (update_offload_timing after each)", str(t["passes"])],
                   ["small-batch replay, timing on / off", f"{ms(t['replay_s'])} / {ms(small['after']['replay'])} = "
                                                          f"{t['replay_s'] / small['after']['replay']:.3f}x"]]
    if "transfer_ms" in t:
        timing_rows.append(["per replay: transfer / compute / wait (sums over traps)",
                            f"{t['transfer_ms']:.1f} / {t['compute_ms']:.1f} / {t['wait_ms']:.1f} ms"])
    return [
        ("Model and inputs", table(["", ""], model_rows)),
        ("Forward pass (median)", table(
            ["batch", "resident eager", "resident replay", "offloaded eager", "offloaded eager after capture",
             "offloaded replay", "eager / replay", "replay / resident replay", "replay diff vs eager / resident"],
            rows)),
        ("Goals", table(["goal", "measured", ""], goals)),
        ("Replay timing (offload_timing='cuda_graph')", table(["", ""], timing_rows)),
    ]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model: checks the paths in seconds")
    add_model_arguments(p)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--profiling-iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md (--quick never does)")
    args = p.parse_args()
    defaults = (1024, 4, 4096, (1, 16), (4, 512)) if args.quick else (4096, 16, 32000, (1, 128), (8, 4096))
    for name, value in zip(("hidden", "layers", "vocab", "small", "large"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.repeat = min(args.repeat, 3)
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_graph measures CUDA-graph replays: it needs CUDA, and this host has none", flush=True)
        return
    r = main_run(args)
    report("bench_graph", "CUDA-graph replay of an offloaded model", build_sections(r), r,
           docs=not (args.no_docs or args.quick))


if __name__ == "__main__":
    main()
