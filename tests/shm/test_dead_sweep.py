"""Dead namespaces found without their names (``flextensor.shm.dead_sweep``): a job whose every worker was
SIGKILLed and never restarted is reclaimed; a live one beside it keeps serving; another user's namespace and an
unreadable lock directory are reported and never touched (played with real uids: these tests run as root).
Leases are 30 s: nothing here may pass by waiting for one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import flextensor as ft
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.dead_sweep import sweep_before_join, sweep_dead_namespaces
from flextensor.shm.names import lock_directory, manager_namespace
from tests.helpers.other_user import run_as_user
from tests.leftovers import shm_names

LONG = 30.0
NOBODY = 65534


def _publish(child, ns: str) -> None:
    assert child.ok("open", ns=ns, lease=LONG)["is_creator"]
    child.ok("segment", kind="sd", size=1 << 16)
    child.ok("write_blob", kind="sm", data=b"manifest".hex())
    child.ok("lock", kind="b0", backend="semaphore")
    child.ok("lock", kind="b0", backend="file")
    child.ok("ready")


def _lock_files(ns: str) -> list[str]:
    return sorted(p.name for p in lock_directory().iterdir() if p.name.startswith(ns))


def test_dead_job_is_reclaimed_and_the_live_one_beside_it_keeps_serving(namespace, children):
    dead, live = manager_namespace(namespace, "dead"), manager_namespace(namespace, "live")
    crashed, serving, late = children(3)
    _publish(crashed, dead)
    _publish(serving, live)
    crashed.kill()  # every worker of that job SIGKILLed, nobody restarts it
    live_names = shm_names(live)
    assert len(shm_names(dead)) == 4 and len(live_names) == 4  # .c, .g1.sd, .g1.sm and sem.*.g1.lb0

    reports = ft.cleanup_dead_namespaces()

    assert [(r.namespace, r.generation) for r in reports] == [(dead, 1)]
    assert f"/{dead}.g1.sd" in reports[0].removed and f"/{dead}.c" in reports[0].removed
    assert shm_names(dead) == [] and _lock_files(dead) == []
    assert shm_names(live) == live_names and {f"{live}.journal", f"{live}.lock"} <= set(_lock_files(live))
    # The live job is untouched and still serving: a new worker attaches to what it published.
    assert late.ok("open", ns=live, lease=LONG)["is_creator"] is False
    late.ok("wait", timeout=5)
    assert bytes.fromhex(late.ok("read_blob", kind="sm")["data"]) == b"manifest"
    late.ok("close", timeout=5)
    serving.ok("close", timeout=5)
    assert shm_names(live) == [] and _lock_files(live) == []
    assert ft.cleanup_dead_namespaces() == []  # nothing left to do, and nothing left behind by looking


def test_sweep_reports_live_namespaces_and_what_it_freed(namespace, children):
    dead, live = manager_namespace(namespace, "dead"), manager_namespace(namespace, "live")
    crashed, serving = children(2)
    _publish(crashed, dead)
    _publish(serving, live)
    crashed.kill()
    sweep = sweep_dead_namespaces()
    assert sweep.complete and sweep.lock_dir == str(lock_directory())
    (reclaimed,) = sweep.reclaimed
    assert reclaimed.report.namespace == dead
    assert reclaimed.shm_bytes >= (1 << 16) + 4096  # the 64 KiB segment's pages and the coordinator's, at least
    assert [(s.namespace, s.reason) for s in sweep.skipped] == [(live, "live")]
    assert str(serving.pid) in sweep.skipped[0].detail
    serving.ok("close", timeout=5)


def test_a_joiner_sweeps_every_dead_namespace_but_its_own(namespace, children):
    """Its own is left to its election, which reclaims it and counts the generations on."""
    mine, other = manager_namespace(namespace, "mine"), manager_namespace(namespace, "other")
    first, second = children(2)
    _publish(first, mine)
    _publish(second, other)
    first.kill()
    second.kill()
    sweep = sweep_before_join(mine)
    assert sweep is not None and [r.report.namespace for r in sweep.reclaimed] == [other]
    assert shm_names(other) == [] and len(shm_names(mine)) == 4
    with ShmCoordinator(mine, lease_seconds=LONG) as coordinator:
        assert coordinator.is_creator and coordinator.generation == 2
    assert shm_names(mine) == [] and _lock_files(mine) == []


def test_a_spent_budget_leaves_the_rest_for_the_next_sweep(namespace, children):
    names = [manager_namespace(namespace, m) for m in ("a", "b")]
    procs = children(2)
    for child, ns in zip(procs, names):
        _publish(child, ns)
        child.kill()
    first = sweep_dead_namespaces(budget_s=0.0)  # the first namespace is always examined
    assert not first.complete and len(first.reclaimed) == 1
    second = sweep_dead_namespaces(budget_s=0.0)
    assert len(second.reclaimed) == 1 and second.complete
    assert sorted(r.report.namespace for r in first.reclaimed + second.reclaimed) == sorted(names)
    assert all(shm_names(ns) == [] for ns in names)


def test_a_namespace_whose_lock_is_taken_is_left_for_the_next_sweep(namespace, children):
    """An election (or a cleanup) holding the coordinator lock right now wins: the sweep does not wait for it."""
    ns = manager_namespace(namespace, "busy")
    crashed, electing = children(2)
    _publish(crashed, ns)
    crashed.kill()
    electing.ok("hold_lock", ns=ns)
    sweep = sweep_dead_namespaces()
    assert sweep.reclaimed == [] and [(s.namespace, s.reason) for s in sweep.skipped] == [(ns, "busy")]
    assert len(shm_names(ns)) == 4
    electing.ok("release_lock")
    assert [r.namespace for r in ft.cleanup_dead_namespaces()] == [ns] and shm_names(ns) == []


def test_interrupted_creation_journal_without_coordinator_is_reclaimed(namespace):
    ns = manager_namespace(namespace, "aborted")
    journal = lock_directory() / f"{ns}.journal"
    journal.write_bytes(b"")  # what an election killed between the journal and the coordinator leaves
    (report,) = ft.cleanup_dead_namespaces()
    assert (report.namespace, report.generation) == (ns, None) and str(journal) in report.removed
    assert not journal.exists() and _lock_files(ns) == []


# ------------------------------------------------------------------------------------------------ other users
_CRASH_AS_NOBODY = """
from flextensor.shm.coordinator import ShmCoordinator
c = ShmCoordinator({ns!r}, lease_seconds=30)
c.memory_owner.create_segment("sd", 1 << 16).close()
c.notify_ready()
os._exit(0)  # gone without closing: a crash, as far as the namespace can tell
"""

_SWEEP_AS_NOBODY = """
import msgspec
from flextensor.shm.dead_sweep import sweep_dead_namespaces
print(json.dumps(msgspec.to_builtins(sweep_dead_namespaces())))
"""


def _as_nobody(code: str, tmpdir: Path) -> dict | None:
    run = run_as_user(NOBODY, code, tmpdir=str(tmpdir), extra_modules=["msgspec"])
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout) if run.stdout.strip() else None


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
def test_another_users_dead_namespace_is_never_swept(namespace, shared_tmp):
    ns = manager_namespace(namespace, "nobody")
    _as_nobody(_CRASH_AS_NOBODY.format(ns=ns), shared_tmp)
    theirs = shared_tmp / f"flextensor-{NOBODY}"
    names = shm_names(ns)
    assert names and all(os.stat(f"/dev/shm/{n}").st_uid == NOBODY for n in names)
    try:
        # Root's own sweep does not see it; pointed at that user's lock directory, it refuses and says why; a
        # copy of that user's journal in root's own lock directory does not make root remove the user's segments.
        assert ft.cleanup_dead_namespaces() == []
        refused = sweep_dead_namespaces(theirs)
        assert refused.reclaimed == [] and [s.reason for s in refused.skipped] == ["other-user"]
        assert f"belongs to uid {NOBODY}" in refused.skipped[0].detail
        planted = lock_directory() / f"{ns}.journal"
        shutil.copyfile(theirs / f"{ns}.journal", planted)
        sweep = sweep_dead_namespaces()
        assert sweep.reclaimed == [] and [(s.namespace, s.reason) for s in sweep.skipped] == [(ns, "other-user")]
        planted.unlink()
        assert shm_names(ns) == names and (theirs / f"{ns}.journal").exists()
        # The owner's own sweep reclaims it.
        own = _as_nobody(_SWEEP_AS_NOBODY, shared_tmp)
        assert [r["report"]["namespace"] for r in own["reclaimed"]] == [ns]
        assert shm_names(ns) == [] and sorted(os.listdir(theirs)) == []
    finally:
        for name in shm_names(ns):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
def test_an_unreadable_lock_directory_is_reported_and_nothing_in_it_touched(namespace, shared_tmp):
    ns = manager_namespace(namespace, "hidden")
    _as_nobody(_CRASH_AS_NOBODY.format(ns=ns), shared_tmp)
    theirs = shared_tmp / f"flextensor-{NOBODY}"
    names = shm_names(ns)
    try:
        os.chmod(theirs, 0o300)  # its owner may enter and write, not list
        sweep = _as_nobody(_SWEEP_AS_NOBODY, shared_tmp)
        assert sweep["reclaimed"] == []
        assert [(s["namespace"], s["reason"]) for s in sweep["skipped"]] == [(str(theirs), "unreadable")]
        assert "cannot list lock directory" in sweep["skipped"][0]["detail"]
        assert shm_names(ns) == names
        os.chmod(theirs, 0o700)
        assert [r["report"]["namespace"] for r in _as_nobody(_SWEEP_AS_NOBODY, shared_tmp)["reclaimed"]] == [ns]
        assert shm_names(ns) == []
    finally:
        for name in shm_names(ns):
            os.unlink(f"/dev/shm/{name}")
