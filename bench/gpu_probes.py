"""What the driver and the kernel say about a process's use of the GPUs and of the shared copy.

The multi-GPU benchmark reads these per rank, because the questions it answers are per process: on which devices
does this process hold a CUDA context (a rank computing on ``cuda:1`` should hold none on ``cuda:0``), which of
the host ranges it streams from are page-locked (registration is per process; the Portable flag makes one serve
every device of it), and on which NUMA nodes its GPU and the shared pages sit. Everything goes through the driver
library (``libcuda``) and ``/proc`` / ``/sys`` directly, so that reading never creates the context it looks for;
each probe returns ``None`` where its source is missing (no driver, no NUMA information).
"""

from __future__ import annotations

import ctypes

__all__ = ["primary_contexts", "registered_count", "gpu_numa_node", "shared_pages_by_node"]


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def primary_contexts() -> list[int] | None:
    """The device ordinals on which this process holds an active CUDA primary context (None without a driver)."""
    lib = _libcuda()
    if lib is None:
        return None
    count = ctypes.c_int()
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    active = []
    for ordinal in range(count.value):
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), ordinal) or lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags),
                                                                                         ctypes.byref(on)):
            return None
        if on.value:
            active.append(ordinal)
    return active


def registered_count(pointers: list[tuple[int, int]]) -> int | None:
    """How many (address, bytes) ranges the driver knows as registered host memory at both ends (None: no
    driver). ``cuPointerGetAttribute(MEMORY_TYPE)`` answers HOST for page-locked memory and fails for pageable."""
    lib = _libcuda()
    if lib is None:
        return None
    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    memory_type, host, invalid_value = 2, 1, 1  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST, the error
    found = 0
    for address, nbytes in pointers:
        ok = True
        for ptr in (address, address + nbytes - 1):
            value = ctypes.c_uint()
            code = lib.cuPointerGetAttribute(ctypes.byref(value), memory_type, ptr)
            if code not in (0, invalid_value):  # not an answer about the pointer (no context, unsupported call)
                return None
            ok = ok and code == 0 and value.value == host
        found += ok
    return found


def gpu_numa_node(torch, device) -> int | None:
    """The NUMA node of the GPU's PCI device, from sysfs (None where it is not known)."""
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None in ids:
        return None
    try:
        with open(f"/sys/bus/pci/devices/{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0/numa_node") as f:
            node = int(f.read())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def shared_pages_by_node(manager_ns: str) -> dict[str, int] | None:
    """Bytes of this process's mappings of the shared copy per NUMA node, from ``/proc/self/numa_maps``."""
    try:
        with open("/proc/self/numa_maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    nodes: dict[str, int] = {}
    for line in lines:
        if f"file=/dev/shm/{manager_ns}." not in line:
            continue
        fields = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
        page = int(fields.get("kernelpagesize_kB", "4")) * 1024
        for key, value in fields.items():
            if key.startswith("N") and key[1:].isdigit():
                nodes[key] = nodes.get(key, 0) + int(value) * page
    return nodes
