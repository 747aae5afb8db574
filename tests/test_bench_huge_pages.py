"""bench/bench_huge_pages.py's report: one table of both modes from the raw results (the runs themselves need root
and minutes; ``python bench/bench_huge_pages.py --quick`` checks them on a CPU host)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_huge_pages  # noqa: E402

GIB = 1 << 30


def _mode(label: str, publish_s: float, register_s: float | None) -> dict:
    group = {"creator": {"shared_bytes": 24 * GIB, "publish_s": publish_s},
             "alone": {"after_ready_s": 0.15, "register_s": 0.9},
             "followers": [{"exit_s": 0.4}, {"exit_s": 0.7}]}
    register = {"size": 8 * GIB, "register_s": register_s, "huge_mapped": 8 * GIB if "huge" in label else 0} \
        if register_s is not None else {"size": 8 * GIB}
    return {"mode": label, "register": register, "left_in_dir": 0, "scale": {"sizes": [{"gib": 24.0, "group": group}]}}


def test_the_table_has_both_modes_every_goal_and_dashes_for_what_was_not_measured() -> None:
    data = {"sizes": [24.0], "workers": 4, "register_gib": 8.0,
            "modes": [_mode("4 KiB pages", 2.0, 0.4), _mode("huge=always", 1.0, None)]}
    ((heading, text),) = bench_huge_pages.sections(data)
    assert heading == "4 KiB pages against a tmpfs mounted huge=always"
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| measure")}
    assert lines["registration of a 8 GiB segment, ms/GiB"] == ["50.0", "-", "<= 10"]
    assert lines["creator publish, in-RAM factory, 24 GiB"] == ["12.9 GB/s", "25.8 GB/s", ">= 25 GB/s"]
    assert lines["follower alone ready after READY, 24 GiB"] == ["0.150 s", "0.150 s", "no slower than 4 KiB"]
    assert lines["exit after close(), 3 followers together, 24 GiB"] == ["0.700 s", "0.700 s", "<= 0.5 s"]
    assert lines["entries left in the directory afterwards"] == ["0", "0", "0"]


def test_the_checkpoint_row_shows_each_modes_median_and_a_dash_where_it_did_not_run() -> None:
    four_k, huge = _mode("4 KiB pages", 2.0, 0.4), _mode("huge=always", 1.0, 0.05)
    four_k["checkpoint"] = {"ready_s": [0.9, 0.7, 0.8], "equal": True, "model_bytes": 6 * GIB}
    huge["checkpoint"] = {"error": "no GPU"}
    data = {"sizes": [24.0], "workers": 4, "register_gib": 8.0, "modes": [four_k, huge]}
    ((_, text),) = bench_huge_pages.sections(data)
    row = next(line for line in text.splitlines() if "checkpoint to READY" in line)
    assert [c.strip() for c in row.split("|")[1:-1]] == [
        "session creator, checkpoint to READY, warm page cache, 6 GiB (median of 3)", "0.800 s", "-",
        "<= 0.5 s at 6 GiB"]
