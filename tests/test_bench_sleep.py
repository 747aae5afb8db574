"""bench/bench_sleep.py --quick: the sharing group's sleep, update and wake and the per-process baseline run on
the CPU with a small model (the device runs use the same code); the report's table is built from the results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import bench_sleep  # noqa: E402


def test_quick_run_measures_the_group_and_the_baseline(tmp_path: Path) -> None:
    env = {**os.environ, "FLEXTENSOR_BENCH_OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(BENCH / "bench_sleep.py"), "--quick", "--no-docs", "--workers", "2"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads((tmp_path / "bench_sleep.json").read_text())
    (run,) = data["runs"]
    assert [r["role"] for r in run["ready"]] == ["creator", "follower"]
    assert run["update"]["complete"] and run["update"]["nbytes"] == run["model_bytes"]
    assert [w["version"] for w in run["woken"]] == [1, 1] and all(w["equal"] for w in run["woken"])
    assert all(c["equal"] for c in run["baseline"]["cycles"]) and run["baseline"]["load_equal"]
    (heading, text), = bench_sleep.sections_for(data)
    assert text.count("| 0.004 GiB |") == 5 and "NO" not in text.split("\n\n")[-1]
