"""Lease table layout and rules, the heartbeat thread, and leases of a SIGKILLed process."""

from __future__ import annotations

import os
import struct
import time

import pytest

from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.header import HEADER_SIZE, SLOT_SIZE, coordinator_segment_size
from flextensor.shm.identity import ParticipantIdentity, boot_id, host_clock_ns
from flextensor.shm.leases import Heartbeat, LeaseTable, SlotState
from flextensor.shm.names import manager_namespace
from tests.shm.procs import start_children

SECOND = 1_000_000_000


def make_table(slots: int = 4) -> tuple[bytearray, LeaseTable]:
    buf = bytearray(coordinator_segment_size(slots))
    return buf, LeaseTable(memoryview(buf), slots, segment="/test.c")


def test_slot_layout_is_fixed():
    buf, table = make_table()
    ident = ParticipantIdentity.current()
    before = host_clock_ns()
    index = table.join(ident, 3 * SECOND)
    assert index == 0
    base = HEADER_SIZE + index * SLOT_SIZE
    state, pid, heartbeat, lease, start = struct.unpack_from("=IIQQQ", buf, base)
    assert (state, pid, lease, start) == (SlotState.ACTIVE, os.getpid(), 3 * SECOND, ident.start_time)
    assert before <= heartbeat <= host_clock_ns()
    import uuid

    assert bytes(buf[base + 32:base + 48]) == uuid.UUID(ident.boot_id).bytes
    assert bytes(buf[base + 48:base + 64]).hex() == ident.token
    slot = table.slots()[0]
    assert slot.identity == ident and slot.live and slot.state == SlotState.ACTIVE
    assert table.slots()[1].identity is None and table.slots()[1].state == SlotState.FREE


def test_liveness_follows_heartbeat_and_lease():
    _, table = make_table()
    index = table.join(ParticipantIdentity.current(), SECOND)
    heartbeat = table.slot(index).heartbeat_ns
    assert table.live_count(now=heartbeat + SECOND) == 1
    assert table.live_count(now=heartbeat + SECOND + 1) == 0
    assert table.live_count(now=heartbeat - 5) == 1  # a heartbeat newer than our clock read is live


def test_live_slots_decodes_only_live_ones_and_refuses_a_corrupt_state():
    buf, table = make_table(4)
    first = table.join(ParticipantIdentity.current(), SECOND)
    second = table.join(ParticipantIdentity.current(), SECOND)
    heartbeat = table.slot(second).heartbeat_ns
    struct.pack_into("=Q", buf, HEADER_SIZE + first * SLOT_SIZE + 8, heartbeat - 2 * SECOND)  # first expired
    assert [s.index for s in table.live_slots(now=heartbeat)] == [second]
    assert table.live_slots(now=heartbeat)[0] == table.slot(second, heartbeat)
    struct.pack_into("=I", buf, HEADER_SIZE + 3 * SLOT_SIZE, 7)  # a state no writer ever stores
    from flextensor.shm.errors import ShmProtocolError

    with pytest.raises(ShmProtocolError, match="lease slot 3 has unknown state 7"):
        table.live_slots(now=heartbeat)


def test_slot_reuse_prefers_free_then_dead_then_expired_and_leave_checks_identity():
    _, table = make_table(3)
    a, b, c, d = (ParticipantIdentity.current() for _ in range(4))
    assert [table.join(x, SECOND) for x in (a, b, c)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="all 3 lease slots"):
        table.join(d, SECOND)
    table.end_lease(1)
    assert table.slot(1).state == SlotState.DEAD and not table.slot(1).live
    assert not table.heartbeat(1, b)  # an ended lease is not revived by its old owner
    assert table.join(d, SECOND) == 1
    assert not table.leave(1, b)  # b lost slot 1 to d: leaving must not free d's slot
    assert table.slot(1).identity == d
    assert table.leave(1, d) and table.slot(1).state == SlotState.FREE
    assert table.join(b, SECOND) == 1
    # expired ACTIVE slots are reused last
    _, small = make_table(1)
    small.join(a, 1)  # 1 ns lease: expired at once
    time.sleep(0.001)
    assert small.live_count() == 0
    assert small.join(b, SECOND) == 0 and small.slot(0).identity == b
    assert not small.heartbeat(0, a)
    with pytest.raises(IndexError):
        small.slot(1)


def test_heartbeat_thread_refreshes_and_stops():
    _, table = make_table()
    ident = ParticipantIdentity.current()
    index = table.join(ident, 200_000_000)  # 0.2 s lease: beats every 50 ms
    beat = Heartbeat(table, index, ident, 200_000_000)
    beat.start()
    first = table.slot(index).heartbeat_ns
    time.sleep(0.35)  # well past the lease: only the thread keeps it live
    assert table.slot(index).heartbeat_ns > first
    assert table.slot(index).live
    beat.stop()
    assert not beat.running and not beat.lost
    beat.stop()  # idempotent
    time.sleep(0.25)
    assert not table.slot(index).live


def test_heartbeat_notices_an_ended_lease():
    _, table = make_table()
    ident = ParticipantIdentity.current()
    index = table.join(ident, 100_000_000)
    beat = Heartbeat(table, index, ident, 100_000_000)
    beat.start()
    table.end_lease(index)
    deadline = time.monotonic() + 2
    while beat.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert beat.lost
    assert table.slot(index).state == SlotState.DEAD


def test_sigkilled_participant_is_seen_gone_at_once(namespace):
    """Same host, same pid namespace: a process that no longer exists is dead now, whatever its heartbeat."""
    ns = manager_namespace(namespace, "leases")
    (child,) = start_children(1)
    try:
        with ShmCoordinator(ns, lease_seconds=30.0) as me:
            reply = child.ok("open", ns=ns, lease=30.0)
            with LeaseTable.open(ns) as table:
                assert table.header is not None and table.header.generation == me.generation
                live = {s.identity.pid for s in table.live_slots()}
                assert live == {os.getpid(), child.pid}
                child.kill()
                killed = time.monotonic()
                while table.slot(reply["slot"]).live:
                    assert time.monotonic() - killed < 1.0, "a dead process must not wait for its 30 s lease"
                    time.sleep(0.01)
                dead = table.slot(reply["slot"])
                assert dead.process_gone and dead.state == SlotState.ACTIVE and not dead.durable
                assert table.live_count() == 1
                # ftd's path (end_lease) still works on a heartbeat-fresh slot of a dead process
                assert table.end_lease(reply["slot"], dead.identity)
                assert table.slot(reply["slot"]).state == SlotState.DEAD
    finally:
        child.kill()
        child.stop()


def test_participant_of_another_pid_namespace_is_judged_by_its_lease(namespace):
    """A slot whose pid namespace is not ours: its pid means nothing here, so only its heartbeat counts."""
    from flextensor.shm.leases import OFF_PID_NS

    ns = manager_namespace(namespace, "leases")
    (child,) = start_children(1)
    try:
        with ShmCoordinator(ns, lease_seconds=30.0):
            reply = child.ok("open", ns=ns, lease=0.6)
            with LeaseTable.open(ns) as table:
                base = HEADER_SIZE + reply["slot"] * SLOT_SIZE
                struct.pack_into("=Q", table._buf, base + OFF_PID_NS, 4026531835)  # not ours
                child.kill()
                killed = time.monotonic()
                time.sleep(0.2)
                assert table.slot(reply["slot"]).live and not table.slot(reply["slot"]).process_gone
                while table.slot(reply["slot"]).live:
                    assert time.monotonic() - killed < 2.0
                    time.sleep(0.02)
                assert time.monotonic() - killed >= 0.3  # it stayed counted for about its lease
    finally:
        child.kill()
        child.stop()


def test_durable_slot_outlives_its_process_for_one_lease():
    """A daemon's hold: its slot keeps counting after its process is gone, until its heartbeat expires."""
    import subprocess
    import sys

    from flextensor.shm.identity import process_start_time

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ident = ParticipantIdentity(pid=proc.pid, start_time=process_start_time(proc.pid), boot_id=boot_id(),
                                    token="ab" * 16)
        buf, table = make_table(2)
        durable = table.join(ident, 30 * SECOND, durable=True)
        plain = table.join(ident, 30 * SECOND)
        from flextensor.shm.identity import pid_namespace
        from flextensor.shm.leases import OFF_PID_NS

        for index in (durable, plain):  # join records our namespace only for our own pid: claim it for the child
            struct.pack_into("=Q", buf, HEADER_SIZE + index * SLOT_SIZE + OFF_PID_NS, pid_namespace())
        assert table.slot(durable).live and table.slot(plain).live
        proc.kill()
        proc.wait()
        assert table.slot(durable).live and table.slot(durable).durable
        assert not table.slot(plain).live and table.slot(plain).process_gone
    finally:
        proc.kill()
        proc.wait()


def test_open_missing_namespace(namespace):
    with pytest.raises(FileNotFoundError):
        LeaseTable.open(manager_namespace(namespace, "none"))


def test_end_lease_with_identity_only_ends_that_live_holder():
    _, table = make_table(2)
    a, b, c = (ParticipantIdentity.current() for _ in range(3))
    index = table.join(a, SECOND)
    assert not table.end_lease(1, a)  # a FREE slot
    table.join(c, SECOND)  # no FREE slot left: a reused slot can only be a's
    assert not table.end_lease(index, b)  # another token
    twin = ParticipantIdentity(pid=a.pid, start_time=a.start_time + 1, boot_id=a.boot_id, token=a.token)
    assert not table.end_lease(index, twin)  # same pid and token, another process start: not the holder
    assert table.slot(index).state == SlotState.ACTIVE and table.slot(index).live
    assert table.end_lease(index, a) and table.slot(index).state == SlotState.DEAD
    assert not table.end_lease(index, a)  # already ended
    # The slot is reused by b; a's death reported late must not end b's lease.
    assert table.join(b, SECOND) == index
    assert not table.end_lease(index, a) and table.slot(index).live
    # Without an identity any ACTIVE slot is ended (and the result says whether it was).
    assert table.end_lease(index) and not table.end_lease(index)
    # An expired holder is left alone: a joiner may be taking its slot over right now.
    _, small = make_table(1)
    small.join(a, 1)  # 1 ns lease: expired at once
    time.sleep(0.001)
    assert not small.end_lease(0, a) and small.slot(0).state == SlotState.ACTIVE
