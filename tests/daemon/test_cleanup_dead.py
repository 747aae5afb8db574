"""``ftd cleanup --dead`` on a host without the daemon, and ``ftd hold`` meeting every cleanup path: a held
namespace is refused at once with the hold named, never swept, and a restarted job attaches to it."""

from __future__ import annotations

import time

import pytest

import flextensor as ft
from flextensor.shm.errors import ShmNamespaceHeldError
from flextensor.shm.names import manager_namespace
from tests.daemon.helpers import run_cli, wait_until
from tests.leftovers import shm_names

LEASE = "30"  # nothing here may come from a lease running out


def _ours(skipped: list[dict], namespace: str) -> list[tuple[str, str]]:
    """(namespace, reason) of the skipped entries of this test (a shared host's /dev/shm holds others')."""
    return [(s["namespace"], s["reason"]) for s in skipped if namespace in s["namespace"]]


def test_cleanup_dead_reclaims_the_dead_job_and_the_live_one_keeps_serving(lock_dir, workers, namespace):
    dead_ns, live_ns = manager_namespace(namespace, "dead"), manager_namespace(namespace, "live")
    live = workers(namespace, "live", "--lease", LEASE, "--no-register")
    published = live.wait_event("published")
    dead = workers(namespace, "dead", "--lease", LEASE, "--no-register", "--size", str(4 << 20))
    dead.wait_event("published")
    dead.kill()
    live_names = shm_names(live_ns)

    code, data, err = run_cli("cleanup", "--dead", "--json")

    assert code == 0, err
    assert data["lock_dir"] == str(lock_dir)
    (reclaimed,) = data["reclaimed"]
    assert (reclaimed["namespace"], reclaimed["base"], reclaimed["manager"], reclaimed["generation"]) == (
        dead_ns, namespace, "dead", 1)
    assert f"/{dead_ns}.g1.w" in reclaimed["removed"] and reclaimed["shm_bytes"] >= 4 << 20
    assert _ours(data["skipped"], namespace) == [(live_ns, "live")]
    assert shm_names(dead_ns) == [] and not (lock_dir / f"{dead_ns}.journal").exists()
    assert shm_names(live_ns) == live_names
    follower = workers(namespace, "live", "--lease", LEASE, "--no-register")
    assert follower.wait_event("joined")["creator"] is False
    assert follower.wait_event("ready")["checksum"] == published["checksum"]  # the live job still serves

    code, text, _ = run_cli("cleanup", "--dead")  # the same, for people: nothing more to do
    assert code == 0 and text.strip() == f"{lock_dir}: 0 dead namespace(s) reclaimed (0 B); left alone: 1 live"
    follower.close()
    live.close()
    assert shm_names(live_ns) == []


def test_cleanup_dead_takes_no_names_and_a_named_cleanup_needs_one(namespace):
    for argv in (["--dead", namespace], ["--dead", "--manager", "m"], ["--dead", "--force"],
                 ["--dead", "--timeout", "5"], []):
        code, _, err = run_cli("cleanup", *argv, expect=2)
        assert "NAMESPACE" in err, (argv, err)


def test_a_held_namespace_is_refused_at_once_never_swept_and_rejoined(daemon, lock_dir, workers, namespace):
    ns = manager_namespace(namespace, "m")
    first = workers(namespace, "m", "--lease", LEASE, socket=daemon.socket)
    published = first.wait_event("published")
    daemon.cli("hold", namespace, "--manager", "m")
    first.kill()
    names = shm_names(ns)
    assert names

    start = time.monotonic()
    for extra in ([], ["--local"]):
        code, data, _ = daemon.cli("cleanup", namespace, "--manager", "m", "--timeout", "30", *extra, expect=1)
        assert data["error"] == "held", (extra, data)
        assert "held by ftd" in data["message"] and f"`ftd release {namespace} --manager m`" in data["message"]
    with pytest.raises(ShmNamespaceHeldError, match="held by ftd") as held:
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["m"], timeout=30)
    assert held.value.holder_pids == (daemon.proc.pid,)  # the daemon's lease, named as the hold it is
    assert time.monotonic() - start < 20  # three refusals, none of them waited for the 30 s it was allowed
    code, data, _ = run_cli("cleanup", "--dead", "--json")
    assert code == 0 and data["reclaimed"] == [] and _ours(data["skipped"], namespace) == [(ns, "held")]
    assert shm_names(ns) == names

    again = workers(namespace, "m", "--lease", LEASE, socket=daemon.socket)  # the job restarted: it attaches
    assert again.wait_event("joined")["creator"] is False
    assert again.wait_event("ready")["checksum"] == published["checksum"]
    again.close()
    assert shm_names(ns) == names  # the hold keeps it warm
    daemon.cli("release", namespace, "--manager", "m")
    assert wait_until(lambda: shm_names(ns) == [], 5.0), shm_names(ns)
