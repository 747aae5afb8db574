"""The operator CLI speaks the user's names: base namespace and manager (default ``default``) or the
per-manager ID that ``ftd ls`` shows, exits non-zero when a name matches nothing, refuses to serve a lock
directory it can never watch, and offers the forced cleanup."""

from __future__ import annotations

import os
import signal
import struct

from flextensor.shm.names import manager_namespace

from tests.daemon.helpers import Daemon, run_cli, wait_until
from tests.leftovers import shm_names


def test_ls_shows_base_and_manager_and_every_command_takes_either_form(socket_path, lock_dir, workers, namespace):
    daemon = Daemon(socket_path, lock_dir, reap_interval=60).start()  # only the cleanup below reclaims
    try:
        ns = manager_namespace(namespace, "default")
        w = workers(namespace, "default", "--lease", "30", "--no-register", socket=socket_path)
        w.wait_event("published")
        _, rows, _ = daemon.cli("ls")
        assert [(r["base"], r["manager"], r["namespace"]) for r in rows] == [(namespace, "default", ns)]
        _, human, _ = run_cli("ls", "--socket", str(socket_path))
        header, line = human.splitlines()[:2]
        assert header.split()[:3] == ["NAMESPACE", "MANAGER", "ID"] and line.split()[:3] == [namespace, "default", ns]
        # hold with the base name and the default manager, release with the ID from ls
        assert daemon.cli("hold", namespace)[1]["ok"] is True
        assert daemon.cli("status")[1]["held"] == [ns]
        assert daemon.cli("release", ns)[1]["ok"] is True
        assert daemon.cli("status")[1]["held"] == []
        w.close()
        assert wait_until(lambda: shm_names(ns) == [], 3.0)
    finally:
        daemon.stop()


def test_a_name_that_matches_nothing_exits_non_zero(socket_path, lock_dir, workers, namespace):
    w = workers(namespace, "m", "--lease", "30", "--no-register")
    w.wait_event("published")
    ns = manager_namespace(namespace, "m")
    hashed_of_hashed = manager_namespace(ns, "m")
    for args in ([namespace], [namespace, "--manager", "other"], [ns, "--manager", "m"]):  # wrong manager/form
        code, _, err = run_cli("cleanup", *args, "--local", expect=1)
        assert code == 1 and "matches nothing" in err, (args, err)
        assert shm_names(ns)  # nothing was removed
    assert hashed_of_hashed in run_cli("cleanup", ns, "--manager", "m", "--local", expect=1)[2]
    w.signal(signal.SIGKILL)
    w.kill()
    _, reports, _ = run_cli("cleanup", ns, "--local", "--json")  # the ID form, as `ftd ls` shows it
    assert reports[0]["namespace"] == ns and reports[0]["generation"] == 1
    assert shm_names(ns) == [] and list(lock_dir.iterdir()) == []


def test_forced_cleanup_from_the_cli_says_what_it_removed(lock_dir, workers, namespace):
    w = workers(namespace, "m", "--lease", "30", "--no-register")
    w.wait_event("published")
    ns = manager_namespace(namespace, "m")
    w.signal(signal.SIGKILL)
    w.kill()
    with open(f"/dev/shm/{ns}.c", "r+b") as f:  # a header state no version writes
        f.seek(32)
        f.write(struct.pack("=I", 7))
    code, _, err = run_cli("cleanup", namespace, "--manager", "m", "--local", expect=1)
    assert code == 1 and "header state 7" in err and f"ftd cleanup {ns} --force" in err
    code, out, _ = run_cli("cleanup", ns, "--force")
    assert code == 0, out
    assert f"removed /dev/shm/{ns}.c" in out and f"removed /dev/shm/{ns}.g1.w" in out
    assert shm_names(ns) == [] and list(lock_dir.iterdir()) == []


def test_serve_refuses_a_lock_dir_it_could_never_watch(socket_path, tmp_path):
    bad = tmp_path / "not-a-lock-dir"
    bad.mkdir(mode=0o777)
    os.chmod(bad, 0o777)
    for path in (bad, tmp_path / "missing-parent" / f"flextensor-{os.getuid()}"):
        code, _, err = run_cli("serve", "--socket", str(socket_path), "--lock-dir", str(path), expect=1)
        assert code == 1 and str(path) in err, err
    assert not socket_path.exists()


def test_help_shows_the_default_socket_and_manager(monkeypatch):
    from flextensor.shm.ftd_client import default_socket_path

    code, out, _ = run_cli("hold", "--help")
    flat = " ".join(out.split())
    assert code == 0 and default_socket_path() in flat and "(default: default)" in flat
