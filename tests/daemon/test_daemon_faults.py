"""Faults with a real daemon: SIGKILLed workers, a creator dying while followers wait, a daemon killed and
restarted, workers that never registered, and workers without any daemon."""

from __future__ import annotations

import signal
import time
import urllib.request

from flextensor.shm.names import manager_namespace

from tests.daemon.helpers import Daemon, wait_until
from tests.leftovers import shm_names

LONG_LEASE = "30"  # without the daemon, nothing would happen for 30 s


def _metrics(daemon: Daemon) -> dict[str, float]:
    port = daemon.cli("status")[1]["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_sigkill_of_every_worker_leaves_nothing_within_2s(socket_path, workers, namespace, lock_dir):
    daemon = Daemon(socket_path, lock_dir, extra=["--metrics-port", "0"]).start()
    try:
        _sigkill_everyone(daemon, workers, namespace, lock_dir)
    finally:
        daemon.stop()


def _sigkill_everyone(daemon, workers, namespace, lock_dir):
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", LONG_LEASE, socket=daemon.socket)
    creator.wait_event("published")
    followers = [workers(namespace, "m", "--lease", LONG_LEASE, socket=daemon.socket) for _ in range(2)]
    for f in followers:
        assert f.wait_event("joined")["registered"] is True
        f.wait_event("ready")
    assert len(shm_names(ns)) == 2
    t0 = time.monotonic()
    for w in [creator, *followers]:
        w.signal(signal.SIGKILL)
    assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)
    elapsed = time.monotonic() - t0
    assert elapsed < 2.0
    assert wait_until(lambda: not any(lock_dir.iterdir()), 1.0), list(lock_dir.iterdir())
    for w in [creator, *followers]:
        w.kill()
    # Seen by its pidfd, or first by the lease reader at a scan (the process is gone): a death either way. The
    # reclaim is logged just after its cleanup removed the names waited for above: wait for the line too.
    assert wait_until(lambda: "(death)" in daemon.read_log(), 2.0), daemon.read_log()
    log = daemon.read_log()
    assert "exited holding lease slot" in log or "no longer counts" in log
    m = _metrics(daemon)
    assert m["ftd_registrations_total"] == 3 and m["ftd_deaths_detected_total"] == 3
    assert m['ftd_reclaims_total{reason="death"}'] == 1
    assert m["ftd_reclaim_latency_seconds_count"] == 1 and m["ftd_reclaim_latency_seconds_sum"] < 2
    assert m["ftd_namespaces"] == 0 and m["ftd_bytes_shared"] == 0


def test_followers_of_a_killed_creator_raise_within_2s(daemon, workers, namespace):
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", LONG_LEASE, "--no-publish", socket=daemon.socket)
    assert creator.wait_event("joined")["creator"] is True
    followers = [workers(namespace, "m", "--lease", LONG_LEASE, socket=daemon.socket) for _ in range(2)]
    for f in followers:
        assert f.wait_event("joined")["creator"] is False
    time.sleep(0.2)  # the followers are inside wait_for_ready()
    killed_at = time.time()
    creator.signal(signal.SIGKILL)
    for f in followers:
        error = f.wait_event("error", timeout=5)
        assert error["type"] == "ShmCreatorDiedError"
        assert error["t"] - killed_at < 2.0, error
        f.wait_event("closed")
    assert wait_until(lambda: shm_names(ns) == [], 2.0)
    creator.kill()


def test_daemon_killed_and_restarted_mid_run_loses_nothing(daemon, workers, namespace, lock_dir):
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", LONG_LEASE, socket=daemon.socket)
    checksum = creator.wait_event("published")["checksum"]
    follower = workers(namespace, "m", "--lease", LONG_LEASE, socket=daemon.socket)
    follower.wait_event("ready")
    daemon.kill()
    assert shm_names(ns) == [f"{ns}.c", f"{ns}.g1.w"]  # a daemon's death touches nothing
    restarted = Daemon(daemon.socket, lock_dir).start()
    try:
        _, rows, _ = restarted.cli("ls")
        assert [(r["namespace"], r["generation"], r["participants"]) for r in rows] == [(ns, 1, 2)]
        assert restarted.cli("status")[1]["registered"] == 2  # re-adopted from the lease table
        late = workers(namespace, "m", "--lease", LONG_LEASE, socket=restarted.socket)
        assert late.wait_event("ready")["checksum"] == checksum
        t0 = time.monotonic()
        for w in (creator, follower, late):
            w.signal(signal.SIGKILL)
        assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)
        assert time.monotonic() - t0 < 2.0
        for w in (creator, follower, late):
            w.kill()
    finally:
        restarted.stop()


def test_reaper_reclaims_expired_leases_of_unregistered_workers(daemon, workers, namespace):
    """A worker that never registered and stops heartbeating without exiting (SIGSTOP) is reclaimed once its
    lease runs out, by the reaper, with the offline cleanup code."""
    ns = manager_namespace(namespace, "m")
    w = workers(namespace, "m", "--lease", "0.5", "--no-register", socket=daemon.socket)
    assert w.wait_event("joined")["registered"] is False
    w.wait_event("published")
    w.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    assert wait_until(lambda: shm_names(ns) == [], 3.0), shm_names(ns)
    assert time.monotonic() - t0 >= 0.3  # not before the lease ran out
    w.kill()
    assert wait_until(lambda: "(expired)" in daemon.read_log(), 2.0)  # logged just after the unlinks


def test_workers_without_a_daemon_are_unchanged(workers, namespace):
    """FT_DAEMON_SOCKET points at nothing (conftest): registration is a fast False and sharing still works."""
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", "2")
    joined = creator.wait_event("joined")
    assert joined["registered"] is False and joined["register_s"] < 0.05
    checksum = creator.wait_event("published")["checksum"]
    follower = workers(namespace, "m", "--lease", "2")
    assert follower.wait_event("joined")["registered"] is False
    assert follower.wait_event("ready")["checksum"] == checksum
    follower.close()
    creator.close()
    assert shm_names(ns) == []


def test_untrusted_journal_is_shown_and_never_reclaimed(daemon, namespace):
    """A journal of another protocol version: ls says CORRUPT, the reaper removes nothing, the error is logged
    once (not at every scan), and the daemon keeps serving."""
    from flextensor.shm.names import lock_directory

    ns = manager_namespace(namespace, "m")
    journal = lock_directory() / f"{ns}.journal"
    journal.write_text('{"record":"header","protocol":99,"library_version":"9.9","namespace":"%s","generation":1}\n'
                       % ns)
    try:
        assert wait_until(lambda: [r["state"] for r in daemon.cli("ls")[1]] == ["CORRUPT"], 3.0)
        time.sleep(0.5)  # a few scans
        assert journal.exists()
        assert daemon.read_log().count("cannot be trusted") == 1
        assert daemon.answers()
    finally:
        journal.unlink()
