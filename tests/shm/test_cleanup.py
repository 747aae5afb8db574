"""Offline cleanup: after SIGKILL of every participant, idempotent, bounded, and safe to retry."""

from __future__ import annotations

import os
import time

import pytest

from flextensor.shm.cleanup import CleanupReport, cleanup_manager_namespace, inspect_namespace_locked
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.leases import LeaseTable
from flextensor.shm.locks import FileLock
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.names import (
    coordinator_lock_path,
    coordinator_segment_name,
    journal_path,
    lock_directory,
    manager_namespace,
)
from flextensor.shm.segment import SharedSegment
from tests.leftovers import shm_names

LEASE = 1.0


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "cleanup")


def lock_files() -> list[str]:
    return sorted(p.name for p in lock_directory().iterdir())


def _populate(creator, followers, ns):
    assert creator.ok("open", ns=ns, lease=LEASE)["is_creator"]
    creator.ok("segment", kind="sd", size=1 << 16)
    creator.ok("write_blob", kind="sm", data=b"manifest".hex())
    creator.ok("lock", kind="b0", backend="semaphore")
    creator.ok("lock", kind="b0", backend="file")
    creator.ok("ready")
    for f in followers:
        f.ok("open", ns=ns, lease=LEASE)
        f.ok("wait", timeout=5)


def test_cleanup_after_everyone_was_killed_twice(ns, children):
    creator, *followers = children(3)
    _populate(creator, followers, ns)
    assert shm_names(ns) == sorted([f"{ns}.c", f"{ns}.g1.sd", f"{ns}.g1.sm", f"sem.{ns}.g1.lb0"])
    for p in (creator, *followers):
        p.kill()
    report = cleanup_manager_namespace(ns, timeout=5)
    assert report.namespace == ns and report.generation == 1
    assert report.waited_s < 1.0  # killed processes are gone at once: nothing to wait for
    assert sorted(report.removed) == sorted([
        f"/{ns}.g1.sd", f"/{ns}.g1.sm", f"/{ns}.g1.lb0", str(lock_directory() / f"{ns}.g1.lb0.lock"),
        f"/{ns}.c", str(journal_path(ns)), str(lock_directory() / f"{ns}.lock"),
    ])
    assert report.already_absent == []
    assert shm_names(ns) == [] and lock_files() == []
    again = cleanup_manager_namespace(ns, timeout=5)
    assert again == CleanupReport(namespace=ns, generation=None, removed=[], already_absent=[],
                                  waited_s=again.waited_s)
    assert again.waited_s < 1
    assert shm_names(ns) == [] and lock_files() == []


def test_cleanup_timeout_zero_with_a_live_participant(ns, children):
    (live,) = children(1)
    live.ok("open", ns=ns, lease=LEASE)
    live.ok("segment", kind="sd", size=4096)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"1 participant\(s\) still hold live leases .*pids {live.pid}\)"):
        cleanup_manager_namespace(ns, timeout=0)
    assert time.monotonic() - start < 0.5
    assert shm_names(ns) == sorted([f"{ns}.c", f"{ns}.g1.sd"])  # nothing removed
    with pytest.raises(TimeoutError, match="still hold live leases"):
        cleanup_manager_namespace(ns, timeout=0.3)  # a live heartbeat outlasts any timeout
    live.ok("close")
    assert shm_names(ns) == [] and lock_files() == []


def test_cleanup_retry_after_partial_failure(ns, children):
    (creator,) = children(1)
    _populate(creator, [], ns)
    creator.kill()
    time.sleep(LEASE + 0.1)
    # a previous cleanup got as far as the data segment and the coordinator segment, then died
    SharedSegment.unlink_name(f"/{ns}.g1.sd")
    SharedSegment.unlink_name(coordinator_segment_name(ns))
    report = cleanup_manager_namespace(ns, timeout=0)
    assert report.generation == 1
    assert sorted(report.already_absent) == sorted([f"/{ns}.g1.sd", f"/{ns}.c"])
    assert f"/{ns}.g1.sm" in report.removed and str(journal_path(ns)) in report.removed
    assert shm_names(ns) == [] and lock_files() == []


def test_cleanup_missing_namespace_is_a_noop(ns):
    report = cleanup_manager_namespace(ns, timeout=0)
    assert report.generation is None and report.removed == [] and report.already_absent == []
    assert lock_files() == []


def test_cleanup_lock_wait_is_bounded(ns, children):
    (holder,) = children(1)
    holder.ok("hold_lock", ns=ns)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\.lock"):
        cleanup_manager_namespace(ns, timeout=0.3)
    assert time.monotonic() - start < 1.5
    holder.ok("release_lock")
    cleanup_manager_namespace(ns, timeout=0)
    assert lock_files() == []


def test_cleanup_validates_arguments(ns):
    with pytest.raises(ValueError, match="namespace"):
        cleanup_manager_namespace("../etc", timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        cleanup_manager_namespace(ns, timeout=-1)


def test_new_coordinator_after_cleanup_starts_fresh(ns, children):
    (creator,) = children(1)
    _populate(creator, [], ns)
    creator.kill()
    cleanup_manager_namespace(ns, timeout=5)
    with ShmCoordinator(ns, lease_seconds=LEASE) as c:
        assert c.is_creator and c.generation == 1
    assert shm_names(ns) == [] and lock_files() == []


def test_cleanup_with_an_explicit_lock_dir_from_another_tmpdir(ns, tmp_path, monkeypatch):
    """A process whose TMPDIR differs from the workers' (ftd serving another user) cleans up through lock_dir=."""
    workers_dir = lock_directory()
    c = ShmCoordinator(ns, lease_seconds=LEASE)
    c.memory_owner.write_blob("p", b"weights")
    c.notify_ready()
    with LeaseTable.open(ns) as table:
        assert table.end_lease(c.lease_slot, c.identity)  # as ftd does when it sees the process exit
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    assert lock_directory() != workers_dir
    with pytest.raises(ShmProtocolError, match="TMPDIR"):
        cleanup_manager_namespace(ns, timeout=0)  # the default lock directory has no journal: nothing removed
    assert shm_names(ns) == sorted([f"{ns}.c", f"{ns}.g1.p"])
    lock = FileLock(coordinator_lock_path(ns, workers_dir))
    with lock:
        state = inspect_namespace_locked(ns, workers_dir)  # public: ftd reads namespaces this way
        try:
            assert state.lock_dir == workers_dir and state.generation == 1 and state.live_slots() == []
        finally:
            state.close()
    lock.close()
    report = cleanup_manager_namespace(ns, timeout=0, lock_dir=str(workers_dir))
    assert report.generation == 1
    assert sorted(report.removed) == sorted([f"/{ns}.g1.p", f"/{ns}.c", str(workers_dir / f"{ns}.journal"),
                                             str(workers_dir / f"{ns}.lock")])
    assert shm_names(ns) == [] and sorted(p.name for p in workers_dir.iterdir()) == []
    assert list(elsewhere.iterdir()) == [elsewhere / f"flextensor-{os.getuid()}"]  # made by lock_directory() only
    monkeypatch.setenv("TMPDIR", str(workers_dir.parent))
    c.close()
    assert lock_files() == []


def test_cleanup_refused_for_another_lock_directory_leaves_no_lock_file_there(namespace, tmp_path):
    ns = manager_namespace(namespace, "wrong-tmpdir")
    elsewhere = tmp_path / "elsewhere" / f"flextensor-{os.getuid()}"
    elsewhere.mkdir(parents=True, mode=0o700)
    with ShmCoordinator(ns, lease_seconds=5) as c:
        c.notify_ready()
        with pytest.raises(ShmProtocolError, match="ownership journal .* does not"):
            cleanup_manager_namespace(ns, timeout=0, lock_dir=elsewhere)
        assert list(elsewhere.iterdir()) == []  # refused: nothing created where the workers' files are not
    assert shm_names(ns) == []
