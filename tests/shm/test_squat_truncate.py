"""Same-host interference: a name squatted in /dev/shm by another user, and a segment truncated while in use
by a process of the same user. A squatted coordinator name and a truncated segment end in an error that names
the file (and its owner), never in a bare "Permission denied" or a SIGBUS at READY; a squatted generation name
is skipped with a WARNING naming its owner."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.header import State
from flextensor.shm.names import manager_namespace
from flextensor.shm.segment import SHM_DIR, SharedSegment
from tests.helpers.other_user import run_as_user
from tests.leftovers import shm_names

SQUATTER, VICTIM = 65534, 65533


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "squat")


@pytest.mark.skipif(os.geteuid() != 0, reason="playing two other users needs root")
@pytest.mark.parametrize("what", ["coordinator", "segment"])
def test_name_squatted_by_another_user_names_the_file_owner_and_remedy(ns, tmp_path, what):
    victim_tmp = Path(tempfile.mkdtemp(prefix="ft-victim-", dir="/tmp"))  # reachable by the victim uid
    os.chown(victim_tmp, VICTIM, VICTIM)
    name = f"/{ns}.c" if what == "coordinator" else f"/{ns}.g1.sd"
    squat = run_as_user(SQUATTER, f"from flextensor.shm.segment import SharedSegment\n"
                                  f"SharedSegment.create({name!r}, 4096).close()\n", tmpdir="/tmp")
    assert squat.returncode == 0, squat.stderr
    try:
        run = run_as_user(VICTIM, f"""
from flextensor.shm.coordinator import ShmCoordinator
try:
    with ShmCoordinator({ns!r}, lease_seconds=5, timeout=2) as c:
        c.memory_owner.create_segment("sd", 4096).close()
except OSError as exc:
    print(type(exc).__name__, exc)
else:
    print("no error")
""", tmpdir=str(victim_tmp))
        out = run.stdout.strip()
        if what == "coordinator":
            assert out.startswith("PermissionError"), (out, run.stderr)
            assert f"{SHM_DIR}{name} belongs to uid {SQUATTER} (nobody)" in out and "use another namespace" in out
        else:  # a generation's name taken before the job: the creator skips that generation and says so
            assert out == "no error", (out, run.stderr)
            assert f"generation 1 skipped, {SHM_DIR}{name} belongs to uid {SQUATTER}" in run.stderr
        assert os.stat(SHM_DIR + name).st_uid == SQUATTER  # the victim removed nothing of the squatter's
        assert shm_names(ns) == [name[1:]]
        left = sorted(p.name for p in (victim_tmp / f"flextensor-{VICTIM}").iterdir())
        assert left in ([], [f"{ns}.lock"])  # no journal: the victim's failed start left nothing to clean
    finally:
        SharedSegment.unlink_name(name)
        shutil.rmtree(victim_tmp, ignore_errors=True)


def test_segment_truncated_before_ready_is_refused_at_publish(ns):
    with ShmCoordinator(ns, lease_seconds=5) as c:
        seg = c.memory_owner.create_segment("sd", 1 << 16)
        seg.buffer[:4] = b"data"
        os.truncate(SHM_DIR + seg.name, 4096)  # a same-uid process shrinks it
        with pytest.raises(ShmProtocolError, match=r"truncated to 4096 bytes while in use \(65536 expected\)"):
            c.notify_ready()
        assert c.state == State.INITIALIZING  # followers were never told to read it
        seg.close()
    assert shm_names(ns) == []


def test_segment_truncated_after_publish_is_refused_on_attach(ns):
    with ShmCoordinator(ns, lease_seconds=5) as c:
        c.memory_owner.create_segment("sd", 1 << 16).close()
        c.notify_ready()
        os.truncate(f"{SHM_DIR}/{ns}.g1.sd", 0)
        with ShmCoordinator(ns, lease_seconds=5) as follower:
            follower.wait_for_ready(1)
            with pytest.raises(ValueError, match="truncated"):
                follower.memory_owner.open_segment("sd", min_size=1 << 16)
    assert shm_names(ns) == []
