"""Sleep, wake and new weights of a sharing group, against per-process copies (vLLM's sleep mode, level 1).

Why: colocated training and serving frees the serving workers' GPU memory for each training step and brings it
back afterwards, usually with new weights. vLLM's level-1 sleep copies each engine's weights to its own pinned
CPU memory and back; every worker of a host keeps a private host copy, and new weights reach each worker
separately. Here the workers of a host share one host copy: sleeping copies nothing, waking copies the resident
tensors from memory that is already shared, and an update is written once per host.

Per size (``--sizes`` in GiB; ``bench/mlp_stack.py``'s bfloat16 MLP blocks), in fresh processes:

1. a profile: the model offloaded with a device budget of half its bytes (so half of it stays resident on the
   device, the rest streams), a few passes, ``save_profile``;
2. the sharing group: ``--workers`` processes adopt it through one ``SharedOffloadSession``, one after the
   other, each sleeping once it is ready (one GPU holds them all). Each measures its forward pass before the
   sleep; ``sleep()``: seconds and ``torch.cuda.memory_allocated`` before and after (what the model held is what
   the process allocated beyond its context); the group's summed PSS while every worker sleeps, over the model's
   bytes (raw, and the growth over each process's PSS before it joined, which leaves out the CUDA context);
   the first worker (which published the weights: the "trainer") then writes new weights (every tensor scaled
   by 0.5, built in its RAM) with ``update_weights`` and times it; every worker waits for the registration of
   the host copy its sleep started (``wake_ready``: a training step outlasts it; the wait is reported) and
   wakes (seconds, against the
   resident bytes over the pinned host-to-device rate measured in the same run) and checks its output against
   the plain model holding the new weights, computed layer by layer on the device;
3. the baseline, vLLM-style: one process holds the whole model on the device, ``sleep`` copies every weight to
   its own pinned host memory (``pin_memory``) and frees the device memory, ``wake`` copies it back and drops
   the host copy (two cycles: the first pays for the pinned allocations); its PSS while asleep (a host of
   ``--workers`` such processes holds that many private copies); and loading a new state dict from host memory
   into its weights (each worker of a host does that for itself).

``--quick``: a small model (``--quick-dims``) on the CPU, for the test suite: same code paths, numbers
meaningless. ``--docs-from JSON ...`` writes saved results (one device run per size) into docs/benchmarks.md.

Usage: ``python bench/bench_sleep.py [--sizes 6 24] [--workers 4] [--no-docs]`` (needs CUDA unless ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS_DIR, JsonLineWorker, cleanup_namespace, docs_body, pss_bytes, report, table, write_docs_section,
)

MANAGER = "sleep"
QUICK_DIMS = (256, 512)
NAME = "bench_sleep"


# ================================================================================================================
# Both sides: the model
# ================================================================================================================


def use_dims(d: int, h: int) -> None:
    """Size ``mlp_stack``'s blocks (the device runs keep its defaults; ``--quick`` makes them small)."""
    import mlp_stack

    mlp_stack.D, mlp_stack.H = d, h
    mlp_stack.BLOCK_BYTES = 2 * d * h * mlp_stack.DTYPE.itemsize


def device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def plain_output(weights: dict, layers: int, x, dev):
    """The plain model with ``weights`` (host tensors by name), layer by layer on ``dev``, one block there at a time."""
    import torch

    with torch.no_grad():
        x = x.to(dev)
        for i in range(layers):
            up = weights[f"blocks.{i}.up.weight"].to(dev)
            down = weights[f"blocks.{i}.down.weight"].to(dev)
            x = x + torch.relu(x @ up.t()) @ down.t()
        return x.cpu()


def close_to(out, expected) -> bool:
    import torch

    return bool(torch.allclose(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2))


def allocated() -> int:
    import torch

    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def config():
    import flextensor as ft

    cuda = device().type == "cuda"
    return ft.OffloadConfig(include_patterns=["class:Block"], pinned_memory=cuda, profiling_iters=2)


# ================================================================================================================
# Worker side (``bench_sleep.py --worker MODE PARAMS_JSON``)
# ================================================================================================================


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def worker_profile(p: dict) -> None:
    """Step 1: offload with a device budget of half the model, a few passes, save the profile."""
    import torch

    import flextensor as ft
    from mlp_stack import build, inputs

    model = build(p["layers"], "cpu")
    manager = ft.get_offload_manager("profiler")
    manager.set_memory_budget(p["budget"])
    ft.offload(model, config(), name="profiler")
    with torch.no_grad():
        for _ in range(manager.iters_before_inference + 1):
            model(inputs(4).to(device()))
    manager.wait_for_host_blocks()
    ft.save_profile(p["profile"], name="profiler")
    usage = manager.get_gpu_memory_usage()
    ft.release("profiler", preserve_model=False)
    emit(resident=usage.resident_bytes, blocks=usage.block_bytes)


def worker_session(p: dict) -> None:
    """Step 2, one worker: adopt, measure a pass, then commands on stdin (module docstring)."""
    import torch

    import flextensor as ft
    from mlp_stack import build, build_meta, inputs

    dev = device()
    if dev.type == "cuda":
        torch.ones(1, device=dev).sum().item()  # the CUDA context: before the baselines below
    before_pss, before_alloc = pss_bytes(), allocated()
    x = inputs(p["batch"])
    with ft.SharedOffloadSession(p["namespace"], wait_timeout=600.0) as session:
        model = session.offload_from_profile(p["profile"], config=config(), name=MANAGER,
                                             creator_model_factory=lambda: build(p["layers"], "cpu"),
                                             follower_model_factory=lambda: build_meta(p["layers"]))
        with torch.no_grad():
            first = model(x.to(dev)).cpu()
        synchronize()
        usage = ft.get_gpu_memory_usage(MANAGER)
        emit(role=session.role(MANAGER), pss_before=before_pss, held_by_model=allocated() - before_alloc,
             resident=usage.resident_bytes, blocks=usage.block_bytes)
        for line in sys.stdin:
            command = line.strip()
            if command == "sleep":
                held = allocated()
                start = time.perf_counter()
                ft.sleep(MANAGER)
                seconds = time.perf_counter() - start
                emit(sleep_s=seconds, allocated_before=held, allocated_after=allocated(),
                     model_before=held - before_alloc)
            elif command == "pss":
                emit(pss=pss_bytes())
            elif command == "update":
                new = build(p["layers"], "cpu").state_dict()
                for tensor in new.values():
                    tensor.mul_(0.5)  # in place: host RAM holds the shared copy and one new one
                expected = plain_output(new, p["layers"], x, dev)
                torch.save(expected, p["expected"])
                update = session.update_weights(new, name=MANAGER)
                emit(update_s=update.seconds, gbps=update.gbps, nbytes=update.nbytes, version=update.version,
                     complete=update.complete)
            elif command == "wake":
                start = time.perf_counter()
                ready = ft.get_offload_manager(MANAGER).wake_ready(timeout=p["timeout"])  # the sleep's preparation
                ready_wait_s = time.perf_counter() - start
                start = time.perf_counter()
                ft.wake(MANAGER)
                synchronize()
                seconds = time.perf_counter() - start
                with torch.no_grad():
                    out = model(x.to(dev)).cpu()
                expected = torch.load(p["expected"]) if os.path.exists(p["expected"]) else first
                emit(wake_s=seconds, wake_ready=ready, ready_wait_s=ready_wait_s, equal=close_to(out, expected),
                     version=session.weights_version(MANAGER),
                     allocated=allocated() - before_alloc)
            elif command == "close":
                break
    emit(closed=True)


def pinned_rate(nbytes: int) -> float:
    """Pinned host-to-device GB/s: ``nbytes`` copied 3 times, the fastest."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    dev = torch.empty_like(host, device=device())
    best = float("inf")
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def worker_baseline(p: dict) -> None:
    """Step 3: a vLLM-style worker: the model on the device, a private pinned copy while it sleeps."""
    import torch

    from mlp_stack import build, inputs

    dev = device()
    if dev.type == "cuda":
        torch.ones(1, device=dev).sum().item()
    rate = pinned_rate(min(1 << 30, p["model_bytes"]))
    before_pss, before_alloc = pss_bytes(), allocated()
    model = build(p["layers"], dev.type)
    params = list(model.parameters())
    x = inputs(p["batch"]).to(dev)
    with torch.no_grad():
        first = model(x).cpu()
    out: dict = {"pinned_gbps": rate, "held_by_model": allocated() - before_alloc, "cycles": []}
    for _ in range(2):
        synchronize()
        held = allocated()
        start = time.perf_counter()
        backups = []
        for param in params:  # what level 1 does: a pinned CPU copy per allocation, then the device memory goes
            backup = torch.empty(param.shape, dtype=param.dtype, pin_memory=dev.type == "cuda")
            backup.copy_(param.data, non_blocking=True)
            backups.append(backup)
        synchronize()
        for param in params:
            param.data = torch.empty(0, dtype=param.dtype, device=dev)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        sleep_s = time.perf_counter() - start
        asleep = allocated()
        pss_asleep = pss_bytes()
        start = time.perf_counter()
        for param, backup in zip(params, backups):
            param.data = backup.to(dev, non_blocking=True)
        synchronize()
        wake_s = time.perf_counter() - start
        del backups
        with torch.no_grad():
            equal = close_to(model(x), first)
        out["cycles"].append(dict(sleep_s=sleep_s, wake_s=wake_s, allocated_before=held, allocated_after=asleep,
                                  pss_growth=pss_asleep - before_pss, equal=equal))
    new = {name: t.detach().to("cpu") * 0.5 for name, t in model.state_dict().items()}
    synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        for name, param in model.named_parameters():  # each worker loads the new state dict into its weights
            param.copy_(new[name])
    synchronize()
    out["load_s"] = time.perf_counter() - start
    with torch.no_grad():
        out["load_equal"] = close_to(model(x), plain_output(new, p["layers"], inputs(p["batch"]), dev))
    emit(**out)


def worker_main(mode: str, raw: str) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{mode} {os.getpid()}] %(asctime)s %(name)s: %(message)s")
    params = json.loads(raw)
    use_dims(*params["dims"])
    try:
        {"profile": worker_profile, "session": worker_session, "baseline": worker_baseline}[mode](params)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        emit(error=f"{type(exc).__name__}: {exc}")
        raise


# ================================================================================================================
# Parent side
# ================================================================================================================


def _worker(mode: str, params: dict) -> JsonLineWorker:
    return JsonLineWorker(__file__, mode, params)


def run_size(size: float, args: argparse.Namespace, tmp: Path) -> dict:
    """Steps 1-3 for one size; the raw measures."""
    import mlp_stack

    use_dims(*args.dims)
    layers = max(2, round(size * 2**30 / mlp_stack.BLOCK_BYTES))
    model_bytes = layers * mlp_stack.BLOCK_BYTES
    common = {"dims": list(args.dims), "layers": layers, "batch": args.batch}
    profile = str(tmp / f"profile-{layers}")
    shutil.rmtree(profile, ignore_errors=True)
    out: dict = {"size_gib": size, "layers": layers, "model_bytes": model_bytes, "workers": args.workers}
    prof = _worker("profile", {**common, "profile": profile, "budget": model_bytes // 2})
    out["profile"] = prof.read(args.timeout)
    prof.proc.wait()
    namespace = f"sleep{uuid.uuid4().hex[:10]}"
    params = {**common, "profile": profile, "namespace": namespace, "expected": str(tmp / f"expected-{layers}.pt"),
              "timeout": args.timeout}
    workers: list[JsonLineWorker] = []
    try:
        for _ in range(args.workers):  # one after the other, each asleep before the next attaches
            worker = _worker("session", params)
            workers.append(worker)
            ready = worker.read(args.timeout)
            worker.send("sleep")
            ready.update(worker.read(args.timeout))
            out.setdefault("ready", []).append(ready)
        for worker in workers:
            worker.send("pss")
        out["pss_asleep"] = [w.read(args.timeout)["pss"] for w in workers]
        workers[0].send("update")
        out["update"] = workers[0].read(args.timeout)
        for worker in workers:
            worker.send("wake")
            out.setdefault("woken", []).append(worker.read(args.timeout))
            worker.send("sleep")  # the next one's wake has the device to itself
            worker.read(args.timeout)
        for worker in workers:
            worker.send("close")
            worker.read(args.timeout)
            worker.proc.wait(args.timeout)
    finally:
        for worker in workers:
            worker.kill()
        cleanup_namespace(namespace, MANAGER, timeout=5)
    base = _worker("baseline", {**common, "model_bytes": model_bytes})
    out["baseline"] = base.read(args.timeout)
    base.proc.wait()
    return out


GOALS = [
    "GPU memory freed by sleep(): >= 95% of what the model held, in <= 50 ms",
    "wake() <= resident bytes / pinned rate + 50 ms",
    "host RAM, 4 workers asleep: sum of PSS / model <= 1.10x",
    "update_weights, whole model: >= 8 GB/s into the shared copy, one write per host",
]


def rows_for(r: dict) -> list[list[str]]:
    size = f"{r['size_gib']:g} GiB"
    if "error" in r:
        return [[size, "error: " + r["error"][:160], "", ""]]
    model = r["model_bytes"]
    b = r["baseline"]
    rate = b["pinned_gbps"]
    sleeps = r["ready"]
    freed = min((s["allocated_before"] - s["allocated_after"]) / max(s["model_before"], 1) for s in sleeps)
    sleep_ms = max(s["sleep_s"] for s in sleeps) * 1e3
    resident = max(s["resident"] for s in sleeps)
    wake_ms = max(w["wake_s"] for w in r["woken"]) * 1e3
    bound_ms = resident / (rate * 1e9) * 1e3 + 50
    pss = sum(r["pss_asleep"])
    growth = pss - sum(s["pss_before"] for s in sleeps)
    c1, c2 = b["cycles"]
    base_freed = (c2["allocated_before"] - c2["allocated_after"]) / max(b["held_by_model"], 1)
    upd = r["update"]
    workers = r["workers"]
    registered = ""
    if all("wake_ready" in w for w in r["woken"]):
        registered = (f"; {sum(bool(w['wake_ready']) for w in r['woken'])} of {len(r['woken'])} from the registered "
                      f"copy (waited {max(w['ready_wait_s'] for w in r['woken']):.2f} s for it at most)")
    return [
        [size, "sleep(): GPU memory freed, time (slowest worker)",
         f"{freed:.1%} in {sleep_ms:.1f} ms",
         f"{base_freed:.1%} in {c1['sleep_s'] * 1e3:.0f} / {c2['sleep_s'] * 1e3:.0f} ms (1st / 2nd cycle)"],
        [size, "wake(): time; resident bytes / pinned rate + 50 ms",
         f"{wake_ms:.0f} ms; bound {bound_ms:.0f} ms ({resident / 2**30:.2f} GiB at {rate:.1f} GB/s)"
         + registered,
         f"{c1['wake_s'] * 1e3:.0f} / {c2['wake_s'] * 1e3:.0f} ms ({b['held_by_model'] / 2**30:.2f} GiB)"],
        [size, f"host RAM, {workers} workers asleep: sum of PSS / model (growth over their start)",
         f"{pss / model:.2f}x ({growth / model:.2f}x)",
         f"{workers} x {c2['pss_growth'] / model:.2f}x = {workers * c2['pss_growth'] / model:.2f}x (one measured)"],
        [size, "new weights: rate, bytes written per host",
         f"{upd['gbps']:.1f} GB/s ({upd['update_s']:.2f} s), {upd['nbytes'] / 2**30:.2f} GiB once",
         f"{model / b['load_s'] / 1e9:.1f} GB/s per worker ({b['load_s']:.2f} s), "
         f"{workers * model / 2**30:.2f} GiB ({workers} loads)"],
        [size, "outputs equal: after wake, after the update / baseline after wake, after its load",
         "yes" if all(w["equal"] for w in r["woken"]) else "NO",
         "yes" if c1["equal"] and c2["equal"] and b["load_equal"] else "NO"],
    ]


def sections_for(data: dict) -> list[tuple[str, str]]:
    rows = [row for r in data["runs"] for row in rows_for(r)]
    headers = ["model", "measure", "shared host copy (sleep / wake / update_weights)",
               "per-process copies (vLLM level 1 style)"]
    note = ("Goals: " + "; ".join(GOALS) + ". The model's GPU memory is what its process allocated beyond the "
            "CUDA context; the pinned rate is measured in the baseline's process of the same run.")
    return [("Sleep, wake and new weights of a sharing group", note + "\n\n" + table(headers, rows))]


def run(args: argparse.Namespace) -> None:
    data: dict = {"runs": []}
    tmp = Path(tempfile.mkdtemp(prefix="ft-sleep-"))
    partial = RESULTS_DIR / f"{NAME}.partial.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    try:
        for size in args.sizes:
            try:
                result = run_size(size, args, tmp)
            except Exception as exc:  # noqa: BLE001 - this size failed; the others still run
                result = {"size_gib": size, "error": f"{type(exc).__name__}: {exc}"}
            data["runs"].append(result)
            partial.write_text(json.dumps(data, indent=2))
            print(json.dumps(result)[:2000], flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(NAME, "Sleep, wake and new weights", sections_for(data), data, docs=not args.no_docs)
    if any("error" in r for r in data["runs"]):
        raise SystemExit(1)


def docs_from(paths: list[str]) -> None:
    """Merge saved results (``bench_sleep.json`` of each device run) into docs/benchmarks.md, in the order given."""
    merged: dict = {"runs": []}
    saved = [json.loads(Path(path).read_text()) for path in paths]
    if len({d["machine"].partition(", ")[2] for d in saved}) != 1:
        raise SystemExit("--docs-from: the runs come from several machines; merge runs of one machine only")
    for d in saved:
        merged["runs"] += d["runs"]
    print(f"wrote {write_docs_section(NAME, docs_body(sections_for(merged), machine=saved[0]['machine']))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=[6, 24])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="a small model on the CPU (the test suite's run)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--docs-from", nargs="+", metavar="JSON")
    p.add_argument("--worker", nargs=2, metavar=("MODE", "PARAMS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    if args.docs_from:
        docs_from(args.docs_from)
        return
    import mlp_stack

    args.dims = QUICK_DIMS if args.quick else (mlp_stack.D, mlp_stack.H)
    if args.quick:
        args.sizes = [s for s in args.sizes if s < 0.1] or [0.004]
    run(args)


if __name__ == "__main__":
    main()
