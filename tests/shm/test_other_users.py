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
import time
from pathlib import Path

import pytest

from flextensor.shm import allocation_gate
from flextensor.shm.names import manager_namespace
from flextensor.shm.segment import SHM_DIR, SharedSegment
from tests.helpers.other_user import run_as_user

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


_CREATE_UNDER_GATE = """
import logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("flextensor.shm.allocation_gate").addHandler(Keep())
logging.getLogger("flextensor.shm.allocation_gate").setLevel(logging.WARNING)
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
        if owner == "root":
            code = "import json, time\n" + _CREATE_UNDER_GATE.format(name=name)
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        else:
            run = run_as_user(VICTIM, _CREATE_UNDER_GATE.format(name=name), tmpdir="/tmp", timeout=300)
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
