"""Another user cannot stop ``ftd`` or misdirect it: a lock directory name taken in a shared sticky TMPDIR, a
drain of the owner's base name, a foreign coordinator on the owner's namespace. The other user is uid 65534,
played by children of this (root) test; the non-root owner is uid 65533."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from flextensor.shm.names import manager_namespace
from tests.daemon.helpers import Daemon, run_cli, wait_until
from tests.helpers.other_user import run_as_user, start_as_user
from tests.leftovers import shm_names

SQUATTER, OWNER = 65534, 65533

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to play other uids")


def test_lock_directory_name_taken_by_another_uid_stops_neither_the_job_nor_ftd(shared_dir, workers, namespace):
    tmp = shared_dir / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)  # the workers' TMPDIR is shared and sticky, as deploy/ sets it up
    taken = tmp / "flextensor-0"
    squat = run_as_user(SQUATTER, f"os.mkdir({str(taken)!r}, 0o700)\n", tmpdir=str(tmp))
    assert squat.returncode == 0, squat.stderr
    sock = shared_dir / "run" / "ftd.sock"
    daemon = Daemon(sock, taken).start()  # configured as deploy/ftd.yaml does: <TMPDIR>/flextensor-<uid>
    fallback = tmp / "flextensor-0.1"
    ns = manager_namespace(namespace, "m")
    try:
        w = workers(namespace, "m", "--lease", "30", socket=sock, env=dict(os.environ, TMPDIR=str(tmp)))
        assert w.wait_event("joined")["registered"] is True
        w.wait_event("published")
        assert (fallback / f"{ns}.journal").exists() and os.stat(fallback).st_uid == 0
        _, rows, _ = daemon.cli("ls")
        assert [(r["namespace"], r["state"]) for r in rows] == [(ns, "READY")]
        w.signal(signal.SIGKILL)
        assert wait_until(lambda: shm_names(ns) == [], 5.0), shm_names(ns)  # ftd reclaims in the fallback
        assert sorted(os.listdir(fallback)) in ([], [f"{ns}.lock"])
        assert f"lock directory {taken} belongs to uid {SQUATTER}" in w.stderr()
        assert f"lock directory {taken} belongs to uid {SQUATTER}" in daemon.read_log()
        assert f"watching {fallback} instead" in daemon.read_log()
        assert os.stat(taken).st_uid == SQUATTER  # the other user's directory is theirs: untouched
        w.kill()
    finally:
        daemon.stop()
        shutil.rmtree(fallback, ignore_errors=True)
        shutil.rmtree(taken, ignore_errors=True)


def _cli_as(uid: int, socket_path: Path, *args: str) -> tuple[int, dict]:
    """The ftd CLI as ``uid`` (tests/helpers/other_user.py: everything imported, then the uid dropped before it
    connects, so the daemon sees that uid)."""
    argv = list(args) + ["--socket", str(socket_path), "--json"]
    run = run_as_user(uid, f"sys.exit(cli.main({argv!r}))\n", tmpdir="/tmp", timeout=30,
                      extra_modules=["zmq", "flextensor.daemon.cli", "flextensor.daemon.config",
                                     "flextensor.daemon.lockdirs"],
                      prepare="import flextensor.daemon.cli as cli\ncli.build_parser()\n")
    return run.returncode, json.loads(run.stdout) if run.stdout.strip() else {"stderr": run.stderr}


@pytest.mark.parametrize("scope", ["base", "manager"])
def test_another_users_drain_of_the_same_name_never_blocks_the_owners_drain_or_undo(shared_dir, lock_dir, namespace,
                                                                                    scope):
    sock = shared_dir / "run" / "ftd.sock"
    daemon = Daemon(sock, lock_dir).start()
    os.chmod(sock.parent, 0o711)
    os.chmod(sock, 0o666)  # both other uids may connect (a socket group holds one of them only)
    name = [namespace] if scope == "base" else [namespace, "--manager", "m"]
    try:
        code, reply = _cli_as(SQUATTER, sock, "drain", *name)  # nobody has used the name yet
        assert code == 0 and reply["ok"] is True, reply
        code, reply = _cli_as(OWNER, sock, "drain", *name)
        assert code == 0 and reply["ok"] is True, reply  # before: "forbidden: ... was drained by uid 65534"
        code, reply = _cli_as(OWNER, sock, "drain", *name, "--undo")
        assert code == 0 and reply["ok"] is True, reply
        # The owner undid its own drain only; the other user's stays until that user (or root) undoes it.
        draining = daemon.cli("status")[1]["draining"]
        assert draining == ([f"base:{namespace}"] if scope == "base" else [manager_namespace(namespace, "m")])
        assert _cli_as(SQUATTER, sock, "drain", *name, "--undo")[0] == 0
        assert daemon.cli("status")[1]["draining"] == []
    finally:
        daemon.stop()


def test_ftd_cleanup_force_never_reports_success_while_another_users_job_holds_the_namespace(shared_dir, namespace):
    ns = manager_namespace(namespace, "m")
    tmp = shared_dir / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    job = start_as_user(SQUATTER, f"""
from flextensor.shm.coordinator import ShmCoordinator
c = ShmCoordinator({ns!r}, lease_seconds=5, timeout=5)
c.notify_ready()
print("ready", flush=True)
sys.stdin.read()
c.close()
""", tmpdir=str(tmp))
    try:
        assert job.stdout.readline().strip() == "ready", job.stderr.read()
        code, reply, err = run_cli("cleanup", namespace, "--manager", "m", "--force", "--json", expect=None)
        assert code == 1, (reply, err)
        message = json.dumps(reply) + err
        assert f"/dev/shm/{ns}.c belongs to uid {SQUATTER}" in message and "`rm /dev/shm/" in message
        assert os.stat(f"/dev/shm/{ns}.c").st_uid == SQUATTER
    finally:
        job.stdin.close()  # the other user's job leaves cleanly: nothing of it remains
        job.wait(timeout=30)
    assert shm_names(ns) == []


def test_with_ftd_a_restart_skips_generation_names_another_user_took_after_the_reclaim(daemon, workers, namespace):
    """ftd reclaims a dead job at once, so its restart would start again at generation 1: another user who took
    ``<ns>.g1.*`` meanwhile must not stop it either."""
    ns = manager_namespace(namespace, "m")
    first = workers(namespace, "m", "--lease", "30", socket=daemon.socket)
    assert first.wait_event("joined")["generation"] == 1
    first.wait_event("published")
    first.signal(signal.SIGKILL)
    assert wait_until(lambda: shm_names(ns) == [], 5.0), shm_names(ns)  # reclaimed by ftd
    squatted = [f"/{ns}.g1.{kind}" for kind in ("h", "sd", "sm", "p", "b0")]
    squat = run_as_user(SQUATTER, "from flextensor.shm.segment import SharedSegment\n"
                                  f"for name in {squatted!r}:\n    SharedSegment.create(name, 4096).close()\n",
                        tmpdir="/tmp")
    assert squat.returncode == 0, squat.stderr
    try:
        again = workers(namespace, "m", "--lease", "30", socket=daemon.socket)
        assert again.wait_event("joined")["generation"] == 2
        again.wait_event("published")
        assert f"generation 1 skipped, /dev/shm/{ns}.g1.b0 belongs to uid {SQUATTER}" in again.stderr()
        assert again.close() == 0
        assert wait_until(lambda: shm_names(ns) == sorted(n[1:] for n in squatted), 5.0), shm_names(ns)
        first.kill()
    finally:
        from flextensor.shm.segment import SharedSegment

        for name in squatted:
            SharedSegment.unlink_name(name)
