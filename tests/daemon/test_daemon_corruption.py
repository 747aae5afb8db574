"""Damaged metadata seen by the daemon: its reclaims go through the same cleanup code as the library's."""

from __future__ import annotations

import os
import signal

from flextensor.shm.names import manager_namespace

from tests.daemon.helpers import Daemon, wait_until
from tests.leftovers import shm_names


def test_reaper_reclaims_a_generation_whose_journal_was_truncated_without_orphans(socket_path, lock_dir, workers,
                                                                                 namespace):
    """The journal emptied under a READY generation (a full disk, an operator): the daemon's reclaim finds the
    generation's segments by name, so the data segment is not orphaned (and a restart does not trip on it)."""
    daemon = Daemon(socket_path, lock_dir).start()
    try:
        ns = manager_namespace(namespace, "m")
        w = workers(namespace, "m", "--lease", "30", socket=socket_path)
        w.wait_event("published")
        assert shm_names(ns) == sorted([f"{ns}.c", f"{ns}.g1.w"])
        os.truncate(lock_dir / f"{ns}.journal", 0)
        w.signal(signal.SIGKILL)
        assert wait_until(lambda: shm_names(ns) == [], 3.0), (shm_names(ns), daemon.read_log()[-2000:])
        assert wait_until(lambda: not any(lock_dir.iterdir()), 2.0), list(lock_dir.iterdir())
        w.kill()
    finally:
        daemon.stop()
