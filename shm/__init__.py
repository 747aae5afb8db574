"""flextensor.shm: bytes, names, processes and tensors' byte layouts in POSIX shared memory.

Layout of the package (each module documents its binary format or protocol beside the code):

- ``names``        validated base/manager names -> compact per-manager namespaces and derived POSIX names
- ``segment``      exclusive, pre-populated segments; zero-copy torch views; in-place pinning (``pinning``)
- ``locks``        fcntl file locks (released by the kernel on death) and posix_ipc semaphores, with timeouts
- ``identity``     participant identity (pid + start time + boot id + token) and the host clock
- ``header``       the coordinator segment's fixed header; ``leases`` its heartbeat lease table
- ``journal``      the ownership journal: every resource recorded before it is created
- ``coordinator``  election, readiness, failure propagation; ``owner`` resources scoped to a generation
- ``cleanup``      offline reclaim from journal + leases (used by sessions' ``cleanup_namespace`` and ``ftd``)
- ``dead_sweep``   every dead namespace of a lock directory, found without names (before a join, ``--dead``)
- ``manifest`` / ``tensor_store``  published parameters and buffers; ``blocks`` the engine's shared host blocks
- ``ftd_protocol`` / ``ftd_client``  the daemon's wire messages and the best-effort worker-side client

Nothing here imports torch at import time, so the daemon and helper processes start fast. Public names are
resolved lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "compute_shm_namespace": "names",
    "manager_namespace": "names",
    "validate_base_namespace": "names",
    "validate_manager_name": "names",
    "validate_namespace": "names",
    "lock_directory": "names",
    "resolve_lock_directory": "names",
    "SharedSegment": "segment",
    "FileLock": "locks",
    "SemaphoreLock": "locks",
    "make_lock": "locks",
    "ParticipantIdentity": "identity",
    "ShmCoordinator": "coordinator",
    "ShmOwner": "owner",
    "cleanup_manager_namespace": "cleanup",
    "CleanupReport": "cleanup",
    "cleanup_dead_namespaces": "dead_sweep",
    "sweep_dead_namespaces": "dead_sweep",
    "SharedTensorStore": "tensor_store",
    "StoreManifest": "manifest",
    "TensorRecord": "manifest",
    "SharedBlockAllocator": "blocks",
    "ShmError": "errors",
    "ShmCreatorFailedError": "errors",
    "ShmCreatorDiedError": "errors",
    "ShmProtocolError": "errors",
    "ShmSpaceError": "errors",
    "HostMemoryError": "errors",
    "ShmNamespaceHeldError": "errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flextensor.shm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flextensor.shm.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
