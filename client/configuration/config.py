"""`OffloadConfig`: every configuration option (``docs/configuration.md``), validated when the object is built.

Why validate at construction: a bad value found later (at the first forward pass, or inside a worker process
of a shared session) is far from the line that set it. Every check here raises ``ValueError`` whose message
names the option, the bad value and what is allowed, so loaders can prefix the source (env var, file) and the
user can fix it without reading code.

Scope decisions (options whose values this engine does not all implement yet):

- ``transfer_mode``: all three documented modes are implemented. ``"raw_block_transfer"`` manages one device
  arena directly: each streamed block gets a byte range sized to it (``flextensor.runtime.loaders.arena_loader``).
- ``profile_mode``: ``"view"``, ``"getter"`` and ``"torch_function"`` are implemented. ``"torch_function"`` (the
  indirect runtime, ``flextensor.engine.function_traps``) streams from the model's own parameters tensor by
  tensor, so it needs ``transfer_mode="strategy"``, and it keeps no weights in shared memory, so it refuses
  ``shm_enabled``; both combinations are rejected at construction, naming what to use instead.
- ``offload_timing``: ``"off"``, ``"eager"`` and ``"cuda_graph"`` (timing read back after CUDA-graph replays,
  PyTorch >= 2.8, checked when a model is offloaded). ``"eager"`` and ``"cuda_graph"`` need a block transfer
  mode (not ``"strategy"``).

The dataclass is mutable (sessions and managers derive variants with :func:`dataclasses.replace`, which
re-runs validation). Assigning attributes directly skips validation; call :meth:`OffloadConfig.validate`
afterwards if you do. List fields are always copied into fresh lists, so a config never shares a pattern list
with its caller or with another config.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

__all__ = [
    "OffloadConfig",
    "StrategyLike",
    "validate_option",
    "PINNED_MEMORY_MODES",
    "SUPPORTED_TRANSFER_MODES",
    "DOCUMENTED_TRANSFER_MODES",
    "SUPPORTED_PROFILE_MODES",
    "DOCUMENTED_PROFILE_MODES",
    "SUPPORTED_OFFLOAD_TIMING_MODES",
    "DOCUMENTED_OFFLOAD_TIMING_MODES",
    "PIECEWISE_PREFETCH_POLICIES",
    "PATTERN_PREFIXES",
]

PinnedMemoryMode = Literal["torch", "host_register"]
OffloadTiming = Literal["off", "eager", "cuda_graph"]
PiecewisePrefetch = Literal["off", "warn", "error"]

PINNED_MEMORY_MODES: tuple[str, ...] = ("torch", "host_register")
SUPPORTED_TRANSFER_MODES: tuple[str, ...] = ("allocation_block_transfer", "strategy", "raw_block_transfer")
DOCUMENTED_TRANSFER_MODES: tuple[str, ...] = ("strategy", "allocation_block_transfer", "raw_block_transfer")
SUPPORTED_PROFILE_MODES: tuple[str, ...] = ("view", "getter", "torch_function")
DOCUMENTED_PROFILE_MODES: tuple[str, ...] = ("view", "getter", "torch_function")
SUPPORTED_OFFLOAD_TIMING_MODES: tuple[str, ...] = ("off", "eager", "cuda_graph")
DOCUMENTED_OFFLOAD_TIMING_MODES: tuple[str, ...] = ("off", "eager", "cuda_graph")
PIECEWISE_PREFETCH_POLICIES: tuple[str, ...] = ("off", "warn", "error")
# A pattern entry is "<glob>", "name:<glob>" or "class:<glob>"; anything else before a ':' is a typo.
PATTERN_PREFIXES: tuple[str, ...] = ("name", "class")


class StrategyLike(Protocol):
    """What ``load_strategy`` accepts: any object with a ``plan`` method (see ``flextensor.planning.strategies``).

    Duck-typed on purpose: the config must not import the strategy module (and through it the planner's
    dependencies) just to check a type, and users may bring their own strategy objects.
    """

    def plan(self, plan_input: Any) -> Any: ...


# --------------------------------------------------------------------------------------------------------------
# Per-option checks. Each takes (name, value) and returns the normalized value or raises ValueError.
# --------------------------------------------------------------------------------------------------------------


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    text = repr(value)
    if len(text) > 120:
        text = text[:117] + "..."
    return ValueError(f"OffloadConfig option {name!r} got {text}; {allowed}")


def _check_bool(name: str, value: Any) -> bool:
    # bool is final in Python, so `type(...) is bool` also excludes 0/1 and numpy bools: an int where a flag
    # is expected usually means options were passed positionally or mixed up.
    if type(value) is not bool:
        raise _bad(name, value, "expected a bool (True or False)")
    return value


def _int_check(minimum: int, why: str = "") -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(name, value, f"expected an int >= {minimum}{why}")
        if value < minimum:
            raise _bad(name, value, f"expected an int >= {minimum}{why}")
        return int(value)

    return check


def _as_real(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, allowed)
    return float(value)


def _check_max_gpu_mem_fraction(name: str, value: Any) -> float | None:
    allowed = "expected None (latency mode) or a float in (0.0, 1.0], e.g. 0.9 for 90% of device memory"
    if value is None:
        return None
    number = _as_real(name, value, allowed)
    if math.isnan(number) or not 0.0 < number <= 1.0:
        raise _bad(name, value, allowed)
    return number


def _check_shm_wait_timeout(name: str, value: Any) -> float:
    allowed = "expected a finite float >= 0.0 (seconds; 0.0 waits indefinitely)"
    number = _as_real(name, value, allowed)
    if not math.isfinite(number) or number < 0.0:
        raise _bad(name, value, allowed)
    return number


def _check_transfer_budget_scale(name: str, value: Any) -> float:
    allowed = "expected a finite float > 0.0 (multiplier on the transfer time budget; 1.0 is the default)"
    number = _as_real(name, value, allowed)
    if not math.isfinite(number) or number <= 0.0:
        raise _bad(name, value, allowed)
    return number


def _choices(values: Sequence[str]) -> str:
    return ", ".join(repr(v) for v in values)


def _choice_check(allowed_values: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in allowed_values:
            raise _bad(name, value, f"expected one of {_choices(allowed_values)}")
        return value

    return check


def _choice_checker(supported: Sequence[str], noun: str, unimplemented: dict[str, str]) -> Callable[[str, Any], str]:
    """A checker for a string option with a fixed set of values; documented-but-unimplemented values get a reason."""

    def check(name: str, value: Any) -> str:
        allowed = f"supported {noun}: {_choices(supported)}"
        if isinstance(value, str) and value in unimplemented:
            raise _bad(name, value, f"{unimplemented[value]}; {allowed}")
        if not isinstance(value, str) or value not in supported:
            raise _bad(name, value, allowed)
        return value

    return check


_check_transfer_mode = _choice_checker(SUPPORTED_TRANSFER_MODES, "modes", {})
_check_profile_mode = _choice_checker(SUPPORTED_PROFILE_MODES, "modes", {})
_check_offload_timing = _choice_checker(SUPPORTED_OFFLOAD_TIMING_MODES, "values", {})


def _check_patterns(name: str, value: Any) -> list[str]:
    allowed = (
        "expected a list of non-empty strings, each '<glob>', 'name:<glob>' or 'class:<glob>' "
        '(a bare string is not accepted: wrap it in a list, e.g. ["layers.*"])'
    )
    if not isinstance(value, (list, tuple)):
        raise _bad(name, value, allowed)
    result: list[str] = []
    for entry in value:
        if not isinstance(entry, str) or not entry.strip():
            raise _bad(name, value, f"entry {entry!r} is not a non-empty string; {allowed}")
        prefix, sep, glob = entry.partition(":")
        if sep:
            if prefix not in PATTERN_PREFIXES:
                raise _bad(
                    name,
                    value,
                    f"entry {entry!r} has unknown prefix {prefix + ':'!r}; allowed prefixes are 'name:' and "
                    "'class:' (or none: a bare glob matches module/parameter paths)",
                )
            if not glob.strip():
                raise _bad(name, value, f"entry {entry!r} has an empty glob after {prefix + ':'!r}")
        result.append(entry)
    return result  # always a fresh list: the config never aliases the caller's list


def _check_shm_namespace(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(name, value, "expected None or a non-empty base namespace string")
    # Lazy import: flextensor.shm is a lower layer and must stay cheap to import; the rules for names live
    # there (one source of truth for what a namespace may contain).
    from flextensor.shm.names import validate_base_namespace

    try:
        validate_base_namespace(value)
    except ValueError as exc:
        raise ValueError(f"OffloadConfig option {name!r} is not a valid base namespace: {exc}") from exc
    return value


def _check_shm_dir(name: str, value: Any) -> str | None:
    if value is None:
        return None
    # The rules live with the code that makes the segments there (flextensor.shm.segment_dir).
    from flextensor.shm.segment_dir import check_directory

    return check_directory(value, f"OffloadConfig option {name!r}")


def _check_optional_path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    return _check_path(name, value)


def _check_path(name: str, value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise _bad(name, value, "expected a non-empty directory path (str or os.PathLike)")
    return value


def _check_load_strategy(name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, type):
        raise _bad(
            name,
            value,
            f"expected a strategy instance, not the class: write {value.__name__}() instead of {value.__name__}",
        )
    if not callable(getattr(value, "plan", None)):
        raise _bad(
            name,
            value,
            "expected None (automatic AdaptiveStrategy) or a strategy object with a plan() method, "
            "e.g. flextensor.GreedyStrategy()",
        )
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "enabled": _check_bool,
    "gpu_device": _int_check(0),
    "include_patterns": _check_patterns,
    "exclude_patterns": _check_patterns,
    "pinned_memory": _check_bool,
    "pinned_memory_mode": _choice_check(PINNED_MEMORY_MODES),
    "shm_enabled": _check_bool,
    "shm_namespace": _check_shm_namespace,
    "shm_wait_timeout": _check_shm_wait_timeout,
    "shm_dir": _check_shm_dir,
    "max_gpu_mem_fraction": _check_max_gpu_mem_fraction,
    "skip_discovery": _check_bool,
    "discovery_iters": _int_check(1),
    "profiling_iters": _int_check(1),
    "transfer_mode": _check_transfer_mode,
    "num_blocks": _int_check(2, " (pipelined execution needs two blocks) and >= min_blocks"),
    "min_blocks": _int_check(2, " (pipelined execution needs two blocks)"),
    "transfer_budget_scale": _check_transfer_budget_scale,
    "load_strategy": _check_load_strategy,
    "profile_mode": _check_profile_mode,
    "profile_storage_dir": _check_optional_path,
    "profile_read_only": _check_bool,
    "enable_instrumentation": _check_bool,
    "instrumentation_output_dir": _check_path,
    "enable_diagnostics": _check_bool,
    "offload_timing": _check_offload_timing,
    "piecewise_prefetch": _choice_check(PIECEWISE_PREFETCH_POLICIES),
}


def validate_option(name: str, value: Any) -> Any:
    """Check one option on its own and return its normalized value (fresh list, float for a real, str path).

    Loaders call this per option so a bad value can be reported together with where it came from; checks that
    relate two options (``num_blocks >= min_blocks``, ``offload_timing`` vs ``transfer_mode``, SHM namespace
    required when SHM is enabled) run when the whole ``OffloadConfig`` is built.
    """
    check = _CHECKS.get(name)
    if check is None:
        raise ValueError(f"unknown OffloadConfig option {name!r}; valid options: {', '.join(_CHECKS)}")
    return check(name, value)


# --------------------------------------------------------------------------------------------------------------
# The config object
# --------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class OffloadConfig:
    """All knobs of the offload engine. Keyword-only; ``docs/configuration.md`` says what each one does.

    Groups: core, memory, profiling, transfer, strategy, profile phase, profile storage,
    debugging. Construction validates every option and their combinations.
    """

    # core
    enabled: bool = True
    gpu_device: int = 0
    include_patterns: list[str] = field(default_factory=lambda: ["*"])
    exclude_patterns: list[str] = field(default_factory=list)
    # memory
    pinned_memory: bool = True
    pinned_memory_mode: PinnedMemoryMode = "torch"
    shm_enabled: bool = False
    shm_namespace: str | None = None
    shm_wait_timeout: float = 0.0
    #: The directory of the shared segments: None is ``$FT_SHM_DIR``, else ``/dev/shm``; a tmpfs mounted with
    #: ``huge=always`` or a hugetlbfs gives them huge pages (docs/huge-pages.md).
    shm_dir: str | None = None
    max_gpu_mem_fraction: float | None = None
    # profiling
    skip_discovery: bool = False
    discovery_iters: int = 1
    profiling_iters: int = 10
    # transfer. ``transfer_mode``: how streamed weights reach the device.
    #   "allocation_block_transfer": a trap's offloaded tensors are packed into one host block and copied with one
    #       copy into one of ``num_blocks`` device blocks (each as large as the largest streamed block, the last
    #       one possibly sized to a partly streamed trap under a memory budget), reused in rotation.
    #   "strategy": the same blocks, copied tensor by tensor.
    #   "raw_block_transfer": one copy per trap too, into ONE device arena managed directly: each block gets a
    #       byte range sized to it, placed after the previous one on a ring, and is copied as soon as the bytes it
    #       overwrites are no longer read. ``num_blocks`` is the number of consecutive streamed calls the arena
    #       holds (so it takes the largest total of that many, not that many times the largest block);
    #       ``min_blocks`` does not bound it (a memory budget may shrink it to two). A trap that streams only part
    #       of its tensors costs only those bytes, so a budget keeps more resident.
    transfer_mode: str = "allocation_block_transfer"
    num_blocks: int = 4
    min_blocks: int = 4
    # strategy
    transfer_budget_scale: float = 1.0
    load_strategy: StrategyLike | None = None
    # profile phase
    profile_mode: str = "view"
    # profile storage
    profile_storage_dir: str | None = None
    profile_read_only: bool = False
    # debugging
    enable_instrumentation: bool = False
    instrumentation_output_dir: str = ".flextensor/instrumentation"
    enable_diagnostics: bool = False
    offload_timing: OffloadTiming = "off"
    piecewise_prefetch: PiecewisePrefetch = "warn"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every option and every combination; normalize in place. Raises ``ValueError``."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, _CHECKS[f.name](f.name, getattr(self, f.name)))
        if self.num_blocks < self.min_blocks:
            raise ValueError(
                f"OffloadConfig option 'num_blocks' got {self.num_blocks}, which is below min_blocks="
                f"{self.min_blocks}; required: num_blocks >= min_blocks >= 2 (raise num_blocks or lower "
                "min_blocks)"
            )
        if self.offload_timing != "off" and self.transfer_mode == "strategy":
            raise ValueError(
                f"OffloadConfig option 'offload_timing' got {self.offload_timing!r}, which requires a block "
                f"transfer_mode ({_choices(tuple(m for m in SUPPORTED_TRANSFER_MODES if m != 'strategy'))}), "
                "but transfer_mode='strategy'; use offload_timing='off' or a block transfer mode"
            )
        if self.profile_mode == "torch_function":
            self._check_torch_function()
        if self.shm_enabled and not self.shm_namespace:
            raise ValueError(
                "OffloadConfig option 'shm_namespace' got None, but shm_enabled=True requires an explicit "
                "non-empty base namespace (e.g. shm_namespace='my_run', or one from "
                "flextensor.shm.compute_shm_namespace(...)); or use SharedOffloadSession, which supplies it"
            )

    def _check_torch_function(self) -> None:
        """``profile_mode="torch_function"`` never moves a parameter: it copies each streamed one from its own
        storage (per tensor) and keeps none in shared host blocks."""
        if self.transfer_mode != "strategy":
            raise ValueError(
                f"OffloadConfig option 'profile_mode' got 'torch_function', which requires transfer_mode='strategy' "
                f"(per-tensor copies from the model's own parameters; a block transfer needs the parameters packed "
                f"into host blocks, which patches the model), but transfer_mode={self.transfer_mode!r}; set "
                "transfer_mode='strategy', or use profile_mode='view' or 'getter' with block transfers"
            )
        if self.shm_enabled:
            raise ValueError(
                "OffloadConfig option 'profile_mode' got 'torch_function', which keeps the weights in the model's "
                "own parameters and cannot share them through shared memory, but shm_enabled=True (a "
                "SharedOffloadSession sets it); use profile_mode='view' or 'getter' to share weights"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of every option, in declaration order (what loaders accept, minus ``load_strategy``)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every option; ``load_strategy`` becomes its class name (or ``None``).

        Used by profiles, diagnostics and instrumentation output: a record of how the engine was configured,
        not a way to rebuild a strategy object.
        """
        out: dict[str, Any] = {}
        for name in self.field_names():
            value = getattr(self, name)
            if name == "load_strategy":
                value = None if value is None else type(value).__name__
            elif isinstance(value, list):
                value = list(value)
            out[name] = value
        return out

    def __copy__(self) -> "OffloadConfig":
        # A shallow copy must not share pattern lists (mutating one config's list would change the other);
        # dataclasses.replace re-runs __init__, which copies lists and re-validates.
        return dataclasses.replace(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> "OffloadConfig":
        kwargs = {name: copy.deepcopy(getattr(self, name), memo) for name in self.field_names()}
        result = type(self)(**kwargs)
        memo[id(self)] = result
        return result
