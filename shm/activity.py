"""Who reads the host copy, and writing new weights into it while nobody does.

Note [sleeping participants and weight updates]
-----------------------------------------------
A participant's model reads the generation's host copy (the tensor store and the arena) while it is *awake*:
it streams blocks from the arena and copies resident tensors from the store. A sleeping model reads nothing:
its device memory is freed, and its plan and the host copy stay. New weights may be written into the host copy
in place only while no participant reads it, so each lease slot carries an :class:`Activity` (``leases.py``)
and the header carries the generation's ``weights_version`` and ``update_state`` (``header.py``). The rules,
every step under the coordinator lock (``ShmCoordinator`` holds it around each function here):

- *sleep*: the model frees its device memory first, then its slot stores SLEEPING. From then on it reads
  nothing.
- *wake*: if ``update_state`` is WRITING and a live slot is UPDATING, the waker waits (the lock released
  between looks); WRITING with no live writer, or TORN, is :class:`WeightsUpdateIncompleteError`. Otherwise
  its slot stores the header's version as ``held_version`` and SERVING, and only then does the model read.
- *join*: the election waits the same way while an update is being written (a joiner attaches, which reads
  the copy) and refuses a TORN copy; a joined slot starts SERVING, holding the header's version.
- *update*: refused (:class:`WorkersAwakeError`, naming the pids) unless the generation is READY and every
  live slot is SLEEPING, the writer's own included; an ``ftd hold`` (a DURABLE slot) reads nothing and does not
  count. A TORN copy may be written again only with a complete set of weights. Then the writer's slot stores
  UPDATING and the header WRITING, and the lock is released for the writing itself. At the end, under the
  lock again: the new version, then IDLE, then the writer's slot back to SLEEPING. A writer that raises
  stores TORN; one that dies leaves WRITING with no live UPDATING slot, which reads as TORN.

Because every transition happens under the one lock, no wake or join can slip between an update's check and
its WRITING mark, and no update can start while a wake has marked itself SERVING. A killed sleeping
participant is an ordinary dead lease: ``ftd`` and the last participant reclaim it as any other.
"""

from __future__ import annotations

import enum
import time
from contextlib import AbstractContextManager
from typing import Callable

from flextensor.shm.checks import check_seconds
from flextensor.shm.errors import ShmProtocolError, WeightsUpdateIncompleteError, WorkersAwakeError
from flextensor.shm.header import OFF_UPDATE_STATE, OFF_WEIGHTS_VERSION, State, load_u32, load_u64, read_state, \
    store_u32, store_u64
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.leases import Activity, LeaseSlot, LeaseTable

__all__ = ["Activity", "UpdateState", "Participation", "weights_version", "update_state", "writers", "awake", "check_readable",
           "check_writable", "store_update_state", "store_weights_version"]

#: The largest weights version a header holds (u64).
MAX_VERSION = (1 << 64) - 1
#: How often a waker looks again while new weights are being written.
POLL_S = 0.01


class UpdateState(enum.IntEnum):
    """Header offset 2184: whether new weights are being written into the host copy."""

    IDLE = 0
    WRITING = 1
    TORN = 2


def weights_version(buf: memoryview) -> int:
    """The version of the weights in the host copy (header offset 2176)."""
    return load_u64(buf, OFF_WEIGHTS_VERSION)


def update_state(buf: memoryview, segment: str = "coordinator segment") -> UpdateState:
    value = load_u32(buf, OFF_UPDATE_STATE)
    try:
        return UpdateState(value)
    except ValueError:
        raise ShmProtocolError(f"{segment}: update state {value} is not IDLE/WRITING/TORN; the segment is corrupt: "
                               "stop the workers of this namespace and run `ftd cleanup --force` on it") from None


def store_update_state(buf: memoryview, state: UpdateState) -> None:
    store_u32(buf, OFF_UPDATE_STATE, int(state))


def store_weights_version(buf: memoryview, version: int) -> None:
    store_u64(buf, OFF_WEIGHTS_VERSION, version)


def writers(slots: list[LeaseSlot]) -> list[LeaseSlot]:
    """The live slots writing new weights."""
    return [s for s in slots if s.live and s.activity == Activity.UPDATING]


def awake(slots: list[LeaseSlot]) -> list[LeaseSlot]:
    """The live slots whose models may read the host copy (neither SLEEPING nor a DURABLE hold)."""
    return [s for s in slots if s.live and not s.durable and s.activity != Activity.SLEEPING]


def _pids(slots: list[LeaseSlot]) -> tuple[int, ...]:
    return tuple(s.identity.pid for s in slots if s.identity is not None)


def check_readable(buf: memoryview, table: LeaseTable, namespace: str) -> bool:
    """May a participant start reading the host copy now (wake, join)? True: yes; False: an update is being
    written by a live participant (wait and ask again). :class:`WeightsUpdateIncompleteError` when an update
    stopped midway. Call under the coordinator lock."""
    state = update_state(buf, table.segment)
    if state == UpdateState.IDLE:
        return True
    if state == UpdateState.WRITING and writers(table.slots()):
        return False
    raise WeightsUpdateIncompleteError(
        f"namespace {namespace!r}: an update of the shared weights stopped midway (its writer "
        f"{'raised' if state == UpdateState.TORN else 'died'}), so the host copy holds part old and part new "
        "weights; a sleeping participant must call update_weights(...) again with every tensor, or stop every "
        "worker of the namespace and start again (the next start publishes the checkpoint afresh)")


def check_writable(buf: memoryview, table: LeaseTable, namespace: str, *, complete: bool) -> None:
    """Refuse an update unless the generation is READY, nobody else reads or writes the host copy, and a torn
    copy is written again in full (``complete``: the new weights cover every tensor). Under the lock."""
    if read_state(buf, table.segment) != State.READY:
        raise RuntimeError(f"namespace {namespace!r} is not READY (its creator has not published yet): new "
                           "weights can only replace published ones; wait for the session to be ready")
    slots = table.slots()
    busy = writers(slots)
    if busy:
        raise WorkersAwakeError(
            f"namespace {namespace!r}: another participant (pid {', '.join(map(str, _pids(busy)))}) is writing "
            "new weights right now; updates of one namespace run one at a time: wait for it, then update again",
            _pids(busy))
    others = awake(slots)  # this participant's own model included: it must sleep too
    if others:
        raise WorkersAwakeError(
            f"namespace {namespace!r}: {len(others)} participant(s) are awake and may read the host copy (pid "
            f"{', '.join(map(str, _pids(others)))}); every worker must call ft.sleep(name) before new weights are "
            "written, and ft.wake(name) afterwards", _pids(others))
    if update_state(buf, table.segment) != UpdateState.IDLE and not complete:
        raise ValueError(
            f"namespace {namespace!r}: an earlier update stopped midway and left part old and part new weights; "
            "this update covers only some tensors, so it cannot repair the copy: pass every tensor of the model")


class Participation:
    """One participant's side of the Note: its activity, the weights version it holds, and weight updates.

    Made by ``ShmCoordinator.participation`` from the coordinator's lease table, slot and identity; ``locked``
    holds the coordinator lock (``timeout`` seconds at most, None: the coordinator's), ``buffer`` returns the
    mapped coordinator segment (``RuntimeError`` once the coordinator is closed).
    """

    def __init__(self, namespace: str, table: LeaseTable, slot: int, identity: ParticipantIdentity,
                 buffer: Callable[[], memoryview], locked: Callable[[float | None], AbstractContextManager[None]],
                 timeout: float | None) -> None:
        self.namespace = namespace
        self._table = table
        self._slot = slot
        self._identity = identity
        self._buffer = buffer
        self._locked = locked
        self._timeout = timeout

    @property
    def weights_version(self) -> int:
        """The version of the weights in the host copy now (a lock-free read of the header)."""
        return weights_version(self._buffer())

    @property
    def held_version(self) -> int:
        """The weights version this participant's model holds (since its join or its last wake)."""
        self._buffer()
        return self._table.slot(self._slot).held_version

    @property
    def activity(self) -> Activity:
        """This participant's activity, as its lease slot records it."""
        self._buffer()
        return Activity(self._table.slot(self._slot).activity)

    def _set(self, value: Activity, held_version: int | None = None) -> None:
        """Under the lock: store this participant's activity; ``RuntimeError`` when its lease was lost."""
        if not self._table.is_live(self._slot, self._identity) \
                or not self._table.set_activity(self._slot, self._identity, value, held_version):
            raise RuntimeError(f"this worker's lease in namespace {self.namespace!r} expired or was ended (a stall "
                               "longer than lease_seconds, or ftd saw it as dead); close the session and start the "
                               "worker again")

    def sleep(self) -> None:
        """Record that this participant's model reads the host copy no more (its device memory is freed)."""
        with self._locked(None):
            self._buffer()
            self._set(Activity.SLEEPING)

    def wake(self, timeout: float | None = None) -> int:
        """Record that this participant's model reads the host copy again; returns the weights version it holds.

        Waits while another participant writes new weights (``TimeoutError`` after ``timeout`` seconds, default
        the coordinator's); :class:`WeightsUpdateIncompleteError` when an update stopped midway."""
        timeout = self._timeout if timeout is None else check_seconds(timeout, "timeout", allow_none=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._locked(remaining):
                buf = self._buffer()
                if check_readable(buf, self._table, self.namespace):
                    version = weights_version(buf)
                    self._set(Activity.SERVING, version)
                    return version
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"namespace {self.namespace!r}: new weights were still being written into its "
                                   f"host copy after {timeout:g} s; wake again later, or pass a longer timeout")
            time.sleep(POLL_S)

    def begin_update(self, version: int | None = None, *, complete: bool) -> int:
        """Check that nobody else reads or writes the host copy and mark it WRITING by this participant; returns
        the version the update will publish (``version``, else the current one + 1). ``complete``: the new
        weights cover every tensor (what repairs a copy an earlier update left torn)."""
        with self._locked(None):
            buf = self._buffer()
            check_writable(buf, self._table, self.namespace, complete=complete)
            current = weights_version(buf)
            target = current + 1 if version is None else version
            if isinstance(target, bool) or not isinstance(target, int) or not current < target <= MAX_VERSION:
                raise ValueError(f"weights version {version!r} must be an int above the current version {current} "
                                 f"of namespace {self.namespace!r} (and below 2**64)")
            self._set(Activity.UPDATING)
            store_update_state(buf, UpdateState.WRITING)
            return target

    def end_update(self, version: int) -> None:
        """The new weights are written: publish ``version``, then IDLE, then go back to sleeping."""
        with self._locked(None):
            buf = self._buffer()
            store_weights_version(buf, version)
            store_update_state(buf, UpdateState.IDLE)
            self._set(Activity.SLEEPING)  # its model holds the new version once it wakes, as every other's

    def abort_update(self) -> None:
        """Writing the new weights failed midway: the host copy is TORN until a complete update."""
        with self._locked(None):
            store_update_state(self._buffer(), UpdateState.TORN)
            self._set(Activity.SLEEPING)
