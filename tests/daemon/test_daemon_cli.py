"""Round trips through a real ``ftd`` subprocess: status, ls, cleanup, drain, hold, release; start and stop."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time

from flextensor.shm.header import coordinator_segment_size
from flextensor.shm.names import manager_namespace
from flextensor.shm.segment_dir import page_info

from tests.daemon.helpers import PY, REPO, Daemon, run_cli, wait_until
from tests.leftovers import shm_names

LS_KEYS = {"namespace", "base", "manager", "generation", "state", "participants", "bytes", "age", "shm_dir",
           "page_size", "pages", "sleeping", "weights_version", "members"}
WEIGHTS = 1 << 20


def test_status_permissions_single_instance_and_clean_exit(daemon, socket_path, lock_dir):
    _, status, _ = daemon.cli("status")
    assert status["up"] is True and status["pid"] == daemon.proc.pid and status["protocol"] == 1
    assert status["socket"] == str(socket_path) and status["namespaces"] == 0
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(socket_path.parent).st_mode) == 0o700
    # A second daemon on the same socket refuses to start (exit 1) and leaves the first one serving.
    second = subprocess.run([PY, "-m", "flextensor.daemon.cli", "serve", "--socket", str(socket_path), "--lock-dir",
                             str(lock_dir)], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert second.returncode == 1
    assert f"another ftd (pid {daemon.proc.pid}) already serves" in second.stderr
    assert daemon.answers()
    # SIGTERM: clean exit, socket file removed.
    assert daemon.stop(signal.SIGTERM) == 0
    assert not socket_path.exists()
    code, data, err = run_cli("status", "--socket", str(socket_path), "--json", expect=1)
    assert data["up"] is False and "no ftd daemon" in err
    assert run_cli("status", "--socket", str(socket_path), expect=1)[0] == 1
    assert run_cli("bogus-command", expect=2)[0] == 2  # usage error


def test_stale_socket_of_a_killed_daemon_is_replaced(socket_path, lock_dir):
    first = Daemon(socket_path, lock_dir).start()
    first.kill()
    assert socket_path.exists()  # a SIGKILLed daemon leaves its socket file behind
    second = Daemon(socket_path, lock_dir).start()
    try:
        assert "replacing the stale socket" in second.read_log()
        assert second.cli("status")[1]["pid"] == second.proc.pid
    finally:
        second.stop()


def test_ls_shows_participants_and_bytes_while_workers_run(daemon, workers, namespace):
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", "5", "--size", str(WEIGHTS), socket=daemon.socket)
    assert creator.wait_event("joined")["registered"] is True
    creator.wait_event("published")
    follower = workers(namespace, "m", "--lease", "5", "--size", str(WEIGHTS), socket=daemon.socket)
    assert follower.wait_event("ready")["checksum"] == creator.wait_event("published")["checksum"]
    _, rows, _ = daemon.cli("ls")
    (row,) = [r for r in rows if r["namespace"] == ns]
    assert set(row) == LS_KEYS
    assert row["manager"] == "m" and row["generation"] == 1 and row["state"] == "READY"
    assert row["participants"] == 2 and (row["sleeping"], row["weights_version"]) == (0, 0)
    assert sorted((m["pid"], m["state"]) for m in row["members"]) == sorted(
        [(creator.pid, "serving"), (follower.pid, "serving")])
    assert (row["shm_dir"], row["page_size"]) == ("/dev/shm", page_info("/dev/shm").size)
    assert row["pages"] == page_info("/dev/shm").describe()
    assert row["bytes"] == WEIGHTS + coordinator_segment_size()
    assert 0 <= row["age"] < 60
    _, status, _ = daemon.cli("status")
    assert status["namespaces"] == 1 and status["participants"] == 2 and status["registered"] == 2
    code, human, _ = run_cli("ls", "--socket", str(daemon.socket))
    assert "NAMESPACE" in human and ns in human and "READY" in human
    follower.close()
    assert follower.wait_event("closed")["unregistered"] is True
    creator.close()
    assert shm_names(ns) == []
    assert wait_until(lambda: daemon.cli("ls")[1] == [], 3.0)
    assert daemon.cli("status")[1]["registered"] == 0


def test_cleanup_through_the_daemon_waits_for_the_lease(socket_path, lock_dir, workers, namespace):
    """A stopped (not dead) worker keeps its lease until it expires; `ftd cleanup --timeout` waits for that."""
    daemon = Daemon(socket_path, lock_dir, reap_interval=60).start()  # the reaper must not race the request
    try:
        ns = manager_namespace(namespace, "m")
        w = workers(namespace, "m", "--lease", "1", socket=socket_path)
        w.wait_event("published")
        w.signal(signal.SIGSTOP)
        code, data, err = daemon.cli("cleanup", namespace, "--manager", "m", "--timeout", "0", expect=1)
        assert data["error"] == "timeout" and "live leases" in data["message"]
        t0 = time.monotonic()
        _, reports, _ = daemon.cli("cleanup", namespace, "--manager", "m", "--manager", "other", "--timeout", "5")
        assert time.monotonic() - t0 < 3
        assert [r["namespace"] for r in reports] == [ns, manager_namespace(namespace, "other")]
        assert reports[0]["generation"] == 1 and f"/{ns}.g1.w" in reports[0]["removed"]
        assert reports[1]["generation"] is None  # a missing generation is a no-op
        assert shm_names(ns) == []
        w.kill()
    finally:
        daemon.stop()


def test_cleanup_without_a_daemon_runs_locally(workers, namespace, lock_dir, tmp_path):
    ns = manager_namespace(namespace, "m")
    w = workers(namespace, "m", "--lease", "0.5")  # FT_DAEMON_SOCKET points nowhere (conftest)
    assert w.wait_event("joined")["registered"] is False
    w.wait_event("published")
    w.kill()
    assert shm_names(ns)  # nobody reclaims it without a daemon...
    _, reports, _ = run_cli("cleanup", namespace, "--manager", "m", "--timeout", "5", "--json")
    assert reports[0]["namespace"] == ns and reports[0]["generation"] == 1
    assert shm_names(ns) == [] and not any(lock_dir.iterdir())
    # Idempotent (nothing is removed), but a name that matches nothing is reported with exit status 1.
    _, again, err = run_cli("cleanup", namespace, "--manager", "m", "--json", expect=1)
    assert again[0]["generation"] is None and "matches nothing" in err
    assert run_cli("cleanup", "bad/name", "--manager", "m", expect=2)[0] == 2


def test_drain_refuses_registrations_and_hold(daemon, workers, namespace):
    ns = manager_namespace(namespace, "m")
    first = workers(namespace, "m", "--lease", "5", socket=daemon.socket)
    assert first.wait_event("joined")["registered"] is True
    first.wait_event("published")
    _, reply, _ = daemon.cli("drain", namespace, "--manager", "m")
    assert reply["ok"] is True and ns in reply["message"]
    late = workers(namespace, "m", "--lease", "5", socket=daemon.socket)
    joined = late.wait_event("joined")
    assert joined["registered"] is False and joined["creator"] is False  # not blocked, just not watched
    late.wait_event("ready")
    _, hold, _ = daemon.cli("hold", namespace, "--manager", "m", expect=1)
    assert hold["error"] == "draining"
    _, rows, _ = daemon.cli("ls")
    assert [r["state"] for r in rows if r["namespace"] == ns] == ["DRAINING"]
    assert ns in daemon.cli("status")[1]["draining"]
    late.close()
    first.close()
    assert shm_names(ns) == []
    assert daemon.cli("drain", namespace, "--manager", "m", "--undo")[1]["ok"] is True
    # A whole base can be drained too: later registrations carrying that base are refused.
    assert daemon.cli("drain", namespace)[1]["ok"] is True
    other = workers(namespace, "other", "--lease", "5", socket=daemon.socket)
    assert other.wait_event("joined")["registered"] is False
    other.close()
    assert daemon.cli("drain", namespace, "--undo")[1]["ok"] is True


def test_hold_keeps_weights_across_a_full_restart_of_the_workers(daemon, workers, namespace):
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", "2", socket=daemon.socket)
    published = creator.wait_event("published")
    _, reply, _ = daemon.cli("hold", namespace, "--manager", "m")
    assert reply["message"] == f"holding {ns} generation 1"
    assert daemon.cli("hold", namespace, "--manager", "m")[1]["message"].startswith("already holding")
    creator.close()  # every worker is gone...
    assert shm_names(ns) == [f"{ns}.c", f"{ns}.g1.w"]  # ...but the weights stay
    time.sleep(0.6)  # longer than a scan: the reaper must leave a held generation alone
    _, rows, _ = daemon.cli("ls")
    assert [(r["generation"], r["participants"]) for r in rows if r["namespace"] == ns] == [(1, 1)]
    restarted = workers(namespace, "m", "--lease", "2", socket=daemon.socket)
    joined = restarted.wait_event("joined")
    assert joined["creator"] is False and joined["generation"] == 1  # a follower: no creator work
    assert restarted.wait_event("ready")["checksum"] == published["checksum"]
    assert not restarted.has("published")
    restarted.close()
    assert shm_names(ns) != []
    _, reply, _ = daemon.cli("release", namespace, "--manager", "m")
    assert "generation 1 reclaimed" in reply["message"]
    assert shm_names(ns) == []
    _, again, _ = daemon.cli("release", namespace, "--manager", "m", expect=1)
    assert again["error"] == "not_found"
    _, missing, _ = daemon.cli("hold", namespace, "--manager", "m", expect=1)
    assert missing["error"] == "not_found"
    # A daemon that stops cleanly releases its holds (and, being the last participant, reclaims).
    again = workers(namespace, "m", "--lease", "2", socket=daemon.socket)
    assert again.wait_event("joined")["generation"] == 1  # a fresh generation 1 after the reclaim
    again.wait_event("published")
    daemon.cli("hold", namespace, "--manager", "m")
    again.close()
    assert shm_names(ns) != []
    assert daemon.stop() == 0
    assert shm_names(ns) == []


def test_hold_of_a_generation_that_is_not_ready_is_refused(daemon, workers, namespace):
    creator = workers(namespace, "m", "--lease", "5", "--no-publish", socket=daemon.socket)
    creator.wait_event("joined")
    _, reply, _ = daemon.cli("hold", namespace, "--manager", "m", expect=1)
    assert reply["error"] == "conflict" and "INITIALIZING" in reply["message"]
    creator.close()


def test_socket_group_mode(tmp_path, lock_dir):
    sock = tmp_path / "grp" / "ftd.sock"
    d = Daemon(sock, lock_dir, extra=["--socket-group", str(os.getgid())]).start()
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o750
        assert os.stat(sock).st_gid == os.getgid()
    finally:
        d.stop()


def test_version_prints_the_package_version_and_needs_no_daemon():
    import flextensor

    proc = subprocess.run([PY, "-m", "flextensor.daemon.cli", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ftd (flextensor) {flextensor.__version__}"


def test_ls_shows_sleeping_workers_and_a_killed_sleeper_is_reclaimed(daemon, workers, namespace):
    ns = manager_namespace(namespace, "m")
    creator = workers(namespace, "m", "--lease", "5", socket=daemon.socket)
    creator.wait_event("published")
    sleeper = workers(namespace, "m", "--lease", "5", "--sleep", socket=daemon.socket)
    sleeper.wait_event("asleep")
    (row,) = [r for r in daemon.cli("ls")[1] if r["namespace"] == ns]
    assert (row["participants"], row["sleeping"]) == (2, 1)
    assert {m["pid"]: m["state"] for m in row["members"]} == {creator.pid: "serving", sleeper.pid: "sleeping"}
    code, human, _ = run_cli("ls", "--socket", str(daemon.socket))
    assert "SLEEPING" in human and "WEIGHTS" in human
    sleeper.kill()  # a sleeping worker dies as any other: its lease ends at once
    assert wait_until(lambda: [(r["participants"], r["sleeping"]) for r in daemon.cli("ls")[1]
                               if r["namespace"] == ns] == [(1, 0)], 3.0)
    creator.close()
    assert wait_until(lambda: daemon.cli("ls")[1] == [], 3.0)
    assert shm_names(ns) == []
