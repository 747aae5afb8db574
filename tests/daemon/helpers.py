"""Real processes for the daemon tests: ``ftd serve`` as a subprocess, workers, and the CLI in-process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers.forkserver import BARE, ForkedProcess, spawn_module

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def wait_until(predicate, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return value
        time.sleep(interval)


class Daemon:
    """``python -m flextensor.daemon.cli serve`` in a process of its own (forked from a server that imported
    nothing, ``forkserver.BARE``: it imports flextensor itself), with its stderr in a log file."""

    def __init__(self, socket_path: Path, lock_dir: Path, *, reap_interval: float = 0.2, extra: list[str] = ()) -> None:
        self.socket = Path(socket_path)
        self.lock_dir = Path(lock_dir)
        self.reap_interval = reap_interval
        self.extra = list(extra)
        self.log = self.socket.parent.parent / f"ftd-{self.socket.parent.name}.log"
        self.proc: subprocess.Popen | ForkedProcess | None = None

    def start(self, wait: bool = True) -> Daemon:
        env = dict(os.environ, FT_DAEMON_SOCKET=str(self.socket))
        with open(self.log, "ab") as log:
            self.proc = spawn_module(
                "flextensor.daemon.cli",
                ["serve", "--socket", str(self.socket), "--lock-dir", str(self.lock_dir), "--reap-interval",
                 str(self.reap_interval), "--log-level", "DEBUG", *self.extra],
                cwd=REPO, env=env, preload=BARE, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                text=False)
        if wait:
            ok = wait_until(lambda: self.proc.poll() is not None or self.answers(), 10.0, 0.02)
            assert ok and self.proc.poll() is None, f"ftd did not start:\n{self.read_log()}"
        return self

    def answers(self) -> bool:
        from flextensor.shm import ftd_protocol as proto
        from flextensor.shm.ftd_client import DaemonUnavailableError, request

        try:
            return isinstance(request(proto.StatusRequest(), 0.5, path=str(self.socket)), proto.StatusReply)
        except DaemonUnavailableError:
            return False

    def read_log(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"ftd did not exit on signal {sig}:\n{self.read_log()}") from None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cli(self, *args: str, expect: int | None = 0) -> tuple[int, object, str]:
        """Run the CLI in this process with --socket and --json; returns (exit code, parsed JSON, stderr)."""
        return run_cli(*args, "--socket", str(self.socket), "--json", expect=expect)


def run_cli(*args: str, expect: int | None = 0) -> tuple[int, object, str]:
    from flextensor.daemon.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    text = out.getvalue()
    try:
        data = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        data = text
    if expect is not None:
        assert code == expect, f"ftd {' '.join(args)} exited {code}, expected {expect}; stdout={text!r} " \
                               f"stderr={err.getvalue()!r}"
    return code, data, err.getvalue()


class Worker:
    """``python -m tests.daemon.worker`` (see worker.py); events are read from its stdout. Forked from a server
    that imported nothing (``forkserver.BARE``), unless started under a ``cmd_prefix`` (another namespace)."""

    def __init__(self, base: str, manager: str, *args: str, socket: Path | str | None = None,
                 env: dict | None = None, cmd_prefix: list[str] = ()) -> None:
        full_env = dict(os.environ if env is None else env)
        if socket is not None:
            full_env["FT_DAEMON_SOCKET"] = str(socket)
        if cmd_prefix:
            self.proc = subprocess.Popen(
                [*cmd_prefix, PY, "-m", "tests.daemon.worker", base, manager, *args], cwd=REPO, env=full_env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        else:
            self.proc = spawn_module("tests.daemon.worker", [base, manager, *args], cwd=REPO, env=full_env,
                                     preload=BARE, text=False)
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self._stderr: list[bytes] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.events.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_event(self, name: str, timeout: float = 15.0) -> dict:
        for event in self.seen:
            if event["event"] == name:
                return event
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"worker {self.pid} sent no {name!r} event within {timeout} s; seen "
                                     f"{self.seen}; stderr:\n{self.stderr()}") from None
            if event is None:
                self.events.put(None)
                raise AssertionError(f"worker {self.pid} exited without {name!r}; seen {self.seen}; "
                                     f"stderr:\n{self.stderr()}")
            self.seen.append(event)
            if event["event"] == name:
                return event

    def has(self, name: str) -> bool:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            if event is None:
                self.events.put(None)
                break
            self.seen.append(event)
        return any(e["event"] == name for e in self.seen)

    def stderr(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    def close(self, timeout: float = 10.0) -> int:
        """Let the worker close its coordinator cleanly (stdin EOF) and exit."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)
