"""The engine policy: forced paths reach the engine, merge over the process default, and bad values are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import flextensor as ft
from flextensor.engine.policy import EnginePolicy, default_engine_policy, set_default_engine_policy
from tests.helpers.models import cpu_config


def test_bad_values_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="'resident' or 'stream'"):
        EnginePolicy(warmup="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a bool"):
        EnginePolicy(stream_on_cpu=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="EnginePolicy"):
        set_default_engine_policy("stream")  # type: ignore[arg-type]


def test_changes_merge_over_the_process_default_and_none_returns_to_it():
    previous = set_default_engine_policy(EnginePolicy(stream_on_cpu=True))
    try:
        om = ft.get_offload_manager("policy")
        om.set_engine_policy(warmup="stream")
        assert om.engine_policy == EnginePolicy(warmup="stream", stream_on_cpu=True)
        with pytest.raises(ValueError, match="not both"):
            om.set_engine_policy(EnginePolicy(), warmup="resident")
        om.set_engine_policy(None)
        assert om.engine_policy is default_engine_policy()
    finally:
        set_default_engine_policy(previous)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU compute device's paths")
@pytest.mark.parametrize("stream_on_cpu", [False, True])
def test_the_engine_takes_the_managers_policy(stream_on_cpu: bool):
    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4))).eval()
    x = torch.randn(2, 32)
    with torch.no_grad():
        expected = model(x)
    om = ft.get_offload_manager()
    om.set_engine_policy(warmup="resident", stream_on_cpu=stream_on_cpu)
    ft.offload(model, cpu_config(include_patterns=["0", "1", "2", "3"]))
    with pytest.raises(RuntimeError, match="release\\(\\) it before changing its engine policy"):
        om.set_engine_policy(warmup="stream")
    assert om.engine.policy == replace(default_engine_policy(), warmup="resident", stream_on_cpu=stream_on_cpu)
    assert om.engine.warm.decision is not None and om.engine.warm.decision.forced
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            assert torch.equal(model(x), expected)
    assert om.engine.in_place is not stream_on_cpu


@pytest.mark.parametrize("rate", [0, -1.0, "fast", True, float("nan")])
def test_device_read_rate_must_be_a_positive_number(rate):
    with pytest.raises(ValueError, match="device_read_rate must be None or a number > 0"):
        EnginePolicy(device_read_rate=rate)


def test_device_read_rate_accepts_none_a_rate_and_infinity():
    assert EnginePolicy().device_read_rate is None
    assert EnginePolicy(device_read_rate=3.35e12).device_read_rate == 3.35e12
    assert EnginePolicy(device_read_rate=float("inf")).device_read_rate == float("inf")
