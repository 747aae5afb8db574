"""StagedCopy: a host range copied through a small pinned ring, chunk by chunk, gives the same bytes; the ring is
registered once and unregistered after the last copy; a refused registration falls back to a direct copy."""

from __future__ import annotations

import logging

import pytest
import torch

import flextensor.runtime.staged_copy as staged_mod
from flextensor.runtime.staged_copy import StagedCopy

CHUNK = 1 << 16


class FakePin:
    """Records the ring's registration; its unregistration must come after the last chunk was copied."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("cudaHostRegister failed: cudaErrorMemoryAllocation (2)")
        self.calls.append(("register", ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.calls.append(("unregister", ptr))


def _source(nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))


@pytest.mark.parametrize("nbytes", [5 * CHUNK + 123, 4 * CHUNK, CHUNK + 1])
def test_every_byte_arrives_through_the_ring(nbytes):
    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=2, min_bytes=CHUNK, register=pin.register, unregister=pin.unregister)
    src, dst = _source(nbytes), torch.zeros(nbytes, dtype=torch.uint8)
    copier(dst, src)
    assert torch.equal(dst, src)
    assert copier.last.staged and copier.last.nbytes == nbytes
    (register, ptr, size), unregister = pin.calls
    assert register == "register" and size == 2 * CHUNK and unregister == ("unregister", ptr)


def test_a_small_range_is_copied_directly_without_a_ring():
    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=2, min_bytes=4 * CHUNK, register=pin.register,
                        unregister=pin.unregister)
    src, dst = _source(3 * CHUNK), torch.zeros(3 * CHUNK, dtype=torch.uint8)
    copier(dst, src)
    assert torch.equal(dst, src) and not copier.last.staged and pin.calls == []


def test_a_refused_ring_falls_back_to_a_direct_copy_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(staged_mod, "_warned", False)
    pin = FakePin(fail=True)
    copier = StagedCopy(chunk_bytes=CHUNK, slots=2, min_bytes=0, register=pin.register, unregister=pin.unregister)
    with caplog.at_level(logging.WARNING, logger="flextensor.runtime.staged_copy"):
        for _ in range(2):
            src, dst = _source(3 * CHUNK), torch.zeros(3 * CHUNK, dtype=torch.uint8)
            copier(dst, src)
            assert torch.equal(dst, src) and not copier.last.staged
    assert caplog.text.count("could not register") == 1


def test_mismatched_ranges_are_refused_with_the_sizes():
    copier = StagedCopy(chunk_bytes=CHUNK, register=FakePin().register, unregister=FakePin().unregister)
    with pytest.raises(ValueError, match="10 bytes"):
        copier(torch.zeros(11, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        copier(torch.zeros(10, dtype=torch.float32), torch.zeros(10, dtype=torch.uint8))


@pytest.mark.cuda
def test_a_staged_copy_to_the_gpu_equals_the_source():
    nbytes = 3 * staged_mod.CHUNK_BYTES + 4097
    src = _source(nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copier = StagedCopy()
    copier(dst, src)
    assert copier.last.staged
    assert torch.equal(dst.cpu(), src)


def test_a_followers_resident_copies_through_the_ring_equal_the_store(namespace):
    """The attach thread's path (``copies_on`` with a ``StagedCopy`` fill), on the CPU: every record's copy equals
    its bytes in the store, with the record's dtype and shape."""
    from torch import nn

    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.names import manager_namespace
    from flextensor.shm.tensor_store import SharedTensorStore

    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 64), nn.LayerNorm(64)).to(torch.bfloat16)
    ns = manager_namespace(namespace, "model")
    pin = FakePin()
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, model, shm_owner=creator.memory_owner)
        copier = StagedCopy(chunk_bytes=CHUNK, slots=3, min_bytes=0, register=pin.register, unregister=pin.unregister)
        copies = store.copies_on("cpu", fill=copier)
        assert copier.last.staged and copier.last.nbytes > 4 * CHUNK
        for name, value in store.tensors().items():
            if name in copies:
                assert copies[name].dtype == value.dtype and torch.equal(copies[name], value), name
        assert [c[0] for c in pin.calls] == ["register", "unregister"]
        del copies
        store.close()
