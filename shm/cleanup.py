"""Removing a generation's resources: by its last participant, by a re-election, or offline.

Three callers share this code so there is exactly one definition of "what a generation owns":

* ``ShmCoordinator.close()`` of the last live participant,
* ``ShmCoordinator(...)`` finding a generation whose participants all died (reclaim, then a new generation),
* ``cleanup_manager_namespace`` — offline cleanup for operators, ``SharedOffloadSession.cleanup_namespace``
  and ``ftd``. It creates no coordinator and loads no model: it reads the journal and the lease table only,
  never probes pids (they mean nothing across containers).

Everything happens under the coordinator lock (``{lock_dir}/{ns}.lock``), and everything is *validated
before anything is deleted*: an unknown protocol or malformed journal/header raises ``ShmProtocolError``
with nothing removed. Removal order is intents (segments, semaphores, lock files), then ``/{ns}.c``, then the
journal, then — only when the caller is done with the namespace — the lock file. Each step tolerates ENOENT
and the journal goes last but one, so a removal that fails half-way can simply be retried.

Aborted creations: the election writes the journal header, then creates ``/{ns}.c`` and its header (magic
last), all under the lock. Holding the lock and finding an empty journal, or a coordinator segment that is
empty / has a zero magic, therefore proves its creator died mid-creation; those are reclaimed too.

Lock directory: every entry point takes ``lock_dir`` (default ``None``: ``lock_directory()`` of the calling
process, i.e. derived from its ``TMPDIR`` and uid).  ``ftd`` passes the directory it learned from a
registration or its configuration, because the namespaces it serves may belong to other users; it is
resolved once, kept in :class:`NamespaceState` and used for the journal, the lock-file intents and the
coordinator lock alike.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import posix_ipc

from flextensor.shm.checks import check_seconds
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.header import AbortedCreationError, HeaderInfo, open_coordinator_segment
from flextensor.shm.journal import Intent, Journal, read_journal
from flextensor.shm.leases import LeaseTable
from flextensor.shm.locks import FileLock
from flextensor.shm.names import (
    coordinator_lock_path,
    coordinator_segment_name,
    journal_path,
    resolve_lock_directory,
    validate_namespace,
)
from flextensor.shm.segment import SharedSegment

__all__ = ["CleanupReport", "NamespaceState", "cleanup_manager_namespace", "inspect_namespace_locked"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05


class CleanupReport(msgspec.Struct):
    """What ``cleanup_manager_namespace`` did. ``generation`` is None when nothing was there."""

    namespace: str
    generation: int | None
    removed: list[str]
    already_absent: list[str]
    waited_s: float


@dataclass
class NamespaceState:
    """A validated view of a namespace's shared state, taken under the coordinator lock.

    ``lock_dir`` is the directory its journal and lock files live in.  ``close()`` it when done (it may hold a
    mapping of the coordinator segment).
    """

    namespace: str
    lock_dir: Path
    journal: Journal | None = None
    journal_exists: bool = False  # also True for an empty (aborted) journal
    segment: SharedSegment | None = None
    header: HeaderInfo | None = None
    coordinator_exists: bool = False  # also True for an aborted coordinator segment
    removed: list[str] = field(default_factory=list)
    already_absent: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.journal_exists and not self.coordinator_exists

    @property
    def generation(self) -> int | None:
        if self.header is not None:
            return self.header.generation
        if self.journal is not None:
            return self.journal.generation
        return None

    def live_slots(self) -> list:
        """Live lease slots of the coordinator segment (none without a valid one)."""
        if self.segment is None or self.header is None:
            return []
        return LeaseTable(self.segment.buffer, self.header.slot_count, segment=self.segment.name).live_slots()

    def close(self) -> None:
        segment, self.segment = self.segment, None
        if segment is not None:
            segment.close()


def inspect_namespace_locked(namespace: str, lock_dir: str | os.PathLike[str] | None = None) -> NamespaceState:
    """Read and validate the journal and coordinator header of ``namespace`` (caller holds its coordinator
    lock, ``coordinator_lock_path(namespace, lock_dir)``).

    ``lock_dir`` defaults to ``lock_directory()``.  Raises ``ShmProtocolError`` (after unmapping) when anything
    cannot be trusted or the two disagree.
    """
    state = NamespaceState(namespace, resolve_lock_directory(lock_dir))
    jpath = journal_path(namespace, state.lock_dir)
    try:
        if jpath.stat().st_size == 0:
            state.journal_exists = True  # aborted creation: nothing can have been created yet
        else:
            state.journal = read_journal(jpath)
            state.journal_exists = True
    except FileNotFoundError:
        pass
    try:
        state.segment, state.header = open_coordinator_segment(namespace)
        state.coordinator_exists = True
    except FileNotFoundError:
        pass
    except AbortedCreationError as exc:
        logger.warning("%s; reclaiming it (the coordinator lock is held, so its creator is gone)", exc)
        state.coordinator_exists = True
    try:
        if state.header is not None:
            if not state.journal_exists:
                raise ShmProtocolError(
                    f"coordinator segment {coordinator_segment_name(namespace)} exists (generation "
                    f"{state.header.generation}) but its ownership journal {jpath} does not: the caller's TMPDIR "
                    "(lock directory) probably differs from the workers'. Nothing was removed; run cleanup with the "
                    "same TMPDIR as the workers"
                )
            if state.journal is not None and state.journal.generation != state.header.generation:
                raise ShmProtocolError(
                    f"ownership journal {jpath} describes generation {state.journal.generation} but coordinator "
                    f"segment {state.header.segment} holds generation {state.header.generation}; refusing to "
                    "guess which resources belong to whom. Nothing was removed"
                )
    except BaseException:
        state.close()
        raise
    return state


def _unlink_intent(intent: Intent, lock_dir: Path) -> bool:
    if intent.kind == "segment":
        return SharedSegment.unlink_name(intent.name)
    if intent.kind == "semaphore":
        try:
            posix_ipc.unlink_semaphore(intent.name)
        except posix_ipc.ExistentialError:
            return False
        return True
    try:  # lockfile: a plain file name inside the lock directory (validated by read_journal)
        os.unlink(lock_dir / intent.name)
    except FileNotFoundError:
        return False
    return True


def _record(state: NamespaceState, what: str, existed: bool) -> None:
    (state.removed if existed else state.already_absent).append(what)


def remove_generation_locked(state: NamespaceState) -> None:
    """Unlink everything ``state`` names except the lock file (caller holds the lock and checked that no
    lease is live). Appends to ``state.removed`` / ``state.already_absent``; unmaps ``state.segment``."""
    state.close()
    if state.journal is not None:
        for intent in state.journal.resources():
            what = intent.name if intent.kind != "lockfile" else str(state.lock_dir / intent.name)
            _record(state, what, _unlink_intent(intent, state.lock_dir))
    cname = coordinator_segment_name(state.namespace)
    _record(state, cname, SharedSegment.unlink_name(cname))
    jpath = journal_path(state.namespace, state.lock_dir)
    try:
        os.unlink(jpath)
        _record(state, str(jpath), True)
    except FileNotFoundError:
        _record(state, str(jpath), False)


def remove_lock_file_locked(state: NamespaceState, lock: FileLock) -> None:
    """Last step: unlink the coordinator lock file while holding it (waiters retry on a fresh file)."""
    _record(state, str(lock.path), lock.unlink_if_held())


def cleanup_manager_namespace(namespace: str, *, timeout: float,
                              lock_dir: str | os.PathLike[str] | None = None) -> CleanupReport:
    """Remove everything one per-manager namespace owns, after its participants' leases ran out.

    ``lock_dir`` is the workers' lock directory (default ``lock_directory()``, from this process's ``TMPDIR``).

    Waits up to ``timeout`` seconds (0: check once) for live leases to expire, then unlinks every resource
    the journal names, the coordinator segment, the journal and the lock file. A namespace with neither a
    journal nor a coordinator segment is a no-op. Safe to retry after a partial failure.

    Raises ``TimeoutError`` (naming how many participants are live and their pids) when leases stay live or
    the coordinator lock stays taken; ``ShmProtocolError`` with nothing removed when the journal or header is
    of an unknown protocol or malformed; ``ValueError`` for a bad namespace or timeout.
    """
    validate_namespace(namespace)
    timeout = check_seconds(timeout, "timeout", allow_none=False)
    start = time.monotonic()
    deadline = start + timeout
    directory = resolve_lock_directory(lock_dir)
    lock = FileLock(coordinator_lock_path(namespace, directory))
    try:
        while True:
            lock.acquire(max(0.0, deadline - time.monotonic()))
            try:
                state = inspect_namespace_locked(namespace, directory)
                try:
                    live = state.live_slots()
                    if not live:
                        generation = state.generation
                        was_empty = state.empty
                        remove_generation_locked(state)
                        remove_lock_file_locked(state, lock)
                        if was_empty:
                            logger.debug("cleanup of %s: nothing to do", namespace)
                            return CleanupReport(namespace, None, [], [], time.monotonic() - start)
                        logger.info("cleanup of %s generation %s removed %d resources (%d already absent)",
                                    namespace, generation, len(state.removed), len(state.already_absent))
                        return CleanupReport(namespace, generation, state.removed, state.already_absent,
                                             time.monotonic() - start)
                finally:
                    state.close()
            finally:
                lock.release()
            now = time.monotonic()
            if now >= deadline:
                pids = ", ".join(str(s.identity.pid) for s in live if s.identity is not None)
                raise TimeoutError(
                    f"cleanup of namespace {namespace!r}: {len(live)} participant(s) still hold live leases after "
                    f"{now - start:.1f} s (pids {pids}). Stop those workers (killed ones expire after their lease, "
                    "30 s by default) and retry, or pass a longer timeout"
                )
            time.sleep(min(_POLL_S, deadline - now))
    finally:
        lock.close()


def reclaim_stale_locked(namespace: str, state: NamespaceState, reason: str) -> int | None:
    """Remove a generation nobody holds any more, keeping the lock file (the caller, an election holding
    the lock, goes on to create the next generation). Returns the reclaimed generation, if any."""
    generation = state.generation
    logger.warning("reclaiming namespace %s generation %s: %s", namespace, generation, reason)
    remove_generation_locked(state)
    if state.removed:
        logger.warning("reclaimed from %s generation %s: %s", namespace, generation, ", ".join(state.removed))
    return generation
