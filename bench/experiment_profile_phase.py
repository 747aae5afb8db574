"""Experiment (profile phase at scale): what a fresh profile costs beyond its passes, per GiB of the model.

bench_scale measures the profile phase among much else (a publish, a sharing group), at sizes that take minutes.
This measures only the phase, at each ``--sizes`` GiB, each in a fresh process (no pinned cache, no warm
allocator), with the bench_scale model and set-up: built on the device from a seed, moved to host memory (as a
checkpoint loaded on the CPU gives it), then ``ft.offload()`` (timed, synchronized) and the
``iters_before_inference`` passes (each timed and synchronized; the last one plans and switches to INFERENCE).

Overhead beyond the passes = ``offload()`` + the passes' sum - as many median passes: what the phase costs
beyond running its passes at their usual cost (with ``max_gpu_mem_fraction=0.05`` a large model's warm-up
streams its weights per call, so a usual pass is a streaming pass). After the phase: two more passes (before
the host blocks are installed, when they build in the background), then ``wait_for_host_blocks`` and one
streamed pass; every output is checked against the plain model's. One line per size on stdout, the raw numbers
as JSON lines after it.

Variants of the first pass, which waits for the model's storages to be page-locked on a thread:
``--no-turns`` (its launches do not take turns with the registrations, ``flextensor.runtime.pinned.launch_turns``),
``--turn copies`` (the turn covers a trap's copies only), ``--register-threads N``, ``--timeline`` (every turn and
registration call written to ``timeline-<gib>.json``); run with
``THP_MEM_ALLOC_ENABLE=1`` in the environment for a model in transparent huge pages. docs/benchmarks.md has the
results.

Run: ``scripts/gpu-suite.sh bench experiment_profile_phase --sizes 6 24`` (H200 host, about 2 minutes), or
``python bench/experiment_profile_phase.py --cpu`` (CPU: the GPU's stream-mode warm-up emulated by copying on the
CPU; checks the paths and shows the Python work, not the GPU's costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GIB = 1 << 30


def worker(args: argparse.Namespace) -> dict:
    """One size in this process: build, reference, the timed profile phase, the switch to streaming."""
    import torch

    import flextensor as ft
    from bench_scale import spec_for
    from models import BLOCK_PATTERN, build_model, default_dtype, make_tokens, worker_env

    device = torch.device("cpu" if args.cpu else "cuda:0")
    dtype = default_dtype(device)
    spec = spec_for(args.worker, args.hidden, args.vocab, dtype)
    _torch, device, dtype, spec = worker_env(str(device), str(dtype).removeprefix("torch."), spec.to_dict())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = build_model(spec, device, dtype, seed=0)
    tokens = make_tokens(spec, 1, args.seq, device)
    with torch.no_grad():
        ref = model(tokens).float().cpu()
    model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    manager = ft.get_offload_manager("phase")
    if args.no_turns:  # registrations and launches no longer take turns (flextensor.runtime.pinned.launch_turns)
        from flextensor.runtime.pinned.launch_turns import LaunchTurns

        LaunchTurns.take = lambda self: None  # type: ignore[method-assign]
    if args.turn == "copies":  # the turn is given back once a trap's copies are queued, before its compute
        from flextensor.runtime.loaders.warm_loader import WarmLoader

        load = WarmLoader.load

        def load_then_give(self, tensors):
            load(self, tensors)
            if self.turns is not None:
                self.turns.give()

        WarmLoader.load = load_then_give  # type: ignore[method-assign]
    if args.register_threads:
        import flextensor.runtime.pinned.in_place as staging_mod

        staging_mod.REGISTER_THREADS = args.register_threads
    if args.cpu:  # the GPU path on the CPU: stream through the loader, "copy" the warm-up's weights
        from flextensor.engine.policy import EnginePolicy

        manager.set_engine_policy(EnginePolicy(warmup=args.warmup, stream_on_cpu=True))
    switch_s = _time_the_switch(args.worker)
    timeline = _record_the_turns() if args.timeline else None
    config = ft.OffloadConfig(include_patterns=[BLOCK_PATTERN], pinned_memory=device.type == "cuda",
                              skip_discovery=args.no_discovery, profiling_iters=args.profiling_iters,
                              max_gpu_mem_fraction=None if args.cpu else args.fraction)
    start = time.perf_counter()
    proxy = ft.offload(model, config=config, name="phase")
    sync()
    offload_s = time.perf_counter() - start
    passes, outputs = [], []
    count = manager.iters_before_inference
    building = False
    with torch.no_grad():
        pass_begins = []
        for i in range(count + 2):
            begin = time.perf_counter()
            pass_begins.append(begin)
            outputs.append(proxy(tokens))
            sync()
            passes.append(time.perf_counter() - begin)
            if i == count - 1:
                building = manager.engine.inference.deferred is not None
        begin = time.perf_counter()
        manager.wait_for_host_blocks()
        wait_s = time.perf_counter() - begin
        begin = time.perf_counter()
        outputs.append(proxy(tokens))
        sync()
        streamed_s = time.perf_counter() - begin
    diff = max(float((out.float().cpu() - ref).abs().max()) for out in outputs)
    phase = passes[:count]
    engine = manager.engine
    info = {
        "gib": args.worker, "model_bytes": spec.total_bytes(dtype), "layers": spec.layers,
        "warmup": engine.warm.decision.mode.value if engine.warm.decision else None,
        "offload_s": offload_s, "passes_s": phase, "after_switch_s": passes[len(phase):],
        "built_in_background": building, "host_blocks_wait_s": wait_s, "host_build_s": engine.inference.host_build_s,
        "streamed_pass_s": streamed_s, "streamed_bytes": sum(layout.nbytes for layout in engine.inference.layouts),
        "max_abs_diff": diff, "switch_s": switch_s,
    }
    ft.release("phase", preserve_model=False)
    folder = os.environ.get("FLEXTENSOR_BENCH_OUT")
    if timeline is not None and folder:
        with open(os.path.join(folder, f"timeline-{args.worker:g}.json"), "w") as f:
            json.dump({"start": start, "pass_begins": pass_begins, "events": timeline}, f)
    return info


def _time_the_switch(gib: float) -> dict[str, float]:
    """Wrap the last PROFILING pass's steps (the window reads, the plan and its strategy, entering INFERENCE) to
    add up their seconds, and write the strategy's input to ``plan-input-<gib>.json`` in the results folder
    (a planner's speed can then be measured anywhere, on the very input of this model)."""
    import dataclasses

    import flextensor.engine.profiling as profiling
    from flextensor.planning.strategies import AdaptiveStrategy

    spent: dict[str, float] = {}

    def timed(name: str, fn):
        def run(*a, **k):
            begin = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - begin
        return run

    for name in ("resolve_windows", "plan_switch", "enter_inference"):
        setattr(profiling, name, timed(name, getattr(profiling, name)))
    plan = AdaptiveStrategy.plan

    def plan_and_keep(self, inp):
        folder = os.environ.get("FLEXTENSOR_BENCH_OUT")
        if folder:
            with open(os.path.join(folder, f"plan-input-{gib:g}.json"), "w") as f:
                json.dump(dataclasses.asdict(inp), f)
        return plan(self, inp)

    AdaptiveStrategy.plan = timed("strategy", plan_and_keep)  # type: ignore[method-assign]
    return spent


def _record_the_turns() -> list:
    """Record every turn taken and given and every registration call (waited from, started, ended: perf_counter
    seconds, with the thread's name), for ``timeline-<gib>.json``: where the first pass waits."""
    import contextlib
    import threading

    from flextensor.runtime.pinned.launch_turns import LaunchTurns

    events: list = []
    take, give, registration = LaunchTurns.take, LaunchTurns.give, LaunchTurns.registration

    def timed_take(self):
        begin = time.perf_counter()
        take(self)
        events.append(("take", threading.current_thread().name, begin, time.perf_counter()))

    def timed_give(self):
        held = self.held
        give(self)
        if held:
            events.append(("give", threading.current_thread().name, time.perf_counter(), time.perf_counter()))

    @contextlib.contextmanager
    def timed_registration(self):
        begin = time.perf_counter()
        with registration(self):
            started = time.perf_counter()
            try:
                yield
            finally:
                events.append(("register", threading.current_thread().name, begin, started, time.perf_counter()))

    LaunchTurns.take, LaunchTurns.give = timed_take, timed_give  # type: ignore[method-assign]
    LaunchTurns.registration = timed_registration  # type: ignore[method-assign]
    return events


def summary(r: dict) -> str:
    passes = r["passes_s"]
    median = statistics.median(passes)
    overhead = r["offload_s"] + sum(passes) - len(passes) * median
    gib = r["model_bytes"] / GIB
    return (f"{r['gib']:g} GiB ({r['warmup']} warm-up, {r['streamed_bytes'] / GIB:.2f} GiB streamed): "
            f"offload {r['offload_s']:.3f} s + {len(passes)} passes {sum(passes):.3f} s (first {passes[0]:.3f}, median "
            f"{median:.3f}, last {passes[-1]:.3f}) -> overhead beyond the passes {overhead:.3f} s = {overhead / gib * 1e3:.0f} ms/GiB; "
            f"after the switch {', '.join(f'{s:.3f}' for s in r['after_switch_s'])} s; host blocks "
            f"{'in the background' if r['built_in_background'] else 'built at the switch'} "
            f"(build {r['host_build_s'] or 0:.2f} s, wait {r['host_blocks_wait_s']:.3f} s); streamed pass "
            f"{r['streamed_pass_s']:.3f} s; max |diff| {r['max_abs_diff']:.3g}; the switch (s): "
            f"{', '.join(f'{k} {v:.3f}' for k, v in r['switch_s'].items())}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", help="model sizes in GiB (default 6 24; --cpu 0.5 2)")
    p.add_argument("--fraction", type=float, default=0.05, help="max_gpu_mem_fraction (GPU)")
    p.add_argument("--profiling-iters", type=int, default=10)
    p.add_argument("--no-discovery", action="store_true")
    p.add_argument("--hidden", type=int, help="model width (default 4096; --cpu 1024)")
    p.add_argument("--vocab", type=int, help="vocabulary (default 32000; --cpu 1024)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--cpu", action="store_true", help="emulate the GPU path on the CPU")
    p.add_argument("--warmup", choices=["stream", "resident"], default="stream", help="--cpu: the warm-up mode")
    p.add_argument("--no-turns", action="store_true",
                   help="the first pass's launches do not take turns with the registrations still running")
    p.add_argument("--turn", choices=["trap", "copies"], default="trap",
                   help="what the launches' turn covers in the first pass: the trap (as flextensor does) or only "
                        "its copies")
    p.add_argument("--register-threads", type=int, help="threads that register the model's storages")
    p.add_argument("--timeline", action="store_true",
                   help="write timeline-<gib>.json: every turn and registration call of the phase")
    p.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.hidden = args.hidden or (1024 if args.cpu else 4096)
    args.vocab = args.vocab or (1024 if args.cpu else 32000)
    if args.worker is not None:
        print(json.dumps(worker(args)), flush=True)
        return
    rows = []
    for size in args.sizes or ([0.5, 2] if args.cpu else [6, 24]):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(size), "--fraction", str(args.fraction),
               "--profiling-iters", str(args.profiling_iters), "--hidden", str(args.hidden), "--vocab",
               str(args.vocab), "--seq", str(args.seq), "--warmup", args.warmup]
        cmd += ["--cpu"] * args.cpu + ["--no-discovery"] * args.no_discovery + ["--no-turns"] * args.no_turns
        cmd += ["--turn", args.turn] + (["--register-threads", str(args.register_threads)] if args.register_threads
                                        else []) + ["--timeline"] * args.timeline
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{size:g} GiB FAILED:\n{out.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(summary(r), flush=True)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
