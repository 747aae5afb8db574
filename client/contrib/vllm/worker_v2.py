"""``FlexTensorOffloadWorkerV2``: the vLLM engines of one host share one host copy of the weights.

For vLLM's local data parallelism (``vllm serve MODEL --data-parallel-size N --worker-cls
flextensor.contrib.vllm.worker_v2.FlexTensorOffloadWorkerV2``), or N engines of one model started side by side
(one ``LLM(...)`` per process with the same ``FT_SHM_NAMESPACE``): every engine's worker joins one
``ft.SharedOffloadSession``, which this worker owns from ``load_model`` to ``shutdown``. The first worker of the
host to arrive is elected creator: it loads the checkpoint with vLLM's loader into host RAM and publishes it into
shared memory; every other worker builds the same model class with its parameters on ``meta``
(``flextensor.contrib.vllm.model_loading.build_meta_model``) while it waits, and attaches to the creator's
blocks. On a CUDA device each engine streams from the shared pinned blocks; on vLLM's CPU backend every engine
computes from them in place, so N engines hold one copy of the weights.

What it needs, checked before anything is loaded (each refusal names the fix):

- a profile in ``profile_storage_dir`` (``FT_PROFILE_STORAGE_DIR``), made beforehand by
  ``FlexTensorOffloadWorker`` with the same model, vLLM arguments and device kind (the v2 worker only reads it:
  a shared plan cannot be profiled by N engines at once); a profile of another model is refused on adoption,
  naming the first tensor that differs;
- a base namespace that every engine of the job shares and no other job uses: ``additional_config
  ["flextensor"]["namespace"]`` or ``FT_SHM_NAMESPACE``; with vLLM's data parallelism (``data_parallel_size``
  > 1) one is derived from the model and the data-parallel master address, which all engines of one launch
  share;
- vLLM 0.17.0 or later, and neither tensor nor pipeline parallelism (each rank would hold another shard under
  the same names).

``shm_wait_timeout`` (``FT_SHM_WAIT_TIMEOUT``, default 0.0: wait as long as the creator lives) is the session's
``wait_timeout``: how long a follower waits for the creator's READY. The compilation and CUDA-graph checks are
the regular worker's (``flextensor.contrib.vllm.graph_checks``). A worker that dies (SIGKILL, OOM kill) is
reclaimed as any session worker: the others keep serving from the shared copy; the last one to close removes
it, or ``ftd`` does when every engine of the job is gone (``docs/launchers.md``, "vLLM").
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from packaging.version import Version
from torch import nn

import vllm
from vllm.config import VllmConfig

import flextensor as ft
from flextensor.contrib.vllm.model_loading import build_meta_model, discard_model, load_host_model
from flextensor.contrib.vllm.settings import OPTIONS_KEY, WorkerSettings
from flextensor.contrib.vllm.worker import FlexTensorOffloadWorker
from flextensor.profiles import profile_path
from flextensor.shm.names import compute_shm_namespace

__all__ = ["FlexTensorOffloadWorkerV2", "MIN_VLLM_VERSION", "job_namespace"]

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format print it

#: The oldest vLLM whose worker and loader interfaces this worker was written against.
MIN_VLLM_VERSION = "0.17.0"


def check_topology(vllm_config: VllmConfig) -> None:
    """Refuse what one shared copy per host cannot serve (``ValueError`` naming the fix)."""
    if Version(vllm.__version__).release < Version(MIN_VLLM_VERSION).release:
        raise RuntimeError(f"FlexTensorOffloadWorkerV2 needs vLLM {MIN_VLLM_VERSION} or later; "
                           f"this is {vllm.__version__}: upgrade vLLM, or use FlexTensorOffloadWorker (no sharing)")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(
            f"FlexTensorOffloadWorkerV2 shares one whole model per host, but this engine is sharded "
            f"(tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}); use data parallelism with one GPU per engine, or "
            "FlexTensorOffloadWorker (one private copy per rank)")


def job_namespace(settings: WorkerSettings, vllm_config: VllmConfig) -> str:
    """The base namespace all engines of this job share (see the module docs for the order of sources)."""
    if settings.namespace:
        return settings.namespace
    if settings.config.shm_namespace:
        return settings.config.shm_namespace
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        model = vllm_config.model_config
        return compute_shm_namespace({
            "model": str(model.model), "revision": str(model.revision), "dtype": str(model.dtype),
            "dp_master": f"{parallel.data_parallel_master_ip}:{parallel.data_parallel_master_port}"}, prefix="ftvllm")
    raise ValueError(
        "FlexTensorOffloadWorkerV2 needs the base namespace every engine of this job shares: set FT_SHM_NAMESPACE "
        f"(or additional_config={{'{OPTIONS_KEY}': {{'namespace': ...}}}}) to the same value in each engine, unique "
        "per job (with vLLM's data_parallel_size > 1 it is derived by itself)")


class FlexTensorOffloadWorkerV2(FlexTensorOffloadWorker):
    """vLLM's platform worker whose engines share one host copy through a session (see the module docstring)."""

    flextensor_role = "pending"  # "creator" or "follower" once the session elected

    def offloaded_model(self, settings: WorkerSettings) -> nn.Module:
        check_topology(self.vllm_config)
        cfg = settings.config
        if settings.memory_budget_bytes is not None:
            raise ValueError(f"additional_config[{OPTIONS_KEY!r}]['memory_budget_bytes'] plans; the v2 worker "
                             "adopts the profile's plan: pass it to the FlexTensorOffloadWorker run that makes the "
                             "profile instead")
        profile = cfg.profile_storage_dir
        if profile is None or not profile_path(profile).is_file():
            raise FileNotFoundError(
                f"FlexTensorOffloadWorkerV2 adopts a saved profile, but {'no profile_storage_dir is set' if profile is None else f'{profile_path(profile)} does not exist'}; "
                "make one first: run the same model once with worker_cls='flextensor.contrib.vllm.worker."
                "FlexTensorOffloadWorker' and FT_PROFILE_STORAGE_DIR set (examples/vllm_dp.py --make-profile), "
                "then start the engines with the same FT_PROFILE_STORAGE_DIR")
        namespace = job_namespace(settings, self.vllm_config)
        built: list[nn.Module] = []  # the follower's model, if this process built one (see creator())

        def follower() -> nn.Module:
            built.append(build_meta_model(self.vllm_config))
            return built[-1]

        def creator() -> nn.Module:
            while built:  # elected creator after building a follower's model: that one is dropped
                discard_model(built.pop(), self.vllm_config)
            return load_host_model(self.vllm_config)

        session = ft.SharedOffloadSession(namespace, wait_timeout=cfg.shm_wait_timeout)
        self._flextensor_session = session
        atexit.register(self.release_offload)  # an engine that exits without shutdown() still leaves its share
        model = session.offload_from_profile(str(profile), config=cfg, name=settings.manager,
                                             creator_model_factory=creator, follower_model_factory=follower)
        self.flextensor_role = session.role(settings.manager)
        logger.info("flextensor: %s of namespace %s (per-manager %s)", self.flextensor_role, namespace,
                    session.namespace_for(settings.manager))
        return model

    def flextensor_report(self) -> dict[str, Any]:
        report = super().flextensor_report()
        session = getattr(self, "_flextensor_session", None)
        if session is not None:
            summary = session.report()
            report["session"] = summary[0] if summary else {}
            report["namespace"] = session.namespace
            report["wait_timeout"] = session.wait_timeout
        return report

    def release_offload(self) -> None:
        """Leave the session (the last engine to leave removes the shared copy); safe to call twice."""
        session = getattr(self, "_flextensor_session", None)
        if session is None:
            return
        self._flextensor_session = None
        session.close()
