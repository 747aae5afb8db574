"""flextensor's demo (``./dev.sh demo``): N worker processes share one host copy of a ~1 GiB model.

What it shows, in one run on any Linux host:

1. the parent builds a transformer-like model of about 1 GiB (``demo_model.py``; float32 on a CPU host, bf16 on
   a GPU host), saves it as a safetensors checkpoint, computes the plain model's output on a fixed input, and
   profiles it once with flextensor (every ``DemoBlock`` streams) into a profile directory;
2. N workers (default 4; this script with ``--worker``) each open ``ft.SharedOffloadSession(namespace)`` and call
   ``offload_from_profile``: the elected creator loads the checkpoint and publishes the weights into
   ``/dev/shm``; the followers build the model on ``meta`` and attach to the same pages. Each runs a forward;
3. while every worker is attached, the parent reads each one's PSS (``/proc/<pid>/smaps_rollup``) and prints
   them beside what N private copies would cost, checks every output against the plain model's, and checks that
   nothing of the run is left in ``/dev/shm`` or the lock directory after the workers closed.

Worker protocol (one line each on the worker's stdout; the parent answers on its stdin):

    worker -> {"stage": "loaded", ...}    imports and device set-up done (the parent reads the idle PSS)
    parent -> go
    worker -> {"stage": "result", ...}    role, generation, time to ready, output checksum (output in a file)
    worker -> ready                       holding the model until told otherwise
    parent -> exit                        (EOF means the same: a dead parent never strands a worker)
    worker -> {"stage": "error", ...}     instead of "result" when the session failed (exit status 3)

Workers run in their own session (process group) so a Ctrl-C reaches the parent only; on any failure the parent
SIGKILLs them and reclaims the namespace with ``SharedOffloadSession.cleanup_namespace``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _path in (str(HERE), str(REPO)):  # demo_model, and bench.common for PSS and tables
    if _path not in sys.path:
        sys.path.insert(0, _path)

from bench.common import machine_description, pss_bytes, table  # noqa: E402

logger = logging.getLogger("demo")

MANAGER = "model"
#: Heartbeat lease of the workers: short enough that reclaiming after a crash takes seconds, long enough that a
#: loaded 2-core host never misses a heartbeat (they come every lease/4 from a background thread).
LEASE_S = 10.0
WAIT_TIMEOUT_S = 300.0
START_TIMEOUT_S = 240.0


class DemoFailure(RuntimeError):
    """Something in the run went wrong; the message says what and where the logs are."""


# ================================================================================================================
# Small helpers
# ================================================================================================================


def human(nbytes: float) -> str:
    """Bytes as GiB above one GiB, else MiB (or KiB for the tiny --quick model)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def shm_pss(pid: int, namespace: str) -> int:
    """The part of a process's PSS that lies in this run's ``/dev/shm`` segments (the shared weights)."""
    total, ours = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping header: "addr-addr perms offset dev inode path"
                parts = line.split()
                ours = len(parts) >= 6 and parts[5].startswith("/dev/shm/") and namespace in parts[5]
            elif ours and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


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


# ================================================================================================================
# Worker side
# ================================================================================================================


def _emit(payload: dict[str, Any] | str) -> None:
    print(payload if isinstance(payload, str) else json.dumps(payload), flush=True)


def worker_main(params: dict[str, Any]) -> int:
    """One worker: join the shared session, run the forward, report, hold until told to exit, close."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(process)d %(name)s: %(message)s", datefmt="%H:%M:%S")
    import torch

    import flextensor as ft
    import flextensor.api  # noqa: F401 - imported before the clock starts, like a real worker would have it
    import flextensor.profiles  # noqa: F401
    import safetensors.torch  # noqa: F401

    from demo_model import DemoSpec, build_meta, build_random, demo_tokens, load_checkpoint, quick_spec

    spec = DemoSpec(**params["spec"])
    device = torch.device(params["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context belongs to the idle baseline, not to the weights
    tokens = demo_tokens(spec, seq=params["seq"]).to(device)
    # What any worker pays before it holds weights belongs to the idle baseline, not to the model: the first meta
    # model's one-off torch set-up, and the math libraries a first forward loads (cuBLAS, attention kernels:
    # hundreds of MiB of host memory with CUDA). A tiny model of the same dtype on the same device does both.
    warm = quick_spec(spec.torch_dtype, layers=1)
    with torch.no_grad():
        build_random(warm, device=device)(demo_tokens(warm, seq=params["seq"]).to(device))
    del warm
    _emit({"stage": "loaded", "pid": os.getpid()})
    if sys.stdin.readline().strip() != "go":
        return 1  # the parent went away before the start

    if device.type == "cuda":
        config = ft.OffloadConfig(include_patterns=[params["pattern"]], pinned_memory=True, gpu_device=device.index)
    else:
        config = ft.OffloadConfig(include_patterns=[params["pattern"]], pinned_memory=False,
                                  num_blocks=params["num_blocks"], min_blocks=params["num_blocks"])
    session = ft.SharedOffloadSession(params["namespace"], wait_timeout=params["wait_timeout"],
                                      lease_seconds=params["lease"])
    status = 0
    try:
        model = session.offload_from_profile(
            params["profile_dir"], config=config, name=MANAGER,
            creator_model_factory=lambda: load_checkpoint(spec, params["checkpoint"]),
            follower_model_factory=lambda: build_meta(spec),
        )
        with torch.no_grad():
            out = model(tokens).float().cpu().contiguous()
        data = out.numpy().tobytes()
        Path(params["out_path"]).write_bytes(data)
        share = next(s for s in session.report() if s["manager"] == MANAGER)
        _emit({"stage": "result", "role": share["role"], "generation": share["generation"],
               "ready_s": share["ready_s"], "wait_s": share["wait_s"], "shared_bytes": share["shared_bytes"],
               "block_bytes": ft.get_gpu_memory_usage(MANAGER).block_bytes,
               "sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data), "shape": list(out.shape)})
        _emit("ready")
        sys.stdin.readline()  # "exit", or EOF when the parent died
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        logging.getLogger("demo.worker").exception("worker failed")
        try:
            _emit({"stage": "error", "error": type(exc).__name__, "message": str(exc)})
        except BrokenPipeError:
            pass
        status = 3
    finally:
        session.close()
    return status


# ================================================================================================================
# Parent side: the workers
# ================================================================================================================


@dataclass
class Worker:
    """A worker process seen from the parent: its stdout split into lines by hand (select + os.read), so a
    worker that writes two lines at once never leaves one stranded in a file object's buffer."""

    index: int
    proc: subprocess.Popen
    log_path: Path
    out_path: Path
    lines: list[str] = field(default_factory=list)
    buffer: bytes = b""
    eof: bool = False
    pss_idle: int = 0
    pss_attached: int = 0
    pss_shared: int = 0
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def pump(self) -> None:
        chunk = os.read(self.fileno(), 65536)
        if not chunk:
            self.eof = True
            return
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        self.lines.extend(line.decode(errors="replace").strip() for line in complete)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: the next read sees EOF and reports it

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(f"    {line}" for line in lines[-n:])


def _failure(worker: Worker, what: str) -> DemoFailure:
    return DemoFailure(f"worker {worker.index} (pid {worker.pid}) {what}; last lines of {worker.log_path}:\n"
                       f"{worker.log_tail()}")


def _next_line(workers: list[Worker], accept, timeout: float, what: str) -> dict[int, Any]:
    """Read until every worker produced a line ``accept`` takes (returns its value); fail fast on an error line,
    on EOF or at the deadline."""
    pending = {w.index: w for w in workers}
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for w in list(pending.values()):
            while w.lines:
                line = w.lines.pop(0)
                if line.startswith("{") and json.loads(line).get("stage") == "error":
                    err = json.loads(line)
                    raise _failure(w, f"failed: {err['error']}: {err['message']}")
                value = accept(line)
                if value is not None:
                    got[w.index] = value
                    del pending[w.index]
                    break
            if w.index in pending and w.eof:
                raise _failure(w, f"exited (status {w.proc.wait()}) before {what}")
        if not pending:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            raise DemoFailure(f"workers {sorted(pending)} did not report {what} within {timeout:.0f} s")
        readable, _, _ = select.select(list(pending.values()), [], [], min(left, 1.0))
        for w in readable:
            w.pump()
    return got


def _stage(name: str):
    def accept(line: str):
        if line.startswith("{"):
            msg = json.loads(line)
            if msg.get("stage") == name:
                return msg
        return None
    return accept


def _kill(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.killpg(w.pid, signal.SIGKILL)  # its own process group: start_new_session=True
            except ProcessLookupError:
                pass
    for w in workers:
        try:
            w.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            logger.warning("worker %d (pid %d) did not die after SIGKILL", w.index, w.pid)


def _close_pipes(workers: list[Worker]) -> None:
    for w in workers:
        for stream in (w.proc.stdin, w.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


def run_workers(n: int, params: dict[str, Any], tmp: Path, logs: Path) -> list[Worker]:
    """Start the workers, take the idle PSS, let them attach, take the attached PSS, let them close."""
    workers: list[Worker] = []
    try:
        for i in range(n):
            log_path = logs / f"worker{i}.log"
            out_path = tmp / f"out{i}.bin"
            wparams = {**params, "out_path": str(out_path), "device": params["devices"][i % len(params["devices"])]}
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(wparams)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO, start_new_session=True,
                )
            workers.append(Worker(i, proc, log_path, out_path))
        _next_line(workers, _stage("loaded"), START_TIMEOUT_S, "its start-up")
        for w in workers:
            w.pss_idle = pss_bytes(w.pid)
        logger.info("all %d workers started (torch imported, device set up); idle PSS read; go", n)
        for w in workers:
            w.send("go")
        results = _next_line(workers, _stage("result"), WAIT_TIMEOUT_S + 60, "a result")
        _next_line(workers, lambda line: True if line == "ready" else None, 60, '"ready"')
        for w in workers:
            w.result = results[w.index]
            w.pss_attached = pss_bytes(w.pid)
            w.pss_shared = shm_pss(w.pid, params["compact_ns"])
        logger.info("all %d workers ready; PSS read while every one is attached; telling them to close", n)
        for w in workers:
            w.send("exit")
        for w in workers:
            status = w.proc.wait(timeout=120)
            if status != 0:
                raise _failure(w, f"exited with status {status} while closing")
        return workers
    except BaseException:
        _kill(workers)
        raise
    finally:
        _close_pipes(workers)


def leftovers(compact_ns: str) -> list[str]:
    """What this run still has in ``/dev/shm`` and the lock directory (segments, semaphores, journal, lock)."""
    from flextensor.shm.names import lock_directory

    found = [f"/dev/shm/{name}" for name in sorted(os.listdir("/dev/shm")) if compact_ns in name]
    lock_dir = lock_directory()
    found += [str(lock_dir / name) for name in sorted(os.listdir(lock_dir)) if name.startswith(compact_ns)]
    return found


def reclaim(namespace: str) -> None:
    """Remove what killed workers left: journal and leases only (waits for their leases to run out)."""
    import flextensor as ft

    logger.info("reclaiming namespace %s (waiting up to %.0f s for the dead workers' leases)", namespace, LEASE_S + 5)
    try:
        reports = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=[MANAGER], timeout=LEASE_S + 5)
        removed = sum(len(r.removed) for r in reports)
        logger.info("namespace %s reclaimed (%d resources removed)", namespace, removed)
    except Exception as exc:  # noqa: BLE001 - tell the user how to finish the job
        logger.error("could not reclaim namespace %s: %s; retry with "
                     "flextensor.SharedOffloadSession.cleanup_namespace(%r, manager_names=[%r])",
                     namespace, exc, namespace, MANAGER)


# ================================================================================================================
# Parent side: the run
# ================================================================================================================


def _plain_output(model, tokens, device):
    import torch

    model.to(device)
    try:
        with torch.no_grad():
            return model(tokens.to(device)).float().cpu()
    finally:
        model.to("cpu")


def _profile(model, tokens, device, config, profile_dir: Path) -> int:
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


def _matches(out, ref, exact: bool) -> tuple[bool, float]:
    import torch

    if out.shape != ref.shape:
        return False, float("inf")
    diff = float((out - ref).abs().max()) if out.numel() else 0.0
    if exact:
        return bool(torch.equal(out, ref)), diff
    scale = float(ref.abs().max()) or 1.0
    return bool(torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * scale)), diff


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

    print(f"flextensor demo: {args.workers} workers share one host copy of a {human(spec.total_bytes())} model")
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name(0)}" + (f" (+{torch.cuda.device_count() - 1} more; workers spread "
              "over them)" if torch.cuda.device_count() > 1 else ""))
    else:
        print("CPU host (no CUDA): computing on the CPU; the shared host copy works the same")
    print(f"machine: {machine_description()}")
    print(flush=True)

    with tempfile.TemporaryDirectory(prefix="flextensor-demo-") as tmp_name:
        tmp = Path(tmp_name)

        logger.info("building model: %d x DemoBlock, hidden %d, vocab %d, %.3g M parameters, %s %s",
                    spec.layers, spec.hidden, spec.vocab, spec.total_params() / 1e6, human(spec.total_bytes()),
                    spec.dtype)
        model = build_random(spec, seed=0, device=device).to("cpu")
        checkpoint = tmp / "model.safetensors"
        logger.info("saving checkpoint %s (what the elected creator will load)", checkpoint.name)
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
        # Outside the temporary directory: the logs outlive a failed run (and a --keep-logs one).
        logs = Path(tempfile.mkdtemp(prefix="flextensor-demo-logs-"))
        logger.info("starting %d workers (namespace %s -> /dev/shm/%s.*, logs in %s)", args.workers, namespace,
                    compact_ns, logs)
        try:
            workers = run_workers(args.workers, params, tmp, logs)
        except BaseException:
            reclaim(namespace)
            logger.info("worker logs kept in %s", logs)
            raise
        if not args.keep_logs:
            shutil.rmtree(logs, ignore_errors=True)
        left = leftovers(compact_ns)
        if left:
            logger.error("the workers closed but left %s", left)
            reclaim(namespace)
        else:
            logger.info("all workers closed; nothing of namespace %s left in /dev/shm or the lock directory",
                        namespace)

        matches = []
        for w in workers:
            out = torch.frombuffer(bytearray(w.out_path.read_bytes()), dtype=torch.float32)
            out = out.reshape(w.result["shape"])
            matches.append(_matches(out, reference, exact=not cuda))
        ref_sha = hashlib.sha256(reference.contiguous().numpy().tobytes()).hexdigest()

    _print_summary(args, spec, workers, matches, ref_sha, cuda, num_blocks, left, time.monotonic() - start)
    return 0 if all(ok for ok, _ in matches) and not left else 1


def _print_summary(args, spec, workers: list[Worker], matches, ref_sha: str, cuda: bool, num_blocks: int,
                   left: list[str], wall_s: float) -> None:
    n = len(workers)
    model_bytes = spec.total_bytes()
    rows = []
    for w, (ok, _) in zip(workers, matches):
        r = w.result
        rows.append([w.index, w.pid, r["role"], r["generation"], f"{r['ready_s'] * 1000:.0f} ms",
                     f"{r['wait_s'] * 1000:.0f} ms", human(w.pss_idle), human(w.pss_attached),
                     human(w.pss_shared), r["sha256"][:12] + ("" if ok else " (MISMATCH)")])
    print()
    print(table(["worker", "pid", "role", "generation", "time to ready", "of which waiting", "PSS idle",
                 "PSS attached", "in /dev/shm", "output sha256"], rows))
    print()
    idle = sum(w.pss_idle for w in workers)
    attached = sum(w.pss_attached for w in workers)
    shared = sum(w.pss_shared for w in workers)
    private = n * model_bytes + idle
    blocks = max(w.result["block_bytes"] for w in workers)
    pad = " " * 32
    print(f"Host RAM (PSS) of the {n} workers while all were attached; model {human(model_bytes)}:")
    print(f"  {'with flextensor, measured':<28}{human(attached):>11} = idle baseline {human(idle)}")
    print(f"{pad}+ weights in /dev/shm {human(shared)} (one copy, split among the workers)")
    print(f"{pad}+ private {human(attached - idle - shared)} (block buffers, activations, allocator)")
    print(f"  {f'{n} private copies, estimated':<28}{human(private):>11} = {n} x {human(model_bytes)} weights "
          f"+ the same idle baseline")
    print(f"  {'ratio':<28}{attached / private:>11.2f}   (saves {human(private - attached)})")
    if args.quick:
        print("  (--quick: the model is tiny, so the ratio shows only each worker's fixed costs)")
    if not cuda:
        print(f"  CPU host: the compute device is host memory too, so each worker also holds its rotating block\n"
              f"  buffers privately ({num_blocks} x largest block = {human(blocks)} per worker, in 'private' above);"
              f"\n  on a GPU host they live in device memory.")
    all_ok = all(ok for ok, _ in matches)
    how = "bit-identical to" if not cuda else "allclose to"
    worst = max(diff for _, diff in matches)
    print()
    print(f"outputs match: {'yes' if all_ok else 'NO'} ({sum(ok for ok, _ in matches)}/{n} workers {how} the plain "
          f"model's output, sha256 {ref_sha[:12]}; max abs diff {worst:.3g})")
    print(f"/dev/shm clean: {'yes' if not left else 'NO: ' + ', '.join(left)}")
    if args.keep_logs:
        print(f"worker logs: {workers[0].log_path.parent}")
    print(f"total time: {wall_s:.1f} s")


# ================================================================================================================
# Entry point
# ================================================================================================================


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--size-gib", type=float, default=1.0, help="model size in GiB (default 1.0)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (seconds; what the test runs)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' logs and print where")
    parser.add_argument("--worker", metavar="PARAMS_JSON", help=argparse.SUPPRESS)
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
    if args.worker is not None:
        return worker_main(json.loads(args.worker))
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
