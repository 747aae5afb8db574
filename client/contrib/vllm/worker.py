"""``FlexTensorOffloadWorker``: a vLLM worker whose model weights go through flextensor's offload engine.

Use it as vLLM's worker class: ``LLM(model, worker_cls="flextensor.contrib.vllm.worker.FlexTensorOffloadWorker")``
or ``vllm serve MODEL --worker-cls flextensor.contrib.vllm.worker.FlexTensorOffloadWorker``. vLLM imports the
class by name in every worker process it spawns; a ``worker_cls`` (rather than a plugin that patches vLLM's own
worker) keeps the choice explicit per engine, and vLLM runs unchanged when it is not named. The class derives
from the platform's worker (``CPUWorker`` on vLLM's CPU backend, ``Worker`` on CUDA), chosen when this module is
imported, and changes one step of it: loading the model.

The life of the model in this worker:

1. ``load_model`` builds the model with its weights in host RAM (``flextensor.contrib.vllm.model_loading``), hands
   it to the offload engine under the settings of ``flextensor.contrib.vllm.settings`` (vLLM-oriented default
   patterns unless ``FT_INCLUDE_PATTERNS`` / ``FT_EXCLUDE_PATTERNS`` or a config file say otherwise), and installs
   it in vLLM's model runner.
2. Still inside ``load_model``, before vLLM measures memory, profiles or captures anything, the engine's warm-up
   passes run as vLLM dummy batches of ``warmup_tokens`` tokens (``iters_before_inference`` of them, eager even
   when vLLM compiles: ``flextensor.contrib.vllm.graph_checks.uncompiled``), the plan is made and its host blocks
   installed. With ``profile_storage_dir`` set, a profile found there is adopted instead (no warm-up), and a new
   plan is saved there unless ``profile_read_only``. Automatic replanning is off, so vLLM's own profiling run,
   its dummy batches and CUDA-graph captures are ordinary INFERENCE passes that change no plan.
3. With the plan known, ``check_capture`` refuses a compilation or CUDA-graph mode the plan cannot run under,
   naming the fix; on CUDA the device bytes the engine holds are what vLLM counts as the model's memory.
4. ``shutdown`` releases the manager.

``flextensor_report`` (``llm.collective_rpc("flextensor_report")``) returns what the worker did: role, phase,
how many tensors are offloaded, the warm-up passes and the device.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from typing import Any

import torch
from torch import nn

from vllm.config import CompilationMode, set_current_vllm_config
from vllm.platforms import current_platform

if current_platform.is_cpu():  # importing the other would patch torch for the wrong backend
    from vllm.v1.worker.cpu_worker import CPUWorker as PlatformWorker
else:
    from vllm.v1.worker.gpu_worker import Worker as PlatformWorker

import flextensor as ft
from flextensor.contrib.vllm.graph_checks import check_capture, streams_to_device, uncompiled
from flextensor.contrib.vllm.model_loading import check_loadable, load_host_model
from flextensor.contrib.vllm.settings import (VLLM_DEFAULT_EXCLUDE_PATTERNS, VLLM_DEFAULT_INCLUDE_PATTERNS,
                                              WorkerSettings, resolve_settings)
from flextensor.profiles import profile_path

__all__ = ["FlexTensorOffloadWorker", "PlatformWorker", "VLLM_DEFAULT_INCLUDE_PATTERNS",
           "VLLM_DEFAULT_EXCLUDE_PATTERNS"]

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and format print it


class FlexTensorOffloadWorker(PlatformWorker):  # type: ignore[misc, valid-type]
    """vLLM's platform worker with its model offloaded by flextensor (see the module docstring)."""

    #: What this worker reports as its role in ``flextensor_report`` (the v2 worker: creator or follower).
    flextensor_role = "private"

    def flextensor_settings(self) -> WorkerSettings:
        """This worker's settings: ``additional_config["flextensor"]``, ``FT_*`` and the vLLM defaults."""
        settings = getattr(self, "_flextensor_settings", None)
        if settings is None:
            settings = resolve_settings(self.vllm_config.additional_config,
                                        cuda=not current_platform.is_cpu())
            device = getattr(self, "device", None)
            if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None \
                    and "FT_GPU_DEVICE" not in os.environ:  # this worker's GPU, as vLLM chose it
                settings = dataclasses.replace(settings, config=dataclasses.replace(settings.config,
                                                                                    gpu_device=device.index))
            self._flextensor_settings = settings
        return settings

    # ------------------------------------------------------------------------------------------ loading
    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        settings = self.flextensor_settings()
        if not settings.config.enabled:
            logger.info("flextensor: offloading disabled (FT_ENABLED or the config file); vLLM loads the model")
            super().load_model(load_dummy_weights=load_dummy_weights)
            return
        if load_dummy_weights:
            raise ValueError("flextensor's vLLM workers load real weights only (load_dummy_weights=True is used by "
                             "elastic expert parallelism, which they do not support)")
        check_loadable(self.vllm_config)
        self._flextensor_warmup_passes = 0
        begin = time.monotonic()
        runner = self.model_runner
        original = runner.load_model

        def load_offloaded(*args: Any, **kwargs: Any) -> None:
            model = self.offloaded_model(settings)
            if "model" in inspect.signature(original).parameters:
                original(model=model)  # the GPU runner: vLLM's wrappers and bookkeeping around a given model
            else:
                runner.model = model  # the CPU runner has no such argument; LoRA and drafters are refused above

        runner.load_model = load_offloaded  # this call only (an instance attribute over the class's method)
        try:
            super().load_model(load_dummy_weights=False)
        finally:
            del runner.load_model
        with set_current_vllm_config(self.vllm_config):
            self.complete_plan(settings)
        manager = ft.get_offload_manager(settings.manager)
        offloaded = manager.offloaded_tensors
        check_capture(self.vllm_config, settings.config, streams=streams_to_device(offloaded, manager.device.type),
                      manager=settings.manager)
        if manager.device.type == "cuda":
            torch.cuda.empty_cache()  # the warm-up's device copies, so vLLM's memory profile starts from the plan
            runner.model_memory_usage = ft.get_gpu_memory_usage(settings.manager).total_bytes
        logger.info("flextensor: manager %r (%s) ready in %.2f s on %s: %d tensors of %d traps offloaded; defaults "
                    "applied: %s", settings.manager, self.flextensor_role, time.monotonic() - begin, manager.device,
                    sum(map(len, offloaded.values())), len(offloaded), ", ".join(settings.defaults_applied) or "none")

    def offloaded_model(self, settings: WorkerSettings) -> nn.Module:
        """The model, offloaded: a profile in ``profile_storage_dir`` is adopted; otherwise warm-up follows."""
        cfg = settings.config
        if cfg.shm_enabled:
            raise ValueError("FT_SHM_ENABLED / shm_enabled=True needs a worker that coordinates the engines: use "
                             "worker_cls='flextensor.contrib.vllm.worker_v2.FlexTensorOffloadWorkerV2'")
        model = load_host_model(self.vllm_config)
        if settings.memory_budget_bytes is not None:
            ft.get_offload_manager(settings.manager).set_memory_budget(settings.memory_budget_bytes)
        profile = cfg.profile_storage_dir
        if profile is not None and profile_path(profile).is_file():
            logger.info("flextensor: adopting the profile in %s", profile)
            return ft.offload_from_profile(model, profile, cfg, name=settings.manager)
        model = ft.offload(model, cfg, name=settings.manager)
        ft.get_offload_manager(settings.manager).allow_strategy_replan = False
        return model

    def complete_plan(self, settings: WorkerSettings) -> None:
        """Run the engine's warm-up passes as vLLM dummy batches, install the plan, save it when asked."""
        manager = ft.get_offload_manager(settings.manager)
        passes = manager.iters_before_inference
        if passes:
            runner = self.model_runner
            tokens = settings.warmup_tokens or self.scheduler_config.max_num_seqs
            tokens = min(tokens, runner.max_num_tokens)
            with uncompiled(runner.get_model()), torch.inference_mode():
                for _ in range(passes):
                    runner._dummy_run(tokens, is_profile=True)
            self._flextensor_warmup_passes = passes
            logger.info("flextensor: %d warm-up passes of %d tokens", passes, tokens)
        if manager.phase is not ft.Phase.INFERENCE:
            raise RuntimeError(f"flextensor manager {settings.manager!r} is in phase {manager.phase} after its "
                               f"{passes} warm-up passes; please report it (FT_ENABLED=0 serves without offloading)")
        manager.wait_for_host_blocks()
        cfg = settings.config
        if passes and cfg.profile_storage_dir is not None and not cfg.profile_read_only:
            ft.save_profile(cfg.profile_storage_dir, name=settings.manager)
            logger.info("flextensor: profile saved to %s", cfg.profile_storage_dir)

    # ------------------------------------------------------------------------------------------ reporting
    def flextensor_report(self) -> dict[str, Any]:
        """Role, phase, device, offloaded tensors and warm-up passes of this worker's manager (JSON-able)."""
        settings = self.flextensor_settings()
        if not settings.config.enabled:
            return {"enabled": False, "pid": os.getpid()}
        manager = ft.get_offload_manager(settings.manager)
        offloaded = manager.offloaded_tensors if manager.model is not None else {}
        return {"enabled": True, "pid": os.getpid(), "manager": settings.manager, "role": self.flextensor_role,
                "phase": None if manager.phase is None else manager.phase.value, "device": str(manager.device),
                "offloaded_tensors": sum(map(len, offloaded.values())), "offloaded_traps": len(offloaded),
                "warmup_passes": getattr(self, "_flextensor_warmup_passes", 0),
                "compilation_mode": CompilationMode(self.vllm_config.compilation_config.mode).name,
                "include_patterns": list(settings.config.include_patterns),
                "exclude_patterns": list(settings.config.exclude_patterns)}

    # ------------------------------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.release_offload()

    def release_offload(self) -> None:
        """Release the manager (its host blocks); the model is not used after shutdown."""
        settings = getattr(self, "_flextensor_settings", None)
        if settings is not None and settings.config.enabled:
            manager = ft.get_offload_manager(settings.manager)
            if manager.model is not None:
                ft.release(settings.manager, preserve_model=False)
