"""Warm hold: the daemon as a participant of a generation, so its weights survive every worker restarting.

``ftd hold NS --manager NAME`` joins the lease table of the per-manager namespace's current generation with
the daemon's own identity (a fresh token) and starts a heartbeat thread, exactly like a follower's
``ShmCoordinator`` would, but without mapping any data segment.  Its slot is DURABLE (``leases.py``): it
outlives the daemon's process by up to one lease, so that a restarted daemon can take it over, while a
worker's slot ends with its process.  While the hold lasts the generation always
has a live lease, so the last worker's ``close()`` does not remove it, and a restarted worker's
``ShmCoordinator`` finds a live READY generation and *joins it as a follower*: it attaches the published
blocks instead of loading the checkpoint again.

Rules (same as any joiner): a hold needs an existing READY generation with at least one live
lease (holding an INITIALIZING generation could keep a dead creator's half-published state alive); it is
refused for a draining namespace.  ``ftd release`` leaves the slot under the coordinator lock and, if the
daemon was the last participant, reclaims the generation at once.

Daemon restarts
---------------
Holds are recorded in ``<socket>.state`` (``state_file.py``): a new hold right after it joined its slot, a
released one is removed from the file *before* it leaves its slot, so a daemon killed in between either
leaves an unrecorded slot that expires after one lease or re-takes a hold nobody released.  A daemon that exits on SIGTERM/SIGINT
releases them (unless ``keep_holds_on_exit``); one that is killed, or that keeps them, leaves them in the
file, and the next daemon re-takes each one at start with :func:`restore_hold`, under the coordinator lock:

* the generation must still be there and READY, with the same number *and* the same creation time (a
  generation cleaned up and created again gets the same number but a new time); otherwise the hold is
  dropped with one WARNING and nothing is created (not even the lock file);
* **adoption**: when the previous daemon's slot is still ACTIVE, holds the recorded identity and has not
  expired, the new daemon takes it over: it refreshes the heartbeat at once, then keeps refreshing it from
  its own heartbeat thread *with the recorded identity* (the lease table only checks the slot's pid and
  token before each beat; the slot then keeps naming the old daemon's pid, which no daemon watches);
* otherwise (the slot expired, or was ended or reused) it joins a fresh slot with its own identity; a READY
  generation's weights are complete, so this is allowed even when no other lease is live any more.

No two processes ever refresh the same slot: (1) the new daemon holds ``<socket>.lock``, an ``flock`` the
kernel releases only when its previous holder exits, and only that holder writes the state file; (2) the
state file names the daemon that wrote it (pid, start time, boot id, pid namespace), and a slot is adopted
only when that process is gone (a zombie counts as gone) or wrote ``heartbeats_stopped`` after stopping its
heartbeat threads on a clean exit; (3) the check "ACTIVE, same identity, unexpired" and the first refresh
happen under the coordinator lock, and a joiner (which needs that lock) only takes over an *expired* slot;
(4) slot tokens are 16 random bytes, so nobody else's heartbeat matches the slot.
"""

from __future__ import annotations

import logging

from flextensor.shm.cleanup import NamespaceState, inspect_namespace_locked
from flextensor.shm.header import State, read_state
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.leases import Heartbeat, LeaseTable, SlotState
from flextensor.shm.locks import FileLock
from flextensor.shm.names import coordinator_lock_path

from flextensor.daemon.lockdirs import LockDir, acting_in
from flextensor.daemon.registry import Hold
from flextensor.daemon.state_file import PersistedHold

__all__ = ["take_hold", "drop_hold", "restore_hold", "HoldRefused", "HoldGone", "LOCK_TIMEOUT_S",
           "RESTORE_LOCK_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: How long a hold/release waits for the coordinator lock (an election holds it for milliseconds).
LOCK_TIMEOUT_S = 1.0
#: The same at start-up, restoring holds (nothing is served yet, and giving up drops the hold).
RESTORE_LOCK_TIMEOUT_S = 5.0


class HoldGone(Exception):
    """A persisted hold cannot be re-taken: its generation is gone, was replaced, or is no longer READY."""


class HoldRefused(Exception):
    """The generation cannot be held; ``code`` is the protocol error code to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def take_hold(namespace: str, lock_dir: LockDir, owner_uid: int) -> Hold:
    """Join ``namespace``'s current generation as the daemon (see the module docstring)."""
    with acting_in(lock_dir):  # the lock file may be (re)created: it must belong to the namespace's owner
        lock = FileLock(coordinator_lock_path(namespace, lock_dir.path))
        try:
            lock.acquire(LOCK_TIMEOUT_S)
        except TimeoutError as exc:
            lock.close()
            raise HoldRefused("busy", str(exc)) from None
        try:
            state = inspect_namespace_locked(namespace, lock_dir.path)
            try:
                header = state.header
                if header is None or state.segment is None:
                    if state.empty:
                        lock.unlink_if_held()  # we just created the lock file: leave no trace
                    raise HoldRefused("not_found", f"namespace {namespace} has no generation to hold (no coordinator "
                                                   "segment): start a worker first, then hold")
                current = read_state(state.segment.buffer, header.segment)
                if current != State.READY:
                    raise HoldRefused("conflict", f"namespace {namespace} generation {header.generation} is "
                                                  f"{current.name}; only a READY generation can be held")
                if not state.live_slots():
                    raise HoldRefused("not_found", f"namespace {namespace} generation {header.generation} has no "
                                                   "live participant left; nothing to keep warm")
                table = LeaseTable(state.segment.buffer, header.slot_count, segment=header.segment)
                identity = ParticipantIdentity.current()
                slot = table.join(identity, header.lease_ns, durable=True)
                segment, state.segment = state.segment, None  # keep the mapping for the heartbeat
            finally:
                state.close()
        finally:
            lock.close()
        heartbeat = Heartbeat(table, slot, identity, header.lease_ns)
        heartbeat.start()
    logger.info("holding %s generation %d (lease slot %d, lease %.1f s)", namespace, header.generation, slot,
                header.lease_ns / 1e9)
    return Hold(namespace=namespace, lock_dir=lock_dir, generation=header.generation, segment=segment, table=table,
                slot=slot, identity=identity, heartbeat=heartbeat, owner_uid=owner_uid,
                created_at_ns=header.created_at_ns, lease_ns=header.lease_ns)


def drop_hold(hold: Hold) -> int:
    """Leave the held slot under the coordinator lock; returns the live leases left (0: reclaim it now).

    ``TimeoutError`` when the lock stays taken (the hold is then kept, still heartbeating: retry).
    """
    with acting_in(hold.lock_dir):
        lock = FileLock(coordinator_lock_path(hold.namespace, hold.lock_dir.path))
        try:
            lock.acquire(LOCK_TIMEOUT_S)
            try:
                hold.heartbeat.stop()  # type: ignore[attr-defined]
                hold.table.leave(hold.slot, hold.identity)
                remaining = hold.table.live_count()
            finally:
                lock.release()
        finally:
            lock.close()
    hold.table = None  # type: ignore[assignment]  # drop memoryview users before unmapping
    hold.heartbeat = None
    hold.segment.close()
    logger.info("released %s generation %d (%d participant(s) remain)", hold.namespace, hold.generation, remaining)
    return remaining


def restore_hold(record: PersistedHold, lock_dir: LockDir, owner_uid: int, *, may_adopt: bool,
                 timeout: float = RESTORE_LOCK_TIMEOUT_S) -> Hold:
    """Re-take a hold of the previous daemon (see "Daemon restarts" in the module docstring).

    ``may_adopt``: the previous daemon no longer refreshes its slots (the caller checked).  Raises
    :class:`HoldGone` when the generation cannot be held any more, ``TimeoutError`` when the coordinator lock
    stays taken, ``ShmProtocolError`` when the namespace's metadata cannot be trusted, ``RuntimeError`` when
    every lease slot is taken.
    """
    ns = record.namespace
    with acting_in(lock_dir):
        lock = FileLock(coordinator_lock_path(ns, lock_dir.path))
        try:
            lock.acquire(timeout)
            state = inspect_namespace_locked(ns, lock_dir.path)
            try:
                table, index, identity, lease_ns, adopted = _rejoin_locked(record, state, lock, may_adopt)
                header = state.header
                segment, state.segment = state.segment, None  # keep the mapping for the heartbeat
            finally:
                state.close()
        finally:
            lock.close()
        heartbeat = Heartbeat(table, index, identity, lease_ns)
        heartbeat.start()
    assert header is not None and segment is not None
    return Hold(namespace=ns, lock_dir=lock_dir, generation=header.generation, segment=segment, table=table,
                slot=index, identity=identity, heartbeat=heartbeat, owner_uid=owner_uid, since=record.since,
                created_at_ns=header.created_at_ns, lease_ns=lease_ns, adopted=adopted)


def _rejoin_locked(record: PersistedHold, state: NamespaceState, lock: FileLock,
                   may_adopt: bool) -> tuple[LeaseTable, int, ParticipantIdentity, int, bool]:
    """Under the coordinator lock: check the generation, then adopt the recorded slot or join a fresh one."""
    header = state.header
    if header is None or state.segment is None:
        if state.empty:
            lock.unlink_if_held()  # we just created the lock file: leave no trace
        raise HoldGone("its generation was cleaned up (no coordinator segment)")
    if header.generation != record.generation or header.created_at_ns != record.created_at_ns:
        raise HoldGone(f"generation {header.generation} (created at {header.created_at_ns / 1e9:.3f}) replaced it")
    current = read_state(state.segment.buffer, header.segment)
    if current != State.READY:
        raise HoldGone(f"the generation is {current.name}, not READY")
    table = LeaseTable(state.segment.buffer, header.slot_count, segment=header.segment)
    if 0 <= record.slot < header.slot_count:
        slot = table.slot(record.slot)
        if slot.state == SlotState.ACTIVE and slot.identity == record.identity:
            if slot.live:
                # Refresh first: from here on the slot is fresh for a whole lease, whoever looks.
                if may_adopt and table.heartbeat(record.slot, record.identity):
                    return table, record.slot, record.identity, slot.lease_ns, True
            else:
                table.leave(record.slot, record.identity)  # our own expired slot: free it rather than let it linger
    identity = ParticipantIdentity.current()
    return table, table.join(identity, header.lease_ns, durable=True), identity, header.lease_ns, False
