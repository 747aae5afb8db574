"""release() of a model held in host blocks: the weights come back block by block, never twice in RAM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flextensor as ft
import flextensor.runtime.host_memory as host_memory
from tests.helpers.models import cpu_config
from tests.helpers.process_memory import reset_peak, status_bytes

MiB = 1 << 20
LAYER_BYTES = 4096 * 4096 * 4  # 64 MiB: above glibc's largest mmap threshold, so every free returns its pages


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU computes from its host blocks in place")
def test_release_copies_the_model_out_of_its_blocks_one_arena_at_a_time(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(host_memory, "ARENA_MAX_BYTES", LAYER_BYTES)  # one block an arena
    layers = 8
    model = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(layers))).eval()
    x = torch.randn(2, 4096)
    with torch.no_grad():
        expected = model(x)
    om = ft.get_offload_manager()
    om.set_memory_budget(0)  # memory mode: every layer lives in a host block
    ft.offload(model, cpu_config(include_patterns=[str(i) for i in range(layers)]))
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            model(x)
    assert sum(len(names) for names in om.offloaded_tensors.values()) == layers
    released: list[int] = []
    provider = om.engine.inference.provider
    original = provider.release_block
    monkeypatch.setattr(provider, "release_block", lambda index: (released.append(index), original(index)))
    reset_peak()
    before = status_bytes("VmRSS")
    ft.release()
    growth = status_bytes("VmHWM") - before
    assert sorted(released) == list(range(layers)), released
    # Copied out all at once, the release held every block and every copy: growth of the whole model (512 MiB).
    # Block by block: one layer's copy while its block is still held, plus allocator slack.
    assert growth < 3 * LAYER_BYTES, f"release() grew the RSS by {growth / MiB:.0f} MiB"
    for layer in model:
        assert layer.weight.untyped_storage().nbytes() == LAYER_BYTES  # its own storage, no view of an arena
    with torch.no_grad():
        assert torch.equal(model(x), expected)
