"""ShmCoordinator: election, readiness, failure propagation, leases of real processes, ownership, closing."""

from __future__ import annotations

import logging
import os
import struct
import threading
import time

import pytest
import torch

from flextensor.shm.cleanup import cleanup_manager_namespace
from flextensor.shm.coordinator import ShmCoordinator, peek_ready
from flextensor.shm.errors import ShmCreatorDiedError, ShmCreatorFailedError, ShmProtocolError, ShmSpaceError
from flextensor.shm.header import (
    FAILURE_CAPACITY,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    TRUNCATION_MARKER,
    State,
    coordinator_segment_size,
    validate_header,
    write_header,
)
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.journal import read_journal
from flextensor.shm.leases import LeaseTable
from flextensor.shm.names import coordinator_segment_name, journal_path, lock_directory, manager_namespace
from flextensor.shm.segment import SharedSegment
from tests.leftovers import shm_names

LEASE = 1.0


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "model")


def assert_gone(ns: str) -> None:
    assert shm_names(ns) == []
    assert sorted(p.name for p in lock_directory().iterdir()) == []


def test_heartbeat_that_cannot_start_leaves_the_generation(ns, monkeypatch):
    """The heartbeat starts after the coordinator lock is released; if it cannot start, the participant leaves
    the slot it claimed (as the last one, removing the generation) before the error reaches the caller."""
    from flextensor.shm import leases

    def refuse(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patch:
        patch.setattr(leases.Heartbeat, "start", refuse)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            ShmCoordinator(ns, lease_seconds=LEASE)
    assert_gone(ns)
    creator = ShmCoordinator(ns, lease_seconds=LEASE)  # a later worker starts a fresh generation
    try:
        with monkeypatch.context() as patch:
            patch.setattr(leases.Heartbeat, "start", refuse)
            with pytest.raises(RuntimeError, match="can't start new thread"):
                ShmCoordinator(ns, lease_seconds=LEASE)  # a follower: its slot is freed, the creator's stays
        assert [slot.index for slot in creator._table.live_slots()] == [creator.lease_slot]
    finally:
        creator.close()
    assert_gone(ns)


def test_election_eight_processes_repeated(ns, children):
    procs = children(8)
    for round_ in range(3):
        for child in procs:  # all eight construct at (nearly) the same instant
            child.send("open", ns=ns, lease=LEASE, timeout=20)
        replies = [child.recv() for child in procs]
        assert all(r["ok"] for r in replies), replies
        creators = [r for r in replies if r["is_creator"]]
        assert len(creators) == 1, replies
        assert {r["generation"] for r in replies} == {1}, f"round {round_}: {replies}"
        assert len({r["slot"] for r in replies}) == 8
        creator = procs[replies.index(creators[0])]
        payload = f"round {round_}".encode().hex()
        creator.ok("write_blob", kind="p", data=payload)
        creator.ok("ready")
        for child in procs:
            if child is not creator:
                child.send("wait", timeout=10)
        for child in procs:
            if child is not creator:
                assert child.recv()["ok"]
                assert child.ok("read_blob", kind="p")["data"] == payload
        for child in procs:
            child.send("close")
        assert all(child.recv()["ok"] for child in procs)
        assert_gone(ns)


def test_peek_ready_reads_the_state_without_the_lock(ns, children):
    """A lock-free hint: True only while a generation is READY (missing, INITIALIZING, FAILED: False), also while
    another process holds the coordinator lock."""
    assert not peek_ready(ns)  # no generation
    creator = ShmCoordinator(ns, lease_seconds=LEASE)
    assert not peek_ready(ns)  # INITIALIZING
    creator.memory_owner.write_blob("p", b"x")
    creator.notify_ready()
    (holder,) = children(1)
    holder.ok("hold_lock", ns=ns)
    try:
        assert peek_ready(ns)
    finally:
        holder.ok("release_lock")
    creator.close()
    assert not peek_ready(ns)  # the last participant left: the generation is gone
    failed = ShmCoordinator(ns, lease_seconds=LEASE)
    failed.mark_failed(RuntimeError("checkpoint missing"))
    assert not peek_ready(ns)
    failed.close()
    assert_gone(ns)


def test_mark_failed_reaches_every_follower(ns, children):
    creator, *followers = children(3)
    assert creator.ok("open", ns=ns, lease=LEASE)["is_creator"]
    for f in followers:
        assert not f.ok("open", ns=ns, lease=LEASE)["is_creator"]
        f.send("wait", timeout=10)
    creator.ok("fail", message="checkpoint shard 3 is corrupt ☃")
    for f in followers:
        reply = f.recv()
        assert reply["error"] == "ShmCreatorFailedError"
        assert reply["creator_message"] == "RuntimeError: checkpoint shard 3 is corrupt ☃"
        assert "checkpoint shard 3 is corrupt" in reply["message"]
        assert f"pid {creator.pid}" in reply["message"]
    for p in (creator, *followers):
        p.ok("close")
    assert_gone(ns)


def test_creator_sigkill_while_initializing_raises_died(ns, children):
    (creator,) = children(1)
    assert creator.ok("open", ns=ns, lease=LEASE)["is_creator"]
    creator.ok("segment", kind="sd", size=4096)
    with ShmCoordinator(ns, lease_seconds=LEASE) as follower:
        assert not follower.is_creator
        creator.kill()
        killed_at = time.monotonic()
        with pytest.raises(ShmCreatorDiedError, match=f"pid {creator.pid}"):
            follower.wait_for_ready(timeout=10)
        elapsed = time.monotonic() - killed_at
        # Only the upper bound is a contract (detection within a lease plus slack): how soon the death is seen
        # depends on when the follower next polls, and may be almost immediate.
        assert elapsed <= LEASE + 1.5, elapsed
        assert follower.state == State.INITIALIZING
    assert_gone(ns)  # the follower was the last live participant: it removed the creator's segment too


def test_follower_sigkill_expires_and_last_participant_cleans(ns, children):
    (follower,) = children(1)
    creator = ShmCoordinator(ns, lease_seconds=LEASE)
    creator.memory_owner.write_blob("p", b"plan")
    creator.notify_ready()
    follower.ok("open", ns=ns, lease=LEASE)
    follower.ok("wait", timeout=5)
    table = LeaseTable.open(ns)
    try:
        assert table.live_count() == 2
        follower.kill()
        deadline = time.monotonic() + LEASE + 1.5
        while table.live_count() != 1:
            assert time.monotonic() < deadline, "the killed follower's lease never expired"
            time.sleep(0.02)
        (dead,) = [s for s in table.slots() if s.identity is not None and s.identity.pid == follower.pid]
        assert not dead.live
    finally:
        table.close()
    assert shm_names(ns)  # still there until the last live participant leaves
    creator.close()
    assert_gone(ns)


def test_late_joiner_attaches_after_creator_closed(ns, children):
    creator, keeper = children(2)
    assert creator.ok("open", ns=ns, lease=LEASE)["is_creator"]
    creator.ok("write_blob", kind="sm", data=b"manifest-bytes".hex())
    creator.ok("ready")
    keeper.ok("open", ns=ns, lease=LEASE)
    keeper.ok("wait", timeout=5)
    creator.ok("close")
    creator.stop()
    with ShmCoordinator(ns, lease_seconds=LEASE) as late:
        assert not late.is_creator
        assert late.generation == 1
        assert late.state == State.READY
        late.wait_for_ready(timeout=1)
        assert late.memory_owner.read_blob("sm") == b"manifest-bytes"
    assert shm_names(ns)  # the keeper still holds the generation
    keeper.ok("close")
    assert_gone(ns)


def test_generation_whose_participants_died_is_reclaimed(ns, children, caplog):
    (creator,) = children(1)
    assert creator.ok("open", ns=ns, lease=LEASE)["generation"] == 1
    creator.ok("segment", kind="b0", size=8192)
    creator.ok("lock", kind="b0", backend="semaphore")
    creator.ok("lock", kind="b1", backend="file")
    creator.ok("ready")
    creator.kill()
    old = [n for n in shm_names(ns) if ".g1." in n]
    assert len(old) == 2  # the block segment and the semaphore
    time.sleep(LEASE + 0.1)
    with caplog.at_level(logging.WARNING, logger="flextensor.shm"):
        with ShmCoordinator(ns, lease_seconds=LEASE) as again:
            assert again.is_creator
            assert again.generation == 2
            assert again.state == State.INITIALIZING
            assert not [n for n in shm_names(ns) if ".g1." in n]
            assert not [p for p in lock_directory().iterdir() if ".g1." in p.name]
            again.notify_ready()
    assert any("generation 1" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert_gone(ns)


def test_wait_for_ready_timeout(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as creator, ShmCoordinator(ns, lease_seconds=LEASE) as follower:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="not READY within 0.2 s"):
            follower.wait_for_ready(timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 1.0
        creator.notify_ready()
        follower.wait_for_ready(timeout=0)
    assert_gone(ns)


def test_a_cancelled_wait_for_ready_ends_at_once_and_a_later_wait_still_works(ns):
    import threading

    cancel = threading.Event()
    with ShmCoordinator(ns, lease_seconds=LEASE) as creator, ShmCoordinator(ns, lease_seconds=LEASE) as follower:
        threading.Timer(0.1, cancel.set).start()
        start = time.monotonic()
        with pytest.raises(InterruptedError, match="was cancelled by its caller"):
            follower.wait_for_ready(timeout=30, cancel=cancel)
        assert time.monotonic() - start < 1.0
        creator.notify_ready()
        follower.wait_for_ready(timeout=1, cancel=threading.Event())
    assert_gone(ns)


def test_lock_acquisition_is_bounded_by_timeout(ns, children):
    (holder,) = children(1)
    holder.ok("hold_lock", ns=ns)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\.lock"):
        ShmCoordinator(ns, lease_seconds=LEASE, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 1.5
    assert shm_names(ns) == []
    holder.ok("release_lock")
    with ShmCoordinator(ns, lease_seconds=LEASE, timeout=1) as c:  # now it goes through, and removes the file
        assert c.is_creator
    assert_gone(ns)


def test_join_timeout_bounds_the_election_only(ns, children):
    """A short ``join_timeout`` (a follower's attach thread) must not become the wait of later lock users."""
    (holder,) = children(1)
    holder.ok("hold_lock", ns=ns)
    with pytest.raises(TimeoutError, match=r"\.lock"):
        ShmCoordinator(ns, lease_seconds=LEASE, timeout=None, join_timeout=0.1)
    holder.ok("release_lock")
    c = ShmCoordinator(ns, lease_seconds=LEASE, timeout=None, join_timeout=0.1)
    c.memory_owner.write_blob("p", b"x")
    c.notify_ready()
    holder.ok("hold_lock", ns=ns)
    release = threading.Timer(0.6, lambda: holder.ok("release_lock"))
    release.start()
    start = time.monotonic()
    try:
        c.close()  # waits for the holder (timeout=None), where join_timeout would have given up after 0.1 s
    finally:
        release.join()
    assert c.closed and time.monotonic() - start >= 0.5
    assert_gone(ns)


def test_failed_close_can_be_retried(ns, children):
    (holder,) = children(1)
    c = ShmCoordinator(ns, lease_seconds=LEASE)
    c.memory_owner.write_blob("p", b"x")
    c.notify_ready()
    holder.ok("hold_lock", ns=ns)
    with pytest.raises(TimeoutError):
        c.close(timeout=0.2)
    assert not c.closed
    table = LeaseTable.open(ns)
    assert table.live_count() == 1  # still a participant: its heartbeat keeps running
    table.close()
    holder.ok("release_lock")
    c.close()
    c.close()  # idempotent
    assert c.closed
    assert_gone(ns)


def test_separate_handles_in_one_process_are_separate_participants(ns):
    a = ShmCoordinator(ns, lease_seconds=LEASE)
    b = ShmCoordinator(ns, lease_seconds=LEASE)
    assert a.is_creator and not b.is_creator
    assert a.identity.pid == b.identity.pid and a.identity.token != b.identity.token
    assert a.lease_slot != b.lease_slot
    a.memory_owner.write_blob("p", b"shared")
    a.notify_ready()
    b.wait_for_ready(1)
    a.close()
    assert shm_names(ns)  # b keeps the generation alive
    assert b.memory_owner.read_blob("p") == b"shared"
    b.close()
    assert_gone(ns)


def test_creator_closing_before_ready_fails_followers(ns):
    creator = ShmCoordinator(ns, lease_seconds=LEASE)
    follower = ShmCoordinator(ns, lease_seconds=LEASE)
    creator.close()
    with pytest.raises(ShmCreatorFailedError, match="closed before it published the weights"):
        follower.wait_for_ready(1)
    follower.close()
    assert_gone(ns)


def test_context_exit_with_error_publishes_it(ns):
    follower = None
    with pytest.raises(KeyError):
        with ShmCoordinator(ns, lease_seconds=LEASE) as creator:
            follower = ShmCoordinator(ns, lease_seconds=LEASE)
            assert creator.is_creator
            raise KeyError("missing tensor")
    with pytest.raises(ShmCreatorFailedError) as info:
        follower.wait_for_ready(1)
    assert info.value.creator_message == "KeyError: 'missing tensor'"
    follower.close()
    assert_gone(ns)


def test_failure_message_is_bounded(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as creator, ShmCoordinator(ns, lease_seconds=LEASE) as follower:
        creator.mark_failed("é" * 5000)
        creator.mark_failed("second failure is ignored")
        with pytest.raises(ShmCreatorFailedError) as info:
            follower.wait_for_ready(1)
        message = info.value.creator_message
        assert message.endswith(TRUNCATION_MARKER)
        assert len(message.encode()) <= FAILURE_CAPACITY
        assert message.startswith("é" * 1000)
        with pytest.raises(RuntimeError, match="FAILED"):
            creator.notify_ready()
    assert_gone(ns)


def test_role_checks(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as creator, ShmCoordinator(ns, lease_seconds=LEASE) as follower:
        with pytest.raises(RuntimeError, match="follower"):
            follower.notify_ready()
        with pytest.raises(RuntimeError, match="follower"):
            follower.mark_failed("no")
        with pytest.raises(RuntimeError, match="creator"):
            creator.wait_for_ready(0)
        creator.notify_ready()
        creator.wait_for_ready(0)
        with pytest.raises(RuntimeError, match="READY"):
            creator.mark_failed("too late")
    with pytest.raises(ValueError, match="namespace"):
        ShmCoordinator("bad/namespace")
    with pytest.raises(ValueError, match="lease_seconds"):
        ShmCoordinator(ns, lease_seconds=0)
    assert_gone(ns)


# ------------------------------------------------------------------------------------------- the header


def _header_bytes() -> bytearray:
    buf = bytearray(coordinator_segment_size(4))
    ident = ParticipantIdentity.current()
    write_header(memoryview(buf), generation=7, lease_ns=123, slot_count=4, creator=ident, creator_slot=2,
                 created_at_ns=99)
    return buf


def test_header_layout_is_fixed():
    buf = _header_bytes()
    assert buf[0:8] == MAGIC == b"FLXTNSR\x00"
    assert struct.unpack_from("=II", buf, 8) == (PROTOCOL_VERSION, HEADER_SIZE) == (3, 4096)
    assert buf[16:32].rstrip(b"\x00").decode() == validate_header(memoryview(buf), "/x.c").library_version
    assert struct.unpack_from("=IIQQQII", buf, 32) == (State.INITIALIZING, 4, 7, 123, 99, 128, 2)
    pid, _, start, boot, token = struct.unpack_from("=IIQ16s16s", buf, 72)
    ident = validate_header(memoryview(buf), "/x.c").creator
    assert (pid, start, token.hex()) == (ident.pid, ident.start_time, ident.token) and pid == os.getpid()
    assert struct.unpack_from("=I", buf, 120) == (0,)
    assert not any(buf[2176:HEADER_SIZE])


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda b: b.__setitem__(slice(0, 8), b"GARBAGE!"), "bad magic"),
        (lambda b: struct.pack_into("=I", b, 8, 99), "protocol version 99.*same flextensor version"),
        (lambda b: struct.pack_into("=I", b, 12, 512), "header size 512"),
        (lambda b: struct.pack_into("=I", b, 32, 9), "state 9"),
        (lambda b: struct.pack_into("=I", b, 36, 5), "truncated"),
    ],
)
def test_corrupt_header_is_rejected(corrupt, match):
    buf = _header_bytes()
    corrupt(buf)
    with pytest.raises(ShmProtocolError, match=match) as info:
        validate_header(memoryview(buf), "/ns.c")
    assert "/ns.c" in str(info.value)


@pytest.mark.parametrize("kind", ["magic", "protocol", "version"])
def test_coordinator_refuses_corrupt_segment(ns, kind):
    owner = ShmCoordinator(ns, lease_seconds=LEASE)
    owner.memory_owner.write_blob("p", b"keep me")
    name = coordinator_segment_name(ns)
    seg = SharedSegment.open(name)
    saved = bytes(seg.buffer[:32])
    if kind == "magic":
        seg.buffer[0:8] = b"NOTFLXT!"
        match = "bad magic.*run cleanup"
    elif kind == "protocol":
        struct.pack_into("=I", seg.buffer, 8, 1)
        match = "protocol version 1.*same flextensor version"
    else:
        seg.buffer[16:32] = b"9.9.9".ljust(16, b"\x00")
        match = "flextensor 9.9.9.*same flextensor version"
    try:
        with pytest.raises(ShmProtocolError, match=match):
            ShmCoordinator(ns, lease_seconds=LEASE, timeout=1)
        if kind != "version":  # another library version is refused for joining only; cleanup reads protocol 1
            with pytest.raises(ShmProtocolError):
                cleanup_manager_namespace(ns, timeout=0)
            assert shm_names(ns) == sorted([name[1:], f"{ns}.g1.p"])  # nothing was deleted
            assert journal_path(ns).exists()
    finally:
        seg.buffer[:32] = saved
        seg.close()
    owner.close()
    assert_gone(ns)


def test_truncated_coordinator_segment_is_refused(ns):
    from flextensor.shm.journal import create_journal

    create_journal(ns, 1)
    name = coordinator_segment_name(ns)
    seg = SharedSegment.create(name, 2048)
    seg.buffer[:] = _header_bytes()[:2048]  # a real header, cut short
    seg.close()
    with pytest.raises(ShmProtocolError, match=f"{name}: it is truncated: 2048 bytes"):
        ShmCoordinator(ns, lease_seconds=LEASE, timeout=1)
    with pytest.raises(ShmProtocolError, match="truncated"):
        cleanup_manager_namespace(ns, timeout=0)
    assert shm_names(ns) == [name[1:]] and journal_path(ns).exists()  # nothing was deleted
    SharedSegment.unlink_name(name)
    journal_path(ns).unlink()
    (lock_directory() / f"{ns}.lock").unlink()
    assert_gone(ns)


def test_aborted_creation_is_reclaimed(ns, caplog):
    from flextensor.shm.journal import create_journal

    create_journal(ns, 4)
    SharedSegment.create(coordinator_segment_name(ns), coordinator_segment_size()).close()  # all zeros
    with caplog.at_level(logging.WARNING, logger="flextensor.shm"):
        with ShmCoordinator(ns, lease_seconds=LEASE) as c:
            assert c.is_creator and c.generation == 5
    assert any("never completely created" in r.getMessage() for r in caplog.records)
    assert_gone(ns)


# ------------------------------------------------------------------------------------------- the owner


def test_blob_round_trip_and_validation(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as c:
        owner = c.memory_owner
        big = os.urandom(1 << 20)
        owner.write_blob("p", big)
        owner.write_blob("e", b"")
        assert owner.read_blob("p") == big
        assert owner.read_blob("e") == b""
        with pytest.raises(FileExistsError):
            owner.write_blob("p", b"again")
        seg = owner.open_segment("e")
        struct.pack_into("=Q", seg.buffer, 0, 10)
        seg.close()
        with pytest.raises(ShmProtocolError, match=r"\.g1\.e declares 10 bytes"):
            owner.read_blob("e")
        with pytest.raises(FileNotFoundError):
            owner.read_blob("missing")
        with pytest.raises(ValueError, match="kind"):
            owner.create_segment("../x", 10)
        assert owner.namespace == ns and owner.generation == 1 and owner.is_creator
    assert_gone(ns)


def test_owner_locks_are_journaled_and_removed(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as a, ShmCoordinator(ns, lease_seconds=LEASE) as b:
        sem = a.memory_owner.create_lock("b0", "semaphore")
        flock = a.memory_owner.create_lock("b0", "file")
        other = b.memory_owner.open_lock("b0", "file")
        with flock:
            with pytest.raises(TimeoutError):
                other.acquire(0)
        with sem:
            pass
        sem.close()
        flock.close()
        other.close()
        assert f"sem.{ns}.g1.lb0" in shm_names(ns)
        assert (lock_directory() / f"{ns}.g1.lb0.lock").exists()
    assert_gone(ns)


def test_owner_close_waits_for_setup_and_rejects_new(ns):
    c = ShmCoordinator(ns, lease_seconds=LEASE)
    owner = c.memory_owner
    entered = threading.Event()
    done = []

    def slow_setup() -> None:
        with owner.setup():
            entered.set()
            time.sleep(0.3)
            owner.write_blob("p", b"late but allowed")  # nested in a running setup: allowed to finish
            done.append(time.monotonic())

    t = threading.Thread(target=slow_setup)
    t.start()
    entered.wait(5)
    c.close()
    closed_at = time.monotonic()
    t.join()
    assert done and done[0] <= closed_at
    with pytest.raises(RuntimeError, match="closed"):
        owner.create_segment("x", 10)
    assert_gone(ns)


def _mapped_here(name: str) -> bool:
    with open("/proc/self/maps") as fh:
        return any(f"/dev/shm{name}" in line for line in fh)


def test_prepared_segments_are_handed_out_by_create_segment(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as c:
        owner = c.memory_owner
        owner.prepare_segments({"b0": 1 << 20, "b1": 8192})
        prepared_b0 = owner._prepared["b0"][1].result()
        b0 = owner.create_segment("b0", 1 << 20)
        assert b0 is prepared_b0, "create_segment must hand out the prepared segment, not make another"
        b1 = owner.create_segment("b1", 4096)  # prepared with another size: made again at the asked size
        try:
            assert (b0.name, b0.size, b1.size) == (owner.resource_name("b0"), 1 << 20, 4096)
            assert {e.name for e in read_journal(ns).intents} >= {owner.resource_name("b0"), owner.resource_name("b1")}
            b0.tensor(torch.uint8, (1 << 20,)).fill_(7)
            with SharedSegment.open(owner.resource_name("b0")) as again:
                assert int(again.tensor(torch.uint8, (1 << 20,)).sum()) == 7 << 20
        finally:
            b0.close()
            b1.close()
    assert_gone(ns)


def test_prepared_segments_nobody_took_are_unmapped_and_unlinked_at_close(ns):
    c = ShmCoordinator(ns, lease_seconds=LEASE)
    owner = c.memory_owner
    owner.prepare_segments({f"b{i}": 1 << 20 for i in range(6)})
    taken = owner.create_segment("b0", 1 << 20)
    taken.close()
    c.close()
    assert not any(_mapped_here(owner.resource_name(f"b{i}")) for i in range(6))
    assert_gone(ns)


def _more_than_dev_shm_holds() -> int:
    st = os.statvfs("/dev/shm")
    if st.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit here")
    return max(st.f_bavail, st.f_blocks) * st.f_frsize + (1 << 30)


def test_preparing_more_than_dev_shm_holds_raises_at_create_and_leaves_nothing(ns):
    wanted = _more_than_dev_shm_holds()
    with ShmCoordinator(ns, lease_seconds=LEASE) as c:
        c.memory_owner.prepare_segments({"b0": wanted})
        with pytest.raises(ShmSpaceError, match="--shm-size"):
            c.memory_owner.create_segment("b0", wanted)
    assert_gone(ns)


def test_a_prepared_segment_of_another_size_does_not_fail_the_one_asked_for(ns):
    too_big = _more_than_dev_shm_holds()
    with ShmCoordinator(ns, lease_seconds=LEASE) as c:
        c.memory_owner.prepare_segments({"b0": too_big})  # its creation fails with ENOSPC
        with c.memory_owner.create_segment("b0", 4096) as seg:
            assert seg.size == 4096
    assert_gone(ns)


def test_only_the_creator_prepares(ns):
    with ShmCoordinator(ns, lease_seconds=LEASE) as a, ShmCoordinator(ns, lease_seconds=LEASE) as b:
        assert a.is_creator and not b.is_creator
        with pytest.raises(RuntimeError, match="only the creator"):
            b.memory_owner.prepare_segments({"b0": 4096})
        with pytest.raises(ValueError):
            a.memory_owner.prepare_segments({"bad/kind": 4096})
    assert_gone(ns)
