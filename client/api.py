"""The simplified API (``import flextensor as ft``): module-level functions over named ``OffloadManager``s.

Managers live in a process-wide registry keyed by name. ``get_offload_manager(name)`` creates one on first use;
a manager belongs to the thread that created it, and asking for it from another thread raises ``RuntimeError``
(FlexTensor is single-threaded; use a separately named manager per thread). ``release(name)`` tears the manager
down and removes it from the registry.

With ``OffloadConfig(enabled=False)`` every call is a pass-through / no-op (``offload`` returns the model
untouched, profiling controls do nothing and never freeze a counter, timing collection returns ``None``).

Strategy replanning (``request_strategy_replan`` / ``update_state`` / ``strategy_replan_status``) measures the
passes as served and changes which host blocks stream, between passes (Note [replanning] in
``flextensor.engine.replan``); ``offload_units`` / ``resident_units`` list the modules to compile per unit
(``flextensor.units``).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import AbstractContextManager
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from flextensor.configuration.config import OffloadConfig
from flextensor import units as _units
from flextensor.manager import GPUMemoryUsage, OffloadManager
from flextensor.units import StrategyReplanStatus
from flextensor.state import TensorManagerState
from flextensor.runtime.timing import OffloadTimingReport, format_offload_timing_table

__all__ = [
    "DEFAULT_MANAGER_NAME",
    "init",
    "offload",
    "get_offload_manager",
    "set_config",
    "offload_block",
    "get_gpu_memory_usage",
    "save_profile",
    "load_profile",
    "offload_from_profile",
    "offload_from_state",
    "release",
    "release_all",
    "sleep",
    "wake",
    "clear_profiling_durations",
    "suspend_profiling",
    "resume_profiling",
    "pause_profiling",
    "collect_offload_timing",
    "reset_offload_timing",
    "format_offload_timing_table",
    "update_offload_timing",
    "request_strategy_replan",
    "strategy_replan_status",
    "StrategyReplanStatus",
    "offload_units",
    "resident_units",
    "update_state",
    "managers",
]

logger = logging.getLogger(__name__)

DEFAULT_MANAGER_NAME: str = "default"

_registry: dict[str, OffloadManager] = {}
_registry_lock = threading.Lock()  # guards the dict itself; managers are single-threaded


def get_offload_manager(name: str = DEFAULT_MANAGER_NAME) -> OffloadManager:
    """Get or create the manager called ``name`` (``RuntimeError`` if another thread created it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"manager name must be a non-empty string, got {name!r}")
    with _registry_lock:
        manager = _registry.get(name)
        if manager is None:
            manager = OffloadManager(name)
            _registry[name] = manager
    manager.check_thread()
    return manager


def managers() -> dict[str, OffloadManager]:
    """A copy of the registry (name -> manager), e.g. for test teardown."""
    with _registry_lock:
        return dict(_registry)


def init(config: OffloadConfig | None = None, name: str = DEFAULT_MANAGER_NAME) -> None:
    """Create the manager ``name`` and apply ``config`` (defaults when None)."""
    get_offload_manager(name).set_config(config if config is not None else OffloadConfig())


def set_config(config: OffloadConfig, name: str = DEFAULT_MANAGER_NAME) -> None:
    get_offload_manager(name).set_config(config)


def offload(
    model: nn.Module,
    config: OffloadConfig | None = None,
    name: str = DEFAULT_MANAGER_NAME,
    compile_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """Patch ``model`` in place for offloading and return it (the same object)."""
    return get_offload_manager(name).offload(model, config, compile_fn)


def offload_block(block_name: str, name: str = DEFAULT_MANAGER_NAME) -> AbstractContextManager[None]:
    """A manual trap around arbitrary code (``with ft.offload_block("mlp"): ...``)."""
    return get_offload_manager(name).offload_block(block_name)


def get_gpu_memory_usage(name: str = DEFAULT_MANAGER_NAME) -> GPUMemoryUsage:
    return get_offload_manager(name).get_gpu_memory_usage()


def save_profile(profile_directory: str | os.PathLike[str] | None = None, name: str = DEFAULT_MANAGER_NAME) -> None:
    get_offload_manager(name).save_profile(profile_directory)


def load_profile(
    profile_directory: str | os.PathLike[str] | None = None,
    model: nn.Module | None = None,
    name: str = DEFAULT_MANAGER_NAME,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> None:
    get_offload_manager(name).load_profile(profile_directory, model, weights=weights)


def offload_from_profile(
    model: nn.Module,
    profile_directory: str | os.PathLike[str],
    config: OffloadConfig | None = None,
    name: str = DEFAULT_MANAGER_NAME,
    compile_fn: Callable[[nn.Module], nn.Module] | None = None,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """init + load_profile + offload in one step: the model goes straight to INFERENCE.

    ``weights`` (extension): host weights by tensor name for a model built on ``meta`` (e.g.
    ``flextensor.profiles.load_weights("model.safetensors")``).
    """
    from flextensor.profiles import read_profile

    manager = get_offload_manager(name)
    if config is not None:
        manager.set_config(config)
    state = read_profile(profile_directory)
    return manager.offload_from_state(model, state, weights=weights, compile_fn=compile_fn)


def offload_from_state(
    model: nn.Module,
    state: TensorManagerState,
    config: OffloadConfig | None = None,
    name: str = DEFAULT_MANAGER_NAME,
    *,
    allow_strategy_replan: bool = True,
    host_blocks: Sequence[torch.Tensor] | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Adopt an in-memory state and enter INFERENCE (``host_blocks``: prefilled blocks used as-is)."""
    return get_offload_manager(name).offload_from_state(
        model, state, config, allow_strategy_replan=allow_strategy_replan, host_blocks=host_blocks, weights=weights
    )


def release(name: str = DEFAULT_MANAGER_NAME, *, preserve_model: bool = True) -> None:
    """Tear the manager down (weights restored unless ``preserve_model=False``) and forget it."""
    with _registry_lock:
        manager = _registry.get(name)
    if manager is None:
        return
    manager.release(preserve_model=preserve_model)
    with _registry_lock:
        if _registry.get(name) is manager:
            del _registry[name]


def sleep(name: str = DEFAULT_MANAGER_NAME) -> None:
    """Free the device memory of manager ``name``'s model, keeping its plan and one host copy of its weights
    (``OffloadManager.sleep``); passes raise ``ModelAsleepError`` until :func:`wake`. In a shared session the
    worker's lease says it sleeps, which lets ``SharedOffloadSession.update_weights`` write new weights."""
    get_offload_manager(name).sleep()


def wake(name: str = DEFAULT_MANAGER_NAME) -> float:
    """Bring manager ``name``'s sleeping model back onto its device with the same plan, from the host copy (with
    the newest weights a session published); returns the seconds it took (``OffloadManager.wake``)."""
    return get_offload_manager(name).wake()


def release_all(*, preserve_model: bool = True) -> None:
    """Release every manager this thread owns (test teardown, process shutdown)."""
    me = threading.get_ident()
    for name, manager in managers().items():
        if manager.owner_thread == me:
            release(name, preserve_model=preserve_model)


def clear_profiling_durations(name: str = DEFAULT_MANAGER_NAME) -> None:
    get_offload_manager(name).clear_profiling_durations()


def suspend_profiling(name: str = DEFAULT_MANAGER_NAME) -> None:
    get_offload_manager(name).suspend_profiling()


def resume_profiling(name: str = DEFAULT_MANAGER_NAME) -> None:
    get_offload_manager(name).resume_profiling()


def pause_profiling(name: str = DEFAULT_MANAGER_NAME) -> AbstractContextManager[None]:
    return get_offload_manager(name).pause_profiling()


def collect_offload_timing(name: str = DEFAULT_MANAGER_NAME) -> OffloadTimingReport | None:
    return get_offload_manager(name).collect_offload_timing()


def reset_offload_timing(name: str = DEFAULT_MANAGER_NAME) -> None:
    get_offload_manager(name).reset_offload_timing()


# ----------------------------------------------------------------------------------------------------------------
# Offload timing publication, units and strategy replan
# ----------------------------------------------------------------------------------------------------------------


def _check_generation(function: str, replay_generation: int) -> None:
    if isinstance(replay_generation, bool) or not isinstance(replay_generation, int):
        raise TypeError(f"{function}: replay_generation must be an int (-1 when unused), "
                        f"got {type(replay_generation).__name__}")


def update_offload_timing(name: str = DEFAULT_MANAGER_NAME, *, replay_generation: int = -1) -> bool:
    """Publish the current offload-timing pass (``OffloadManager.update_offload_timing``)."""
    _check_generation("update_offload_timing", replay_generation)
    return get_offload_manager(name).update_offload_timing(replay_generation=replay_generation)


def request_strategy_replan(name: str = DEFAULT_MANAGER_NAME, *, manual_update_state: bool = False) -> int:
    """Measure the next forwards as served and plan again (``OffloadManager.request_strategy_replan``).

    Returns the forwards to drive (with ``manual_update_state=True``: the ``update_state()`` calls, one after
    each ``graph.replay()``), or 0 when no replan was armed (the reason is logged)."""
    if not isinstance(manual_update_state, bool):
        raise TypeError(f"request_strategy_replan: manual_update_state must be a bool, "
                        f"got {type(manual_update_state).__name__}")
    return get_offload_manager(name).request_strategy_replan(manual_update_state=manual_update_state)


def strategy_replan_status(name: str = DEFAULT_MANAGER_NAME) -> StrategyReplanStatus:
    """The replan state of manager ``name`` (``OffloadManager.strategy_replan_status``); reading it changes nothing."""
    return get_offload_manager(name).strategy_replan_status


def update_state(name: str = DEFAULT_MANAGER_NAME, *, replay_generation: int = -1) -> None:
    """Advance a replan armed with ``manual_update_state=True`` by one step (call it after each
    ``graph.replay()``, which runs no forward hooks); a repeated ``replay_generation`` is counted once."""
    _check_generation("update_state", replay_generation)
    get_offload_manager(name).update_state(replay_generation=replay_generation)


def offload_units(name: str = DEFAULT_MANAGER_NAME) -> tuple[tuple[str, nn.Module], ...]:
    """Outermost modules whose tensors are (partly) offloaded, as ``(qualified_name, module)`` pairs.

    ``RuntimeError`` before INFERENCE (or with no model offloaded); ``()`` with ``OffloadConfig(enabled=False)``.
    """
    return _units.offload_units(get_offload_manager(name))


def resident_units(name: str = DEFAULT_MANAGER_NAME) -> tuple[tuple[str, nn.Module], ...]:
    """Outermost trap modules none of whose tensors is offloaded, as ``(qualified_name, module)`` pairs.

    ``RuntimeError`` before INFERENCE (or with no model offloaded); ``()`` with ``OffloadConfig(enabled=False)``.
    """
    return _units.resident_units(get_offload_manager(name))
