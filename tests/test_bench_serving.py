"""bench/serving_trace.py's summary of a served trace: classes, percentiles, and the first pass at a size set
against the twin's median at that size (the runs themselves need a GPU: ``python bench/bench_serving.py --quick``
checks them on a CPU host)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import serving_trace  # noqa: E402


def _record(batch: int, off_ms: float, res_ms: float, first: bool = False) -> dict:
    return {"batch": batch, "first": first, "off_s": off_ms / 1e3, "res_s": res_ms / 1e3, "equal": True}


def test_a_first_pass_is_set_against_the_twins_median_at_its_size_not_the_one_pass_beside_it() -> None:
    # batch 1: the twin pass beside the first pass was fast (2.0 ms), its median over the trace is 3.0 ms
    records = [_record(1, 3.3, 2.0, first=True), _record(1, 3.0, 3.0), _record(1, 3.0, 3.1), _record(1, 2.9, 3.0),
               _record(4096, 44.0, 40.0, first=True), _record(4096, 40.0, 40.0), _record(4096, 41.0, 41.0)]
    assert serving_trace.twin_medians(records) == {1: pytest.approx(3.0e-3), 4096: pytest.approx(40.0e-3)}
    rows = {row["batch_class"]: row for row in serving_trace.summarise(records)}
    assert set(rows) == {"1", "257-4096"}
    assert rows["1"]["passes"] == 4 and rows["1"]["first_worst"] == pytest.approx(1.1)
    assert rows["257-4096"]["first_worst"] == pytest.approx(1.1)
    assert rows["1"]["off_max"] == pytest.approx(3.3) and rows["1"]["res_p50"] == pytest.approx(3.0)
    assert rows["1"]["equal"] and rows["257-4096"]["equal"]


def test_trace_gives_every_batch_class_a_share_of_the_passes():
    batches = serving_trace.trace(500, seed=0)
    assert len(batches) == 500
    sizes = set(serving_trace.POWERS_OF_TWO + serving_trace.ODD_SIZES)
    assert set(batches) <= sizes
    for low, high, name in serving_trace.CLASSES:
        share = sum(low <= b <= high for b in batches) / len(batches)
        assert 0.18 < share < 0.32, (name, share)
    assert serving_trace.trace(500, seed=0) == batches
    assert max(serving_trace.trace(200, seed=1, largest=256)) <= 256
