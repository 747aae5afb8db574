"""How a staged copy's worker hands each chunk to the device: :func:`chunk_queue`.

Why
---
A :class:`~flextensor.runtime.pinned.bounce_copy.StagedCopy` worker spends its time in ``pread`` (the GIL released) and
needs the GIL once per chunk to queue the chunk's copy and an event. A follower's model factory (pure Python)
runs on another thread meanwhile, so each time a worker takes the GIL back the factory hands it over and waits to
get it again. Through PyTorch a chunk costs several such hand-overs (``narrow``, ``copy_``, ``Event.record`` and
``Event.synchronize`` each let go of the GIL and take it back). The calls that only queue work
(``cudaMemcpyAsync`` from pinned memory, ``cudaEventRecord``, ``cudaEventQuery``) return in microseconds, so
:class:`RuntimeChunkQueue` makes them through ``ctypes.PyDLL`` on the CUDA runtime PyTorch loaded, which keeps
the GIL: a chunk costs one hand-over (after its ``pread``), and one more only when its slot's previous copy is
still running (``cudaEventSynchronize``, which may block, goes through ``ctypes.CDLL`` and lets go of the GIL).

Where that runtime is not found (a PyTorch linked statically against it), :class:`TorchChunkQueue` makes the same
calls through PyTorch; on a CPU destination :class:`CpuChunkQueue` copies synchronously.

The three share one interface: ``bind()`` makes the destination's device current for the calling thread (each
worker calls it first); ``put(slot, piece, offset, nbytes)`` queues the slot's first ``nbytes`` into the
destination of piece ``piece`` at ``offset`` and records the slot's event (if it raises, nothing it queued is
left running); ``wait(slot)`` returns once the device finished reading the slot; ``close()`` frees the events.
A queue is used by the workers of one copy at once (each worker only puts and waits on its own slots) and closed
by the copy once every worker is done.

The runtime is found among the libraries the process mapped; should it be another copy than PyTorch's, it still
works on the same primary context of each device (the runtime's contexts are the driver's), and ``bind`` sets
its current device itself rather than trusting PyTorch's. Keeping the GIL has one cost: a queueing call that
waits for a driver lock another thread holds (a ``cudaMalloc`` that has to free cached blocks, a registration)
holds every Python thread for that long; none of those holders needs the GIL, so it cannot deadlock.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Protocol, Sequence

import torch

from flextensor.shm.pinning import loaded_cudart_path

__all__ = ["ChunkQueue", "chunk_queue", "RuntimeChunkQueue", "TorchChunkQueue", "CpuChunkQueue"]

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_DISABLE_TIMING = 2  # cudaEventDisableTiming
_NOT_READY = 600  # cudaErrorNotReady: what cudaEventQuery returns while the work before the event runs


class ChunkQueue(Protocol):
    def bind(self) -> None: ...
    def put(self, slot: int, piece: int, offset: int, nbytes: int) -> None: ...
    def wait(self, slot: int) -> None: ...
    def close(self) -> None: ...


def chunk_queue(destinations: Sequence[torch.Tensor], stages: Sequence[torch.Tensor],
                stream: "torch.cuda.Stream | None") -> ChunkQueue:
    """The queue for copying ``stages`` (the ring's slots, pinned host memory) into ``destinations`` (the pieces'
    device tensors, contiguous ``uint8``) on ``stream``: through the runtime with the GIL kept where it can, else
    through PyTorch; synchronous copies when ``stream`` is None (a CPU destination)."""
    if stream is None:
        return CpuChunkQueue(destinations, stages)
    runtime = _runtime()
    if runtime is not None:
        return RuntimeChunkQueue(runtime, destinations, stages, stream)
    return TorchChunkQueue(destinations, stages, stream)


class CpuChunkQueue:
    """Synchronous copies (a CPU destination: tests, hosts without CUDA); nothing to wait for."""

    def __init__(self, destinations: Sequence[torch.Tensor], stages: Sequence[torch.Tensor]) -> None:
        self._destinations, self._stages = list(destinations), list(stages)

    def bind(self) -> None:
        pass

    def put(self, slot: int, piece: int, offset: int, nbytes: int) -> None:
        self._destinations[piece].narrow(0, offset, nbytes).copy_(self._stages[slot].narrow(0, 0, nbytes))

    def wait(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass


class TorchChunkQueue:
    """The queue through PyTorch's calls (each lets go of the GIL and takes it back)."""

    def __init__(self, destinations: Sequence[torch.Tensor], stages: Sequence[torch.Tensor],
                 stream: "torch.cuda.Stream") -> None:
        self._destinations, self._stages, self._stream = list(destinations), list(stages), stream
        self._events = [torch.cuda.Event() for _ in stages]

    def bind(self) -> None:
        pass  # the workers run inside torch.cuda.device(...) already

    def put(self, slot: int, piece: int, offset: int, nbytes: int) -> None:
        stage = self._stages[slot]
        if nbytes != stage.numel():
            stage = stage.narrow(0, 0, nbytes)
        self._destinations[piece].narrow(0, offset, nbytes).copy_(stage, non_blocking=True)
        self._events[slot].record(self._stream)

    def wait(self, slot: int) -> None:
        self._events[slot].synchronize()

    def close(self) -> None:
        self._events = []


class _Runtime:
    """The few runtime functions, bound twice: ``quick`` keeps the GIL (``PyDLL``), ``blocking`` lets go of it."""

    def __init__(self, path: str) -> None:
        self.quick = ctypes.PyDLL(path)
        self.blocking = ctypes.CDLL(path)
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for lib in (self.quick, self.blocking):
            lib.cudaMemcpyAsync.argtypes = [vp, vp, sz, i, vp]
            lib.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
            lib.cudaEventRecord.argtypes = [vp, vp]
            lib.cudaEventQuery.argtypes = [vp]
            lib.cudaEventSynchronize.argtypes = [vp]
            lib.cudaEventDestroy.argtypes = [vp]
            lib.cudaSetDevice.argtypes = [i]
            lib.cudaStreamSynchronize.argtypes = [vp]
            lib.cudaGetErrorName.argtypes = [i]
            lib.cudaGetErrorName.restype = ctypes.c_char_p
            for name in ("cudaMemcpyAsync", "cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery",
                         "cudaEventSynchronize", "cudaEventDestroy", "cudaGetLastError", "cudaSetDevice",
                         "cudaStreamSynchronize"):
                getattr(lib, name).restype = i

    def check(self, code: int, what: str) -> None:
        """Raise ``RuntimeError`` naming the call and the runtime's error for a nonzero ``code`` (the runtime's
        last error is cleared first, so that PyTorch does not raise it later, far from here)."""
        if code != 0:
            self.quick.cudaGetLastError()
            name = self.quick.cudaGetErrorName(code) or b"unknown error"
            raise RuntimeError(f"{what} failed: {name.decode()} ({code}): the staged copy to the device stopped; "
                               "check the GPU (nvidia-smi) and restart this process if it reports errors")


_runtime_lock = threading.Lock()
_runtime_bound: "_Runtime | None" = None
_runtime_looked = False


def _runtime() -> "_Runtime | None":
    """The runtime PyTorch loaded, bound once per process; None where it is not found."""
    global _runtime_bound, _runtime_looked
    with _runtime_lock:
        if not _runtime_looked:
            _runtime_looked = True
            path = loaded_cudart_path()
            try:
                _runtime_bound = _Runtime(path) if path is not None else None
            except (OSError, AttributeError):
                _runtime_bound = None
        return _runtime_bound


class RuntimeChunkQueue:
    """The queue through the CUDA runtime with the GIL kept for the calls that only queue work (module docs)."""

    def __init__(self, runtime: _Runtime, destinations: Sequence[torch.Tensor], stages: Sequence[torch.Tensor],
                 stream: "torch.cuda.Stream") -> None:
        self._rt = runtime
        self._device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
        self._destinations = [t.data_ptr() for t in destinations]
        self._stages = [t.data_ptr() for t in stages]
        self._stream = ctypes.c_void_p(stream.cuda_stream)
        self._events: list[ctypes.c_void_p] = []
        try:
            self.bind()
            for _ in stages:
                event = ctypes.c_void_p()
                runtime.check(runtime.quick.cudaEventCreateWithFlags(ctypes.byref(event), _DISABLE_TIMING),
                              "cudaEventCreateWithFlags")
                self._events.append(event)
        except BaseException:
            self.close()
            raise

    def bind(self) -> None:
        self._rt.check(self._rt.quick.cudaSetDevice(self._device), f"cudaSetDevice({self._device})")

    def put(self, slot: int, piece: int, offset: int, nbytes: int) -> None:
        quick = self._rt.quick
        self._rt.check(quick.cudaMemcpyAsync(self._destinations[piece] + offset, self._stages[slot], nbytes,
                                             _HOST_TO_DEVICE, self._stream), "cudaMemcpyAsync of a staged chunk")
        recorded = quick.cudaEventRecord(self._events[slot], self._stream)
        if recorded != 0:  # the copy is queued but no event follows it: wait for it here, the slot is reused next
            self._rt.blocking.cudaStreamSynchronize(self._stream)
        self._rt.check(recorded, "cudaEventRecord")

    def wait(self, slot: int) -> None:
        code = self._rt.quick.cudaEventQuery(self._events[slot])
        if code == _NOT_READY:
            self._rt.quick.cudaGetLastError()  # "not ready" is no error: do not leave it for PyTorch to raise
            code = self._rt.blocking.cudaEventSynchronize(self._events[slot])
        self._rt.check(code, "waiting for a staged chunk's copy")

    def close(self) -> None:
        events, self._events = self._events, []
        if events:
            self._rt.quick.cudaSetDevice(self._device)  # not another device's context, in a thread that has none
        for event in events:
            self._rt.quick.cudaEventDestroy(event)
