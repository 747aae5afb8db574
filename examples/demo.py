"""flextensor's demo (``./dev.sh demo``): N worker processes hold one ~1 GiB model, three ways, measured.

What it shows, in one run on any Linux host:

1. the parent builds a transformer-like model of about 1 GiB (``demo_model.py``; float32 on a CPU host, bf16 on
   a GPU host), saves it as a safetensors checkpoint, computes the plain model's output on a fixed input, and
   profiles it once with flextensor (every ``DemoBlock`` streams) into a profile directory;
2. three groups of N workers (default 4; ``demo_worker.py``), one group after another, never at once, each
   load the checkpoint, run the same forward and hold their weights:

   - ``flextensor``: a ``SharedOffloadSession``; the elected creator publishes the weights into ``/dev/shm`` and
     the followers attach to the same pages;
   - ``private copies``: ``load_file`` and a ``.clone()`` of every tensor: what each worker of a GPU host pays
     without flextensor (a pinned copy cannot be page cache);
   - ``mmap``: ``load_file`` as usual: on a CPU host the file's pages are the page cache's, shared already;

3. while all N workers of a group hold their weights, the parent reads each one's ``/proc/<pid>/smaps_rollup``
   and compares it with the same worker's idle reading; it prints one table (layout, sum of PSS growth, times the
   model's bytes) and says which case flextensor wins and by how much; it checks every output against the plain
   model's, and that flextensor's workers left nothing in ``/dev/shm`` or the lock directory.

Why measured baselines: an estimate of "N private copies" cannot show where a layout pays more than its weights
(allocator rounding, activations, a mapping kept alive), and on a CPU host the fair baseline is mmap, which an
estimate would not have shown to share already. The workers' side and protocol are in ``demo_worker.py``; the
process handling and memory readings in ``demo_fleet.py``; this file decides what runs and reports it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (str(HERE), str(REPO)):  # demo_model, demo_worker, demo_fleet, and bench.common for tables
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench.common import machine_description, table  # noqa: E402
from demo_fleet import (LEASE_S, WAIT_TIMEOUT_S, DemoFailure, Worker, leftovers, reclaim,  # noqa: E402
                        run_group)
from demo_worker import MANAGER  # noqa: E402

logger = logging.getLogger("demo")

#: The groups, in the order they run and are reported, with the name each has in the tables.
LAYOUT_NAMES = {
    "flextensor": "flextensor (one shared copy in /dev/shm)",
    "copy": "private copies (load_file + clone)",
    "mmap": "mmap of the checkpoint (load_file)",
}
#: The goal for flextensor's sum of PSS growth over the model's bytes (the full demo: 1 GiB, 4 workers).
GOAL_RATIO = 1.15


def human(nbytes: float) -> str:
    """Bytes as GiB above one GiB, else MiB (or KiB for the tiny --quick model)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


class _ElapsedFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self.start = time.monotonic()

    def format(self, record: logging.LogRecord) -> str:
        return f"[{time.monotonic() - self.start:6.1f} s] {record.getMessage()}"


def _setup_parent_logging() -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_ElapsedFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


@dataclass
class Group:
    """One layout's N workers after their run: their readings, and whether each output matched the plain model's."""

    layout: str
    workers: list[Worker]
    matches: list[tuple[bool, float]]

    @property
    def name(self) -> str:
        return LAYOUT_NAMES[self.layout]

    def growth(self, key: str = "Pss") -> int:
        """The sum over the N workers of what holding the weights added to ``key``."""
        return sum(w.growth(key) for w in self.workers)

    @property
    def ok(self) -> int:
        return sum(ok for ok, _ in self.matches)


# ================================================================================================================
# The parent's own work: model, checkpoint, reference output, profile
# ================================================================================================================


def _plain_output(model: Any, tokens: Any, device: Any) -> Any:
    import torch

    model.to(device)
    try:
        with torch.no_grad():
            return model(tokens.to(device)).float().cpu()
    finally:
        model.to("cpu")


def _profile(model: Any, tokens: Any, device: Any, config: Any, profile_dir: Path) -> int:
    """Offload privately once, run the warm-up forwards, save the profile, release. Returns the forward count."""
    import torch

    import flextensor as ft

    ft.offload(model, config, name="profiler")
    iters = ft.get_offload_manager("profiler").iters_before_inference
    with torch.no_grad():
        for _ in range(iters):
            model(tokens.to(device))
    ft.save_profile(str(profile_dir), name="profiler")
    ft.release("profiler", preserve_model=False)
    return iters


def _matches(out: Any, ref: Any, exact: bool) -> tuple[bool, float]:
    import torch

    if out.shape != ref.shape:
        return False, float("inf")
    diff = float((out - ref).abs().max()) if out.numel() else 0.0
    if exact:
        return bool(torch.equal(out, ref)), diff
    scale = float(ref.abs().max()) or 1.0
    return bool(torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * scale)), diff


def _check_outputs(workers: list[Worker], reference: Any, exact: bool) -> list[tuple[bool, float]]:
    import torch

    found = []
    for w in workers:
        out = torch.frombuffer(bytearray(w.out_path.read_bytes()), dtype=torch.float32).reshape(w.result["shape"])
        found.append(_matches(out, reference, exact))
    return found


# ================================================================================================================
# The run
# ================================================================================================================


def _run_flextensor(n: int, params: dict[str, Any], tmp: Path, logs: Path) -> tuple[list[Worker], list[str]]:
    """flextensor's group, then what it left in /dev/shm (reclaimed if anything: the run then fails)."""
    namespace, compact_ns = params["namespace"], params["compact_ns"]
    logger.info("flextensor: starting %d workers (namespace %s -> /dev/shm/%s.*)", n, namespace, compact_ns)
    try:
        workers = run_group("flextensor", n, params, tmp, logs)
    except BaseException:
        reclaim(namespace)
        raise
    left = leftovers(compact_ns)
    if left:
        logger.error("the workers closed but left %s", left)
        reclaim(namespace)
    else:
        logger.info("flextensor: all workers closed; nothing of namespace %s left in /dev/shm or the lock "
                    "directory", namespace)
    return workers, left


def parent_main(args: argparse.Namespace) -> int:
    start = time.monotonic()
    _setup_parent_logging()
    import torch

    import flextensor as ft
    from flextensor.shm.names import manager_namespace

    from demo_model import BLOCK_PATTERN, build_random, demo_tokens, quick_spec, save_checkpoint, spec_for_size

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    spec = quick_spec(dtype) if args.quick else spec_for_size(args.size_gib, dtype)
    seq = 8 if args.quick else 32
    num_blocks = 2
    namespace = f"demo-{os.getpid()}"
    compact_ns = manager_namespace(namespace, MANAGER)

    print(f"flextensor demo: {args.workers} workers hold one {human(spec.total_bytes())} model three ways "
          "(flextensor, private copies, mmap), one group after another")
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name(0)}" + (f" (+{torch.cuda.device_count() - 1} more; workers spread "
              "over them)" if torch.cuda.device_count() > 1 else ""))
    else:
        print("CPU host (no CUDA): computing on the CPU; flextensor's workers compute from the shared pages in place")
    print(f"machine: {machine_description()}")
    print(flush=True)

    # Outside the temporary directory: the logs outlive a failed run (and a --keep-logs one).
    logs = Path(tempfile.mkdtemp(prefix="flextensor-demo-logs-"))
    with tempfile.TemporaryDirectory(prefix="flextensor-demo-") as tmp_name:
        tmp = Path(tmp_name)

        logger.info("building model: %d x DemoBlock, hidden %d, vocab %d, %.3g M parameters, %s %s",
                    spec.layers, spec.hidden, spec.vocab, spec.total_params() / 1e6, human(spec.total_bytes()),
                    spec.dtype)
        model = build_random(spec, seed=0, device=device).to("cpu")
        checkpoint = tmp / "model.safetensors"
        logger.info("saving checkpoint %s (what every group loads)", checkpoint.name)
        save_checkpoint(model, str(checkpoint))
        tokens = demo_tokens(spec, seq=seq)
        logger.info("computing the plain model's output on %s (the reference), input %s", device, tuple(tokens.shape))
        reference = _plain_output(model, tokens, device)

        pattern_cfg = dict(include_patterns=[BLOCK_PATTERN], profiling_iters=2,
                           load_strategy=ft.NthLayerStrategy(1))  # every DemoBlock streams from the host copy
        config = ft.OffloadConfig(pinned_memory=True, **pattern_cfg) if cuda else \
            ft.OffloadConfig(pinned_memory=False, num_blocks=num_blocks, min_blocks=num_blocks, **pattern_cfg)
        profile_dir = tmp / "profile"
        logger.info("profiling once in this process (%s, every DemoBlock streamed)", BLOCK_PATTERN)
        iters = _profile(model, tokens, device, config, profile_dir)
        logger.info("profile saved after %d forwards; the parent drops its copy of the model", iters)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
        params = {"namespace": namespace, "compact_ns": compact_ns, "profile_dir": str(profile_dir),
                  "checkpoint": str(checkpoint), "spec": spec.to_dict(), "seq": seq, "pattern": BLOCK_PATTERN,
                  "num_blocks": num_blocks, "lease": LEASE_S, "wait_timeout": WAIT_TIMEOUT_S, "devices": devices}
        logger.info("worker logs in %s", logs)
        groups: list[Group] = []
        try:
            workers, left = _run_flextensor(args.workers, params, tmp, logs)
            groups.append(Group("flextensor", workers, _check_outputs(workers, reference, exact=not cuda)))
            for layout in ("copy", "mmap"):
                logger.info("%s: starting %d workers", layout, args.workers)
                workers = run_group(layout, args.workers, params, tmp, logs)
                groups.append(Group(layout, workers, _check_outputs(workers, reference, exact=not cuda)))
        except BaseException:
            logger.info("worker logs kept in %s", logs)
            raise
        if not args.keep_logs:
            shutil.rmtree(logs, ignore_errors=True)
        ref_sha = hashlib.sha256(reference.contiguous().numpy().tobytes()).hexdigest()

    _print_report(args, spec.total_bytes(), groups, ref_sha, cuda, left, logs, time.monotonic() - start)
    return 0 if all(g.ok == len(g.workers) for g in groups) and not left else 1


# ================================================================================================================
# The report
# ================================================================================================================


def _worker_rows(groups: list[Group]) -> list[list[object]]:
    rows: list[list[object]] = []
    for g in groups:
        for w, (ok, _) in zip(g.workers, g.matches):
            r = w.result
            rows.append([g.layout, w.index, w.pid, r["role"], r["generation"], f"{r['ready_s'] * 1000:.0f} ms",
                         human(w.idle["Pss"]),
                         human(w.growth()), human(w.growth("Pss_Anon")), human(w.growth("Pss_Shmem")),
                         human(w.growth("Pss_File")), r["sha256"][:12] + ("" if ok else " (MISMATCH)")])
    return rows


def _verdict(groups: dict[str, Group], n: int, model_bytes: int) -> list[str]:
    """The plain-language lines under the table: which case flextensor wins, and by how much. "Matches" allows
    the goal's margin (GOAL_RATIO - 1 of the model's bytes); the tiny --quick model is within no such margin."""
    ft_g, copy_g, mmap_g = groups["flextensor"].growth(), groups["copy"].growth(), groups["mmap"].growth()
    x = lambda b: f"{b / model_bytes:.2f}x"  # noqa: E731
    lines = [f"flextensor: {human(ft_g)} = {x(ft_g)} the model; private copies (what each GPU worker pays without "
             f"flextensor): {human(copy_g)} = {x(copy_g)}; mmap of the same file (CPU only, page cache): "
             f"{human(mmap_g)} = {x(mmap_g)}."]
    if ft_g - mmap_g <= (GOAL_RATIO - 1) * model_bytes:
        lines.append(f"On a CPU host mmap already shares the file: flextensor matches it ({x(ft_g)} vs {x(mmap_g)}), "
                     "it does not beat it.")
    else:
        lines.append(f"On a CPU host mmap already shares the file: flextensor costs {human(ft_g - mmap_g)} more than "
                     f"it here ({x(ft_g)} vs {x(mmap_g)}).")
    if copy_g > ft_g:
        lines.append(f"On a GPU host, where each worker needs its own pinned copy, flextensor holds 1 copy instead of "
                     f"{n}: it saves {human(copy_g - ft_g)} here ({x(copy_g)} -> {x(ft_g)}).")
    else:
        lines.append(f"On a GPU host, where each worker needs its own pinned copy, flextensor holds 1 copy instead of "
                     f"{n}; with this model the copies weigh less than flextensor's fixed costs ({x(copy_g)} vs "
                     f"{x(ft_g)}).")
    return lines


def _print_report(args: argparse.Namespace, model_bytes: int, groups: list[Group], ref_sha: str, cuda: bool,
                  left: list[str], logs: Path, wall_s: float) -> None:
    n = args.workers
    by_layout = {g.layout: g for g in groups}
    print()
    print("Each worker's memory: growth = while all of its group held their weights - idle "
          "(/proc/PID/smaps_rollup); anon = Pss_Anon, shmem = Pss_Shmem, file = Pss_File")
    print(table(["layout", "worker", "pid", "role", "generation", "time to ready", "PSS idle", "PSS growth",
                 "anon", "shmem", "file", "output sha256"], _worker_rows(groups)))
    print()
    print(f"Host RAM of {n} workers holding one {human(model_bytes)} model (sum of PSS growth while all {n} of "
          "a group were alive; the groups ran one after another):")
    print(table(["layout", "sum of PSS growth", "x model bytes"],
                [[g.name, human(g.growth()), f"{g.growth() / model_bytes:.2f}x"] for g in groups]))
    print()
    for line in _verdict(by_layout, n, model_bytes):
        print(line)
    flex = by_layout["flextensor"]
    print(f"flextensor's growth by kind (sum of {n} workers): in /dev/shm (Pss_Shmem) "
          f"{human(flex.growth('Pss_Shmem'))}, private anonymous (Pss_Anon) {human(flex.growth('Pss_Anon'))}, "
          f"mapped files (Pss_File) {human(flex.growth('Pss_File'))}")
    ratio = flex.growth() / model_bytes
    if args.quick:
        print("(--quick: the model is tiny, so the ratios show only each worker's fixed costs)")
    else:
        print(f"goal: flextensor's sum of PSS growth <= {GOAL_RATIO:.2f}x the model bytes: "
              f"{'met' if ratio <= GOAL_RATIO else 'MISSED'} ({ratio:.2f}x)")
    total = sum(len(g.workers) for g in groups)
    how = "bit-identical to" if not cuda else "allclose to"
    worst = max(diff for g in groups for _, diff in g.matches)
    per_group = ", ".join(f"{g.layout} {g.ok}/{len(g.workers)}" for g in groups)
    print()
    print(f"outputs match: {'yes' if all(g.ok == len(g.workers) for g in groups) else 'NO'} "
          f"({sum(g.ok for g in groups)}/{total} workers {how} the plain model's output: {per_group}; sha256 "
          f"{ref_sha[:12]}; max abs diff {worst:.3g})")
    print(f"/dev/shm clean: {'yes' if not left else 'NO: ' + ', '.join(left)}")
    if args.keep_logs:
        print(f"worker logs: {logs}")
    print(f"total time: {wall_s:.1f} s")


# ================================================================================================================
# Entry point
# ================================================================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="worker processes per group (default 4)")
    parser.add_argument("--size-gib", type=float, default=1.0, help="model size in GiB (default 1.0)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (seconds; what the test runs)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs and print where")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if not args.size_gib > 0:
        parser.error("--size-gib must be > 0")
    return args


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a terminated demo cleans up like an interrupted one
    try:
        return parent_main(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except DemoFailure as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
