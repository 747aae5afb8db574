"""Page-locking ("pinning") existing host memory for CUDA with ``cudaHostRegister``.

Why register in place instead of ``tensor.pin_memory()``: ``pin_memory()`` *copies* into a fresh
cudaHostAlloc buffer, which would give every process its own private copy and defeat shared memory.
``cudaHostRegister`` page-locks the pages of our existing ``MAP_SHARED`` mapping, so DMA reads straight from
the one shared copy.  Registration is per process (it is about this process's page tables and the driver's
view of them): every process that copies from a segment to a GPU registers its own mapping, and must
unregister it before unmapping (the driver keeps references to the pages otherwise).

The flag is ``cudaHostRegisterPortable`` (1): the memory counts as pinned for every CUDA context of the
process, not just the current device's, so one registration serves all GPUs a worker uses.

Segments that the device only reads (every host block: copies go host -> device only) can be registered with
``cudaHostRegisterReadOnly`` (8) as well: the driver then pins the pages without asking for write access, which
roughly halved the registration of a fresh mapping (``bench/experiment_register.py``; docs/benchmarks.md,
Figures behind the code). Platforms without read-only registration refuse the flag (invalid value / not
supported): the call is repeated without it, and later calls skip it; any other refusal is retried without the
flag and reported as usual.

Registration locks the pages in RAM and is charged against ``RLIMIT_MEMLOCK`` on many systems; a low
``ulimit -l`` is the most common cause of failure, hence the hint in the error.

torch is imported lazily: ``flextensor.shm`` must stay importable without paying for torch.
"""

from __future__ import annotations

import ctypes
import logging
import resource
from typing import Any

__all__ = ["host_register", "host_unregister", "cudart_available", "memlock_limit", "clear_cuda_error",
           "loaded_cudart_path"]

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_READ_ONLY = 8
#: cudaErrorInvalidValue, cudaErrorNotSupported: how a platform without read-only registration refuses the flag.
_READ_ONLY_UNSUPPORTED = (1, 801)
#: False once the driver refused the read-only flag as unsupported in this process (it is not offered again).
_read_only_supported = True
_NO_CUDA_MESSAGE = "pinning needs CUDA; use pinned_memory=False on CPU hosts"


def cudart_available() -> bool:
    """True when torch has CUDA, a device is visible, and its runtime bindings can be loaded."""
    try:
        import torch
    except ImportError:
        return False
    try:
        if not torch.cuda.is_available():
            return False
        torch.cuda.cudart()
    except (AssertionError, RuntimeError, AttributeError, OSError):
        return False
    return True


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` in bytes, or ``None`` when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def _cudart():
    if not cudart_available():
        raise RuntimeError(_NO_CUDA_MESSAGE)
    import torch

    return torch.cuda.cudart()


def _error_text(cudart, code: int) -> str:
    """``cudaErrorName (code): description`` as far as the bindings allow."""
    try:
        err = cudart.cudaError(code)
        name = getattr(err, "name", str(err))
        try:
            description = cudart.cudaGetErrorString(err)
        except Exception:  # noqa: BLE001 - the code is what matters; the text is a bonus
            description = ""
        return f"{name} ({code}){': ' + description if description else ''}"
    except Exception:  # noqa: BLE001 - unknown code: still report the number
        return f"cudaError {code}"


def _limit_text() -> str:
    limit = memlock_limit()
    return "unlimited" if limit is None else f"{limit} bytes"


def host_register(ptr: int, nbytes: int, *, read_only: bool = False) -> None:
    """Page-lock ``nbytes`` at address ``ptr`` for CUDA (Portable).  ``RuntimeError`` on failure.

    ``read_only=True``: the device will only read the range (host -> device copies); faster where supported.
    """
    global _read_only_supported
    if not isinstance(ptr, int) or ptr <= 0:
        raise ValueError(f"invalid pointer {ptr!r} for cudaHostRegister: pass the mapping's address (int > 0)")
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"invalid size {nbytes!r} for cudaHostRegister: it must be an int > 0 (bytes)")
    cudart = _cudart()
    if read_only and _read_only_supported:
        code = int(cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_READ_ONLY))
        if code == 0:
            logger.debug("registered %d bytes at %#x with CUDA (read-only)", nbytes, ptr)
            return
        clear_cuda_error()
        if code in _READ_ONLY_UNSUPPORTED:  # the platform lacks it: stop offering it; other errors recur below
            _read_only_supported = False
        logger.debug("read-only cudaHostRegister refused (%s); registering read-write", _error_text(cudart, code))
    code = int(cudart.cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code != 0:
        clear_cuda_error()
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: {_error_text(cudart, code)}. "
            f"Page-locked memory is limited by RLIMIT_MEMLOCK (now {_limit_text()}): raise it with `ulimit -l "
            "unlimited` (Docker: `--ulimit memlock=-1`), or run without pinning (pinned_memory=False)"
        )
    logger.debug("registered %d bytes at %#x with CUDA", nbytes, ptr)


_cudart_lib: Any = None


def loaded_cudart_path() -> str | None:
    """The file of a CUDA runtime library this process already loaded (normally PyTorch's; the first by path if
    there are several), or None: code that calls the runtime through ctypes uses it rather than loading another
    copy, whose per-thread state (current device, last error) PyTorch would not see."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            paths = {line.split()[-1] for line in fh if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError  # noqa: B018 - a runtime: it has this symbol
        except (OSError, AttributeError):
            continue
        return path
    return None


def _loaded_cudart() -> Any:
    """The CUDA runtime library this process already loaded (PyTorch's), through ctypes; None if not found.

    ``torch.cuda.cudart()`` does not bind ``cudaGetLastError``, hence the library itself.
    """
    global _cudart_lib
    if _cudart_lib is None:
        path = loaded_cudart_path()
        try:
            _cudart_lib = False if path is None else ctypes.CDLL(path)
            if _cudart_lib:
                _cudart_lib.cudaGetLastError.restype = ctypes.c_int
        except (OSError, AttributeError):
            _cudart_lib = False
    return _cudart_lib or None


def clear_cuda_error() -> None:
    """Reset the CUDA runtime's per-thread last error after a failure we handled (best effort).

    A failed ``cudaHostRegister`` leaves its code there, and PyTorch raises it after its next kernel launch, far
    from the cause.
    """
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


def host_unregister(ptr: int) -> None:
    """Undo :func:`host_register` for the region starting at ``ptr``.  ``RuntimeError`` on failure."""
    cudart = _cudart()
    code = int(cudart.cudaHostUnregister(ptr))
    if code != 0:
        raise RuntimeError(f"cudaHostUnregister at {ptr:#x} failed: {_error_text(cudart, code)}; the region was "
                           "not registered by this process or was already unregistered")
    logger.debug("unregistered %#x from CUDA", ptr)
