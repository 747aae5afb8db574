"""Queueing host-to-device copies and their events without letting go of the GIL: :class:`CopyEvents`.

Why
---
A follower copies its resident tensors on worker threads (``flextensor.runtime.staged_copy``) while the user's
model factory runs on the caller's thread, and that factory is pure Python: it holds the GIL the whole time.
PyTorch's ``copy_``, ``Event.record`` and ``Event.synchronize`` each let go of the GIL and take it back, and a
thread that wants it back from a busy holder waits up to the switch interval (5 ms) before the holder is made to
let go. With 16 workers making four such calls per 8 MiB chunk, both sides lost: the copy waited for the GIL
instead of reading, and the factory was interrupted thousands of times (on a 2-core VM, a 94-layer meta model
took 260-330 ms beside 16 such workers where it takes 70 ms alone; the H200 host measured the same ratio inside
a follower).

The calls bound here only queue work (a copy, an event record) or ask whether it is done: microseconds each.
They are made through ``ctypes.PyDLL``, which keeps the GIL during the call, so a worker takes the GIL once per
chunk (after its ``pread``, which does let go). Waiting for an event that is not done yet lets go
(``ctypes.CDLL``), since that can take as long as a copy.

The library is the CUDA runtime PyTorch itself loaded (``flextensor.shm.pinning.loaded_cudart_path``), so the
calls act on the same device, context and streams as PyTorch's: the caller makes the device current (PyTorch's
``torch.cuda.device``) and passes a PyTorch stream's handle. :func:`load` returns None where that library is not
found (no CUDA, an unusual build); callers then use PyTorch's own calls.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Sequence

from flextensor.shm.pinning import loaded_cudart_path

__all__ = ["CudaRuntime", "CopyEvents", "load"]

#: ``cudaMemcpyHostToDevice``, ``cudaEventDisableTiming``, ``cudaErrorNotReady``.
_HOST_TO_DEVICE = 1
_DISABLE_TIMING = 2
_NOT_READY = 600

_lock = threading.Lock()
_loaded: "CudaRuntime | None | bool" = False


class CudaRuntime:
    """The handful of runtime calls :class:`CopyEvents` needs, bound twice: ``held`` keeps the GIL during the
    call (queueing, querying), ``released`` lets go of it (waiting)."""

    def __init__(self, path: str) -> None:
        held = ctypes.PyDLL(path)
        released = ctypes.CDLL(path)
        vp, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        for lib in (held, released):
            lib.cudaEventSynchronize.argtypes = [vp]
            lib.cudaEventSynchronize.restype = i32
        held.cudaMemcpyAsync.argtypes = [vp, vp, size, i32, vp]
        held.cudaMemcpyAsync.restype = i32
        held.cudaEventCreateWithFlags.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        held.cudaEventCreateWithFlags.restype = i32
        held.cudaEventRecord.argtypes = [vp, vp]
        held.cudaEventRecord.restype = i32
        held.cudaEventQuery.argtypes = [vp]
        held.cudaEventQuery.restype = i32
        held.cudaEventDestroy.argtypes = [vp]
        held.cudaEventDestroy.restype = i32
        held.cudaGetLastError.argtypes = []
        held.cudaGetLastError.restype = i32
        held.cudaGetErrorString.argtypes = [i32]
        held.cudaGetErrorString.restype = ctypes.c_char_p
        self.held, self.released = held, released

    def check(self, code: int, what: str) -> None:
        """Raise ``RuntimeError`` naming ``what`` for a failed call (clearing the runtime's last error first, so
        PyTorch does not report it later, far from here)."""
        if code != 0:
            self.held.cudaGetLastError()
            text = (self.held.cudaGetErrorString(code) or b"").decode(errors="replace")
            raise RuntimeError(f"{what} failed: CUDA error {code} ({text})")


def load() -> CudaRuntime | None:
    """The runtime PyTorch loaded, bound once per process; None when it is not loaded (no CUDA used yet, or a
    platform whose library cannot be found this way)."""
    global _loaded
    with _lock:
        if _loaded is False:
            path = loaded_cudart_path()
            try:
                _loaded = CudaRuntime(path) if path is not None else None
            except (OSError, AttributeError):
                _loaded = None
        return _loaded  # type: ignore[return-value]


class CopyEvents:
    """Copies from pinned host memory to a device, queued on one stream, with an event per slot that says when the
    device finished reading that slot.

    Made (and closed) with the device current, by the thread that owns the copy; :meth:`copy` and :meth:`wait`
    may be called from several threads, each on its own slots. :meth:`close` destroys the events: call it once
    every slot was waited for."""

    def __init__(self, runtime: CudaRuntime, stream: int, slots: int) -> None:
        self._runtime, self._stream = runtime, ctypes.c_void_p(stream)
        self._events: list[ctypes.c_void_p] = []
        try:
            for _ in range(slots):
                event = ctypes.c_void_p()
                runtime.check(runtime.held.cudaEventCreateWithFlags(ctypes.byref(event), _DISABLE_TIMING),
                              "cudaEventCreateWithFlags")
                self._events.append(event)
        except BaseException:
            self.close()
            raise

    def copy(self, slot: int, dst: int, src: int, nbytes: int) -> None:
        """Queue ``nbytes`` from host address ``src`` (pinned) to device address ``dst``, then the slot's event."""
        held = self._runtime.held
        self._runtime.check(held.cudaMemcpyAsync(dst, src, nbytes, _HOST_TO_DEVICE, self._stream),
                            f"cudaMemcpyAsync of {nbytes} bytes to the device")
        self._runtime.check(held.cudaEventRecord(self._events[slot], self._stream), "cudaEventRecord")

    def wait(self, slot: int) -> None:
        """Return once the device finished the copies queued before the slot's last event: asked first while
        holding the GIL (the usual answer, since the device reads faster than the host fills), waited for
        without it otherwise."""
        event = self._events[slot]
        code = self._runtime.held.cudaEventQuery(event)
        if code == _NOT_READY:
            code = self._runtime.released.cudaEventSynchronize(event)
        self._runtime.check(code, "waiting for a staging slot's copy")

    def wait_all(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.wait(slot)

    def close(self) -> None:
        """Destroy the events (idempotent)."""
        events, self._events = self._events, []
        for event in events:
            self._runtime.held.cudaEventDestroy(event)
