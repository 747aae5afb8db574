"""SharedOffloadSession.cleanup_namespace passes the workers' lock directory and force through (the session
is a thin layer over cleanup_manager_namespace; this checks the wiring, with no model involved)."""

from __future__ import annotations

import os

import pytest

import flextensor as ft
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.leases import LeaseTable
from flextensor.shm.names import lock_directory, manager_namespace
from tests.leftovers import shm_names


def test_cleanup_namespace_takes_the_workers_lock_dir_and_force(namespace, tmp_path, monkeypatch):
    ns = manager_namespace(namespace, "default")
    workers_dir = lock_directory()
    c = ShmCoordinator(ns, lease_seconds=30)
    c.memory_owner.write_blob("p", b"x")
    c.notify_ready()
    with LeaseTable.open(ns) as table:
        assert table.end_lease(c.lease_slot, c.identity)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("TMPDIR", str(elsewhere))  # the caller's TMPDIR is not the workers'
    (report,) = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["default"], timeout=0,
                                                          lock_dir=workers_dir)
    assert report.generation == 1 and f"/{ns}.g1.p" in report.removed
    assert shm_names(ns) == [] and list(workers_dir.iterdir()) == []
    monkeypatch.setenv("TMPDIR", str(workers_dir.parent))
    c.close()
    (forced,) = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["default"], timeout=0,
                                                          force=True)
    assert forced.removed == []
    assert list(workers_dir.iterdir()) == []
    with pytest.raises(ValueError, match="wait_timeout"):
        ft.SharedOffloadSession(namespace, wait_timeout=1e30)
    with pytest.raises(ValueError, match="lease_seconds"):
        ft.SharedOffloadSession(namespace, lease_seconds=1e12)
    assert os.listdir(workers_dir) == []
