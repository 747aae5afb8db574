"""Experiment (issue 4, follower time to ready): is cudaHostRegister of many blocks faster from several threads?

Registers 24 x 64 MiB of shared anonymous memory sequentially and from 4/8/16 threads, twice. A follower spends
most of its time to ready registering its mapping of the shared blocks; if the driver scales across threads,
``SharedOffloadSession._attach`` should pin its blocks from a thread pool. Needs CUDA. Not run yet (no device time
left in the session that wrote it).
"""
import mmap
import time
from concurrent.futures import ThreadPoolExecutor

import torch

torch.cuda.init()
cudart = torch.cuda.cudart()
nblocks, bsize = 24, 64 << 20
def make():
    bufs = [mmap.mmap(-1, bsize, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS) for _ in range(nblocks)]
    ts = [torch.frombuffer(b, dtype=torch.uint8) for b in bufs]
    for t in ts: t.fill_(1)
    return bufs, ts
def reg(t): assert int(cudart.cudaHostRegister(t.data_ptr(), t.numel(), 1)) == 0
def unreg(t): assert int(cudart.cudaHostUnregister(t.data_ptr())) == 0
for rep in range(2):
    for threads in (1, 4, 8, 16):
        bufs, ts = make()
        t0 = time.perf_counter()
        if threads == 1:
            for t in ts: reg(t)
        else:
            with ThreadPoolExecutor(threads) as p: list(p.map(reg, ts))
        dt = time.perf_counter() - t0
        for t in ts: unreg(t)
        print(f"threads {threads:2d}: {dt*1e3:7.1f} ms for {nblocks*bsize/2**30:.2f} GiB = {dt*1e3/(nblocks*bsize/2**30):.1f} ms/GiB", flush=True)
        del ts; [b.close() for b in bufs]
