"""Experiment (follower time to ready): how fast can a follower register its fresh mapping of the blocks?

24 x 64 MiB POSIX shared-memory segments are written by this process; each variant then runs in a fresh process
(a follower: new CUDA context, new mapping without page-table entries) and registers all 1.5 GiB:
``plain`` (cudaHostRegister Portable, 1/4/8/16 threads), ``mappop`` (mmap with MAP_POPULATE first),
``popread`` (MADV_POPULATE_READ from 8 threads first), flags 9 (Portable | ReadOnly); then 4 and 8 followers at
once. Last, 1 GiB from PyTorch's pinned allocator against an anonymous fill + cudaHostRegister.

"""
import ctypes, mmap, sys, time, json
from concurrent.futures import ThreadPoolExecutor
import posix_ipc, torch
NB, BS = 24, 64 << 20
libc = ctypes.CDLL(None, use_errno=True); libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
names = [f"/regexp{i}" for i in range(NB)]
def create():
    for n in names:
        try: posix_ipc.unlink_shared_memory(n)
        except Exception: pass
        m = posix_ipc.SharedMemory(n, posix_ipc.O_CREX, size=BS)
        mm = mmap.mmap(m.fd, BS); mm.write(b"\1" * BS); mm.close(); m.close_fd()
def unlink():
    for n in names: posix_ipc.unlink_shared_memory(n)
def follower(variant, threads, flags, tag=""):
    torch.cuda.init(); cudart = torch.cuda.cudart(); torch.empty(1, device="cuda")
    t0 = time.perf_counter()
    maps = []
    for n in names:
        m = posix_ipc.SharedMemory(n); fl = mmap.MAP_SHARED | (mmap.MAP_POPULATE if variant == "mappop" else 0)
        prot = mmap.PROT_READ if flags & 8 else mmap.PROT_READ | mmap.PROT_WRITE
        mm = mmap.mmap(m.fd, BS, flags=fl, prot=prot); m.close_fd(); maps.append(mm)
    import warnings; warnings.simplefilter('ignore')
    addrs = [torch.frombuffer(mm, dtype=torch.uint8).data_ptr() for mm in maps]
    t1 = time.perf_counter()
    if variant == "popread":
        def pr(a): return libc.madvise(a, BS, 22)
        with ThreadPoolExecutor(threads) as p: list(p.map(pr, addrs))
    t2 = time.perf_counter()
    def reg(a): return int(cudart.cudaHostRegister(a, BS, flags))
    if threads == 1 or variant == "popread":
        rcs = [reg(a) for a in addrs]
    else:
        with ThreadPoolExecutor(threads) as p: rcs = list(p.map(reg, addrs))
    t3 = time.perf_counter()
    for a in addrs: cudart.cudaHostUnregister(a)
    gib = NB * BS / 2**30
    res = dict(variant=variant, threads=threads, flags=flags, tag=tag, map_ms=(t1-t0)*1e3, prefault_ms=(t2-t1)*1e3, reg_ms=(t3-t2)*1e3, total_ms=(t3-t0)*1e3, ms_per_gib=(t3-t0)*1e3/gib, rc=sorted(set(rcs)))
    print(json.dumps(res), flush=True)
if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "follower":
        follower(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
        sys.exit()
    import subprocess
    create()
    try:
        py = sys.executable
        runs = [("plain", 1, 1), ("plain", 4, 1), ("plain", 8, 1), ("plain", 16, 1), ("mappop", 1, 1), ("popread", 8, 1), ("plain", 1, 9), ("plain", 8, 9)]
        for rep in range(2):
            for v, th, fl in runs:
                subprocess.run([py, __file__, "follower", v, str(th), str(fl)], check=False)
        for v, th, fl in [("plain", 1, 1), ("plain", 8, 1)]:
            for k in (4, 8):
                procs = [subprocess.Popen([py, __file__, "follower", v, str(th), str(fl), f"concurrent{k}"]) for _ in range(k)]
                [p.wait() for p in procs]
    finally:
        unlink()
    # cudaHostAlloc vs anon+register for 1 GiB
    torch.cuda.init(); cudart = torch.cuda.cudart()
    for rep in range(2):
        t0 = time.perf_counter(); x = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True); t1 = time.perf_counter()
        mm = mmap.mmap(-1, 1 << 30); t = torch.frombuffer(mm, dtype=torch.uint8); t.fill_(0); t2 = time.perf_counter()
        rc = cudart.cudaHostRegister(t.data_ptr(), 1 << 30, 1); t3 = time.perf_counter(); cudart.cudaHostUnregister(t.data_ptr())
        print(f"cudaHostAlloc(torch pinned) 1GiB {1e3*(t1-t0):.0f} ms | anon fill {1e3*(t2-t1):.0f} ms + register {1e3*(t3-t2):.0f} ms", flush=True)
        del x, t; mm.close()
        torch.cuda.empty_cache(); torch._C._host_emptyCache() if hasattr(torch._C, "_host_emptyCache") else None
