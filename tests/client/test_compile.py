"""torch.compile over offloaded models: whole-model ``torch.compile`` (inductor) over a streamed model and over a
shared session's model, and ``compile_fn`` per unit. Outputs equal eager; the engine's steps never enter a graph
(Note [engine steps outside compiled graphs] in ``flextensor.runtime.compile_guard``).

CPU inductor needs a C++ compiler. The tests use the inductor cache a plain run of this user would (each test
has its own TMPDIR, where inductor would otherwise start from nothing): its C++ helpers and the small model's
kernels are built once per host, not once per test (the first build takes tens of seconds on a CI runner).
"""

from __future__ import annotations

import getpass
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flextensor as ft
from tests.helpers.models import DEVICE, cpu_config

needs_compiler = pytest.mark.skipif(
    DEVICE.type == "cpu" and shutil.which("g++") is None and shutil.which("c++") is None,
    reason="inductor on the CPU needs a C++ compiler (g++), which this host lacks",
)


class ScaledBlock(nn.Module):
    """An MLP layer with a float16 scale: its offloaded tensors are views of one block in two dtypes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.scale = nn.Parameter((1.0 + 0.1 * torch.randn(d)).to(torch.float16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) * self.scale.float()


class Net(nn.Module):
    """Layers called from the model's own forward (one frame for dynamo), and a resident head."""

    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock(d) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().eval()


def net_config(**kwargs) -> ft.OffloadConfig:
    kwargs.setdefault("include_patterns", ["layers.*"])
    kwargs.setdefault("load_strategy", ft.NthLayerStrategy(1))
    return cpu_config(**kwargs)


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def eager_reference() -> torch.Tensor:
    model = net().to(DEVICE)
    with torch.no_grad():
        return model(X.to(DEVICE))


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Inductor's kernels are not eager's: equal to float32 tolerance, not bit for bit."""
    atol = 1e-5 if DEVICE.type == "cpu" else 1e-4
    return out.shape == ref.shape and torch.allclose(out.float(), ref.float(), atol=atol, rtol=1e-4)


# Read at import, before a test's TMPDIR replaces the host's: inductor's own default location.
INDUCTOR_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
# Imported here for the same reason: inductor keeps its precompiled C++ headers under the default location of the
# moment this module is imported, not under TORCHINDUCTOR_CACHE_DIR; imported in a test, they would be compiled
# again in every run's TMPDIR (about 5 s of g++ on a 2-core host).
import torch._inductor.codecache  # noqa: E402, F401


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch):
    """The host's inductor cache (see the module docstring); dynamo's caches emptied around each test (layer
    frames compiled by one test must not count against the next test's recompile limit)."""
    import torch._dynamo as dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", INDUCTOR_CACHE)
    dynamo.reset()
    dynamo.utils.counters.clear()
    yield
    dynamo.reset()


def graph_breaks() -> list[str]:
    import torch._dynamo as dynamo

    return list(dynamo.utils.counters["graph_break"])


def frames_compiled() -> int:
    import torch._dynamo as dynamo

    return dynamo.utils.counters["frames"]["total"]


def graphs_compiled() -> int:
    import torch._dynamo as dynamo

    return dynamo.utils.counters["stats"]["unique_graphs"]


def phase(manager) -> str:
    return manager.phase.value if manager.phase is not None else "released"


def params_on(model: nn.Module) -> dict[str, str]:
    """Where each parameter lives (assertion messages)."""
    return {name: str(p.device) for name, p in model.named_parameters()}


def assert_only_trap_boundaries(breaks: list[str]) -> None:
    """A streamed trap is where a graph ends (its loader steps run between graphs); nothing else may break one:
    not the per-pass thread check, not the engine's bookkeeping, not the install of host blocks."""
    for reason in breaks:
        first = reason.split("\n*** While handling", 1)[0]  # what followed from it is the same break
        assert first.startswith("Skip inlining") and "ScaledBlock.forward" in first, reason
    assert not any("get_ident" in r or "flextensor/engine" in r or "flextensor/manager" in r for r in breaks)


# ---------------------------------------------------------------------------------------------------------------
@needs_compiler
def test_compiling_a_streamed_model_before_its_warmup_equals_eager(stream_on_cpu: None) -> None:
    """torch.compile(model) straight after offload(): the warm-up, the switch, the host blocks built behind
    resident inference and installed at a compiled pass's start, then streaming (layers of two dtypes in one
    block); every output equals eager, and the steady passes compile nothing new."""
    ref = eager_reference()
    model = net()
    manager = ft.get_offload_manager()
    manager.set_engine_policy(warmup="resident")  # the host blocks are built on a thread and installed at a pass start
    ft.offload(model, net_config())
    compiled = torch.compile(model)
    x = X.to(DEVICE)
    with torch.no_grad():
        assert close(compiled(x), ref)
        assert graphs_compiled() == 0, f"DISCOVERY compiled code; breaks: {graph_breaks()}"  # an eager region
        for i in range(manager.iters_before_inference):
            assert close(compiled(x), ref), f"pass {i + 2}, phase {phase(manager)}"
        assert manager.engine.inference.deferred is not None
        manager.engine.inference.deferred.wait()  # built: the next compiled pass installs it
        for i in range(2):
            assert close(compiled(x), ref), f"pass {i + 1} after the host blocks were built"
        assert manager.engine.inference.deferred is None and manager.loader is not None
        copies = manager.loader.copies_issued
        frames = frames_compiled()
        for _ in range(3):
            assert close(compiled(x), ref)
    assert manager.loader.copies_issued == copies + 3 * 3  # every pass streamed its three layers
    assert frames_compiled() == frames, f"compiled per forward; breaks: {graph_breaks()}"
    assert_only_trap_boundaries(graph_breaks())
    ft.release()
    assert set(params_on(model).values()) == {"cpu"}, params_on(model)  # back where they came from
    model.to(DEVICE)
    with torch.no_grad():
        assert close(model(x), ref)  # released: the model's own forward, its weights back


@needs_compiler
def test_compiled_shared_model_is_one_graph_per_forward(namespace: str, tmp_path: Path) -> None:
    """A session's model on the CPU computes from the shared blocks in place: torch.compile(fullgraph=True)
    traces the whole forward into one graph (the root forward's thread check and pass bookkeeping run outside)."""
    ref = eager_reference()
    model = net()
    ft.offload(model, net_config(), name="profiler")
    with torch.no_grad():
        for _ in range(ft.get_offload_manager("profiler").iters_before_inference):
            model(X.to(DEVICE))
    ft.save_profile(str(tmp_path / "profile"), name="profiler")
    ft.release("profiler")

    def follower() -> Net:
        with torch.device("meta"):
            return Net()

    with ft.SharedOffloadSession(namespace, lease_seconds=1.0) as session:
        shared = session.offload_from_profile(str(tmp_path / "profile"), config=net_config(), name="model",
                                              creator_model_factory=net, follower_model_factory=follower)
        compiled = torch.compile(shared, fullgraph=DEVICE.type == "cpu")
        with torch.no_grad():
            outs = [compiled(X.to(DEVICE)) for _ in range(3)]
        assert all(close(out, ref) for out in outs)
        if DEVICE.type == "cpu":
            import torch._dynamo as dynamo

            assert dynamo.utils.counters["stats"]["unique_graphs"] == 1 and graph_breaks() == []
        else:
            assert_only_trap_boundaries(graph_breaks())


@needs_compiler
def test_compile_fn_compiles_every_offloaded_unit(stream_on_cpu: None) -> None:
    """offload(..., compile_fn=torch.compile): one compiled graph per trap, the offload units among them; the
    compiled units read the parameters the loader points at the rotating blocks."""
    ref = eager_reference()
    model = net()
    shims: list[nn.Module] = []

    def compile_fn(shim: nn.Module) -> nn.Module:
        shims.append(shim)
        return torch.compile(shim)

    ft.offload(model, net_config(), compile_fn=compile_fn)
    manager = ft.get_offload_manager()
    x = X.to(DEVICE)
    with torch.no_grad():
        assert close(model(x), ref)
        assert graphs_compiled() == 0, "DISCOVERY compiled a unit"  # the units' own forwards ran, uncompiled
        for i in range(manager.iters_before_inference - 1):
            assert close(model(x), ref), f"pass {i + 2}, phase {phase(manager)}"
        assert graphs_compiled() > 0  # PROFILING ran the compiled units
        manager.wait_for_host_blocks()
        outs = [model(x) for _ in range(3)]
    assert all(close(out, ref) for out in outs)
    compiled_modules = {id(shim._fn.__self__) for shim in shims}  # each shim wraps its trap's original forward
    units = ft.offload_units()
    assert [name for name, _ in units] == ["layers.0", "layers.1", "layers.2"]
    assert all(id(module) in compiled_modules for _, module in units)
    assert manager.loader is not None and manager.loader.copies_issued >= 3 * 3


def test_compiling_the_model_again_after_release_and_offload(stream_on_cpu: None) -> None:
    """The patched forwards are skipped frames, not the model's: after release() the same model compiles as a
    plain model (its own forward traced), and a second offload is traced as the first (aot_eager: cheap)."""
    import torch._dynamo as dynamo

    ref = eager_reference()
    model = net()
    x = X.to(DEVICE)
    for round_ in range(2):
        ft.offload(model, net_config())
        manager = ft.get_offload_manager()
        with torch.no_grad():
            for _ in range(manager.iters_before_inference):
                model(x)
            compiled = torch.compile(model, backend="aot_eager")
            outs = [compiled(x) for _ in range(2)]
        assert all(close(out, ref) for out in outs), f"offload {round_ + 1}"
        ft.release()
        assert set(params_on(model).values()) == {"cpu"}, (round_, params_on(model))  # where they came from
        dynamo.reset()
    model.to(DEVICE)  # released weights are back on the CPU, where the model was built
    plain = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert close(plain(x), ref)


def test_compiling_each_unit_after_inference_starts(stream_on_cpu: None) -> None:
    """The units listed after INFERENCE compiled in place (``module.compile()``): each unit's call runs its trap's
    loader steps outside the graph and compiles the unit's own forward."""
    ref = eager_reference()
    model = net()
    ft.offload(model, net_config(load_strategy=ft.NthLayerStrategy(2)))
    manager = ft.get_offload_manager()
    x = X.to(DEVICE)
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(x)
        manager.wait_for_host_blocks()
        units = ft.offload_units() + ft.resident_units()
        assert sorted(name for name, _ in units) == ["layers.0", "layers.1", "layers.2"]
        for _, module in units:
            module.compile(backend="aot_eager")
        outs = [model(x)]
        copies = manager.loader.copies_issued
        outs += [model(x) for _ in range(3)]
    assert all(close(out, ref) for out in outs)
    assert manager.loader.copies_issued == copies + 3 * len(ft.offload_units())  # steady: its units, each pass
    assert_only_trap_boundaries(graph_breaks())
