"""Benchmark of loading real checkpoints at bounded host RAM: the peak RSS each way of loading, and the time
from a safetensors checkpoint to READY, from a warm page cache and from disk.

Peak RSS: the point of one host copy is host RAM, and a creator that held the model twice while loading would
need a host that holds two copies anyway. Each way of loading runs in a fresh process, which resets its peak
(``/proc/self/clear_refs``), reads ``VmRSS`` just before the call and ``VmHWM`` just after it; the growth is
reported as a ratio of the model's bytes. Before the baseline the process imports flextensor's modules (~70 MiB
once per process) and, on CUDA, creates the CUDA context (the driver's and runtime's host memory, a per-process
constant): neither is memory the model's load needs.

- ``load_model_from_profile``: meta model, every tensor read once into its host block. Goal <= 1.10x. On CUDA
  the blocks are pinned in place at their exact size (``--pinned-mode host_register``, the default here); a
  second row shows the default ``"torch"`` mode, whose arenas PyTorch's pinned allocator rounds up to powers of
  two (the configuration guide says so): that row has no goal.
- ``session creator (checkpoint)``: the creator of an N-worker ``SharedOffloadSession`` with ``checkpoint=``
  (reads into the shared blocks). Goal <= 1.10x. The followers' time to ready (they start once the creator is
  READY) is shown beside it.
- ``session creator (in RAM)``: the creator's factory first loads the checkpoint into private tensors (the same
  reader), then the session copies them into the shared blocks and frees each as it goes. Goal <= 1.25x.
- ``offload (model in RAM), added``: a single process offloading a model already in RAM from the profile; the
  growth is what offloading adds on top of the model.
(``--skip-in-ram`` leaves out the last two.)

Checkpoint-to-READY time (the call, from the checkpoint path to a model ready for inference; process start,
imports and the CUDA context are not in it) for ``load_model_from_profile`` and the session creator:

- warm: the files were read once before and are all in the page cache (checked with ``mincore``); the memory
  rows' runs are these runs. Goal on the H200 host: <= 2.5 s for 6 GiB (scaled by the model's bytes here);
- cold: the files are dropped from the page cache first (``fsync``, then ``POSIX_FADV_DONTNEED`` on each),
  and the drop is checked with ``mincore``; ``cat FILES > /dev/null``, equally cold, is timed for the same bytes.
  Goal: within 1.2x of ``cat``. Where the page cache cannot be dropped (tmpfs, or pages someone keeps), the
  table says so and gives no verdict.
"of which reading" is the time spent inside the checkpoint reader (``ReadPlan.read``); the rest of the call
allocates and pins the blocks, builds the model and publishes. A third table says where each load's time went:
reading, the destination pages the reader's thread populated ahead of its reads (and its seconds), the
registration of private host blocks inside the call (CUDA), and the call's steps (the session creator's
``report()`` steps: its block reads run on a thread beside ``adopt`` and ``plan``, ``blocks_wait`` is what is left
of them after those); each worker also prints one line per run as it finishes. Beside ``cat`` (cold and warm), a reference row
runs the checkpoint reader alone (``ReadPlan`` over every tensor, into memory allocated and written before), and
another writes as many bytes of fresh anonymous memory: the page allocation that a load into fresh host blocks
pays on top of reading (inside its reads when the blocks' pages come as they are written, before them when a
session creator allocates its shared arena ahead).

Set-up, in a separate process: an MLP stack (``--layers`` blocks of ``d x h`` and ``h x d`` weights, float32 on
a CPU host and bfloat16 on CUDA by default), saved as sharded safetensors with an index (``--shards``), profiled
with every block streamed, profile saved. Every output is checked against the plain model's. Sizes: a block is
``2 * d * h`` elements; the defaults are 8 x 1024 x 8192 float32 (0.5 GiB) on a CPU host and 24 x 4096 x 16384
bfloat16 (6 GiB) on CUDA.

Usage: ``python bench/bench_checkpoint.py [--layers N --d D --h H] [--workers 2] [--repeat 1] [--skip-in-ram]
[--tmp DIR] [--no-docs]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import page_cache  # noqa: E402
from checkpoint_report import memory_table, phases_table, samples, summary_line, timing_table  # noqa: E402

import flextensor as ft  # noqa: E402

NAME = "bench_checkpoint"


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Sequential):
    def __init__(self, layers: int, d: int, h: int, dtype: torch.dtype) -> None:
        super().__init__(*[Block(d, h) for _ in range(layers)])
        self.to(dtype)


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _input(args: argparse.Namespace) -> torch.Tensor:
    return torch.randn(4, args.d, generator=torch.Generator().manual_seed(1)).to(_dtype(args))


def _config(mode: str = "host_register") -> ft.OffloadConfig:
    cuda = torch.cuda.is_available()
    return ft.OffloadConfig(pinned_memory=cuda, pinned_memory_mode=mode if cuda else "torch", num_blocks=2,
                            min_blocks=2)


def _checkpoint_files(root: Path) -> list[str]:
    return sorted(str(p) for p in (root / "ckpt").iterdir())


# ------------------------------------------------------------------------------------------------ set-up
def setup(args: argparse.Namespace, root: Path) -> None:
    """Model -> sharded checkpoint + profile + reference output (run in its own process). The model is made
    on the compute device (a 6 GiB model's random initialisation takes seconds there, minutes on a CPU)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    device = _device()
    with torch.device(device):
        model = Stack(args.layers, args.d, args.h, _dtype(args)).eval()
    with torch.no_grad():
        ref = model(_input(args).to(device)).float().cpu()
    model.to("cpu")
    torch.save(ref, root / "ref.pt")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = list(tensors)
    per = -(-len(keys) // args.shards)
    weight_map = {}
    ckpt = root / "ckpt"
    ckpt.mkdir()
    for i in range(args.shards):
        name = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(ckpt / name))
        weight_map.update({k: name for k in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    del tensors
    cfg = ft.OffloadConfig(pinned_memory=torch.cuda.is_available(), include_patterns=["class:Block"],
                           load_strategy=ft.NthLayerStrategy(1), num_blocks=2, min_blocks=2)
    ft.offload(model, cfg, name="profiler")
    manager = ft.get_offload_manager("profiler")
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(_input(args).to(manager.device))
    ft.save_profile(str(root / "profile"), name="profiler")
    ft.release("profiler")


# ------------------------------------------------------------------------------------------------ worker
def _start_cuda() -> None:
    """The CUDA context (and the copy path) before the baseline: a per-process constant of host memory, on the
    order of 100 MiB of RSS, and start-up time, neither of which is the model's load."""
    if torch.cuda.is_available():
        torch.ones(1024, dtype=torch.uint8).to("cuda").cpu()
        torch.cuda.synchronize()


class _Phases:
    """Where a worker's call spends its time: this process's checkpoint reader (every ``ReadPlan.read``: seconds,
    and the pages its thread populated ahead of the reads), the adoption (``offload_from_state``: for
    ``load_model_from_profile`` it contains the reads and the registration) and the in-place registration of
    private host blocks (``HostRegisterProvider.finish``, CUDA). Instruments the classes, in the worker only."""

    def __init__(self) -> None:
        from flextensor.loading.checkpoint import ReadPlan
        from flextensor.manager import OffloadManager
        from flextensor.runtime.host_memory import HostRegisterProvider

        self.seconds = {"read": 0.0, "populate": 0.0, "adopt": 0.0, "register": 0.0}
        self.populated = 0
        read, adopt, finish = ReadPlan.read, OffloadManager.offload_from_state, HostRegisterProvider.finish
        phases = self

        def timed_read(plan: ReadPlan, *args, **kwargs):
            start = time.monotonic()
            try:
                stats = read(plan, *args, **kwargs)
            except BaseException:
                phases.seconds["read"] += time.monotonic() - start
                raise
            phases.seconds["read"] += stats.read_s
            phases.seconds["populate"] += stats.populate_s
            phases.populated += stats.populated_bytes
            return stats

        def timed(name: str, fn):
            def call(*args, **kwargs):
                start = time.monotonic()
                try:
                    return fn(*args, **kwargs)
                finally:
                    phases.seconds[name] += time.monotonic() - start
            return call

        ReadPlan.read = timed_read  # type: ignore[method-assign]
        OffloadManager.offload_from_state = timed("adopt", adopt)  # type: ignore[method-assign]
        HostRegisterProvider.finish = timed("register", finish)  # type: ignore[method-assign]

    def result(self, session=None) -> dict:
        out = {**{f"{k}_s": v for k, v in self.seconds.items()}, "populated_bytes": self.populated}
        if session is not None:  # the creator's steps (factory, store, blocks, adopt, plan: see session.report())
            report = session.report()[0]
            out["steps"] = {k: v for k, v in report["steps"].items() if isinstance(v, float)}
        return out


def _in_ram_factory(args: argparse.Namespace, ckpt: Path):
    def factory() -> nn.Module:
        from flextensor.loading.checkpoint import SafetensorsCheckpoint

        checkpoint = SafetensorsCheckpoint(ckpt)
        with ft.init_empty_weights():
            model = Stack(args.layers, args.d, args.h, _dtype(args))
        model.load_state_dict({k: checkpoint.read(k) for k in checkpoint.entries}, assign=True)
        return model.eval()

    return factory


def _meta_model(args: argparse.Namespace) -> nn.Module:
    with ft.init_empty_weights():
        return Stack(args.layers, args.d, args.h, _dtype(args)).eval()


def worker(args: argparse.Namespace, root: Path) -> None:
    """One way of loading (``args.worker``); prints one JSON line; with --hold waits for a line on stdin."""
    meta = lambda: _meta_model(args)  # noqa: E731
    ckpt = root / "ckpt"
    mode = args.worker.removesuffix("-torch")
    config = _config(args.pinned_mode if mode == args.worker else "torch")
    model_in_ram = _in_ram_factory(args, ckpt)() if mode == "offload" else None
    size = sum(t.numel() * t.element_size() for t in meta().parameters())
    # The engine's modules are imported before the measurement: importing them costs ~70 MiB of anonymous memory
    # once per process (measured on the CPU VM), which is not memory the model's load needs.
    for module in ("flextensor.loading.lazy_init", "flextensor.sharing.session"):
        importlib.import_module(module)

    _start_cuda()
    phases = _Phases()
    ft.init(config, name="model")
    common.reset_peak_rss()
    before = common.proc_status("VmRSS")
    start = time.monotonic()
    session = None
    role = "single"
    if mode == "lazy":
        model = ft.load_model_from_profile(ft.get_offload_manager("model"), str(root / "profile"), Stack,
                                           model_args=(args.layers, args.d, args.h, _dtype(args)),
                                           safetensor_path=str(ckpt), strict=True)
    elif mode == "offload":
        model = ft.offload_from_profile(model_in_ram, str(root / "profile"), config, name="model")
        del model_in_ram
    else:
        session = ft.SharedOffloadSession(args.ns, wait_timeout=600)
        kwargs = {"checkpoint": str(ckpt)} if mode == "session" else \
            {"creator_model_factory": _in_ram_factory(args, ckpt)}
        model = session.offload_from_profile(str(root / "profile"), config=config, name="model",
                                             follower_model_factory=meta, **kwargs)
        role = session.role("model")
    ready_s = time.monotonic() - start
    growth = common.proc_status("VmHWM") - before
    device = ft.get_offload_manager("model").device
    with torch.no_grad():
        out = model(_input(args).to(device)).float().cpu()
    ref = torch.load(root / "ref.pt")
    equal = torch.equal(out, ref) if device.type == "cpu" else bool(torch.allclose(out, ref, atol=2e-2, rtol=2e-2))
    print(json.dumps({"role": role, "growth": growth, "model_bytes": size, "ready_s": ready_s,
                      "read_s": phases.seconds["read"], "phases": phases.result(session), "equal": equal}),
          flush=True)
    if args.hold:
        sys.stdin.readline()
    if session is not None:
        session.close()


# ------------------------------------------------------------------------------------------------ parent
def _spawn(args: argparse.Namespace, root: Path, mode: str, ns: str = "", hold: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", mode, "--root", str(root), "--ns", ns or "unused",
           "--layers", str(args.layers), "--d", str(args.d), "--h", str(args.h), "--dtype", args.dtype,
           "--pinned-mode", args.pinned_mode]
    if hold:
        cmd.append("--hold")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"worker exited {proc.returncode} without a result")
    return json.loads(line)


def _release(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
    for proc in procs:
        proc.wait()


class Runner:
    """Runs the workers against one set-up, each from a page cache prepared as asked, and keeps every result."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args, self.root = args, root
        self.files = _checkpoint_files(root)
        self.file_bytes = sum(os.path.getsize(p) for p in self.files)
        self.runs: list[dict] = []

    def prepare(self, cache: str) -> float:
        """Make the checkpoint's files warm (all cached) or cold (dropped); returns the fraction cached now."""
        if cache == "warm":
            cached = page_cache.make_resident(self.files)
        else:
            page_cache.evict(self.files)
            cached = page_cache.resident_bytes(self.files)
        return cached / max(self.file_bytes, 1)

    def load(self, mode: str, cache: str) -> dict:
        """One worker of ``mode`` (with ``--workers - 1`` followers for the session's memory row)."""
        ns = f"bench-ckpt-{uuid.uuid4().hex[:8]}"
        cached = self.prepare(cache)
        followers_wanted = mode == "session" and cache == "warm" and not any(
            r["mode"] == "session" for r in self.runs)
        if followers_wanted:
            creator = _spawn(self.args, self.root, mode, ns, hold=True)
            result = _result(creator)
            followers = [_spawn(self.args, self.root, mode, ns, hold=True) for _ in range(self.args.workers - 1)]
            others = [_result(p) for p in followers]
            _release(*followers, creator)
            result["followers_ready_s"] = [o["ready_s"] for o in others]
            result["equal"] = result["equal"] and all(o["equal"] for o in others)
        else:
            proc = _spawn(self.args, self.root, mode, ns)
            result = _result(proc)
            proc.wait()
        result.update(mode=mode, cache=cache, cached_before=cached)
        self.runs.append(result)
        line = summary_line(result)
        if line is not None:
            print(line, flush=True)
        return result

    def cat(self, cache: str) -> dict:
        cached = self.prepare(cache)
        result = {"mode": "cat", "cache": cache, "cached_before": cached, "ready_s": page_cache.timed_cat(self.files)}
        self.runs.append(result)
        return result

    def reader(self, cache: str) -> dict:
        """The checkpoint reader alone (``ReadPlan``, as a load runs it) into memory allocated and written before:
        what reading costs without the page allocation and the rest of a load."""
        from flextensor.loading.checkpoint import ReadPlan, SafetensorsCheckpoint

        checkpoint = SafetensorsCheckpoint(self.root / "ckpt")
        plan = ReadPlan(label="bench")
        buffers = [torch.zeros(e.shape, dtype=e.dtype) for e in checkpoint.entries.values()]
        for entry, buffer in zip(checkpoint.entries.values(), buffers):
            plan.add(entry, buffer)
        cached = self.prepare(cache)
        start = time.monotonic()
        plan.run()
        result = {"mode": "reader", "cache": cache, "cached_before": cached, "ready_s": time.monotonic() - start}
        del buffers
        self.runs.append(result)
        return result

    def samples(self, mode: str, cache: str) -> list[dict]:
        return samples(self.runs, mode, cache)


def memory_section(runner: Runner, modes: list[str]) -> str:
    """The peak-RSS rows: one warm load of each way of loading (the first warm run of each)."""
    return memory_table(modes, [runner.load(mode, "warm") for mode in modes])


def _fresh_memory_s(nbytes: int) -> float:
    """Seconds to allocate and write ``nbytes`` of fresh anonymous memory (torch's threads): the page allocation
    a load into fresh host blocks pays besides its reads."""
    start = time.monotonic()
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    buffer.fill_(1)
    seconds = time.monotonic() - start
    del buffer
    return seconds


def timing_section(runner: Runner, modes: list[str]) -> str:
    """The timed runs: cold ones first (``cat``, the reader, each way of loading, ``--repeat`` times), then the
    warm ones the memory rows did not already give, the warm references and the fresh-memory writes."""
    args = runner.args
    for _ in range(args.repeat):
        runner.cat("cold")
        runner.reader("cold")
        for mode in modes:
            runner.load(mode, "cold")
    for mode in modes:  # the memory rows were the first warm run of each
        for _ in range(args.repeat - len(runner.samples(mode, "warm"))):
            runner.load(mode, "warm")
    runner.cat("warm")
    runner.reader("warm")
    for _ in range(args.repeat):
        runner.runs.append({"mode": "fresh", "cache": "-", "ready_s": _fresh_memory_s(runner.file_bytes)})
    return timing_table(runner.runs, modes, runner.file_bytes, args.repeat)


def _set_up(args: argparse.Namespace, root: Path) -> None:
    t0 = time.monotonic()
    subprocess.run([sys.executable, __file__, "--setup", "--root", str(root), "--layers", str(args.layers),
                    "--d", str(args.d), "--h", str(args.h), "--dtype", args.dtype, "--shards", str(args.shards)],
                   check=True)
    page_cache.evict(_checkpoint_files(root))  # written back now (not during a timed run), then read again
    print(f"set-up (model, checkpoint, profile) took {time.monotonic() - t0:.1f} s", flush=True)


def run_session_warm(args: argparse.Namespace) -> None:
    """Only the session creator's checkpoint-to-READY from a warm page cache, ``--repeat`` times, over the set-up
    kept in ``--session-warm-only DIR`` (made there on the first call): what bench_huge_pages runs once per kind
    of page, with ``FT_SHM_DIR`` naming the directory under test. Prints one JSON line ``{"ready_s": [...]}``."""
    root = Path(args.session_warm_only)
    if not (root / "ckpt").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        _set_up(args, root)
    runner = Runner(args, root)
    runs = [runner.load("session", "warm") for _ in range(args.repeat)]
    print(json.dumps({"ready_s": [r["ready_s"] for r in runs], "equal": all(r["equal"] for r in runs),
                      "model_bytes": runs[0]["model_bytes"], "cached_before": [r["cached_before"] for r in runs]}),
          flush=True)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ft-bench-ckpt-", dir=args.tmp) as tmp:
        root = Path(tmp)
        _set_up(args, root)
        runner = Runner(args, root)
        shm_free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
        shared = shm_free > 1.1 * runner.file_bytes
        if not shared:
            print(f"/dev/shm has {common.gib(shm_free)} free, too little for the model: no session rows", flush=True)
        modes = ["lazy"] + (["lazy-torch"] if torch.cuda.is_available() else []) + (["session"] if shared else [])
        if not args.skip_in_ram:
            modes += (["inram"] if shared else []) + ["offload"]
        t1 = time.monotonic()
        memory = memory_section(runner, modes)
        print(f"memory rows took {time.monotonic() - t1:.1f} s", flush=True)
        t1 = time.monotonic()
        timed_modes = [m for m in ("lazy", "session") if m in modes]
        timing = timing_section(runner, timed_modes)
        phases = phases_table(runner.runs, timed_modes, torch.cuda.is_available())
        print(f"timing rows took {time.monotonic() - t1:.1f} s", flush=True)
        model_bytes = runner.runs[0]["model_bytes"]
        where = f"{args.tmp or tempfile.gettempdir()} ({page_cache.filesystem_type(root)})"
        footer = (f"\n\nModel: {args.layers} blocks of {args.d}x{args.h} {args.dtype}, {common.gib(model_bytes)}, "
                  f"{args.shards} shards in {where}; {args.workers} session workers; host blocks pinned with "
                  f"pinned_memory_mode={args.pinned_mode!r} on CUDA.")
        data = {"args": vars(args), "runs": runner.runs}
        common.report(NAME if torch.cuda.is_available() else NAME + "_cpu", "Checkpoints at bounded host RAM",
                      [("Peak RSS", memory + footer), ("Checkpoint to READY, warm and cold", timing),
                       ("Where the time goes", phases)],
                      data, docs=not args.no_docs)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--layers", type=int, default=24 if cuda else 8)
    p.add_argument("--d", type=int, default=4096 if cuda else 1024)
    p.add_argument("--h", type=int, default=16384 if cuda else 8192)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="runs per timed row (warm and cold)")
    p.add_argument("--pinned-mode", default="host_register", choices=["host_register", "torch"],
                   help="pinned_memory_mode of the host blocks on CUDA (the rows with goals)")
    p.add_argument("--skip-in-ram", action="store_true", help="leave out the in-RAM creator and offload rows")
    p.add_argument("--tmp", default=None, help="where the checkpoint is written (default: the system's temp dir)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--session-warm-only", metavar="DIR",
                   help="only the session creator from a warm cache, over a set-up kept in DIR (made if absent)")
    p.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--ns", help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.setup:
        setup(args, Path(args.root))
    elif args.worker:
        worker(args, Path(args.root))
    elif args.session_warm_only:
        run_session_warm(args)
    else:
        run(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
