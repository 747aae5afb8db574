"""The simplified-API surface (spec 002) and the timing-publication / units / strategy-replan functions.

Replanning itself is tested in tests/client/engine/test_replan.py; here: the spec's names exist, a replan that
cannot change anything (a CPU computing from its host blocks in place) is refused with the reason and changes
nothing, and the compile units match the plan the engine actually built.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import flextensor as ft
from flextensor.api import (
    StrategyReplanStatus,
    offload_units,
    request_strategy_replan,
    resident_units,
    strategy_replan_status,
    update_offload_timing,
    update_state,
)
from flextensor.manager import Phase
from tests.helpers.models import (
    DEVICE,
    ManualBlockModel,
    cpu_config,
    mlp_stack,
    reference,
    same,
    tiny_transformer,
    token_ids,
    errors_on_another_thread,
)

# Every public name of the simplified-API spec (spec 002) that lives on ``flextensor`` itself.
# (``load_model_from_profile`` is documented under ``flextensor.lazy_model_init``, not ``ft``; not part of this list.)
SPEC_002_NAMES = [
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
    "clear_profiling_durations",
    "suspend_profiling",
    "resume_profiling",
    "pause_profiling",
    "collect_offload_timing",
    "reset_offload_timing",
    "update_offload_timing",
    "request_strategy_replan",
    "StrategyReplanStatus",
    "offload_units",
    "resident_units",
    "update_state",
    "format_offload_timing_table",
    "OffloadTimingReport",
    "OffloadTimingSnapshot",
    "TrapTimingRecord",
    "TrapTimingStats",
    # types the spec's signatures name
    "OffloadConfig",
    "OffloadManager",
    "GPUMemoryUsage",
]

def test_every_spec_name_resolves_on_ft():
    missing = [n for n in SPEC_002_NAMES if not hasattr(ft, n)]
    assert not missing, f"ft lacks {missing}"
    assert set(SPEC_002_NAMES) <= set(dir(ft))
    assert ft.DEFAULT_MANAGER_NAME == "default"
    assert ft.StrategyReplanStatus is StrategyReplanStatus
    for fn in (update_offload_timing, request_strategy_replan, offload_units, resident_units, update_state):
        assert getattr(ft, fn.__name__) is fn


def test_package_all_lists_each_lazy_name_once_and_the_version():
    assert sorted(ft.__all__) == sorted({*ft._LAZY, "__version__"})


def test_api_module_exports_every_spec_function():
    """flextensor.api itself defines every simplified-API function of spec 002 (independent of _LAZY)."""
    import flextensor.api as api

    engine_types = {"OffloadConfig", "OffloadManager", "GPUMemoryUsage", "OffloadTimingReport",
                    "OffloadTimingSnapshot", "TrapTimingRecord", "TrapTimingStats"}
    for name in SPEC_002_NAMES:
        if name not in engine_types:
            assert name in api.__all__ and hasattr(api, name), name


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _warm_up(model, x, extra: int = 0, name: str = "default") -> None:
    om = ft.get_offload_manager(name)
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
        om.wait_for_host_blocks()  # a resident warm-up (GPU) builds them behind the first passes
        for _ in range(extra):
            model(x)
    assert om.phase is Phase.INFERENCE


# ----------------------------------------------------------------------------------------------------------------
# offload_units / resident_units
# ----------------------------------------------------------------------------------------------------------------


def test_units_split_mlp_stack_by_plan_and_refuse_before_inference():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(2)))
    with pytest.raises(RuntimeError, match="offload_units: manager 'default' is in phase discovery"):
        offload_units()
    with pytest.raises(RuntimeError, match="resident_units: .*phase discovery"):
        resident_units()
    _warm_up(model, x)
    om = ft.get_offload_manager()
    assert set(om.offloaded_tensors) == {"0", "2"}
    off = offload_units()
    res = resident_units()
    assert [n for n, _ in off] == ["0", "2"] and [n for n, _ in res] == ["1", "3"]
    assert all(m is model[int(n)] for n, m in off + res)  # the model's own modules, not copies
    ft.release()
    with pytest.raises(RuntimeError, match="phase none"):
        offload_units()


def test_units_on_transformer_are_outermost_trap_modules():
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ft.NthLayerStrategy(1)))
    _warm_up(model, ids)
    units = offload_units()
    assert [n for n, _ in units] == [f"blocks.{i}" for i in range(4)]
    assert [m for _, m in units] == list(model.blocks)  # outermost: no blocks.i.attn etc.
    assert resident_units() == ()
    with torch.no_grad():
        assert same(model(ids), ref)  # asking for units changes nothing


def test_manual_block_unit_is_owning_module_never_the_root():
    torch.manual_seed(0)
    model = ManualBlockModel().eval()
    x = torch.randn(3, 16, device=DEVICE)
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(1)))
    _warm_up(model, x)
    om = ft.get_offload_manager()
    assert om.offloaded_tensors["head"] == ["w_head", "b_head"]  # root-level parameters: no unit below the root
    assert offload_units() == (("body", model.body),)
    assert resident_units() == ()


def test_units_empty_when_disabled_and_named_manager():
    model = mlp_stack()
    assert ft.offload(model, cpu_config(enabled=False), name="off") is model
    assert offload_units("off") == () and resident_units("off") == ()
    other = mlp_stack(n=2)
    ft.offload(other, cpu_config(load_strategy=ft.NthLayerStrategy(1)), name="b")
    _warm_up(other, torch.randn(1, 16, device=DEVICE), name="b")
    assert [n for n, _ in offload_units("b")] == ["0", "1"]
    with pytest.raises(RuntimeError, match="phase none"):
        offload_units()  # the default manager offloads nothing


# ----------------------------------------------------------------------------------------------------------------
# timing publication, update_state, strategy replan
# ----------------------------------------------------------------------------------------------------------------


def test_update_offload_timing_true_and_publishes_nothing_extra():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ft.offload(model, cpu_config(offload_timing="eager", load_strategy=ft.NthLayerStrategy(2)))
    _warm_up(model, x, extra=2)
    assert update_offload_timing() is True
    assert update_offload_timing(replay_generation=7) is True
    report = ft.collect_offload_timing()
    assert report is not None and report.num_passes == 2  # exactly the forwards run, no phantom pass
    assert update_offload_timing() is True
    assert ft.collect_offload_timing() is None
    with pytest.raises(TypeError, match="replay_generation must be an int"):
        update_offload_timing(replay_generation="0")
    with pytest.raises(TypeError, match="replay_generation must be an int"):
        update_offload_timing(replay_generation=True)


def test_update_state_is_a_noop_for_the_phase_machine():
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(1)))
    om = ft.get_offload_manager()
    needed = om.iters_before_inference
    for _ in range(10):
        assert update_state() is None
        update_state(replay_generation=3)
    assert om.phase is Phase.DISCOVERY and om.iters_before_inference == needed
    with torch.no_grad():
        for i in range(needed):
            assert om.phase is not Phase.INFERENCE, f"update_state advanced the phases (pass {i})"
            model(x)
        assert om.phase is Phase.INFERENCE
        update_state()
        assert same(model(x), ref)
    with pytest.raises(TypeError, match="update_state: replay_generation"):
        update_state(replay_generation=1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA streams the blocks: tests/client/engine/test_replan.py")
def test_request_strategy_replan_refused_where_nothing_streams(caplog):
    model = mlp_stack()
    x = torch.randn(2, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(load_strategy=ft.NthLayerStrategy(2)))
    _warm_up(model, x)
    om = ft.get_offload_manager()
    plan = om.offloaded_tensors
    assert strategy_replan_status() == StrategyReplanStatus("idle", can_request=False, applied=None)
    with caplog.at_level(logging.WARNING, logger="flextensor.manager"):
        assert request_strategy_replan() == 0
        assert request_strategy_replan(manual_update_state=True) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("in place" in w for w in warnings)
    status = strategy_replan_status()
    assert (status.state, status.can_request, status.applied) == ("idle", False, None)
    assert om.offloaded_tensors == plan and om.phase is Phase.INFERENCE
    with torch.no_grad():
        assert same(model(x), ref)
    with pytest.raises(TypeError, match="manual_update_state must be a bool"):
        request_strategy_replan(manual_update_state=1)


def test_replan_status_dataclass_contract():
    s = StrategyReplanStatus("done", can_request=True, applied=False)
    assert [f.name for f in dataclasses.fields(s)] == ["state", "can_request", "applied"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.state = "idle"  # type: ignore[misc]
    with pytest.raises(ValueError, match="must be 'idle', 'in_progress', 'done' or 'failed'"):
        StrategyReplanStatus("running", can_request=False, applied=None)


def test_functions_keep_the_thread_contract():
    ft.init(cpu_config())
    errors = errors_on_another_thread(update_offload_timing, update_state, request_strategy_replan,
                                      strategy_replan_status, offload_units, resident_units)
    assert len(errors) == 6 and all(isinstance(e, RuntimeError) and "single-threaded" in str(e) for e in errors)


def test_every_public_name_is_typed_for_checkers():
    """``ft.X`` resolves lazily at run time; a type checker reads the TYPE_CHECKING imports of the package and
    the ``py.typed`` marker instead. Each public name is imported there from the module that defines it."""
    import ast
    import importlib
    from pathlib import Path

    import flextensor

    init = Path(flextensor.__file__)
    assert (init.parent / "py.typed").is_file()
    typed: dict[str, str] = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                typed.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    lazy = flextensor._LAZY
    assert typed == lazy
    for name, module in typed.items():
        assert getattr(flextensor, name) is getattr(importlib.import_module(module), name)
