"""``ftd`` with real ``SharedOffloadSession`` workers (tests/helpers/session_worker.py), not bare coordinators.

Each worker is a full process that imports torch, elects a creator, publishes or attaches a tiny transformer
and runs a forward pass; the session registers every participant with the daemon found through
``FT_DAEMON_SOCKET``.  Leases are 30 s on purpose: everything these tests wait for must come from the daemon
(pidfd death detection, reclaim, hold), never from a lease running out.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import time
from pathlib import Path

import pytest

from flextensor.shm.ftd_client import register_participant
from flextensor.shm.header import coordinator_segment_size
from flextensor.shm.identity import ParticipantIdentity
from flextensor.shm.journal import read_journal
from flextensor.shm.names import manager_namespace
from tests.client.sharing.test_session import (
    expected_output,
    finish,
    finish_all,
    make_profile,
    matches,
    output_of,
    read_result,
    spawn,
    wait_for_file,
    wait_for_joined,
)
from tests.daemon.helpers import Daemon, wait_until
from tests.leftovers import shm_names

LEASE = "30"  # without the daemon nothing below would happen for 30 s
MANAGER = "model"  # session_worker's default --name


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One saved profile for the whole module (profiling is in-process and touches no shared memory)."""
    return make_profile(tmp_path_factory.mktemp("ftd-sessions") / "profile")


@pytest.fixture
def ftd(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> Daemon:
    """The conftest's daemon, advertised to every worker spawned from now on."""
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(daemon.socket))
    return daemon


def _start(namespace: str, profile: str, count: int, *args: str) -> list:
    return [spawn(namespace, profile, "--lease", LEASE, *args) for _ in range(count)]


def _kill_all(procs: list) -> float:
    """SIGKILL every worker; returns the moment the last signal went out."""
    for p in procs:
        p.send_signal(signal.SIGKILL)
    return time.monotonic()


def _journal_bytes(ns: str, lock_dir: Path) -> int:
    """What ``ftd ls`` must report: the segments the journal names, plus the coordinator segment."""
    journal = read_journal(lock_dir / f"{ns}.journal")
    sizes = [os.stat(f"/dev/shm{i.name}").st_size for i in journal.resources() if i.kind == "segment"]
    assert sizes, f"the journal of {ns} names no segment: {journal.intents}"
    return sum(sizes) + coordinator_segment_size()


def test_ls_shows_three_session_workers_and_their_bytes(ftd, namespace, profile, lock_dir):
    ns = manager_namespace(namespace, MANAGER)
    procs = _start(namespace, profile, 3, "--hold")
    try:
        results = [read_result(p) for p in procs]
        assert sorted(r["role"] for r in results) == ["creator", "follower", "follower"]
        _, rows, _ = ftd.cli("ls")
        (row,) = [r for r in rows if r["namespace"] == ns]
        assert row["manager"] == MANAGER and row["state"] == "READY" and row["generation"] == results[0]["generation"]
        assert row["participants"] == 3
        expected_bytes = _journal_bytes(ns, lock_dir)
        assert row["bytes"] == expected_bytes and expected_bytes > coordinator_segment_size()
        assert ftd.cli("status")[1]["registered"] == 3  # every session registered its participant
    finally:
        codes = finish_all(procs)
    assert codes == [0, 0, 0]
    assert shm_names(ns) == []
    assert wait_until(lambda: ftd.cli("ls")[1] == [], 3.0)


def test_sigkill_of_every_session_worker_is_reclaimed_within_2s(ftd, namespace, profile, lock_dir):
    ns = manager_namespace(namespace, MANAGER)
    procs = _start(namespace, profile, 3, "--hold")
    try:
        for p in procs:
            assert "error" not in read_result(p)
        assert ftd.cli("status")[1]["registered"] == 3
        assert shm_names(ns)
        killed = _kill_all(procs)
        assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)
        elapsed = time.monotonic() - killed
        assert elapsed < 2.0, f"reclaimed after {elapsed:.2f} s"
        assert wait_until(lambda: not any(lock_dir.iterdir()), 1.0), list(lock_dir.iterdir())
    finally:
        for p in procs:
            finish(p)
    # The reclaim is logged just after its cleanup removed the names the test waited for: wait for the line too.
    assert wait_until(lambda: "(death)" in ftd.read_log(), 2.0), ftd.read_log()


def test_follower_of_a_killed_creator_raises_within_2s(ftd, namespace, profile, tmp_path):
    ns = manager_namespace(namespace, MANAGER)
    marker = tmp_path / "creator-started"
    (creator,) = _start(namespace, profile, 1, "--mode", "hang", "--marker", str(marker))
    procs = [creator]
    try:
        wait_for_file(marker)  # the creator registered and is inside its (hanging) factory
        (follower,) = _start(namespace, profile, 1, "--log")
        procs.append(follower)
        wait_for_joined(follower)
        killed = _kill_all([creator])
        result = read_result(follower, timeout=10.0)
        elapsed = time.monotonic() - killed
        assert result.get("error") == "ShmCreatorDiedError", result
        assert elapsed < 2.0, f"the follower noticed the dead creator after {elapsed:.2f} s (lease {LEASE} s)"
    finally:
        for p in procs:
            finish(p)
    assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)  # no cleanup_namespace needed


def test_hold_keeps_a_session_generation_warm_across_a_full_restart(ftd, namespace, profile):
    ns = manager_namespace(namespace, MANAGER)
    first = _start(namespace, profile, 2, "--hold")
    try:
        before = [read_result(p) for p in first]
        assert sorted(r["role"] for r in before) == ["creator", "follower"]
        generation = before[0]["generation"]
        _, reply, _ = ftd.cli("hold", namespace, "--manager", MANAGER)
        assert reply["message"] == f"holding {ns} generation {generation}"
        coordinator_inode = os.stat(f"/dev/shm/{ns}.c").st_ino
        _kill_all(first)  # every worker of the job is gone...
    finally:
        for p in first:
            finish(p)
    # ...the daemon ended their leases at once, but its hold keeps the generation (and the weights).
    assert wait_until(lambda: [(r["participants"], r["state"]) for r in ftd.cli("ls")[1]] == [(1, "READY")], 2.0)
    assert shm_names(ns)
    (restarted,) = _start(namespace, profile, 1, "--hold")
    try:
        after = read_result(restarted)
        # A follower of the SAME generation: only creators call the creator factory (the checkpoint load).
        assert after["role"] == "follower" and after["generation"] == generation, after
        assert os.stat(f"/dev/shm/{ns}.c").st_ino == coordinator_inode  # the very segments published before
        assert after["out"] == before[0]["out"] == before[1]["out"]
        assert matches(output_of(after), expected_output())
        _, reply, _ = ftd.cli("release", namespace, "--manager", MANAGER)
        assert "1 participant(s) remain" in reply["message"], reply
    finally:
        assert finish(restarted) == 0
    assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)
    assert wait_until(lambda: ftd.cli("ls")[1] == [], 2.0)


def test_drain_refuses_new_session_workers_and_the_generation_goes_with_its_last_participant(
        ftd, namespace, profile):
    ns = manager_namespace(namespace, MANAGER)
    (running,) = _start(namespace, profile, 1, "--hold")
    try:
        assert read_result(running)["role"] == "creator"
        ftd.cli("drain", namespace, "--manager", MANAGER)
        (late,) = _start(namespace, profile, 1)
        refused = read_result(late)
        finish(late)
        assert refused["error"] == "NamespaceDrainingError", refused
        assert "ftd drain" in refused["message"] and "--undo" in refused["message"]
    finally:
        assert finish(running) == 0
    # the refused worker left at once and the running one closed: nothing of the namespace remains
    assert wait_until(lambda: shm_names(ns) == [], 2.0), shm_names(ns)
    ftd.cli("drain", namespace, "--manager", MANAGER, "--undo")


def _registration_times() -> list[float]:
    """Seconds taken by five registrations with the daemon socket of ``FT_DAEMON_SOCKET`` (none answers)."""
    identity = ParticipantIdentity.current()
    times = []
    for slot in range(5):
        t0 = time.perf_counter()
        registered = register_participant("ftnone-0123456789abcdef", slot, identity, "/nonexistent", base="b",
                                          manager="m")
        times.append(time.perf_counter() - t0)
        assert registered is False
    return times


def test_session_workers_without_a_daemon_are_unchanged(namespace, profile, tmp_path, monkeypatch):
    """FT_DAEMON_SOCKET points at nothing (conftest): sessions share as before, and registration is free."""
    ns = manager_namespace(namespace, MANAGER)
    assert not Path(os.environ["FT_DAEMON_SOCKET"]).exists()
    procs = _start(namespace, profile, 2, "--hold")
    try:
        results = [read_result(p) for p in procs]
        assert sorted(r["role"] for r in results) == ["creator", "follower"]
        assert len({r["generation"] for r in results}) == 1
        assert all(matches(output_of(r), expected_output()) for r in results)
    finally:
        codes = finish_all(procs)
    assert codes == [0, 0] and shm_names(ns) == []
    # What each participant pays when no daemon runs: a missing socket, then a stale one (file, no listener).
    missing = _registration_times()
    stale_path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(stale_path))
    stale.close()  # the file stays, nothing listens: what a SIGKILLed daemon leaves behind
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(stale_path))
    refused = _registration_times()
    # A failed connect costs microseconds; the bounds leave room for a loaded 2-core CI host (one descheduled
    # registration must not fail the test) while still catching a retry loop or a connect timeout.
    assert statistics.median(missing) < 0.02 and max(missing) < 0.5, missing
    assert statistics.median(refused) < 0.02 and max(refused) < 0.5, refused
