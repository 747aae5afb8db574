"""Sleeping participants and weight updates across real processes (Note [... weight updates] in shm/activity.py).

Each child is a participant of one namespace (tests/shm/procs.py); the test drives sleep, wake and updates step
by step and kills with SIGKILL where a crash is the point.
"""

from __future__ import annotations

import os
import struct
import threading

import pytest

from flextensor.shm.activity import UpdateState
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.errors import WeightsUpdateIncompleteError
from flextensor.shm.header import HEADER_SIZE, SLOT_SIZE, open_coordinator_segment
from flextensor.shm.leases import Activity, LeaseTable
from flextensor.shm.names import manager_namespace


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "default")


def _group(children, ns: str, n: int):
    procs = children(n)
    assert procs[0].ok("open", ns=ns, lease=5.0)["is_creator"]
    procs[0].ok("ready")
    for child in procs[1:]:
        child.ok("open", ns=ns, lease=5.0)
    return procs


def _close_all(procs) -> None:
    for child in procs:
        child.ok("close", timeout=10)


def test_an_update_is_refused_while_anyone_is_awake_and_publishes_its_version(children, ns):
    a, b = _group(children, ns, 2)
    assert a.ok("versions") == {"ok": True, "published": 0, "held": 0, "activity": "SERVING"}
    refused = a.call("begin_update")
    assert refused["error"] == "WorkersAwakeError" and sorted(refused["pids"]) == sorted([a.pid, b.pid])
    assert "ft.sleep(name)" in refused["message"]
    a.ok("sleep")
    refused = a.call("begin_update")  # its own model sleeps; the other's does not
    assert refused["error"] == "WorkersAwakeError" and refused["pids"] == [b.pid]
    b.ok("sleep")
    assert a.ok("begin_update", version=7)["version"] == 7
    assert a.ok("versions")["activity"] == "UPDATING"
    a.ok("end_update", version=7)
    assert b.ok("versions") == {"ok": True, "published": 7, "held": 0, "activity": "SLEEPING"}
    assert b.ok("wake")["version"] == 7
    assert b.ok("versions") == {"ok": True, "published": 7, "held": 7, "activity": "SERVING"}
    refused = a.call("begin_update", version=7)  # not above the current version
    assert refused["error"] == "WorkersAwakeError"  # b is awake again: that is checked first
    b.ok("sleep")
    refused = a.call("begin_update", version=7)
    assert refused["error"] == "ValueError" and "above the current version 7" in refused["message"]
    _close_all([b, a])


def test_slot_and_header_fields_sit_where_the_layout_says(ns):
    with ShmCoordinator(ns, lease_seconds=5.0) as coordinator:
        coordinator.notify_ready()
        coordinator.participation.sleep()
        version = coordinator.participation.begin_update(complete=True)
        segment, header = open_coordinator_segment(ns)
        try:
            base = HEADER_SIZE + coordinator.lease_slot * SLOT_SIZE
            assert struct.unpack_from("=I", segment.buffer, base + 76)[0] == Activity.UPDATING
            assert struct.unpack_from("=QI", segment.buffer, 2176) == (0, UpdateState.WRITING)
            coordinator.participation.end_update(version)
            assert struct.unpack_from("=QI", segment.buffer, 2176) == (1, UpdateState.IDLE)
            assert struct.unpack_from("=IQ", segment.buffer, base + 76) == (Activity.SLEEPING, 0)
            assert coordinator.participation.wake() == 1
            assert struct.unpack_from("=IQ", segment.buffer, base + 76) == (Activity.SERVING, 1)
            assert header.protocol == 3
        finally:
            segment.close()


def test_a_wake_and_a_join_wait_for_an_update_being_written(children, ns):
    a, b = _group(children, ns, 2)
    a.ok("sleep")
    b.ok("sleep")
    version = a.ok("begin_update")["version"]
    b.send("wake", timeout=30)
    joiner = children(1)[0]
    joiner.send("open", ns=ns, lease=5.0, timeout=30)
    with pytest.raises(TimeoutError):
        b.recv(timeout=0.5)  # waiting: new weights are being written
    with pytest.raises(TimeoutError):
        joiner.recv(timeout=0.1)
    a.ok("end_update", version=version)
    assert b.recv()["version"] == 1
    reply = joiner.recv()
    assert reply["ok"] and not reply["is_creator"]
    assert joiner.ok("versions") == {"ok": True, "published": 1, "held": 1, "activity": "SERVING"}
    _close_all([joiner, b, a])


def test_a_writer_killed_midway_leaves_a_torn_copy_that_only_a_complete_update_repairs(children, ns):
    a, b, writer = _group(children, ns, 3)
    for child in (a, b, writer):
        child.ok("sleep")
    writer.ok("begin_update")
    writer.kill()
    refused = b.call("wake", timeout=5)
    assert refused["error"] == "WeightsUpdateIncompleteError" and "update_weights" in refused["message"]
    with pytest.raises(WeightsUpdateIncompleteError, match="stopped midway"):
        ShmCoordinator(ns, lease_seconds=5.0, timeout=5)  # nobody joins a torn copy
    refused = a.call("begin_update", complete=False)
    assert refused["error"] == "ValueError" and "pass every tensor" in refused["message"]
    version = a.ok("begin_update", complete=True)["version"]
    a.ok("end_update", version=version)
    assert b.ok("wake")["version"] == version == 1
    _close_all([a, b])


def test_a_writer_that_raises_marks_the_copy_torn(children, ns):
    a, b = _group(children, ns, 2)
    a.ok("sleep")
    b.ok("sleep")
    a.ok("begin_update")
    a.ok("abort_update")
    assert a.ok("versions")["activity"] == "SLEEPING"
    assert b.call("wake")["error"] == "WeightsUpdateIncompleteError"
    _close_all([a, b])


def test_a_sleeping_participant_killed_is_reclaimed_like_any_other(children, ns):
    a, b = _group(children, ns, 2)
    b.ok("sleep")
    b.kill()
    a.ok("sleep")  # the dead sleeper no longer counts: nobody is awake
    version = a.ok("begin_update")["version"]
    a.ok("end_update", version=version)
    a.ok("close", timeout=10)  # the last participant: the generation goes (the fixture checks /dev/shm)
    assert not os.path.exists(f"/dev/shm/{ns}.c")


def test_only_one_update_at_a_time_and_a_durable_hold_does_not_count(ns):
    with ShmCoordinator(ns, lease_seconds=5.0) as first, ShmCoordinator(ns, lease_seconds=5.0) as second:
        first.notify_ready()
        segment, header = open_coordinator_segment(ns)
        table = LeaseTable(segment.buffer, header.slot_count)
        try:
            from flextensor.shm.identity import ParticipantIdentity
            from flextensor.shm.locks import FileLock
            from flextensor.shm.names import coordinator_lock_path

            with FileLock(coordinator_lock_path(ns)) as _:
                held = table.join(ParticipantIdentity.current(), 5 * 10**9, durable=True)  # what ftd hold does
            first.participation.sleep()
            second.participation.sleep()
            version = first.participation.begin_update(complete=True)
            errors: list[BaseException] = []
            thread = threading.Thread(target=lambda: _try(errors, second.participation.begin_update, True))
            thread.start()
            thread.join()
            assert type(errors[0]).__name__ == "WorkersAwakeError" and "one at a time" in str(errors[0])
            first.participation.end_update(version)
            with FileLock(coordinator_lock_path(ns)):
                table.leave(held)
        finally:
            del table
            segment.close()


def _try(errors: list[BaseException], call, complete: bool) -> None:
    try:
        call(complete=complete)
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        errors.append(exc)
