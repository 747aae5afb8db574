"""cuda_enqueue: copies queued on a stream through PyTorch's own CUDA runtime, with an event per slot, land on the
device byte for byte; a refused call is a RuntimeError naming it and leaves no error behind for PyTorch; a
staged copy gives the same bytes through these calls and through PyTorch's."""

from __future__ import annotations

import pytest
import torch

import flextensor.runtime.cuda_enqueue as cuda_enqueue
import flextensor.runtime.staged_copy as staged_mod
from flextensor.runtime.cuda_enqueue import CopyEvents
from flextensor.runtime.staged_copy import StagedCopy

pytestmark = pytest.mark.cuda


def _runtime() -> cuda_enqueue.CudaRuntime:
    torch.empty(1, device="cuda")  # PyTorch has loaded its runtime
    runtime = cuda_enqueue.load()
    assert runtime is not None, "PyTorch's CUDA runtime library was not found in /proc/self/maps"
    return runtime


def test_queued_copies_from_two_slots_land_on_the_device_in_order():
    runtime = _runtime()
    host = torch.arange(2 * 4096, dtype=torch.int32).view(torch.uint8).pin_memory()
    dst = torch.zeros(host.numel() * 2, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    half = host.numel() // 2
    events = CopyEvents(runtime, stream.cuda_stream, 2)
    try:
        events.copy(0, dst.data_ptr(), host.data_ptr(), half)
        events.copy(1, dst.data_ptr() + half, host.data_ptr() + half, half)
        events.wait(0)
        events.wait(1)
        assert stream.query()
        events.copy(0, dst.data_ptr() + host.numel(), host.data_ptr(), host.numel())  # a slot used again
        events.wait(0)
    finally:
        events.close()
        events.close()
    assert torch.equal(dst[: host.numel()].cpu(), host)
    assert torch.equal(dst[host.numel():].cpu(), host)


def test_a_refused_copy_names_the_call_and_leaves_pytorch_working():
    runtime = _runtime()
    host = torch.ones(64, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    events = CopyEvents(runtime, stream.cuda_stream, 1)
    try:
        with pytest.raises(RuntimeError, match="cudaMemcpyAsync of 64 bytes"):
            events.copy(0, 8, host.data_ptr(), 64)  # no device memory at address 8
    finally:
        events.close()
    out = torch.ones(4, device="cuda") * 2  # no CUDA error left over for PyTorch's next launch
    torch.cuda.synchronize()
    assert out.sum().item() == 8


@pytest.mark.parametrize("lean", [True, False], ids=["cuda_enqueue", "pytorch_calls"])
def test_a_staged_copy_equals_the_source_through_either_calls(monkeypatch, lean):
    _runtime()
    if not lean:
        monkeypatch.setattr(cuda_enqueue, "load", lambda: None)
    nbytes = 5 * staged_mod.CHUNK_BYTES + 777
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copier = StagedCopy(min_bytes=0, threads=3, slots=6, stream=torch.cuda.Stream())
    copier(dst, src)
    assert copier.last.staged and copier.last.threads == 3
    assert torch.equal(dst.cpu(), src)
