"""Participant leases: the lease table after the coordinator header, and the heartbeat thread.

Every participant of a generation (creator and followers, one per ``ShmCoordinator`` handle) owns one slot
of the table that follows the 4 KiB header page of ``/{ns}.c``. A participant is alive while its slot is
ACTIVE, its heartbeat is fresher than its lease, and its process is not *known* to be gone.

Slot layout (``SLOT_SIZE`` = 128 bytes at ``HEADER_SIZE + index * 128``, native byte order, protocol 3)::

    offset size field         meaning
    0      4    state         u32 SlotState: 0 FREE, 1 ACTIVE, 2 DEAD (ended by close-less death / ftd)
    4      4    pid           u32
    8      8    heartbeat_ns  u64 host_clock_ns() (CLOCK_BOOTTIME) of the last refresh (aligned store)
    16     8    lease_ns      u64 how long a heartbeat stays valid
    24     8    start_time    u64 process start time, clock ticks after boot
    32     16   boot_id       raw UUID bytes
    48     16   token         16 random bytes of the handle's identity
    64     8    pid_ns        u64 inode of the holder's pid namespace (0: unknown, judge by heartbeat only)
    72     4    flags         u32 bit 0 DURABLE: the lease outlives its process (an ftd hold, see below)
    76     4    activity      u32 Activity: 0 SERVING (its model may read the host copy), 1 SLEEPING,
                              2 UPDATING (it writes new weights into the host copy); ``activity.py``
    80     8    held_version  u64 the weights version its model holds (set at join and at each wake)
    88     40   reserved      0

A slot is claimed SERVING (zeros) and stores its activity with single aligned stores under the coordinator lock
(``activity.py`` says why the lock); readers outside the lock (``ftd``) only report it.

The one liveness rule (``LeaseTable._live_at``; every reader uses it: the last-participant check, the
election, a follower's wait for READY, cleanup and ``ftd``)::

    live = ACTIVE and same boot as this host and now - heartbeat_ns <= lease_ns
           and not (not DURABLE and process_gone(pid, start_time, boot_id, pid_ns))

``process_gone`` (``identity.py``) is True only when the slot's pid namespace is ours and no process runs
with that pid and start time: a SIGKILLed participant on this host is dead *now*, not after its lease.
Participants in another pid namespace (containers sharing /dev/shm) are judged by the heartbeat alone.
A DURABLE slot (a daemon's warm hold) is meant to survive its holder for one lease, so that a restarted
daemon can take it over; only its heartbeat counts.

Write ordering and locking:

* ``join`` (claim) and ``leave`` (release) run under the coordinator ``FileLock`` (the caller holds it), so
  two joiners never pick the same slot. ``join`` prefers FREE slots, then DEAD ones, then ones whose
  heartbeat expired; it writes identity, lease and a fresh heartbeat first and the ACTIVE state last.  It
  never takes a slot whose heartbeat is still fresh, even when its process is gone: ``end_lease`` below may
  be about to store DEAD there.
* ``leave`` stores FREE first, then clears the rest; it only touches a slot still holding the caller's
  token, so a handle whose expired slot was reused never frees the new owner's slot.
* Heartbeats are single aligned 8-byte stores from a daemon thread every ``lease / 4``; before each store
  the thread checks that the slot is still ACTIVE with its token, and stops (``lost``) otherwise.
* ``end_lease`` is one aligned 4-byte store of DEAD and needs no lock (``ftd`` uses it). Given the identity
  it believes holds the slot, it is a compare-and-end: it stores DEAD only if, right before the store, the
  slot is ACTIVE, held by exactly that identity and its heartbeat is *unexpired*. The last condition is what
  makes the lock-free check sound: ``join`` takes over only FREE, DEAD or heartbeat-expired slots, so nobody
  can replace an unexpired holder between the check and the store (its owner is dead and will not ``leave``
  either). An expired slot is left alone: it is not counted as live anyway, and a joiner may be claiming it.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import uuid
from typing import TYPE_CHECKING

import msgspec

from flextensor.shm.header import (
    HEADER_SIZE,
    SLOT_SIZE,
    HeaderInfo,
    load_u32,
    load_u64,
    open_coordinator_segment,
    store_u32,
    store_u64,
)
from flextensor.shm.identity import ParticipantIdentity, boot_id, host_clock_ns, pid_namespace, process_gone

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.shm.segment import SharedSegment

__all__ = ["SlotState", "Activity", "LeaseSlot", "LeaseTable", "Heartbeat"]

logger = logging.getLogger(__name__)

OFF_STATE = 0
OFF_PID = 4
OFF_HEARTBEAT = 8
OFF_LEASE = 16
OFF_START_TIME = 24
OFF_BOOT_ID = 32
OFF_TOKEN = 48
OFF_PID_NS = 64
OFF_FLAGS = 72
OFF_ACTIVITY = 76
OFF_HELD_VERSION = 80

FLAG_DURABLE = 1


class SlotState(enum.IntEnum):
    FREE = 0
    ACTIVE = 1
    DEAD = 2


_SLOT_STATES = frozenset(int(state) for state in SlotState)


class Activity(enum.IntEnum):
    """What a participant does with the host copy (slot offset 76; the rules are in ``activity.py``)."""

    SERVING = 0
    SLEEPING = 1
    UPDATING = 2


class LeaseSlot(msgspec.Struct, frozen=True):
    """A snapshot of one slot (``identity`` is None for a FREE slot)."""

    index: int
    state: SlotState
    identity: ParticipantIdentity | None
    heartbeat_ns: int
    lease_ns: int
    live: bool
    pid_ns: int = 0
    durable: bool = False
    process_gone: bool = False  # its process is known to be gone (it may still be heartbeat-fresh)
    activity: int = Activity.SERVING  # an Activity value (an unknown one is reported as it is, never trusted)
    held_version: int = 0  # the weights version its model holds


def _uuid_bytes(text: str) -> bytes:
    return uuid.UUID(text).bytes


def _uuid_text(raw: bytes) -> str:
    return str(uuid.UUID(bytes=raw))


class LeaseTable:
    """The lease slots of one mapped coordinator segment.

    ``buffer`` is the whole segment; ``slot_count`` comes from a validated header. ``LeaseTable.open`` maps
    and validates a namespace's coordinator segment itself (read-only users such as ``ftd``).
    """

    def __init__(self, buffer: memoryview, slot_count: int, *, segment: str = "coordinator segment") -> None:
        if len(buffer) < HEADER_SIZE + slot_count * SLOT_SIZE:
            raise ValueError(f"{segment}: {len(buffer)} bytes cannot hold {slot_count} lease slots")
        self._buf = buffer
        self.slot_count = slot_count
        self.segment = segment
        self._boot_raw = _uuid_bytes(boot_id())
        self._owned_segment: SharedSegment | None = None  # set by open()
        self.header: HeaderInfo | None = None

    @classmethod
    def open(cls, namespace: str) -> LeaseTable:
        """Map ``/{namespace}.c``, validate its header and return its table (``close()`` it when done).

        ``FileNotFoundError`` when the namespace has no coordinator segment; ``ShmProtocolError`` when its
        header cannot be trusted.
        """
        segment, header = open_coordinator_segment(namespace)
        table = cls(segment.buffer, header.slot_count, segment=segment.name)
        table._owned_segment = segment
        table.header = header
        return table

    def close(self) -> None:
        """Unmap the segment if this table mapped it (``open``). Idempotent."""
        segment, self._owned_segment = self._owned_segment, None
        self._buf = None  # type: ignore[assignment]
        if segment is not None:
            segment.close()

    def __enter__(self) -> LeaseTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reading
    def _base(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.slot_count:
            raise IndexError(f"lease slot {index!r} is outside the {self.slot_count}-slot table of {self.segment}")
        return HEADER_SIZE + index * SLOT_SIZE

    def _fresh_at(self, base: int, now: int) -> bool:
        """ACTIVE, this boot, heartbeat within its lease: the heartbeat half of liveness (``join`` and
        ``end_lease`` use it alone, see the module docstring)."""
        if load_u32(self._buf, base + OFF_STATE) != SlotState.ACTIVE:
            return False
        if bytes(self._buf[base + OFF_BOOT_ID:base + OFF_BOOT_ID + 16]) != self._boot_raw:
            return False  # a slot from another boot (a /dev/shm that survived a reboot) never heartbeats again
        heartbeat = load_u64(self._buf, base + OFF_HEARTBEAT)
        lease = load_u64(self._buf, base + OFF_LEASE)
        return now - heartbeat <= lease  # a heartbeat stored after we read `now` is negative: live

    def _gone(self, base: int) -> bool:
        """The slot's process is certainly gone (same boot, our pid namespace, no such pid + start time)."""
        if load_u32(self._buf, base + OFF_FLAGS) & FLAG_DURABLE:
            return False
        return process_gone(
            load_u32(self._buf, base + OFF_PID),
            load_u64(self._buf, base + OFF_START_TIME),
            bytes(self._buf[base + OFF_BOOT_ID:base + OFF_BOOT_ID + 16]),
            load_u64(self._buf, base + OFF_PID_NS),
        )

    def _live_at(self, base: int, now: int) -> bool:
        """THE liveness rule (module docstring): fresh heartbeat and a process not known to be gone."""
        return self._fresh_at(base, now) and not self._gone(base)

    def _identity(self, base: int) -> ParticipantIdentity:
        return ParticipantIdentity(
            pid=load_u32(self._buf, base + OFF_PID),
            start_time=load_u64(self._buf, base + OFF_START_TIME),
            boot_id=_uuid_text(bytes(self._buf[base + OFF_BOOT_ID:base + OFF_BOOT_ID + 16])),
            token=bytes(self._buf[base + OFF_TOKEN:base + OFF_TOKEN + 16]).hex(),
        )

    def _holds(self, base: int, identity: ParticipantIdentity) -> bool:
        return (
            load_u32(self._buf, base + OFF_PID) == identity.pid
            and bytes(self._buf[base + OFF_TOKEN:base + OFF_TOKEN + 16]) == bytes.fromhex(identity.token)
        )

    def slot(self, index: int, now: int | None = None) -> LeaseSlot:
        base = self._base(index)
        now = host_clock_ns() if now is None else now
        raw_state = load_u32(self._buf, base + OFF_STATE)
        try:
            state = SlotState(raw_state)
        except ValueError:
            from flextensor.shm.errors import ShmProtocolError

            from flextensor.shm.header import force_remedy

            raise ShmProtocolError(f"{self.segment}: lease slot {index} has unknown state {raw_state}; the "
                                   f"segment is corrupt: {force_remedy(self.segment)}") from None
        fresh = self._fresh_at(base, now)
        gone = state == SlotState.ACTIVE and self._gone(base)
        return self._snapshot(index, state, live=fresh and not gone, gone=gone)

    def _snapshot(self, index: int, state: SlotState, *, live: bool, gone: bool) -> LeaseSlot:
        base = HEADER_SIZE + index * SLOT_SIZE
        return LeaseSlot(
            index=index,
            state=state,
            identity=None if state == SlotState.FREE else self._identity(base),
            heartbeat_ns=load_u64(self._buf, base + OFF_HEARTBEAT),
            lease_ns=load_u64(self._buf, base + OFF_LEASE),
            live=live,
            pid_ns=load_u64(self._buf, base + OFF_PID_NS),
            durable=bool(load_u32(self._buf, base + OFF_FLAGS) & FLAG_DURABLE),
            process_gone=gone,
            activity=load_u32(self._buf, base + OFF_ACTIVITY),
            held_version=load_u64(self._buf, base + OFF_HELD_VERSION),
        )

    def slots(self, now: int | None = None) -> list[LeaseSlot]:
        """Snapshots of every slot, in index order."""
        now = host_clock_ns() if now is None else now
        return [self.slot(i, now) for i in range(self.slot_count)]

    def live_slots(self, now: int | None = None) -> list[LeaseSlot]:
        """Snapshots of the live slots. Every slot's state is checked, but only live ones are decoded, and each
        live one's process is looked up once (a ``/proc`` read): this runs under the coordinator lock at every
        join, where N workers arriving at once wait for each other, and for every namespace a sweep passes."""
        now = host_clock_ns() if now is None else now
        live = []
        for i in range(self.slot_count):
            base = HEADER_SIZE + i * SLOT_SIZE
            raw_state = load_u32(self._buf, base + OFF_STATE)
            if raw_state not in _SLOT_STATES:
                self.slot(i, now)  # raises ShmProtocolError naming the slot
            if raw_state == SlotState.ACTIVE and self._live_at(base, now):
                live.append(self._snapshot(i, SlotState.ACTIVE, live=True, gone=False))
        return live

    def live_count(self, now: int | None = None) -> int:
        now = host_clock_ns() if now is None else now
        return sum(self._live_at(HEADER_SIZE + i * SLOT_SIZE, now) for i in range(self.slot_count))

    def is_live(self, index: int, identity: ParticipantIdentity | None = None, now: int | None = None) -> bool:
        """Slot ``index`` is live (and, when ``identity`` is given, still held by it)."""
        base = self._base(index)
        now = host_clock_ns() if now is None else now
        if identity is not None and not self._holds(base, identity):
            return False
        return self._live_at(base, now)

    # ------------------------------------------------------------------ writing
    def join(self, identity: ParticipantIdentity, lease_ns: int, *, durable: bool = False) -> int:
        """Claim a slot for ``identity`` with a fresh heartbeat; returns its index.

        The caller holds the coordinator lock. The slot records this process's pid namespace when
        ``identity`` is this process (otherwise 0: only its heartbeat will count). ``durable``: the lease
        outlives the process by up to one lease (a daemon's hold). ``RuntimeError`` when every slot is held
        by a fresh heartbeat.
        """
        if lease_ns <= 0:
            raise ValueError(f"lease must be > 0 ns, got {lease_ns}")
        now = host_clock_ns()
        choice = None
        for wanted in (SlotState.FREE, SlotState.DEAD, None):
            for i in range(self.slot_count):
                base = HEADER_SIZE + i * SLOT_SIZE
                state = load_u32(self._buf, base + OFF_STATE)
                if wanted is None:
                    if state == SlotState.ACTIVE and not self._fresh_at(base, now):
                        choice = i
                        break
                elif state == wanted:
                    choice = i
                    break
            if choice is not None:
                break
        if choice is None:
            raise RuntimeError(
                f"{self.segment}: all {self.slot_count} lease slots hold live participants; close unused "
                "coordinators (each ShmCoordinator handle takes one slot)"
            )
        base = HEADER_SIZE + choice * SLOT_SIZE
        store_u32(self._buf, base + OFF_STATE, SlotState.FREE)  # an expired ACTIVE slot stops being one first
        store_u32(self._buf, base + OFF_PID, identity.pid)
        store_u64(self._buf, base + OFF_START_TIME, identity.start_time)
        self._buf[base + OFF_BOOT_ID:base + OFF_BOOT_ID + 16] = _uuid_bytes(identity.boot_id)
        self._buf[base + OFF_TOKEN:base + OFF_TOKEN + 16] = bytes.fromhex(identity.token)
        store_u64(self._buf, base + OFF_PID_NS, pid_namespace() if identity.pid == os.getpid() else 0)
        store_u32(self._buf, base + OFF_FLAGS, FLAG_DURABLE if durable else 0)
        self._buf[base + OFF_FLAGS + 4:base + SLOT_SIZE] = bytes(SLOT_SIZE - OFF_FLAGS - 4)
        store_u64(self._buf, base + OFF_LEASE, lease_ns)
        store_u64(self._buf, base + OFF_HEARTBEAT, host_clock_ns())
        store_u32(self._buf, base + OFF_STATE, SlotState.ACTIVE)
        return choice

    def leave(self, index: int, identity: ParticipantIdentity | None = None) -> bool:
        """Free slot ``index`` (caller holds the coordinator lock). With ``identity``, only if it still
        holds the slot. Returns True if the slot was freed."""
        base = self._base(index)
        if identity is not None and not self._holds(base, identity):
            return False
        store_u32(self._buf, base + OFF_STATE, SlotState.FREE)
        self._buf[base + 4:base + SLOT_SIZE] = bytes(SLOT_SIZE - 4)
        return True

    def end_lease(self, index: int, identity: ParticipantIdentity | None = None) -> bool:
        """Mark slot ``index`` DEAD at once (its process is known to be gone); no lock needed. True if ended.

        Without ``identity`` any ACTIVE slot is ended.  With it, only a slot that is still ACTIVE, unexpired and
        held by exactly ``identity`` (pid, start time, boot id and token) is ended, checked right before the
        store: a daemon reacting to a death can never end the lease of whoever reused the slot since (see the
        module docstring for why no lock is needed).
        """
        base = self._base(index)
        if identity is not None:
            if not self._fresh_at(base, host_clock_ns()) or self._identity(base) != identity:
                return False
        elif load_u32(self._buf, base + OFF_STATE) != SlotState.ACTIVE:
            return False
        store_u32(self._buf, base + OFF_STATE, SlotState.DEAD)
        return True

    def set_activity(self, index: int, identity: ParticipantIdentity, activity: Activity,
                     held_version: int | None = None) -> bool:
        """Store slot ``index``'s activity (and the weights version its model holds) if ``identity`` still holds
        it; the caller holds the coordinator lock. The version is stored before the activity, so a reader that
        sees SERVING sees the version it serves. False when the slot was lost."""
        base = self._base(index)
        if not self._holds(base, identity):
            return False
        if held_version is not None:
            store_u64(self._buf, base + OFF_HELD_VERSION, held_version)
        store_u32(self._buf, base + OFF_ACTIVITY, int(activity))
        return True

    def heartbeat(self, index: int, identity: ParticipantIdentity) -> bool:
        """Refresh slot ``index`` if it is still ACTIVE and held by ``identity``; False when it was lost."""
        base = self._base(index)
        if load_u32(self._buf, base + OFF_STATE) != SlotState.ACTIVE or not self._holds(base, identity):
            return False
        store_u64(self._buf, base + OFF_HEARTBEAT, host_clock_ns())
        return True


class Heartbeat:
    """A daemon thread refreshing one slot every ``lease / 4``; ``stop()`` joins it.

    The thread holds no lock and does one aligned store per beat. If the slot is ended (``end_lease``) or
    taken over after expiry, the thread stops and ``lost`` turns True: the participant is no longer counted.
    """

    def __init__(self, table: LeaseTable, index: int, identity: ParticipantIdentity, lease_ns: int) -> None:
        self._table = table
        self._index = index
        self._identity = identity
        self.interval = max(lease_ns / 4e9, 0.001)
        self._stop = threading.Event()
        self.lost = False
        self._thread = threading.Thread(
            target=self._run, name=f"flextensor-heartbeat-{table.segment}-{index}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._table.heartbeat(self._index, self._identity):
                self.lost = True
                logger.warning(
                    "lease slot %d of %s no longer belongs to %s (ended by ftd or expired and reused); this "
                    "participant is no longer counted", self._index, self._table.segment, self._identity.describe()
                )
                return

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop refreshing and wait for the thread to finish. Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
