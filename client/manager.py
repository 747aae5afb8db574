"""``OffloadManager``: patches a model in place and drives DISCOVERY -> PROFILING -> INFERENCE.

Lifecycle (see the configuration spec, "Profiling Configuration"):

1. ``offload(model)`` selects traps from the patterns, patches each trap module's ``forward`` (instance
   attribute) and the root module's ``forward`` (which counts passes and drives the phases), and moves every
   tensor that no trap can offload (buffers, parameters outside traps or statically shared by several traps) to
   the compute device. The model object is returned as the "proxy": identity, ``isinstance``, attributes and
   ``state_dict`` keys are unchanged.
2. DISCOVERY (``discovery_iters`` passes; skipped with ``skip_discovery``): a ``TorchFunctionMode`` records which
   trap uses which parameter; a parameter used by several traps or outside traps stays resident.
3. PROFILING (``profiling_iters`` passes): per-trap compute durations (CUDA events / perf_counter); each trap's
   weights are put on the device before its timing window opens. Suspended passes record nothing and are not
   counted. After the last pass: one transfer sweep, then the strategy (``config.load_strategy`` or
   ``AdaptiveStrategy()``) plans which tensors stream through the rotating device blocks.
4. INFERENCE: offloaded tensors are packed into host blocks (one per trap), the rest is resident on the device,
   and the :class:`~flextensor.loader.BlockLoader` streams blocks ahead of compute. After a resident warm-up the
   blocks are built on a thread while the first INFERENCE passes run resident, and streaming starts at the first
   pass boundary after that (``flextensor.deferred_build``; ``wait_for_host_blocks()`` switches at once).

Adoption (``offload_from_state`` / profiles) skips 2-3: the state says what is offloaded, where, and in which
order traps run; host blocks may be supplied by the caller (shared memory), in which case they are used as-is.

Threading: a manager belongs to the thread that created it; any other thread gets ``RuntimeError``.

Pinned staging (``flextensor.staging``): with a CUDA compute device and ``pinned_memory=True``, ``offload()``
registers the candidates' own CPU storages in place, so the warm-up copies of steps 2-3 are direct DMA
(``non_blocking``) instead of bounced pageable copies; the registration ends once the host blocks are built or at
``release()``.

Warm-up residency (``flextensor.warmup``): ``offload()`` decides once whether the candidates fit on the device
(budget or free memory less a margin). If they do, the first warm-up pass copies them all before any trap runs
and they stay there until INFERENCE is built (one copy per tensor for the whole warm-up; no copy in any timed
region, the first PROFILING pass included); if not, each trap's weights are copied per call as before. One INFO
line says which mode and why.

Module map: this file holds setup (``offload``, adoption entry points, config) and reports;
``flextensor.phases`` the per-pass phase machine, traps and profiling controls; ``flextensor.teardown``
``release()``; ``flextensor.inference`` planning and the INFERENCE build; ``flextensor.adoption`` states.

``profile_mode``: "view" and "getter" run the same mechanism here: before a trap's timing window opens, its
offloadable weights are copied to the device (``.data`` swap) and put back after it, so timings exclude copies
and contain no attribute-getter indirection.

``compile_fn`` (minimal support): applied once per trap to a parameterless shim around the trap's original
forward (see :class:`~flextensor.traps.ForwardShim`); the engine's loading happens outside the compiled region.
No strategy replan from compiled timings is implemented (``allow_strategy_replan`` is accepted and recorded).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from flextensor.config import OffloadConfig
from flextensor.host_memory import BlockLayout, HostBlock, HostBlockProvider
from flextensor.loader import BlockLoader
from flextensor.patterns import PatternSet
from flextensor.phases import Phase, PhaseMixin
from flextensor.staging import PinnedStaging
from flextensor.state import ModelTensor, TensorManagerState, model_tensors, tensor_nbytes
from flextensor.teardown import ReleaseMixin
from flextensor.timing import OffloadTimingReport, TimingCollector
from flextensor.trap_windows import PassWindows, TrapWindow
from flextensor.traps import Trap, UsageRecorder, WarmLoader
from flextensor.warm_copies import WarmCopiesMixin
from flextensor.warmup import WarmupDecision

# The modules the switch to INFERENCE uses are imported with the manager: imported on first use, they were
# loaded inside the last PROFILING pass of a process's first model (milliseconds the profile phase should not pay).
import flextensor.inference  # noqa: E402,F401  (plan_inference, build_inference, deferred_build)
import flextensor.strategies  # noqa: E402,F401  (AdaptiveStrategy, plan_model, basic_strategies)

__all__ = ["OffloadManager", "Phase", "GPUMemoryUsage", "compute_device"]

logger = logging.getLogger(__name__)
MB = 1024 * 1024


@dataclass(frozen=True)
class GPUMemoryUsage:
    """Device memory held by the engine: rotating blocks + resident tensors (bytes and MB)."""

    block_bytes: int
    resident_bytes: int
    total_bytes: int
    block_mb: float = field(init=False)
    resident_mb: float = field(init=False)
    total_mb: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_mb", self.block_bytes / MB)
        object.__setattr__(self, "resident_mb", self.resident_bytes / MB)
        object.__setattr__(self, "total_mb", self.total_bytes / MB)


def compute_device(config: OffloadConfig) -> torch.device:
    """Where a manager with ``config`` computes: its ``gpu_device`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", config.gpu_device)
    return torch.device("cpu")


class OffloadManager(PhaseMixin, WarmCopiesMixin, ReleaseMixin):
    """One named offload engine instance (see the module docstring).

    The per-pass phase machine, ``offload_block`` and the profiling controls come from
    :class:`~flextensor.phases.PhaseMixin`; ``release()`` from :class:`~flextensor.teardown.ReleaseMixin`.
    """

    def __init__(self, name: str = "default", config: OffloadConfig | None = None) -> None:
        self.name = name
        self._thread = threading.get_ident()
        self.config: OffloadConfig | None = None
        self._pending_state: TensorManagerState | None = None
        self._budget_override: int | None = None
        # Internal (tests): force the warm-up mode, "resident" or "stream" (flextensor.warmup); survives release().
        self._warmup_override: str | None = None
        self.allow_strategy_replan = True
        self._reset()
        if config is not None:
            self.set_config(config)

    # ------------------------------------------------------------------------------------------------ basics
    def _reset(self) -> None:
        self.model: nn.Module | None = None
        self._phase: Phase | None = None
        self._iteration = 0
        self._suspend = 0
        self._adopted = False
        self._device = torch.device("cpu")
        self._traps: dict[str, Trap] = {}
        self._tensors: dict[str, ModelTensor] = {}
        self._orig_device: dict[str, torch.device] = {}
        self._shared: set[str] = set()
        self._exclusive: dict[str, list[str]] = {}
        self._recorder: UsageRecorder | None = None
        self._warm = WarmLoader(self._device)
        self._warmup: WarmupDecision | None = None
        self._warm_pending: list[str] = []  # resident warm-up: names to copy at the start of the first pass
        self._warm_events: list[tuple[int, Any, Any]] = []  # resident warm-up copies per trap: (bytes, start, end)
        self._warm_ready: dict[str | None, Any] = {}  # trap label -> event of its overlapped warm-up copy
        self._warm_settled: dict[str, int] = {}  # trap label -> WarmLoader.removals when all its tensors were kept
        self._warm_last: Any = None  # the last overlapped warm-up copy's event (orders everything after the pass)
        self._warm_stream: Any = None  # side stream for the overlapped preload, made in offload() (see there)
        self._deferred: Any = None  # a HostBlockBuild running behind resident inference (flextensor.deferred_build)
        self._deferred_plan: Any = None
        self._host_build_s: float | None = None  # how long the last background host-block build took
        self._staging = PinnedStaging()
        self._sequence: list[str] = []
        self._pass_sequence: list[str] = []
        self._pass_windows: list[TrapWindow] = []  # this pass's trap windows (flextensor.trap_windows)
        self._pass_on_device = True  # this pass marks every trap entry on the device
        self._pending_windows: list[PassWindows] = []  # counted PROFILING passes not read yet
        self._device_kept_up = False  # the newest pass read kept up with the host: time traps on the host clock
        self._durations: dict[str, list[float]] = {}
        self._host_durations: dict[str, list[float]] = {}  # the same windows on the host's clock
        self._compute_s: dict[str, float] = {}
        self._samples: list[tuple[int, float]] = []
        self._switch_inputs: Any = None  # flextensor.inference.SwitchInputs, prepared after the first counted pass
        self._strategy_name = ""
        self._explanation: list[str] = []
        self._layouts: list[BlockLayout] = []
        self._placement: dict[str, tuple[int, Any]] = {}
        self._host_blocks: list[HostBlock] = []
        self._provider: HostBlockProvider | None = None
        self._loader: BlockLoader | None = None
        self._block_of: dict[str, int] = {}
        self._timing: TimingCollector | None = None
        self._clock: TimingCollector | None = None
        self._active: Trap | None = None
        self._active_phase: Phase | None = None
        self._depth = 0
        self._root_previous: Any = None
        self._root_had_forward = False
        self._compile_fn: Callable[[nn.Module], nn.Module] | None = None
        self._shm_owner: Any = None
        self._shm_coordinator: Any = None

    def _check_thread(self) -> None:
        current = threading.get_ident()
        if current != self._thread:
            raise RuntimeError(
                f"OffloadManager {self.name!r} was created by thread {self._thread} and cannot be used from thread "
                f"{current}: FlexTensor is single-threaded; create a separately named manager (and model) per thread"
            )

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enabled

    @property
    def phase(self) -> Phase | None:
        """The current phase; ``None`` before ``offload()`` and when offloading is disabled."""
        return self._phase

    @property
    def iters_before_inference(self) -> int:
        """Forward passes from ``offload()`` to INFERENCE for this path (0 after adopting a profile/state)."""
        if not self.enabled or self._adopted:
            return 0
        cfg = self.config
        assert cfg is not None
        return (0 if cfg.skip_discovery else cfg.discovery_iters) + cfg.profiling_iters

    @property
    def device(self) -> torch.device:
        return self._device

    def set_config(self, config: OffloadConfig) -> None:
        """Apply a config (copied). Refused while a model is offloaded; ``pinned_memory`` needs CUDA."""
        self._check_thread()
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"set_config expects an OffloadConfig, got {type(config).__name__}")
        if self.model is not None:
            raise RuntimeError(f"manager {self.name!r} is offloading a model; release() it before changing its config")
        config = copy.copy(config)  # re-validates, never aliases the caller's lists
        if config.enabled and config.pinned_memory and not torch.cuda.is_available():
            raise RuntimeError(
                "OffloadConfig(pinned_memory=True) needs CUDA, but torch.cuda.is_available() is False on this host; "
                "set pinned_memory=False on CPU-only hosts (the CPU then serves as the compute device)"
            )
        if config.enabled and torch.cuda.is_available() and config.gpu_device >= torch.cuda.device_count():
            raise ValueError(
                f"OffloadConfig(gpu_device={config.gpu_device}) but only {torch.cuda.device_count()} CUDA device(s) "
                "are visible; pick an index below that (CUDA_VISIBLE_DEVICES renumbers devices)"
            )
        self.config = config

    def set_memory_budget(self, nbytes: int | None) -> None:
        """Absolute device budget (bytes) for memory mode, used instead of ``max_gpu_mem_fraction``.

        For applications that know their budget and for CPU-only runs (where the "device" is host RAM);
        ``None`` restores the config's behaviour. Takes effect at the next planning.
        """
        self._check_thread()
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0):
            raise ValueError(f"set_memory_budget expects None or an int >= 0 (bytes), got {nbytes!r}")
        self._budget_override = nbytes

    def _config(self) -> OffloadConfig:
        if self.config is None:
            self.set_config(OffloadConfig())
        assert self.config is not None
        return self.config

    def _compute_device(self) -> torch.device:
        return compute_device(self._config())

    # ------------------------------------------------------------------------------------------------ offload
    def offload(
        self,
        model: nn.Module,
        config: OffloadConfig | None = None,
        compile_fn: Callable[[nn.Module], nn.Module] | None = None,
        *,
        shm_owner: Any = None,
    ) -> nn.Module:
        """Patch ``model`` in place and return it. With a loaded profile pending, adopt it instead."""
        self._check_thread()
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
        meta = [n for n, t in tensors.items() if t.tensor.is_meta]
        if meta:
            raise ValueError(
                f"model tensor {meta[0]!r} (and {len(meta) - 1} more) is on the meta device: discovery and profiling "
                "need real weights; load them first, or use offload_from_profile(..., weights=...) with a saved profile"
            )
        specs = PatternSet(cfg.include_patterns, cfg.exclude_patterns).select_traps(model)
        if not specs:
            logger.warning("manager %r: no module matched include_patterns=%r (exclude_patterns=%r); nothing will "
                           "be offloaded", self.name, cfg.include_patterns, cfg.exclude_patterns)
        self._begin(model, tensors, compile_fn, shm_owner)
        try:
            owners: dict[str, str] = {}
            for spec in specs:
                for name, _p in spec.params:
                    if name in owners:
                        self._shared.add(name)
                    owners.setdefault(name, spec.label)
                self._traps[spec.label] = Trap(spec.label, spec.module, spec.param_names)
            candidates = set(owners) - self._shared
            for name, entry in self._tensors.items():
                if name not in candidates:
                    self._to_device(entry)
            self._stage(candidates)
            self._choose_warmup(candidates)
            if cfg.skip_discovery:
                self._exclusive = {label: [n for n in t.candidates if n in candidates] for label, t in self._traps.items()}
                self._phase = Phase.PROFILING
                self._warm_stream = self._overlap_stream()
            else:
                names_by_id = {id(e.tensor): n for n, e in self._tensors.items() if e.kind == "parameter"}
                self._recorder = UsageRecorder(names_by_id, self._device, non_blocking=self._warm.non_blocking)
                self._phase = Phase.DISCOVERY
            for trap in self._traps.values():
                trap.install(self, compile_fn)
            self._write_instrumentation()
        except BaseException:
            self._teardown(preserve_model=True)
            raise
        logger.info("manager %r: %d traps on %s; %s for %d passes", self.name, len(self._traps), self._device,
                    self._phase.value if self._phase else "-", self.iters_before_inference)
        return model

    def _begin(self, model: nn.Module, tensors: dict[str, ModelTensor], compile_fn: Any, shm_owner: Any) -> None:
        cfg = self._config()
        self.model = model
        self._device = self._compute_device()
        self._warm = WarmLoader(self._device)
        self._warm_settled = {}
        self._tensors = tensors
        self._orig_device = {n: e.tensor.device for n, e in tensors.items()}
        self._compile_fn = compile_fn
        self._shm_owner = shm_owner
        use_cuda = self._device.type == "cuda"
        self._clock = TimingCollector(use_cuda, self._device)
        self._timing = TimingCollector(use_cuda, self._device) if cfg.offload_timing == "eager" else None
        self._install_root(model)

    def _to_device(self, entry: ModelTensor) -> None:
        t = entry.tensor
        if not t.is_meta and t.device != self._device:
            t.data = t.data.to(self._device)

    # ------------------------------------------------------------------------------------------------ inference
    def _build_inference(self, layouts: list[BlockLayout], schedule: list[str], num_slots: int,
                         host_blocks: Sequence[torch.Tensor] | None = None,
                         weights: Mapping[str, torch.Tensor] | None = None,
                         block_names: Sequence[str] | None = None,
                         host_block_gate: Callable[[int], None] | None = None) -> None:
        from flextensor.inference import build_inference

        build_inference(self, layouts, schedule, num_slots, host_blocks, weights, block_names, host_block_gate)

    # ------------------------------------------------------------------------------------------------ state
    def export_state(self) -> TensorManagerState:
        """A snapshot of the live INFERENCE allocation (placements, block sizes and names, timings, plan)."""
        from flextensor.adoption import export_state

        self._check_thread()
        self.wait_for_host_blocks()
        return export_state(self)

    def offload_from_state(
        self,
        model: nn.Module,
        state: TensorManagerState,
        config: OffloadConfig | None = None,
        *,
        allow_strategy_replan: bool = True,
        host_blocks: Sequence[torch.Tensor] | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        compile_fn: Callable[[nn.Module], nn.Module] | None = None,
        shm_owner: Any = None,
        host_block_gate: Callable[[int], None] | None = None,
    ) -> nn.Module:
        """Adopt ``state`` for ``model`` and enter INFERENCE directly (see ``flextensor.adoption``).

        ``host_block_gate(i)``, when given, is called before each copy from host block ``i`` and returns once the
        block may be read at full speed (a shared session registers its blocks in the background).
        """
        from flextensor.adoption import adopt_state

        self._check_thread()
        if config is not None:
            self.set_config(config)
        if not self._config().enabled:
            return model
        if self.model is not None:
            raise RuntimeError(f"manager {self.name!r} already offloads a model; release() it first")
        self.allow_strategy_replan = allow_strategy_replan
        return adopt_state(self, model, state, host_blocks=host_blocks, weights=weights, compile_fn=compile_fn,
                           shm_owner=shm_owner, host_block_gate=host_block_gate)

    def wait_for_host_blocks(self) -> None:
        """Return once INFERENCE streams from its host blocks (see ``flextensor.deferred_build``).

        After a resident warm-up the blocks are built on a thread while the first inference passes run with
        every weight on the device; the engine switches to streaming at the next pass boundary on its own. Call
        this to switch now (e.g. before measuring); it raises the build's error if it failed. Called while a
        forward pass runs (a hook inside a trap asking for a report), it only waits for the build: the switch
        itself always happens between passes, never under a running trap's weights.
        """
        if self._deferred is None:
            return
        self._check_thread()
        if self._depth:
            self._deferred.wait()
            return
        from flextensor.deferred_build import install_deferred

        install_deferred(self)

    # ------------------------------------------------------------------------------------------------ reports
    def get_gpu_memory_usage(self) -> GPUMemoryUsage:
        self._check_thread()
        self.wait_for_host_blocks()
        if not self.enabled:
            return GPUMemoryUsage(0, 0, 0)
        if self._phase is not Phase.INFERENCE:
            raise RuntimeError(
                f"get_gpu_memory_usage: manager {self.name!r} is in phase "
                f"{self._phase.value if self._phase else 'none'}; it reports after INFERENCE starts "
                f"({self.iters_before_inference} forward passes after offload())"
            )
        blocks = self._loader.device_bytes if self._loader is not None else 0
        resident = sum(tensor_nbytes(e.tensor) for n, e in self._tensors.items()
                       if n not in self._placement and e.tensor.device == self._device)
        return GPUMemoryUsage(blocks, resident, blocks + resident)

    @property
    def offloaded_tensors(self) -> dict[str, list[str]]:
        """Trap label -> names of the tensors it streams (INFERENCE)."""
        self.wait_for_host_blocks()
        return {l.label: [p.name for p in l.tensors] for l in self._layouts}

    @property
    def trap_labels(self) -> list[str]:
        return list(self._traps)

    @property
    def loader(self) -> BlockLoader | None:
        self.wait_for_host_blocks()
        return self._loader

    def collect_offload_timing(self) -> OffloadTimingReport | None:
        self._check_thread()
        return self._timing.collect() if self._timing is not None else None

    def reset_offload_timing(self) -> None:
        self._check_thread()
        if self._timing is not None:
            self._timing.reset()

    # ------------------------------------------------------------------------------------------------ profiles
    def save_profile(self, profile_directory: str | os.PathLike[str] | None = None) -> Path:
        from flextensor.profiles import write_profile

        self._check_thread()
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
        from flextensor.profiles import read_profile

        self._check_thread()
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
        if self.model is not None:
            if target is not self.model:
                raise RuntimeError(f"manager {self.name!r} already offloads another model; release() it first")
            compile_fn = self._compile_fn
            self.release(preserve_model=True)
        else:
            compile_fn = None
        self.offload_from_state(target, state, weights=weights, compile_fn=compile_fn)

    # ------------------------------------------------------------------------------------------------ misc
    def _write_instrumentation(self) -> None:
        cfg = self._config()
        if not cfg.enable_instrumentation:
            return
        out = Path(cfg.instrumentation_output_dir)
        out.mkdir(parents=True, exist_ok=True)
        record = {"manager": self.name, "config": cfg.to_dict(), "device": str(self._device),
                  "traps": {label: t.candidates for label, t in self._traps.items()}}
        (out / f"{self.name}.offload_manager.json").write_text(json.dumps(record, indent=1, default=str))

    def __repr__(self) -> str:
        phase = self._phase.value if self._phase else "idle"
        return f"OffloadManager(name={self.name!r}, phase={phase}, traps={len(self._traps)})"
