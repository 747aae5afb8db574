"""``ShmCoordinator``: one participant of a per-manager namespace — election, readiness, failure, leaving.

Election (constructor), all under the coordinator ``FileLock`` ``{lockdir}/{ns}.lock``, whose acquisition
is bounded by ``timeout`` (the participant's heartbeat thread starts right after the lock is released):

1. ``/{ns}.c`` absent -> this handle is the **creator** of a new generation: if a journal is left over (a
   crash during creation or cleanup) its resources are reclaimed first and the new generation is its
   generation + 1, else 1, moved past any number whose names another uid took (``_unsquatted_generation``).
   The journal header is written, then ``/{ns}.c`` created (O_EXCL), the creator's
   lease claimed and the header written with state INITIALIZING (magic last).
2. ``/{ns}.c`` present and valid, with at least one live lease -> **follower**: claim a lease slot. Joining
   needs a live lease: it is what keeps the generation's resources alive.
3. ``/{ns}.c`` present but no live lease (everyone died or was ended by ``ftd``), or an aborted creation ->
   reclaim that generation with the cleanup code (WARNING naming it) and become the creator of the next.

Where: the segments live in ``shm_dir`` (``segment_dir.py``; default ``$FT_SHM_DIR`` or ``/dev/shm``), which the
creator records in the journal. A participant configured with another directory than a live generation's
journal names is refused with ``ValueError`` naming both: it would otherwise create a second copy beside it.

Anything that cannot be trusted (bad magic, another protocol, a truncated segment, a malformed journal, a
different flextensor version) raises ``ShmProtocolError`` and changes nothing.

Liveness is the lease reader's (``leases.py``): a fresh heartbeat whose process is not known to be gone. On
one host and in one pid namespace a SIGKILLed participant is therefore dead at once, not after its lease.

Admission of a restarted job: a generation still INITIALIZING whose creator is dead but whose followers have
not left yet is not joined; the election releases the lock and retries (up to ``_DOOMED_WAIT_S``) until they
left, then reclaims it and creates the next generation. A restart needs no supervisor and no second try.

Readiness: the creator publishes through ``memory_owner`` and calls ``notify_ready()`` (state READY) or
``mark_failed(error)`` (message, then FAILED). Followers poll the header in ``wait_for_ready`` every 10 ms:
READY returns, FAILED raises ``ShmCreatorFailedError`` with the creator's message, and the creator's lease
ending while INITIALIZING (its process gone, its heartbeat expired or ended by ``ftd``) raises
``ShmCreatorDiedError``.

Sleeping, waking and new weights: each participant's activity (serving, sleeping, updating) in its lease slot
and the generation's weights version in the header, changed under the lock through ``participation``
(Note [sleeping participants and weight updates] in ``activity.py``). The election waits while an update is
being written, and refuses a copy one left torn.

Leaving (``close``): wait for local setup through the owner; a creator that never published marks the
generation FAILED so followers learn it at once; then, under the lock, stop the heartbeat, free the slot,
and if no live lease remains unlink everything the journal names, the coordinator segment, the journal and
the lock file. A close that fails (lock timeout, unlink error) keeps what it needs and can be retried.

Each ``ShmCoordinator`` is its own participant (own token, slot and heartbeat), even within one process. A
handle that is never closed keeps its lease (and the generation) alive until its process exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from contextlib import contextmanager

from flextensor.shm import segment_dir
from flextensor.shm import activity
from flextensor.shm.checks import check_lease_seconds, check_seconds
from flextensor.shm.cleanup import (
    NamespaceState,
    inspect_namespace_locked,
    reclaim_stale_locked,
    remove_generation_locked,
    sweep_orphans_locked,
    remove_lock_file_locked,
)
from flextensor.shm.errors import ShmCreatorDiedError, ShmCreatorFailedError, ShmProtocolError
from flextensor.shm.header import (
    DEFAULT_SLOT_COUNT,
    LIBRARY_VERSION,
    HeaderInfo,
    State,
    coordinator_segment_size,
    open_coordinator_segment,
    read_failure,
    read_state,
    store_state,
    validate_header,
    write_failure,
    write_header,
)
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.journal import create_journal, remove_journal
from flextensor.shm.leases import Activity, Heartbeat, LeaseTable
from flextensor.shm.locks import FileLock
from flextensor.shm.names import coordinator_lock_path, coordinator_segment_name, manager_namespace, validate_namespace
from flextensor.shm.orphans import squatted_generations
from flextensor.shm.owner import ShmOwner
from flextensor.shm.segment import SharedSegment

__all__ = ["ShmCoordinator", "peek_ready"]

logger = logging.getLogger(__name__)

_POLL_S = 0.01
#: How long an election waits for the followers of a dead creator to leave before joining them anyway.
_DOOMED_WAIT_S = 5.0
_DOOMED_RETRY_S = 0.05


def _describe_error(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        text = str(error)
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return str(error)


def peek_ready(namespace: str) -> bool:
    """A hint, read without the coordinator lock: does ``namespace`` have a generation that is READY (its
    segments in the namespace's directory, ``segment_dir.py``)?

    A caller that sees one will almost certainly join it as a follower, and may start its follower work before
    the join (``SharedOffloadSession``). Only the join, under the lock, decides: the generation may end between
    the two. A header being written, or anything untrustworthy, reads as "no"."""
    try:
        segment, _header = open_coordinator_segment(validate_namespace(namespace))
    except (FileNotFoundError, ShmProtocolError):
        return False
    try:
        return read_state(segment.buffer, segment.name) == State.READY
    except ShmProtocolError:
        return False
    finally:
        segment.close()


class ShmCoordinator:
    """Join (or create) the sharing group of one per-manager namespace; see the module docstring.

    ``lease_seconds``: how long this participant stays counted without a heartbeat (heartbeats every quarter
    of it). ``timeout``: bound on acquiring the coordinator lock (None: wait as long as it takes), for the
    election and every later registration and close. ``base``/``manager``: the names ``namespace`` was derived
    from, recorded in the journal so that operators' tools can show them. ``join_timeout``, when given, bounds
    the election's wait alone (a caller that would rather do something else than wait long for the join, as a follower's attach
    thread does); the later waits keep ``timeout``. ``shm_dir``: the directory of the segments (None:
    ``$FT_SHM_DIR``, else ``/dev/shm``; ``ValueError`` when it is not a directory).
    """

    def __init__(self, namespace: str, *, lease_seconds: float = 30.0, timeout: float | None = None,
                 join_timeout: float | None = None, base: str | None = None, manager: str | None = None,
                 shm_dir: str | None = None) -> None:
        self._namespace = validate_namespace(namespace)
        self._shm_dir = segment_dir.check_directory(shm_dir) if shm_dir is not None else \
            segment_dir.default_directory()
        derived = manager_namespace(base, manager) if base is not None and manager is not None else None
        if (base is None) != (manager is None) or derived not in (None, namespace):
            raise ValueError(f"base {base!r} and manager {manager!r} must both be given and derive namespace "
                             f"{namespace!r} (manager_namespace(base, manager)), or both be None")
        self._labels = (base, manager)
        lease = check_lease_seconds(lease_seconds)
        self._timeout = check_seconds(timeout, "timeout", allow_none=True)
        join_wait = self._timeout if join_timeout is None else check_seconds(join_timeout, "join_timeout",
                                                                             allow_none=False)
        self._lease_ns = int(lease * 1e9)
        self._identity = ParticipantIdentity.current()
        self._segment_name = coordinator_segment_name(namespace)
        self._thread_lock = threading.Lock()  # one thread at a time on the FileLock object below
        self._lock = FileLock(coordinator_lock_path(namespace))
        self._segment: SharedSegment | None = None
        self._table: LeaseTable | None = None
        self._heartbeat: Heartbeat | None = None
        self._slot = -1
        self._left = False
        self._closed = False
        self._header: HeaderInfo | None = None
        self._updating = False  # the last election waited for new weights being written
        self._participation: activity.Participation | None = None
        segment_dir.bind_namespace(namespace, self._shm_dir)
        self._elect_until_admitted(join_wait)
        assert self._header is not None and self._table is not None
        self._is_creator: bool = self._header.creator.token == self._identity.token
        self._generation: int = self._header.generation
        self._owner: ShmOwner = ShmOwner(namespace, self._generation, self._is_creator, self._registration)
        # The heartbeat starts after the lock is released: the lease claimed above runs for lease_seconds from
        # now, and starting a thread (a millisecond or more on a busy host) under the lock would make every
        # other worker joining at the same moment wait for it.
        self._heartbeat = Heartbeat(self._table, self._slot, self._identity, self._lease_ns)
        try:
            self._heartbeat.start()
        except BaseException:
            self.close()  # leave the slot claimed above (and, if last, remove what the election created)
            raise
        logger.info(
            "%s namespace %s generation %d as %s (lease slot %d, lease %.1f s; segments in %s, %s)",
            "created" if self._is_creator else "joined", namespace, self._generation,
            "creator" if self._is_creator else "follower", self._slot, self._lease_ns / 1e9, self._shm_dir,
            segment_dir.page_info(self._shm_dir).describe(),
        )

    # ------------------------------------------------------------------ locking
    @contextmanager
    def _locked(self, timeout: float | None) -> Iterator[None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._thread_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"another thread of this process holds the coordinator lock of {self._namespace!r}"
                               f" for longer than {timeout:g} s")
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._lock.acquire(remaining)
            try:
                yield
            finally:
                if self._lock.held:
                    self._lock.release()
        finally:
            self._thread_lock.release()

    @contextmanager
    def _registration(self) -> Iterator[None]:
        """For the owner: hold the coordinator lock to journal a resource, while this handle participates."""
        if self._left:
            raise RuntimeError(f"the session of namespace {self._namespace!r} is closing or closed (it left generation "
                               f"{self._generation}); it can create no new shared resources: open a new session")
        with self._locked(self._timeout):
            assert self._table is not None
            if not self._table.is_live(self._slot, self._identity):
                # Our lease ran out (a stall longer than the lease) or ftd ended it: the generation may have
                # been reclaimed already, so registering more resources in it could leak them.
                raise RuntimeError(
                    f"this worker's lease in namespace {self._namespace!r} generation {self._generation} expired or "
                    "was ended (a stall longer than lease_seconds, or `ftd` saw it as dead); it no longer keeps the "
                    "shared weights alive. Close the session and start the worker again (raise lease_seconds if it "
                    "stalls that long)"
                )
            yield

    # ------------------------------------------------------------------ election
    def _elect_until_admitted(self, timeout: float | None) -> None:
        """Run the election; while the generation here is doomed (its creator died while INITIALIZING but some
        of its followers have not noticed yet), release the lock and try again, so a job restarted right after
        such a crash creates a new generation instead of joining one that can only fail.  The followers see the
        death at their next poll (10 ms) and leave; after ``_DOOMED_WAIT_S`` (a follower that never waits for
        READY) we join anyway, and ``wait_for_ready`` raises ``ShmCreatorDiedError`` at once."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            patient = time.monotonic() - start < _DOOMED_WAIT_S and (deadline is None or time.monotonic() < deadline)
            self._updating = False
            with self._locked(remaining):
                if self._elect(wait_if_doomed=patient):
                    return
            if self._updating and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"namespace {self._namespace!r}: new weights were still being written into its "
                                   f"host copy after {timeout:g} s, and a participant joins only once they are "
                                   "complete; pass a longer timeout")
            time.sleep(_DOOMED_RETRY_S)

    def _elect(self, *, wait_if_doomed: bool = False) -> bool:
        """One election under the lock; False (nothing changed) when the caller should retry later."""
        state = inspect_namespace_locked(self._namespace)  # reading the journal binds the directory it records
        try:
            if state.header is not None:
                live = state.live_slots()
                if live:
                    self._check_directory(state)
                    header = state.header
                    creator_live = any(s.index == header.creator_slot and s.identity == header.creator for s in live)
                    if wait_if_doomed and header.state == State.INITIALIZING and not creator_live:
                        logger.info("namespace %s generation %d: its creator (%s) died while INITIALIZING; waiting "
                                    "for its %d remaining participant(s) to leave before electing a new creator",
                                    self._namespace, header.generation, header.creator.describe(), len(live))
                        return False
                    table = LeaseTable(state.segment.buffer, header.slot_count, segment=header.segment)
                    if not activity.check_readable(state.segment.buffer, table, self._namespace):
                        self._updating = True  # joining reads the host copy: wait until the update is written
                        return False
                    self._join(state)
                    return True
                reason = (f"no participant of generation {state.header.generation} holds a live lease any more "
                          f"(state {state.header.state.name}, creator {state.header.creator.describe()})")
            elif state.coordinator_exists:
                reason = "its coordinator segment was never completely created"
            elif state.journal_exists:
                reason = "its journal survived without a coordinator segment (interrupted creation or cleanup)"
            else:
                reason = ""
            if reason:
                previous = reclaim_stale_locked(self._namespace, state, reason)
            else:
                previous = None
                sweep_orphans_locked(self._namespace)
            segment_dir.bind_namespace(self._namespace, self._shm_dir)  # the next generation lives where we say
            self._create(self._unsquatted_generation((previous or 0) + 1))
            return True
        finally:
            state.close()

    def _check_directory(self, state: NamespaceState) -> None:
        """``ValueError`` when the live generation's segments are in another directory than this handle's."""
        recorded = state.journal.header.shm_dir if state.journal is not None else self._shm_dir
        if recorded != self._shm_dir:
            segment_dir.bind_namespace(self._namespace, self._shm_dir)
            raise ValueError(
                f"namespace {self._namespace!r} is served from segments in {recorded} (its journal says so), but "
                f"this worker is configured for {self._shm_dir}: every worker of a namespace must use the same "
                f"shm_dir ({segment_dir.ENV_VAR}); set it to {recorded} here, or stop the running job first")

    def _join(self, state: NamespaceState) -> None:
        header = state.header
        assert header is not None and state.segment is not None
        if header.library_version != LIBRARY_VERSION:
            raise ShmProtocolError(
                f"coordinator segment {header.segment} was created by flextensor {header.library_version}, this "
                f"process runs {LIBRARY_VERSION}: all participants of a namespace must use the same flextensor "
                "version; restart all workers with the same version"
            )
        table = LeaseTable(state.segment.buffer, header.slot_count, segment=header.segment)
        self._slot = table.join(self._identity, self._lease_ns)
        table.set_activity(self._slot, self._identity, Activity.SERVING,
                           activity.weights_version(state.segment.buffer))
        self._segment, state.segment = state.segment, None  # keep the mapping
        self._table = table
        self._header = header

    def _unsquatted_generation(self, generation: int) -> int:
        """``generation``, or the first later one none of whose names another uid has taken in ``/dev/shm``.

        The names of generation N are derived (``names.py``), so any user can create ``{ns}.g{N+1}.sd`` while
        generation N runs, and the restart after a crash would fail on it. A creator therefore skips every
        number with a name of another uid (WARNING naming the uid and the entry); the journal and the header
        record the number chosen, so followers, cleanup and ftd follow it. A name taken after this choice, while
        the creator publishes, still fails that creation (FileExistsError naming the owner); the restart after
        it skips that number too."""
        squatted = squatted_generations(self._namespace, os.geteuid(), Path(self._shm_dir))
        while generation in squatted:
            entry, uid = squatted[generation]
            where = self._shm_dir if os.path.lexists(os.path.join(self._shm_dir, entry)) else \
                segment_dir.DEFAULT_DIRECTORY
            logger.warning("namespace %s: generation %d skipped, %s/%s belongs to uid %d, not to this user "
                           "(uid %d); that user or root can remove it (`rm %s/%s`)", self._namespace,
                           generation, where, entry, uid, os.geteuid(), where, entry)
            generation += 1
        return generation

    def _create(self, generation: int) -> None:
        create_journal(self._namespace, generation, base=self._labels[0], manager=self._labels[1],
                       shm_dir=self._shm_dir)
        try:
            segment = SharedSegment.create(self._segment_name, coordinator_segment_size(DEFAULT_SLOT_COUNT))
        except BaseException:
            remove_journal(self._namespace)
            raise
        try:
            table = LeaseTable(segment.buffer, DEFAULT_SLOT_COUNT, segment=self._segment_name)
            self._slot = table.join(self._identity, self._lease_ns)
            write_header(
                segment.buffer,
                generation=generation,
                lease_ns=self._lease_ns,
                slot_count=DEFAULT_SLOT_COUNT,
                creator=self._identity,
                creator_slot=self._slot,
                created_at_ns=time.time_ns(),
            )
            self._header = validate_header(segment.buffer, self._segment_name, segment.size)
        except BaseException:
            segment.close()
            SharedSegment.unlink_name(self._segment_name)
            remove_journal(self._namespace)
            raise
        self._segment = segment
        self._table = table

    # ------------------------------------------------------------------ properties
    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def is_creator(self) -> bool:
        return self._is_creator

    @property
    def identity(self) -> ParticipantIdentity:
        return self._identity

    @property
    def lease_slot(self) -> int:
        return self._slot

    @property
    def memory_owner(self) -> ShmOwner:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def state(self) -> State:
        """The generation's current state, read from the header."""
        return read_state(self._buffer(), self._segment_name)

    @property
    def creator(self) -> ParticipantIdentity:
        assert self._header is not None
        return self._header.creator

    def _buffer(self) -> memoryview:
        if self._segment is None:
            raise RuntimeError(f"the session of namespace {self._namespace!r} is closed (its coordinator was closed); "
                               "open a new session")
        return self._segment.buffer

    # ------------------------------------------------------------------ creator
    def _require_creator(self, what: str) -> None:
        if not self._is_creator:
            raise RuntimeError(f"{what}() is for the creator of {self._namespace!r} generation {self._generation}; "
                               "this handle is a follower (use wait_for_ready())")

    def notify_ready(self) -> None:
        """Publish READY (after everything followers need was written through ``memory_owner``)."""
        self._require_creator("notify_ready")
        buf = self._buffer()
        current = read_state(buf, self._segment_name)
        if current == State.FAILED:
            raise RuntimeError(f"namespace {self._namespace!r} generation {self._generation} is already FAILED; "
                               "it cannot become READY")
        self._owner.check_intact()  # never publish a segment that was truncated meanwhile (SIGBUS for readers)
        store_state(buf, State.READY)
        logger.info("namespace %s generation %d is READY", self._namespace, self._generation)

    def mark_failed(self, error: BaseException | str) -> None:
        """Publish FAILED with ``error``'s message (bounded to 2 KiB) so followers raise it.

        A generation that already FAILED keeps its first message; one that is READY cannot fail
        (followers may already use it): ``RuntimeError``.
        """
        self._require_creator("mark_failed")
        buf = self._buffer()
        current = read_state(buf, self._segment_name)
        if current == State.FAILED:
            logger.debug("namespace %s already FAILED; keeping the first message", self._namespace)
            return
        if current == State.READY:
            raise RuntimeError(f"namespace {self._namespace!r} generation {self._generation} is already READY; "
                               "followers may be using it, so it cannot be marked FAILED")
        message = _describe_error(error)
        write_failure(buf, message)
        logger.warning("namespace %s generation %d marked FAILED: %s", self._namespace, self._generation, message)

    # ------------------------------------------------------------------ followers
    def wait_for_ready(self, timeout: float | None = None, *, cancel: threading.Event | None = None) -> None:
        """Wait until the creator published (READY).

        ``ShmCreatorFailedError`` when it marked the generation FAILED (``creator_message`` holds its text),
        ``ShmCreatorDiedError`` when its lease ran out while INITIALIZING, ``TimeoutError`` after ``timeout``
        seconds (None: no limit), ``InterruptedError`` once ``cancel`` is set (a caller that waits on a thread
        and gave up meanwhile).
        """
        timeout = check_seconds(timeout, "timeout", allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        buf = self._buffer()
        assert self._table is not None and self._header is not None
        creator = self._header.creator
        creator_slot = self._header.creator_slot
        while True:
            state = read_state(buf, self._segment_name)
            if state == State.READY:
                return
            if state == State.FAILED:
                message = read_failure(buf)
                raise ShmCreatorFailedError(
                    f"the creator ({creator.describe()}) of namespace {self._namespace!r} generation "
                    f"{self._generation} failed: {message}",
                    message,
                )
            if self._is_creator:
                raise RuntimeError(f"wait_for_ready() on the creator of {self._namespace!r}: the creator publishes "
                                   "and calls notify_ready() or mark_failed() itself")
            if not self._table.is_live(creator_slot, creator):
                # Re-read: the creator may have published just before its lease ended.
                if read_state(buf, self._segment_name) == State.INITIALIZING:
                    raise ShmCreatorDiedError(
                        f"the creator of namespace {self._namespace!r} generation {self._generation} (pid "
                        f"{creator.pid}) died or was killed before publishing. This worker cannot use it: close "
                        "the session (or coordinator) and start the workers again; the next start elects a new "
                        "creator"
                    )
                continue
            pause = _POLL_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"namespace {self._namespace!r} generation {self._generation} was not READY within "
                        f"{timeout:g} s; its creator (pid {creator.pid}) is alive and still INITIALIZING: pass a "
                        "longer timeout if loading the model takes longer"
                    )
                pause = min(_POLL_S, remaining)
            if cancel is None:
                time.sleep(pause)
            elif cancel.wait(pause):
                raise InterruptedError(f"waiting for namespace {self._namespace!r} generation {self._generation} "
                                       "to be READY was cancelled by its caller")

    @property
    def participation(self) -> activity.Participation:
        """This participant's activity and the generation's weights version: sleep, wake and weight updates
        (Note [sleeping participants and weight updates] in ``activity.py``)."""
        if self._participation is None:
            assert self._table is not None
            self._participation = activity.Participation(
                self._namespace, self._table, self._slot, self._identity, self._buffer,
                lambda timeout: self._locked(self._timeout if timeout is None else timeout), self._timeout)
        return self._participation

    # ------------------------------------------------------------------ leaving
    def close(self, timeout: float | None = None) -> None:
        """Leave the generation; the last participant removes all of it. Idempotent; retry if it raised.

        ``timeout`` bounds the wait for local setup and for the coordinator lock (default: the constructor's).
        """
        if self._closed:
            return
        timeout = self._timeout if timeout is None else check_seconds(timeout, "timeout", allow_none=True)
        self._owner.close(timeout)
        if self._is_creator and not self._left and self._segment is not None:
            if read_state(self._segment.buffer, self._segment_name) == State.INITIALIZING:
                write_failure(self._segment.buffer, "the creator's session closed before it published the "
                                                    "weights (initialization did not complete)")
        with self._locked(timeout):
            if not self._left:
                assert self._heartbeat is not None and self._table is not None
                self._heartbeat.stop()
                self._table.leave(self._slot, self._identity)
                self._left = True
            self._remove_if_last()
        self._lock.close()
        if self._segment is not None:
            self._heartbeat = None  # they hold the mapping's memoryview: drop them so close() can unmap
            self._table = None
            self._participation = None
            self._segment.close()
            self._segment = None
        self._closed = True
        logger.debug("left namespace %s generation %d", self._namespace, self._generation)

    def _remove_if_last(self) -> None:
        """With the lock held: if our generation has no live lease left, remove all of it."""
        state = inspect_namespace_locked(self._namespace)
        try:
            if state.empty:  # removed meanwhile (offline cleanup): only the lock file we just made is left
                remove_lock_file_locked(state, self._lock)
                return
            if state.generation != self._generation:
                return  # a later generation lives here now: nothing of ours is left to remove
            live = state.live_slots()
            if live:
                logger.debug("namespace %s generation %d stays: %d participant(s) remain", self._namespace,
                             self._generation, len(live))
                return
            remove_generation_locked(state)
            remove_lock_file_locked(state, self._lock)
            logger.info("last participant of namespace %s generation %d removed %s", self._namespace,
                        self._generation, ", ".join(state.removed))
        finally:
            state.close()

    def __enter__(self) -> ShmCoordinator:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and self._is_creator and not self._closed and self.state == State.INITIALIZING:
            self.mark_failed(exc)
        self.close()

    def __repr__(self) -> str:
        role = "creator" if self._is_creator else "follower"
        return (f"ShmCoordinator({self._namespace!r}, generation={self._generation}, {role}, "
                f"slot={self._slot}, closed={self._closed})")
