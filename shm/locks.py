"""Inter-process locks with timeouts: a file lock (``flock``) and a POSIX named semaphore.

Which to use
------------
``FileLock`` is the default and the one the coordinator uses: the kernel drops an ``flock`` when the last fd
of the holder's open file description closes, i.e. when the holder exits or is SIGKILLed, so a crash can
never leave a namespace locked.  ``SemaphoreLock`` (posix_ipc named semaphore, initial value 1) works where
the lock directory is not shared between the processes (e.g. containers that share only ``/dev/shm``), but a
holder that dies keeps it taken until someone unlinks it; use it only when that trade-off is acceptable.

Neither lock is re-entrant: acquiring a lock object that is already held raises ``RuntimeError``, and two
lock objects for the same path/name in one process exclude each other exactly like two processes do
(separate handles are separate participants).  A lock object is meant for one thread at a time.
The lock fd is close-on-exec, but a *forked* child shares the open file description and so the flock:
start helpers with ``spawn``/``subprocess`` (the project rule anyway), not bare ``fork``, while holding one.

Safe removal of lock files
--------------------------
Deleting a lock file that others may be waiting on is racy: a waiter may have opened the old inode, and a
newcomer may create a fresh file at the same path, and both would "hold the lock".  So removal happens only
while holding the lock (``unlink_if_held``), and ``acquire`` re-checks after every successful ``flock`` that
the path still names the inode it locked (``fstat`` vs ``stat``); if not, it closes, reopens and retries.
Whoever holds the lock therefore always holds it on the file currently at the path.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Literal

import posix_ipc

from flextensor.shm.checks import check_seconds
from flextensor.shm.names import validate_posix_name

__all__ = ["FileLock", "SemaphoreLock", "make_lock", "LockBackend"]

logger = logging.getLogger(__name__)

LockBackend = Literal["file", "semaphore"]
_BACKENDS = ("file", "semaphore")
#: Waiting for a held lock polls ``flock(LOCK_NB)`` (a blocking ``flock`` cannot time out). The sleep doubles from
#: ``_POLL_START_S`` up to ``_POLL_FAST_MAX_S`` for the first ``_POLL_FAST_WINDOW_S`` of the wait, then up to
#: ``_POLL_MAX_S``. The short cap matters when several workers join at once: each holds the coordinator lock for
#: about a millisecond, and a waiter that slept 20 ms after the lock came free lost those 20 ms (measured: 7
#: followers joining at once waited up to 56 ms). A try is one system call, so polling every 2 ms is cheap.
_POLL_START_S = 0.0002
_POLL_FAST_MAX_S = 0.002
_POLL_FAST_WINDOW_S = 0.5
_POLL_MAX_S = 0.02


def _next_poll(delay: float, waited: float) -> float:
    """The next sleep between two tries, after ``waited`` seconds of waiting (see the constants above)."""
    return min(delay * 2, _POLL_FAST_MAX_S if waited < _POLL_FAST_WINDOW_S else _POLL_MAX_S)


class FileLock:
    """An exclusive ``flock`` on ``path`` (created 0600 when missing; the directory must exist).

    ``timeout`` is the default for the context manager; :meth:`acquire` takes its own.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float | None = None) -> None:
        self.path = Path(path)
        self.timeout = check_seconds(timeout, "timeout", allow_none=True)
        self._fd: int | None = None  # fd kept between polls (and while held)
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def _drop_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _same_file(self, fd: int) -> bool:
        try:
            path_st = os.stat(self.path)
        except FileNotFoundError:
            return False
        fd_st = os.fstat(fd)
        return (path_st.st_dev, path_st.st_ino) == (fd_st.st_dev, fd_st.st_ino)

    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (``None``: forever, ``0``: one try).

        ``TimeoutError`` naming the path and the fix when it stays taken; ``RuntimeError`` if this object
        already holds it (not re-entrant).
        """
        timeout = check_seconds(timeout, "timeout", allow_none=True)
        if self._held:
            raise RuntimeError(f"file lock {self.path} is already held by this object; locks are not re-entrant")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        delay = _POLL_START_S
        while True:
            if self._fd is None:
                self._fd = self._open()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EINTR):
                    self._drop_fd()
                    raise
            else:
                if self._same_file(self._fd):
                    self._held = True
                    return
                # The file we locked was unlinked (and maybe replaced) meanwhile: start over on the new one.
                self._drop_fd()
                continue
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._drop_fd()
                    raise TimeoutError(
                        f"could not acquire the file lock {self.path} within {timeout:g} s: another process "
                        f"holds it (see who with `fuser -v {self.path}` or `lsof {self.path}`). The kernel releases "
                        "it when the holder exits; if the holder is stuck, stop it, or pass a longer timeout"
                    )
                time.sleep(min(delay, remaining))
            else:
                time.sleep(delay)
            delay = _next_poll(delay, time.monotonic() - started)

    def release(self) -> None:
        """Release the lock.  ``RuntimeError`` if this object does not hold it."""
        if not self._held:
            raise RuntimeError(f"file lock {self.path} is not held by this object")
        self._held = False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # type: ignore[arg-type]
        finally:
            self._drop_fd()

    def unlink_if_held(self) -> bool:
        """Remove the lock file while holding the lock (see the module docstring).  True if it was removed.

        The lock stays held (on the now nameless inode) until :meth:`release`; waiters then notice that the
        path changed and retry on a fresh file.
        """
        if not self._held:
            raise RuntimeError(f"file lock {self.path} must be held to unlink it safely; acquire it first")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        """Release if held and close the file.  Idempotent."""
        if self._held:
            self.release()
        self._drop_fd()

    def __enter__(self) -> FileLock:
        self.acquire(self.timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self._drop_fd()  # closing the fd also drops the flock
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    def __repr__(self) -> str:
        return f"FileLock({str(self.path)!r}, held={self._held})"


class SemaphoreLock:
    """A POSIX named semaphore (initial value 1, mode 0600) used as a mutex.

    Created on first use and shared by name; it shows up as ``/dev/shm/sem.<name without '/'>``.  Unlike
    :class:`FileLock` it is NOT released when its holder dies; :meth:`unlink` removes the name.
    """

    def __init__(self, name: str, *, timeout: float | None = None) -> None:
        self.name = validate_posix_name(name, "semaphore", 251)
        self.timeout = check_seconds(timeout, "timeout", allow_none=True)
        self._held = False
        try:
            self._sem: posix_ipc.Semaphore | None = posix_ipc.Semaphore(
                name, posix_ipc.O_CREAT, mode=0o600, initial_value=1
            )
        except posix_ipc.PermissionsError as exc:
            from flextensor.shm.segment import squatter_hint

            hint = squatter_hint(name, f"/dev/shm/sem.{name[1:]}") or ("; it belongs to another user or has a "
                                                                         "restrictive mode")
            raise PermissionError(errno.EACCES, f"cannot open semaphore {name!r}: {exc}{hint}") from None

    @property
    def held(self) -> bool:
        return self._held

    def _semaphore(self) -> posix_ipc.Semaphore:
        if self._sem is None:
            raise ValueError(f"semaphore lock {self.name!r} is closed; create a new SemaphoreLock")
        return self._sem

    def acquire(self, timeout: float | None = None) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (``None``: forever, ``0``: one try)."""
        timeout = check_seconds(timeout, "timeout", allow_none=True)
        sem = self._semaphore()
        if self._held:
            raise RuntimeError(f"semaphore lock {self.name!r} is already held by this object; locks are not "
                               "re-entrant")
        try:
            sem.acquire(timeout)
        except posix_ipc.BusyError:
            raise TimeoutError(
                f"could not acquire the semaphore lock {self.name!r} (/dev/shm/sem.{self.name[1:]}) within "
                f"{timeout:g} s: another process holds it. A semaphore is not released when its holder dies; if "
                "the holder crashed, remove it (`ftd cleanup`, or SemaphoreLock.unlink()) or use the file lock "
                "backend"
            ) from None
        self._held = True

    def release(self) -> None:
        """Release the lock.  ``RuntimeError`` if this object does not hold it."""
        if not self._held:
            raise RuntimeError(f"semaphore lock {self.name!r} is not held by this object")
        self._semaphore().release()
        self._held = False

    def unlink(self) -> bool:
        """Remove the semaphore's name (processes that opened it keep using it).  True if it existed."""
        try:
            posix_ipc.unlink_semaphore(self.name)
        except posix_ipc.ExistentialError:
            return False
        return True

    def close(self) -> None:
        """Release if held and close this handle (the name stays).  Idempotent."""
        if self._sem is None:
            return
        if self._held:
            self.release()
        sem, self._sem = self._sem, None
        sem.close()

    def __enter__(self) -> SemaphoreLock:
        self.acquire(self.timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SemaphoreLock({self.name!r}, held={self._held})"


def make_lock(
    backend: LockBackend,
    *,
    path: str | os.PathLike[str] | None = None,
    name: str | None = None,
    timeout: float | None = None,
) -> FileLock | SemaphoreLock:
    """Build a lock of the given backend: ``"file"`` needs ``path``, ``"semaphore"`` needs ``name``."""
    if backend == "file":
        if path is None:
            raise ValueError("the 'file' lock backend needs path= (a file in the lock directory)")
        return FileLock(path, timeout=timeout)
    if backend == "semaphore":
        if name is None:
            raise ValueError("the 'semaphore' lock backend needs name= (a POSIX name such as '/ns.g0.l0')")
        return SemaphoreLock(name, timeout=timeout)
    raise ValueError(f"unknown lock backend {backend!r}: choose one of {', '.join(map(repr, _BACKENDS))}")
