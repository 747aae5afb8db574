"""The tables of ``bench_engine.py`` from its raw results: forward passes against the resident model, the
host-to-device rate, the profile phase against its goal (single and repeated phases, the A/A noise row), goals.

Kept apart from the measuring so that a saved ``bench_engine.json`` can be turned into the same tables again and
so that ``transfer_modes.py`` formats its rows the same way (``ms``, ``ratio``, ``verdict``).
"""

from __future__ import annotations

from common import gib, median, table

GOAL_H2D_RATIO = 0.97
GOAL_COMPUTE_BOUND_RATIO = 1.05
GOAL_VS_ACCELERATE = 3.0


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
