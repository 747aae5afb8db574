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

def both(step):  # a barrier of the two jobs: each marks the step, then waits for the other's mark
    open(os.path.join(os.environ["OUT"], f"{ns}.{step}"), "w").close()
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(os.environ["OUT"]) if n.endswith("." + step)]) < 2:
        assert time.monotonic() < deadline, f"the other job never reached {step}"
        time.sleep(0.0005)

ns = sys.argv[1]
with ShmCoordinator(ns, lease_seconds=5) as c:
    both("joined")  # allocate at the same moment, however long either took to start
    segment = None
    try:
        segment = c.memory_owner.create_segment("b0", 40 << 20)
        result = {"ok": True}
    except ShmSpaceError as exc:
        result = {"ok": False, "message": str(exc)}
    both("tried")  # the winner holds its segment until the other tried
    if segment is not None:
        segment.close()
    print(json.dumps(result))
"""

ROUND = r"""
set -e
mount -t tmpfs -o size=64m tmpfs /dev/shm
"$PY" -c "$JOB" ftrace-a > "$OUT/a" &
"$PY" -c "$JOB" ftrace-b > "$OUT/b" &
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
