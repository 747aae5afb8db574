"""Benchmark of ``SharedOffloadSession``: N workers, one host copy of the weights.

What is measured, and why:

1. Host RAM. N = 1, 2, 4, 8 worker processes each open ``ft.SharedOffloadSession(ns)`` and call
   ``offload_from_profile`` on the same model (default ~1.6 GiB) from a profile made once beforehand. While all
   of them hold their model (each has run one forward pass), the parent reads every worker's PSS from
   ``/proc/<pid>/smaps_rollup`` and subtracts the PSS of an idle worker running beside them (same imports, same
   device initialisation, a private ``ft.offload`` of a one-layer model: what any worker costs without the
   weights). Goal: the sum of PSS growth is <= 1.05x the model bytes, plus, on a CPU host, every worker's
   rotating device blocks (host memory there; ``get_gpu_memory_usage().block_bytes``).
2. Time to ready. A follower's ``offload_from_profile`` (open, join, meta model, validate, attach, copy resident
   tensors), median and p95 over every follower of every N: the group's n-1 followers, then ``--join-waves``
   (default 2) more waves of n-1 fresh followers joining the same generation at once after the first ones left,
   so the p95 rests on 33 samples rather than 11 with the default ``--workers 1 2 4 8``. The creator starts
   first and the followers only after it is ready, so follower times are attach times, not waits. Goal:
   < 50 ms + 10 us per tensor, excluding resident copies to the GPU: the follower makes them on its attach
   thread while its model factory runs, so only the part the session waited for is excluded
   (``resident_copy_on_critical_path``). The clock stops when ``offload_from_profile`` returns, provided the
   compute stream is idle then (checked with ``Stream.query()``, recorded as ``device_idle_at_return``); else
   after a device synchronize. The synchronized
   time is kept beside it (``ready_synced_s``): a synchronize right after attaching waits behind the first
   background registration, which the first forward pays anyway and which is reported there. Compared
   with what a private worker pays: loading the same weights from the safetensors file into a private host copy
   (``pin_memory()`` on CUDA, ``clone()`` on CPU), measured in 4 concurrent private workers.
   A CUDA follower registers its block mappings in the background (``flextensor.shm.background_pin``), so its
   registration is not in the time to ready; its first forward, which waits for blocks not registered yet, is
   reported beside it, with the creator's first forward for comparison.
3. Creator publish time: the creator's ``offload_from_profile`` minus its checkpoint factory.
4. Forward time of each of 4 workers (one at a time, so they do not share the copy engine, interleaved over 3
   rounds) against a single process offloading the same model privately from the same profile
   (``ft.offload_from_profile``), and each follower's ``cudaHostRegister`` time (``session.report()``).
   Goal: <= 1.02x. Meaningful on the GPU machine; on a CPU host it only checks the path.

Set-up, in a separate process so the parent never holds weights or a device context: build the model from a
seed, write it to a safetensors file, keep a resident output as reference, ``ft.offload`` it with
``NthLayerStrategy(1)`` (every layer streams, so every layer is shared), run ``iters_before_inference``
forwards, ``ft.save_profile``.

Workers report one JSON line on stdout and then wait on stdin for ``forward`` or ``exit``.

Run: ``.venv/bin/python bench/bench_session.py`` (GPU, ~2 min) or ``... --quick`` (CPU, under a minute). A full
run writes its tables into docs/benchmarks.md (``--no-docs`` skips that; a ``--quick`` run never does).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RESULTS_DIR, JsonLineWorker, cleanup_namespace, gib, loaded_then_wait, median, pss_bytes, report, start_together,
    write_cprofile,
)
from session_report import build_sections  # noqa: E402

MANAGER = "bench"


@dataclass
class Params:
    """Everything a worker needs, passed as one JSON argument."""

    spec: dict
    device: str
    dtype: str
    weights: str
    profile_dir: str
    reference: str
    batch: int
    seq: int
    profiling_iters: int
    forward_repeat: int
    namespace: str = ""
    wait_timeout: float = 120.0
    cprofile: bool = False  # followers write a cProfile table of their offload_from_profile next to the results


# ================================================================================================================
# Worker side (runs in a fresh interpreter: ``bench_session.py --worker MODE PARAMS_JSON``)
# ================================================================================================================


def _torch_env(p: Params):
    importlib.import_module("safetensors.torch")  # imported here so no timed region pays for the import

    from models import worker_env

    return worker_env(p.device, p.dtype, p.spec)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(p: Params, device):
    import flextensor as ft

    from models import BLOCK_PATTERN

    return ft.OffloadConfig(
        include_patterns=[BLOCK_PATTERN],
        pinned_memory=device.type == "cuda",
        skip_discovery=True,
        profiling_iters=p.profiling_iters,
        load_strategy=ft.NthLayerStrategy(1),
    )


def _tokens(p: Params, spec, device):
    from models import make_tokens

    return make_tokens(spec, p.batch, p.seq, device)


def _forward_times(torch, device, proxy, tokens, repeat: int) -> list[float]:
    samples = []
    with torch.no_grad():
        for i in range(repeat + 1):
            _sync(torch, device)
            start = time.perf_counter()
            proxy(tokens)
            _sync(torch, device)
            if i:
                samples.append(time.perf_counter() - start)
    return samples


def _max_diff(torch, p: Params, out) -> float:
    from safetensors.torch import load_file

    reference = load_file(p.reference)["out"]
    return float((out.float().cpu() - reference).abs().max())


def _load_private(torch, p: Params, spec, dtype, pin: bool):
    """The weights from the safetensors file into a private host copy, assigned to a meta-built model.

    ``load_file`` returns views of a mapping of the file (shared page cache); a worker that offloads privately
    needs its own host copy, pinned on CUDA, so every tensor is copied out (and the file mapping is dropped).
    """
    from safetensors.torch import load_file

    from models import build_meta_model

    state = {k: (v.pin_memory() if pin else v.clone()) for k, v in load_file(p.weights).items()}
    model = build_meta_model(spec, dtype)
    model.load_state_dict(state, assign=True)
    return model


def worker_setup(p: Params) -> dict:
    """Build the model, save its weights and a resident reference output, profile it once and save the profile."""
    torch, device, dtype, spec = _torch_env(p)
    import flextensor as ft
    from safetensors.torch import save_file

    from models import build_model

    model = build_model(spec, device, dtype, seed=0)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, p.weights)
    tokens = _tokens(p, spec, device)
    with torch.no_grad():
        save_file({"out": model(tokens).float().cpu()}, p.reference)
    proxy = ft.offload(model, config=_config(p, device), name=MANAGER)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(ft.get_offload_manager(MANAGER).iters_before_inference):
            proxy(tokens)
    _sync(torch, device)
    profile_s = time.perf_counter() - start
    ft.save_profile(p.profile_dir, name=MANAGER)
    with torch.no_grad():
        diff = _max_diff(torch, p, proxy(tokens))
    ft.release(MANAGER, preserve_model=False)
    return {"profile_s": profile_s, "max_abs_diff": diff}


def worker_session(p: Params) -> tuple[dict, object]:
    """Join the shared session; report role, time to ready, factory time and output check."""
    torch, device, dtype, spec = _torch_env(p)
    import flextensor as ft

    from models import build_meta_model

    ft.SharedOffloadSession, ft.OffloadConfig  # resolve the lazy imports before the clock starts
    loaded_then_wait()

    info: dict = {"role": "follower", "factory_s": 0.0}

    def creator_factory():
        info["role"] = "creator"
        start = time.perf_counter()
        model = _load_private(torch, p, spec, dtype, pin=False)
        info["factory_s"] = time.perf_counter() - start
        return model

    def follower_factory():
        return build_meta_model(spec, dtype)

    config = _config(p, device)  # the caller's own config, built before the clock starts (as a server would)
    session = ft.SharedOffloadSession(p.namespace, wait_timeout=p.wait_timeout)
    profiler = None
    if p.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    proxy = session.offload_from_profile(
        p.profile_dir, config=config, name=MANAGER,
        creator_model_factory=creator_factory, follower_model_factory=follower_factory,
    )
    returned = time.perf_counter()
    # Time to ready is the call's own time when it left no device work queued (its resident copies are made
    # and synchronized on the attach thread); otherwise it lasts until that work is done.
    info["device_idle_at_return"] = device.type != "cuda" or torch.cuda.current_stream(device).query()
    _sync(torch, device)
    synced = time.perf_counter()
    info["ready_s"] = (returned if info["device_idle_at_return"] else synced) - start
    info["ready_synced_s"] = synced - start  # the same plus a device synchronize (waits behind registration)
    if profiler is not None:
        profiler.disable()
        _write_cprofile(profiler, f"{info['role']}-{p.namespace}-{os.getpid()}")
    info["publish_s"] = info["ready_s"] - info["factory_s"] if info["role"] == "creator" else None
    info["device_block_bytes"] = ft.get_gpu_memory_usage(MANAGER).block_bytes
    tokens = _tokens(p, spec, device)
    start = time.perf_counter()
    with torch.no_grad():  # a follower's first forward may wait for its background block registration
        first = proxy(tokens)
    _sync(torch, device)
    info["first_forward_s"] = time.perf_counter() - start
    info["max_abs_diff"] = _max_diff(torch, p, first)
    for share in session.report():  # the session's own account: role, wait, registration time, shared bytes
        if share["manager"] == MANAGER:
            info.update(role=share["role"], wait_s=share["wait_s"], register_s=share["register_s"],
                        register_wait_s=share.get("register_wait_s"), registered=share.get("registered"),
                        shared_bytes=share["shared_bytes"],
                        steps=share.get("steps", {}))
    return info, (torch, device, session, proxy, tokens)


def _write_cprofile(profiler, tag: str) -> None:
    """The attach's cProfile, by cumulative and by own time, as text under the results directory (and the raw
    ``.prof`` beside it, for ``pstats`` or snakeviz: the text rounds to milliseconds)."""
    write_cprofile(profiler, RESULTS_DIR / f"cprofile-{tag}.txt")
    profiler.dump_stats(str(RESULTS_DIR / f"cprofile-{tag}.prof"))


def worker_private(p: Params) -> tuple[dict, object]:
    """What a worker without sharing pays: its own host copy of the weights from the safetensors file."""
    torch, device, dtype, spec = _torch_env(p)
    loaded_then_wait()
    start = time.perf_counter()
    model = _load_private(torch, p, spec, dtype, pin=device.type == "cuda")
    return {"role": "private", "ready_s": time.perf_counter() - start}, (torch, device, None, model, None)


def worker_single(p: Params) -> tuple[dict, object]:
    """The comparison for forward time: one process offloading the same model privately from the same profile
    (``ft.offload_from_profile``; private host blocks, pinned by the engine on CUDA)."""
    torch, device, dtype, spec = _torch_env(p)
    import flextensor as ft

    model = _load_private(torch, p, spec, dtype, pin=False)
    proxy = ft.offload_from_profile(model, p.profile_dir, config=_config(p, device), name=MANAGER)
    tokens = _tokens(p, spec, device)
    with torch.no_grad():
        diff = _max_diff(torch, p, proxy(tokens))
    return {"role": "single", "max_abs_diff": diff}, (torch, device, None, proxy, tokens)


def worker_idle(p: Params) -> tuple[dict, object]:
    """The PSS baseline: the same imports, device set-up and engine code paths (a private ``ft.offload`` of a
    one-layer model of the same class, profiled and run), so only the weights and sharing differ."""
    torch, device, dtype, spec = _torch_env(p)
    import flextensor as ft

    from models import ModelSpec, build_model, make_tokens

    ft.SharedOffloadSession  # noqa: B018 - the same modules mapped as in the session workers
    tiny = ModelSpec(hidden=spec.head_dim, layers=1, vocab=16, head_dim=spec.head_dim)
    model = ft.offload(build_model(tiny, device, dtype), config=_config(p, device), name="idle")
    tokens = make_tokens(tiny, p.batch, p.seq, device)
    with torch.no_grad():
        for _ in range(ft.get_offload_manager("idle").iters_before_inference + 1):
            model(tokens)
    _sync(torch, device)
    return {"role": "idle"}, (torch, device, None, model, tokens)


def _malloc_trim() -> None:
    """Hand freed heap back to the OS before PSS is read, in every kind of worker alike.

    A checkpoint load frees many medium-sized buffers that glibc keeps in its heap; without this the creator's
    PSS would measure the allocator's caching, not what the worker holds.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def worker_main(mode: str, raw: str) -> None:
    p = Params(**json.loads(raw))
    try:
        if mode == "setup":
            print(json.dumps(worker_setup(p)), flush=True)
            return
        info, (torch, device, session, proxy, tokens) = {
            "session": worker_session, "private": worker_private, "idle": worker_idle, "single": worker_single,
        }[mode](p)
        _malloc_trim()
        print(json.dumps(info), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the benchmark
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        raise
    twin = None
    for line in sys.stdin:  # commands from the parent until "exit" (or EOF)
        if line.strip() == "forward":
            samples = _forward_times(torch, device, proxy, tokens, p.forward_repeat)
            print(json.dumps({"forward_s": median(samples)}), flush=True)
        elif line.strip() == "paired":  # CPU: this worker's forward against a plain twin, pass for pass
            if twin is None:
                _t, _d, dtype, spec = _torch_env(p)
                twin = _load_private(torch, p, spec, dtype, pin=False)
            mine, plain = [], []
            for _ in range(p.forward_repeat):
                mine += _forward_times(torch, device, proxy, tokens, 1)
                plain += _forward_times(torch, device, twin, tokens, 1)
            print(json.dumps({"forward_s": median(mine), "plain_s": median(plain)}), flush=True)
        else:
            break
    if session is not None:
        session.close()


# ================================================================================================================
# Parent side
# ================================================================================================================


class Worker(JsonLineWorker):
    """One child process speaking the JSON-line protocol above."""

    def __init__(self, mode: str, params: Params) -> None:
        super().__init__(__file__, mode, asdict(params))

    def start(self) -> None:
        self.read_stage()
        self.send("go")

    def finish(self, timeout: float = 120.0) -> None:
        """Wait for the worker to exit (it was told to); kill it when it does not within ``timeout``."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def finish_all(workers: list[Worker], failed: bool = False) -> None:
    """Ask every worker to exit at once (closing is concurrent, as in a real shutdown), then reap them.

    After a failure the others may be blocked waiting for a creator that will never publish: kill them (our
    own children, by pid) instead of waiting for their timeout.
    """
    for w in workers:
        if failed:
            w.kill()
        elif w.proc.poll() is None:
            try:
                w.send("exit")
            except BrokenPipeError:
                pass
    for w in workers:
        w.finish()


def time_forwards(workers: list[Worker], reports: list[dict], rounds: int) -> None:
    """Forward time of each worker, one worker at a time (no two share the GPU's copy engine), interleaved over
    ``rounds`` so drift of a shared machine hits every worker alike; the median of the rounds is kept."""
    samples: list[list[float]] = [[] for _ in workers]
    for _ in range(rounds):
        for w, out in zip(workers, samples):
            w.send("forward")
            out.append(w.read()["forward_s"])
    for r, out in zip(reports, samples):
        r["forward_s"] = median(out)


def run_shared(params: Params, n: int, forward: bool, rounds: int = 3, waves: int = 0) -> dict:
    """One sharing group of ``n`` workers (creator first, then n-1 followers at once) plus an idle baseline.

    With ``forward``, after the PSS reading, a single-process private offload of the same model starts beside
    them and every worker's forward is timed against it. Then ``waves`` more times the followers leave and n-1
    fresh ones join the creator's generation at once (``result["waves"]``): more time-to-ready samples under the
    same contention, so that a p95 is not just the largest of a handful."""
    params = Params(**{**asdict(params), "namespace": f"bench{uuid.uuid4().hex[:10]}"})
    workers: list[Worker] = []
    ok = False
    try:
        idle = Worker("idle", params)
        creator = Worker("session", params)
        workers += [idle, creator]
        idle.read()  # the baseline worker is done before anything is timed
        creator.start()
        reports = [creator.read()]
        followers = [Worker("session", params) for _ in range(n - 1)]
        workers.extend(followers)
        reports += start_together(followers)
        baseline = pss_bytes(idle.proc.pid)
        growth = [pss_bytes(w.proc.pid) - baseline for w in [creator, *followers]]
        for r, g in zip(reports, growth):
            r["pss_growth"] = g
        result = {"n": n, "workers": reports, "baseline_pss": baseline, "pss_growth_sum": sum(growth)}
        if forward:
            single = Worker("single", params)
            workers.append(single)
            result["single"] = single.read()
            timed, timed_reports = [single, creator, *followers], [result["single"], *reports]
            time_forwards(timed, timed_reports, rounds)
            if params.device == "cpu":  # CPU workers compute from the shared blocks: held to a plain twin
                for w, report_ in zip([creator, *followers], reports):
                    w.send("paired")
                    paired = w.read()
                    report_["paired_s"], report_["plain_s"] = paired["forward_s"], paired["plain_s"]
        result["waves"] = []
        for _ in range(waves if n > 1 else 0):
            finish_all(followers)  # they close their sessions; the creator keeps the generation READY
            workers = [w for w in workers if w not in followers]
            followers = [Worker("session", params) for _ in range(n - 1)]
            workers.extend(followers)
            result["waves"].append(start_together(followers))
        ok = True
        return result
    finally:
        finish_all(workers, failed=not ok)
        # After killed workers their leases stay valid up to 30 s, hence the longer timeout on the error path.
        cleanup_namespace(params.namespace, MANAGER, timeout=0.0 if ok else 45.0)


def run_private(params: Params, n: int) -> dict:
    """``n`` concurrent workers each loading a private copy from the safetensors file, plus an idle baseline."""
    workers = [Worker("idle", params)] + [Worker("private", params) for _ in range(n)]
    ok = False
    try:
        workers[0].read()
        reports = start_together(workers[1:])
        baseline = pss_bytes(workers[0].proc.pid)
        growth = [pss_bytes(w.proc.pid) - baseline for w in workers[1:]]
        ok = True
        return {"n": n, "ready_s": [r["ready_s"] for r in reports], "pss_growth_sum": sum(growth)}
    finally:
        finish_all(workers, failed=not ok)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model on the CPU: checks the paths, not the speed")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--forward-workers", type=int, default=4, help="group whose forwards are timed one by one")
    p.add_argument("--private-workers", type=int, default=4)
    p.add_argument("--join-waves", type=int, default=2,
                   help="after each group's measurements, this many more waves of n-1 followers join (time to ready)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--profiling-iters", type=int, default=5)
    p.add_argument("--repeat", type=int, default=5, help="forward passes timed per worker")
    p.add_argument("--no-docs", action="store_true",
                   help="do not write the results into docs/benchmarks.md (a --quick run never does)")
    p.add_argument("--cprofile", action="store_true",
                   help="each worker writes a cProfile of its offload_from_profile (cprofile-*.txt and .prof in "
                        "the results directory); the times then include the profiler's overhead")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import torch  # the parent never initialises CUDA; it only asks whether there is a device

    from models import ModelSpec, default_dtype

    gpu = not args.quick and torch.cuda.is_available()
    hidden, layers, vocab, seq = (2048, 24, 8192, 128) if gpu else (512, 8, 1024, 16)
    spec = ModelSpec(hidden=args.hidden or hidden, layers=args.layers or layers, vocab=args.vocab or vocab)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = default_dtype(device)
    workdir = tempfile.mkdtemp(prefix="ftbench-session-")
    try:
        params = Params(
            spec=spec.to_dict(), device=str(device), dtype=str(dtype).replace("torch.", ""),
            weights=os.path.join(workdir, "model.safetensors"), profile_dir=os.path.join(workdir, "profile"),
            reference=os.path.join(workdir, "reference.safetensors"), batch=1, seq=args.seq or seq,
            profiling_iters=args.profiling_iters, forward_repeat=args.repeat, cprofile=args.cprofile,
        )
        r = {"spec": spec.to_dict(), "device": str(device), "dtype": params.dtype, "batch": 1, "seq": params.seq,
             "model_bytes": spec.total_bytes(dtype), "block_bytes": spec.block_bytes(dtype),
             "resident_bytes": spec.total_bytes(dtype) - spec.layers * spec.block_bytes(dtype),
             "tensors": spec.tensor_count()}
        print(f"set-up: model {gib(r['model_bytes'])} on {device}, weights + profile into {workdir}", flush=True)
        setup = Worker("setup", params)
        try:
            r["setup"] = setup.read()
        finally:
            setup.finish()
        r["groups"] = []
        for n in args.workers:
            print(f"shared group of {n} worker(s)", flush=True)
            r["groups"].append(run_shared(params, n, forward=n == args.forward_workers, waves=args.join_waves))
        print(f"{args.private_workers} private workers", flush=True)
        r["private"] = run_private(params, args.private_workers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # A GPU host's run and a CPU host's (where workers compute from the shared blocks in place) keep a section
    # each in docs/benchmarks.md.
    report("bench_session" if gpu else "bench_session_cpu", "SharedOffloadSession benchmark", build_sections(r), r,
           docs=not (args.no_docs or args.quick))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main()
