"""Warm hold: the daemon as a participant of a generation, so its weights survive every worker restarting.

``ftd hold NS --manager NAME`` joins the lease table of the per-manager namespace's current generation with
the daemon's own identity (a fresh token) and starts a heartbeat thread, exactly like a follower's
``ShmCoordinator`` would, but without mapping any data segment.  While the hold lasts the generation always
has a live lease, so the last worker's ``close()`` does not remove it, and a restarted worker's
``ShmCoordinator`` finds a live READY generation and *joins it as a follower*: it attaches the published
blocks instead of loading the checkpoint again.

Rules (same as any joiner, see the spec): a hold needs an existing READY generation with at least one live
lease (holding an INITIALIZING generation could keep a dead creator's half-published state alive); it is
refused for a draining namespace.  ``ftd release`` leaves the slot under the coordinator lock and, if the
daemon was the last participant, reclaims the generation at once.  A daemon that exits cleanly releases its
holds; one that is killed stops heartbeating and its hold expires after one lease (the creator's
``lease_seconds``).  A restarted daemon does not hold anything until ``ftd hold`` is run again.
"""

from __future__ import annotations

import logging

from flextensor.shm.cleanup import inspect_namespace_locked
from flextensor.shm.header import State, read_state
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.leases import Heartbeat, LeaseTable
from flextensor.shm.locks import FileLock
from flextensor.shm.names import coordinator_lock_path

from flextensor.daemon.registry import Hold, LockDir, acting_in

__all__ = ["take_hold", "drop_hold", "HoldRefused", "LOCK_TIMEOUT_S"]

logger = logging.getLogger(__name__)

#: How long a hold/release waits for the coordinator lock (an election holds it for milliseconds).
LOCK_TIMEOUT_S = 1.0


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
                slot = table.join(identity, header.lease_ns)
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
                slot=slot, identity=identity, heartbeat=heartbeat, owner_uid=owner_uid)


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
