"""Child processes for the multi-process shm tests.

``python -m tests.shm.procs`` runs a small command interpreter: one JSON command per stdin line, one JSON
reply per stdout line. The child imports only ``flextensor.shm`` (never torch), so eight of them start in a
fraction of a second, and the test drives each one step by step (open, publish, wait, close) and kills
them with SIGKILL where a test needs a crash. ``Child`` is the parent-side handle.

Commands (``op``): open(ns, lease, timeout), ready, fail(message), wait(timeout), wait_close(timeout),
segment(kind, size),
lock(kind, backend), write_blob(kind, data), read_blob(kind), state, close(timeout), hold_lock(ns),
release_lock, sleep, wake(timeout), begin_update(version, complete), end_update(version), abort_update,
versions, exit. Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": <type>, "message": ...,
"creator_message": ...}``.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------- child side
def _serve() -> None:
    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.locks import FileLock
    from flextensor.shm.names import coordinator_lock_path

    coordinator: ShmCoordinator | None = None
    held: FileLock | None = None

    def reply(payload: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()

    reply({"ok": True, "hello": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            out: dict[str, Any] = {}
            if op == "open":
                coordinator = ShmCoordinator(cmd["ns"], lease_seconds=cmd.get("lease", 1.0),
                                             timeout=cmd.get("timeout"))
                out = {"is_creator": coordinator.is_creator, "generation": coordinator.generation,
                       "pid": os.getpid(), "slot": coordinator.lease_slot}
            elif op == "ready":
                coordinator.notify_ready()
            elif op == "fail":
                coordinator.mark_failed(RuntimeError(cmd["message"]))
            elif op == "wait":
                start = time.monotonic()
                try:
                    coordinator.wait_for_ready(cmd.get("timeout"))
                finally:
                    out["elapsed"] = time.monotonic() - start
            elif op == "segment":
                seg = coordinator.memory_owner.create_segment(cmd["kind"], cmd["size"])
                seg.buffer[: len(b"data")] = b"data"
                seg.close()
            elif op == "lock":
                lock = coordinator.memory_owner.create_lock(cmd["kind"], cmd["backend"])
                lock.acquire(5)
                lock.release()
                lock.close()
            elif op == "write_blob":
                coordinator.memory_owner.write_blob(cmd["kind"], bytes.fromhex(cmd["data"]))
            elif op == "read_blob":
                out["data"] = coordinator.memory_owner.read_blob(cmd["kind"]).hex()
            elif op == "wait_close":  # what a session does: wait for READY, and leave whatever happened
                start = time.monotonic()
                try:
                    coordinator.wait_for_ready(cmd.get("timeout"))
                finally:
                    out["elapsed"] = time.monotonic() - start
                    coordinator.close(5)
            elif op == "state":
                out["state"] = coordinator.state.name
            elif op == "close":
                coordinator.close(cmd.get("timeout"))
            elif op == "hold_lock":
                held = FileLock(coordinator_lock_path(cmd["ns"]))
                held.acquire(5)
            elif op == "release_lock":
                held.close()
                held = None
            elif op == "sleep":
                coordinator.participation.sleep()
            elif op == "wake":
                start = time.monotonic()
                try:
                    out["version"] = coordinator.participation.wake(cmd.get("timeout"))
                finally:
                    out["elapsed"] = time.monotonic() - start
            elif op == "begin_update":
                out["version"] = coordinator.participation.begin_update(cmd.get("version"),
                                                                        complete=cmd.get("complete", True))
            elif op == "end_update":
                coordinator.participation.end_update(cmd["version"])
            elif op == "abort_update":
                coordinator.participation.abort_update()
            elif op == "versions":
                participation = coordinator.participation
                out = {"published": participation.weights_version, "held": participation.held_version,
                       "activity": participation.activity.name}
            elif op == "exit":
                reply({"ok": True})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            reply({"ok": True, **out})
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test
            reply({"ok": False, "error": type(exc).__name__, "message": str(exc),
                   "creator_message": getattr(exc, "creator_message", None), "pids": getattr(exc, "pids", None),
                   **out})


# --------------------------------------------------------------------------------------------- parent side
class Child:
    """A ``python -m tests.shm.procs`` process driven over pipes (inherits TMPDIR from the test), forked from a
    server that imported nothing (``forkserver.BARE``): it imports flextensor.shm itself, never torch."""

    def __init__(self) -> None:
        from tests.helpers.forkserver import BARE, spawn_module

        self.proc = spawn_module("tests.shm.procs", [], cwd=ROOT, preload=BARE, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=2, text=True)  # stderr: the test's own
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def started(self, timeout: float = 30.0) -> Child:
        hello = self.recv(timeout)
        assert hello.get("hello") == self.pid, hello
        return self

    def send(self, op: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"child {self.pid} did not answer within {timeout} s") from None
        if line is None:
            raise EOFError(f"child {self.pid} exited (rc {self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.recv(timeout)

    def ok(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        reply = self.call(op, timeout, **args)
        assert reply["ok"], reply
        return reply

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Ask the child to exit (closing nothing it has not closed); SIGKILL if it does not."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def start_children(n: int) -> list[Child]:
    """Start ``n`` children at once and wait until each has imported flextensor.shm."""
    children = [Child() for _ in range(n)]
    for child in children:
        child.started()
    return children


if __name__ == "__main__":
    _serve()
