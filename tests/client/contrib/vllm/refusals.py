"""What the vLLM workers refuse before or after planning, checked in the vLLM venv (for ``test_workers.py``, in
the process of an ``engine.py``, which has vLLM imported already: its ``refusals`` command; or run as a module):
each case calls the public check with a configuration that must be refused and gives the error it raised, one
JSON object of ``{case: "ExceptionType: message"}`` (``null`` where nothing was raised)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, ParallelConfig

import flextensor as ft
from flextensor.contrib.vllm.graph_checks import check_capture, streams_to_device
from flextensor.contrib.vllm.settings import WorkerSettings
from flextensor.contrib.vllm.worker_v2 import check_topology, job_namespace


def outcome(call) -> str | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the case reports whatever was raised
        return f"{type(exc).__name__}: {exc}"
    return None


def vllm_config(*, mode: CompilationMode = CompilationMode.NONE, cudagraph: CUDAGraphMode = CUDAGraphMode.NONE,
                tp: int = 1, dp: int = 1) -> SimpleNamespace:
    compilation = CompilationConfig(mode=mode, cudagraph_mode=cudagraph)
    parallel = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp)
    return SimpleNamespace(compilation_config=compilation, parallel_config=parallel,
                           model_config=SimpleNamespace(model="/m", revision=None, dtype="float32"))


def cases() -> dict[str, str | bool | None]:
    """Each case's outcome (see the module docstring)."""
    pageable, pinned = ft.OffloadConfig(pinned_memory=False), ft.OffloadConfig(pinned_memory=True)
    return {
        "streams_on_cpu": streams_to_device({"model.layers.0": ["w"]}, "cpu"),
        "streams_on_cuda": streams_to_device({"model.layers.0": ["w"]}, "cuda"),
        "compiled_streaming": outcome(lambda: check_capture(vllm_config(mode=CompilationMode.VLLM_COMPILE),
                                                            pinned, streams=True, manager="vllm")),
        "compiled_resident": outcome(lambda: check_capture(vllm_config(mode=CompilationMode.VLLM_COMPILE),
                                                           pinned, streams=False, manager="vllm")),
        "graphs_pageable": outcome(lambda: check_capture(vllm_config(cudagraph=CUDAGraphMode.FULL), pageable,
                                                         streams=True, manager="vllm")),
        "graphs_pinned": outcome(lambda: check_capture(vllm_config(cudagraph=CUDAGraphMode.FULL), pinned,
                                                       streams=True, manager="vllm")),
        "tensor_parallel": outcome(lambda: check_topology(vllm_config(tp=2))),
        "no_namespace": outcome(lambda: job_namespace(WorkerSettings(config=pageable), vllm_config())),
        "dp_namespace": job_namespace(WorkerSettings(config=pageable), vllm_config(dp=2)),
    }


def main() -> None:
    print(json.dumps(cases()))


if __name__ == "__main__":
    main()
