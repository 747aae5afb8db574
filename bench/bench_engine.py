"""Benchmark of the offload engine: what streaming layers from host memory costs a forward pass.

Measured on one transformer-like model (``bench/models.py``, default ~4.5 GiB bf16 on GPU), in one run so every
ratio compares numbers taken minutes apart on the same machine:

1. Forward time, resident (all weights on the device) against offloaded through ``ft.offload`` with
   ``include_patterns=["class:DecoderBlock"]``: with ``NthLayerStrategy(1)`` (every layer streams) and with the
   default ``AdaptiveStrategy``; at a small batch (transfer-bound: a layer's copy takes longer than its compute)
   and a large batch (compute-bound: long sequences, so layer compute > layer copy). Each offloaded pass is
   compared with a resident twin of the model timed alternately with it (same input, same seconds).
   Goal: compute-bound offloaded pass <= 1.05x resident.
2. Achieved host-to-device rate of the transfer-bound offloaded pass (bytes streamed per pass / pass time), and
   the copy rate the engine reports itself (``offload_timing="eager"`` + ``ft.collect_offload_timing``), against
   the peak of a plain ``pin_memory()`` copy of one layer's size measured in the same run.
   Goal: >= 0.97x the pinned peak.
3. accelerate's ``cpu_offload`` on the same model and small batch (imported lazily; accelerate is not a
   dependency, the section is skipped with a note when it is missing). Goal: flextensor >= 3x faster.
4. The profile phase: the ``iters_before_inference`` forwards after ``ft.offload`` against ``profiling_iters``
   ordinary (resident) forwards plus one transfer sweep (every offloaded byte once at the pinned peak). The
   ordinary forwards are a resident twin of the model on the same input, one run before each profile pass
   (paired), summed. Goal: no more than that. A single small-batch phase is short (about a hundred
   milliseconds on a GPU host), and the host's noise moves its ratio about as much as the engine does: the
   resident twin timed against itself the same way (A/A, ``3 * --profile-repeats`` times a run) shows how much.
   So each small-batch configuration's phase is measured ``--profile-repeats`` times (fresh ``ft.offload`` each,
   interleaved with the others), the goal is read on each one's median, and the single phases over the goal are
   counted beside it. The large batch's phase (seconds, compute-bound) is measured once.

Passes are timed whole, with ``torch.cuda.synchronize`` on both sides (a benchmark may sync; the engine must
not), medians over ``--repeat`` passes after a warm-up pass. ``--quick`` runs a tiny model on the CPU (float32,
``pinned_memory=False``): the numbers mean nothing there, the run proves every path works end to end.

Run: ``.venv/bin/python bench/bench_engine.py`` (GPU, ~1-2 min) or ``... --quick`` (CPU, seconds). A full run
writes its tables into docs/benchmarks.md (``--no-docs`` skips that; a ``--quick`` run never does).

``--transfer-modes`` runs another benchmark instead: ``allocation_block_transfer`` against ``raw_block_transfer``
(every layer streaming, and memory mode at ``--fraction``), see ``bench/transfer_modes.py``; ``--model mlp``
(with ``--ffn``) picks the MLP stack it was written for.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gib, median, report, timed  # noqa: E402
from engine_report import build_sections  # noqa: E402
from models import (  # noqa: E402
    BLOCK_PATTERN, ModelSpec, add_model_arguments, build_model, default_device, default_dtype, make_tokens,
)

import flextensor as ft  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# Timing primitives
# ----------------------------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pass_times(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 1) -> list[float]:
    """Seconds per whole forward pass (synchronized before and after, so queued work is not mis-attributed)."""
    sync(device)

    def one() -> None:
        with torch.no_grad():
            fn()
        sync(device)

    return timed(one, repeat=repeat, warmup=warmup)


class GcPauses:
    """Python's cyclic-GC pauses (seconds each) while ``counting``, through ``gc.callbacks``: a full collection
    in a process holding a model and torch's objects takes milliseconds, as much as a launch-bound pass."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.counting = False
        self._start = 0.0

    def _callback(self, phase: str, _info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.counting:
            self.seconds.append(time.perf_counter() - self._start)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._callback)


def pinned_peak_gbps(nbytes: int, device: torch.device, repeat: int) -> float:
    """H2D rate of a plain copy from a ``pin_memory()`` buffer of one layer's size: the ceiling to reach.

    On a CPU host there is no H2D; the same copy between two host buffers is reported so the ratios still
    print (they are meaningless there).
    """
    src = torch.ones(nbytes, dtype=torch.uint8)
    if device.type == "cuda":
        src = src.pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    samples = []
    for i in range(repeat + 1):
        sync(device)
        start = time.perf_counter()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1e3
        else:
            dst.copy_(src)
            seconds = time.perf_counter() - start
        if i:  # the first copy is a warm-up
            samples.append(seconds)
    del src, dst
    return nbytes / median(samples) / 1e9


# ----------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The two input shapes of the benchmark and the resident reference output of the small one."""

    small: torch.Tensor
    large: torch.Tensor
    reference: torch.Tensor | None = None


def resident_run(model: torch.nn.Module, work: Workload, device: torch.device, repeat: int) -> dict:
    with torch.no_grad():
        work.reference = model(work.small).float().cpu()
    return {
        "small_s": median(pass_times(lambda: model(work.small), device, repeat)),
        "large_s": median(pass_times(lambda: model(work.large), device, repeat)),
    }


def offload_config(args: argparse.Namespace, device: torch.device, strategy: object | None,
                   patterns: list[str] | None = None, **extra) -> object:
    return ft.OffloadConfig(
        include_patterns=patterns or [BLOCK_PATTERN],
        pinned_memory=device.type == "cuda",
        skip_discovery=not args.discovery,
        profiling_iters=args.profiling_iters,
        load_strategy=strategy,
        **extra,
    )


def offload_run(
    model: torch.nn.Module,
    config: object,
    name: str,
    profile_input: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    work: Workload,
    device: torch.device,
    repeat: int,
    collect_timing: bool = False,
    twin: torch.nn.Module | None = None,
) -> dict:
    """``ft.offload`` the model, time the profile phase pass by pass, then time inference passes on each input.

    ``twin`` (a resident copy of the model on the device) runs an ordinary forward of the profile input before
    each profile pass: the profile-phase goal compares against the sum of those, taken in the same seconds, not
    minutes earlier, because the speed of a launch-bound pass drifts on this shared host (2.7-5.7 ms for the
    same resident pass within one process and minute).

    The last profile pass also carries the switch to INFERENCE (plan; host blocks when they are not built in
    the background), so it is reported on its own beside the total. The background build of the host blocks
    (after a resident warm-up) is reported beside it, and waited for before inference passes are timed. The
    model is released with ``preserve_model=True`` afterwards (its weights go back where they were), so the next
    run starts from the same model.
    """
    out: dict = {"name": name}
    sync(device)
    start = time.perf_counter()
    proxy = ft.offload(model, config=config, name=name)
    sync(device)
    out["setup_s"] = time.perf_counter() - start
    manager = ft.get_offload_manager(name)
    out.update(paired_profile_phase(proxy, manager.iters_before_inference, profile_input, device, twin))
    out["first_inference_s"] = pass_times(lambda: proxy(profile_input), device, repeat=1, warmup=0)[0]
    start = time.perf_counter()  # after a resident warm-up the host blocks are built behind the first passes
    manager.wait_for_host_blocks()
    out["host_blocks_wait_s"] = time.perf_counter() - start
    out["host_blocks_build_s"] = manager.engine.inference.host_build_s
    out["offloaded_bytes"] = offloaded_bytes(manager, model)
    usage = ft.get_gpu_memory_usage(name)  # the device memory the engine holds: rotating blocks + resident
    out["device_block_bytes"], out["device_total_bytes"] = usage.block_bytes, usage.total_bytes
    out["strategy"] = manager.engine.plan.strategy_name
    with torch.no_grad():
        result = proxy(work.small).float().cpu()
    out["max_abs_diff"] = float((result - work.reference).abs().max()) if work.reference is not None else None
    if collect_timing:
        ft.reset_offload_timing(name)
    for label, tokens in inputs.items():
        if twin is None:
            out[f"{label}_s"] = median(pass_times(lambda: proxy(tokens), device, repeat))
            continue
        # Alternating with the twin: the ratio to resident compares passes taken in the same seconds (a
        # launch-bound resident pass measured at the start of the run drifted from 3.1 to 6.5 ms between runs).
        mine = pass_times(lambda: proxy(tokens), device, repeat=1)  # warm-up pass + one
        theirs = pass_times(lambda: twin(tokens), device, repeat=1)
        for _ in range(repeat - 1):
            mine += pass_times(lambda: proxy(tokens), device, repeat=1, warmup=0)
            theirs += pass_times(lambda: twin(tokens), device, repeat=1, warmup=0)
        out[f"{label}_s"], out[f"{label}_twin_s"] = median(mine), median(theirs)
    if collect_timing:
        out["timing"] = timing_summary(ft.collect_offload_timing(name))
    ft.release(name)
    gc.collect()
    return out


def paired_profile_phase(proxy: Callable[[torch.Tensor], object], iters: int, profile_input: torch.Tensor,
                         device: torch.device, twin: torch.nn.Module | None) -> dict:
    """The ``iters`` profile passes of a fresh ``ft.offload`` proxy, each after an ordinary forward of ``twin``
    (paired samples, see :func:`offload_run`), with the cyclic-GC pauses inside the profile passes."""
    profile, ordinary = [], []
    with GcPauses() as pauses:  # a cyclic-GC pause inside a pass lands in the phase's time: reported beside it
        for _ in range(iters):  # an ordinary forward of the resident twin, then a profile pass: paired samples
            if twin is not None:  # (before, not after: after the last one the host-block build gets a head start)
                ordinary += pass_times(lambda: twin(profile_input), device, repeat=1, warmup=0)
            pauses.counting = True
            profile += pass_times(lambda: proxy(profile_input), device, repeat=1, warmup=0)
            pauses.counting = False
    out: dict = {"iters_before_inference": iters, "profile_passes_s": profile, "gc_pauses_s": pauses.seconds}
    if ordinary:
        out["resident_adjacent_s"] = median(ordinary)
        out["resident_adjacent_all_s"] = ordinary  # pass by pass: the one after the sweep ran slower in experiments
    out["profile_s"], out["profile_last_s"] = sum(profile), profile[-1] if profile else 0.0
    out["profile_pass_median_s"] = median(profile[:-1]) if len(profile) > 1 else None
    return out


def profile_phase_run(model: torch.nn.Module, config: object, name: str, profile_input: torch.Tensor,
                      device: torch.device, twin: torch.nn.Module) -> dict:
    """One more profile phase of a configuration, and nothing else: ``ft.offload``, the paired profile passes,
    ``ft.release``. The switch to INFERENCE is in the last pass; the host blocks it would build behind the first
    inference pass are never started (no inference pass runs), so the release costs no build."""
    proxy = ft.offload(model, config=config, name=name)
    manager = ft.get_offload_manager(name)
    out = {"name": name, **paired_profile_phase(proxy, manager.iters_before_inference, profile_input, device, twin)}
    del proxy
    ft.release(name)
    gc.collect()
    return out


def twin_against_itself(twin: torch.nn.Module, profile_input: torch.Tensor, device: torch.device, iters: int,
                        sweep_s: float, repeats: int) -> list[float]:
    """The profile-phase ratio of an engine that costs nothing, as this host measures it: ``iters`` passes of the
    twin labelled B, each after one labelled A (the same model, input and pairing as the profile phase), read as
    ``(sweep + sum B) / (sweep + sum A)``, ``repeats`` times. Its spread is the noise of the profile goal's ratio
    itself (without the sweep's own disturbance of the passes after it, so a lower bound)."""
    ratios = []
    for _ in range(repeats):
        phase = paired_profile_phase(twin, iters, profile_input, device, twin)  # B as the "profile" passes
        ratios.append((sweep_s + phase["profile_s"]) / (sweep_s + sum(phase["resident_adjacent_all_s"])))
    return ratios


def offloaded_bytes(manager: object, model: torch.nn.Module) -> int:
    """Bytes the strategy left on the host, streamed every pass (``OffloadManager.offloaded_tensors``)."""
    sizes = {n: t.numel() * t.element_size() for n, t in model.state_dict(keep_vars=True).items()}
    return sum(sizes[n] for names in manager.offloaded_tensors.values() for n in names)


def timing_summary(report_: object | None) -> dict | None:
    """Per-pass averages of the engine's own transfer / compute / wait timing (milliseconds)."""
    if report_ is None:
        return None
    return {
        "passes": report_.num_passes,
        "transfer_ms": report_.total_transfer_avg,
        "compute_ms": report_.total_compute_avg,
        "wait_ms": report_.total_wait_avg,
    }


def accelerate_run(model: torch.nn.Module, work: Workload, device: torch.device, repeat: int) -> dict:
    """accelerate's ``cpu_offload`` on the same model (consumes it: its weights move to accelerate's CPU copy)."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device: accelerate cpu_offload streams to a GPU"}
    try:
        from accelerate import cpu_offload
        import accelerate
    except ImportError:
        return {"skipped": "accelerate is not installed (pip install accelerate; not a flextensor dependency)"}
    start = time.perf_counter()
    cpu_offload(model, execution_device=device)
    setup_s = time.perf_counter() - start
    with torch.no_grad():
        diff = float((model(work.small).float().cpu() - work.reference).abs().max())
    small = median(pass_times(lambda: model(work.small), device, max(2, repeat // 2)))
    return {"version": accelerate.__version__, "setup_s": setup_s, "small_s": small, "max_abs_diff": diff}


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the paths, not the speed")
    add_model_arguments(p)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--profiling-iters", type=int, default=10)
    p.add_argument("--profile-repeats", type=int, default=5,
                   help="small-batch profile phases per configuration; the goal is read on their median")
    p.add_argument("--discovery", action="store_true", help="keep the DISCOVERY phase (skip_discovery=False)")
    p.add_argument("--adaptive-fraction", type=float, default=None,
                   help="max_gpu_mem_fraction for the AdaptiveStrategy runs (default: latency mode)")
    p.add_argument("--offload-from", choices=("cpu", "device"), default="cpu",
                   help="where the weights are when ft.offload is called (default: host memory)")
    p.add_argument("--no-accelerate", action="store_true")
    p.add_argument("--no-docs", action="store_true",
                   help="do not write the results into docs/benchmarks.md (a --quick run never does)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transfer-modes", action="store_true",
                   help="compare allocation_block_transfer and raw_block_transfer instead (bench/transfer_modes.py)")
    p.add_argument("--model", choices=("transformer", "mlp"), default="transformer",
                   help="--transfer-modes: the transformer, or a stack of layers.N.fc1/fc2 (--hidden x --ffn)")
    p.add_argument("--ffn", type=int, help="--model mlp: fc1's output width (default 4 x hidden)")
    p.add_argument("--fraction", type=float, default=0.015,
                   help="--transfer-modes: max_gpu_mem_fraction of the memory-mode runs")
    args = p.parse_args()
    gpu = not args.quick and torch.cuda.is_available()
    defaults = (4096, 16, 32000, (1, 128), (8, 4096)) if gpu else (256, 4, 1024, (1, 16), (4, 256))
    if args.model == "mlp":  # 24 layers of 4096 x 16384: 6.0 GiB in bf16
        defaults = (4096, 24, 0, (1, 128), (8, 4096)) if gpu else (64, 6, 0, (1, 16), (4, 64))
    for name, value in zip(("hidden", "layers", "vocab", "small", "large"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.repeat = min(args.repeat, 3)
        args.profiling_iters = min(args.profiling_iters, 3)
        args.profile_repeats = min(args.profile_repeats, 2)
    if args.profile_repeats < 1:
        p.error("--profile-repeats must be >= 1 (the first phase of each configuration is always measured)")
    args.device = default_device() if gpu else torch.device("cpu")
    return args


def main() -> None:
    args = parse_args()
    if args.transfer_modes:
        import transfer_modes  # noqa: PLC0415 - its own benchmark, loaded only when asked for

        transfer_modes.main(args)
        return
    device = args.device
    dtype = default_dtype(device)
    spec = ModelSpec(hidden=args.hidden, layers=args.layers, vocab=args.vocab, mlp_ratio=args.mlp_ratio)
    model = build_model(spec, device, dtype, seed=args.seed)
    work = Workload(small=make_tokens(spec, *args.small, device), large=make_tokens(spec, *args.large, device))
    block_bytes = spec.block_bytes(dtype)
    r: dict = {
        "spec": spec.to_dict(), "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "model_bytes": spec.total_bytes(dtype), "block_bytes": block_bytes,
        "stream_bytes": spec.layers * block_bytes,  # NthLayerStrategy(1) streams every block every pass
        "small_shape": args.small, "large_shape": args.large, "profiling_iters": args.profiling_iters,
    }
    print(f"model {gib(r['model_bytes'])} {r['dtype']} on {device}; measuring resident passes", flush=True)
    r["resident"] = resident_run(model, work, device, args.repeat)
    r["pinned_peak_gbps"] = pinned_peak_gbps(block_bytes, device, args.repeat)
    r["offload_from"] = args.offload_from
    twin = copy.deepcopy(model)  # stays resident: the ordinary forwards each profile phase is compared with
    if args.offload_from == "cpu":  # as a user would hand it over: weights in (pageable) host memory
        model.to("cpu")
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    both = {"small": work.small, "large": work.large}
    nth = ft.NthLayerStrategy(1)
    print("offloaded: NthLayerStrategy(1)", flush=True)
    r["nth"] = offload_run(model, offload_config(args, device, nth), "nth", work.small, both, work, device,
                           args.repeat, twin=twin)
    print("offloaded: NthLayerStrategy(1) with offload_timing='eager'", flush=True)
    r["nth_eager"] = offload_run(model, offload_config(args, device, nth, offload_timing="eager"), "nth_eager",
                                 work.small, {"small": work.small}, work, device, args.repeat, collect_timing=True,
                                 twin=twin)
    adaptive = dict(max_gpu_mem_fraction=args.adaptive_fraction)
    print("offloaded: AdaptiveStrategy, profiled at each batch", flush=True)
    r["adaptive_small"] = offload_run(model, offload_config(args, device, None, **adaptive), "adaptive_small",
                                      work.small, {"small": work.small}, work, device, args.repeat, twin=twin)
    r["adaptive_large"] = offload_run(model, offload_config(args, device, None, **adaptive), "adaptive_large",
                                      work.large, {"large": work.large}, work, device, args.repeat, twin=twin)
    # More small-batch profile phases of the same three configurations, interleaved so that a slow stretch of the
    # host falls on all of them alike; then the twin against itself, the noise of the ratio (see the docstring).
    small_configs = {"nth": offload_config(args, device, nth),
                     "nth_eager": offload_config(args, device, nth, offload_timing="eager"),
                     "adaptive_small": offload_config(args, device, None, **adaptive)}
    r["profile_repeats"] = {label: [] for label in small_configs}
    if args.profile_repeats > 1:
        print(f"profile phase, small batch: {args.profile_repeats - 1} more of each configuration", flush=True)
    for _ in range(args.profile_repeats - 1):
        for label, config in small_configs.items():
            r["profile_repeats"][label].append(
                profile_phase_run(model, config, f"{label}_again", work.small, device, twin))
    sweep_s = r["stream_bytes"] / (r["pinned_peak_gbps"] * 1e9)
    r["twin_against_itself"] = twin_against_itself(twin, work.small, device, r["nth"]["iters_before_inference"],
                                                   sweep_s, repeats=3 * args.profile_repeats)
    if args.no_accelerate:
        r["accelerate"] = {"skipped": "--no-accelerate"}
    else:
        print("accelerate cpu_offload", flush=True)
        r["accelerate"] = accelerate_run(model, work, device, args.repeat)
    report("bench_engine", "flextensor engine benchmark", build_sections(r), r,
           docs=not (args.no_docs or args.quick))


if __name__ == "__main__":
    main()
