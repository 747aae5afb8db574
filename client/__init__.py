"""flextensor: one pinned copy of a model's weights per host, shared by every worker process.

The public API (``import flextensor as ft``) is resolved lazily (PEP 562): ``import flextensor.shm`` and the
``ftd`` daemon must not pay for importing torch and the engine, and multi-process tests start faster.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flextensor.shm._version import __version__

if TYPE_CHECKING:  # pragma: no cover - what a type checker sees for ``ft.X`` (resolved lazily at run time)
    from flextensor.api import (
        DEFAULT_MANAGER_NAME as DEFAULT_MANAGER_NAME,
        StrategyReplanStatus as StrategyReplanStatus,
        clear_profiling_durations as clear_profiling_durations,
        collect_offload_timing as collect_offload_timing,
        format_offload_timing_table as format_offload_timing_table,
        get_gpu_memory_usage as get_gpu_memory_usage,
        get_offload_manager as get_offload_manager,
        init as init,
        load_profile as load_profile,
        offload as offload,
        offload_block as offload_block,
        offload_from_profile as offload_from_profile,
        offload_from_state as offload_from_state,
        offload_units as offload_units,
        pause_profiling as pause_profiling,
        release as release,
        request_strategy_replan as request_strategy_replan,
        reset_offload_timing as reset_offload_timing,
        resident_units as resident_units,
        resume_profiling as resume_profiling,
        save_profile as save_profile,
        set_config as set_config,
        sleep as sleep,
        strategy_replan_status as strategy_replan_status,
        suspend_profiling as suspend_profiling,
        update_offload_timing as update_offload_timing,
        update_state as update_state,
        wake as wake,
    )
    from flextensor.errors import ModelAsleepError as ModelAsleepError
    from flextensor.configuration.config import OffloadConfig as OffloadConfig
    from flextensor.loading.lazy_init import (
        init_empty_weights as init_empty_weights,
        load_model_from_profile as load_model_from_profile,
    )
    from flextensor.configuration.config_loading import (
        load_config as load_config,
        load_config_from_env as load_config_from_env,
        load_config_from_file as load_config_from_file,
    )
    from flextensor.manager import (
        GPUMemoryUsage as GPUMemoryUsage,
        OffloadManager as OffloadManager,
        Phase as Phase,
    )
    from flextensor.planning.strategies import (
        AdaptiveStrategy as AdaptiveStrategy,
        BudgetFillStrategy as BudgetFillStrategy,
        GreedyStrategy as GreedyStrategy,
        KnapsackStrategy as KnapsackStrategy,
        NthLayerStrategy as NthLayerStrategy,
    )
    from flextensor.runtime.timing import (
        OffloadTimingReport as OffloadTimingReport,
        OffloadTimingSnapshot as OffloadTimingSnapshot,
        TrapTimingRecord as TrapTimingRecord,
        TrapTimingStats as TrapTimingStats,
    )
    from flextensor.sharing.session import SharedOffloadSession as SharedOffloadSession
    from flextensor.shm.dead_sweep import cleanup_dead_namespaces as cleanup_dead_namespaces
    from flextensor.shm.errors import (
        ShmCreatorDiedError as ShmCreatorDiedError,
        ShmCreatorFailedError as ShmCreatorFailedError,
        WeightsUpdateIncompleteError as WeightsUpdateIncompleteError,
        WorkersAwakeError as WorkersAwakeError,
    )

# public name -> module that defines it
_LAZY: dict[str, str] = {
    # configuration
    "OffloadConfig": "flextensor.configuration.config",
    "load_config": "flextensor.configuration.config_loading",
    "load_config_from_env": "flextensor.configuration.config_loading",
    "load_config_from_file": "flextensor.configuration.config_loading",
    # simplified API
    "DEFAULT_MANAGER_NAME": "flextensor.api",
    "init": "flextensor.api",
    "offload": "flextensor.api",
    "get_offload_manager": "flextensor.api",
    "set_config": "flextensor.api",
    "offload_block": "flextensor.api",
    "get_gpu_memory_usage": "flextensor.api",
    "save_profile": "flextensor.api",
    "load_profile": "flextensor.api",
    "offload_from_profile": "flextensor.api",
    "offload_from_state": "flextensor.api",
    "release": "flextensor.api",
    "clear_profiling_durations": "flextensor.api",
    "suspend_profiling": "flextensor.api",
    "resume_profiling": "flextensor.api",
    "pause_profiling": "flextensor.api",
    "collect_offload_timing": "flextensor.api",
    "reset_offload_timing": "flextensor.api",
    "format_offload_timing_table": "flextensor.api",
    "update_offload_timing": "flextensor.api",
    "request_strategy_replan": "flextensor.api",
    "strategy_replan_status": "flextensor.api",
    "StrategyReplanStatus": "flextensor.api",
    "offload_units": "flextensor.api",
    "resident_units": "flextensor.api",
    "update_state": "flextensor.api",
    "sleep": "flextensor.api",
    "wake": "flextensor.api",
    "ModelAsleepError": "flextensor.errors",
    # lazy initialisation from a checkpoint
    "load_model_from_profile": "flextensor.loading.lazy_init",
    "init_empty_weights": "flextensor.loading.lazy_init",
    # engine
    "OffloadManager": "flextensor.manager",
    "GPUMemoryUsage": "flextensor.manager",
    "Phase": "flextensor.manager",
    "KnapsackStrategy": "flextensor.planning.strategies",
    "GreedyStrategy": "flextensor.planning.strategies",
    "NthLayerStrategy": "flextensor.planning.strategies",
    "AdaptiveStrategy": "flextensor.planning.strategies",
    "BudgetFillStrategy": "flextensor.planning.strategies",
    "OffloadTimingReport": "flextensor.runtime.timing",
    "OffloadTimingSnapshot": "flextensor.runtime.timing",
    "TrapTimingRecord": "flextensor.runtime.timing",
    "TrapTimingStats": "flextensor.runtime.timing",
    # sharing
    "SharedOffloadSession": "flextensor.sharing.session",
    "ShmCreatorFailedError": "flextensor.shm.errors",
    "ShmCreatorDiedError": "flextensor.shm.errors",
    "WorkersAwakeError": "flextensor.shm.errors",
    "WeightsUpdateIncompleteError": "flextensor.shm.errors",
    "cleanup_dead_namespaces": "flextensor.shm.dead_sweep",
}

__all__ = [  # every name of _LAZY, and the version (tests/client/test_api_surface.py checks they agree)
    "AdaptiveStrategy", "BudgetFillStrategy", "DEFAULT_MANAGER_NAME", "GPUMemoryUsage", "GreedyStrategy",
    "KnapsackStrategy", "ModelAsleepError", "NthLayerStrategy", "OffloadConfig", "OffloadManager", "OffloadTimingReport",
    "OffloadTimingSnapshot", "Phase", "SharedOffloadSession", "ShmCreatorDiedError", "ShmCreatorFailedError",
    "StrategyReplanStatus", "TrapTimingRecord", "TrapTimingStats", "__version__", "cleanup_dead_namespaces",
    "clear_profiling_durations",
    "collect_offload_timing", "format_offload_timing_table", "get_gpu_memory_usage", "get_offload_manager", "init",
    "init_empty_weights", "load_config", "load_config_from_env", "load_config_from_file", "load_model_from_profile",
    "load_profile", "offload", "offload_block", "offload_from_profile", "offload_from_state", "offload_units",
    "pause_profiling", "release", "request_strategy_replan", "reset_offload_timing", "resident_units",
    "resume_profiling", "save_profile", "set_config", "sleep", "strategy_replan_status", "suspend_profiling",
    "update_offload_timing", "update_state", "wake", "WeightsUpdateIncompleteError", "WorkersAwakeError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flextensor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return __all__
