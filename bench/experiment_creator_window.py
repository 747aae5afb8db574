"""A session creator whose factory builds the model in RAM: host RAM and publish rate of the arena filled in pieces,
against the same fill in whole blocks, in one run.

Why: the creator's growth over the model is what it holds beside its private copy while it publishes. Filled in
pieces (``flextensor.sharing.publish``: pages allocated 1/32 of the model ahead, in pieces of at most 32 MiB, each
private tensor's pages given back behind its copy) it holds the window and a piece; filled in whole blocks (each
block's pages allocated before its copy, 1/16 of the model ahead, each tensor freed once copied whole) it held the
block being filled and the window. Fewer pages ahead could also mean fewer arena parts allocating at once, so the
publish rate is measured beside the memory, alternating the two fills in fresh processes on the same host.

Each size: a profile of ``mlp_stack``'s model in ``bench_host_memory``'s memory mode, saved once; then per repeat
one creator per fill (the order alternates), alone, each in a fresh process that starts CUDA before its baseline,
builds the model in its factory and publishes it. Printed per creator (JSON lines) and as a table: growth over
the RSS at the session's start / model (the factory's own peak, and the publish's peak over the RSS the factory
ended at), the publish's rate and seconds, the seconds the copy waited for pages, the bytes given back early.

Usage: ``python bench/experiment_creator_window.py [--sizes 6 24] [--repeat 2] [--plan memory|latency]``
(``latency``: profiled without a cap, so most of the model is resident and the store's fill is measured);
``--quick`` runs 0.5 and 1 GiB on the CPU (no CUDA needed: the paths work, the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, proc_status, reset_peak_rss, table  # noqa: E402

FILLS = ("pieces", "blocks")


def fill_in_blocks() -> None:
    """The whole-block fill: one piece per block, 1/16 of the segments ahead (1 GiB at most), no early release."""
    import flextensor.sharing.creator as creator
    import flextensor.sharing.publish as publish

    def window(total: int) -> int:
        return max(1, min(1 << 30, total // 16))

    publish.populate_window = window
    creator.populate_window = window  # the store's window, taken by name there
    publish.fill_piece = lambda window: 1 << 62
    publish.releasable = lambda tensor: False


def config(cuda: bool, plan: str = "memory"):
    import flextensor as ft

    if cuda and plan == "latency":  # no cap: what fits stays resident, so the store holds most of the model
        return ft.OffloadConfig(include_patterns=["class:Block"])
    if cuda:
        from host_memory_group import memory_mode_config

        return memory_mode_config()
    return ft.OffloadConfig(pinned_memory=False, include_patterns=["class:Block"], profiling_iters=2,
                            load_strategy=ft.NthLayerStrategy(1))


def profile_main(layers: int, path: str, plan: str) -> None:
    import torch

    import flextensor as ft
    from mlp_stack import build, inputs

    cuda = torch.cuda.is_available()
    model = build(layers, "cpu")
    ft.offload(model, config(cuda, plan))
    manager = ft.get_offload_manager()
    x = inputs(2).to(manager.device)
    with torch.no_grad():
        for _ in range(manager.iters_before_inference + 1):
            model(x)
    ft.save_profile(path)
    ft.release()
    print(json.dumps({"profile": path}), flush=True)


def creator_main(layers: int, profile: str, fill: str, plan: str) -> None:
    import torch

    import flextensor as ft
    import flextensor.sharing.session  # noqa: F401 - imported before the baseline
    from mlp_stack import BLOCK_BYTES, build, build_meta

    cuda = torch.cuda.is_available()
    if cuda:
        torch.ones(1, device="cuda").sum().item()  # the CUDA context: a per-process constant
    if fill == "blocks":
        fill_in_blocks()
    info: dict = {"fill": fill, "layers": layers, "model_bytes": layers * BLOCK_BYTES}

    def factory():
        model = build(layers, "cpu")
        info.update(factory_peak=proc_status("VmHWM"), factory_rss=proc_status("VmRSS"))
        reset_peak_rss()
        return model

    reset_peak_rss()
    info["before"] = proc_status("VmRSS")
    session = ft.SharedOffloadSession(f"crwin{uuid.uuid4().hex[:10]}", wait_timeout=600)
    try:
        start = time.monotonic()
        session.offload_from_profile(profile, config=config(cuda, plan), name="creator", creator_model_factory=factory,
                                     follower_model_factory=lambda: build_meta(layers))
        info.update(ready_s=time.monotonic() - start, publish_peak=proc_status("VmHWM"),
                    role=session.role("creator"), **{k: v for k, v in session.report()[0].items()
                                                     if k in ("publish", "steps")})
    finally:
        session.close()
    print(json.dumps(info), flush=True)


def _spawn(*argv: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}: " + (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1])


def _row(size: float, fill: str, runs: list[dict]) -> list[str]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return [f"{size} GiB", fill, "error: " + runs[0]["error"][-200:], "", "", "", "", ""]
    model = ok[0]["model_bytes"]

    def med(values) -> float:
        return statistics.median(values)

    growth = med((max(r["factory_peak"], r["publish_peak"]) - r["before"]) / model for r in ok)
    factory = med((r["factory_peak"] - r["before"]) / model for r in ok)
    publish = med((r["publish_peak"] - r["factory_rss"]) / model for r in ok)
    rate = med(r["publish"]["gbps"] for r in ok)
    seconds = med(r["publish"]["seconds"] for r in ok)
    waited = med(r["publish"].get("populate_wait_s", 0.0) for r in ok)
    released = med(r["publish"].get("released_early_bytes", 0.0) + r["publish"].get("store_released_early_bytes", 0.0)
                   for r in ok) / model
    return [f"{size} GiB", fill, f"{growth:.3f}x", f"{factory:.3f}x / +{publish:.3f}x",
            f"{rate:.2f} GB/s ({seconds:.2f} s)", f"{waited:.2f} s", f"{released:.2f}x", str(len(ok))]


def run(args: argparse.Namespace) -> None:
    from mlp_stack import layers_for

    tmp = Path(tempfile.mkdtemp(prefix="ft-crwin-"))
    rows = []
    for size in args.sizes:
        layers = layers_for(size)
        profile = str(tmp / f"profile-{layers}")
        made = _spawn("--profile-of", str(layers), profile, "--plan", args.plan, timeout=args.timeout)
        if "error" in made:
            rows.append([f"{size} GiB", "profile", "error: " + made["error"][-200:], "", "", "", "", ""])
            continue
        runs: dict[str, list[dict]] = {fill: [] for fill in FILLS}
        for repeat in range(args.repeat):
            for fill in (FILLS if repeat % 2 == 0 else FILLS[::-1]):
                result = _spawn("--creator", str(layers), profile, fill, "--plan", args.plan, timeout=args.timeout)
                result.update(size_gib=size)
                print(json.dumps(result)[:800], flush=True)
                runs[fill].append(result)
        rows += [_row(size, fill, runs[fill]) for fill in FILLS]
    print(f"\nCreator in RAM, alone, {args.plan} plan, {machine_description()}\n")
    print(table(["model", "fill", "growth / model", "factory's peak / publish over its end", "publish",
                 "waited for pages", "given back early / model", "runs"], rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=float, nargs="+", default=[6, 24])
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="0.5 and 1 GiB; runs without CUDA")
    p.add_argument("--plan", choices=["memory", "latency"], default="memory",
                   help="the profile's mode: memory (bench_host_memory's, mostly streamed) or latency (no cap, "
                        "mostly resident: the store's fill)")
    p.add_argument("--profile-of", nargs=2, metavar=("LAYERS", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--creator", nargs=3, metavar=("LAYERS", "PROFILE", "FILL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.profile_of:
        profile_main(int(args.profile_of[0]), args.profile_of[1], args.plan)
    elif args.creator:
        creator_main(int(args.creator[0]), args.creator[1], args.creator[2], args.plan)
    else:
        if args.quick:
            args.sizes, args.repeat = [0.5, 1.0], 1
        run(args)


if __name__ == "__main__":
    main()
