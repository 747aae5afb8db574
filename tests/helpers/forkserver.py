"""Worker processes forked from a server that imported torch once, for the multi-process tests.

A worker started as ``python -m MODULE`` spends most of its life importing torch: about 2 s of CPU each on a
2-core CI host, where the multi-process tests start dozens of them (a transformers worker pays as much again).
``spawn_module``, ``spawn_script`` and ``spawn_code`` (``python -c``) start the same worker in a process forked
from a server that imported the ``preload`` modules and nothing of flextensor: torch, ``torch._dynamo`` (which a
follower building its model on ``meta`` imports anyway: torch's meta initialisers load it, as does transformers)
and pytest, plus transformers' Llama for the example workers (``TRANSFORMERS``). One server per preload set
serves the whole run.

The worker is still a real process with its own pid, pipes, environment, working directory, ``sys.path`` and
torch thread count (from its own ``OMP_NUM_THREADS``); it imports flextensor and the worker itself (from sources the
server compiled once, as a ``__pycache__`` would give them: ``_compile_sources_once``), runs it as
``__main__`` and leaves through the interpreter's normal shutdown (threads joined, atexit handlers run, modules
torn down), so SIGKILL, exit codes and leftovers mean what they mean for a fresh interpreter. ``fresh=True`` (and
``FLEXTENSOR_TEST_EXEC=1`` for every worker) starts a fresh interpreter instead, for the tests that keep that
path covered. The server never touches CUDA (a process forked after CUDA started could not use it): on a CUDA
host every worker is a fresh interpreter.

Protocol (one control socket per server, the test process's end guarded by a lock): a request is one JSON line
``{"kind": "module"|"script"|"code", "target", "args", "env", "cwd", "new_session"}`` sent with four descriptors
(the child's stdin, stdout, stderr and the write end of a status pipe); the server answers ``{"pid": N}`` (or
``{"error": ...}``) and, once the child exited, writes its raw wait status (decimal, newline) to the status pipe.
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
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
#: What a session worker imports first anyway (see the module docstring for torch._dynamo).
TORCH = ("torch", "torch._dynamo", "pytest")
#: Nothing: for the workers of the shm and daemon tests (flextensor.shm, ftd), which never load torch.
BARE: tuple[str, ...] = ()
#: What an example worker (``--tiny-llama``) imports first anyway.
TRANSFORMERS = (*TORCH, "transformers", "transformers.models.auto.modeling_auto",
                "transformers.models.llama.modeling_llama", "transformers.generation.utils")
_MAX_FDS = 4
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read once, as a library loads: the child applies its own


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


def _become(request: dict, server_path: list[str]) -> None:
    """In the child: take the request's session, environment, directory, ``sys.path``, thread count and argv, as a
    fresh interpreter would, then run the worker as ``__main__``."""
    import runpy
    import tempfile
    import types

    if request["new_session"]:
        os.setsid()
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # TMPDIR is read again
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    kind = request["kind"]
    first = {"script": str(Path(request["target"]).resolve().parent), "module": os.getcwd(), "code": ""}[kind]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *server_path]
    sys.argv = ["-c" if kind == "code" else request["target"], *request["args"]]
    if kind == "script":
        runpy.run_path(request["target"], run_name="__main__")
    elif kind == "module":
        runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
    else:
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(request["target"], "<string>", "exec"), main.__dict__)


#: The checkout's own sources that a worker imports after the fork: flextensor, the workers, the examples.
_SOURCE_FOLDERS = ("client", "shm", "daemon", "tests/helpers", "examples")


def _compile_sources_once() -> None:
    """Compile the checkout's sources here, once, for every child: each child still imports (and runs) every
    module itself, but a source identical to the one compiled here is not compiled again. Without it every child
    compiles all it imports wherever no ``__pycache__`` is written (``PYTHONDONTWRITEBYTECODE=1``, as in the
    sandboxes this suite runs in): about 0.1-0.2 s per worker. A file changed since is compiled as usual."""
    import importlib.machinery

    loader = importlib.machinery.SourceFileLoader
    compile_source = loader.source_to_code
    compiled: dict[str, tuple[bytes, Any]] = {}
    for folder in _SOURCE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            try:
                data = path.read_bytes()
                compiled[str(path)] = (data, compile(data, str(path), "exec", dont_inherit=True))
            except (OSError, SyntaxError, ValueError):
                continue

    def source_to_code(self, data, path, *, _optimize=-1):
        known = compiled.get(path) if _optimize == -1 else None
        if known is not None and known[0] == data:
            return known[1]
        return compile_source(self, data, path, _optimize=_optimize)

    loader.source_to_code = source_to_code


def _server_main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    for name in sys.argv[2:]:
        __import__(name)
    _compile_sources_once()
    # The preloaded objects live as long as every child: moved out of the collector's sight, they are neither
    # scanned by each child's collections nor by its shutdown (about 1.5 s of CPU per worker otherwise).
    gc.freeze()
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    server_path = [p for p in sys.path[1:] if p not in own]  # what the interpreter adds by itself
    request = _serve(conn)
    if request is not None:
        _become(request, server_path)


# --------------------------------------------------------------------------------------------- test side
class ForkedProcess:
    """The part of ``subprocess.Popen`` the tests use, for a child of a fork server."""

    def __init__(self, pid: int, pipes: list[int | None], status: int, text: bool) -> None:
        self.pid = pid
        self.args = None
        self.returncode: int | None = None
        modes = ("w", "r", "r")
        self.stdin, self.stdout, self.stderr = (
            None if fd is None else open(fd, mode, encoding="utf-8") if text else open(fd, mode + "b")
            for fd, mode in zip(pipes, modes))
        self._status = os.fdopen(status, "rb")

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
    def __init__(self, preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {k: v for k, v in os.environ.items() if k not in _THREAD_VARS}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.forkserver", str(theirs.fileno()),
                                      *preload], cwd=ROOT, env=env, pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.conn = ours
        self.answers = ours.makefile("rb")
        self.lock = threading.Lock()

    def spawn(self, request: dict, stdio: tuple[Any, Any, Any], text: bool) -> ForkedProcess:
        mine: list[int | None] = []  # our ends of the pipes (None where the caller gave a file)
        theirs: list[int] = []
        to_close: list[int] = []  # descriptors we opened for the child only
        for index, spec in enumerate(stdio):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                ours, child = (w, r) if index == 0 else (r, w)
                mine.append(ours)
                theirs.append(child)
                to_close.append(child)
            elif spec == subprocess.DEVNULL or spec is None:
                fd = os.open(os.devnull, os.O_RDWR)
                mine.append(None)
                theirs.append(fd)
                to_close.append(fd)
            else:
                mine.append(None)
                theirs.append(spec if isinstance(spec, int) else spec.fileno())
        status_r, status_w = os.pipe()
        theirs.append(status_w)
        to_close.append(status_w)
        line = json.dumps(request) + "\n"
        try:
            with self.lock:
                self.conn.sendmsg([line.encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", theirs))])
                answer = self.answers.readline()
            reply = json.loads(answer) if answer else {"error": f"the fork server exited ({self.proc.poll()})"}
            if "pid" not in reply:
                raise RuntimeError(reply["error"])
        except BaseException:
            for fd in [*(m for m in mine if m is not None), status_r]:
                os.close(fd)
            raise
        finally:
            for fd in to_close:
                os.close(fd)
        return ForkedProcess(reply["pid"], mine, status_r, text)

    def close(self) -> None:
        self.answers.close()
        self.conn.close()
        self.proc.wait(30)


_servers: dict[tuple[str, ...], _Server] = {}
_servers_lock = threading.Lock()


def forking_enabled(preload: tuple[str, ...] = TORCH) -> bool:
    """Fork from a server unless CUDA is present (see the module docstring) or FLEXTENSOR_TEST_EXEC=1.
    ``FLEXTENSOR_TEST_EXEC=0`` is the answer a test process hands to a helper process it starts (``fork_env``):
    fork, without importing torch to ask. A server that imports no torch (``BARE``) never touched CUDA: its
    children may use it, so it forks on a CUDA host too (and this asks nothing of torch)."""
    value = os.environ.get("FLEXTENSOR_TEST_EXEC")
    if value in ("0", "1"):
        return value == "0"
    if "torch" not in preload:
        return True
    import torch

    return not torch.cuda.is_available()


def fork_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a helper process that starts workers itself: it carries this process's ``forking_enabled()``,
    which the helper then need not import torch to learn."""
    return {**env, "FLEXTENSOR_TEST_EXEC": "0" if forking_enabled() else "1"}


def _server(preload: tuple[str, ...]) -> _Server:
    """The running server of ``preload``, started now if there is none (its imports go on in the background:
    the first request waits for them)."""
    with _servers_lock:
        server = _servers.get(preload)
        if server is None or server.proc.poll() is not None:
            if not _servers:
                atexit.register(stop_servers)
            server = _servers[preload] = _Server(preload)
        return server


def prestart(preload: tuple[str, ...] = TORCH) -> None:
    """Start the server of ``preload`` ahead of its first worker, if forking is on: it imports while the test
    process goes on with other tests, and the first worker is forked without waiting for those imports."""
    if forking_enabled(preload):
        _server(preload)


def _spawn(kind: str, target: str, args: list[str], *, env: dict[str, str] | None, cwd: Path, fresh: bool,
           preload: tuple[str, ...], stdin: Any, stdout: Any, stderr: Any, text: bool,
           new_session: bool) -> ForkedProcess | subprocess.Popen:
    env = dict(os.environ if env is None else env)
    if fresh or not forking_enabled(preload):
        command = [sys.executable, *{"module": ["-m"], "code": ["-c"]}.get(kind, []), target, *args]
        return subprocess.Popen(command, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=new_session)
    server = _server(preload)
    request = {"kind": kind, "target": target, "args": list(args), "env": env, "cwd": str(cwd),
               "new_session": new_session}
    return server.spawn(request, (stdin, stdout, stderr), text)


_DEFAULTS: dict[str, Any] = dict(env=None, cwd=ROOT, fresh=False, preload=TORCH, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, new_session=False)


def spawn_module(module: str, args: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT,
                 fresh: bool = False, preload: tuple[str, ...] = TORCH, stdin: Any = subprocess.PIPE,
                 stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE, text: bool = True,
                 new_session: bool = False) -> ForkedProcess | subprocess.Popen:
    """``python -m module *args`` (stdio as for ``subprocess.Popen``: ``PIPE``, ``DEVNULL`` or a file), forked
    from the server of ``preload`` unless ``fresh`` or not ``forking_enabled()``."""
    return _spawn("module", module, args, env=env, cwd=cwd, fresh=fresh, preload=preload, stdin=stdin,
                  stdout=stdout, stderr=stderr, text=text, new_session=new_session)


def spawn_script(path: str | Path, args: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT,
                 fresh: bool = False, preload: tuple[str, ...] = TORCH, stdin: Any = subprocess.PIPE,
                 stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE, text: bool = True,
                 new_session: bool = False) -> ForkedProcess | subprocess.Popen:
    """``python path *args``, as ``spawn_module``."""
    return _spawn("script", str(path), args, env=env, cwd=cwd, fresh=fresh, preload=preload, stdin=stdin,
                  stdout=stdout, stderr=stderr, text=text, new_session=new_session)


def spawn_code(code: str, args: Sequence[str] = (), **options: Any) -> ForkedProcess | subprocess.Popen:
    """``python -c code *args``, as ``spawn_module`` (same keyword options)."""
    return _spawn("code", code, list(args), **{**_DEFAULTS, **options})


def run_code(code: str, args: Sequence[str] = (), *, timeout: float, **options: Any) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-c", code, *args], capture_output=True, text=True, timeout=...)`` through
    ``spawn_code``: the child's output, its exit status, and ``TimeoutExpired`` (the child killed) past ``timeout``."""
    proc = spawn_code(code, args, stdin=subprocess.DEVNULL, **options)
    try:
        out, err = communicate(proc, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(["-c", code, *args], proc.wait(), out, err)


def communicate(proc: ForkedProcess | subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Everything the child writes to its stdout and stderr pipes until it closes them."""
    if isinstance(proc, subprocess.Popen):
        return proc.communicate(timeout=timeout)
    deadline = time.monotonic() + timeout
    chunks: dict[Any, list[bytes]] = {proc.stdout: [], proc.stderr: []}
    open_files = [f for f in chunks if f is not None]
    while open_files:
        left = deadline - time.monotonic()
        ready = select.select(open_files, [], [], max(0.0, left))[0]
        if not ready:
            raise subprocess.TimeoutExpired(f"forked worker {proc.pid}", timeout)
        for f in ready:
            data = os.read(f.fileno(), 65536)
            if data:
                chunks[f].append(data)
            else:
                open_files.remove(f)
                f.close()
    return tuple(b"".join(chunks[f]).decode() for f in (proc.stdout, proc.stderr))


def stop_servers() -> None:
    """Close every fork server (its end of the control socket: it exits). A later spawn starts a new one."""
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


if __name__ == "__main__":
    _server_main()
