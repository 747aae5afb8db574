"""The demo (``./dev.sh demo``), end to end in its quick form: real worker processes, real /dev/shm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_demo_shares_one_copy_and_leaves_nothing(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--quick", "--workers", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"

    assert "CPU host (no CUDA)" in out or "GPU: " in out
    rows = [line for line in out.splitlines() if re.match(r"^\| \d+ +\|", line)]
    roles = [row.split("|")[3].strip() for row in rows]
    assert len(rows) == 3, out
    assert roles.count("creator") == 1 and roles.count("follower") == 2, out
    assert len({row.split("|")[4].strip() for row in rows}) == 1, "all workers must join one generation"
    assert "outputs match: yes (3/3 workers" in out, out
    assert "/dev/shm clean: yes" in out, out
    assert re.search(r"ratio +\d+\.\d\d", out), out

    compact = re.search(r"-> /dev/shm/(\S+)\.\*", out).group(1)
    left = [name for name in set(os.listdir("/dev/shm")) - before if compact in name]
    assert not left, f"the demo left {left} in /dev/shm"
