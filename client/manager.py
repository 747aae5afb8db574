"""``OffloadManager``: one named engine instance; patches a model in place and owns its phase.

Lifecycle: ``offload(model)`` selects traps from the patterns, patches each trap module's ``forward`` (an
instance attribute) and the root module's ``forward`` (which frames a pass), and returns the model itself, so
identity, ``isinstance`` and ``state_dict`` keys are unchanged (``flextensor.engine.discovery``). DISCOVERY learns
which trap uses which parameter, PROFILING times each trap, the switch plans what streams
(``flextensor.engine.switch``), and INFERENCE streams host blocks through a few rotating device blocks
(``flextensor.engine.build``, ``flextensor.engine.inference``). Adoption of a profile or state starts there.

The manager holds the engine's state in one :class:`~flextensor.engine.context.EngineContext` (``engine``) and
a :class:`~flextensor.engine.phase_driver.PhaseDriver` holding the current phase handler, to which the root
forward and the trap forwards send each pass's start and end and each trap's entry and exit; the manager alone
hands it a new phase between passes (Note [phases and handlers] in ``flextensor.engine.phase``). It also owns
what outlives a model: the config, the memory budget, a profile loaded ahead of ``offload()``, and a
shared-memory namespace it joined for ``shm_enabled`` without a session.

``sleep()`` frees the device memory of a model in INFERENCE and ``wake()`` brings it back with the same plan
(Note [sleep and wake] in ``flextensor.engine.sleep``); a shared session hands the manager the host copy its
resident tensors come back from (``set_host_copy``).

Threading: a manager belongs to the thread that created it; any other thread gets ``RuntimeError``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

# The engine's modules are imported with the manager: imported on first use, the switch's were loaded inside
# the last PROFILING pass of a process's first model (milliseconds the profile phase should not pay).
from flextensor.configuration.config import OffloadConfig
from flextensor.engine import adoption
from flextensor.engine.build import Weight, install_deferred
from flextensor.engine.context import EngineContext, check_devices, compute_device
from flextensor.engine.discovery import select_warmup_traps, start_warmup
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.engine.phase_driver import PhaseDriver
from flextensor.engine.policy import EnginePolicy, default_engine_policy
from flextensor.engine.profiling import clear_durations, resolve_windows
from flextensor.engine.sleep import HostCopy, SleepingHandler, SleepState, put_to_sleep, restore_on_host, wake_up
from flextensor.errors import ModelAsleepError
from flextensor.engine import replan
from flextensor.engine.replan import StrategyReplanStatus
from flextensor.engine.teardown import teardown
from flextensor.memory_usage import GPUMemoryUsage, engine_memory_usage, offloaded_tensors
from flextensor.profiles import read_profile, write_instrumentation, write_profile
from flextensor.runtime.loaders.block_loader import StreamingLoader
from flextensor.runtime.timing import OffloadTimingReport
from flextensor.standalone_namespace import StandaloneNamespace
from flextensor.state import TensorManagerState, model_tensors

if TYPE_CHECKING:  # pragma: no cover - the shm modules load at the first shared offload, not at import
    from flextensor.shm.owner import ShmOwner

__all__ = ["OffloadManager", "Phase", "GPUMemoryUsage", "compute_device"]

logger = logging.getLogger(__name__)


class OffloadManager:
    """One named offload engine instance (see the module docstring)."""

    def __init__(self, name: str = "default", config: OffloadConfig | None = None) -> None:
        self.name = name
        self._thread = threading.get_ident()
        self.config: OffloadConfig | None = None
        self._pending_state: TensorManagerState | None = None
        self._budget_override: int | None = None
        self._policy: EnginePolicy | None = None  # set_engine_policy(); None: the process default
        self._suspend_pending = 0  # suspend_profiling() before offload(): handed to the next engine
        self._own_namespace = StandaloneNamespace()  # joined for shm_enabled without a session
        self._allow_replan = True
        self._reset()
        if config is not None:
            self.set_config(config)

    def _reset(self) -> None:
        self.model: nn.Module | None = None
        self._ctx: EngineContext | None = None
        self._driver: PhaseDriver | None = None  # the current phase handler and the patched forwards' calls
        self._host_copy: HostCopy | None = None  # set_host_copy(): where a sleeping model's resident tensors are

    @property
    def owner_thread(self) -> int:
        """The ident of the thread that created this manager: the only one that may use it."""
        return self._thread

    def check_thread(self) -> None:
        """``RuntimeError`` unless the calling thread is :attr:`owner_thread` (managers are single-threaded)."""
        current = threading.get_ident()
        if current != self._thread:
            raise RuntimeError(
                f"OffloadManager {self.name!r} was created by thread {self._thread} and cannot be used from thread "
                f"{current}: FlexTensor is single-threaded; create a separately named manager (and model) per thread"
            )

    @property
    def _handler(self) -> PhaseHandler | None:
        """The current phase's handler (held by the driver); ``None`` without an offloaded model."""
        return self._driver.handler if self._driver is not None else None

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enabled

    @property
    def phase(self) -> Phase | None:
        """The current phase; ``None`` before ``offload()`` and when offloading is disabled."""
        return self._handler.phase if self._handler is not None else None

    @property
    def engine(self) -> EngineContext | None:
        """The engine's state for the offloaded model (None without one): for reports, diagnostics and tests.
        Read it; the manager and its phase handlers are the ones that change it."""
        return self._ctx

    @property
    def iters_before_inference(self) -> int:
        """Forward passes from ``offload()`` to INFERENCE for this path (0 after adopting a profile/state)."""
        if not self.enabled:
            return 0
        if self._ctx is not None:
            return self._ctx.iters_before_inference
        cfg = self.config
        assert cfg is not None
        return (0 if cfg.skip_discovery else cfg.discovery_iters) + cfg.profiling_iters

    @property
    def device(self) -> torch.device:
        return self._ctx.device if self._ctx is not None else torch.device("cpu")

    def set_config(self, config: OffloadConfig) -> None:
        """Apply a config (copied). Refused while a model is offloaded; ``pinned_memory`` needs CUDA."""
        self.check_thread()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"set_config expects an OffloadConfig, got {type(config).__name__}")
        if self.model is not None:
            raise RuntimeError(f"manager {self.name!r} is offloading a model; release() it before changing its config")
        config = copy.copy(config)  # re-validates, never aliases the caller's lists
        check_devices(config)
        self.config = config

    @property
    def engine_policy(self) -> EnginePolicy:
        """The paths the next ``offload()`` forces (:mod:`flextensor.engine.policy`): this manager's own policy,
        else the process default."""
        return self._policy if self._policy is not None else default_engine_policy()

    def set_engine_policy(self, policy: EnginePolicy | None = None, **changes: Any) -> None:
        """Force engine paths for this manager's next ``offload()`` (tests and experiments on hosts without a
        GPU): ``policy`` as given, or the current policy with ``changes`` (``warmup=``, ``stream_on_cpu=``);
        ``set_engine_policy(None)`` goes back to the process default. Refused while a model is offloaded."""
        self.check_thread()
        if self.model is not None:
            raise RuntimeError(f"manager {self.name!r} is offloading a model; release() it before changing its "
                               "engine policy")
        if policy is not None and changes:
            raise ValueError("set_engine_policy takes a policy or field changes, not both")
        if changes:
            policy = dataclasses.replace(self.engine_policy, **changes)
        elif policy is not None and not isinstance(policy, EnginePolicy):
            raise TypeError(f"set_engine_policy expects an EnginePolicy, got {type(policy).__name__}")
        self._policy = policy

    def set_memory_budget(self, nbytes: int | None) -> None:
        """Absolute device budget (bytes) for memory mode, used instead of ``max_gpu_mem_fraction``.

        For applications that know their budget and for CPU-only runs (where the "device" is host RAM);
        ``None`` restores the config's behaviour. Takes effect at the next planning.
        """
        self.check_thread()
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise ValueError(f"set_memory_budget expects None or an int >= 0 (bytes), got {nbytes!r}")
        self._budget_override = nbytes
        if self._ctx is not None:
            self._ctx.budget_bytes = nbytes

    def _inference_context(self) -> EngineContext | None:
        """The engine's context while the phase is INFERENCE, else ``None``."""
        return self._ctx if self.phase is Phase.INFERENCE else None

    def _require_inference(self, what: str) -> EngineContext:
        ctx = self._inference_context()
        if ctx is None and self.phase is Phase.SLEEPING:
            raise ModelAsleepError(f"{what}: manager {self.name!r} is asleep; call wake() first")
        if ctx is None:
            phase = self.phase.value if self.phase is not None else "none (no model offloaded)"
            raise RuntimeError(f"{what}: manager {self.name!r} is in phase {phase}; {what} needs INFERENCE, which "
                               f"starts {self.iters_before_inference} forward passes after offload()")
        return ctx

    def _config(self) -> OffloadConfig:
        if self.config is None:
            self.set_config(OffloadConfig())
        assert self.config is not None
        return self.config

    # ------------------------------------------------------------------------------------------------ offload
    def offload(
        self,
        model: nn.Module,
        config: OffloadConfig | None = None,
        compile_fn: Callable[[nn.Module], nn.Module] | None = None,
        *,
        shm_owner: ShmOwner | None = None,
    ) -> nn.Module:
        """Patch ``model`` in place and return it. With a loaded profile pending, adopt it instead."""
        self.check_thread()
        if config is not None:
            self.set_config(config)
        cfg = self._config()
        if not cfg.enabled:
            return model
        if self.model is not None:
            if model is self.model:
                return model
            raise RuntimeError(f"manager {self.name!r} already offloads another model; release() it or use another name")
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            return self.offload_from_state(model, state, compile_fn=compile_fn, shm_owner=shm_owner)
        tensors = model_tensors(model)
        specs = select_warmup_traps(self.name, cfg, model, tensors)
        ctx, driver = self._begin(model, tensors, compile_fn, shm_owner)
        try:
            handler = start_warmup(ctx, specs, driver.trap_enter, driver.trap_exit)
            driver.switch_to(handler)
            write_instrumentation(self.name, cfg, ctx)
        except BaseException:
            self._teardown(preserve_model=True)
            raise
        logger.info("manager %r: %d traps on %s; %s for %d passes", self.name, len(ctx.traps), ctx.device,
                    handler.phase.value, self.iters_before_inference)
        return model

    def _begin(self, model: nn.Module, tensors: dict, compile_fn: Any,
               shm_owner: ShmOwner | None) -> tuple[EngineContext, PhaseDriver]:
        """A fresh engine context for ``model`` and the driver whose root forward frames its passes."""
        cfg = self._config()
        device = compute_device(cfg)
        providers = self._own_namespace.provider_factory(self.name, cfg, device, shm_owner)
        ctx = EngineContext(self.name, cfg, device, model, tensors, providers,
                            compile_fn=compile_fn, budget_bytes=self._budget_override,
                            policy=self.engine_policy,
                            allow_replan=self._allow_replan)
        ctx.profile.suspend, self._suspend_pending = self._suspend_pending, 0
        self.model, self._ctx = model, ctx
        self._driver = PhaseDriver(ctx, model, self.check_thread)
        return ctx, self._driver

    @contextmanager
    def offload_block(self, block_name: str) -> Iterator[None]:
        """A manual trap around arbitrary code (its exclusive parameters are found during DISCOVERY)."""
        self.check_thread()
        if self.config is not None and not self.config.enabled:
            yield
            return
        if self.config is not None and self.config.skip_discovery:
            raise RuntimeError(
                f"offload_block({block_name!r}) needs DISCOVERY to learn which tensors the block uses, but "
                "skip_discovery=True; set skip_discovery=False"
            )
        if self._driver is None:
            # No model offloaded (yet): the block is plain code, so a model with offload_block markers still
            # runs unmodified (reference runs, enabled=False deployments).
            yield
            return
        with self._driver.block(block_name):
            yield

    # ------------------------------------------------------------------------------------------------ profiling control
    def suspend_profiling(self) -> None:
        """Reference-counted: PROFILING passes record nothing and are not counted while suspended."""
        self.check_thread()
        if not self.enabled:
            return
        if self._ctx is None:
            self._suspend_pending += 1
        else:
            self._ctx.profile.suspend += 1

    def resume_profiling(self) -> None:
        self.check_thread()
        if not self.enabled:
            return
        if not self.profiling_suspended:
            raise RuntimeError(f"resume_profiling() on manager {self.name!r} without a matching suspend_profiling()")
        if self._ctx is None:
            self._suspend_pending -= 1
        else:
            self._ctx.profile.suspend -= 1

    @contextmanager
    def pause_profiling(self) -> Iterator[None]:
        self.suspend_profiling()
        try:
            yield
        finally:
            self.resume_profiling()

    @property
    def profiling_suspended(self) -> bool:
        return (self._ctx.profile.suspend if self._ctx is not None else self._suspend_pending) > 0

    def clear_profiling_durations(self) -> None:
        """Drop every duration sample so far (discovery mappings are kept)."""
        self.check_thread()
        if self._ctx is not None:
            clear_durations(self._ctx)

    @property
    def profiling_durations(self) -> dict[str, list[float]]:
        """Per-trap seconds of each counted PROFILING pass (copy): each trap's window, from its entry to the next
        trap's entry (the last trap's to the end of the pass), summed over its calls in the pass, on the device's
        clock (the host's, for a pass timed on it: ``flextensor.runtime.trap_windows``)."""
        self.check_thread()  # reading the pending passes' events and reusing them is the manager's own work
        if self._ctx is None:
            return {}
        resolve_windows(self._ctx, keep_last=0)
        return {k: list(v) for k, v in self._ctx.profile.durations.items()}

    # ------------------------------------------------------------------------------------------------ state
    def export_state(self) -> TensorManagerState:
        """A snapshot of the live INFERENCE allocation (placements, block sizes and names, timings, plan)."""
        self.check_thread()
        self.wait_for_host_blocks()
        return adoption.export_state(self._require_inference("export_state"))

    def offload_from_state(
        self,
        model: nn.Module,
        state: TensorManagerState,
        config: OffloadConfig | None = None,
        *,
        allow_strategy_replan: bool = True,
        host_blocks: Sequence[torch.Tensor] | None = None,
        weights: Mapping[str, Weight] | None = None,
        compile_fn: Callable[[nn.Module], nn.Module] | None = None,
        shm_owner: ShmOwner | None = None,
        host_block_gate: Callable[[int], None] | None = None,
    ) -> nn.Module:
        """Adopt ``state`` for ``model`` and enter INFERENCE directly (see ``flextensor.engine.adoption``).

        ``host_block_gate(i)``, when given, is called before each copy from host block ``i`` and returns once the
        block may be read at full speed (a shared session registers its blocks in the background).
        """
        self.check_thread()
        if config is not None:
            self.set_config(config)
        cfg = self._config()
        if not cfg.enabled:
            return model
        if self.model is not None:
            raise RuntimeError(f"manager {self.name!r} already offloads a model; release() it first")
        self._allow_replan = bool(allow_strategy_replan)
        checked = adoption.check_state(model, state, cfg, host_blocks=host_blocks, weights=weights)
        ctx, driver = self._begin(model, checked.tensors, compile_fn, shm_owner)
        try:
            driver.switch_to(adoption.adopt_state(ctx, checked, driver.trap_enter, driver.trap_exit,
                                                  host_blocks=host_blocks, weights=weights,
                                                  host_block_gate=host_block_gate))
        except BaseException:
            self._teardown(preserve_model=True)
            raise
        return model

    def wait_for_host_blocks(self) -> None:
        """Return once INFERENCE streams from its host blocks (see ``flextensor.engine.build``).

        After a resident warm-up the blocks are built on a thread while the first inference passes run with
        every weight on the device; the engine switches to streaming at the next pass boundary on its own. Call
        this to switch now (e.g. before measuring); it raises the build's error if it failed. Called while a
        forward pass runs (a hook inside a trap asking for a report), it only waits for the build: the switch
        itself always happens between passes, never under a running trap's weights.
        """
        ctx = self._ctx
        if ctx is None or ctx.inference.deferred is None:
            return
        self.check_thread()
        if self._driver is not None and self._driver.in_pass:
            ctx.inference.deferred.wait()
            return
        install_deferred(ctx)

    # ------------------------------------------------------------------------------------------------ sleep
    @property
    def asleep(self) -> bool:
        """The model's device memory is freed (``sleep()``); passes raise ``ModelAsleepError`` until ``wake()``."""
        return isinstance(self._handler, SleepingHandler)

    @property
    def sleep_state(self) -> SleepState | None:
        """While asleep, what the sleep freed and kept (``flextensor.engine.sleep.SleepState``): for reports and
        tests; None while awake."""
        return self._handler.state if isinstance(self._handler, SleepingHandler) else None

    def set_host_copy(self, host_copy: HostCopy | None) -> None:
        """Where the resident tensors of this manager's model wake from instead of a private host copy made at
        each sleep: a shared session's tensor store (``flextensor.sharing``). For the model offloaded now."""
        self.check_thread()
        if self._ctx is None:
            raise RuntimeError(f"manager {self.name!r} offloads no model: set_host_copy() applies to the model "
                               "offloaded now")
        self._host_copy = host_copy

    def sleep(self) -> None:
        """Free the device memory the offloaded model holds (rotating blocks or arena, resident tensors), keeping
        its plan and one host copy of every weight; a no-op when asleep. Passes raise ``ModelAsleepError`` until
        :meth:`wake`. Needs INFERENCE, between passes (Note [sleep and wake] in ``flextensor.engine.sleep``)."""
        self.check_thread()
        if self.asleep:
            return
        ctx = self._require_inference("sleep()")
        if self._driver is not None and self._driver.in_pass:
            raise RuntimeError(f"sleep() on manager {self.name!r} was called inside a forward pass; call it "
                               "between passes")
        self.wait_for_host_blocks()
        driver, awake = self._driver, self._handler
        assert driver is not None and awake is not None
        state = put_to_sleep(ctx, self._host_copy)
        driver.switch_to(SleepingHandler(ctx, state, awake))

    def wake_ready(self, timeout: float | None = 0.0) -> bool:
        """Whether a :meth:`wake` now copies the resident tensors at link rate (from pinned host memory), after
        waiting up to ``timeout`` seconds (None: no limit) for what the sleep prepares in the background (a shared
        session registers its host copy meanwhile). False while awake, or where the wake copies from pageable
        memory (``pinned_memory=False``, a CPU device, a registration the driver refused)."""
        self.check_thread()
        handler = self._handler
        if not isinstance(handler, SleepingHandler) or self._ctx is None or self._ctx.device.type != "cuda":
            return False
        state = handler.state
        if state.covered and (self._host_copy is None or not self._host_copy.wake_ready(timeout)):
            return False
        return state.provider is None or state.provider.pinned

    def wake(self) -> float:
        """Bring a sleeping model's device memory back (resident tensors at link rate from their host copy, a
        new loader for the same plan) and resume INFERENCE; returns the seconds it took (0.0 when awake)."""
        self.check_thread()
        handler = self._handler
        if not isinstance(handler, SleepingHandler):
            self._require_inference("wake()")
            return 0.0
        assert self._ctx is not None and self._driver is not None
        seconds = wake_up(self._ctx, handler.state, self._host_copy)
        self._driver.switch_to(handler.awake)
        return seconds

    # ------------------------------------------------------------------------------------------------ release
    def release(self, preserve_model: bool = True) -> None:
        """Undo everything: weights back into the model (unless ``preserve_model=False``), forwards unpatched,
        device and host blocks freed. The manager can offload again afterwards."""
        self.check_thread()
        self._pending_state = None
        if self._ctx is None:
            self._own_namespace.leave()
            return
        self._teardown(preserve_model)

    def _teardown(self, preserve_model: bool) -> None:
        """``flextensor.engine.teardown`` for the current context, then the root forward and the namespace."""
        ctx = self._ctx
        try:
            if ctx is not None and isinstance(self._handler, SleepingHandler):
                restore_on_host(ctx, self._handler.state, self._host_copy, preserve_model)
            if ctx is not None:
                teardown(ctx, preserve_model)
        finally:
            if self._driver is not None:
                self._driver.uninstall()
            self._own_namespace.leave()
            self._reset()

    # ------------------------------------------------------------------------------------------------ reports
    def get_gpu_memory_usage(self) -> GPUMemoryUsage:
        self.check_thread()
        self.wait_for_host_blocks()
        if not self.enabled:
            return GPUMemoryUsage(0, 0, 0)
        if self.asleep:  # what a sleeping model still holds on its device: nothing the engine knows of
            assert self._ctx is not None
            return engine_memory_usage(self._ctx)
        return engine_memory_usage(self._require_inference("get_gpu_memory_usage"))

    @property
    def offloaded_tensors(self) -> dict[str, list[str]]:
        """Trap label -> names of the tensors it streams (INFERENCE)."""
        self.wait_for_host_blocks()
        return offloaded_tensors(self._ctx) if self._ctx is not None else {}

    @property
    def trap_labels(self) -> list[str]:
        return list(self._ctx.traps) if self._ctx is not None else []

    @property
    def loader(self) -> StreamingLoader | None:
        self.wait_for_host_blocks()
        return self._ctx.inference.loader if self._ctx is not None else None

    def collect_offload_timing(self) -> OffloadTimingReport | None:
        self.check_thread()
        timing = self._ctx.timing if self._ctx is not None else None
        return timing.collect() if timing is not None else None

    def reset_offload_timing(self) -> None:
        self.check_thread()
        if self._ctx is not None and self._ctx.timing is not None:
            self._ctx.timing.reset()

    def update_offload_timing(self, *, replay_generation: int = -1) -> bool:
        """Publish the passes replayed from CUDA graphs since the last call (``offload_timing="cuda_graph"``;
        Note [timing replayed passes] in ``flextensor.runtime.graph_timing``). ``True`` when published or when
        there is nothing to publish (eager timing stores each pass as its forward returns; timing off);
        ``False`` when the replays' events could not be read. A ``replay_generation >= 0`` already published is
        ignored."""
        self.check_thread()
        timing = self._ctx.timing if self._ctx is not None else None
        return timing.publish_replays(replay_generation) if timing is not None else True

    # ------------------------------------------------------------------------------------------------ replanning
    @property
    def allow_strategy_replan(self) -> bool:
        """Replans may be requested, and armed by stalled copies in latency mode (``flextensor.engine.replan``)."""
        return self._allow_replan

    @allow_strategy_replan.setter
    def allow_strategy_replan(self, value: bool) -> None:
        self._allow_replan = bool(value)
        if self._ctx is not None:
            replan.allow(self._ctx, self._allow_replan)

    def request_strategy_replan(self, *, manual_update_state: bool = False) -> int:
        """Measure the next passes and plan again; the forwards (``update_state()`` steps with
        ``manual_update_state``) to drive, or 0 when nothing was armed (logged why)."""
        self.check_thread()
        self.wait_for_host_blocks()
        return replan.request_if_available(self.name, self._inference_context(), manual=manual_update_state)

    @property
    def strategy_replan_status(self) -> StrategyReplanStatus:
        """A snapshot of the replan state; reading it arms or advances nothing."""
        return replan.status(self._inference_context())

    def update_state(self, *, replay_generation: int = -1) -> None:
        """One step of a replan armed with ``manual_update_state=True`` (after a ``graph.replay()``, which runs
        no hooks); a ``replay_generation`` already counted is ignored. Phases advance in the root forward."""
        self.check_thread()
        ctx = self._inference_context()
        if ctx is not None:
            replan.step(ctx, replay_generation)

    # ------------------------------------------------------------------------------------------------ profiles
    def save_profile(self, profile_directory: str | os.PathLike[str] | None = None) -> Path:
        self.check_thread()
        cfg = self._config()
        if cfg.profile_read_only:
            raise PermissionError(f"manager {self.name!r} has profile_read_only=True: profiles are only loaded, never "
                                  "saved; set profile_read_only=False to save")
        directory = profile_directory if profile_directory is not None else cfg.profile_storage_dir
        if directory is None:
            raise ValueError("save_profile needs a directory: pass profile_directory or set profile_storage_dir")
        return write_profile(directory, self.export_state())

    def load_profile(self, profile_directory: str | os.PathLike[str] | None = None, model: nn.Module | None = None,
                     *, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Read a profile; adopt it for ``model`` (or the model being offloaded) now, else at ``offload()``."""
        self.check_thread()
        cfg = self._config()
        directory = profile_directory if profile_directory is not None else cfg.profile_storage_dir
        if directory is None:
            raise ValueError("load_profile needs a directory: pass profile_directory or set profile_storage_dir")
        state = read_profile(directory)
        if not cfg.enabled:
            return
        target = model if model is not None else self.model
        if target is None:
            self._pending_state = state
            return
        compile_fn = None
        if self._ctx is not None:
            if target is not self.model:
                raise RuntimeError(f"manager {self.name!r} already offloads another model; release() it first")
            compile_fn = self._ctx.compile_fn
            self.release(preserve_model=True)
        self.offload_from_state(target, state, weights=weights, compile_fn=compile_fn)

    def __repr__(self) -> str:
        phase = self.phase.value if self.phase else "idle"
        return f"OffloadManager(name={self.name!r}, phase={phase}, traps={len(self.trap_labels)})"
