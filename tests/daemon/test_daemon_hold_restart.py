"""Holds survive a daemon restart: ``<socket>.state`` carries them (and the watched processes) to the next daemon.

Everything runs for real: ``ftd serve`` subprocesses on one socket, ``SharedOffloadSession`` workers
(tests/helpers/session_worker.py) or bare coordinators (tests/daemon/worker.py), SIGKILL for every crash.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest

from flextensor.daemon.config import load_settings
from flextensor.shm.leases import LeaseTable
from flextensor.shm.names import manager_namespace
from tests.client.sharing.test_session import expected_output, finish, make_profile, matches, output_of, read_result, spawn
from tests.daemon.helpers import Daemon, run_cli, wait_until
from tests.leftovers import shm_names

LEASE = "30"  # the workers' (and so the hold's) lease: nothing below may come from a lease running out
MANAGER = "model"  # session_worker's default --name
REAP = 0.1  # the helper daemon's reap interval


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_profile(tmp_path_factory.mktemp("ftd-hold-restart") / "profile")


def _state(socket_path: Path) -> dict | None:
    path = Path(f"{socket_path}.state")
    if not path.exists():
        return None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return json.loads(path.read_text())


def _rows(daemon: Daemon) -> list[tuple]:
    return [(r["namespace"], r["generation"], r["state"], r["participants"]) for r in daemon.cli("ls")[1]]


def _only_live_slot(ns: str):
    with LeaseTable.open(ns) as table:
        (slot,) = table.live_slots()
        return slot


def test_hold_survives_sigkill_of_the_daemon_and_of_every_worker(socket_path, lock_dir, namespace, profile,
                                                                   monkeypatch):
    ns = manager_namespace(namespace, MANAGER)
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(socket_path))
    first_daemon = Daemon(socket_path, lock_dir, reap_interval=REAP).start()
    first = [spawn(namespace, profile, "--lease", LEASE, "--hold") for _ in range(2)]
    try:
        before = [read_result(p) for p in first]
        assert sorted(r["role"] for r in before) == ["creator", "follower"]
        generation = before[0]["generation"]
        first_daemon.cli("hold", namespace, "--manager", MANAGER)
        state = _state(socket_path)
        (held,) = state["holds"]
        assert (held["namespace"], held["base"], held["manager"], held["generation"]) == (ns, namespace, MANAGER,
                                                                                          generation)
        assert held["lock_dir"] == str(lock_dir)
        assert len(state["watched"]) == 2 and {w["lock_dir"] for w in state["watched"]} == {str(lock_dir)}
        inode = os.stat(f"/dev/shm/{ns}.c").st_ino
        first_daemon.kill()
        for p in first:  # every worker dies while no daemon runs: nobody sees it happen
            p.send_signal(signal.SIGKILL)
    finally:
        for p in first:
            finish(p)
    daemon = Daemon(socket_path, lock_dir, reap_interval=REAP).start()
    try:
        time.sleep(3 * REAP)  # more than two scans (each one may reap)
        assert _rows(daemon) == [(ns, generation, "READY", 1)]  # the dead workers' leases ended at start
        assert daemon.cli("status")[1]["held"] == [ns]
        log = daemon.read_log()
        assert log.count(f"restored the hold on {ns} (base '{namespace}', manager '{MANAGER}') generation "
                         f"{generation}: took over the previous daemon's lease slot {held['slot']}") == 1, log
        assert "2 exited while no daemon ran" in log
        slot = _only_live_slot(ns)  # the very slot the first daemon took, refreshed by the second one
        assert slot.index == held["slot"] and slot.identity.token == held["identity"]["token"]
        (late,) = [spawn(namespace, profile, "--lease", LEASE, "--hold")]
        try:
            after = read_result(late)
            assert after["role"] == "follower" and after["generation"] == generation, after
            assert os.stat(f"/dev/shm/{ns}.c").st_ino == inode
            assert after["out"] == before[0]["out"] and matches(output_of(after), expected_output())
            assert _rows(daemon) == [(ns, generation, "READY", 2)]
            _, reply, _ = daemon.cli("release", namespace, "--manager", MANAGER)
            assert "1 participant(s) remain" in reply["message"], reply
            assert _state(socket_path)["holds"] == []
        finally:
            assert finish(late) == 0
        assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)
        assert wait_until(lambda: daemon.cli("ls")[1] == [], 2.0)
        assert wait_until(lambda: _state(socket_path) is None, 2.0)  # nothing held or watched: no file
    finally:
        daemon.stop()


@pytest.mark.parametrize("meanwhile", ["cleaned up", "replaced"])
def test_a_persisted_hold_whose_generation_went_away_is_dropped(socket_path, lock_dir, namespace, workers, meanwhile):
    ns = manager_namespace(namespace, "m")
    first_daemon = Daemon(socket_path, lock_dir, reap_interval=REAP).start()
    creator = workers(namespace, "m", "--lease", "0.3", socket=socket_path)
    creator.wait_event("published")
    first_daemon.cli("hold", namespace, "--manager", "m")
    first_daemon.kill()
    creator.kill()
    time.sleep(0.5)  # the hold's lease (the creator's) runs out: nothing protects the generation now
    run_cli("cleanup", namespace, "--manager", "m", "--local", "--lock-dir", str(lock_dir), "--json")
    assert shm_names(ns) == [] and not any(lock_dir.iterdir())
    replacement = None
    if meanwhile == "replaced":  # a new generation 1: same number, another creation time
        replacement = workers(namespace, "m", "--lease", LEASE, "--no-register", socket=socket_path)
        replacement.wait_event("published")
    daemon = Daemon(socket_path, lock_dir, reap_interval=REAP).start()
    try:
        time.sleep(3 * REAP)
        log = daemon.read_log()
        reason = "replaced it" if meanwhile == "replaced" else "its generation was cleaned up"
        assert log.count(f"dropped the hold on {ns}") == 1 and reason in log, log
        assert "restored the hold" not in log
        assert daemon.cli("status")[1]["held"] == []
        if replacement is None:
            assert shm_names(ns) == [] and not any(lock_dir.iterdir())  # nothing was created, not even a lock
            assert daemon.cli("ls")[1] == []
        else:
            assert _rows(daemon) == [(ns, 1, "READY", 1)]  # the new generation, untouched
            assert replacement.close() == 0
            assert shm_names(ns) == []
        assert wait_until(lambda: _state(socket_path) is None, 2.0)
    finally:
        daemon.stop()


def test_keep_holds_on_exit_hands_holds_to_the_next_daemon(socket_path, lock_dir, namespace, workers):
    ns = manager_namespace(namespace, "m")
    first_daemon = Daemon(socket_path, lock_dir, reap_interval=REAP, extra=["--keep-holds"]).start()
    creator = workers(namespace, "m", "--lease", LEASE, socket=socket_path)
    checksum = creator.wait_event("published")["checksum"]
    first_daemon.cli("hold", namespace, "--manager", "m")
    assert first_daemon.stop(signal.SIGTERM) == 0
    state = _state(socket_path)
    assert state["heartbeats_stopped"] is True and [h["namespace"] for h in state["holds"]] == [ns]
    assert "keeping 1 hold(s) for the next ftd" in first_daemon.read_log()
    assert creator.close() == 0  # the last worker leaves cleanly: the kept hold's lease keeps the generation
    assert shm_names(ns) == [f"{ns}.c", f"{ns}.g1.w"]
    daemon = Daemon(socket_path, lock_dir, reap_interval=REAP).start()  # default: releases on SIGTERM
    try:
        time.sleep(3 * REAP)
        assert _rows(daemon) == [(ns, 1, "READY", 1)]
        assert "took over the previous daemon's lease slot" in daemon.read_log()
        follower = workers(namespace, "m", "--lease", LEASE, socket=socket_path)
        assert follower.wait_event("ready")["checksum"] == checksum  # attached: nobody published again
        assert follower.close() == 0
        assert shm_names(ns)  # still held
        assert wait_until(lambda: daemon.cli("status")[1]["registered"] == 0, 2.0)  # it saw the follower go
    finally:
        assert daemon.stop(signal.SIGTERM) == 0
    # A default clean stop releases the hold (the daemon was the last participant: reclaimed) and keeps no hold.
    assert shm_names(ns) == [] and not any(lock_dir.iterdir())
    assert _state(socket_path) is None


def test_an_untrusted_state_file_is_ignored(socket_path, lock_dir):
    socket_path.parent.mkdir(mode=0o700)
    state = Path(f"{socket_path}.state")
    state.write_text('{"format": 99, "daemon": {}}')
    state.chmod(0o600)
    daemon = Daemon(socket_path, lock_dir, reap_interval=REAP).start()
    try:
        assert "ignoring the daemon state file" in daemon.read_log() and "format 99" in daemon.read_log()
        assert daemon.cli("status")[1]["held"] == []
        assert not state.exists()  # replaced by this daemon's (empty) state
    finally:
        daemon.stop()


def test_keep_holds_on_exit_setting(tmp_path):
    assert load_settings({}, environ={}).keep_holds_on_exit is False
    assert load_settings({}, environ={"FT_DAEMON_KEEP_HOLDS_ON_EXIT": "yes"}).keep_holds_on_exit is True
    config = tmp_path / "ftd.yaml"
    config.write_text("keep_holds_on_exit: true\n")
    assert load_settings({}, config_file=str(config), environ={"FT_DAEMON_KEEP_HOLDS_ON_EXIT": "off"}
                         ).keep_holds_on_exit is False  # environment over file
    assert load_settings({"keep_holds_on_exit": True}, environ={"FT_DAEMON_KEEP_HOLDS_ON_EXIT": "0"}
                         ).keep_holds_on_exit is True  # flag over environment
    with pytest.raises(ValueError, match="FT_DAEMON_KEEP_HOLDS_ON_EXIT"):
        load_settings({}, environ={"FT_DAEMON_KEEP_HOLDS_ON_EXIT": "maybe"})
    config.write_text("keep_holds_on_exit: 1\n")
    with pytest.raises(ValueError, match="keep_holds_on_exit must be true or false"):
        load_settings({}, config_file=str(config), environ={})
