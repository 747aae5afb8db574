"""Host RAM per way of offloading a model held in memory: one copy of the weights, or two?

Each path runs in a fresh process that builds the model, creates the CUDA context and runs one block of the
model on the device (per-process constants: the driver's memory, the math libraries), then resets its peak
(``/proc/self/clear_refs``), reads ``VmRSS`` and makes the call, runs forward passes until the model streams
from its host blocks (``wait_for_host_blocks``), and reads ``VmHWM``. Two ratios per row:

- ``peak / before``: ``VmHWM`` over the RSS just before the call (the model is most of that RSS);
- ``growth / model``: what the call added at its peak, over the model's bytes (0 means no second copy).

Paths, each with the configuration's defaults (``pinned_memory_mode="torch"``) unless named:

- ``offload, memory mode``: ``ft.offload(model, OffloadConfig(max_gpu_mem_fraction=0.015))``: the warm-up
  streams, and the host blocks are built behind the first inference passes;
- ``offload, latency mode``: ``ft.offload(model, OffloadConfig())`` (no cap: the warm-up keeps every weight on
  the device while it profiles);
- ``offload, model on the GPU``: the model is built on the device and offloaded in memory mode: the host RSS
  growth over the bytes offloaded (the host copy is the only host copy: 1.0 is the floor);
- ``offload_from_profile``: a profile saved by the memory-mode path, adopted by a model in RAM.

Every output is compared with a reference computed before the baseline, layer by layer on the device from the
host weights. Beside the memory, each row gives the time from the call to streaming from host blocks, and the
streamed pass rate against the pinned host-to-device rate measured in a process of its own (``pinned H2D``).

Then, per size, a sharing group of ``--workers`` (default 4) processes adopts the memory-mode profile through one
``SharedOffloadSession`` (``host_memory_group.py``): the creator's growth over the model (and its parts: the
factory's own peak, the publish's peak over the RSS the factory ended at) and its publish rate, the workers'
summed PSS once ready and after serving, outputs, and the shut-down of all of them at once after serving
(``close()`` and the exit after it, then what ``/dev/shm`` holds); with ``--kill`` a second group runs with
``ftd`` and is SIGKILLed instead (time until ``/dev/shm`` is clean).

Model (``mlp_stack.py``): MLP blocks of ``d x h`` and ``h x d`` bfloat16 weights (256 MiB a block); ``--sizes`` in
GiB picks the layer count. A model larger than the GPU works the same: it is built in host RAM, and the
reference never holds more than one block on the device.

Usage: ``python bench/bench_host_memory.py [--sizes 6 24] [--paths ...] [--workers 4] [--kill] [--no-docs]``
(needs CUDA).

The configurations name the traps (``include_patterns=["class:Block"]``) and leave everything else at its
default: the default ``["*"]`` traps the ``blocks`` ``ModuleList``, which is never called, so nothing would
stream.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS_DIR, docs_body, proc_status, report, reset_peak_rss, table, write_docs_section,
)
from host_memory_group import GroupParams, memory_mode_config, run_group  # noqa: E402
from mlp_stack import BLOCK_BYTES, build, close_to, inputs, layers_for, reference  # noqa: E402

PATHS = {
    "memory": "offload, memory mode",
    "latency": "offload, latency mode",
    "gpu": "offload, model on the GPU (growth / offloaded bytes)",
    "profile": "offload_from_profile (memory mode's profile)",
}


def worker(args: argparse.Namespace) -> dict:
    import flextensor as ft

    layers, path = args.layers, args.path
    on_gpu = path == "gpu"
    model = build(layers, "cuda" if on_gpu else "cpu")
    x = inputs(args.batch)
    expected = reference(model, x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if path in ("memory", "gpu", "profile"):
        config = memory_mode_config()
    else:
        config = ft.OffloadConfig(include_patterns=["class:Block"])
    reset_peak_rss()
    before = proc_status("VmRSS")
    start = time.monotonic()
    if path == "profile":
        model = ft.offload_from_profile(model, args.profile, config)
    else:
        model = ft.offload(model, config)
    manager = ft.get_offload_manager()
    xd = x.cuda()
    with torch.no_grad():
        for _ in range(manager.iters_before_inference + 1):
            model(xd)
        manager.wait_for_host_blocks()
        model(xd)
        torch.cuda.synchronize()
        ready_s = time.monotonic() - start
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = model(xd)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = proc_status("VmHWM")
    sizes = {name: t.numel() * t.element_size() for name, t in model.named_parameters()}
    streamed = sum(sizes.get(name, 0) for names in manager.offloaded_tensors.values() for name in names)
    if args.save_profile:
        ft.save_profile(args.save_profile)
    equal = close_to(out, expected)
    ft.release()
    return {"path": path, "layers": layers, "model_bytes": layers * BLOCK_BYTES, "before": before, "peak": peak,
            "ready_s": ready_s, "pass_s": min(times), "streamed_bytes": streamed, "equal": equal}


def pinned_h2d_rate() -> float:
    """Pinned host-to-device rate, GB/s: 1 GiB copied 5 times, the fastest."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return (1 << 30) / best / 1e9


def _spawn(*argv: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}: " + (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1])


GROUP_HEADERS = ["model", "ready: creator / slowest", "creator growth / model",
                 "of which: factory's peak / publish over the factory's end", "creator publish",
                 "sum of PSS / model: ready, served", "served PSS growth / model", "outputs equal",
                 "slowest pass, batch 1 / 4096", "shut-down", "left in /dev/shm"]


def group_row(result: dict) -> list[str]:
    """One row of the group table from :func:`host_memory_group.run_group`'s measures."""
    size = f"{result['size_gib']} GiB"
    if "error" in result:
        return [size, "error: " + result["error"][:120], *[""] * (len(GROUP_HEADERS) - 2)]
    model = result["model_bytes"]
    ready = result["ready"]
    creator = next(r for r in ready if r["role"] == "creator")
    slowest = {b: max(max(s["passes_s"][b]) for s in result["served"]) for b in result["served"][0]["passes_s"]}
    if result["kill"]:
        shutdown = f"SIGKILL of all, ftd: reclaimed in {result['reclaim_s']:.2f} s"
        if "exited_s" in result:  # runs before the two were timed apart measured the reclaim after the exits
            shutdown += f" (processes gone in {result['exited_s']:.2f} s)"
    else:
        closes, exits = zip(*result["closed"])
        shutdown = f"close() <= {max(closes):.3f} s, exit after it <= {max(exits):.3f} s"
    parts, rate = "-", "-"
    if "factory_peak" in creator:  # runs before the factory's and the publish's peaks were read apart: "-"
        parts = (f"{(creator['factory_peak'] - creator['before']) / model:.3f}x / "
                 f"+{(creator['publish_peak'] - creator['factory_rss']) / model:.3f}x")
    publish = creator.get("publish") or {}
    if publish.get("gbps"):
        rate = f"{publish['gbps']:.1f} GB/s, {publish['seconds']:.2f} s"
    return [size, f"{creator['ready_s']:.1f} / {max(r['ready_s'] for r in ready):.1f} s",
            f"{(creator['peak'] - creator['before']) / model:.3f}x", parts, rate,
            f"{result['pss_ready'] / model:.3f}x, {result['pss_served'] / model:.3f}x",
            f"{(result['pss_served'] - sum(r['before'] for r in ready)) / model:.3f}x",
            "yes" if all(s["equal"] for s in result["served"]) else "NO",
            " / ".join(f"{v * 1e3:.0f} ms" for v in slowest.values()), shutdown,
            str(len(result["leftovers"]))]


def path_row(result: dict, rate: float) -> list[str]:
    """One row of the per-path table from a worker's measures."""
    size, path = f"{result['size_gib']} GiB", result["path"]
    if "error" in result:
        return [size, PATHS[path], "error", "", "", "", "", ""]
    growth = result["peak"] - result["before"]
    base = result["streamed_bytes"] if path == "gpu" and result["streamed_bytes"] else result["model_bytes"]
    stream_gbs = result["streamed_bytes"] / result["pass_s"] / 1e9 if result["streamed_bytes"] else 0.0
    return [size, PATHS[path], f"{result['before'] / 2**30:.2f} -> {result['peak'] / 2**30:.2f} GiB",
            f"{result['peak'] / max(result['before'], 1):.3f}x", f"{growth / max(base, 1):.3f}x",
            f"{result['ready_s']:.1f} s", f"{stream_gbs:.1f} GB/s ({stream_gbs / rate:.2f}x)" if stream_gbs else "-",
            "yes" if result["equal"] else "NO"]


def sections_for(data: dict) -> list[tuple[str, str]]:
    """The report's tables from the raw measures (one run's, or several runs' merged by ``--docs-from``)."""
    headers = ["model", "path", "RSS before -> peak", "peak / before", "growth / model", "to streaming",
               "streamed pass", "output equal"]
    rows = [path_row(r, r.get("pinned_h2d_gbs", data["pinned_h2d_gbs"])) for r in data["runs"]]
    rates = sorted({f"{r.get('pinned_h2d_gbs', data['pinned_h2d_gbs']):.1f}" for r in data["runs"]})
    sections = [("Host RAM per path (defaults: pinned_memory_mode='torch')",
                 f"Pinned host-to-device rate on this host, measured in the same run: {' / '.join(rates)} GB/s."
                 "\n\n" + table(headers, rows))]
    if data["groups"]:
        workers = sorted({g["workers"] for g in data["groups"] if "workers" in g}) or ["?"]
        sections.append((f"A sharing group of {'/'.join(map(str, workers))} workers (SharedOffloadSession, memory "
                         "mode, the profile above), all started, serving and shutting down at once",
                         table(GROUP_HEADERS, [group_row(g) for g in data["groups"]])))
    return sections


def run(args: argparse.Namespace) -> None:
    rate = _spawn("--h2d", timeout=120).get("rate", float("nan"))
    data: dict = {"pinned_h2d_gbs": rate, "runs": [], "groups": []}
    partial = RESULTS_DIR / "bench_host_memory.partial.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ft-hostmem-"))
    for size in args.sizes:
        layers = layers_for(size)
        profile = tmp / f"profile-{layers}"
        for path in args.paths:
            extra = ["--save-profile", str(profile)] if path == "memory" else []
            if path == "profile":
                if not profile.exists():
                    continue
                extra = ["--profile", str(profile)]
            result = _spawn("--worker", "--path", path, "--layers", str(layers), "--batch", str(args.batch), *extra,
                            timeout=args.timeout)
            result.update(path=path, size_gib=size, pinned_h2d_gbs=rate)
            data["runs"].append(result)
            partial.write_text(json.dumps(data, indent=2))
            print(json.dumps(result)[:600], flush=True)
        if args.workers and profile.exists():
            for kill in ([True] if args.kill_only else [False, True] if args.kill else [False]):
                params = GroupParams(layers=layers, profile=str(profile), batch=args.batch,
                                     reference=str(tmp / f"reference-{layers}-{int(kill)}.safetensors"),
                                     serve_passes=args.serve_passes)
                try:
                    result = run_group(params, args.workers, kill, args.timeout)
                except Exception as exc:  # noqa: BLE001 - this group failed; the rest still runs
                    result = {"error": f"{type(exc).__name__}: {exc}", "kill": kill}
                result.update(size_gib=size, model_bytes=layers * BLOCK_BYTES)
                data["groups"].append(result)
                partial.write_text(json.dumps(data, indent=2))
                print(json.dumps(result)[:1500], flush=True)
    report("bench_host_memory", "Host RAM per offload path", sections_for(data), data, docs=not args.no_docs)


def docs_from(paths: list[str]) -> None:
    """Merge saved results (each run's ``bench_host_memory.json`` or ``.partial.json``, e.g. one size per device
    run) into one report, in the order given, and write it into docs/benchmarks.md."""
    merged: dict = {"pinned_h2d_gbs": float("nan"), "runs": [], "groups": []}
    machines = set()
    for path in paths:
        data = json.loads(Path(path).read_text())
        machines.add(data["machine"].partition(", ")[2])
        for r in data["runs"]:
            r.setdefault("pinned_h2d_gbs", data["pinned_h2d_gbs"])
        merged["runs"] += data["runs"]
        merged["groups"] += data["groups"]
    if len(machines) != 1:
        raise SystemExit(f"--docs-from: the runs come from {len(machines)} machines; merge runs of one machine only")
    machine = json.loads(Path(paths[0]).read_text())["machine"]
    body = docs_body(sections_for(merged), machine=machine)
    print(f"wrote {write_docs_section('bench_host_memory', body)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=float, nargs="+", default=[6, 24])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--workers", type=int, default=4, help="sharing group size per size (0: no group)")
    p.add_argument("--serve-passes", type=int, default=8, help="passes each group worker serves before shut-down")
    p.add_argument("--kill", action="store_true", help="also a group SIGKILLed with ftd running")
    p.add_argument("--kill-only", action="store_true", help="only the SIGKILLed group (no orderly shut-down)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--docs-from", nargs="+", metavar="JSON", help="write saved results into docs/benchmarks.md")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--h2d", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=list(PATHS), help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.add_argument("--save-profile", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.h2d:
        print(json.dumps({"rate": pinned_h2d_rate()}))
    elif args.docs_from:
        docs_from(args.docs_from)
    elif args.worker:
        print(json.dumps(worker(args)), flush=True)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_host_memory needs CUDA")
        run(args)


if __name__ == "__main__":
    main()
