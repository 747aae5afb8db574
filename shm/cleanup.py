"""Removing a generation's resources: by its last participant, by a re-election, or offline.

Three callers share this code so there is exactly one definition of "what a generation owns":

* ``ShmCoordinator.close()`` of the last live participant,
* ``ShmCoordinator(...)`` finding a generation whose participants all died (reclaim, then a new generation),
* ``cleanup_manager_namespace`` — offline cleanup for operators, ``SharedOffloadSession.cleanup_namespace``,
  ``ftd`` and the dead-namespace sweeps (``dead_sweep.py``: a session before it joins, ``ftd cleanup --dead``).
  It creates no coordinator and loads no model: it reads the journal and the lease table, whose reader counts
  a participant as gone when its pid namespace is ours and its process no longer exists (pids of another pid
  namespace are never probed: those participants count until their lease runs out).

Holds: a live DURABLE lease slot is an ``ftd hold`` (``leases.py``), which keeps a generation's weights warm
until ``ftd release``.  Cleanup refuses such a namespace at once with ``ShmNamespaceHeldError`` naming the hold
and the release command, instead of waiting for a lease that is refreshed for as long as the hold lasts.

Everything happens under the coordinator lock (``{lock_dir}/{ns}.lock``), and everything is *validated
before anything is deleted*: an unknown protocol or malformed journal/header raises ``ShmProtocolError``
with nothing removed. Removal order is intents (segments, semaphores, lock files), then ``/{ns}.c``, then the
journal, then — only when the caller is done with the namespace — the lock file. Each step tolerates ENOENT
and the journal goes last but one, so a removal that fails half-way can simply be retried.

Aborted creations: the election writes the journal header, then creates ``/{ns}.c`` and its header (magic
last), all under the lock. Holding the lock and finding an empty journal *without* a valid coordinator
segment, or a coordinator segment that is empty / has a zero magic, therefore proves its creator died
mid-creation; those are reclaimed too.

Lost journals: an empty journal beside a *valid* coordinator header was truncated after the fact (a full disk,
an operator), so it says nothing about what the generation created.  Its resources are derivable from the
namespace (``orphans.py``), and removing a generation always sweeps every ``{ns}.g{N}.*`` of the namespace's
owner besides the journal's intents, so nothing is orphaned.  A journal that is *missing* beside a valid
header is refused (the usual cause is a caller whose TMPDIR differs from the workers': its coordinator lock
is not theirs), unless the operator forces it.

Forced cleanup (``force=True``): for an operator who has stopped every worker and whose metadata is corrupt
or lost (a header state that no version writes, a deleted journal).  Under the coordinator lock, it removes
every resource derivable from the namespace that belongs to the lock directory's owner, without reading the
header, the journal or the leases, and reports each path.

Lock directory: every entry point takes ``lock_dir`` (default ``None``: ``lock_directory()`` of the calling
process, i.e. derived from its ``TMPDIR`` and uid).  ``ftd`` passes the directory it learned from a
registration or its configuration, because the namespaces it serves may belong to other users; it is
resolved once, kept in :class:`NamespaceState` and used for the journal, the lock-file intents and the
coordinator lock alike.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import posix_ipc

from flextensor.shm.checks import check_seconds
from flextensor.shm.errors import ShmDirectoryUnseenError, ShmNamespaceHeldError, ShmProtocolError
from flextensor.shm.header import AbortedCreationError, HeaderInfo, open_coordinator_segment
from flextensor.shm.journal import Intent, Journal, JournalHeader, read_journal
from flextensor.shm.leases import LeaseSlot, LeaseTable
from flextensor.shm.locks import FileLock
from flextensor.shm import segment_dir
from flextensor.shm.orphans import derived_resources, shm_directories
from flextensor.shm.names import (
    coordinator_lock_path,
    coordinator_segment_name,
    journal_path,
    resolve_lock_directory,
    validate_namespace,
)
from flextensor.shm.segment import SharedSegment

__all__ = ["CleanupReport", "NamespaceState", "check_not_held", "cleanup_manager_namespace", "held_error",
           "inspect_namespace_locked"]

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
    journal_exists: bool = False  # also True for an empty (aborted or truncated) journal
    journal_lost: bool = False  # an empty journal beside a valid header: resources are found by name
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
    if state.journal is not None:
        _check_directory_seen(state.journal, jpath)
    owner = namespace_owner(state.lock_dir)
    foreign = _foreign_owner(coordinator_segment_name(namespace), owner)
    if foreign is not None:
        # Whatever its content (a live job, a planted zero or garbage header), it is not this user's to read as
        # metadata or to reclaim: /dev/shm is shared by every user, and names are derived from the namespace.
        coordinator_path = segment_dir.segment_path(coordinator_segment_name(namespace))
        raise PermissionError(
            f"coordinator segment {coordinator_path} belongs to {foreign}, not to this "
            f"user (uid {owner}): another user runs a job on the same namespace (the same base namespace and "
            "manager name), or left or planted that file. Nothing was removed. Either use another namespace "
            "(another base namespace or manager name), or have that user stop its job or remove the file (root "
            "can too: `rm "
            f"{coordinator_path}`)"
        )
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
                    f"{state.header.generation}) but its ownership journal {jpath} does not. Nothing was removed. "
                    "Either this process's lock directory is not the workers' (give cleanup their lock directory: "
                    "`ftd cleanup --lock-dir DIR`, `cleanup_namespace(..., lock_dir=DIR)`, or the workers' TMPDIR), "
                    "or the journal was deleted: then stop every worker of this namespace and run `ftd cleanup "
                    "NS --force` (`cleanup_namespace(..., force=True)`)"
                )
            if state.journal is None:
                state.journal_lost = True
                logger.warning("ownership journal %s is empty but coordinator segment %s holds generation %d: the "
                               "journal was truncated; its resources are found by name instead", jpath,
                               state.header.segment, state.header.generation)
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


def _check_directory_seen(journal: Journal, jpath: Path) -> None:
    """``ShmDirectoryUnseenError`` when the journal's directory of segments is another file system here."""
    header = journal.header
    if not segment_dir.sees_directory(header.shm_dir, header.shm_dev):
        raise ShmDirectoryUnseenError(
            errno.ENOENT,
            f"ownership journal {jpath} says the segments of namespace {header.namespace!r} are in {header.shm_dir}, "
            "but that path is another file system in this process (a private mount namespace, another container "
            "sharing the lock directory, or it was unmounted): their workers may be alive. Nothing was removed. "
            f"Run cleanup where {header.shm_dir} is the workers' mount, or give every worker and ftd the same mount")


def _unlink_intent(intent: Intent, lock_dir: Path) -> bool:
    """Unlink one journaled resource; False when absent. A journaled name that belongs to another user was
    never ours (its creation failed on the squatter's file, after the intent was written): it is left alone
    with a WARNING, and counts as absent."""
    try:
        if intent.kind == "segment":
            return SharedSegment.unlink_name(intent.name)
        if intent.kind == "semaphore":
            try:
                posix_ipc.unlink_semaphore(intent.name)
            except posix_ipc.ExistentialError:
                return False
            except posix_ipc.PermissionsError as exc:
                raise PermissionError(errno.EACCES, f"{exc}") from None
            return True
    except PermissionError as exc:
        logger.warning("left %s in place: %s (it was never created by this namespace's workers)", intent.name, exc)
        return False
    try:  # lockfile: a plain file name inside the lock directory (validated by read_journal)
        os.unlink(lock_dir / intent.name)
    except FileNotFoundError:
        return False
    return True


def _record(state: NamespaceState, what: str, existed: bool) -> None:
    (state.removed if existed else state.already_absent).append(what)


def namespace_owner(lock_dir: Path) -> int:
    """The uid whose resources a cleanup in ``lock_dir`` may remove: the lock directory's owner (``ftd``
    switches its effective uid to it), or this process's effective uid when the directory is missing."""
    try:
        return os.stat(lock_dir).st_uid
    except OSError:
        return os.geteuid()


def _unlink_path(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def sweep_generations_locked(state: NamespaceState) -> None:
    """Unlink every ``{ns}.g{N}.*`` of the namespace's owner that is still there (caller holds the lock and
    knows no lease is live): resources of a lost journal, or orphans of an older generation."""
    found = derived_resources(state.namespace, state.lock_dir, owner_uid=namespace_owner(state.lock_dir))
    for path in found.generation_shm:
        name = path.name
        shown = f"/{name[4:]}" if name.startswith("sem.") else f"/{name}"  # the POSIX name, as journals say
        _record(state, shown, _unlink_path(path))
    for path in found.generation_locks:
        _record(state, str(path), _unlink_path(path))


def remove_generation_locked(state: NamespaceState) -> None:
    """Unlink everything ``state`` names except the lock file (caller holds the lock and checked that no
    lease is live), and every other ``{ns}.g{N}.*`` left (``sweep_generations_locked``). Appends to
    ``state.removed`` / ``state.already_absent``; unmaps ``state.segment``."""
    state.close()
    if state.journal is not None:
        for intent in state.journal.resources():
            what = intent.name if intent.kind != "lockfile" else str(state.lock_dir / intent.name)
            _record(state, what, _unlink_intent(intent, state.lock_dir))
    sweep_generations_locked(state)
    cname = coordinator_segment_name(state.namespace)
    _record(state, cname, SharedSegment.unlink_name(cname))
    jpath = journal_path(state.namespace, state.lock_dir)
    try:
        os.unlink(jpath)
        _record(state, str(jpath), True)
    except FileNotFoundError:
        _record(state, str(jpath), False)


def held_error(namespace: str, generation: int | None, labels: JournalHeader | None,
               held: list[LeaseSlot]) -> ShmNamespaceHeldError:
    """The refusal for a namespace with a live ``ftd hold`` (a DURABLE lease slot, ``leases.py``): it names the
    hold and the command that ends it, never the daemon as if it were a worker still running. ``labels``: the
    journal's header, for the base namespace and manager name an operator types."""
    if labels is not None and labels.base is not None:
        release = f"`ftd release {labels.base} --manager {labels.manager}`"
    else:
        release = f"`ftd release {namespace}`"
    pids = tuple(s.identity.pid for s in held if s.identity is not None)
    return ShmNamespaceHeldError(
        f"namespace {namespace!r} generation {generation} is held by ftd (`ftd hold`, daemon pid "
        f"{', '.join(map(str, pids)) or '?'}): its weights are kept warm on purpose, so cleanup removed nothing. A "
        f"restarted job attaches to them without any cleanup; to free them, end the hold with {release} (the "
        "generation is reclaimed then if no worker is left)",
        namespace=namespace, holder_pids=pids)


def check_not_held(namespace: str, lock_dir: str | os.PathLike[str] | None = None) -> None:
    """``ShmNamespaceHeldError`` when a live ``ftd hold`` keeps ``namespace`` now: a lock-free look at its lease
    table, for callers that would otherwise wait for leases or queue a request behind the hold.  Anything that
    cannot be read (no coordinator, another user's, corrupt) passes: the cleanup decides under the lock."""
    try:
        table = LeaseTable.open(validate_namespace(namespace))
    except (OSError, ShmProtocolError):
        return
    with table:
        held = [s for s in table.live_slots() if s.durable]
        generation = table.header.generation if table.header is not None else None
    if held:
        try:
            labels = read_journal(namespace, lock_dir=resolve_lock_directory(lock_dir)).header
        except (OSError, ShmProtocolError):
            labels = None
        raise held_error(namespace, generation, labels, held)


def remove_lock_file_locked(state: NamespaceState, lock: FileLock) -> None:
    """Last step: unlink the coordinator lock file while holding it (waiters retry on a fresh file)."""
    _record(state, str(lock.path), lock.unlink_if_held())


def cleanup_manager_namespace(namespace: str, *, timeout: float,
                              lock_dir: str | os.PathLike[str] | None = None, force: bool = False) -> CleanupReport:
    """Remove everything one per-manager namespace owns, after its participants left or died.

    ``lock_dir`` is the workers' lock directory (default ``lock_directory()``, from this process's ``TMPDIR``).
    A participant whose process is gone (same host and pid namespace) counts as left at once; one in another
    pid namespace counts until its lease runs out.

    ``force=True``: every worker was stopped and the metadata cannot be trusted (see the module docstring):
    remove everything derivable from the namespace without reading header, journal or leases.

    Waits up to ``timeout`` seconds (0: check once) for live leases to expire, then unlinks every resource
    the journal names, the coordinator segment, the journal and the lock file. A namespace with neither a
    journal nor a coordinator segment is a no-op. Safe to retry after a partial failure.

    Raises ``FileNotFoundError`` when a ``lock_dir`` given does not exist, ``TimeoutError`` (naming how many
    participants are live and their pids) when leases stay live or
    the coordinator lock stays taken; ``ShmNamespaceHeldError`` (a ``TimeoutError``) at once, without waiting,
    when an ``ftd hold`` keeps the generation; ``ShmProtocolError`` with nothing removed when the journal or header is
    of an unknown protocol or malformed; ``ValueError`` for a bad namespace or timeout.
    """
    validate_namespace(namespace)
    timeout = check_seconds(timeout, "timeout", allow_none=False)
    start = time.monotonic()
    deadline = start + timeout
    directory = resolve_lock_directory(lock_dir)
    if lock_dir is not None and not directory.is_dir():
        raise FileNotFoundError(
            f"lock directory {str(directory)!r} does not exist: pass the workers' lock directory (their "
            f"TMPDIR/flextensor-<uid>, the directory that holds {namespace}.journal)"
        )
    if force:
        return _force_cleanup(namespace, directory, deadline, start)
    lock = FileLock(coordinator_lock_path(namespace, directory))
    existed = lock.path.exists()
    try:
        while True:
            lock.acquire(max(0.0, deadline - time.monotonic()))
            try:
                try:
                    state = inspect_namespace_locked(namespace, directory)
                except (ShmProtocolError, PermissionError, ShmDirectoryUnseenError):
                    if not existed:
                        lock.unlink_if_held()  # refused: leave no lock file where there was none
                    raise
                try:
                    live = state.live_slots()
                    held = [s for s in live if s.durable]
                    if held:
                        raise held_error(namespace, state.generation,
                                         state.journal.header if state.journal is not None else None, held)
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
                    f"{now - start:.1f} s (pids {pids}). Stop those workers and retry (a killed worker counts as gone "
                    "at once on this host; one in another pid namespace only when its lease runs out, 30 s by "
                    "default), or pass a longer timeout"
                )
            time.sleep(min(_POLL_S, deadline - now))
    finally:
        lock.close()


def _force_cleanup(namespace: str, directory: Path, deadline: float, start: float) -> CleanupReport:
    """``force=True``: under the coordinator lock, unlink every derivable resource of the namespace's owner."""
    lock = FileLock(coordinator_lock_path(namespace, directory))
    existed = lock.path.exists()  # a lock file we create only to take the lock is not something we "removed"
    try:
        try:
            lock.acquire(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TimeoutError(
                f"forced cleanup of namespace {namespace!r}: its coordinator lock "
                f"{coordinator_lock_path(namespace, directory)} is held by a running process (a lock is released "
                "when its holder exits): stop every worker of this namespace first, or pass a longer timeout"
            ) from None
        try:
            generation = None
            try:
                generation = read_journal(journal_path(namespace, directory)).generation
            except (OSError, ShmProtocolError):
                pass
            found = derived_resources(namespace, directory, owner_uid=namespace_owner(directory))
            removed: list[str] = []
            absent: list[str] = []
            for path in found.all():
                if path.name == f"{namespace}.lock":
                    continue  # last, while held
                (removed if _unlink_path(path) else absent).append(str(path))
            if lock.unlink_if_held() and existed:
                removed.append(str(lock.path))
        finally:
            lock.release()
    finally:
        lock.close()
    if removed:
        logger.warning("forced cleanup of %s removed %s", namespace, ", ".join(removed))
    owner = namespace_owner(directory)
    blocking = [path for path in derived_resources(namespace, directory, owner_uid=None).all()
                if path.parent in shm_directories(namespace) and _foreign_owner_of(path, owner) is not None]
    if blocking:
        shown = ", ".join(f"{path} ({_foreign_owner_of(path, owner)})" for path in blocking)
        raise PermissionError(
            f"forced cleanup of namespace {namespace!r} removed {len(removed)} entries of this user (uid {owner}), "
            f"but {shown} belong to another user and still block the namespace. They are not this user's to "
            f"remove: their owner or root must (`rm {' '.join(str(p) for p in blocking)}`), or use another base "
            "namespace or manager name"
        )
    return CleanupReport(namespace, generation, removed, absent, time.monotonic() - start)


def _foreign_owner_of(path: Path, owner_uid: int) -> str | None:
    """``"uid N (name)"`` when ``path`` exists and belongs to a uid other than ``owner_uid``, else None."""
    try:
        uid = os.lstat(path).st_uid
    except FileNotFoundError:
        return None
    if uid == owner_uid:
        return None
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _foreign_owner(name: str, owner_uid: int) -> str | None:
    """:func:`_foreign_owner_of` for the segment ``name`` (its file, ``segment_dir.segment_path``)."""
    return _foreign_owner_of(Path(segment_dir.segment_path(name)), owner_uid)


def sweep_orphans_locked(namespace: str, lock_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Before creating generation 1 of an empty namespace (lock held): remove ``{ns}.g{N}.*`` orphans that
    an older version or a lost journal left behind (they would make the creation fail with
    ``FileExistsError``). Returns what was removed."""
    state = NamespaceState(namespace, resolve_lock_directory(lock_dir))
    sweep_generations_locked(state)
    if state.removed:
        logger.warning("namespace %s had no coordinator segment and no journal; removed orphaned resources of an "
                       "earlier generation: %s", namespace, ", ".join(state.removed))
    return state.removed


def reclaim_stale_locked(namespace: str, state: NamespaceState, reason: str) -> int | None:
    """Remove a generation nobody holds any more, keeping the lock file (the caller, an election holding
    the lock, goes on to create the next generation). Returns the reclaimed generation, if any."""
    generation = state.generation
    logger.warning("reclaiming namespace %s generation %s: %s", namespace, generation, reason)
    remove_generation_locked(state)
    if state.removed:
        logger.warning("reclaimed from %s generation %s: %s", namespace, generation, ", ".join(state.removed))
    return generation
