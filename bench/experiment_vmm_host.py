"""Experiment: host memory the CUDA driver allocates pinned and shares by file descriptor, against registering a
shared mapping in every process.

Why: every process that streams from the shared copy registers its own mapping with CUDA (``cudaHostRegister``),
at a cost per page the driver sets: about 40 ms/GiB on huge pages and 40-110 ms/GiB on 4 KiB pages on the
device host (docs/benchmarks.md), against a goal of 10 ms/GiB. Memory that the driver allocates pinned once
(``cuMemCreate`` with a host location) can be exported as a POSIX file descriptor and imported by other
processes (``cuMemImportFromShareableHandle``), each mapping it into its own address space for the device and
the CPU. This measures whether that import is cheap, whether copies from it run at the pinned rate, and what the
CPU sees:

- the exporter: ``cuMemCreate`` (allocation and pinning) per GiB, the map and access set-up, a multi-threaded CPU
  fill through the host mapping (GB/s), the host-to-device rate from it against PyTorch's pinned memory;
- ``--together`` fresh processes that get the descriptor (inherited: ``pass_fds``) and import, map and set access
  at once, timed per GiB each; each checks the bytes through its CPU mapping and copies to the device from it;
- each importer's exit after it unmapped, and the exporter's release.

Usage: ``python bench/experiment_vmm_host.py [--gib 8] [--together 1 4]`` (needs CUDA with host VMM
allocations: CUDA 12.2 or newer driver). Prints one JSON line per measure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

import torch

GIB = 1 << 30
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_MEM_LOCATION_TYPE_HOST_NUMA = 3
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def _driver() -> ctypes.CDLL:
    cuda = ctypes.CDLL("libcuda.so.1")
    u64 = ctypes.c_uint64
    cuda.cuMemCreate.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.POINTER(AllocationProp), u64]
    cuda.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), ctypes.c_size_t, ctypes.c_size_t, u64, u64]
    cuda.cuMemMap.argtypes = [u64, ctypes.c_size_t, ctypes.c_size_t, u64, u64]
    cuda.cuMemSetAccess.argtypes = [u64, ctypes.c_size_t, ctypes.POINTER(AccessDesc), ctypes.c_size_t]
    cuda.cuMemUnmap.argtypes = [u64, ctypes.c_size_t]
    cuda.cuMemAddressFree.argtypes = [u64, ctypes.c_size_t]
    cuda.cuMemRelease.argtypes = [u64]
    cuda.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, u64, ctypes.c_int, u64]
    cuda.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
    cuda.cuMemGetAllocationGranularity.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(AllocationProp),
                                                   ctypes.c_int]
    cuda.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return cuda


def _check(cuda: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode() if name.value else rc}")


def _emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _map(cuda: ctypes.CDLL, handle: int, size: int, align: int, host_type: int) -> int:
    """Reserve a range, map ``handle`` there and give the device and the CPU read-write access; its address."""
    ptr = ctypes.c_uint64()
    _check(cuda, cuda.cuMemAddressReserve(ctypes.byref(ptr), size, align, 0, 0), "cuMemAddressReserve")
    _check(cuda, cuda.cuMemMap(ptr.value, size, 0, handle, 0), "cuMemMap")
    descs = (AccessDesc * 2)(AccessDesc(Location(CU_MEM_LOCATION_TYPE_DEVICE, torch.cuda.current_device()),
                                        CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
                             AccessDesc(Location(host_type, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE))
    _check(cuda, cuda.cuMemSetAccess(ptr.value, size, descs, 2), "cuMemSetAccess")
    return ptr.value


def _host_tensor(ptr: int, size: int) -> torch.Tensor:
    buf = (ctypes.c_ubyte * size).from_address(ptr)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(buf, dtype=torch.uint8)


def _h2d_gbps(src: torch.Tensor, chunk: int = 1 << 30, repeat: int = 3) -> float:
    dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for lo in range(0, src.numel() - chunk + 1, chunk):
            dst.copy_(src[lo:lo + chunk], non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return (src.numel() // chunk) * chunk / best / 1e9


def importer(fd: int, size: int, align: int, host_type: int, go_fd: int) -> None:
    torch.empty(1, device="cuda")
    cuda = _driver()
    os.read(go_fd, 1)  # every importer starts at the same word
    t0 = time.perf_counter()
    handle = ctypes.c_uint64()
    _check(cuda, cuda.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "import")
    t1 = time.perf_counter()
    ptr = _map(cuda, handle.value, size, align, host_type)
    t2 = time.perf_counter()
    host = _host_tensor(ptr, size)
    ok = bool((host[:: 1 << 20] == 7).all())
    t3 = time.perf_counter()
    rate = _h2d_gbps(host)
    _check(cuda, cuda.cuMemUnmap(ptr, size), "cuMemUnmap")
    cuda.cuMemAddressFree(ptr, size)
    cuda.cuMemRelease(handle.value)
    _emit(role="importer", pid=os.getpid(), import_ms=(t1 - t0) * 1e3, map_ms=(t2 - t1) * 1e3,
          ms_per_gib=(t2 - t0) * 1e3 / (size / GIB), first_cpu_read_ms=(t3 - t2) * 1e3, bytes_ok=ok,
          h2d_gbps=round(rate, 1))
    print("exiting", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--together", type=int, nargs="+", default=[1, 4])
    p.add_argument("--importer", nargs=5, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.importer:
        importer(*args.importer)
        return
    torch.empty(1, device="cuda")
    cuda = _driver()
    size0 = int(args.gib * GIB)
    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True).fill_(1)
    _emit(role="baseline", pinned_h2d_gbps=round(_h2d_gbps(pinned), 1))
    del pinned
    for host_type in (CU_MEM_LOCATION_TYPE_HOST_NUMA, CU_MEM_LOCATION_TYPE_HOST):
        prop = AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                              requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                              location=Location(host_type, 0))
        gran = ctypes.c_size_t()
        rc = cuda.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop),
                                                CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        if rc != 0:
            _emit(role="exporter", host_type=host_type, granularity_rc=rc)
            continue
        size = -(-size0 // gran.value) * gran.value
        try:
            handle = ctypes.c_uint64()
            t0 = time.perf_counter()
            _check(cuda, cuda.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0), "cuMemCreate")
            t1 = time.perf_counter()
            ptr = _map(cuda, handle.value, size, gran.value, host_type)
            t2 = time.perf_counter()
        except RuntimeError as exc:
            _emit(role="exporter", host_type=host_type, error=str(exc))
            continue
        host = _host_tensor(ptr, size)
        t3 = time.perf_counter()
        host.fill_(7)
        t4 = time.perf_counter()
        fd = ctypes.c_int(-1)
        _check(cuda, cuda.cuMemExportToShareableHandle(ctypes.byref(fd), handle.value,
                                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export")
        _emit(role="exporter", host_type=host_type, granularity=gran.value, gib=size / GIB,
              create_ms_per_gib=(t1 - t0) * 1e3 / (size / GIB), map_ms=(t2 - t1) * 1e3,
              cpu_fill_gbps=round(size / (t4 - t3) / 1e9, 1), h2d_gbps=round(_h2d_gbps(host), 1),
              threads=torch.get_num_threads())
        for together in args.together:
            go_r, go_w = os.pipe()
            procs = [subprocess.Popen([sys.executable, __file__, "--importer", str(fd.value), str(size),
                                       str(gran.value), str(host_type), str(go_r)],
                                      pass_fds=(fd.value, go_r), stdout=subprocess.PIPE, text=True)
                     for _ in range(together)]
            time.sleep(8)  # every importer has its CUDA context
            os.write(go_w, b"x" * together)
            exits = []
            for proc in procs:
                for line in proc.stdout:
                    if line.startswith("exiting"):
                        t_last = time.perf_counter()
                        proc.wait()
                        exits.append(time.perf_counter() - t_last)
                        break
                    print(line.rstrip().replace('"role": "importer"', f'"role": "importer", "together": {together}'),
                          flush=True)
                proc.wait()
            os.close(go_r)
            os.close(go_w)
            _emit(role="importers", together=together, slowest_exit_after_last_line_s=round(max(exits), 3)
                  if exits else None)
        t5 = time.perf_counter()
        os.close(fd.value)
        del host
        _check(cuda, cuda.cuMemUnmap(ptr, size), "cuMemUnmap")
        cuda.cuMemAddressFree(ptr, size)
        _check(cuda, cuda.cuMemRelease(handle.value), "cuMemRelease")
        _emit(role="exporter", host_type=host_type, release_ms=(time.perf_counter() - t5) * 1e3)
        break


if __name__ == "__main__":
    main()
