"""Experiment (publish rate): is there a faster way to fill a fresh /dev/shm segment than populate + copy?

Against a copy into fresh anonymous memory (ratio > 1 is faster): parallel MADV_POPULATE_WRITE then copy,
MAP_POPULATE then copy, and pwrite() from the source tensor's memory with 1-16 threads (no page faults, and tmpfs
need not zero a page it is about to overwrite). Argument: GiB (default 1).

"""
import ctypes, mmap, os, time, sys
from concurrent.futures import ThreadPoolExecutor
import posix_ipc, torch
n = int(float(sys.argv[1]) * 2**30) if len(sys.argv) > 1 else 1 << 30
src = torch.randn(n // 4)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
T = min(16, os.cpu_count())
CH = 64 << 20
srcbuf = (ctypes.c_char * n).from_address(src.data_ptr())
srcmv = memoryview(srcbuf).cast("B")
def anon():
    s = time.perf_counter(); d = torch.empty_like(src); d.copy_(src); del d; return time.perf_counter() - s
def mk():
    name = "/pubexp2"
    try: posix_ipc.unlink_shared_memory(name)
    except Exception: pass
    m = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    return name, m
def fin(name, m):
    m.close_fd(); posix_ipc.unlink_shared_memory(name)
def pop_copy():
    s = time.perf_counter(); name, m = mk(); fd = m.fd; os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED); a = ctypes.c_char.from_buffer(mm); addr = ctypes.addressof(a)
    with ThreadPoolExecutor(T) as p: r = list(p.map(lambda o: libc.madvise(addr + o, min(CH, n - o), 23), range(0, n, CH)))
    del a
    dst = torch.frombuffer(mm, dtype=torch.float32); dst.copy_(src); del dst; mm.close(); fin(name, m)
    return time.perf_counter() - s, r[0]
def pwrite(threads, chunk=CH, fall=False):
    s = time.perf_counter(); name, m = mk(); fd = m.fd; os.ftruncate(fd, n)
    def w(o):
        end = min(o + chunk, n)
        while o < end:
            o += os.pwrite(fd, srcmv[o:end], o)
    if threads == 1:
        for o in range(0, n, chunk): w(o)
    else:
        with ThreadPoolExecutor(threads) as p: list(p.map(w, range(0, n, chunk)))
    if fall: os.posix_fallocate(fd, 0, n)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED); mm.close()
    fin(name, m)
    return time.perf_counter() - s
def mappop_copy():
    s = time.perf_counter(); name, m = mk(); fd = m.fd; os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED | mmap.MAP_POPULATE)
    dst = torch.frombuffer(mm, dtype=torch.float32); dst.copy_(src); del dst; mm.close(); fin(name, m)
    return time.perf_counter() - s
def check(mmv=None):
    # verify pwrite content correctness once
    name, m = mk(); fd = m.fd; os.ftruncate(fd, n)
    o = 0
    while o < n: o += os.pwrite(fd, srcmv[o:n], o)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED); dst = torch.frombuffer(mm, dtype=torch.float32)
    ok = torch.equal(dst, src); del dst; mm.close(); fin(name, m); return ok
print("cpus", os.cpu_count(), "torch threads", torch.get_num_threads(), "bytes", n, "pwrite correct", check())
try:
    print("THP", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip())
except Exception as e: print("THP ?", e)
for rep in range(3):
    a = anon(); pc, rc = pop_copy(); mp = mappop_copy()
    res = {f"pw{t}": pwrite(t) for t in (1, 2, 4, 8, 16) if t <= T}
    res["pw_big"] = pwrite(T, chunk=max(CH, n // T + 4096))
    res["pw4+fall"] = pwrite(min(4, T), fall=True)
    print(f"anon {n/a/1e9:.2f} GB/s | pop+copy {a/pc:.2f}x (madvise rc {rc}) | MAP_POPULATE+copy {a/mp:.2f}x | " + " ".join(f"{k} {a/v:.2f}x" for k, v in res.items()), flush=True)
