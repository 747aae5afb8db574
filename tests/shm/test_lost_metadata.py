"""Metadata that was damaged or lost after the fact: a truncated journal, a corrupt header, a deleted
journal, orphans of a lost journal, and a lock directory that cannot be made. Cleanup either reclaims
everything derivable from the namespace or refuses naming the forced cleanup, never a loop of remedies."""

from __future__ import annotations

import os
import struct

import pytest

from flextensor.shm.cleanup import cleanup_manager_namespace
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.leases import LeaseTable
from flextensor.shm.names import journal_path, lock_directory, manager_namespace
from flextensor.shm.segment import SharedSegment
from tests.leftovers import shm_names

LEASE = 30.0


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "lost")


def lock_files() -> list[str]:
    return sorted(p.name for p in lock_directory().iterdir())


def _ready_generation(ns: str, children) -> None:
    """A READY generation with a segment, a blob, a semaphore and a file lock, whose only worker was killed."""
    (creator,) = children(1)
    assert creator.ok("open", ns=ns, lease=LEASE)["is_creator"]
    creator.ok("segment", kind="sd", size=1 << 16)
    creator.ok("write_blob", kind="sm", data=b"m".hex())
    creator.ok("lock", kind="b0", backend="semaphore")
    creator.ok("lock", kind="b0", backend="file")
    creator.ok("ready")
    creator.kill()


@pytest.mark.parametrize("who", ["cleanup", "election"])
def test_truncated_journal_beside_a_ready_header_orphans_nothing(ns, children, who):
    _ready_generation(ns, children)
    os.truncate(journal_path(ns), 0)
    if who == "cleanup":
        report = cleanup_manager_namespace(ns, timeout=0)
        assert report.generation == 1
        assert {f"/{ns}.g1.sd", f"/{ns}.g1.sm", f"/{ns}.g1.lb0", f"/{ns}.c"} <= set(report.removed)
        assert shm_names(ns) == [] and lock_files() == []
    else:
        with ShmCoordinator(ns, lease_seconds=LEASE) as again:  # a restart reclaims and creates the next
            assert again.is_creator and again.generation == 2
            assert shm_names(ns) == [f"{ns}.c"]
        assert shm_names(ns) == [] and lock_files() == []


def test_orphans_without_journal_or_coordinator_do_not_block_the_next_creator(ns):
    """Segments an older run left with no journal and no coordinator (no tool shows them any more) are removed
    by the next creator instead of failing it with FileExistsError."""
    for kind in ("sd", "b0"):
        SharedSegment.create(f"/{ns}.g1.{kind}", 4096).close()
    with ShmCoordinator(ns, lease_seconds=LEASE) as c:
        assert c.is_creator and c.generation == 1
        c.memory_owner.create_segment("sd", 4096).close()  # the name an orphan held
        assert shm_names(ns) == sorted([f"{ns}.c", f"{ns}.g1.sd"])
    assert shm_names(ns) == [] and lock_files() == []


def test_orphan_sweep_leaves_other_namespaces_alone(ns, namespace):
    other = manager_namespace(namespace, "lost.g1")  # another namespace, whatever its name looks like
    keep = SharedSegment.create(f"/{other}.g1.sd", 4096)
    try:
        SharedSegment.create(f"/{ns}.g3.sd", 4096).close()
        with ShmCoordinator(ns, lease_seconds=LEASE):
            pass
        assert shm_names(ns) == [] and shm_names(other) == [f"{other}.g1.sd"]
    finally:
        keep.close()
        SharedSegment.unlink_name(keep.name)


@pytest.mark.parametrize("damage", ["header_state", "slot_state", "deleted_journal"])
def test_forced_cleanup_is_the_way_out_of_untrustworthy_metadata(ns, children, damage):
    _ready_generation(ns, children)
    with LeaseTable.open(ns) as table:
        buf = table._buf
        if damage == "header_state":
            struct.pack_into("=I", buf, 32, 7)
            problem = "header state 7"
        elif damage == "slot_state":
            struct.pack_into("=I", buf, 4096, 9)
            problem = "unknown state 9"
        else:
            journal_path(ns).unlink()
            problem = "journal .* does not"
        del buf
    with pytest.raises(ShmProtocolError, match=problem) as refused:
        cleanup_manager_namespace(ns, timeout=0)
    assert "--force" in str(refused.value) and "force=True" in str(refused.value)
    assert f"{ns}.c" in shm_names(ns)  # the plain cleanup removed nothing
    report = cleanup_manager_namespace(ns, timeout=0, force=True)
    expected = {f"/dev/shm/{ns}.c", f"/dev/shm/{ns}.g1.sd", f"/dev/shm/{ns}.g1.sm", f"/dev/shm/sem.{ns}.g1.lb0",
                str(lock_directory() / f"{ns}.g1.lb0.lock"), str(lock_directory() / f"{ns}.lock")}
    if damage != "deleted_journal":
        expected.add(str(journal_path(ns)))
        assert report.generation == 1
    assert set(report.removed) == expected
    assert shm_names(ns) == [] and lock_files() == []


def test_forced_cleanup_refuses_while_a_worker_holds_the_coordinator_lock(ns, children):
    (holder,) = children(1)
    holder.ok("hold_lock", ns=ns)
    with pytest.raises(TimeoutError, match="stop every worker"):
        cleanup_manager_namespace(ns, timeout=0.2, force=True)
    holder.ok("release_lock")
    assert cleanup_manager_namespace(ns, timeout=0, force=True).removed == [str(lock_directory() / f"{ns}.lock")]


def test_unusable_tmpdir_is_an_error_naming_it_not_a_fall_back(ns, tmp_path, monkeypatch):
    missing = tmp_path / "does-not-exist"
    monkeypatch.setenv("TMPDIR", str(missing))
    with pytest.raises(FileNotFoundError, match=f"lock directory {missing}/flextensor-{os.getuid()}.*TMPDIR"):
        ShmCoordinator(ns, lease_seconds=LEASE)
    assert shm_names(ns) == []


def test_full_tmpdir_is_an_error_naming_the_journal(ns, tmp_path, monkeypatch):
    """A TMPDIR with no room left: the journal cannot be written, and the error says where and what to do."""
    full = tmp_path / "full"
    full.mkdir()
    if os.system(f"mount -t tmpfs -o size=4k tmpfs {full} 2>/dev/null") != 0:
        pytest.skip("needs to mount a tiny tmpfs (root in a private mount namespace)")
    try:
        monkeypatch.setenv("TMPDIR", str(full))
        lock_directory()
        with open(full / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"x" * 1024)
            except OSError:
                pass
        with pytest.raises(OSError, match="ownership journal .*free space") as info:
            ShmCoordinator(ns, lease_seconds=LEASE)
        assert info.value.errno == 28
        assert shm_names(ns) == []
        assert not (tmp_path / "tmp" / f"flextensor-{os.getuid()}" / f"{ns}.journal").exists()
    finally:
        os.system(f"umount {full}")
