"""``bench/bench_multi_gpu.py --quick``: two CPU ranks under torchrun (gloo) run every phase of the multi-GPU
benchmark on a small model: set-up, one shared generation, throughput alone and at once, PSS, late join."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "bench_multi_gpu.py"
DOCS = REPO / "docs" / "benchmarks.md"


@pytest.mark.slow
def test_quick_two_cpu_ranks_share_one_generation(tmp_path: Path) -> None:
    docs_before = DOCS.read_bytes()
    # CPU ranks on any host: --quick hides the GPUs from the ranks itself (the engine computes on CUDA whenever
    # CUDA is available), so the GPUs stay visible here and the report must still say there is none.
    env = dict(os.environ, FLEXTENSOR_BENCH_OUT=str(tmp_path / "results"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--nproc-per-node", "2", "--rounds", "1",
                           "--passes", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"

    data = json.loads((tmp_path / "results" / "bench_multi_gpu.json").read_text())
    assert "no GPU" in data["machine"], data["machine"]
    ranks = sorted(data["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sorted(r["role"] for r in ranks) == ["creator", "follower"]
    assert {r["device"] for r in ranks} == {"cpu"}
    # One output, on every rank and for the late joiner, equal to the resident model's.
    follower = next(r for r in ranks if r["role"] == "follower")
    creator = next(r for r in ranks if r["role"] == "creator")
    assert follower["late"] is not None and creator["late"] is None
    assert len({r["hash"] for r in ranks} | {follower["late"]["hash"]}) == 1
    assert all(r["max_diff"] == 0.0 for r in ranks)
    # Every rank timed both loads alone and at once, over the same streamed bytes.
    model_bytes = data["model_bytes"]
    for r in ranks:
        assert set(r["timing"]) == {"alone_fwd", "alone_copy", "together_fwd", "together_copy"}
        assert all(seconds > 0 for seconds in r["timing"].values())
        assert 0 < r["streamed_bytes"] < model_bytes and r["blocks"] == data["spec"]["layers"]
        assert r["pss"] > r["baseline_pss"] > 0
    assert follower["wait_s"] > 0, "all ranks start at once: the follower waits for the creator's READY"
    assert ranks[0]["leftover"] == []
    for heading in ("Transfer-bound forward per GPU", "Host RAM", "Time to ready", "Outputs", "Goals"):
        assert f"### {heading}" in proc.stdout, proc.stdout
    assert "CPU host: the ranks compute from the shared blocks in place" in proc.stdout
    assert DOCS.read_bytes() == docs_before, "a --quick run must not write docs/benchmarks.md"
