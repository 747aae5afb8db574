"""Other users on the same host cannot stall, block or misdirect a job: the allocation gate, the lock directory,
the generation names and the errors about a namespace that another uid uses. Each attack is played by a real
uid (65534, the squatter) against a root owner and a non-root owner (uid 65533)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from flextensor.shm import allocation_gate
from flextensor.shm.names import manager_namespace
from flextensor.shm.segment import SHM_DIR, SharedSegment
from tests.helpers.other_user import run_as_user, start_as_user
from tests.leftovers import shm_names

SQUATTER, VICTIM = 65534, 65533

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing other users needs root")


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "others")


@pytest.fixture
def victim_tmp():
    """A TMPDIR of the non-root owner, reachable by that uid (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="ft-victim-", dir="/tmp"))
    os.chown(path, VICTIM, VICTIM)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _hold_gate(uid: int) -> subprocess.Popen:
    """A process of ``uid`` that takes the allocation gate's flock on /dev/shm and keeps it until killed."""
    code = textwrap.dedent(f"""
        import fcntl, os, sys
        if {uid} != os.getuid():
            os.setgroups([]); os.setgid({uid}); os.setuid({uid})
        fd = os.open({SHM_DIR!r}, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd="/")
    assert holder.stdout.readline().strip() == "held"
    return holder


def _stop(holder: subprocess.Popen) -> None:
    holder.kill()
    holder.wait(timeout=30)


def _keeping_warnings(logger: str) -> str:
    """The start of a script run in a child: the WARNINGs of ``logger`` are kept in ``records`` for its report."""
    return f"""
import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger({logger!r}).addHandler(Keep())
logging.getLogger({logger!r}).setLevel(logging.WARNING)
"""


#: What ``run_as_user``'s prelude has imported for the scripts here; a script run as root directly imports it.
_STANDARD_IMPORTS = "import json, os, sys, time\n"


def _run_script(uid: int, code: str, *, timeout: float, tmpdir: str | None = None) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: as this (root) process's user directly (``TMPDIR=tmpdir`` when given),
    as another uid through ``run_as_user``."""
    if uid == 0:
        env = {**os.environ, "TMPDIR": tmpdir} if tmpdir is not None else None
        return subprocess.run([sys.executable, "-c", _STANDARD_IMPORTS + code], capture_output=True, text=True,
                              timeout=timeout, env=env)
    return run_as_user(uid, code, tmpdir=tmpdir or "/tmp", timeout=timeout)


def _as(uid: int, code: str, tmpdir: Path) -> dict:
    """``code``'s JSON report, run as ``uid`` with ``TMPDIR=tmpdir`` (it must exit 0)."""
    run = _run_script(uid, code, tmpdir=str(tmpdir), timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


_CREATE_UNDER_GATE = _keeping_warnings("flextensor.shm.allocation_gate") + """
from flextensor.shm.segment import SharedSegment
start = time.monotonic()
segment = SharedSegment.create({name!r}, 4 << 20)
elapsed = time.monotonic() - start
segment.close()
SharedSegment.unlink_name({name!r})
print(json.dumps({{"elapsed": elapsed, "warnings": records}}))
"""


@pytest.mark.parametrize("owner", ["root", "non-root"])
def test_allocation_gate_held_by_another_uid_does_not_delay_a_creator(ns, owner):
    name = f"/{ns}.gate"
    holder = _hold_gate(SQUATTER)
    try:
        run = _run_script(0 if owner == "root" else VICTIM, _CREATE_UNDER_GATE.format(name=name), timeout=300)
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout)
        assert holder.poll() is None  # the segment was made while the squatter still held the gate
        # Before, the creator waited ALLOCATION_LOCK_WAIT_S (120 s) for the squatter; a bound with room.
        assert result["elapsed"] < allocation_gate.ALLOCATION_LOCK_WAIT_S / 4, result
        [warning] = result["warnings"]
        assert f"held by uid {SQUATTER} (pid {holder.pid})" in warning and "allocating without it" in warning
    finally:
        _stop(holder)
    assert not os.path.exists(SHM_DIR + name)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a pid namespace")
def test_allocation_gate_held_where_the_creator_cannot_see_the_holder_does_not_delay_it(ns):
    """A creator in its own pid namespace (a container sharing the host's IPC) is not shown the holder in
    /proc/locks: the lock is busy, held by nobody it can see."""
    name = f"/{ns}.gate"
    holder = _hold_gate(SQUATTER)
    try:
        code = _STANDARD_IMPORTS + _CREATE_UNDER_GATE.format(name=name)
        run = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        result = json.loads(run.stdout)
        assert holder.poll() is None
        assert result["elapsed"] < allocation_gate.ALLOCATION_LOCK_WAIT_S / 4, result
        [warning] = result["warnings"]
        assert "held by a process this one cannot see (another pid namespace)" in warning, warning
    finally:
        _stop(holder)
    assert not os.path.exists(SHM_DIR + name)


def test_allocation_gate_names_its_holder_and_still_waits_for_a_creator_of_the_same_uid(monkeypatch, caplog):
    foreign = _hold_gate(SQUATTER)
    try:
        fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert allocation_gate.gate_holder(fd) == (foreign.pid, SQUATTER)
        finally:
            os.close(fd)
    finally:
        _stop(foreign)
    own = _hold_gate(os.getuid())
    try:
        monkeypatch.setattr(allocation_gate, "ALLOCATION_LOCK_WAIT_S", 0.3)
        with caplog.at_level(logging.WARNING, logger="flextensor.shm.allocation_gate"):
            assert allocation_gate.acquire(SHM_DIR, 4 << 20) is None  # waited for its own uid, then gave up
        assert [r.getMessage() for r in caplog.records] == [
            f"the allocation lock on {SHM_DIR} was held by a process of this user for more than 0 s; "
            "allocating without it"]
    finally:
        _stop(own)
    fd = allocation_gate.acquire(SHM_DIR, 4 << 20)
    assert fd is not None  # free again: taken at once
    allocation_gate.release(fd)


_JOB_WITH_LOGS = _keeping_warnings("flextensor") + """
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.names import lock_directory
out = {{}}
try:
    with ShmCoordinator({ns!r}, lease_seconds=5, timeout=5) as c:
        c.memory_owner.create_segment("sd", 4096).close()
        c.notify_ready()
        out["generation"] = c.generation
        out["lock_dir"] = str(lock_directory())
        out["lock_files"] = sorted(os.listdir(out["lock_dir"]))
except Exception as exc:
    out["error"] = f"{{type(exc).__name__}}: {{exc}}"
out["warnings"] = records
print(json.dumps(out))
"""


def _run_job(uid: int, ns: str, tmpdir: Path) -> dict:
    return _as(uid, _JOB_WITH_LOGS.format(ns=ns), tmpdir)


@pytest.mark.parametrize("owner", [0, VICTIM])
def test_lock_directory_taken_by_another_uid_falls_back_to_one_the_owner_owns(ns, shared_tmp, owner):
    squat = run_as_user(SQUATTER, f"os.mkdir({str(shared_tmp / f'flextensor-{owner}')!r}, 0o700)\n"
                                  f"os.mkdir({str(shared_tmp / f'flextensor-{owner}.1')!r}, 0o700)\n",
                        tmpdir=str(shared_tmp))
    assert squat.returncode == 0, squat.stderr
    fallback = shared_tmp / f"flextensor-{owner}.2"
    first = _run_job(owner, ns, shared_tmp)
    assert "error" not in first, first
    assert first["lock_dir"] == str(fallback) and first["lock_files"] == [f"{ns}.journal", f"{ns}.lock"]
    assert os.stat(fallback).st_uid == owner and os.stat(fallback).st_mode & 0o777 == 0o700
    for taken in (f"flextensor-{owner}", f"flextensor-{owner}.1"):
        assert any(f"lock directory {shared_tmp / taken} belongs to uid {SQUATTER}" in w and str(fallback) in w
                   for w in first["warnings"]), first["warnings"]
    # The squatter gives the first name back: the owner's next job keeps the directory its journals are in.
    shutil.rmtree(shared_tmp / f"flextensor-{owner}")
    again = _run_job(owner, ns, shared_tmp)
    assert again["lock_dir"] == str(fallback) and again["generation"] == 1, again
    assert sorted(os.listdir(fallback)) in ([], [f"{ns}.lock"])  # the job left: nothing of it remains
    assert shm_names(ns) == []


_FIRST_JOB = """
from flextensor.shm.coordinator import ShmCoordinator
c = ShmCoordinator({ns!r}, lease_seconds=5, timeout=5)
c.memory_owner.create_segment("sd", 4096).close()
c.notify_ready()
print(json.dumps({{"generation": c.generation}}), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("owner", [0, VICTIM])
def test_generation_names_squatted_while_a_job_runs_are_skipped_by_its_restart(ns, shared_tmp, owner):
    squatted = [f"/{ns}.g2.{kind}" for kind in ("h", "sd", "sm", "p", "b0")] + [f"/{ns}.g3.sd"]
    job = start_as_user(owner, _FIRST_JOB.format(ns=ns), tmpdir=str(shared_tmp))
    try:
        assert json.loads(job.stdout.readline() or "{}").get("generation") == 1, job.stderr.read()
        squat = run_as_user(SQUATTER, "from flextensor.shm.segment import SharedSegment\n"
                                      f"for name in {squatted!r}:\n"
                                      "    SharedSegment.create(name, 4096).close()\n", tmpdir="/tmp")
        assert squat.returncode == 0, squat.stderr
        job.kill()  # the whole job dies; its restart must create generation 2
        job.wait(timeout=30)
        restart = _run_job(owner, ns, shared_tmp)
        assert "error" not in restart and restart["generation"] == 4, restart
        for generation, entry in ((2, f"{ns}.g2.b0"), (3, f"{ns}.g3.sd")):
            assert any(f"generation {generation} skipped, /dev/shm/{entry} belongs to uid {SQUATTER}" in w
                       for w in restart["warnings"]), restart["warnings"]
        # The restart reclaimed generation 1 and left; only the squatter's names remain, untouched.
        assert shm_names(ns) == sorted(name[1:] for name in squatted)
        assert all(os.stat(SHM_DIR + name).st_uid == SQUATTER for name in squatted)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
        for name in squatted:
            SharedSegment.unlink_name(name)


_FORCED_CLEANUP = """
from flextensor.shm.cleanup import cleanup_manager_namespace
try:
    report = cleanup_manager_namespace({ns!r}, timeout=1, force=True)
except OSError as exc:
    print(json.dumps({{"error": f"{{type(exc).__name__}}: {{exc}}"}}))
else:
    print(json.dumps({{"removed": report.removed}}))
"""


@pytest.mark.parametrize("owner", [0, VICTIM])
def test_another_users_job_on_the_same_namespace_is_named_with_a_remedy_that_works(ns, shared_tmp, owner):
    other = start_as_user(SQUATTER, _FIRST_JOB.format(ns=ns), tmpdir=str(shared_tmp))
    try:
        assert json.loads(other.stdout.readline() or "{}").get("generation") == 1, other.stderr.read()
        refused = _run_job(owner, ns, shared_tmp)
        assert refused["error"].startswith("PermissionError"), refused
        assert f"/dev/shm/{ns}.c" in refused["error"] and f"belongs to uid {SQUATTER} (nobody)" in refused["error"]
        assert "another namespace" in refused["error"] or "another base namespace" in refused["error"]
        # --force removes what is the owner's and says what still blocks it, instead of reporting success.
        forced = _as(owner, _FORCED_CLEANUP.format(ns=ns), shared_tmp)
        assert forced["error"].startswith("PermissionError"), forced
        assert f"/dev/shm/{ns}.c (uid {SQUATTER} (nobody))" in forced["error"], forced
        assert "`rm /dev/shm/" in forced["error"] and f"/dev/shm/{ns}.c`" in forced["error"]
        assert os.stat(f"{SHM_DIR}/{ns}.c").st_uid == SQUATTER  # nothing of the other user's was touched
    finally:
        other.kill()
        other.wait(timeout=30)
    # The remedy named: that user cleans up its namespace; then the owner's job runs.
    cleaned = run_as_user(SQUATTER, "from flextensor.shm.cleanup import cleanup_manager_namespace\n"
                                    f"cleanup_manager_namespace({ns!r}, timeout=5)\n", tmpdir=str(shared_tmp))
    assert cleaned.returncode == 0, cleaned.stderr
    assert _run_job(owner, ns, shared_tmp)["generation"] == 1
    assert shm_names(ns) == []


@pytest.mark.parametrize("owner", [0, VICTIM])
@pytest.mark.parametrize("content", ["zeros", "garbage"])
def test_a_coordinator_segment_planted_by_another_uid_is_named_and_left_alone(ns, shared_tmp, owner, content):
    name = f"/{ns}.c"
    data = b"\0" * 4096 if content == "zeros" else b"garbage!" * 512
    plant = run_as_user(SQUATTER, f"open({SHM_DIR + name!r}, 'wb').write({data!r})\n", tmpdir="/tmp")
    assert plant.returncode == 0, plant.stderr
    try:
        refused = _run_job(owner, ns, shared_tmp)
        assert refused["error"].startswith("PermissionError"), refused
        assert f"{SHM_DIR}{name} belongs to uid {SQUATTER} (nobody)" in refused["error"], refused
        assert "use another namespace" in refused["error"] and f"`rm {SHM_DIR}{name}`" in refused["error"]
        with open(SHM_DIR + name, "rb") as f:
            assert f.read() == data  # neither reclaimed as an aborted creation nor touched
        assert shm_names(ns) == [name[1:]]
    finally:
        SharedSegment.unlink_name(name)
