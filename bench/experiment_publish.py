"""Experiment (issue 2, publish rate): where does publishing into /dev/shm spend its time?

Breaks a 1 GiB publish into allocation (``posix_fallocate`` sequentially or in parallel ranges, or parallel
``MADV_POPULATE_WRITE``), mapping and the copy, against a copy into fresh anonymous memory, and prints the host's
transparent-huge-page settings. Ran on the H200 host on 2026-11-29: ``posix_fallocate`` took ~190 ms/GiB and
dominated; parallel ranges did not help there.
"""
import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import posix_ipc
import torch

n = 1 << 30
src = torch.randn(n // 4)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23
threads = min(16, os.cpu_count() or 1)
CH = 64 << 20
def timeit(f):
    s = time.perf_counter(); r = f(); return time.perf_counter() - s, r
def anon():
    return timeit(lambda: torch.empty_like(src).copy_(src))[0]
def shm(mode):
    name = "/pubexp"
    try: posix_ipc.unlink_shared_memory(name)
    except Exception: pass
    m = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0); fd = m.fd
    os.ftruncate(fd, n)
    t = {}
    pool = ThreadPoolExecutor(threads)
    if mode in ("seq",):
        t["fallocate"] = timeit(lambda: os.posix_fallocate(fd, 0, n))[0]
    elif mode in ("par", "par+pop"):
        t["fallocate"] = timeit(lambda: list(pool.map(lambda o: os.posix_fallocate(fd, o, min(CH, n - o)), range(0, n, CH))))[0]
    t["mmap"], mm = timeit(lambda: mmap.mmap(fd, n, mmap.MAP_SHARED))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    if mode == "par+pop":
        t["populate"] = timeit(lambda: list(pool.map(lambda o: libc.madvise(addr + o, min(CH, n - o), MADV_POPULATE_WRITE), range(0, n, CH))))[0]
    dst = torch.frombuffer(memoryview(mm), dtype=torch.float32)
    t["copy"] = timeit(lambda: dst.copy_(src))[0]
    total = sum(t.values())
    del dst; pool.shutdown()
    m.close_fd(); posix_ipc.unlink_shared_memory(name)
    return total, t
print("threads", threads, "torch threads", torch.get_num_threads())
print("THP anon:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), "shmem:", open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip())
for rep in range(3):
    a = anon()
    print(f"anon {n/a/1e9:.2f} GB/s")
    for mode in ("seq", "par", "par+pop"):
        total, t = shm(mode)
        print(f"  {mode:8s} {n/total/1e9:.2f} GB/s ratio {a/total:.2f}  " + " ".join(f"{k}={v*1e3:.0f}ms" for k, v in t.items()))
