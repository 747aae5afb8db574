"""The demo (``./dev.sh demo``), end to end in its quick form: real worker processes, real /dev/shm, three groups
(flextensor, private copies, mmap) measured one after another."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKERS = 2  # one creator and one follower per group: every layout and role, at the fewest worker starts
LAYOUTS = {
    "flextensor": "flextensor (one shared copy in /dev/shm)",
    "copy": "private copies (load_file + clone)",
    "mmap": "mmap of the checkpoint (load_file)",
}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_quick_demo_measures_three_layouts_and_leaves_nothing(tmp_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--quick", "--workers", str(WORKERS)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "CPU host (no CUDA)" in out or "GPU: " in out

    # One row per worker: WORKERS of each layout, flextensor's with one creator and one generation.
    rows = [_cells(line) for line in out.splitlines() if re.match(r"^\| (flextensor|copy|mmap) +\| \d+ +\|", line)]
    for layout in LAYOUTS:
        mine = [row for row in rows if row[0] == layout]
        assert len(mine) == WORKERS, out
        assert not any("MISMATCH" in row[-1] for row in mine), out
        if layout == "flextensor":
            roles = [row[3] for row in mine]
            assert roles.count("creator") == 1 and roles.count("follower") == WORKERS - 1, out
            assert len({row[4] for row in mine}) == 1, "all workers must join one generation"
        else:
            assert {row[3] for row in mine} == {layout}, out

    # The summary table: one row per layout, a size and a ratio to the model's bytes.
    summary = {}
    for line in out.splitlines():
        cells = _cells(line) if line.startswith("| ") else []
        if cells and cells[0] in LAYOUTS.values():
            summary[cells[0]] = cells
    assert set(summary) == set(LAYOUTS.values()), out
    for cells in summary.values():
        assert re.fullmatch(r"-?\d+\.\d\d (GiB|MiB|KiB)|-?\d+ B", cells[1]), cells
        assert re.fullmatch(r"-?\d+\.\d\dx", cells[2]), cells

    assert "flextensor: " in out and "private copies (what each GPU worker pays without flextensor)" in out, out
    assert f"flextensor holds 1 copy instead of {WORKERS}" in out and "On a CPU host mmap" in out, out
    total = WORKERS * len(LAYOUTS)
    match = re.search(r"outputs match: yes \((\d+)/(\d+) workers .*: flextensor (\d)/\d, copy (\d)/\d, mmap (\d)/\d",
                      out)
    assert match, out
    assert [int(g) for g in match.groups()] == [total, total, WORKERS, WORKERS, WORKERS], out
    assert "/dev/shm clean: yes" in out, out

    compact = re.search(r"-> /dev/shm/(\S+)\.\*", out).group(1)
    left = [name for name in set(os.listdir("/dev/shm")) - before if compact in name]
    assert not left, f"the demo left {left} in /dev/shm"
