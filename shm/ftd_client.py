"""The tiny, best-effort client of ``ftd`` used by workers (and the request helper used by the ``ftd`` CLI).

A worker registers each participant it creates with the host's daemon so that the daemon notices the
process's death at once (pidfd) instead of after a lease.  The daemon is optional: when none runs, or its
socket is stale, registration must cost nothing and change nothing.  Hence:

* ``register_participant`` / ``unregister_participant`` never raise and return ``False`` when the daemon
  is absent, dead, slow (about 200 ms in total) or refuses; the first such miss in a process is logged at
  DEBUG (one line), later ones are silent unless the daemon actively refused (WARNING: draining, forbidden).
* Before touching ZeroMQ the socket path is checked with ``stat`` and probed with a plain ``AF_UNIX``
  ``connect``: a missing path or ``ECONNREFUSED`` (a stale file of a dead daemon) returns at once, without
  waiting for a timeout.

Socket path: ``$FT_DAEMON_SOCKET`` when set, else :func:`default_socket_path` — ``/run/flextensor/ftd.sock``
for root, ``$XDG_RUNTIME_DIR/flextensor/ftd.sock`` for other users when ``XDG_RUNTIME_DIR`` is set, else
``$TMPDIR/flextensor-ftd-{uid}/ftd.sock``.  Workers of a system-wide daemon (root, socket group configured)
set ``FT_DAEMON_SOCKET=/run/flextensor/ftd.sock`` explicitly (see ``docs/daemon.md``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import msgspec

from flextensor.shm import ftd_protocol as proto
from flextensor.shm.identity import ParticipantIdentity

__all__ = [
    "SOCKET_ENV",
    "REGISTER_TIMEOUT_S",
    "default_socket_path",
    "daemon_socket_path",
    "daemon_available",
    "register_participant",
    "unregister_participant",
    "request",
    "DaemonUnavailableError",
]

logger = logging.getLogger(__name__)

SOCKET_ENV = "FT_DAEMON_SOCKET"
#: Total budget of one registration round trip (connect + send + reply).
REGISTER_TIMEOUT_S = 0.2

_lock = threading.Lock()
_context = None  # zmq.Context, created lazily (and again after fork)
_context_pid = -1
_missed_once = False


class DaemonUnavailableError(ConnectionError):
    """No daemon answers on the socket (missing path, stale socket file, or no reply in time)."""


def default_socket_path() -> str:
    """The documented default socket path for this user (see the module docstring)."""
    uid = os.getuid()
    if uid == 0:
        return "/run/flextensor/ftd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return str(Path(runtime) / "flextensor" / "ftd.sock")
    return str(Path(tempfile.gettempdir()) / f"flextensor-ftd-{uid}" / "ftd.sock")


def daemon_socket_path() -> str:
    """``$FT_DAEMON_SOCKET`` if set (and non-empty), else :func:`default_socket_path`."""
    return os.environ.get(SOCKET_ENV) or default_socket_path()


def _probe(path: str) -> str | None:
    """Why ``path`` cannot be a live daemon socket, or None when something accepts connections there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no socket file"
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    if not stat.S_ISSOCK(st.st_mode):
        return "it is not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.05)
        probe.connect(path)
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return "stale socket file, nothing listens (daemon dead?)"
        return f"cannot connect ({exc.strerror or exc})"
    finally:
        probe.close()
    return None


def daemon_available(path: str | None = None) -> bool:
    """True when something listens on the daemon socket (a cheap probe, no request is sent)."""
    return _probe(path or daemon_socket_path()) is None


def _zmq_context():
    global _context, _context_pid
    import zmq  # imported lazily: importing flextensor.shm stays cheap for processes that never register

    with _lock:
        if _context is None or _context_pid != os.getpid():
            _context = zmq.Context()  # a fresh one after fork: a zmq context must not cross a fork
            _context_pid = os.getpid()
        return _context


def request(message: msgspec.Struct, timeout: float = 5.0, *, path: str | None = None) -> proto.Reply:
    """Send one request to the daemon and return its reply (``ErrorReply`` included, not raised).

    ``DaemonUnavailableError`` when no daemon listens on ``path`` (default :func:`daemon_socket_path`) or
    none answers within ``timeout`` seconds; ``ValueError`` (``ProtocolDecodeError``) for a malformed reply.
    """
    path = path or daemon_socket_path()
    why = _probe(path)
    if why is not None:
        raise DaemonUnavailableError(f"no ftd daemon at {path}: {why}; start one with `ftd serve --socket {path}` "
                                     f"or set {SOCKET_ENV}")
    import zmq  # only now: a host without a daemon never pays for importing it

    frame = proto.encode(message)
    sock = _zmq_context().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_REPLY_BYTES)
        sock.connect(f"ipc://{path}")
        deadline = time.monotonic() + timeout
        if not sock.poll(max(1, int(timeout * 1000)), zmq.POLLOUT):
            raise DaemonUnavailableError(f"ftd at {path} did not accept a request within {timeout:g} s")
        sock.send(frame, zmq.NOBLOCK)
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
            raise DaemonUnavailableError(f"ftd at {path} did not answer within {timeout:g} s")
        parts = sock.recv_multipart(zmq.NOBLOCK)
    finally:
        sock.close(0)
    return proto.decode_reply(parts[-1])


def _miss(reason: str) -> bool:
    """Log the first miss of this process at DEBUG (one line) and return False."""
    global _missed_once
    if not _missed_once:
        _missed_once = True
        logger.debug("ftd not used (%s); shared memory works as without a daemon", reason)
    return False


class NamespaceDrainingError(RuntimeError):
    """``ftd`` refused a registration because the namespace is being drained (``ftd drain``)."""


def _best_effort(message: msgspec.Struct, what: str, *, refuse_if_draining: bool = False) -> bool:
    try:
        reply = request(message, REGISTER_TIMEOUT_S)
    except DaemonUnavailableError as exc:
        return _miss(str(exc))
    except Exception as exc:  # noqa: BLE001 - registration must never break a worker
        return _miss(f"{what} failed: {type(exc).__name__}: {exc}")
    if isinstance(reply, proto.OkReply):
        return True
    if isinstance(reply, proto.ErrorReply) and reply.code == "draining" and refuse_if_draining:
        raise NamespaceDrainingError(
            f"ftd refused to {what}: {reply.message}. The namespace is being drained; wait until it is gone, "
            "or lift the drain with `ftd drain NAMESPACE --undo`"
        )
    if isinstance(reply, proto.ErrorReply):
        level = logging.WARNING if reply.code in ("draining", "forbidden") else logging.DEBUG
        logger.log(level, "ftd refused to %s: %s (%s)", what, reply.message, reply.code)
        return False
    return _miss(f"unexpected reply {type(reply).__name__} to {what}")


def register_participant(
    namespace: str,
    slot_index: int,
    identity: ParticipantIdentity,
    lock_dir: str | os.PathLike[str],
    *,
    base: str | None = None,
    manager: str | None = None,
    refuse_if_draining: bool = False,
) -> bool:
    """Ask the host's ``ftd`` to watch this participant; True when it does.

    Call it from the participant's own process right after it joined the lease table of ``namespace`` (a
    per-manager namespace) at ``slot_index``.  ``lock_dir`` is the directory of the namespace's journal
    (``names.lock_directory()``).  ``base``/``manager`` are optional labels shown by ``ftd ls`` and used by
    ``ftd drain BASE``.  Returns False fast when no daemon runs. Never raises, except
    ``NamespaceDrainingError`` when ``refuse_if_draining`` and the daemon is draining the namespace (a session
    then leaves at once: draining refuses new joins).
    """
    message = proto.RegisterRequest(namespace=namespace, slot_index=int(slot_index), identity=identity,
                                    lock_dir=os.fspath(lock_dir), base=base, manager=manager)
    return _best_effort(message, f"register {identity.describe()} in {namespace}",
                        refuse_if_draining=refuse_if_draining)


def unregister_participant(namespace: str, slot_index: int, identity: ParticipantIdentity,
                           lock_dir: str | os.PathLike[str] | None = None) -> bool:
    """Tell ``ftd`` the participant left cleanly (call after leaving the lease table).  Never raises.

    ``lock_dir`` is accepted for symmetry with :func:`register_participant` and ignored.
    """
    message = proto.UnregisterRequest(namespace=namespace, slot_index=int(slot_index), identity=identity)
    return _best_effort(message, f"unregister {identity.describe()} from {namespace}")
