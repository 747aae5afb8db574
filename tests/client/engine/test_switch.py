"""The switch to INFERENCE (``flextensor.inference``): its timing-free part is prepared after the first counted
PROFILING pass, and the plan built from it equals one built from the model at the switch."""

from __future__ import annotations

import statistics

import pytest
import torch

import flextensor as ft
from flextensor.runtime.host_memory import pack_block, packed_stride
from flextensor.engine.switch import prepare_switch
from flextensor.manager import Phase
from flextensor.planning.plan_model import make_plan
from tests.helpers.models import (
    ALL,
    DEVICE,
    cpu_config,
    reference,
    same,
    tiny_transformer,
    token_ids,
)


class FirstTensorOnly(ft.NthLayerStrategy):
    """Streams only the first tensor of each trap: a plan that takes part of a trap."""

    name = "first-tensor-only"

    def plan(self, inp):
        return make_plan(inp, self.name, {t.label: [t.tensors[0].name] for t in inp.traps if t.tensors},
                         num_blocks=inp.num_blocks)


def _fresh_layouts(om):
    """The layouts packed from the model's tensors now, as the switch did before it was prepared ahead."""
    out = []
    for layout in om.engine.inference.layouts:
        entries = []
        for p in layout.tensors:
            t = om.engine.tensors[p.name].tensor
            entries.append((p.name, t.dtype, tuple(t.shape), packed_stride(t)))
        out.append(pack_block(layout.index, layout.label, entries))
    return out


def _passes(model, ids, ref, count):
    with torch.no_grad():
        for _ in range(count):
            assert same(model(ids), ref)


def _offload_tiny(strategy, **cfg):
    """The tiny transformer offloaded by its decoder blocks: (model, ids, reference output, manager)."""
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    om = ft.get_offload_manager()
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=strategy, **cfg))
    return model, ids, ref, om


@pytest.mark.parametrize("skip_discovery", [True, False])
def test_the_switch_is_prepared_after_the_first_counted_pass_and_consumed_by_it(skip_discovery):
    model, ids, ref, om = _offload_tiny(ALL, profiling_iters=3, skip_discovery=skip_discovery)
    warm_up = om.iters_before_inference - 3  # the DISCOVERY passes, when kept
    _passes(model, ids, ref, warm_up)
    assert om.phase is Phase.PROFILING and om.engine.profile.switch_inputs is None  # DISCOVERY prepares nothing
    _passes(model, ids, ref, 1)
    inputs = om.engine.profile.switch_inputs
    assert inputs is not None
    assert sorted(inputs.traps) == sorted(om.engine.exclusive)
    for label, names in om.engine.exclusive.items():
        expected = [(n, (om.engine.tensors[n].tensor.numel() * om.engine.tensors[n].tensor.element_size() + 255) // 256 * 256)
                    for n in names]
        trap = inputs.traps[label]
        assert [(t.name, t.nbytes) for t in trap.tensors] == expected
        assert (trap.label, trap.compute_s, trap.stream_cost_s) == (label, 0.0, 0.0)  # timings come at the switch
    exclusive = {n for names in om.engine.exclusive.values() for n in names}
    assert inputs.exclusive_bytes == {n: om.engine.tensors[n].tensor.numel() * om.engine.tensors[n].tensor.element_size()
                                      for n in exclusive}
    assert [id(t) for t in inputs.others] == [id(e.tensor) for n, e in om.engine.tensors.items() if n not in exclusive]
    _passes(model, ids, ref, 2)  # the last one switches
    assert om.phase is Phase.INFERENCE and om.engine.profile.switch_inputs is None
    om.wait_for_host_blocks()
    assert om.engine.inference.layouts and om.engine.inference.layouts == _fresh_layouts(om)
    assert [layout.index for layout in om.engine.inference.layouts] == list(range(len(om.engine.inference.layouts)))
    _passes(model, ids, ref, 3)


def test_a_plan_streaming_part_of_a_trap_packs_that_part():
    model, ids, ref, om = _offload_tiny(FirstTensorOnly(), profiling_iters=2, skip_discovery=True)
    _passes(model, ids, ref, om.iters_before_inference)
    om.wait_for_host_blocks()
    assert om.engine.inference.layouts
    for layout in om.engine.inference.layouts:
        assert [p.name for p in layout.tensors] == [om.engine.exclusive[layout.label][0]]
    assert om.engine.inference.layouts == _fresh_layouts(om)
    _passes(model, ids, ref, 3)


def test_one_profiling_pass_plans_without_a_prepared_switch():
    model, ids, ref, om = _offload_tiny(ALL, profiling_iters=1, skip_discovery=True)
    _passes(model, ids, ref, 1)
    assert om.phase is Phase.INFERENCE and om.engine.profile.switch_inputs is None
    om.wait_for_host_blocks()
    assert om.engine.inference.layouts == _fresh_layouts(om) and len(om.engine.inference.layouts) == len(om.engine.exclusive)
    _passes(model, ids, ref, 3)


def test_prepare_switch_skips_zero_byte_tensors():
    """A zero-size exclusive tensor is neither costed nor packed (as the plan never streams it)."""
    model = tiny_transformer()
    model.blocks[0].register_parameter("empty", torch.nn.Parameter(torch.zeros(0)))
    om = ft.get_offload_manager()
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL, skip_discovery=True))
    label = next(label for label, names in om.engine.exclusive.items() if any(n.endswith(".empty") for n in names))
    inputs = prepare_switch(om.engine)
    assert all(not t.name.endswith(".empty") for t in inputs.traps[label].tensors)
    names, layout = inputs.whole[label]
    assert names == tuple(t.name for t in inputs.traps[label].tensors) == tuple(p.name for p in layout.tensors)


def test_the_direct_forwards_of_bypassed_traps_are_built_ahead_and_installed_at_the_switch():
    """``prepare_switch`` builds each module trap's direct forward; the switch installs those very objects on the
    traps that stream nothing (NthLayer(100) streams the first block only)."""
    model, ids, ref, om = _offload_tiny(ft.NthLayerStrategy(100), profiling_iters=3, skip_discovery=True)
    _passes(model, ids, ref, 1)
    prepared = {label: trap._direct for label, trap in om.engine.traps.items()}
    assert all(direct is not None for direct in prepared.values())
    _passes(model, ids, ref, 2)
    om.wait_for_host_blocks()
    streamed = set(om.engine.inference.block_of)
    assert len(streamed) == 1
    for label, trap in om.engine.traps.items():
        if label in streamed:
            assert not trap.bypassed and trap.module.forward is trap._wrapper
        else:
            assert trap.bypassed and trap.module.forward is prepared[label]
    _passes(model, ids, ref, 3)


class RecordingNthLayer(ft.NthLayerStrategy):
    """NthLayer(1) that keeps the planner's input."""

    def __init__(self) -> None:
        super().__init__(1)
        self.inputs: list = []

    def plan(self, inp):
        self.inputs.append(inp)
        return super().plan(inp)


def test_a_buffer_that_grows_while_profiled_is_counted_at_its_size_at_the_switch():
    """Only the exclusive parameters' sizes are taken at the first counted pass; every other tensor (here a
    buffer resized in place after it) is counted when the plan is made."""
    model = tiny_transformer()
    model.register_buffer("cache", torch.zeros(4))
    ids = token_ids().to(DEVICE)
    strategy = RecordingNthLayer()
    om = ft.get_offload_manager()
    ft.offload(model, cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=strategy, profiling_iters=3,
                                 skip_discovery=True))
    with torch.no_grad():
        model(ids)
        assert om.engine.profile.switch_inputs is not None
        cache = om.engine.tensors["cache"].tensor
        assert cache is model.cache
        cache.resize_(1024)  # 4 KiB now, 16 bytes when the switch was prepared
        model(ids)
        model(ids)
    assert om.phase is Phase.INFERENCE and len(strategy.inputs) == 1
    exclusive = {n for names in om.engine.exclusive.values() for n in names}
    expected = sum(e.tensor.numel() * e.tensor.element_size() for n, e in om.engine.tensors.items() if n not in exclusive)
    assert strategy.inputs[0].fixed_resident_bytes == expected and expected >= 4096


class Recording(ft.NthLayerStrategy):
    """NthLayer(1) that keeps the PlanInput it was given."""

    def plan(self, inp):
        self.input = inp
        return super().plan(inp)


class GapModel(torch.nn.Module):
    """Linear, a parameter-free trap (a gap trap: its compute only widens the next copy's window), Linear."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.first, self.gap, self.last = torch.nn.Linear(d, d), torch.nn.GELU(), torch.nn.Linear(d, d)

    def forward(self, x):
        return self.last(self.gap(self.first(x)))


def _offload_recorded(model, monkeypatch=None):
    """Offload ``model`` by its Linear and GELU traps, 4 PROFILING passes, planned by a ``Recording`` strategy;
    returns (strategy, manager). With ``monkeypatch`` the device is never past a pass's marks (as when a
    copy-bound pass still runs at the switch)."""
    strategy = Recording()
    om = ft.get_offload_manager()
    ft.offload(model, cpu_config(include_patterns=["class:Linear", "class:GELU"], load_strategy=strategy,
                                 profiling_iters=4, skip_discovery=True))
    if monkeypatch is not None:
        monkeypatch.setattr(om.engine.clock, "done", lambda mark: False)
    return strategy, om


def test_the_switch_costs_a_gap_trap_its_compute_only_and_a_streamed_trap_its_median_and_stream_cost():
    torch.manual_seed(0)
    model, x = GapModel().eval(), torch.randn(4, 16).to(DEVICE)
    ref = reference(model, x)
    strategy, om = _offload_recorded(model)
    _passes(model, x, ref, om.iters_before_inference)  # the last one switches
    traps = {t.label: t for t in strategy.input.traps}
    assert [t.label for t in strategy.input.traps] == ["first", "gap", "last"]
    for label, trap in traps.items():  # every counted pass's window, the last one read at the switch
        assert len(om.engine.profile.durations[label]) == 4
        assert trap.compute_s == statistics.median(om.engine.profile.durations[label]) > 0.0
    assert traps["gap"].tensors == () and traps["gap"].stream_cost_s == 0.0
    for label in ("first", "last"):
        assert [t.name for t in traps[label].tensors] == [f"{label}.weight", f"{label}.bias"]
        assert traps[label].stream_cost_s > 0.0  # at least the device part of the per-call cost
    om.wait_for_host_blocks()
    _passes(model, x, ref, 2)


def test_while_the_device_still_runs_the_last_pass_the_switch_plans_from_the_passes_before_it(monkeypatch):
    """A device that has not reached the last PROFILING pass's end (a copy-bound pass) would keep the host waiting
    to read it: the plan is made from the passes before it meanwhile, and the last pass is read after the plan
    and kept with the others."""
    torch.manual_seed(0)
    model, x = GapModel().eval(), torch.randn(4, 16).to(DEVICE)
    ref = reference(model, x)
    strategy, om = _offload_recorded(model, monkeypatch)
    seen_at_plan: dict[str, list[float]] = {}
    plan = strategy.plan

    def plan_and_look(inp):
        seen_at_plan.update({label: list(s) for label, s in om.engine.profile.durations.items()})
        return plan(inp)

    monkeypatch.setattr(strategy, "plan", plan_and_look)
    _passes(model, x, ref, om.iters_before_inference)  # the last one switches
    for trap in strategy.input.traps:
        durations = om.engine.profile.durations[trap.label]
        assert len(durations) == 4 and seen_at_plan[trap.label] == durations[:3]
        assert trap.compute_s == statistics.median(durations[:3]) > 0.0
    om.wait_for_host_blocks()
    _passes(model, x, ref, 2)


def test_a_strategy_that_raises_while_the_device_runs_the_last_pass_leaves_that_pass_read(monkeypatch):
    """The last pass is read even when the plan made meanwhile raises: the next pass finds nothing left to read
    (so it marks its traps on the host's clock) and its switch plans from every pass, its own included."""
    torch.manual_seed(0)
    model, x = GapModel().eval(), torch.randn(4, 16).to(DEVICE)
    ref = reference(model, x)
    strategy, om = _offload_recorded(model, monkeypatch)
    seen_at_plan: list[int] = []
    plan = strategy.plan

    def fail_once(inp):
        seen_at_plan.append(len(om.engine.profile.durations["first"]))
        if len(seen_at_plan) == 1:
            raise ValueError("this strategy fails once")
        return plan(inp)

    monkeypatch.setattr(strategy, "plan", fail_once)
    _passes(model, x, ref, om.iters_before_inference - 1)
    with torch.no_grad(), pytest.raises(ValueError, match="fails once"):
        model(x)
    _passes(model, x, ref, 1)  # the switch again, now planned
    assert seen_at_plan == [3, 5] and len(om.engine.profile.durations["first"]) == 5
    om.wait_for_host_blocks()
    _passes(model, x, ref, 2)


class LateBranchModel(GapModel):
    """GapModel with one more Linear that runs only once ``late`` is set (a branch taken from some pass on)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        self.branch = torch.nn.Linear(d, d)
        self.late = False

    def forward(self, x):
        y = super().forward(x)
        return self.branch(y) if self.late else y


def test_a_trap_first_entered_in_the_last_pass_is_planned_from_its_reading(monkeypatch):
    """The plan is made ahead of the last pass's reading only when every trap of that pass has two samples or
    more before it: a branch first taken in the last pass is timed from that pass, not planned at zero."""
    torch.manual_seed(0)
    model, x = LateBranchModel().eval(), torch.randn(4, 16).to(DEVICE)
    model.late = True
    ref = reference(model, x)
    model.late = False
    strategy, om = _offload_recorded(model, monkeypatch)
    with torch.no_grad():
        for _ in range(om.iters_before_inference - 1):
            model(x)
        model.late = True
        assert same(model(x), ref)  # the last PROFILING pass: the switch
    traps = {t.label: t for t in strategy.input.traps}
    assert list(traps) == ["first", "gap", "last", "branch"]
    assert len(om.engine.profile.durations["branch"]) == 1 and traps["branch"].compute_s > 0.0
    assert traps["first"].compute_s == statistics.median(om.engine.profile.durations["first"])  # all 4 read
    om.wait_for_host_blocks()
    _passes(model, x, ref, 2)


def test_a_trap_never_called_is_named_with_the_patterns_that_reach_its_layers(caplog):
    model = tiny_transformer()  # its blocks live in a ModuleList: "*" traps the list, which nothing calls
    ids = token_ids().to(DEVICE)
    expected = reference(model, ids)
    om = ft.get_offload_manager()
    with caplog.at_level("WARNING", logger="flextensor.manager"):
        ft.offload(model, cpu_config())  # the default include_patterns, ["*"]
        with torch.no_grad():
            for _ in range(om.iters_before_inference + 1):
                assert same(model(ids), expected)
    assert om.phase is Phase.INFERENCE
    warnings = [r.getMessage() for r in caplog.records if "never called" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'blocks' (ModuleList, never called: name its layers, e.g. include_patterns=['blocks.*'])" in warnings[0]
    # a model whose traps are all called says nothing
    caplog.clear()
    ft.release()
    om = ft.get_offload_manager()
    with caplog.at_level("WARNING", logger="flextensor.manager"):
        ft.offload(model, cpu_config(include_patterns=["blocks.*"]))
        with torch.no_grad():
            for _ in range(om.iters_before_inference + 1):
                model(ids)
    assert not [r for r in caplog.records if "never called" in r.getMessage()]
