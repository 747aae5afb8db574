"""What the daemon records about the host: one view per namespace, the processes it watches, its own holds.

Why a module of its own: these records are plain data that the registry fills from its scans, the reaper reads
to decide what to reclaim and ``holds`` creates for ``ftd hold``; the registry's job is keeping them current
(scanning, watching processes), not defining them. ``registry`` re-exports the three names. Nothing here is
authoritative: the journals and lease tables are (see ``registry.py``).
"""

from __future__ import annotations

import dataclasses
import time

from flextensor.shm import segment_dir
from flextensor.shm.header import HeaderInfo
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.leases import LeaseTable
from flextensor.shm.segment import SharedSegment

from flextensor.daemon.lockdirs import LockDir

__all__ = ["Participant", "Hold", "NamespaceView"]


@dataclasses.dataclass
class Participant:
    """A process the daemon watches (registered, or adopted from a lease table)."""

    namespace: str
    slot_index: int
    identity: ParticipantIdentity
    pid: int  # the pid as the daemon sees it (may differ from identity.pid across pid namespaces)
    pidfd: int
    uid: int | None
    adopted: bool
    since: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Hold:
    """The daemon's own participation in a generation (``ftd hold``)."""

    namespace: str
    lock_dir: LockDir
    generation: int
    segment: SharedSegment
    table: LeaseTable
    slot: int
    identity: ParticipantIdentity
    heartbeat: object  # flextensor.shm.leases.Heartbeat
    owner_uid: int
    since: float = dataclasses.field(default_factory=time.time)
    created_at_ns: int = 0  # the header's creation time: with ``generation``, names the generation exactly
    lease_ns: int = 0  # the slot's lease (the heartbeat runs every lease / 4)
    adopted: bool = False  # the slot was taken over from a previous daemon (see holds.restore_hold)


@dataclasses.dataclass
class NamespaceView:
    """What the last scan saw of one namespace (a journal in a watched lock directory)."""

    namespace: str
    lock_dir: LockDir
    base: str | None = None
    manager: str | None = None
    generation: int | None = None
    state: str = "ORPHAN"  # INITIALIZING / READY / FAILED (header), ORPHAN (no coordinator), CORRUPT, CREATING
    live: int = 0
    bytes: int = 0
    shm_dir: str = segment_dir.DEFAULT_DIRECTORY  # where its segments are (the journal's shm_dir)
    created_at: float | None = None  # wall clock seconds
    error: str | None = None
    owner_uid: int | None = None  # uid owning the coordinator segment (else the lock directory's)
    reclaimable_since_ns: int | None = None  # host clock: when the last lease ended/expired
    segment: SharedSegment | None = None  # cached mapping of /{ns}.c
    segment_ino: int | None = None
    table: LeaseTable | None = None
    header: HeaderInfo | None = None
    expired_seen: set[str] = dataclasses.field(default_factory=set)  # tokens counted as lease expiries
    adoption_checked: set[str] = dataclasses.field(default_factory=set)
    dead_at_ns: dict[str, int] = dataclasses.field(default_factory=dict)  # token -> host clock of death
    logged_error: str | None = None
    members: list[tuple[int, int, str, int]] = dataclasses.field(default_factory=list)  # pid, slot, state, version
    weights_version: int = 0  # the header's (shm/activity.py)

    def close_mapping(self) -> None:
        self.table = None
        self.header = None
        segment, self.segment, self.segment_ino = self.segment, None, None
        if segment is not None:
            segment.close()
