"""OffloadConfig: spec defaults, construction-time validation, copies, serialization."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest

from flextensor.configuration.config import OffloadConfig, validate_option

# The spec's option tables (core, memory, profiling, transfer, strategy, profile phase, profile storage,
# debugging), verbatim: name -> default.
SPEC_DEFAULTS = {
    "enabled": True,
    "gpu_device": 0,
    "include_patterns": ["*"],
    "exclude_patterns": [],
    "pinned_memory": True,
    "pinned_memory_mode": "torch",
    "shm_enabled": False,
    "shm_namespace": None,
    "shm_wait_timeout": 0.0,
    "max_gpu_mem_fraction": None,
    "skip_discovery": False,
    "discovery_iters": 1,
    "profiling_iters": 10,
    "transfer_mode": "allocation_block_transfer",
    "num_blocks": 4,
    "min_blocks": 4,
    "transfer_budget_scale": 1.0,
    "load_strategy": None,
    "profile_mode": "view",
    "profile_storage_dir": None,
    "profile_read_only": False,
    "enable_instrumentation": False,
    "instrumentation_output_dir": ".flextensor/instrumentation",
    "enable_diagnostics": False,
    "offload_timing": "off",
    "piecewise_prefetch": "warn",
}
# Options beyond the spec's tables, named in its style (docs/configuration.md lists them): name -> default.
EXTENSION_DEFAULTS = {
    "shm_dir": None,
}
DEFAULTS = {**SPEC_DEFAULTS, **EXTENSION_DEFAULTS}


class FakeStrategy:
    """Duck-typed strategy: the config only requires a plan() method."""

    def plan(self, plan_input):
        return None


def test_field_names_are_exactly_the_spec_options_and_the_extensions():
    assert set(OffloadConfig.field_names()) == set(DEFAULTS)
    assert len(OffloadConfig.field_names()) == len(DEFAULTS)


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_default_matches_spec(name):
    value = getattr(OffloadConfig(), name)
    expected = DEFAULTS[name]
    assert value == expected
    assert type(value) is type(expected)


def test_construction_is_keyword_only():
    with pytest.raises(TypeError):
        OffloadConfig(True, 0)  # type: ignore[misc]


def test_spec_examples_construct():
    cfg = OffloadConfig(
        include_patterns=["layers.*", "embed", "head"],
        exclude_patterns=["head", "*.norm", "class:MoELayer"],
        pinned_memory=True,
        pinned_memory_mode="host_register",
        max_gpu_mem_fraction=0.9,
        num_blocks=4,
        min_blocks=2,
        profile_storage_dir="/tmp/flextensor_profiles",
        offload_timing="eager",
        load_strategy=FakeStrategy(),
    )
    assert cfg.include_patterns == ["layers.*", "embed", "head"]
    assert cfg.exclude_patterns == ["head", "*.norm", "class:MoELayer"]
    assert cfg.min_blocks == 2 and cfg.max_gpu_mem_fraction == 0.9
    assert OffloadConfig(include_patterns=["class:torch.nn.*.Linear", "name:layers.*"]).include_patterns == [
        "class:torch.nn.*.Linear",
        "name:layers.*",
    ]
    assert OffloadConfig(transfer_mode="strategy", profile_mode="getter").transfer_mode == "strategy"
    assert OffloadConfig(transfer_mode="strategy", profile_mode="torch_function").profile_mode == "torch_function"
    assert OffloadConfig(max_gpu_mem_fraction=1.0).max_gpu_mem_fraction == 1.0
    assert OffloadConfig(offload_timing="cuda_graph").offload_timing == "cuda_graph"


def test_numbers_are_normalized_to_float():
    cfg = OffloadConfig(max_gpu_mem_fraction=1, shm_wait_timeout=3, transfer_budget_scale=2)
    assert (cfg.max_gpu_mem_fraction, cfg.shm_wait_timeout, cfg.transfer_budget_scale) == (1.0, 3.0, 2.0)
    for value in (cfg.max_gpu_mem_fraction, cfg.shm_wait_timeout, cfg.transfer_budget_scale):
        assert type(value) is float


def test_path_like_directories_become_str(tmp_path: Path):
    cfg = OffloadConfig(profile_storage_dir=tmp_path, instrumentation_output_dir=tmp_path / "inst")
    assert cfg.profile_storage_dir == str(tmp_path)
    assert cfg.instrumentation_output_dir == str(tmp_path / "inst")


# (kwargs, option the message must name, extra fragment the message must contain)
INVALID = [
    ({"enabled": 1}, "enabled", "bool"),
    ({"enabled": "true"}, "enabled", "bool"),
    ({"pinned_memory": None}, "pinned_memory", "bool"),
    ({"shm_enabled": 0}, "shm_enabled", "bool"),
    ({"skip_discovery": "no"}, "skip_discovery", "bool"),
    ({"profile_read_only": 1}, "profile_read_only", "bool"),
    ({"enable_instrumentation": 1}, "enable_instrumentation", "bool"),
    ({"enable_diagnostics": "yes"}, "enable_diagnostics", "bool"),
    ({"gpu_device": -1}, "gpu_device", ">= 0"),
    ({"gpu_device": True}, "gpu_device", "int"),
    ({"gpu_device": 1.0}, "gpu_device", "int"),
    ({"gpu_device": "0"}, "gpu_device", "int"),
    ({"discovery_iters": 0}, "discovery_iters", ">= 1"),
    ({"profiling_iters": 0}, "profiling_iters", ">= 1"),
    ({"profiling_iters": 2.5}, "profiling_iters", "int"),
    ({"min_blocks": 1, "num_blocks": 4}, "min_blocks", ">= 2"),
    ({"num_blocks": 1, "min_blocks": 2}, "num_blocks", ">= 2"),
    ({"num_blocks": 3}, "num_blocks", "min_blocks"),  # default min_blocks=4
    ({"num_blocks": 2, "min_blocks": 3}, "num_blocks", "min_blocks"),
    ({"min_blocks": False}, "min_blocks", "int"),
    ({"max_gpu_mem_fraction": 0.0}, "max_gpu_mem_fraction", "(0.0, 1.0]"),
    ({"max_gpu_mem_fraction": -0.5}, "max_gpu_mem_fraction", "(0.0, 1.0]"),
    ({"max_gpu_mem_fraction": 1.01}, "max_gpu_mem_fraction", "(0.0, 1.0]"),
    ({"max_gpu_mem_fraction": math.nan}, "max_gpu_mem_fraction", "(0.0, 1.0]"),
    ({"max_gpu_mem_fraction": math.inf}, "max_gpu_mem_fraction", "(0.0, 1.0]"),
    ({"max_gpu_mem_fraction": "0.9"}, "max_gpu_mem_fraction", "(0.0, 1.0]"),
    ({"max_gpu_mem_fraction": True}, "max_gpu_mem_fraction", "None"),
    ({"shm_wait_timeout": -1.0}, "shm_wait_timeout", ">= 0.0"),
    ({"shm_wait_timeout": math.inf}, "shm_wait_timeout", "finite"),
    ({"shm_wait_timeout": math.nan}, "shm_wait_timeout", "finite"),
    ({"shm_wait_timeout": None}, "shm_wait_timeout", "float"),
    ({"transfer_budget_scale": 0.0}, "transfer_budget_scale", "> 0.0"),
    ({"transfer_budget_scale": -1.0}, "transfer_budget_scale", "> 0.0"),
    ({"transfer_budget_scale": math.inf}, "transfer_budget_scale", "finite"),
    ({"transfer_budget_scale": math.nan}, "transfer_budget_scale", "finite"),
    ({"pinned_memory_mode": "cuda"}, "pinned_memory_mode", "'host_register'"),
    ({"pinned_memory_mode": "TORCH"}, "pinned_memory_mode", "'torch'"),
    ({"pinned_memory_mode": None}, "pinned_memory_mode", "'torch'"),
    ({"transfer_mode": "block"}, "transfer_mode", "'allocation_block_transfer', 'strategy', 'raw_block_transfer'"),
    ({"transfer_mode": None}, "transfer_mode", "'allocation_block_transfer', 'strategy', 'raw_block_transfer'"),
    ({"profile_mode": "torch_function"}, "profile_mode", "requires transfer_mode='strategy'"),
    ({"profile_mode": "torch_function", "transfer_mode": "strategy", "shm_enabled": True, "shm_namespace": "n"},
     "profile_mode", "shm_enabled=True"),
    ({"profile_mode": "views"}, "profile_mode", "'view', 'getter', 'torch_function'"),
    ({"offload_timing": "cuda_graph", "transfer_mode": "strategy"}, "offload_timing", "transfer_mode"),
    ({"offload_timing": "on"}, "offload_timing", "'off', 'eager'"),
    ({"offload_timing": "eager", "transfer_mode": "strategy"}, "offload_timing", "transfer_mode"),
    ({"piecewise_prefetch": "ignore"}, "piecewise_prefetch", "'off', 'warn', 'error'"),
    ({"piecewise_prefetch": True}, "piecewise_prefetch", "'warn'"),
    ({"include_patterns": "layers.*"}, "include_patterns", "list"),
    ({"include_patterns": None}, "include_patterns", "list"),
    ({"include_patterns": [""]}, "include_patterns", "non-empty"),
    ({"include_patterns": ["  "]}, "include_patterns", "non-empty"),
    ({"include_patterns": [3]}, "include_patterns", "non-empty"),
    ({"include_patterns": ["klass:Linear"]}, "include_patterns", "'klass:Linear'"),
    ({"include_patterns": ["layers.*", "modul:Foo"]}, "include_patterns", "'modul:Foo'"),
    ({"include_patterns": ["class:"]}, "include_patterns", "empty glob"),
    ({"exclude_patterns": ["type:MoELayer"]}, "exclude_patterns", "'type:MoELayer'"),
    ({"exclude_patterns": ["name: "]}, "exclude_patterns", "empty glob"),
    ({"exclude_patterns": {"head"}}, "exclude_patterns", "list"),
    ({"shm_enabled": True}, "shm_namespace", "shm_enabled=True"),
    ({"shm_enabled": True, "shm_namespace": ""}, "shm_namespace", "non-empty"),
    ({"shm_namespace": 5}, "shm_namespace", "non-empty"),
    ({"load_strategy": object()}, "load_strategy", "plan()"),
    ({"load_strategy": "greedy"}, "load_strategy", "plan()"),
    ({"load_strategy": FakeStrategy}, "load_strategy", "FakeStrategy()"),
    ({"profile_storage_dir": ""}, "profile_storage_dir", "non-empty"),
    ({"profile_storage_dir": 3}, "profile_storage_dir", "path"),
    ({"instrumentation_output_dir": None}, "instrumentation_output_dir", "path"),
]


@pytest.mark.parametrize(("kwargs", "option", "fragment"), INVALID, ids=[repr(k) for k, _, _ in INVALID])
def test_invalid_values_are_rejected_naming_option_and_allowed(kwargs, option, fragment):
    with pytest.raises(ValueError) as info:
        OffloadConfig(**kwargs)
    message = str(info.value)
    assert repr(option) in message or f"{option}=" in message
    assert fragment in message


def test_message_names_the_bad_value():
    with pytest.raises(ValueError, match=r"'gpu_device' got -7"):
        OffloadConfig(gpu_device=-7)
    with pytest.raises(ValueError, match=r"'pinned_memory_mode' got 'cuda'"):
        OffloadConfig(pinned_memory_mode="cuda")


def test_raw_block_transfer_is_a_block_mode():
    """Accepted, and a block mode: eager offload timing, which needs one copy per trap, takes it."""
    cfg = OffloadConfig(transfer_mode="raw_block_transfer", offload_timing="eager")
    assert cfg.transfer_mode == "raw_block_transfer" and cfg.to_dict()["transfer_mode"] == "raw_block_transfer"


def test_torch_function_message_mentions_strategy_constraint():
    with pytest.raises(ValueError, match="transfer_mode='strategy'"):
        OffloadConfig(profile_mode="torch_function")


def test_load_strategy_is_duck_typed():
    strategy = FakeStrategy()
    assert OffloadConfig(load_strategy=strategy).load_strategy is strategy


def test_shm_namespace_is_checked_by_shm_names():
    pytest.importorskip("flextensor.shm.names")
    cfg = OffloadConfig(shm_enabled=True, shm_namespace="my_run")
    assert cfg.shm_enabled and cfg.shm_namespace == "my_run"
    for bad in ("a/b", "..", "with space", "x" * 201, "nul\x00"):
        with pytest.raises(ValueError, match="shm_namespace"):
            OffloadConfig(shm_enabled=True, shm_namespace=bad)


def test_copies_do_not_share_lists():
    a = OffloadConfig()
    b = OffloadConfig()
    a.include_patterns.append("layers.*")
    a.exclude_patterns.append("head")
    assert b.include_patterns == ["*"] and b.exclude_patterns == []

    source = ["layers.*"]
    c = OffloadConfig(include_patterns=source)
    source.append("embed")
    assert c.include_patterns == ["layers.*"]
    assert OffloadConfig(include_patterns=("a", "b")).include_patterns == ["a", "b"]

    for clone in (dataclasses.replace(c), copy.copy(c), copy.deepcopy(c)):
        assert clone == c
        assert clone.include_patterns is not c.include_patterns
        assert clone.exclude_patterns is not c.exclude_patterns
        clone.include_patterns.append("head")
        assert c.include_patterns == ["layers.*"]


def test_replace_revalidates():
    cfg = OffloadConfig(num_blocks=6, min_blocks=3)
    assert dataclasses.replace(cfg, gpu_device=2).gpu_device == 2
    with pytest.raises(ValueError, match="num_blocks"):
        dataclasses.replace(cfg, num_blocks=2)
    with pytest.raises(ValueError, match="profiling_iters"):
        dataclasses.replace(cfg, profiling_iters=0)


def test_validate_after_mutation():
    cfg = OffloadConfig()
    cfg.min_blocks = 1
    with pytest.raises(ValueError, match="min_blocks"):
        cfg.validate()


def test_to_dict_is_json_able():
    strategy = FakeStrategy()
    cfg = OffloadConfig(load_strategy=strategy, include_patterns=["class:*DecoderLayer"])
    data = cfg.to_dict()
    assert list(data) == list(OffloadConfig.field_names())
    assert data["load_strategy"] == "FakeStrategy"
    assert json.loads(json.dumps(data)) == data
    data["include_patterns"].append("x")
    assert cfg.include_patterns == ["class:*DecoderLayer"]
    defaults = OffloadConfig().to_dict()
    assert defaults == DEFAULTS
    # Everything except load_strategy round-trips through the constructor.
    assert OffloadConfig(**{k: v for k, v in defaults.items() if k != "load_strategy"}) == OffloadConfig()


def test_validate_option_normalizes_and_rejects_unknown():
    assert validate_option("max_gpu_mem_fraction", 1) == 1.0
    assert validate_option("include_patterns", ("a",)) == ["a"]
    with pytest.raises(ValueError, match="unknown OffloadConfig option 'gpu_devices'"):
        validate_option("gpu_devices", 1)
