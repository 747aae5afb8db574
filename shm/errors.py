"""Exceptions of :mod:`flextensor.shm`.

The public API names two of them (``ShmCreatorFailedError`` and ``ShmCreatorDiedError``); the others exist so that
callers can tell "the shared state is corrupt / of another protocol", "/dev/shm is full" and "an ``ftd hold``
keeps this namespace" apart from the builtin errors without parsing messages.  Each one subclasses the builtin a
caller would naturally catch (``RuntimeError``, ``ValueError``, ``OSError``, ``TimeoutError``), so ``except
OSError`` still sees a full ``/dev/shm``.
"""

from __future__ import annotations

import errno

__all__ = [
    "ShmError",
    "ShmCreatorFailedError",
    "ShmCreatorDiedError",
    "ShmProtocolError",
    "ShmSpaceError",
    "ShmDirectoryUnseenError",
    "HostMemoryError",
    "ShmNamespaceHeldError",
    "WorkersAwakeError",
    "WeightsUpdateIncompleteError",
]


class ShmError(RuntimeError):
    """Base class of the runtime failures of shared-memory coordination."""


class ShmCreatorFailedError(ShmError):
    """The creator of a shared namespace called ``mark_failed``; followers receive its message.

    ``creator_message`` is the (bounded) text the creator stored in the coordinator header, kept apart from
    the exception text so that callers can show or log it verbatim.
    """

    def __init__(self, message: str, creator_message: str = "") -> None:
        super().__init__(message)
        self.creator_message = creator_message

    def __reduce__(self):  # keep creator_message when the error crosses a process boundary
        return (type(self), (str(self), self.creator_message))


class ShmCreatorDiedError(ShmError):
    """The creator's lease expired while the namespace was still INITIALIZING (it crashed or was killed)."""


class WorkersAwakeError(ShmError):
    """New weights were refused because a participant of the namespace may still read the host copy (it is
    awake: ``wake()`` was called, or it never slept) or another update is being written.

    Raised before any byte is written. ``pids`` are the awake participants' (or the writer's) process ids; the
    message names them and the fix: every worker calls ``ft.sleep(name)`` first.
    """

    def __init__(self, message: str, pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.pids = tuple(pids)

    def __reduce__(self):  # keep pids when the error crosses a process boundary
        return (type(self), (str(self), self.pids))


class WeightsUpdateIncompleteError(ShmError):
    """An update of the shared weights stopped midway (its writer raised or died), so the host copy holds part
    old and part new weights: no worker may wake from it or join it until a participant writes a complete set
    again (``update_weights`` with every tensor), or every worker stops and the next start publishes afresh."""


class ShmNamespaceHeldError(TimeoutError):
    """Cleanup found a live ``ftd hold`` in the namespace: its weights are kept warm on purpose, so nothing is
    removed, at once (waiting cannot help: a hold lasts until ``ftd release``).

    A ``TimeoutError``, like the "participants still hold live leases" refusal, so every caller that already
    treats a namespace in use as "not now" keeps doing so; a supervisor catches this class to restart its workers
    instead, which then attach to the held weights. ``namespace`` is the per-manager namespace, ``holder_pids``
    the pids recorded in the held slots (the daemon that holds it, or the one it took the hold over from).
    """

    def __init__(self, message: str, *, namespace: str, holder_pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.namespace = namespace
        self.holder_pids = tuple(holder_pids)

    def __reduce__(self):  # OSError's default reduce would drop the keyword fields
        return (_rebuild_held_error, (type(self), str(self), self.namespace, self.holder_pids))


def _rebuild_held_error(cls: type[ShmNamespaceHeldError], message: str, namespace: str,
                        holder_pids: tuple[int, ...]) -> ShmNamespaceHeldError:
    return cls(message, namespace=namespace, holder_pids=holder_pids)


class ShmProtocolError(ValueError):
    """Shared metadata that cannot be trusted: unknown protocol, bad magic, truncated or malformed content.

    Raised instead of guessing: code that meets another protocol version or a corrupted header must stop
    and tell the operator, never reinterpret the bytes.
    """


class ShmSpaceError(OSError):
    """``/dev/shm`` has no room for a segment (ENOSPC while allocating it).

    ``errno`` is ``ENOSPC``; ``segment`` is the POSIX name, ``wanted`` the size asked for in bytes and
    ``free`` the bytes free in ``/dev/shm`` when the failure was seen (``None`` if that could not be read).
    """

    def __init__(self, message: str, *, segment: str, wanted: int, free: int | None) -> None:
        super().__init__(errno.ENOSPC, message)
        self.segment = segment
        self.wanted = wanted
        self.free = free

    def __str__(self) -> str:
        return f"[Errno {errno.ENOSPC}] {self.strerror}"

    def __reduce__(self):  # OSError's default reduce would call __init__(errno, message) and fail
        return (_rebuild_space_error, (type(self), self.strerror, self.segment, self.wanted, self.free))


def _rebuild_space_error(cls: type[ShmSpaceError], message: str, segment: str, wanted: int,
                         free: int | None) -> ShmSpaceError:
    return cls(message, segment=segment, wanted=wanted, free=free)


class ShmDirectoryUnseenError(FileNotFoundError):
    """The directory a namespace's journal names for its segments is not the file system this process sees there
    (another mount namespace or container, or unmounted since): nothing of the namespace may be judged or
    removed from here. Raised as ``FileNotFoundError(errno.ENOENT, message)``."""


class HostMemoryError(MemoryError):
    """Host RAM cannot hold what a call is about to allocate: raised before any of it is allocated.

    ``wanted`` is the bytes the call needs on top of what the process holds, ``available`` the host's
    ``MemAvailable`` when it was checked. The message names both and what to change. A ``MemoryError``, so code
    that already catches allocation failures catches this one too, without the out-of-memory killer's visit.
    """

    def __init__(self, message: str, *, wanted: int, available: int) -> None:
        super().__init__(message)
        self.wanted = wanted
        self.available = available

    def __reduce__(self):  # MemoryError's default reduce would call __init__(message) and fail
        return (_rebuild_host_memory_error, (type(self), str(self), self.wanted, self.available))


def _rebuild_host_memory_error(cls: type[HostMemoryError], message: str, wanted: int,
                               available: int) -> HostMemoryError:
    return cls(message, wanted=wanted, available=available)
