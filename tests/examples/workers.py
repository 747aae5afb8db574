"""Worker processes of ``examples/supervisor.py --worker`` driven directly by a test (stdin commands, JSON lines)."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from pathlib import Path

from tests.examples.conftest import EXAMPLES, REPO
from tests.helpers.forkserver import TRANSFORMERS, spawn_script


class ExampleWorker:
    """``supervisor.py --worker``: reports ``ready`` (role, tokens), answers ``generate``, closes on EOF. Forked
    with torch and transformers already imported (tests/helpers/forkserver.py), in a session of its own."""

    def __init__(self, namespace: str, index: int, model_argv: list[str], env: dict[str, str], log: Path,
                 lease: float = 2.0) -> None:
        self.index = index
        self.log = log
        with open(log, "wb") as err:
            self.proc = spawn_script(
                EXAMPLES / "supervisor.py",
                [*model_argv, "--worker", "--index", str(index), "--namespace", namespace, "--lease", str(lease)],
                env=env, cwd=REPO, preload=TRANSFORMERS, stderr=err, text=False, new_session=True)
        self.buffer = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read(self, timeout: float) -> dict:
        """The next JSON line, or fail with the worker's log."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"worker {self.index} said nothing within {timeout} s; log:\n{self.tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise AssertionError(f"worker {self.index} exited ({self.proc.wait()}); log:\n{self.tail()}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()

    def close(self, timeout: float = 30) -> int:
        """EOF on stdin: the worker closes its session and exits."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        status = self.proc.wait(timeout=timeout)
        self.proc.stdout.close()
        return status

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


class Jobs:
    """The test's worker processes and namespaces: on teardown every worker still running is killed and each
    namespace is reclaimed with ``cleanup_namespace`` (a failing test leaves nothing behind either)."""

    def __init__(self, env: dict[str, str], logs: Path, lease: float = 2.0) -> None:
        self.env, self.logs, self.lease = env, logs, lease
        self.workers: list[ExampleWorker] = []
        self.namespaces: set[str] = set()

    def start(self, namespace: str, index: int, model_argv: list[str]) -> ExampleWorker:
        self.namespaces.add(namespace)
        worker = ExampleWorker(namespace, index, model_argv, self.env,
                               self.logs / f"{namespace}-{index}-{len(self.workers)}.log", lease=self.lease)
        self.workers.append(worker)
        return worker

    def teardown(self) -> None:
        import flextensor as ft

        killed = [w for w in self.workers if w.proc.poll() is None]
        for w in killed:
            w.kill()
        for ns in sorted(self.namespaces):
            ft.SharedOffloadSession.cleanup_namespace(ns, manager_names=["llm"], timeout=self.lease + 10)
