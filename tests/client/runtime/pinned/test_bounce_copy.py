"""StagedCopy: a host range copied through a small pinned ring, chunk by chunk, gives the same bytes, read from
the range's file (pread) or its mapping, by one or several workers; the ring is registered once and unregistered
after the last copy (or by the release thread); a refused registration falls back to a direct copy."""

from __future__ import annotations

import logging
import os
import tempfile
import time

import pytest
import torch

import flextensor.runtime.pinned.bounce_copy as staged_mod
from flextensor.runtime.pinned.bounce_copy import StagedCopy

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
    assert copier.last.staged and copier.last.nbytes == nbytes and copier.last.source == "mapping"
    (register, ptr, size), unregister = pin.calls
    assert register == "register" and size == 2 * CHUNK and unregister == ("unregister", ptr)


def test_pieces_from_a_file_and_from_memory_arrive_through_one_ring(tmp_path):
    """Three pieces in one copy (one read from a file with pread at an offset, two from memory, one of them
    shorter than a chunk): every byte lands in its own destination, and the ring is registered once."""
    pin = FakePin()
    sizes = [3 * CHUNK + 5, CHUNK - 7, 2 * CHUNK]
    sources = [_source(n) for n in sizes]
    path = tmp_path / "piece0"
    path.write_bytes(b"\0" * 100 + sources[0].numpy().tobytes())
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    copier = StagedCopy(chunk_bytes=CHUNK, slots=4, threads=2, min_bytes=0, register=pin.register,
                        unregister=pin.unregister)
    fd = os.open(path, os.O_RDONLY)
    try:
        copier.copy_pieces([(dsts[0], sources[0], (fd, 100)), (dsts[1], sources[1], None), (dsts[2], sources[2])])
    finally:
        os.close(fd)
    for dst, src in zip(dsts, sources):
        assert torch.equal(dst, src)
    assert copier.last.staged and copier.last.nbytes == sum(sizes) and copier.last.source == "file+mapping"
    assert [c[0] for c in pin.calls] == ["register", "unregister"]


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
    with caplog.at_level(logging.WARNING, logger="flextensor.runtime.pinned.bounce_copy"):
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


def _file_holding(data: torch.Tensor, offset: int) -> int:
    """A read-only fd of an unlinked temporary file holding ``data`` from ``offset``."""
    with tempfile.NamedTemporaryFile() as f:
        f.write(b"\xff" * offset + data.numpy().tobytes())
        f.flush()
        return os.open(f.name, os.O_RDONLY)


@pytest.mark.parametrize("threads,slots", [(1, 2), (3, 6), (4, 5)])
def test_bytes_are_read_from_the_file_when_given_by_every_worker(threads, slots):
    """With ``file`` the bytes come from the file (the mapping passed as ``src`` is not read: here it holds
    zeros), whatever the number of workers and slots, starting chunk included."""
    nbytes = 11 * CHUNK + 77
    data = _source(nbytes)
    fd = _file_holding(data, 4096 + 3)
    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=slots, threads=threads, min_bytes=0, register=pin.register,
                        unregister=pin.unregister)
    try:
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        copier(dst, torch.zeros(nbytes, dtype=torch.uint8), (fd, 4096 + 3))
    finally:
        os.close(fd)
    assert torch.equal(dst, data)
    assert (copier.last.source, copier.last.threads, copier.last.staged) == ("file", min(threads, slots), True)
    assert [c[0] for c in pin.calls] == ["register", "unregister"] and pin.calls[0][2] == slots * CHUNK


def test_a_file_shorter_than_the_range_is_an_eof_error_and_the_ring_is_still_released():
    data = _source(3 * CHUNK)
    fd = _file_holding(data, 0)
    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=4, threads=2, min_bytes=0, register=pin.register,
                        unregister=pin.unregister)
    try:
        with pytest.raises(EOFError, match="truncated while in use"):
            copier(torch.zeros(5 * CHUNK, dtype=torch.uint8), torch.zeros(5 * CHUNK, dtype=torch.uint8), (fd, 0))
    finally:
        os.close(fd)
    assert [c[0] for c in pin.calls] == ["register", "unregister"]


def test_a_ring_prepared_in_the_background_serves_the_next_copy_and_close_releases_an_unused_one():
    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=2, min_bytes=0, register=pin.register, unregister=pin.unregister)
    copier.prepare_in_background()
    src, dst = _source(3 * CHUNK), torch.zeros(3 * CHUNK, dtype=torch.uint8)
    copier(dst, src)
    assert torch.equal(dst, src) and [c[0] for c in pin.calls] == ["register", "unregister"]
    assert copier.last.ring_wait_s >= 0 and copier.last.ring_populate_s >= 0
    copier.prepare_in_background()
    copier.close()
    copier.close()
    assert [c[0] for c in pin.calls] == ["register", "unregister"] * 2


def test_background_release_hands_the_ring_to_the_release_thread():
    import flextensor.shm.background_release as release_mod

    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=2, min_bytes=0, register=pin.register, unregister=pin.unregister,
                        background_release=True)
    src, dst = _source(2 * CHUNK + 5), torch.zeros(2 * CHUNK + 5, dtype=torch.uint8)
    copier(dst, src)
    assert torch.equal(dst, src)
    assert release_mod.wait_released(timeout=30)
    assert [c[0] for c in pin.calls] == ["register", "unregister"]


@pytest.mark.cuda
def test_a_staged_copy_to_the_gpu_equals_the_source():
    nbytes = 3 * staged_mod.CHUNK_BYTES + 4097
    src = _source(nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copier = StagedCopy(min_bytes=0)
    copier(dst, src)
    assert copier.last.staged and copier.last.source == "mapping"
    assert torch.equal(dst.cpu(), src)


@pytest.mark.cuda
def test_a_staged_copy_from_a_segments_file_to_the_gpu_equals_it_on_a_side_stream(namespace):
    """The follower's path: a shared segment read with pread by several workers, the ring prepared on a thread
    and released on the release thread, the copies on a stream of the caller's."""
    import flextensor.shm.background_release as release_mod
    from flextensor.shm.segment import SharedSegment

    nbytes = 5 * staged_mod.CHUNK_BYTES + 4097
    data = _source(nbytes)
    name = f"/{namespace}.staged"
    creator = SharedSegment.create(name, nbytes + 4096)
    try:
        creator.tensor(torch.uint8, (nbytes,), offset=4096).copy_(data)
        follower = SharedSegment.open(name)
        stream = torch.cuda.Stream()
        copier = StagedCopy(min_bytes=0, threads=4, slots=8, stream=stream, background_release=True)
        copier.prepare_in_background(torch.device("cuda", torch.cuda.current_device()))
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        fd = follower.open_file()
        try:
            copier(dst, follower.tensor(torch.uint8, (nbytes,), offset=4096), (fd, 4096))
        finally:
            os.close(fd)
        assert stream.query()  # complete on return
        assert copier.last.source == "file" and copier.last.threads == 4 and copier.last.staged
        assert torch.equal(dst.cpu(), data)
        assert release_mod.wait_released(timeout=60)
        follower.close()
    finally:
        creator.close()
        SharedSegment.unlink_name(name)


def test_a_followers_resident_copies_through_the_ring_equal_the_store(namespace):
    """The attach thread's path (``copies_on`` with a ``StagedCopy`` fill), on the CPU, from a store in five parts
    (one piece each, read from its own file): every record's copy equals its bytes in the store, with the
    record's dtype and shape, and the ring is registered once for all of them."""
    from torch import nn

    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.names import manager_namespace
    from flextensor.shm.tensor_store import SharedTensorStore

    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 64), nn.LayerNorm(64)).to(torch.bfloat16)
    ns = manager_namespace(namespace, "model")
    pin = FakePin()
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, model, shm_owner=creator.memory_owner,
                                                    part_min_bytes=CHUNK)
        assert store.parts == 5
        copier = StagedCopy(chunk_bytes=CHUNK, slots=3, min_bytes=0, register=pin.register, unregister=pin.unregister)
        copies = store.copies_on("cpu", fill=copier.copy_pieces)
        assert copier.last.staged and copier.last.nbytes > 4 * CHUNK and copier.last.source == "file"
        for name, value in store.tensors().items():
            if name in copies:
                assert copies[name].dtype == value.dtype and torch.equal(copies[name], value), name
        assert [c[0] for c in pin.calls] == ["register", "unregister"]
        del copies
        store.close()


@pytest.mark.cuda
@pytest.mark.parametrize("through", ["runtime", "torch"])
def test_chunks_reach_the_gpu_through_the_runtime_or_through_torch(through, monkeypatch):
    """On CUDA the chunks are queued through the CUDA runtime PyTorch loaded (with the GIL kept); where that
    runtime is not found, through PyTorch's calls. Either way every byte arrives, in several pieces, by several
    workers reusing their slots."""
    import flextensor.runtime.pinned.bounce_chunks as queue_mod

    if through == "torch":
        monkeypatch.setattr(queue_mod, "_runtime", lambda: None)
    made: list[str] = []
    original = queue_mod.chunk_queue

    def spy(*args):
        queue = original(*args)
        made.append(type(queue).__name__)
        return queue

    monkeypatch.setattr(staged_mod, "chunk_queue", spy)
    sizes = [7 * CHUNK + 3, 2 * CHUNK, 11]
    sources = [_source(n) for n in sizes]
    dsts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    copier = StagedCopy(chunk_bytes=CHUNK, slots=4, min_bytes=0, threads=2)
    copier.copy_pieces(list(zip(dsts, sources)))
    assert made == ["RuntimeChunkQueue" if through == "runtime" else "TorchChunkQueue"]
    for dst, src in zip(dsts, sources):
        assert torch.equal(dst.cpu(), src)


@pytest.mark.cuda
def test_a_refused_runtime_call_is_a_runtime_error_naming_it_and_leaves_no_error_for_torch():
    """A copy the runtime refuses (here: to an address that is no device memory) raises ``RuntimeError`` naming
    the call and the runtime's error; the runtime's last error is cleared, so PyTorch's next call does not fail."""
    from flextensor.runtime.pinned.bounce_chunks import RuntimeChunkQueue, _runtime

    class NoDeviceMemory:
        def data_ptr(self) -> int:
            return 16

    runtime = _runtime()
    assert runtime is not None, "PyTorch's CUDA runtime was not found in this process's mappings"
    stage = torch.empty(CHUNK, dtype=torch.uint8).pin_memory()
    queue = RuntimeChunkQueue(runtime, [NoDeviceMemory()], [stage], torch.cuda.current_stream())
    try:
        with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync of a staged chunk failed: cudaError\w+ \(\d+\)"):
            queue.put(0, 0, 0, CHUNK)
    finally:
        queue.close()
    assert torch.equal((torch.ones(4, device="cuda") * 2).cpu(), torch.full((4,), 2.0))


def test_the_queue_follows_the_destination_and_the_runtime_found(monkeypatch):
    """A CPU destination (no stream) gets synchronous copies; a CUDA stream gets the runtime's queue where
    PyTorch's runtime is mapped, PyTorch's calls where it is not (here faked: no CUDA is needed to choose)."""
    import flextensor.runtime.pinned.bounce_chunks as queue_mod

    stages = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(2)]
    dsts = [torch.zeros(3 * CHUNK, dtype=torch.uint8)]
    cpu = queue_mod.chunk_queue(dsts, stages, None)
    assert isinstance(cpu, queue_mod.CpuChunkQueue)
    stages[1].fill_(7)
    cpu.bind()
    cpu.put(1, 0, CHUNK, CHUNK - 5)
    cpu.wait(1)
    cpu.close()
    assert int(dsts[0][CHUNK:2 * CHUNK - 5].min()) == 7 and int(dsts[0][2 * CHUNK - 5:].max()) == 0
    assert int(dsts[0][:CHUNK].max()) == 0

    made: list[str] = []
    monkeypatch.setattr(queue_mod, "TorchChunkQueue", lambda *args: made.append("torch") or "torch queue")
    monkeypatch.setattr(queue_mod, "RuntimeChunkQueue", lambda *args: made.append("runtime") or "runtime queue")
    monkeypatch.setattr(queue_mod, "_runtime", lambda: None)
    assert queue_mod.chunk_queue(dsts, stages, object()) == "torch queue"
    monkeypatch.setattr(queue_mod, "_runtime", lambda: object())
    assert queue_mod.chunk_queue(dsts, stages, object()) == "runtime queue"
    assert made == ["torch", "runtime"]


def _ramped_copy(tmp_path, monkeypatch, caller_free, *, set_after: int | None = None):
    """A 48-chunk copy read from a file (each read 5 ms longer), ``threads=4``, ``threads_beside=2``; returns the
    distinct worker threads that read and whether every byte arrived. ``set_after``: set ``caller_free`` once
    that many chunks were read."""
    import threading

    nbytes = 48 * CHUNK
    src = _source(nbytes)
    path = tmp_path / "ramp"
    path.write_bytes(src.numpy().tobytes())
    readers: set[int] = set()
    reads: list[int] = []
    original = staged_mod._read_file

    def slow_read(fd, address, n, offset):
        readers.add(threading.get_ident())
        reads.append(offset)
        if set_after is not None and len(reads) == set_after:
            caller_free.set()
        time.sleep(0.005)
        return original(fd, address, n, offset)

    monkeypatch.setattr(staged_mod, "_read_file", slow_read)
    pin = FakePin()
    copier = StagedCopy(chunk_bytes=CHUNK, slots=8, min_bytes=0, threads=4, threads_beside=2,
                        register=pin.register, unregister=pin.unregister, caller_free=caller_free)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        copier(dst, src, (fd, 0))
    finally:
        os.close(fd)
    return readers, torch.equal(dst, src), copier.last.threads


def test_workers_held_back_while_the_caller_is_busy_start_once_it_is_free(tmp_path, monkeypatch):
    """While ``caller_free`` is not set only ``threads_beside`` workers copy; set midway, the others join in;
    set before, or not given, every worker copies from the start. Every byte arrives each time, and no thread
    of the copy is left running."""
    import threading

    never = threading.Event()
    readers, equal, reported = _ramped_copy(tmp_path, monkeypatch, never)
    assert (len(readers), equal, reported) == (2, True, 2)

    midway = threading.Event()
    readers, equal, reported = _ramped_copy(tmp_path, monkeypatch, midway, set_after=6)
    assert (len(readers), equal, reported) == (4, True, 4)

    already = threading.Event()
    already.set()
    assert len(_ramped_copy(tmp_path, monkeypatch, already)[0]) == 4
    assert len(_ramped_copy(tmp_path, monkeypatch, None)[0]) == 4
    assert not [t for t in threading.enumerate() if t.name in ("ft-staged-copy", "ft-staged-ramp")]
