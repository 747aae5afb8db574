"""Worker processes forked from a server that imported torch once, for the multi-process tests.

A worker started as ``python -m MODULE`` spends most of its life importing torch: about 2 s of CPU each on a
2-core CI host, where the multi-process tests start dozens of them. ``spawn_module`` starts the same module in a
process forked from one server per test run that imported torch, ``torch._dynamo`` (which a follower building its
model on ``meta`` imports anyway: torch's meta initialisers load it, as does transformers) and pytest, and
nothing of flextensor. The worker is still a real process with its own pid, pipes, environment and working
directory; it imports flextensor and the module itself, runs the module as ``__main__`` and leaves through the
interpreter's normal shutdown (threads joined, atexit handlers run, modules torn down), so SIGKILL, exit codes and
leftovers mean what they mean for a fresh interpreter. ``fresh=True`` (and ``FLEXTENSOR_TEST_EXEC=1`` for every
worker) starts a fresh interpreter instead, for the tests that keep that path covered.

The server never touches CUDA (a process forked after CUDA started could not use it): on a CUDA host every worker
is a fresh interpreter.

Protocol (one control socket, the test process's end guarded by a lock): a request is one JSON line
``{"module", "args", "env", "cwd"}`` sent with four descriptors (the child's stdin, stdout, stderr and the write
end of a status pipe); the server answers ``{"pid": N}`` (or ``{"error": ...}``) and, once the child exited,
writes its raw wait status (decimal, newline) to the status pipe.
"""

from __future__ import annotations

import array
import atexit
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What the server imports before it forks: what every worker would import first anyway.
PRELOAD = ("torch", "torch._dynamo", "pytest")
_MAX_FDS = 4


# --------------------------------------------------------------------------------------------- server side
def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """One request and its descriptors; None once the test process closed its end."""
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
        if not msg:
            return None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        data += msg
    return json.loads(data), list(fds)


def _serve(conn: socket.socket) -> dict | None:
    """Fork one child per request. Returns the request in a child (which then runs it), None when the test
    process is gone (the server exits; running children are left alone, as subprocess leaves its children)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    status_fds: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([conn, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(status_fds)
        if conn not in ready:
            continue
        received = _receive(conn)
        if received is None:
            return None
        request, fds = received
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            conn.sendall((json.dumps({"error": f"fork failed: {exc}"}) + "\n").encode())
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w, fds[3], *status_fds.values()):
                os.close(fd)
            conn.close()
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            return request
        for fd in fds[:3]:
            os.close(fd)
        status_fds[pid] = fds[3]
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        _reap(status_fds)  # a SIGCHLD that arrived before the pid was known


def _reap(status_fds: dict[int, int]) -> None:
    """Hand the wait status of every exited child to its status pipe."""
    for pid in list(status_fds):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            fd = status_fds.pop(pid)
            try:
                os.write(fd, f"{status}\n".encode())
            except OSError:  # the test process no longer listens
                pass
            os.close(fd)


def _become(request: dict) -> None:
    """In the child: take the request's environment, directory and argv, as a fresh interpreter would."""
    import runpy
    import tempfile

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # TMPDIR is read again
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _server_main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    # The preloaded objects live as long as every child: moved out of the collector's sight, they are neither
    # scanned by each child's collections nor by its shutdown (about 1.5 s of CPU per worker otherwise).
    gc.freeze()
    request = _serve(conn)
    if request is not None:
        _become(request)


# --------------------------------------------------------------------------------------------- test side
class ForkedProcess:
    """The part of ``subprocess.Popen`` (text pipes) the tests use, for a child of the fork server."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int, status: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = open(stdin, "w", encoding="utf-8")
        self.stdout = open(stdout, "r", encoding="utf-8")
        self.stderr = open(stderr, "r", encoding="utf-8")
        self._status = os.fdopen(status, "rb")
        self.args = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        line = self._status.readline()
        self._status.close()
        if not line:
            raise RuntimeError(f"the fork server went away before worker {self.pid} exited")
        self.returncode = os.waitstatus_to_exitcode(int(line))

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Server:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forkserver", str(theirs.fileno())],
                                     cwd=ROOT, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        theirs.close()
        self.conn = ours
        self.answers = ours.makefile("rb")
        self.lock = threading.Lock()

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: Path) -> ForkedProcess:
        pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": str(cwd)}) + "\n"
        try:
            with self.lock:
                self.conn.sendmsg([request.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                        array.array("i", theirs))])
                answer = self.answers.readline()
        except BaseException:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise
        for fd in theirs:
            os.close(fd)
        reply = json.loads(answer) if answer else {"error": f"the fork server exited ({self.proc.poll()})"}
        if "pid" not in reply:
            for fd in (pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0]):
                os.close(fd)
            raise RuntimeError(reply["error"])
        return ForkedProcess(reply["pid"], pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0])

    def close(self) -> None:
        self.answers.close()
        self.conn.close()
        self.proc.wait(30)


_server: _Server | None = None
_server_lock = threading.Lock()


def forking_enabled() -> bool:
    """Fork from the server unless CUDA is present (see the module docstring) or FLEXTENSOR_TEST_EXEC=1."""
    if os.environ.get("FLEXTENSOR_TEST_EXEC") == "1":
        return False
    import torch

    return not torch.cuda.is_available()


def spawn_module(module: str, args: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT,
                 fresh: bool = False) -> ForkedProcess | subprocess.Popen:
    """``python -m module *args`` with text pipes on stdin, stdout and stderr: forked from the server unless
    ``fresh`` or not ``forking_enabled()``."""
    env = dict(os.environ if env is None else env)
    if fresh or not forking_enabled():
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            if _server is None:
                atexit.register(stop_server)
            _server = _Server()
        server = _server
    return server.spawn(module, args, env, cwd)


def stop_server() -> None:
    """Close the fork server (its end of the control socket: it exits). A later spawn starts a new one."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


if __name__ == "__main__":
    _server_main()
