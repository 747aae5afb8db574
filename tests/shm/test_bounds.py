"""Durations are checked at construction against both bounds: a value that is accepted must work for the
whole run (no OverflowError in a heartbeat thread, no lease that expires before its first beat)."""

from __future__ import annotations

import pytest

from flextensor.shm.checks import MAX_LEASE_SECONDS, MAX_WAIT_SECONDS, MIN_LEASE_SECONDS, check_seconds
from flextensor.shm.cleanup import cleanup_manager_namespace
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.locks import FileLock
from flextensor.shm.names import lock_directory, manager_namespace
from tests.leftovers import shm_names


@pytest.mark.parametrize("lease", [1e12, 1e-9, 0, -1, float("nan"), float("inf"), MAX_LEASE_SECONDS * 2])
def test_lease_out_of_range_is_refused_at_construction(namespace, lease):
    ns = manager_namespace(namespace, "bounds")
    with pytest.raises(ValueError, match=r"invalid lease_seconds .*between 0\.1 and 86400"):
        ShmCoordinator(ns, lease_seconds=lease)
    assert shm_names(ns) == [] and list(lock_directory().iterdir()) == []


@pytest.mark.parametrize("bad", [1e30, MAX_WAIT_SECONDS + 1])
def test_huge_timeouts_are_refused_naming_the_parameter(namespace, bad):
    ns = manager_namespace(namespace, "bounds")
    with pytest.raises(ValueError, match=r"invalid timeout .*at most 2\.592e\+06"):
        ShmCoordinator(ns, timeout=bad)
    with pytest.raises(ValueError, match=r"invalid join_timeout"):
        ShmCoordinator(ns, join_timeout=bad)
    with pytest.raises(ValueError, match=r"invalid timeout"):
        cleanup_manager_namespace(ns, timeout=bad)
    with pytest.raises(ValueError, match=r"invalid timeout"):
        FileLock(lock_directory() / "x.lock", timeout=bad)
    assert shm_names(ns) == []


def test_bounds_themselves_are_accepted(namespace):
    ns = manager_namespace(namespace, "bounds")
    assert check_seconds(MAX_WAIT_SECONDS, "timeout", allow_none=True) == MAX_WAIT_SECONDS
    with ShmCoordinator(ns, lease_seconds=MIN_LEASE_SECONDS, timeout=MAX_WAIT_SECONDS) as c:
        assert c.is_creator
    with ShmCoordinator(ns, lease_seconds=MAX_LEASE_SECONDS) as c:
        c.memory_owner.write_blob("p", b"x")
        c.notify_ready()
    assert shm_names(ns) == []


def test_host_memory_check_names_the_bytes_and_survives_pickling(tmp_path):
    import pickle

    from flextensor.shm import preflight
    from flextensor.shm.errors import HostMemoryError

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       33554432 kB\nMemAvailable:    4194304 kB\n")
    assert preflight.host_available_bytes(str(meminfo)) == 4 << 30
    assert preflight.host_available_bytes(str(tmp_path / "missing")) is None
    original = preflight.host_available_bytes
    try:
        preflight.host_available_bytes = lambda meminfo=str(meminfo): original(meminfo)
        preflight.check_host_memory("a test", 3 << 30, "fix it")  # 3 GiB + 1 GiB headroom fits in 4 GiB
        with pytest.raises(HostMemoryError) as info:
            preflight.check_host_memory("a test", (3 << 30) + 1, "Fix it.")
    finally:
        preflight.host_available_bytes = original
    error = info.value
    assert isinstance(error, MemoryError) and error.wanted == (3 << 30) + 1 and error.available == 4 << 30
    assert str(error).startswith("a test needs 3.0 GiB of host RAM and the host has 4.0 GiB available")
    assert str(error).endswith("Fix it.")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is HostMemoryError and (copy.wanted, copy.available, str(copy)) == (error.wanted, error.available, str(error))
