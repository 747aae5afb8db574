"""``EngineContext``: everything one offloaded model's engine knows, grouped by the phase that fills it.

The manager makes one context per ``offload()`` (or adoption) and drops it at ``release()``; the phase handlers
(``flextensor.engine.phase``) and the engine's functions receive it and work on its fields. Nothing outside the
engine writes them: the manager reads them for its reports, tests read them through ``OffloadManager.engine``.

Groups, in the order a model meets them:

- the model itself (top level): its tensors by name, where each came from, the traps, the trap order, which
  tensors several traps share and which each trap may offload alone (``exclusive``);
- :class:`WarmupState`: the warm-up's device copies and the pinned staging of their sources
  (``flextensor.engine.warmup``);
- :class:`ProfileState`: DISCOVERY's recorder and PROFILING's trap windows and duration samples
  (``flextensor.engine.profiling``);
- :class:`PlanState`: what the switch measured and decided (``flextensor.engine.switch``), also what a saved
  profile or a published state carries;
- :class:`InferenceState`: the host blocks, where each offloaded tensor sits in them, the block loader, and a
  host-block build still running behind resident inference (``flextensor.engine.build``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, NamedTuple, Sequence

import torch
from torch import nn

from flextensor.configuration.config import OffloadConfig
from flextensor.engine.policy import EnginePolicy
from flextensor.planning.plan_model import TrapCost
from flextensor.planning.warmup_rule import WarmupDecision
from flextensor.runtime.host_block_build import HostBlockBuild, SourceHandover
from flextensor.runtime.host_memory import BlockLayout, HostBlock, HostBlockProvider, TensorPlacement
from flextensor.runtime.loaders.arena_loader import make_loader
from flextensor.runtime.loaders.block_loader import StreamingLoader
from flextensor.runtime.pinned.in_place import PinnedStaging
from flextensor.runtime.stall_probe import StallProbe
from flextensor.runtime.graph_timing import offload_timing_collector
from flextensor.runtime.timing import TimingCollector
from flextensor.runtime.trap_windows import PassWindows, TrapWindow
from flextensor.runtime.usage_recorder import UsageRecorder
from flextensor.runtime.loaders.warm_loader import WarmLoader
from flextensor.state import ModelTensor

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.hooks import Trap

__all__ = ["block_loader", "compute_device", "check_devices", "EngineContext", "WarmupState", "ProfileState", "PlanState", "InferenceState", "SwitchInputs", "DeferredPlan",
           "ReplanState"]

#: Makes the provider of the INFERENCE host blocks (``register_in_place=True``: never PyTorch's pinned allocator,
#: for a build on a thread behind running inference or from a checkpoint). The manager supplies it: private pinned or pageable memory, or shared memory whose namespace
#: membership the session (or the manager's low-level path) already holds.
ProviderFactory = Callable[..., HostBlockProvider]


class SwitchInputs(NamedTuple):
    """What the switch to INFERENCE needs that no PROFILING timing changes, per trap label.

    ``traps``: the planner's ``TrapCost`` of each trap with its exclusive tensors of non-zero size (aligned
    bytes, the trap's order) and no timings yet (``flextensor.engine.switch`` adds them with ``TrapCost.timed``); ``whole``: the
    packed block of all of them, with the names it packs, for the usual plan that streams a trap whole (a plan
    streaming part of a trap packs that part at the switch); ``exclusive_bytes``: each exclusive tensor's
    unaligned bytes; ``others``: every other model tensor, whose bytes are counted at the switch (a buffer may
    grow in place while the model is profiled; exclusive tensors are parameters, whose shape, dtype and layout
    are taken as fixed from the first counted pass on).
    """

    traps: dict[str, TrapCost]
    whole: dict[str, tuple[tuple[str, ...], BlockLayout]]
    exclusive_bytes: dict[str, int]
    others: tuple[torch.Tensor, ...]


class DeferredPlan(NamedTuple):
    """What a deferred build will stream, kept until :func:`install_deferred` points the tensors at it."""

    layouts: list[BlockLayout]
    schedule: list[str]
    num_slots: int
    streamed: list[list[torch.Tensor]]  # the model's tensor objects, one list per block
    # After a stream-mode warm-up: trap label -> its streamed tensors, which the warm loader copies per call
    # until the blocks are installed (empty after a resident warm-up: the tensors hold their device copies)
    copied: dict[str, list[torch.Tensor]] = {}
    # With ``copied``: moves each trap's tensors onto its block as the build fills it, bracketing the copies per
    # call (Note [sources handed over block by block] in flextensor.runtime.host_block_build)
    handover: SourceHandover | None = None


def compute_device(config: OffloadConfig) -> torch.device:
    """Where an engine with ``config`` computes: its ``gpu_device`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", config.gpu_device)
    return torch.device("cpu")


def block_loader(ctx: EngineContext, layouts: Sequence[BlockLayout], host_blocks: Sequence[HostBlock],
                 schedule: Sequence[int], num_slots: int, *, small_slot: int = 0,
                 host_block_gate: Callable[[int], None] | None = None) -> StreamingLoader:
    """The loader of ``ctx``'s transfer mode that streams ``host_blocks`` (one per layout, in order) into the
    model's tensors of each layout, on the schedule given: the one construction the build, a replan and a wake
    share."""
    return make_loader(ctx.config.transfer_mode, device=ctx.device, layouts=layouts,
                       host_blocks=[b.tensor for b in host_blocks],
                       params=[[ctx.tensors[p.name].tensor for p in layout.tensors] for layout in layouts],
                       schedule=schedule, num_slots=num_slots, small_slot=small_slot, timing=ctx.timing,
                       host_block_gate=host_block_gate)


def check_devices(config: OffloadConfig) -> None:
    """Refuse an enabled ``config`` this host cannot run: ``pinned_memory`` without CUDA (``RuntimeError``), or a
    ``gpu_device`` past the visible ones (``ValueError``). ``OffloadConfig`` itself knows no host, so a manager
    checks when the config is applied."""
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


@dataclass(eq=False)
class WarmupState:
    """The warm-up's device copies (``flextensor.engine.warmup``)."""

    loader: WarmLoader
    staging: PinnedStaging
    decision: WarmupDecision | None = None
    pending: list[str] = field(default_factory=list)  # resident warm-up: names to copy at the first pass's start
    events: list[tuple[int, Any, Any]] = field(default_factory=list)  # timed copies: (bytes, start, end) events
    ready: dict[str | None, Any] = field(default_factory=dict)  # trap label -> event of its overlapped copy
    settled: dict[str, int] = field(default_factory=dict)  # trap label -> WarmLoader.removals when all were kept
    last: Any = None  # the last overlapped copy's event (orders everything after the first pass)
    stream: Any = None  # side stream for the overlapped preload, made in offload()


@dataclass(eq=False)
class ProfileState:
    """DISCOVERY and PROFILING passes (``flextensor.engine.discovery``, ``flextensor.engine.profiling``)."""

    iteration: int = 0  # counted warm-up passes (DISCOVERY and PROFILING together)
    suspend: int = 0  # suspend_profiling() depth
    recorder: UsageRecorder | None = None
    pass_sequence: list[str] = field(default_factory=list)  # traps entered in this pass, in order
    windows: list[TrapWindow] = field(default_factory=list)  # this pass's trap windows
    on_device: bool = True  # this pass marks every trap entry on the device
    pending: list[PassWindows] = field(default_factory=list)  # counted passes not read yet
    kept_up: bool = False  # the newest pass read kept up with the host: time traps on the host clock
    durations: dict[str, list[float]] = field(default_factory=dict)
    host_durations: dict[str, list[float]] = field(default_factory=dict)
    switch_inputs: SwitchInputs | None = None  # prepared after the first counted pass


@dataclass(eq=False)
class PlanState:
    """What the switch to INFERENCE measured and decided (or what an adopted state says it did)."""

    compute_s: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) transfer samples
    strategy_name: str = ""
    explanation: list[str] = field(default_factory=list)
    small_slot: int = 0  # bytes of the loader's small last slot, 0 for none (flextensor.planning.slot_model)


@dataclass(eq=False)
class InferenceState:
    """The INFERENCE allocation (``flextensor.engine.build``)."""

    layouts: list[BlockLayout] = field(default_factory=list)
    placement: dict[str, tuple[int, TensorPlacement]] = field(default_factory=dict)  # name -> (block, place)
    host_blocks: list[HostBlock] = field(default_factory=list)
    provider: HostBlockProvider | None = None
    loader: StreamingLoader | None = None
    block_of: dict[str, int] = field(default_factory=dict)  # trap label -> block index
    deferred: HostBlockBuild | None = None  # host blocks building behind resident inference
    deferred_plan: DeferredPlan | None = None  # what the deferred build streams, kept until it is installed
    host_build_s: float | None = None  # how long the last background host-block build took
    state_dict_hook: Any = None  # makes state_dict() read streamed tensors from their host blocks
    resident_blocks: set[str] = field(default_factory=set)  # traps a replan made resident (host block kept)
    replan: ReplanState = field(default_factory=lambda: ReplanState())


#: Where a strategy replan stands (``strategy_replan_status().state``).
StrategyReplanState = Literal["idle", "in_progress", "done", "failed"]


@dataclass(eq=False)
class ReplanState:
    """Strategy replanning during INFERENCE (``flextensor.engine.replan``).

    ``state``/``applied`` are what ``strategy_replan_status`` reports. A replan measures ``passes_left`` more
    passes with ``measure`` (every trap timed), waits for the device to pass ``last_mark``, then plans on a
    thread (``planner``) and installs the result between two passes. ``floor_s`` is each trap's smallest compute
    seen (profile and every measurement since), ``excluded`` the traps whose copies were seen to stall: a
    latency-mode plan must hold at every batch the model met, so neither ever grows back.
    """

    state: StrategyReplanState = "idle"
    applied: bool | None = None
    manual: bool = False
    automatic: bool = False
    passes_left: int = 0
    measure: TimingCollector | None = None
    measuring: bool = False  # this pass reports to ``measure``
    last_mark: Any = None
    planner: Any = None  # flextensor.engine.replan.PlannerThread
    probe: StallProbe | None = None
    floor_s: dict[str, float] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)
    stalled: dict[str, float] = field(default_factory=dict)  # trap -> wait ms seen in the measured passes
    generation: int = -1  # the last replay_generation given to update_state
    applied_count: int = 0


@dataclass(eq=False)
class EngineContext:
    """One offloaded model's engine state (see the module docstring)."""

    name: str
    config: OffloadConfig
    device: torch.device
    model: nn.Module
    tensors: dict[str, ModelTensor]
    provider_factory: ProviderFactory
    compile_fn: Callable[[nn.Module], nn.Module] | None = None
    budget_bytes: int | None = None  # set_memory_budget(): used instead of max_gpu_mem_fraction
    policy: EnginePolicy = field(default_factory=EnginePolicy)  # paths forced regardless of the device
    adopted: bool = False  # INFERENCE from a profile or state, without warm-up passes
    allow_replan: bool = True  # allow_strategy_replan: replans may be requested, and armed by stalls
    orig_device: dict[str, torch.device] = field(default_factory=dict)
    traps: dict[str, Trap] = field(default_factory=dict)
    shared: set[str] = field(default_factory=set)  # candidates of several traps: resident
    exclusive: dict[str, list[str]] = field(default_factory=dict)  # trap label -> tensors it may offload
    sequence: list[str] = field(default_factory=list)  # trap labels in call order (one pass)
    clock: TimingCollector | None = None  # PROFILING's trap windows
    timing: TimingCollector | None = None  # offload_timing="eager" / "cuda_graph" records
    # profile_mode="torch_function": the mode that hands shadows to torch calls (flextensor.engine.function_traps)
    function_traps: Any = None  # a FunctionTraps (typed loosely: that module builds on this one)
    warm: WarmupState = field(init=False)
    profile: ProfileState = field(default_factory=ProfileState)
    plan: PlanState = field(default_factory=PlanState)
    inference: InferenceState = field(default_factory=InferenceState)

    def __post_init__(self) -> None:
        self.warm = WarmupState(WarmLoader(self.device), PinnedStaging())
        self.orig_device = {n: e.tensor.device for n, e in self.tensors.items()}
        use_cuda = self.device.type == "cuda"
        self.clock = TimingCollector(use_cuda, self.device)
        self.timing = offload_timing_collector(self.config.offload_timing, self.device)

    @property
    def latency_mode(self) -> bool:
        """No memory budget: neither ``set_memory_budget`` nor ``max_gpu_mem_fraction`` names one."""
        return self.budget_bytes is None and self.config.max_gpu_mem_fraction is None

    @property
    def in_place(self) -> bool:
        """Offloaded tensors are computed from their host blocks directly (Note [CPU in place] in
        ``flextensor.engine.build``)."""
        return self.device.type == "cpu" and not self.policy.stream_on_cpu

    @property
    def iters_before_inference(self) -> int:
        """Warm-up passes before INFERENCE (0 after adopting a profile or state)."""
        if self.adopted:
            return 0
        cfg = self.config
        return (0 if cfg.skip_discovery else cfg.discovery_iters) + cfg.profiling_iters

    def tensor_objs(self, names: Any) -> list[torch.Tensor]:
        """The model's tensor objects for ``names``, in order."""
        tensors = self.tensors
        return [tensors[n].tensor for n in names]

    def to_device(self, tensor: torch.Tensor) -> None:
        """Give a (non-meta) tensor its data on the compute device, keeping the object."""
        if not tensor.is_meta and tensor.device != self.device:
            tensor.data = tensor.data.to(self.device)
