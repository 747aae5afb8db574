"""Compile units (``offload_units`` / ``resident_units``) and the strategy-replan status of the simplified API.

Why this module exists: offload timing and strategy replanning have two halves.

1. *Units*, which this project implements. After INFERENCE a caller that wants to ``torch.compile`` per unit
   (one graph per unit, so no compiled graph spans a block that the loader swaps) needs to know which modules
   stream their weights and which keep them on the device. Both lists are derived from the manager's public
   surface only (``model``, ``phase``, ``offloaded_tensors``, ``trap_labels``), so they cannot drift from what
   the engine actually planned:

   - an **offload unit** is a trap module with at least one offloaded tensor (its weights are (partly) streamed
     through the rotating device blocks). A manual ``offload_block`` has no module; its unit is the module that
     owns each offloaded tensor, unless that owner is the root model itself, which is never returned as a unit
     (compiling the whole model is not a per-unit compile);
   - a **resident unit** is a trap module none of whose tensors is offloaded (the strategy kept it whole on the
     device), and which neither contains nor sits inside an offload unit.

   Both lists keep only the outermost modules (a unit inside another unit is dropped), as
   ``(qualified_name, module)`` pairs in the model's module order.

   Two ways to compile per unit. ``offload(model, config, compile_fn=...)`` applies ``compile_fn`` at install
   to every module trap's forward (a parameterless shim around it, ``flextensor.engine.hooks.ForwardShim``):
   each offload unit among them, before the plan says which traps stream, so PROFILING times the compiled
   forwards. Or, after INFERENCE starts, ``module.compile()`` on each listed unit. Either way a unit's call
   runs its trap's loader steps outside the graph and the unit's forward as a graph of its own (Note [engine
   steps outside compiled graphs] in ``flextensor.runtime.compile_guard``).

2. *Strategy replanning* (``flextensor.engine.replan``): :class:`StrategyReplanStatus`, the snapshot that
   ``OffloadManager.strategy_replan_status`` returns, is defined there and exported from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from flextensor.engine.replan import StrategyReplanState, StrategyReplanStatus

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.manager import OffloadManager

__all__ = [
    "StrategyReplanState",
    "StrategyReplanStatus",
    "offload_units",
    "resident_units",
]


# ----------------------------------------------------------------------------------------------------------------
# Units
# ----------------------------------------------------------------------------------------------------------------


def _require_inference(manager: "OffloadManager", what: str) -> nn.Module:
    """The offloaded model, or ``RuntimeError`` before INFERENCE (same contract as ``get_gpu_memory_usage``)."""
    from flextensor.engine.phase import Phase

    if manager.phase is not Phase.INFERENCE or manager.model is None:
        phase = manager.phase.value if manager.phase is not None else "none"
        raise RuntimeError(
            f"{what}: manager {manager.name!r} is in phase {phase}; units are known once INFERENCE starts "
            f"({manager.iters_before_inference} forward passes after offload(), or at once after "
            "offload_from_profile/offload_from_state)"
        )
    return manager.model


def _disabled(manager: "OffloadManager") -> bool:
    """Configured with ``enabled=False`` (a pass-through: no units). A manager with no config yet is not
    "disabled": it simply offloads nothing, and asking it for units is the before-INFERENCE error."""
    return manager.config is not None and not manager.config.enabled


def _is_within(path: str, ancestor: str) -> bool:
    """``path`` is ``ancestor`` or a descendant of it (module paths are dot-separated)."""
    return path == ancestor or path.startswith(ancestor + ".")


def _outermost(paths: set[str], modules: dict[str, nn.Module]) -> tuple[tuple[str, nn.Module], ...]:
    """Drop every path inside another one; order by the model's module order."""
    kept = {p for p in paths if not any(o != p and _is_within(p, o) for o in paths)}
    return tuple((p, m) for p, m in modules.items() if p in kept)


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    # remove_duplicate=False: a trap label is the path under which pattern selection met the module, which for a
    # module reachable twice need not be the first path named_modules() would report.
    modules: dict[str, nn.Module] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        modules.setdefault(path, module)
    return modules


def _is_module_trap(label: str, modules: dict[str, nn.Module]) -> bool:
    """``label`` names a patched trap module (not a manual block that merely shares a module's path).

    ``flextensor.engine.hooks.Trap.install`` marks the instance-level forward with ``__flextensor_trap__``; a manual
    ``offload_block`` never patches a module, so its label can coincide with an unpatched module's path.
    """
    module = modules.get(label) if label else None
    forward = module.__dict__.get("forward") if module is not None else None
    return getattr(forward, "__flextensor_trap__", None) == label


def _offload_paths(manager: "OffloadManager", modules: dict[str, nn.Module]) -> set[str]:
    paths: set[str] = set()
    for label, names in manager.offloaded_tensors.items():
        if not names:
            continue
        if _is_module_trap(label, modules):  # a module trap: the trap module is the unit
            paths.add(label)
            continue
        for name in names:  # a manual block: the modules owning its tensors (never the root model)
            owner = name.rpartition(".")[0]
            if owner and owner in modules:
                paths.add(owner)
    return paths


def offload_units(manager: "OffloadManager") -> tuple[tuple[str, nn.Module], ...]:
    """Outermost modules whose tensors are (partly) offloaded, as ``(qualified_name, module)`` pairs."""
    if _disabled(manager):
        return ()
    model = _require_inference(manager, "offload_units")
    modules = _modules(model)
    return _outermost(_offload_paths(manager, modules), modules)


def resident_units(manager: "OffloadManager") -> tuple[tuple[str, nn.Module], ...]:
    """Outermost trap modules with no offloaded tensor (and no overlap with an offload unit)."""
    if _disabled(manager):
        return ()
    model = _require_inference(manager, "resident_units")
    modules = _modules(model)
    offloaded = _offload_paths(manager, modules)
    resident = {
        label for label in manager.trap_labels
        if _is_module_trap(label, modules) and label not in offloaded
        and not any(_is_within(label, o) or _is_within(o, label) for o in offloaded)
    }
    return _outermost(resident, modules)
