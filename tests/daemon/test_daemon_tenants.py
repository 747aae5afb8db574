"""Other users on the same host: their drains, journals and queued requests never change how another user's
namespaces are handled. The foreign user is uid 65534, played by child processes of this (root) test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from flextensor.shm.names import manager_namespace

from tests.daemon.helpers import Daemon, wait_until
from tests.leftovers import shm_names
from tests.daemon.test_daemon_security import NOBODY, _cli_as_nobody

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to play another uid")


def _foreign_lock_dir(shared_dir: Path) -> Path:
    tmp = shared_dir / "tmp"
    tmp.mkdir(mode=0o755)
    directory = tmp / f"flextensor-{NOBODY}"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    return directory


def test_drain_of_a_name_another_user_has_not_used_yet_does_not_apply_to_that_user(shared_dir, lock_dir, workers,
                                                                                   namespace):
    sock = shared_dir / "run" / "ftd.sock"
    daemon = Daemon(sock, lock_dir, extra=["--socket-group", str(NOBODY)]).start()
    try:
        squat = _cli_as_nobody(sock, "drain", namespace, "--manager", "m")  # nobody has used it yet
        assert squat.returncode == 0, (squat.stdout, squat.stderr)
        w = workers(namespace, "m", "--lease", "30", socket=sock)  # root's job starts afterwards
        joined = w.wait_event("joined")
        assert joined["registered"] is True, joined  # not refused as "draining"
        w.wait_event("published")
        _, rows, _ = daemon.cli("ls")
        assert [r["state"] for r in rows] == ["READY"]
        # The owner's own drain still works, and only the owner (or root) can undo it.
        assert daemon.cli("drain", namespace, "--manager", "m")[1]["ok"] is True
        assert [r["state"] for r in daemon.cli("ls")[1]] == ["DRAINING"]
        undo = _cli_as_nobody(sock, "drain", namespace, "--manager", "m", "--undo")
        assert undo.returncode == 1 and json.loads(undo.stdout)["error"] == "forbidden"
        w.close()
        assert wait_until(lambda: shm_names(manager_namespace(namespace, "m")) == [], 3.0)
    finally:
        daemon.stop()


def test_journals_planted_in_another_users_lock_directory_are_ignored(shared_dir, lock_dir, workers, namespace):
    foreign = _foreign_lock_dir(shared_dir)
    ns = manager_namespace(namespace, "m")
    sock = shared_dir / "run" / "ftd.sock"
    w = workers(namespace, "m", "--lease", "30", "--no-register")  # root's job, unknown to the daemon
    w.wait_event("published")
    # A well-formed copy of root's journal, planted by uid 65534 in its own lock directory, scanned first...
    planted = foreign / f"{ns}.journal"
    shutil.copyfile(lock_dir / f"{ns}.journal", planted)
    os.chown(planted, NOBODY, NOBODY)
    # ...and a 1 GiB sparse "journal" that must never be read into memory.
    sparse = foreign / f"{manager_namespace(namespace, 'sparse')}.journal"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)
    os.chown(sparse, NOBODY, NOBODY)
    daemon = Daemon(sock, foreign, extra=["--lock-dir", str(lock_dir)]).start()
    try:
        rss_before = _rss_kib(daemon.proc.pid)
        _, rows, _ = daemon.cli("ls")
        assert [(r["namespace"], r["base"], r["manager"], r["state"]) for r in rows] == [(ns, namespace, "m",
                                                                                          "READY")]
        t0 = time.monotonic()
        w.signal(signal.SIGKILL)
        assert wait_until(lambda: shm_names(ns) == [], 3.0), shm_names(ns)  # reclaimed in root's lock directory
        assert time.monotonic() - t0 < 3.0
        assert not (lock_dir / f"{ns}.journal").exists()
        assert planted.exists() and sparse.exists()  # the other user's files are theirs: not touched
        log = daemon.read_log()
        assert f"ignoring journal {planted}" in log and "belongs to uid 0" in log
        assert f"ignoring journal {sparse}" in log and "more than a journal ever does" in log
        assert _rss_kib(daemon.proc.pid) - rss_before < 100 * 1024
        w.kill()
    finally:
        daemon.stop()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime (fields 14, 15)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_one_user_cannot_queue_unbounded_cleanups(socket_path, lock_dir, workers, namespace):
    from flextensor.daemon.handlers import MAX_PENDING_CLEANUPS_PER_UID
    from flextensor.shm import ftd_protocol as proto
    import zmq

    daemon = Daemon(socket_path, lock_dir, reap_interval=60).start()
    try:
        w = workers(namespace, "m", "--lease", "30", socket=socket_path)
        w.wait_event("published")  # a live participant: every cleanup of it has to wait
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{socket_path}")
        ns = manager_namespace(namespace, "m")
        request = proto.encode(proto.CleanupRequest(namespaces=[ns], lock_dir=str(lock_dir), timeout=30.0,
                                                    base=namespace, managers=["m"]))
        for _ in range(MAX_PENDING_CLEANUPS_PER_UID + 5):
            s.send(request)
        refused = []
        while len(refused) < 5 and s.poll(10_000):  # the five over the limit are refused at once...
            refused.append(proto.decode_reply(s.recv()))
        while s.poll(300):  # ...and nothing else answers while the accepted ones wait
            refused.append(proto.decode_reply(s.recv()))
        assert len(refused) == 5 and all(r.code == "busy" and "cleanups waiting" in r.message for r in refused)
        assert daemon.answers()
        # The accepted ones wait with back-off: they cost the daemon little CPU while the lease stays live.
        before = _cpu_s(daemon.proc.pid)
        time.sleep(1.0)
        assert _cpu_s(daemon.proc.pid) - before < 0.125  # an eighth of a core at most
        s.close(0)
        w.close()
    finally:
        daemon.stop()
    assert shm_names(manager_namespace(namespace, "m")) == []

