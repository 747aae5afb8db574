"""flextensor inside vLLM: worker classes that offload a vLLM engine's weights (``docs/launchers.md``, "vLLM").

- ``flextensor.contrib.vllm.worker.FlexTensorOffloadWorker``: one engine, its weights through the offload engine.
- ``flextensor.contrib.vllm.worker_v2.FlexTensorOffloadWorkerV2``: the engines of one host (vLLM's local data
  parallelism, or N engines of one model) share one host copy through a ``SharedOffloadSession``.

Name either as vLLM's ``worker_cls`` (``LLM(..., worker_cls=...)``, ``vllm serve --worker-cls ...``). Importing
this package does not import vLLM; the worker modules do.
"""

from flextensor.contrib.vllm.settings import (VLLM_DEFAULT_EXCLUDE_PATTERNS, VLLM_DEFAULT_INCLUDE_PATTERNS,
                                              WorkerSettings, resolve_settings)

__all__ = ["VLLM_DEFAULT_INCLUDE_PATTERNS", "VLLM_DEFAULT_EXCLUDE_PATTERNS", "WorkerSettings", "resolve_settings"]
