"""Benchmark of how flextensor's costs grow with the model: ``--sizes`` GiB (default 6, 24 and 48) on one host.

Why: bench_session measures one small model; costs that grow faster than the bytes (or run far below memory
speed) only show at the sizes users run. Per size, in fresh processes (the parent holds no weights and no device
context), with the bench_session set-up (``models.BenchTransformer``, every ``DecoderBlock`` a trap) and
``max_gpu_mem_fraction`` (default 0.05, so a large model keeps part of itself resident and streams the rest):

1. **Fresh profile**, one process, as a user makes one: the model built on the device from a seed, a resident
   reference output, the weights moved to host memory (as a checkpoint loaded on the CPU gives them; a model the
   device cannot hold is built in host RAM instead: see "Sizes beyond the device"), then
   ``ft.offload()`` (timed) and the ``iters_before_inference`` passes (each timed,
   synchronized; the last one includes the switch to INFERENCE), ``ft.save_profile``. The phase's overhead beyond
   its passes is ``offload()`` plus the passes' sum minus as many median passes; a cProfile of that process's
   ``offload()`` and passes is written beside the results (``cprofile-setup-<GiB>.txt``) to show where it goes.
2. **A sharing group** of ``--workers`` (default 4) processes on that profile, as bench_session runs them: the
   creator (its factory rebuilds the same model in host RAM, the way the set-up built it; the factory is not
   part of the publish) publishes, while one follower started once the creator was
   elected builds its model and waits (its time from READY to ready is what that wait did not hide; the two run
   their first forwards only once both are ready, one after the other, as workers on GPUs of their own would
   not share a link); then the followers start together, after READY, so their whole time to ready is after
   READY; each runs one forward (checked against the reference), then all ``close()`` at once and exit right
   after; then one more follower joins alone (the same measures without contention), closes and exits; the
   creator closes last. Once every process is gone, ``/dev/shm`` must hold nothing of the namespace.

Reported per size, each cost also per GiB of the model, so growth faster than the bytes shows as a per-GiB
column that rises with the size: ``offload()``, the passes, the overhead, the creator's publish (and its rate),
a follower's time to ready and its resident copy (bytes, rate), its first forward and background registration,
``close()`` and the exit after it, leftovers; a follower's steps to ready (join, maps, device blocks, resident
copy, validate, install, adopt) and its staging ring's parts, also printed per follower as each size ends. Goals
per size: a follower ready after READY within ``resident bytes / 40 GB/s + 0.1 s`` (alone, and the worst of those
started together: they share one GPU's host link) and its ``close()`` <= 0.5 s; at 24 GiB the creator's
publish >= 16 GB/s; nothing left in ``/dev/shm``. Two host-side sections run once, without the GPU
(``shm_rates.py``): how fast this host allocates shared-memory pages (the bound of publishing a model built in
RAM) against a plain copy, and a follower's reads of a segment into its staging ring (``pread`` from the file
against ``memmove`` from the pre-faulted mapping), one process alone and ``--workers - 1`` together.

Sizes beyond the device: when the model's bytes exceed the device's free memory less 4 GiB
(``models.fits_on_device``, asked by the set-up process, which has the GPU to itself), or at every size with
``--host-build`` (any device, the CPU included), the set-up and the creator's factory build the model in host RAM
with ``models.build_model_in_host_ram``: made on ``meta``, then one piece (embedding, ``DecoderBlock``, norm, head)
at a time drawn on the device from the same seeded generator in the same order, moved to the host and dropped
from the device, so the weights are those of the whole build and the host holds one copy of the model. Its
reference output runs one piece on the device at a time (``models.layerwise_forward``), equal to the whole
forward. Nothing else in either process keeps a copy (the reference is one output, the profile a plan): the
set-up process's and the creator's peak RSS (``VmHWM``, against their RSS at the start) are printed per size and
tabled, and should stay near 1.0x the model.

The 96 GiB row (``--sizes 96 --host-build``: on an 80 GiB GPU the flag changes nothing, on a larger one it keeps
the same build) needs:

- host RAM for the model once plus a few GiB (the set-up process and the group run one after the other; the
  set-up holds the model and its host blocks, which replace it one by one; the group holds the shared copy in
  ``/dev/shm``, the creator's window of pages ahead of its copy, and each worker's runtime): about 100 GiB;
- a ``/dev/shm`` of at least the model plus 2 GiB (the shared copy is the model's bytes; the rest is metadata);
- a few minutes (about 4 to 5 on a 16-core host with one 80 GiB GPU, estimated from the 48 GiB row; the table's
  "wall" row has the measured split): each build streams the model through the device once (set-up and
  creator), the reference once more, the set-up's memory mode profiles with its passes over the streamed blocks and
  builds its host blocks behind them, every forward in the group streams the model, and each process that
  mapped it takes seconds to exit. ``--tmpfs-gib 0 --reads-gib 0`` skip the host-side sections, and
  ``--docs-section bench_scale_96`` keeps the 6/24/48 GiB section as it is.

Robustness: each size runs on its own; a failing size is reported (its error, and what it measured before) and
the next still runs. Raw results are written after every size (``bench_scale.partial.json`` in the results
directory, ``$OUT`` under ``scripts/gpu-suite.sh``), the Markdown body too (``bench_scale.md``); the full report at
the end goes to ``bench_scale.json`` and, for a GPU run without ``--no-docs``, into docs/benchmarks.md (section
``--docs-section``, default ``bench_scale``; the JSON is named after it too). ``--docs-from FILE`` puts a saved
``bench_scale.md`` into that section (a run on another machine).

Run: ``scripts/gpu-suite.sh bench bench_scale --sizes 6 24 48`` (H200 host, about 5 minutes), the 96 GiB row
with ``scripts/gpu-suite.sh bench bench_scale --sizes 96 --host-build --tmpfs-gib 0 --reads-gib 0 --docs-section
bench_scale_96``, or ``python bench/bench_scale.py --quick [--host-build]`` (CPU, small sizes: checks the paths,
not the speed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RESULTS_DIR, JsonLineWorker, cleanup_namespace, close_together, gib, loaded_then_wait, namespace_leftovers,
    proc_status, report, report_close, start_together, table, write_cprofile, write_docs_section,
)
from scale_report import build_sections, host_memory_line, print_phases, save_partial  # noqa: E402
from shm_rates import READ_HEADERS, follower_read_rates, read_rows, tmpfs_rates  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from models import ModelSpec

MANAGER = "scale"
GIB = 1 << 30


@dataclass
class Params:
    """Everything a worker needs, passed as one JSON argument."""

    spec: dict
    device: str
    dtype: str
    profile_dir: str
    reference: str
    batch: int
    seq: int
    fraction: float | None
    discovery: bool
    profiling_iters: int
    gib: float
    namespace: str = ""
    wait_timeout: float = 300.0
    cprofile: bool = True
    #: Once ready, report the "ready" stage and run the first forward only on "forward" (see run_group).
    hold_forward: bool = False
    #: Build the model in host RAM one piece at a time on the device (True), whole on the device (False), or as
    #: the set-up finds: in host RAM when the device cannot hold it (None; the group gets the set-up's choice).
    host_build: bool | None = None


# ================================================================================================================
# Worker side (``bench_scale.py --worker MODE PARAMS_JSON``)
# ================================================================================================================


def _torch_env(p: Params):
    from models import worker_env

    return worker_env(p.device, p.dtype, p.spec)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(p: Params, device):
    import flextensor as ft

    from models import BLOCK_PATTERN

    return ft.OffloadConfig(include_patterns=[BLOCK_PATTERN], pinned_memory=device.type == "cuda",
                            skip_discovery=not p.discovery, profiling_iters=p.profiling_iters,
                            max_gpu_mem_fraction=p.fraction if device.type == "cuda" else None)


def _max_diff(p: Params, out) -> float:
    from safetensors.torch import load_file

    return float((out.float().cpu() - load_file(p.reference)["out"]).abs().max())


def _top_functions(profiler, path: str, count: int = 12) -> list[list]:
    """The profile by cumulative time into ``path``; the top ``count`` entries as [function, calls, cum s, own s]."""
    stats = write_cprofile(profiler, path)
    entries = stats.stats.items()  # type: ignore[attr-defined]
    ours = sorted((kv for kv in entries if f"{os.sep}flextensor{os.sep}" in kv[0][0]), key=lambda kv: kv[1][3],
                  reverse=True)[:count]  # flextensor's functions by cumulative time
    own = sorted(entries, key=lambda kv: kv[1][2], reverse=True)[:count // 2]  # anything by its own time
    rows = dict([*ours, *own])  # keyed by function: one row each, in that order
    return [[f"{os.path.basename(k[0])}:{k[1]}({k[2]})", v[1], round(v[3], 3), round(v[2], 3)]
            for k, v in rows.items()]


def _host_model(p: Params, torch, device, dtype, spec):
    """The model with its weights in host RAM, as a checkpoint loaded on the CPU gives them: built one piece at a
    time on the device when ``p.host_build``, else whole on the device and moved."""
    from models import build_model, build_model_in_host_ram

    if p.host_build:
        return build_model_in_host_ram(spec, device, dtype, seed=0)
    model = build_model(spec, device, dtype, seed=0).to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model


def _build_with_reference(p: Params, torch, device, dtype, spec, tokens):
    """The model in host RAM, its output saved as the reference; returns (model, build seconds, reference
    seconds). Built whole on the device, the reference is its resident forward before the move to the host (the
    move counts as build); built in host RAM (``p.host_build``), it runs one piece on the device at a time
    (``models.layerwise_forward``, equal to the whole forward)."""
    from safetensors.torch import save_file

    from models import build_model, build_model_in_host_ram, layerwise_forward

    begin = time.perf_counter()
    if p.host_build:
        model = build_model_in_host_ram(spec, device, dtype, seed=0)
    else:
        model = build_model(spec, device, dtype, seed=0)
    build_s = time.perf_counter() - begin
    begin = time.perf_counter()
    with torch.no_grad():
        out = layerwise_forward(model, tokens, device) if p.host_build else model(tokens)
        save_file({"out": out.float().cpu()}, p.reference)
    reference_s = time.perf_counter() - begin
    begin = time.perf_counter()
    if not p.host_build:
        model.to("cpu")  # the weights come from host memory, as from a checkpoint loaded on the CPU
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine's budget starts from a device that holds nothing of the model
    build_s += time.perf_counter() - begin
    return model, build_s, reference_s


def worker_setup(p: Params) -> dict:
    """Build, reference, fresh profile (timed), save the profile; report the plan's sizes, where the model was
    built and the process's peak RSS (one copy of the model, whatever the build)."""
    torch, device, dtype, spec = _torch_env(p)
    import flextensor as ft

    from models import fits_on_device, make_tokens

    info: dict = {"rss_start": proc_status("VmRSS")}
    if p.host_build is None:
        p = Params(**{**asdict(p), "host_build": not fits_on_device(spec.total_bytes(dtype), device)})
    tokens = make_tokens(spec, p.batch, p.seq, device)
    model, info["build_s"], info["reference_s"] = _build_with_reference(p, torch, device, dtype, spec, tokens)
    info.update(host_build=p.host_build, rss_built=proc_status("VmRSS"))
    profiler = None
    if p.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    proxy = ft.offload(model, config=_config(p, device), name=MANAGER)
    _sync(torch, device)
    info["offload_s"] = time.perf_counter() - start
    manager = ft.get_offload_manager(MANAGER)
    passes = []
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            begin = time.perf_counter()
            proxy(tokens)
            _sync(torch, device)
            passes.append(time.perf_counter() - begin)
    if profiler is not None:
        profiler.disable()
        info["cprofile_top"] = _top_functions(profiler, str(RESULTS_DIR / f"cprofile-setup-{p.gib:g}.txt"))
    info["passes_s"] = passes
    start = time.perf_counter()
    manager.wait_for_host_blocks()
    info["host_blocks_wait_s"] = time.perf_counter() - start
    with torch.no_grad():
        begin = time.perf_counter()
        out = proxy(tokens)
        _sync(torch, device)
        info["first_inference_s"] = time.perf_counter() - begin
    info["max_abs_diff"] = _max_diff(p, out)
    ft.save_profile(p.profile_dir, name=MANAGER)
    info["vmhwm"] = proc_status("VmHWM")
    ft.release(MANAGER, preserve_model=False)
    from flextensor.profiles import read_profile

    state = read_profile(p.profile_dir)
    info.update(
        tensors=len(state.tensors), blocks=len(state.blocks), strategy=state.strategy,
        resident_bytes=sum(t.nbytes for t in state.tensors if not t.offloaded),
        streamed_bytes=sum(t.nbytes for t in state.tensors if t.offloaded),
    )
    return info


def worker_session(p: Params):
    """Join the sharing group: creator (factory: the model in host RAM) or follower (meta model)."""
    torch, device, dtype, spec = _torch_env(p)
    import flextensor as ft

    from models import build_meta_model, make_tokens

    ft.SharedOffloadSession, ft.OffloadConfig  # resolve the lazy imports before the clock starts
    loaded_then_wait()
    info: dict = {"role": "follower", "factory_s": 0.0, "rss_start": proc_status("VmRSS")}

    def creator_factory():
        info["role"] = "creator"
        begin = time.perf_counter()
        model = _host_model(p, torch, device, dtype, spec)
        info["factory_s"] = time.perf_counter() - begin
        return model

    config = _config(p, device)
    session = ft.SharedOffloadSession(p.namespace, wait_timeout=p.wait_timeout)
    start = time.perf_counter()
    proxy = session.offload_from_profile(p.profile_dir, config=config, name=MANAGER,
                                         creator_model_factory=creator_factory,
                                         follower_model_factory=lambda: build_meta_model(spec, dtype))
    returned = time.perf_counter()
    idle = device.type != "cuda" or torch.cuda.current_stream(device).query()
    _sync(torch, device)
    synced = time.perf_counter()
    info.update(ready_s=(returned if idle else synced) - start, ready_synced_s=synced - start,
                device_idle_at_return=idle)
    info["publish_s"] = info["ready_s"] - info["factory_s"] if info["role"] == "creator" else None
    if p.hold_forward:
        print(json.dumps({"stage": "ready"}), flush=True)
        if sys.stdin.readline().strip() != "forward":
            raise SystemExit("parent went away before 'forward'")
    tokens = make_tokens(spec, p.batch, p.seq, device)
    begin = time.perf_counter()
    with torch.no_grad():
        out = proxy(tokens)
    _sync(torch, device)
    info["first_forward_s"] = time.perf_counter() - begin
    info["max_abs_diff"] = _max_diff(p, out)
    info["vmhwm"] = proc_status("VmHWM")  # the factory's model, the publish and a forward: one copy at most
    share = session.report()[0]
    # From READY (as this process saw it) to ready: the whole time for a follower started after READY; for one
    # started before, what its wait for READY (on the attach thread, beside its factory) did not hide.
    steps = share["steps"]
    info["after_ready_s"] = info["ready_s"] - sum(steps.get(k, 0.0) for k in ("join", "daemon", "wait"))
    info.update(wait_s=share["wait_s"], register_s=share["register_s"], registered=share.get("registered"),
                register_wait_s=share.get("register_wait_s"), shared_bytes=share["shared_bytes"],
                steps=share["steps"], publish=share.get("publish"), resident_copy=share.get("resident_copy"))
    return info, session


def worker_main(mode: str, raw: str) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[{mode} {os.getpid()}] %(asctime)s %(name)s: %(message)s")
    p = Params(**json.loads(raw))
    session = None
    try:
        if mode == "setup":
            print(json.dumps(worker_setup(p)), flush=True)
            return
        info, session = worker_session(p)
        print(json.dumps(info), flush=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which records the size as failed
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        traceback.print_exc()
        if session is not None:
            session.close()
        raise SystemExit(3)
    if sys.stdin.readline().strip() == "close":
        report_close(session)
    else:
        session.close()
    # The process exits now, as a worker that shuts down right after close() would.


# ================================================================================================================
# Parent side
# ================================================================================================================


class Worker(JsonLineWorker):
    """One child process speaking the JSON-line protocol above."""

    def __init__(self, mode: str, params: Params) -> None:
        super().__init__(__file__, mode, asdict(params))


def leftovers(namespace: str) -> list[str]:
    return namespace_leftovers(namespace, MANAGER)


def run_setup(params: Params, timeout: float) -> dict:
    worker = Worker("setup", params)
    try:
        return worker.read(timeout)
    finally:
        try:
            worker.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            worker.kill()


def wait_for_election(namespace: str, timeout: float) -> None:
    """Return once a worker of ``namespace`` has made the manager's coordinator (the election is under way)."""
    from flextensor.shm.names import coordinator_segment_name, manager_namespace
    from flextensor.shm.segment_dir import segment_path

    path = segment_path(coordinator_segment_name(manager_namespace(namespace, MANAGER)))  # FT_SHM_DIR, or /dev/shm
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker made {path} within {timeout:.0f} s")
        time.sleep(0.005)


def _read_ready(worker: Worker, timeout: float) -> None:
    """Wait for a held worker's "ready" stage (``Params.hold_forward``)."""
    stage = worker.read(timeout)
    if stage.get("stage") != "ready":
        raise RuntimeError(f"session worker {worker.proc.pid}: expected the 'ready' line, got {stage}")


def run_group(params: Params, workers: int, timeout: float, out: dict) -> None:
    """Creator with one follower started before READY, followers together, closes, one follower alone, the
    creator's close; results into ``out``."""
    params = Params(**{**asdict(params), "namespace": f"scale{uuid.uuid4().hex[:10]}"})
    started: list[Worker] = []
    try:
        # The creator, and one follower started once the creator is elected: it builds its model while the
        # creator publishes, as a server's workers started together do.
        # Their first forwards wait until both are ready: on this host they share one GPU's link, and the
        # creator's forward (every streamed block over that link) would otherwise run under the follower's
        # resident copy, which a host with a GPU per worker does not see.
        held = Params(**{**asdict(params), "hold_forward": True})
        creator, early = Worker("session", held), Worker("session", held)
        started += [creator, early]
        for w in (creator, early):
            w.read_stage(timeout)
        creator.send("go")
        wait_for_election(params.namespace, timeout)
        early.send("go")
        for w in (creator, early):
            _read_ready(w, timeout)
        creator.send("forward")
        out["creator"] = creator.read(timeout)
        early.send("forward")
        out["early"] = early.read(timeout)
        if out["creator"]["role"] != "creator":  # the early one was elected after all
            out["creator"], out["early"], creator, early = out["early"], out["creator"], early, creator
        (out["early"]["close_s"], out["early"]["exit_s"]), = close_together([early], timeout)
        followers = [Worker("session", params) for _ in range(workers - 1)]
        started += followers
        out["followers"] = start_together(followers, timeout)
        for report_, (close_s, exit_s) in zip(out["followers"], close_together(followers, timeout)):
            report_.update(close_s=close_s, exit_s=exit_s)
        alone = Worker("session", params)
        started.append(alone)
        out["alone"] = start_together([alone], timeout)[0]
        (out["alone"]["close_s"], out["alone"]["exit_s"]), = close_together([alone], timeout)
        (out["creator"]["close_s"], out["creator"]["exit_s"]), = close_together([creator], timeout)
        out["leftovers"] = leftovers(params.namespace)
    finally:
        for w in started:
            w.kill()
        if any(w.proc.returncode not in (0, None) for w in started) or "leftovers" not in out:
            cleanup_namespace(params.namespace, MANAGER, timeout=45.0)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def spec_for(gib_: float, hidden: int, vocab: int, dtype) -> "ModelSpec":
    """The bench model closest to ``gib_`` GiB at this width: as many layers as fit beside embedding and head."""
    from models import ModelSpec

    probe = ModelSpec(hidden=hidden, layers=1, vocab=vocab)
    layer = probe.block_bytes(dtype)
    fixed = probe.total_bytes(dtype) - layer
    return ModelSpec(hidden=hidden, layers=max(1, round((gib_ * GIB - fixed) / layer)), vocab=vocab)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", help="model sizes in GiB (default 6 24 48; --quick 0.25 0.5)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--hidden", type=int, help="model width (default 4096; --quick 512)")
    p.add_argument("--vocab", type=int, help="vocabulary (default 32000; --quick 1024)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--fraction", type=float, default=0.05, help="max_gpu_mem_fraction of the profile and the workers")
    p.add_argument("--profiling-iters", type=int, default=10)
    p.add_argument("--no-discovery", action="store_true", help="skip the discovery pass (default: 1 + profiling)")
    p.add_argument("--host-build", action="store_true",
                   help="build every size in host RAM one block at a time on the device, reference layer by layer "
                        "(default: only a size the device cannot hold; any device, the CPU included)")
    p.add_argument("--no-cprofile", action="store_true", help="no cProfile of the fresh profile's process")
    p.add_argument("--tmpfs-gib", type=float, default=2.0, help="bytes for the /dev/shm page rates (0: skip)")
    p.add_argument("--reads-gib", type=float, default=2.0, help="segment size for the follower reads (0: skip)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one worker may go quiet")
    p.add_argument("--quick", action="store_true", help="small models on the CPU: checks the paths, not the speed")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    p.add_argument("--docs-from", metavar="FILE", help="write a saved bench_scale.md into docs/benchmarks.md, exit")
    p.add_argument("--docs-section", default="bench_scale", metavar="NAME",
                   help="the section of docs/benchmarks.md (and NAME.json) this run writes, so that a run of other "
                        "sizes keeps the default section's (bench_scale_96: the 96 GiB row)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.docs_from:
        with open(args.docs_from) as f:
            print(f"wrote {write_docs_section(args.docs_section, f.read())} (section {args.docs_section})")
        return
    import torch  # the parent never initialises CUDA; it only asks whether there is a device

    from models import default_dtype

    gpu = not args.quick and torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    dtype = default_dtype(device)
    sizes = args.sizes or ([6, 24, 48] if gpu else [0.25, 0.5])
    hidden = args.hidden or (4096 if gpu else 512)
    vocab = args.vocab or (32000 if gpu else 1024)
    data: dict = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "workers": args.workers,
                  "fraction": args.fraction if gpu else None, "sizes": []}
    if args.tmpfs_gib > 0:
        try:
            data["tmpfs"] = tmpfs_rates(int(args.tmpfs_gib * GIB))
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            data["tmpfs_error"] = f"{type(exc).__name__}: {exc}"
        print(f"tmpfs rates: {data.get('tmpfs') or data.get('tmpfs_error')}", flush=True)
    if args.reads_gib > 0:
        try:
            data["reads"] = follower_read_rates(int(args.reads_gib * GIB), args.workers - 1, args.timeout)
            print(table(READ_HEADERS, read_rows(data["reads"])), flush=True)
        except Exception as exc:  # noqa: BLE001 - a diagnostic only
            data["reads_error"] = f"{type(exc).__name__}: {exc}"
            print(f"follower reads failed: {data['reads_error']}", flush=True)
    for size in sizes:
        spec = spec_for(size, hidden, vocab, dtype)
        r: dict = {"gib": size, "spec": spec.to_dict(), "model_bytes": spec.total_bytes(dtype)}
        data["sizes"].append(r)
        workdir = tempfile.mkdtemp(prefix=f"ftbench-scale-{size:g}-")
        begin = time.monotonic()
        try:
            params = Params(spec=spec.to_dict(), device=str(device), dtype=data["dtype"],
                            profile_dir=os.path.join(workdir, "profile"),
                            reference=os.path.join(workdir, "reference.safetensors"), batch=1, seq=args.seq,
                            fraction=data["fraction"], discovery=not args.no_discovery,
                            profiling_iters=args.profiling_iters, gib=size, cprofile=not args.no_cprofile,
                            wait_timeout=args.timeout, host_build=True if args.host_build else None)
            print(f"[{size:g} GiB] set-up and fresh profile: {gib(r['model_bytes'])}, {spec.layers} layers", flush=True)
            r["setup"] = run_setup(params, args.timeout)
            r["setup_wall_s"] = time.monotonic() - begin
            shown = {k: v for k, v in r["setup"].items() if k != "cprofile_top"}
            print(f"[{size:g} GiB] set-up done: {json.dumps(shown)}", flush=True)
            print(f"[{size:g} GiB] {host_memory_line(r, 'setup')}", flush=True)
            params = Params(**{**asdict(params), "host_build": r["setup"]["host_build"]})  # the creator's build
            r["group"] = {}
            print(f"[{size:g} GiB] sharing group of {args.workers}", flush=True)
            run_group(params, args.workers, args.timeout, r["group"])
            r["group_wall_s"] = time.monotonic() - begin - r["setup_wall_s"]
            print(f"[{size:g} GiB] {host_memory_line(r, 'creator')}", flush=True)
            print_phases(r)
        except Exception as exc:  # noqa: BLE001 - this size failed; the next one still runs
            r["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{size:g} GiB] FAILED: {r['error']}", flush=True)
            traceback.print_exc()
        finally:
            r["wall_s"] = time.monotonic() - begin
            shutil.rmtree(workdir, ignore_errors=True)
            save_partial(data)
            print(f"[{size:g} GiB] done in {r['wall_s']:.0f} s; partial results in {RESULTS_DIR}", flush=True)
    report(args.docs_section, "Growth with the model size", build_sections(data), data,
           docs=gpu and not args.no_docs)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main()
