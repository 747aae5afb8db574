"""One CUDA stream of the engine's own, for the loader's host-to-device copies.

Why not ``torch.cuda.Stream()``
-------------------------------
``torch.cuda.Stream()`` hands out a stream from PyTorch's per-device pool, and the first call in a process
creates the whole pool: 32 streams per priority level, each a ``cudaStreamCreateWithPriority``, while the calling
thread holds the GIL. Measured on an H200 host inside a shared-session follower: 3-12 ms, all of it time the
user's model factory (running beside the attach thread) could not run, and 35 ms while other followers were
registering host memory with the driver. A follower's loader needs exactly one stream, so it creates exactly one:
``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` through ctypes (which releases the GIL for the call) on the
runtime PyTorch already loaded, wrapped for PyTorch as a ``torch.cuda.ExternalStream``.

Ownership
---------
:class:`CopyStream` owns the handle: :meth:`CopyStream.close` waits for the stream's work and destroys it, and a
``weakref.finalize`` destroys it if the owner is dropped without closing (the CUDA runtime defers the release of
a destroyed stream until its queued work has completed, so this is safe at any point). When the runtime cannot be
reached through ctypes, or refuses, a pool stream is used instead and nothing is destroyed.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import Any

import torch

from flextensor.shm.pinning import _loaded_cudart

__all__ = ["CopyStream"]

logger = logging.getLogger(__name__)

_CUDA_STREAM_NON_BLOCKING = 0x01  # no implicit ordering with the legacy default stream, like PyTorch's pool


def _destroy(lib: Any, handle: int) -> None:
    code = lib.cudaStreamDestroy(ctypes.c_void_p(handle))
    if code:
        logger.debug("cudaStreamDestroy(%#x) returned %d", handle, code)
        lib.cudaGetLastError()  # do not leave the code for PyTorch to raise after its next launch


class CopyStream:
    """A non-blocking CUDA stream created for one owner (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.owned = False
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        lib = _loaded_cudart()
        handle = ctypes.c_void_p()
        code = -1
        if lib is not None and hasattr(lib, "cudaStreamCreateWithFlags"):
            with torch.cuda.device(device):  # the runtime creates the stream on the thread's current device
                code = lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _CUDA_STREAM_NON_BLOCKING)
            if code:
                lib.cudaGetLastError()
        if code == 0 and handle.value:
            self.stream: torch.cuda.Stream = torch.cuda.ExternalStream(handle.value, device=device)
            self.owned = True
            self._finalizer = weakref.finalize(self, _destroy, lib, handle.value)
        else:
            logger.debug("own CUDA stream unavailable (code %s): using a stream from PyTorch's pool", code)
            self.stream = torch.cuda.Stream(device=device)

    def close(self) -> None:
        """Wait for the work queued on the stream, then destroy it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.stream.synchronize()
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
