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
