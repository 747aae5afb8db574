"""Benchmark: N GPUs of one host streaming from ONE shared, registered host copy of the weights at the same time.

Data-parallel replicas run one worker per GPU, and every worker streams its layers from the same pages of host
memory. Whether N copy engines can read one copy at full speed at once (host memory bandwidth, the NUMA placement
of the pages, one ``cudaHostRegister`` per process) is what this run measures. It runs under torchrun, one rank
per GPU: rank i computes on ``cuda:LOCAL_RANK`` through ``OffloadConfig(gpu_device=LOCAL_RANK)``, and
``torch.distributed`` with gloo only orders the phases and gathers the numbers (no NCCL).

1. Set-up, once, in a child process of rank 0 (no rank keeps its weights or device memory): the model is drawn
   from a seed on the device, a resident forward is kept as the reference, ``ft.offload`` profiles it with
   ``NthLayerStrategy(1)`` (every layer streamed: the transfer-bound plan) and ``ft.save_profile`` writes it.
2. Every rank warms up (a private offload of a one-layer model of the same class) and reads its own PSS: its
   baseline. Then all ranks call ``SharedOffloadSession.offload_from_profile`` at once: the elected creator builds
   the model in RAM (drawn on its device from the same seed, moved to the host) and publishes it; the others wait
   for READY and attach. A follower's *ready after READY* is its return minus the creator's (``time.monotonic``
   is one clock for the whole host; the creator publishes READY just before it returns). Every rank runs one
   forward; rank 0 gathers the outputs' hashes (equal on every rank?) and each rank's difference to the resident
   reference.
3. Host RAM: while every rank holds the model, rank 0 reads each rank's PSS. The sum of the growth over each
   rank's baseline is held to 1.05x the model's bytes (on a CPU host plus the rotating blocks, host memory there).
4. Throughput over ``--rounds`` rounds: each rank alone in turn (the others wait on a barrier), then all at once,
   with lead-in and tail passes around the timed ones so that each rank's timed passes run while all the others
   stream. Two loads: the transfer-bound forward (batch 1; GB/s streamed per pass and passes/s) and a raw copy of
   the same blocks from the shared copy to the device, without compute (this path's copy ceiling). Goal per GPU:
   all at once >= 0.9x alone; where not, the forward is held to the host's limit measured in the same run, the
   raw copies of all GPUs at once (forward all at once >= 0.9x the raw copy all at once).
5. Late join (N >= 2): the followers leave, then join the READY generation again, all at once: their call time.
6. Per rank: the devices on which the process holds a CUDA primary context (expected: its own only), how many of
   the host blocks it streams from the driver knows as registered host memory, the GPU's NUMA node and the NUMA
   nodes of the shared copy's pages (where ``/sys`` and ``/proc/self/numa_maps`` tell).

Run::

    torchrun --standalone --nproc-per-node N bench/bench_multi_gpu.py   # a GPU host, one rank per GPU
    python bench/bench_multi_gpu.py --nproc-per-node N                  # the same; starts torchrun itself
    python bench/bench_multi_gpu.py --quick                             # 2 CPU ranks, a small model: paths only

``--current-device set`` (the default) calls ``torch.cuda.set_device(LOCAL_RANK)`` in every rank, as
``examples/torchrun_generate.py`` does; ``keep`` leaves ``cuda:0`` current, so that only ``gpu_device`` routes a
rank's work (the README's quick start), and the contexts column shows whether anything still touched ``cuda:0``.
With more ranks than GPUs, ranks share GPUs (rank i on ``cuda:(i % count)``): every path runs and the host RAM,
time-to-ready and output checks hold as usual, but the throughput goal does not apply. A run with one rank on
each of two or more GPUs writes its tables into docs/benchmarks.md (``--no-docs`` skips that); N=1, shared GPUs
and ``--quick`` print them and save the JSON only. ``--quick`` hides every GPU from its ranks and their set-up
process (``CUDA_VISIBLE_DEVICES=""``, set before torch looks for a device): the engine computes on the device CUDA
offers whenever there is one, so on a GPU host the ranks would otherwise stream to a GPU from CPU inputs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gib, median, pss_bytes, report, table  # noqa: E402
from gpu_probes import gpu_numa_node, primary_contexts, registered_count, shared_pages_by_node  # noqa: E402

NAME = "bench_multi_gpu"
MANAGER = "mgpu"
GOAL_TOGETHER = 0.9
GOAL_PSS = 1.05
GOAL_READY_S = 0.3
LEAD = 2  # untimed passes before and after the timed ones when all ranks stream at once
GPU_SPEC = dict(hidden=4096, layers=22, vocab=32000)  # 5.99 GiB in bfloat16
CPU_SPEC = dict(hidden=512, layers=8, vocab=1024)  # 68 MiB in float32


@dataclass
class Params:
    """What every rank and the set-up process share (rank 0 makes it and broadcasts it)."""

    spec: dict
    dtype: str
    batch: int
    seq: int
    profiling_iters: int
    workdir: str
    namespace: str
    wait_timeout: float

    @property
    def profile_dir(self) -> str:
        return os.path.join(self.workdir, "profile")

    @property
    def reference(self) -> str:
        return os.path.join(self.workdir, "reference.safetensors")


# ================================================================================================================
# Set-up (a child process of rank 0: ``bench_multi_gpu.py --setup DEVICE PARAMS_JSON``)
# ================================================================================================================


def offload_config(ft, p: Params, device):
    from models import BLOCK_PATTERN

    return ft.OffloadConfig(include_patterns=[BLOCK_PATTERN], pinned_memory=device.type == "cuda",
                            skip_discovery=True, profiling_iters=p.profiling_iters,
                            load_strategy=ft.NthLayerStrategy(1), gpu_device=device.index or 0)


def setup_main(device_name: str, raw: str) -> None:
    """The model from its seed, its resident output as the reference, one profile."""
    import torch
    from safetensors.torch import save_file

    import flextensor as ft
    from models import ModelSpec, build_model, make_tokens

    p = Params(**json.loads(raw))
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec, dtype = ModelSpec(**p.spec), getattr(torch, p.dtype)
    model = build_model(spec, device, dtype, seed=0)
    tokens = make_tokens(spec, p.batch, p.seq, device)
    with torch.no_grad():
        save_file({"out": model(tokens).float().cpu()}, p.reference)
        proxy = ft.offload(model, config=offload_config(ft, p, device), name=MANAGER)
        for _ in range(ft.get_offload_manager(MANAGER).iters_before_inference):
            proxy(tokens)
    ft.save_profile(p.profile_dir, name=MANAGER)
    ft.release(MANAGER, preserve_model=False)


# ================================================================================================================
# Ranks
# ================================================================================================================


class Rank:
    """One torchrun rank: its device, the process group and the timed loads."""

    def __init__(self, torch, dist, ft, p: Params, device, rank: int, world: int) -> None:
        from models import ModelSpec, make_tokens

        self.torch, self.dist, self.ft, self.p, self.device = torch, dist, ft, p, device
        self.rank, self.world = rank, world
        self.spec, self.dtype = ModelSpec(**p.spec), getattr(torch, p.dtype)
        self.tokens = make_tokens(self.spec, p.batch, p.seq, device)
        self.config = offload_config(ft, p, device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def gather(self, obj) -> list:
        out: list = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def times(self, fn, n: int) -> list[float]:
        samples = []
        with self.torch.no_grad():
            for _ in range(n):
                self.sync()
                start = time.perf_counter()
                fn()
                self.sync()
                samples.append(time.perf_counter() - start)
        return samples

    def warm_up(self) -> None:
        """What any worker pays before it holds weights (imports, the engine's paths, the math libraries)."""
        from models import ModelSpec, build_model, make_tokens

        tiny = ModelSpec(hidden=self.spec.head_dim, layers=1, vocab=16, head_dim=self.spec.head_dim)
        model = self.ft.offload(build_model(tiny, self.device, self.dtype), config=self.config, name="warm")
        tokens = make_tokens(tiny, self.p.batch, self.p.seq, self.device)
        with self.torch.no_grad():
            for _ in range(self.ft.get_offload_manager("warm").iters_before_inference + 1):
                model(tokens)
        self.sync()
        self.ft.release("warm", preserve_model=False)
        self.ft.SharedOffloadSession  # noqa: B018 - the session's modules mapped before the baseline

    def open_shared(self, session) -> tuple[object, dict]:
        """``offload_from_profile``: creator or follower; when it returned, and the session's own account."""
        from models import build_meta_model, build_model

        torch, spec, dtype, device = self.torch, self.spec, self.dtype, self.device

        def creator_factory():
            model = build_model(spec, device, dtype, seed=0)  # drawn on the device: seconds, not minutes
            if device.type == "cuda":
                model = model.to("cpu")  # the model in RAM, where a checkpoint load leaves it
                torch.cuda.empty_cache()
            return model

        start = time.monotonic()
        proxy = session.offload_from_profile(self.p.profile_dir, config=self.config, name=MANAGER,
                                             creator_model_factory=creator_factory,
                                             follower_model_factory=lambda: build_meta_model(spec, dtype))
        returned = time.monotonic()
        idle = device.type != "cuda" or torch.cuda.current_stream(device).query()
        self.sync()
        share = next(s for s in session.report() if s["manager"] == MANAGER)
        done = returned if idle else time.monotonic()  # ready once no device work of the call is queued
        return proxy, {"role": share["role"], "returned": done, "call_s": done - start, "wait_s": share["wait_s"],
                       "register_s": share["register_s"], "registered": share.get("registered")}

    def first_forward(self, proxy) -> dict:
        from safetensors.torch import load_file

        torch = self.torch
        self.sync()
        start = time.perf_counter()
        with torch.no_grad():
            out = proxy(self.tokens)
        self.sync()
        seconds = time.perf_counter() - start
        host = out.detach().cpu().contiguous()
        digest = hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        diff = float((host.float() - load_file(self.p.reference)["out"]).abs().max())
        return {"first_forward_s": seconds, "hash": digest, "max_diff": diff}

    def streams(self) -> tuple[int, list[tuple[object, object]]]:
        """Bytes streamed per forward, and (device buffer, shared host block) pairs for the raw copy."""
        ctx = self.ft.get_offload_manager(MANAGER).engine
        layouts, blocks = ctx.inference.layouts, ctx.inference.host_blocks
        loader = ctx.inference.loader
        order = loader.schedule if loader is not None else [layout.index for layout in layouts]
        per_pass = sum(layouts[b].nbytes for b in order)
        largest = max(layout.nbytes for layout in layouts)
        buffer = self.torch.empty(largest, dtype=self.torch.uint8, device=self.device)
        pairs = [(buffer.narrow(0, 0, layouts[b].nbytes), blocks[b].tensor.narrow(0, 0, layouts[b].nbytes))
                 for b in order]
        return per_pass, pairs

    def throughput(self, proxy, pairs, rounds: int, passes: int) -> dict[str, float]:
        """Median seconds per pass: forward and raw copy, each rank alone in turn, then all ranks at once."""
        def forward() -> None:
            proxy(self.tokens)

        def copy() -> None:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

        samples: dict[str, list[float]] = {k: [] for k in ("alone_fwd", "alone_copy", "together_fwd", "together_copy")}
        for _ in range(rounds):
            for turn in range(self.world):
                self.dist.barrier()
                if self.rank == turn:
                    samples["alone_fwd"].append(median(self.times(forward, passes + 1)[1:]))
                    samples["alone_copy"].append(median(self.times(copy, passes + 1)[1:]))
            for key, fn in (("together_fwd", forward), ("together_copy", copy)):
                self.dist.barrier()
                samples[key].append(median(self.times(fn, LEAD + passes + LEAD)[LEAD:LEAD + passes]))
        self.dist.barrier()
        return {key: median(values) for key, values in samples.items()}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    gpu = not args.quick and torch.cuda.is_available()
    device = torch.device("cuda", local % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        if args.current_device == "set":
            torch.cuda.set_device(device)
        torch.empty(1, device=device)  # this rank's CUDA context, outside every timed region
    contexts = {"start": primary_contexts() if gpu else None}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one host: loopback, whatever the hostname is
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=args.wait_timeout + 600))
    try:
        params = [make_params(args, gpu) if rank == 0 else None]
        dist.broadcast_object_list(params, src=0)
        p = params[0]
        try:
            if rank == 0:
                print(f"set-up: {world} rank(s), model {gib(model_bytes(p))} into {p.workdir}", flush=True)
                run_setup(p, device)
            dist.barrier()
            result = run_rank(args, torch, dist, p, device, rank, world, contexts)
        finally:
            if rank == 0:
                import shutil

                shutil.rmtree(p.workdir, ignore_errors=True)
        if rank == 0:
            write_report(args, p, result, gpu)
    finally:
        dist.destroy_process_group()


def make_params(args: argparse.Namespace, gpu: bool) -> Params:
    spec = dict(GPU_SPEC if gpu else CPU_SPEC)
    spec.update({k: v for k, v in (("hidden", args.hidden), ("layers", args.layers), ("vocab", args.vocab)) if v})
    return Params(spec=spec, dtype="bfloat16" if gpu else "float32", batch=1, seq=args.seq or (128 if gpu else 16),
                  profiling_iters=args.profiling_iters, workdir=tempfile.mkdtemp(prefix="ftbench-mgpu-"),
                  namespace=f"mgpu{uuid.uuid4().hex[:10]}", wait_timeout=args.wait_timeout)


def model_bytes(p: Params) -> int:
    import torch

    from models import ModelSpec

    return ModelSpec(**p.spec).total_bytes(getattr(torch, p.dtype))


def run_setup(p: Params, device) -> None:
    """The set-up in a child process, so that rank 0 holds neither its weights nor its device memory after it."""
    argv = [sys.executable, os.path.abspath(__file__), "--setup", str(device), json.dumps(asdict(p))]
    start = time.monotonic()
    rc = subprocess.run(argv).returncode
    if rc:
        raise RuntimeError(f"the set-up process exited with {rc} (its error is above)")
    print(f"set-up done in {time.monotonic() - start:.1f} s", flush=True)


def run_rank(args, torch, dist, p: Params, device, rank: int, world: int, contexts: dict) -> list[dict] | None:
    """Every phase of one rank; rank 0 returns every rank's numbers."""
    import flextensor as ft
    from flextensor.runtime.heap import return_free_heap

    me = Rank(torch, dist, ft, p, device, rank, world)
    began = time.monotonic()

    def say(what: str) -> None:  # rank 0's progress, with the seconds since the ranks' warm-up began
        if rank == 0:
            print(f"[{time.monotonic() - began:6.1f} s] {what}", flush=True)

    me.warm_up()
    contexts["warm"] = primary_contexts() if device.type == "cuda" else None
    return_free_heap()
    info: dict = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "pid": os.getpid(),
                  "device": str(device), "baseline_pss": pss_bytes(), "contexts": contexts}
    if device.type == "cuda":
        info.update(device_name=torch.cuda.get_device_name(device), gpu_numa=gpu_numa_node(torch, device))
    sessions = [ft.SharedOffloadSession(p.namespace, wait_timeout=p.wait_timeout)]
    try:
        dist.barrier()  # all at once, as a job's ranks start
        say("warmed up; all ranks open the shared session at once")
        proxy, attach = me.open_shared(sessions[0])
        info.update(attach)
        info.update(me.first_forward(proxy))
        info["device_block_bytes"] = ft.get_gpu_memory_usage(MANAGER).block_bytes
        info["streamed_bytes"], pairs = me.streams()
        if device.type == "cuda":
            info["registered_blocks"] = registered_count([(src.data_ptr(), src.numel()) for _, src in pairs])
        info["blocks"] = len(pairs)
        info["shared_numa"] = shared_pages_by_node(sessions[0].namespace_for(MANAGER))
        return_free_heap()
        pids = me.gather(os.getpid())
        say(f"attached as {info['role']}; reading every rank's PSS")
        dist.barrier()
        pss = [pss_bytes(pid) for pid in pids] if rank == 0 else None  # every rank holds the model now
        dist.barrier()
        say(f"throughput: {args.rounds} round(s) of each rank alone, then all at once")
        info["timing"] = me.throughput(proxy, pairs, args.rounds, args.passes)
        del pairs
        if world > 1:
            say("late join: the followers leave and join again, at once")
        info["late"] = late_join(me, sessions, info["role"]) if world > 1 else None
        contexts["end"] = primary_contexts() if device.type == "cuda" else None
    finally:
        for session in sessions:
            session.close()
    everyone = me.gather(info)
    dist.barrier()  # every session closed: nothing may be left of the namespace
    say("every rank closed its session")
    if rank != 0:
        return None
    left = [r for r in ft.SharedOffloadSession.cleanup_namespace(p.namespace, manager_names=[MANAGER], timeout=0.0)
            if r.removed]
    for r, value in zip(everyone, pss):
        r["pss"] = value
    return [{**r, "leftover": [name for report_ in left for name in report_.removed]} for r in everyone]


def late_join(me: Rank, sessions: list, role: str) -> dict | None:
    """The followers leave and join the READY generation again, all at once (the creator keeps it)."""
    me.dist.barrier()
    if role == "follower":
        sessions[0].close()
        sessions.append(me.ft.SharedOffloadSession(me.p.namespace, wait_timeout=me.p.wait_timeout))
    me.dist.barrier()
    result = None
    if role == "follower":
        proxy, attach = me.open_shared(sessions[-1])
        result = {**attach, **me.first_forward(proxy)}
    me.dist.barrier()
    return result


# ================================================================================================================
# Report (rank 0)
# ================================================================================================================


def rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s ({1 / seconds:.2f}/s)"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def run_kind(ranks: list[dict]) -> str:
    """"cpu", "shared" (more ranks than GPUs: ranks share one) or "gpus" (one GPU per rank)."""
    if ranks[0]["device"] == "cpu":
        return "cpu"
    return "shared" if len({x["device"] for x in ranks}) < len(ranks) else "gpus"


def throughput_status(r: dict, kind: str, world: int) -> tuple[float, str]:
    t = r["timing"]
    ratio = t["alone_fwd"] / t["together_fwd"]  # passes/s together over passes/s alone
    if kind != "gpus":
        return ratio, "n/a (CPU host)" if kind == "cpu" else "n/a (ranks share a GPU)"
    if world == 1:
        return ratio, "n/a (N=1)"
    if ratio >= GOAL_TOGETHER:
        return ratio, "met (vs alone)"
    if t["together_copy"] / t["together_fwd"] >= GOAL_TOGETHER:
        return ratio, "met (at the host limit: the raw copies of all GPUs at once)"
    return ratio, "MISSED"


def build_sections(r: dict) -> list[tuple[str, str]]:
    ranks, world, nbytes = r["ranks"], len(r["ranks"]), r["model_bytes"]
    kind = run_kind(ranks)
    cpu = kind == "cpu"
    creator_ready = next(x["returned"] for x in ranks if x["role"] == "creator")
    setup_rows = [[f"hidden {r['spec']['hidden']}, {r['spec']['layers']} layers, vocab {r['spec']['vocab']}",
                   r["dtype"], gib(nbytes), gib(ranks[0]["streamed_bytes"]), f"{ranks[0]['blocks']} blocks",
                   world, f"B={r['batch']}, S={r['seq']}", r["current_device"]]]
    notes = []
    if world == 1:
        notes.append("N=1: 'all at once' is this one rank again, so together / alone is 1 up to noise (an A/A "
                     "reading of this host); the multi-GPU goal needs N >= 2 GPUs. With one rank there is no "
                     "follower either: it is the creator.")
    if kind == "shared":
        notes.append("More ranks than GPUs: ranks share GPUs, so 'all at once' shares their copy engines and the "
                     "throughput goal does not apply; host RAM, time to ready and outputs do.")
    if cpu:
        notes.append("CPU host: the ranks compute from the shared blocks in place (nothing is copied per pass) and "
                     "the raw copy is a memory copy; the numbers only check the paths.")

    rank_rows = [[x["rank"], x["device"], x.get("device_name", "-"), _opt(x.get("gpu_numa")), x["role"],
                  " / ".join(_opt(x["contexts"].get(k)) for k in ("start", "warm", "end")),
                  "-" if x.get("registered_blocks") is None else f"{x['registered_blocks']} / {x['blocks']}",
                  _numa(x.get("shared_numa"))] for x in ranks]

    fwd_rows = []
    for x in ranks:
        t, b = x["timing"], x["streamed_bytes"]
        ratio, status = throughput_status(x, kind, world)
        fwd_rows.append([x["rank"], x["device"], rate(b, t["alone_fwd"]), rate(b, t["together_fwd"]), f"{ratio:.3f}x",
                         rate(b, t["alone_copy"]), rate(b, t["together_copy"]),
                         f"{t['together_copy'] / t['together_fwd']:.3f}x", status])
    total = lambda key: sum(x["streamed_bytes"] / x["timing"][key] for x in ranks) / 1e9  # noqa: E731
    fwd_rows.append(["all", "-", f"{total('alone_fwd'):.2f} GB/s (sum)", f"{total('together_fwd'):.2f} GB/s (sum)",
                     f"{total('together_fwd') / total('alone_fwd'):.3f}x", f"{total('alone_copy'):.2f} GB/s (sum)",
                     f"{total('together_copy'):.2f} GB/s (sum)", "-", "-"])

    growth = [x["pss"] - x["baseline_pss"] for x in ranks]
    allowance = GOAL_PSS + (sum(x["device_block_bytes"] for x in ranks) / nbytes if cpu else 0.0)
    pss_ratio = sum(growth) / nbytes
    pss_rows = [[x["rank"], x["role"], gib(x["baseline_pss"]), gib(x["pss"]), gib(g)] for x, g in zip(ranks, growth)]
    pss_status = "met" if pss_ratio <= allowance else "MISSED"
    pss_rows.append(["sum", "-", "-", "-",
                     f"{gib(sum(growth))} = {pss_ratio:.3f}x the model (goal <= {allowance:.3f}x: {pss_status})"])

    followers = [x for x in ranks if x["role"] == "follower"]
    after = {x["rank"]: x["returned"] - creator_ready for x in followers}
    late = [x["late"] for x in followers if x.get("late")]
    ready_rows = [[x["rank"], x["device"], x["role"], ms(after.get(x["rank"])), ms(x["call_s"]), ms(x["wait_s"]),
                   ms(x["register_s"]) if x["role"] == "follower" else "in publish", ms(x["first_forward_s"]),
                   ms(x["late"]["call_s"]) if x.get("late") else "-",
                   ms(x["late"]["first_forward_s"]) if x.get("late") else "-"] for x in ranks]
    worst_ready = max([*after.values(), *(y["call_s"] for y in late)], default=None)

    hashes = {x["hash"] for x in ranks} | {y["hash"] for y in late}
    out_rows = [[x["rank"], x["role"], x["hash"], f"{x['max_diff']:.3g}", x["late"]["hash"] if x.get("late") else "-"]
                for x in ranks]
    worst_ratio = min(throughput_status(x, kind, world) for x in ranks)
    goal_rows = [
        [f"each GPU's forward all at once >= {GOAL_TOGETHER}x alone, or the host limit", f"worst {worst_ratio[0]:.3f}x",
         worst_ratio[1]],
        [f"sum of PSS growth <= {GOAL_PSS}x model bytes (N={world})", f"{pss_ratio:.3f}x", pss_status],
        [f"follower ready <= {GOAL_READY_S} s after READY (and late joiners' call), every GPU",
         ms(worst_ready), "n/a (no follower)" if worst_ready is None else
         ("met" if worst_ready <= GOAL_READY_S else "MISSED")],
        ["outputs equal on every rank (late joiners too)", f"{len(hashes)} distinct hash(es)",
         "met" if len(hashes) == 1 else "MISSED"],
        ["nothing of the namespace left after every rank closed", ", ".join(ranks[0]["leftover"]) or "nothing",
         "met" if not ranks[0]["leftover"] else "MISSED"],
    ]
    return [
        ("Model and ranks", table(["model", "dtype", "weights", "streamed per pass", "streamed as", "ranks (N)",
                                   "input", "current device"], setup_rows) + "".join(f"\n\n{n}" for n in notes)),
        ("Ranks", table(["rank", "device", "GPU", "GPU NUMA node", "role",
                         "CUDA contexts held (start / after warm-up / end)", "host blocks registered (driver)",
                         "shared pages mapped, by NUMA node"], rank_rows)),
        ("Transfer-bound forward per GPU: alone vs all at once (median of rounds)", table(
            ["rank", "device", "forward alone: streamed (passes/s)", "forward all at once", "together / alone",
             "raw copy alone", "raw copy all at once", "forward / raw copy, all at once", "goal"], fwd_rows)),
        ("Host RAM: PSS while every rank holds the model, over each rank's own baseline", table(
            ["rank", "role", "baseline PSS", "PSS with the model", "growth"], pss_rows)),
        ("Time to ready", table(
            ["rank", "device", "role", "ready after READY", "call", "waited for READY", "background registration",
             "first forward", "late join: call", "late join: first forward"], ready_rows)),
        ("Outputs", table(["rank", "role", "output hash", "max |out - resident reference|", "late join: hash"],
                          out_rows)),
        ("Goals", table(["goal", "measured", "status"], goal_rows)),
    ]


def _opt(value) -> str:
    return "n/a" if value is None else str(value)


def _numa(nodes: dict[str, int] | None) -> str:
    if nodes is None:
        return "n/a"
    return ", ".join(f"{k}: {gib(v)}" for k, v in sorted(nodes.items())) or "none"


def write_report(args: argparse.Namespace, p: Params, ranks: list[dict], gpu: bool) -> None:
    data = {"spec": p.spec, "dtype": p.dtype, "batch": p.batch, "seq": p.seq, "model_bytes": model_bytes(p),
            "current_device": args.current_device if gpu else "-", "ranks": ranks}
    # The docs section holds the multi-GPU goals: only a run on two or more distinct GPUs can check them.
    docs = run_kind(ranks) == "gpus" and len(ranks) >= 2 and not (args.no_docs or args.quick)
    report(NAME, "Several GPUs streaming from one shared host copy", build_sections(data), data, docs=docs)
    if not docs and not (args.no_docs or args.quick):
        print("not written into docs/benchmarks.md: only a run with one rank on each of 2 or more GPUs checks "
              "the multi-GPU goals", flush=True)


# ================================================================================================================
# Main
# ================================================================================================================


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small model on CPU ranks (gloo), every GPU hidden from them (CUDA_VISIBLE_DEVICES=''): "
                        "checks the paths only, on any host")
    p.add_argument("--nproc-per-node", type=int,
                   help="without torchrun: the ranks to start (default: one per GPU; 2 with --quick or no GPU)")
    p.add_argument("--current-device", choices=["set", "keep"], default="set",
                   help="set: torch.cuda.set_device(LOCAL_RANK) in every rank; keep: cuda:0 stays current")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--profiling-iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (each rank alone, all at once)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per rank and phase in each round")
    p.add_argument("--wait-timeout", type=float, default=600.0, help="a follower's wait for READY (s)")
    p.add_argument("--no-docs", action="store_true", help="do not write the results into docs/benchmarks.md")
    return p.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> None:
    """Not under torchrun: replace this process by torchrun running this file, one rank per GPU."""
    n = args.nproc_per_node
    if n is None:
        import torch  # the device count only; no CUDA context here

        n = torch.cuda.device_count() if not args.quick and torch.cuda.is_available() else 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           os.path.abspath(__file__), *argv]
    print(" ".join(cmd), flush=True)
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--setup":
        setup_main(sys.argv[2], sys.argv[3])
    else:
        parsed = parse_args(sys.argv[1:])
        if parsed.quick:  # before torch asks for a device, in torchrun's ranks and the set-up process too
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
            rank_main(parsed)
        else:
            launch(parsed, sys.argv[1:])
