"""Two jobs that each fit in /dev/shm alone, allocating at the same moment in one too small for both: one
wins and the other gets ShmSpaceError with the remedy, never both failing half-way (they take turns on the
host-wide allocation lock, see SharedSegment.create). Runs in a private mount namespace with a 64 MiB
/dev/shm, so it needs root and unshare."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

JOB = r"""
import json, os, sys, time
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.errors import ShmSpaceError
ns, start_at = sys.argv[1], float(sys.argv[2])
with ShmCoordinator(ns, lease_seconds=5) as c:
    while time.time() < start_at:
        time.sleep(0.0005)
    try:
        c.memory_owner.create_segment("b0", 40 << 20).close()
        print(json.dumps({"ok": True}))
    except ShmSpaceError as exc:
        print(json.dumps({"ok": False, "message": str(exc)}))
"""

ROUND = r"""
set -e
mount -t tmpfs -o size=64m tmpfs /dev/shm
at=$(python3 -c 'import time; print(time.time() + 1.5)')
"$PY" -c "$JOB" ftrace-a "$at" > "$OUT/a" &
"$PY" -c "$JOB" ftrace-b "$at" > "$OUT/b" &
wait
ls -A /dev/shm > "$OUT/left"
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_two_jobs_too_big_together_one_wins_the_other_gets_the_remedy(tmp_path):
    # Prepended: the package may come from a site directory on PYTHONPATH (scripts/gpu-suite.sh), not the checkout.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for round_ in range(3):
        out = tmp_path / f"round{round_}"
        out.mkdir()
        env = {**os.environ, "PY": sys.executable, "JOB": JOB, "OUT": str(out), "PYTHONPATH": pythonpath}
        run = subprocess.run(["unshare", "-m", "sh", "-c", ROUND], env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        results = [json.loads((out / name).read_text()) for name in ("a", "b")]
        assert sorted(r["ok"] for r in results) == [False, True], results
        (loser,) = [r for r in results if not r["ok"]]
        assert "--shm-size" in loser["message"] or "/dev/shm" in loser["message"], loser
        assert (out / "left").read_text() == ""  # both closed: nothing left in their /dev/shm
