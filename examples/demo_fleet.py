"""The parent side of the demo's workers: start a group, read its memory, stop it, clean up after it.

Why apart from ``demo.py``: this is the part that must never strand a process or a ``/dev/shm`` segment,
whatever the layout; the parent's script only decides what to run and how to report it. One group is the N
workers of one layout (``demo_worker.py``, whose docstring gives the protocol); :func:`run_group` runs it to the
end, reading every worker's ``/proc/<pid>/smaps_rollup`` once idle and once while all N hold their weights.

Workers run in their own session (process group) so a Ctrl-C reaches the parent only; on any failure the parent
SIGKILLs them and, for flextensor's group, reclaims the namespace with ``SharedOffloadSession.cleanup_namespace``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from demo_worker import MANAGER

logger = logging.getLogger("demo")

WORKER_SCRIPT = Path(__file__).resolve().parent / "demo_worker.py"
REPO = WORKER_SCRIPT.parent.parent
#: Heartbeat lease of the workers: short enough that reclaiming after a crash takes seconds, long enough that a
#: loaded 2-core host never misses a heartbeat (they come every lease/4 from a background thread).
LEASE_S = 10.0
WAIT_TIMEOUT_S = 300.0
START_TIMEOUT_S = 240.0

#: The lines of ``smaps_rollup`` the demo keeps (kB in the file, bytes here). ``Pss`` is the sum of the three
#: ``Pss_*`` kinds: anonymous (private heap: copies, activations), file (mapped files: the page cache) and shmem
#: (``/dev/shm`` and other tmpfs pages); ``Private_*`` / ``Shared_*`` split the resident pages by how many
#: processes map them.
SMAPS_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Shared_Clean", "Shared_Dirty",
                "Private_Clean", "Private_Dirty")


class DemoFailure(RuntimeError):
    """Something in the run went wrong; the message says what and where the logs are."""


def smaps_rollup(pid: int) -> dict[str, int]:
    """A process's memory by kind, in bytes, from ``/proc/<pid>/smaps_rollup`` (the fields of SMAPS_FIELDS)."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in SMAPS_FIELDS:
                found[key] = int(rest.split()[0]) * 1024
    return {key: found.get(key, 0) for key in SMAPS_FIELDS}


@dataclass
class Worker:
    """A worker process seen from the parent: its stdout split into lines by hand (select + os.read), so a
    worker that writes two lines at once never leaves one stranded in a file object's buffer."""

    index: int
    layout: str
    proc: subprocess.Popen
    log_path: Path
    out_path: Path
    lines: list[str] = field(default_factory=list)
    buffer: bytes = b""
    eof: bool = False
    idle: dict[str, int] = field(default_factory=dict)
    attached: dict[str, int] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def growth(self, key: str = "Pss") -> int:
        """What holding the weights added to this worker's ``key`` (attached minus idle)."""
        return self.attached[key] - self.idle[key]

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
    return DemoFailure(f"{worker.layout} worker {worker.index} (pid {worker.pid}) {what}; last lines of "
                       f"{worker.log_path}:\n{worker.log_tail()}")


def _next_line(workers: list[Worker], accept: Callable[[str], Any], timeout: float, what: str) -> dict[int, Any]:
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


def _stage(name: str) -> Callable[[str], dict[str, Any] | None]:
    def accept(line: str) -> dict[str, Any] | None:
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


def _start(layout: str, index: int, params: dict[str, Any], tmp: Path, logs: Path) -> Worker:
    log_path = logs / f"{layout}-worker{index}.log"
    out_path = tmp / f"{layout}-out{index}.bin"
    wparams = {**params, "out_path": str(out_path), "device": params["devices"][index % len(params["devices"])]}
    mode = [] if layout == "flextensor" else ["--baseline", layout]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(WORKER_SCRIPT), *mode, json.dumps(wparams)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
                                start_new_session=True)
    return Worker(index, layout, proc, log_path, out_path)


def run_group(layout: str, n: int, params: dict[str, Any], tmp: Path, logs: Path) -> list[Worker]:
    """Start N workers of ``layout``, read their idle memory, let them load, read it again while all N hold
    their weights, let them close. Any failure kills the group before it propagates."""
    workers: list[Worker] = []
    try:
        for i in range(n):
            workers.append(_start(layout, i, params, tmp, logs))
        _next_line(workers, _stage("loaded"), START_TIMEOUT_S, "its start-up")
        for w in workers:
            w.idle = smaps_rollup(w.pid)
        logger.info("%s: all %d workers started (torch imported, device set up); idle memory read; go", layout, n)
        for w in workers:
            w.send("go")
        results = _next_line(workers, _stage("result"), WAIT_TIMEOUT_S + 60, "a result")
        _next_line(workers, lambda line: True if line == "ready" else None, 60, '"ready"')
        for w in workers:
            w.result = results[w.index]
            w.attached = smaps_rollup(w.pid)
        logger.info("%s: all %d workers hold their weights; memory read while every one does; telling them to "
                    "close", layout, n)
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
