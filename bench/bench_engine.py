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
from common import gib, median, report, table, timed  # noqa: E402
from models import BLOCK_PATTERN, ModelSpec, build_model, default_device, default_dtype, make_tokens  # noqa: E402

import flextensor as ft  # noqa: E402

GOAL_H2D_RATIO = 0.97
GOAL_COMPUTE_BOUND_RATIO = 1.05
GOAL_VS_ACCELERATE = 3.0


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
# Report
# ----------------------------------------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.3f}x"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def build_sections(r: dict) -> list[tuple[str, str]]:
    res, nth, ada_s, ada_l, acc = r["resident"], r["nth"], r["adaptive_small"], r["adaptive_large"], r["accelerate"]
    stream_bytes = r["stream_bytes"]
    peak = r["pinned_peak_gbps"]
    achieved = stream_bytes / nth["small_s"] / 1e9
    eager = r["nth_eager"].get("timing")
    eager_gbps = stream_bytes / (eager["transfer_ms"] / 1e3) / 1e9 if eager and eager["transfer_ms"] else None
    model_rows = [[
        f"hidden {r['spec']['hidden']}, {r['spec']['layers']} layers, vocab {r['spec']['vocab']}",
        f"{r['dtype']} on {r['device']}", gib(r["model_bytes"]), gib(r["block_bytes"]),
        f"{tuple(r['small_shape'])}", f"{tuple(r['large_shape'])}",
    ]]
    forward_rows = [
        ["resident", ms(res["small_s"]), ms(res["large_s"]), "1.000x", "1.000x", "-"],
        ["offloaded, NthLayerStrategy(1)", ms(nth["small_s"]), ms(nth["large_s"]),
         _vs_resident(nth, res, "small"), _vs_resident(nth, res, "large"), _bytes(nth, stream_bytes)],
        ["offloaded, AdaptiveStrategy (profiled per batch)", ms(ada_s["small_s"]), ms(ada_l["large_s"]),
         _vs_resident(ada_s, res, "small"), _vs_resident(ada_l, res, "large"),
         f"{_bytes(ada_s, None)} / {_bytes(ada_l, None)}"],
    ]
    if "skipped" not in acc:
        forward_rows.append([f"accelerate {acc['version']} cpu_offload", ms(acc["small_s"]), "not run",
                             ratio(acc["small_s"], res["small_s"]), "-", gib(r["model_bytes"])])
    h2d_rows = [
        ["pin_memory() copy of one layer (peak)", f"{peak:.2f} GB/s", "1.000x"],
        ["offloaded pass, NthLayerStrategy(1): streamed bytes / pass time", f"{achieved:.2f} GB/s",
         f"{achieved / peak:.3f}x"],
        ["engine's own copy timing (offload_timing='eager')",
         "n/a" if eager_gbps is None else f"{eager_gbps:.2f} GB/s",
         "n/a" if eager_gbps is None else f"{eager_gbps / peak:.3f}x"],
    ]
    eager_text = "no timing report" if not eager else (
        f"per pass over {eager['passes']} passes: transfer {eager['transfer_ms']:.1f} ms, compute "
        f"{eager['compute_ms']:.1f} ms, wait {eager['wait_ms']:.1f} ms")
    profiled = [("small", nth), ("small", r["nth_eager"]), ("small", ada_s), ("large", ada_l)]
    profile_rows = [_profile_row(batch, run, res, r) for batch, run in profiled]
    repeated = {label: [_phase_ratio(run, res, "small", r) for run in [r[label], *again]]
                for label, again in r["profile_repeats"].items()}
    medians = {label: median(ratios) for label, ratios in repeated.items()}
    large_ratio = _phase_ratio(ada_l, res, "large", r)
    singles = [x for ratios in repeated.values() for x in ratios]
    itself = r["twin_against_itself"]
    repeat_rows = [[label, str(len(ratios)), " ".join(f"{x:.3f}" for x in ratios), f"{medians[label]:.3f}x",
                    f"{sum(x > 1.0 for x in ratios)} of {len(ratios)}"] for label, ratios in repeated.items()]
    repeat_rows.append(["the resident twin against itself (A/A, no engine)", str(len(itself)),
                        f"{min(itself):.3f} to {max(itself):.3f}", f"{median(itself):.3f}x",
                        f"spread {max(itself) - min(itself):.3f}"])
    goals = [
        [f"transfer-bound H2D >= {GOAL_H2D_RATIO}x pinned peak", f"{achieved / peak:.3f}x",
         verdict(achieved / peak >= GOAL_H2D_RATIO)],
        [f"compute-bound offloaded (Nth 1) <= {GOAL_COMPUTE_BOUND_RATIO}x resident",
         _vs_resident(nth, res, "large"),
         verdict(nth["large_s"] / _resident_s(nth, res, "large") <= GOAL_COMPUTE_BOUND_RATIO)],
        [f">= {GOAL_VS_ACCELERATE}x faster than accelerate cpu_offload (transfer-bound)",
         "skipped" if "skipped" in acc else f"{acc['small_s'] / nth['small_s']:.2f}x",
         verdict(None if "skipped" in acc else acc["small_s"] / nth["small_s"] >= GOAL_VS_ACCELERATE)],
        ["profile phase <= profiling_iters forwards (paired twin passes) + one sweep: median of "
         f"{len(singles) // max(len(repeated), 1)} small-batch phases (worst configuration) / the large batch's",
         f"{max(medians.values()):.3f}x / {large_ratio:.3f}x",
         verdict(max(medians.values()) <= 1.0 and large_ratio <= 1.0)],
        ["the same, single small-batch phases over the goal (the host's noise: the A/A row above)",
         f"{sum(x > 1.0 for x in singles)} of {len(singles)}, worst {max(singles):.3f}x", "-"],
        ["offloaded outputs equal resident (max |diff|, small batch)",
         f"{max(v for v in (nth['max_abs_diff'], ada_s['max_abs_diff']) if v is not None):.3g}", "-"],
    ]
    sections = [
        ("Model and inputs", table(["model", "dtype / device", "weights", "one layer", "small batch (B, S)",
                                   "large batch (B, S)"], model_rows)),
        ("Forward pass (median)", table(["run", "small batch (transfer-bound)", "large batch (compute-bound)",
                                         "small / resident", "large / resident", "bytes streamed per pass"],
                                        forward_rows)
         + "\n\nThe flextensor rows' ratios are against a resident twin of the model timed alternately with them "
           "(pass for pass, same input); the resident row, and accelerate's ratio, use the pass measured at the "
           "start of the run."),
        ("Host-to-device rate, transfer-bound", table(["measure", "rate", "x pinned peak"], h2d_rows)
         + f"\n\nEngine timing, {eager_text}."),
        ("Profile phase (in run order)", table(
            ["batch", "run", "iters_before_inference", "first pass (sweep)", "median pass",
             "last pass (+ switch to INFERENCE)", "GC pauses in its passes", "profile phase total",
             "first inference pass", "host blocks built in the background (then waited for)",
             "resident twin passes (paired): sum (median)", "goal: that sum + one sweep", "phase / goal",
             "phase / (its passes x the median twin pass + one sweep)"],
            profile_rows)
         + "\n\nThe goal holds the phase to the ordinary forwards that ran in the same seconds: each profile pass "
           "follows a pass of the resident twin, and their sum is the profiling_iters ordinary forwards (with "
           "--discovery, the discovery passes' too). The last column holds it to that many times the median twin "
           "pass instead, which assumes a steady host: passes right after the sweep, the twin's and the "
           "profile's alike, can run slower than later ones, time the median leaves out of the goal but not "
           "out of the phase."
         + f"\n\nWeights handed to ft.offload from: {r['offload_from']} memory. After a resident warm-up the host "
         "blocks are allocated and filled on a thread while the first inference passes run resident (the first "
         "run's build also pays this process's first pinned host allocations); the engine streams from the next "
         "pass after the build, and the benchmark waits for it before timing inference passes."),
        ("Profile phase, small batch, repeated", table(
            ["configuration", "phases", "phase / goal, in run order (the first is the table above's)", "median",
             "over the goal"], repeat_rows)
         + "\n\nThe A/A row times the resident twin against itself, paired as in the profile phase, with the same "
           "sweep added to both sides: its spread is what this host's noise alone does to one phase's ratio. So "
           "the goal is read on the median of repeated phases per configuration (each a fresh ft.offload, "
           "interleaved with the other configurations), and the single phases over it are counted beside."),
        ("Goals", table(["goal", "measured", "status"], goals)),
    ]
    if "skipped" in acc:
        sections.append(("accelerate", f"Skipped: {acc['skipped']}."))
    return sections


def _resident_s(run: dict, res: dict, batch: str) -> float:
    """The resident pass an offloaded run's passes are compared with: its twin's, timed alternately with them
    (the same seconds), else the resident pass measured at the start of the run."""
    return run.get(f"{batch}_twin_s") or res[f"{batch}_s"]


def _vs_resident(run: dict, res: dict, batch: str) -> str:
    return ratio(run[f"{batch}_s"], _resident_s(run, res, batch))


def _bytes(run: dict, fallback: int | None) -> str:
    value = run.get("offloaded_bytes")
    if value is None:
        value = fallback
    return "n/a" if value is None else gib(value)


def _ordinary_s(run: dict, res: dict, batch: str) -> float:
    """The median ordinary forward of a run's profile phase: the twin's, paired with its passes, when run."""
    return run.get("resident_adjacent_s") or res[f"{batch}_s"]


def _ordinary_total_s(run: dict, res: dict, batch: str) -> float:
    """The profiling_iters ordinary forwards a run's profile phase is held to: the paired twin passes' sum (one
    before each profile pass, so the same seconds), else profiling_iters x the resident pass of the run's start."""
    paired = run.get("resident_adjacent_all_s")
    if paired and len(paired) == run["iters_before_inference"]:
        return sum(paired)
    return run["iters_before_inference"] * res[f"{batch}_s"]


def _profile_goal_s(ordinary_total_s: float, r: dict) -> float:
    """The ordinary forwards + one sweep of every streamed byte at the measured pinned peak."""
    return ordinary_total_s + r["stream_bytes"] / (r["pinned_peak_gbps"] * 1e9)


def _phase_ratio(run: dict, res: dict, batch: str, r: dict) -> float:
    """A profile phase against its goal (1.0 = exactly the goal)."""
    return run["profile_s"] / _profile_goal_s(_ordinary_total_s(run, res, batch), r)


def _profile_row(label: str, run: dict, res: dict, r: dict) -> list[str]:
    total_s, median_s = _ordinary_total_s(run, res, label), _ordinary_s(run, res, label)
    goal_s = _profile_goal_s(total_s, r)
    median_goal_s = _profile_goal_s(run["iters_before_inference"] * median_s, r)
    pauses = run.get("gc_pauses_s", [])
    gc_text = f"{len(pauses)}, {sum(pauses) * 1e3:.1f} ms" if pauses else "none"
    passes = run.get("profile_passes_s") or [None]
    return [label, run["name"], str(run["iters_before_inference"]), ms(passes[0]), ms(run["profile_pass_median_s"]),
            ms(run["profile_last_s"]), gc_text, ms(run["profile_s"]), ms(run["first_inference_s"]),
            f"{ms(run.get('host_blocks_build_s'))} ({ms(run.get('host_blocks_wait_s'))})",
            f"{ms(total_s)} ({ms(median_s)})", ms(goal_s), f"{run['profile_s'] / goal_s:.3f}x",
            f"{run['profile_s'] / median_goal_s:.3f}x"]


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU: checks the paths, not the speed")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--mlp-ratio", type=int, default=2)
    p.add_argument("--small", type=int, nargs=2, metavar=("B", "S"), help="transfer-bound input (batch, seq)")
    p.add_argument("--large", type=int, nargs=2, metavar=("B", "S"), help="compute-bound input (batch, seq)")
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
