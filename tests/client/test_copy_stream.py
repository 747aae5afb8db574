"""The loader's own copy stream (``flextensor.copy_stream``): created alone, ordered, destroyed once."""

from __future__ import annotations

import gc

import pytest
import torch

import flextensor.copy_stream as copy_stream
from flextensor.copy_stream import CopyStream

pytestmark = pytest.mark.cuda


def _pool_was_touched(monkeypatch) -> list:
    """Record every ``torch.cuda.Stream`` made from PyTorch's pool inside the module under test."""
    made: list = []
    real = torch.cuda.Stream

    class Spy(real):  # type: ignore[misc, valid-type]
        def __new__(cls, *args, **kwargs):
            made.append((args, kwargs))
            return real(*args, **kwargs)

    monkeypatch.setattr(copy_stream.torch.cuda, "Stream", Spy)
    return made


def test_own_stream_carries_copies_and_is_destroyed_once(monkeypatch):
    device = torch.device("cuda", 0)
    pool = _pool_was_touched(monkeypatch)
    owner = CopyStream(device)
    assert owner.owned and pool == []  # one stream of its own, none from the pool
    assert owner.stream.device == device and owner.stream != torch.cuda.current_stream(device)
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    out = torch.empty_like(host, device=device)
    with torch.cuda.stream(owner.stream):
        out.copy_(host, non_blocking=True)
    torch.cuda.current_stream(device).wait_stream(owner.stream)
    assert torch.equal(out.cpu(), host)
    owner.close()
    owner.close()  # idempotent: the handle is destroyed once
    assert owner._finalizer is None


def test_dropped_owner_destroys_its_stream():
    owner = CopyStream(torch.device("cuda", 0))
    finalizer = owner._finalizer
    assert finalizer is not None and finalizer.alive
    del owner
    gc.collect()
    assert not finalizer.alive


def test_without_the_runtime_library_a_pool_stream_is_used(monkeypatch):
    monkeypatch.setattr(copy_stream, "_loaded_cudart", lambda: None)
    owner = CopyStream(torch.device("cuda", 0))
    assert not owner.owned and isinstance(owner.stream, torch.cuda.Stream)
    owner.close()  # only waits: a pool stream is not ours to destroy


def test_loader_uses_and_closes_its_own_stream():
    from flextensor.host_memory import block_views, pack_block
    from flextensor.loader import BlockLoader

    device = torch.device("cuda", 0)
    weights = [torch.randn(64, 64) for _ in range(2)]
    layouts = [pack_block(i, f"t{i}", [(f"w{i}", w.dtype, tuple(w.shape), w.stride())]) for i, w in enumerate(weights)]
    hosts = []
    for layout, w in zip(layouts, weights):
        host = torch.zeros(layout.nbytes, dtype=torch.uint8).pin_memory()
        block_views(host, layout.tensors)[0].copy_(w)
        hosts.append(host)
    params = [[torch.nn.Parameter(w.clone(), requires_grad=False)] for w in weights]
    loader = BlockLoader(device=device, layouts=layouts, host_blocks=hosts, params=params, schedule=[0, 1],
                         num_slots=2)
    assert loader._copy_stream.owned and loader._side is loader._copy_stream.stream
    for block, w in enumerate(weights):
        loader.enter(block)
        assert torch.equal(params[block][0].data.cpu(), w)
        loader.exit(block)
    loader.close()
    assert loader._copy_stream._finalizer is None
