"""Experiment: how a creator whose model is in RAM should get the pages of its shared copy, on 4 KiB pages and on
a tmpfs mounted ``huge=always``.

Why: a creator publishing a model built in RAM copies each piece of a private tensor into a fresh shared segment
and gives the private piece back behind the copy (one copy of the model plus a window). The segment's pages are
allocated ahead of the copy on threads (``MADV_POPULATE_WRITE``), which is what beats 4 KiB pages; on huge pages
the publish measured slower than on 4 KiB pages, where the issue's single-thread write was 2.75x faster. Each
variant runs in a fresh process, on a tmpfs this script mounts in a private mount namespace (root), after
compacting free memory, for ``--gib`` GiB in pieces of 32 MiB:

- ``populate``: each piece allocated ``--ahead`` pieces ahead on a pool of threads (``MADV_POPULATE_WRITE``),
  then copied (PyTorch's multi-threaded copy), then the private piece given back (``MADV_DONTNEED``);
- ``fallocate``: the same with ``posix_fallocate`` of each piece (tmpfs reserves the pages; on huge pages it
  defers their zeroing to the first touch);
- ``fault``: no allocation ahead: the copy's own page faults allocate the pages (a fault per 2 MiB on huge pages);
- ``threads``: ``fault``, with the copy and the give-back of the pieces spread over ``--threads`` Python threads;
- ``fallocate_threads``: ``fallocate`` ahead on its pool, the copy and give-back as in ``threads`` (what a
  creator on huge pages could run: reserved ahead, so a full directory is an error and not a SIGBUS);
- ``pwrite_threads``: each piece written into the file with ``pwrite`` on ``--threads`` threads, then given back:
  nothing is allocated ahead or faulted, tmpfs need not zero a page that a write covers whole, and a full
  directory is an ``ENOSPC`` from the write.

``--files N`` spreads the pieces over N files in turn, as a creator's arena spreads its blocks over its parts
(tmpfs serialises the writes into one file under its inode lock, but not the page faults of a mapping).

Usage: ``python bench/experiment_publish_pages.py [--gib 8] [--threads 8]`` as root. One JSON line per variant.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from private_tmpfs import TMPFS_MODES, run_variants  # noqa: E402

PIECE = 32 << 20
VARIANTS = ("populate", "fallocate", "fault", "threads", "fallocate_threads", "pwrite_threads")


def child(directory: str, variant: str, gib: float, ahead: int, threads: int, files: int = 1) -> None:
    import mmap

    import torch

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    n = int(gib * (1 << 30)) // (PIECE * files) * PIECE * files
    src = torch.empty(n, dtype=torch.uint8).fill_(3)
    saddr = src.data_ptr()
    paths = [os.path.join(directory, f"seg{f}") for f in range(files)]
    fds, dsts = [], []
    import warnings
    for path in paths:
        fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.ftruncate(fds[-1], n // files)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dsts.append(torch.frombuffer(mmap.mmap(fds[-1], n // files), dtype=torch.uint8))
    pieces = range(0, n, PIECE)

    def place(lo: int) -> tuple[int, int]:
        """The file and the offset in it of the piece at ``lo`` in the source (pieces go to the files in turn)."""
        k = lo // PIECE
        return k % files, k // files * PIECE

    def allocate(lo: int) -> None:
        f, at = place(lo)
        if variant == "populate":
            if libc.madvise(dsts[f].data_ptr() + at, PIECE, 23):
                raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE")
        elif variant in ("fallocate", "fallocate_threads"):
            os.posix_fallocate(fds[f], at, PIECE)

    def release(lo: int) -> None:
        start = -(-(saddr + lo) // 4096) * 4096
        end = (saddr + lo + PIECE) // 4096 * 4096
        libc.madvise(start, end - start, 4)

    def copy_piece(lo: int) -> None:
        f, at = place(lo)
        if variant == "pwrite_threads":
            view = memoryview((ctypes.c_char * PIECE).from_address(saddr + lo)).cast("B")
            done = 0
            while done < PIECE:
                done += os.pwrite(fds[f], view[done:], at + done)
        else:
            dsts[f][at:at + PIECE].copy_(src[lo:lo + PIECE])
        release(lo)

    reserves = variant in ("populate", "fallocate", "fallocate_threads")
    threaded = variant in ("threads", "fallocate_threads", "pwrite_threads")
    if threaded:
        torch.set_num_threads(1)
    begin = time.perf_counter()
    waited = 0.0
    with ThreadPoolExecutor(max(1, ahead)) as allocator, ThreadPoolExecutor(threads) as copier:
        reserved: dict = {}
        copies = []
        for k, lo in enumerate(pieces):
            if reserves:
                for j in range(k, min(k + ahead + 1, len(pieces))):  # at most --ahead pieces reserved ahead
                    if j not in reserved:
                        reserved[j] = allocator.submit(allocate, pieces[j])
                w = time.perf_counter()
                reserved.pop(k).result()
                waited += time.perf_counter() - w
            if threaded:
                copies.append(copier.submit(copy_piece, lo))
            else:
                copy_piece(lo)
        for c in copies:
            c.result()
    seconds = time.perf_counter() - begin
    ok = all(bool((dst[::1 << 20] == 3).all()) for dst in dsts)
    huge = sum(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("ShmemHugePages")) << 10
    print(json.dumps({"variant": variant, "files": files, "threads": threads, "gib": n / (1 << 30), "gbps": round(n / seconds / 1e9, 2),
                      "seconds": round(seconds, 3), "waited_for_pages_s": round(waited, 3), "bytes_ok": ok,
                      "shmem_huge_gib": round(huge / (1 << 30), 2), "torch_threads": torch.get_num_threads()}),
          flush=True)
    for path in paths:
        os.unlink(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--ahead", type=int, default=8, help="pieces allocated ahead of the copy")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--files", type=int, default=1, help="files the pieces go to in turn")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--modes", nargs="+", choices=list(TMPFS_MODES), default=list(TMPFS_MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.gib, args.ahead, args.threads, args.files)
        return
    run_variants(__file__, "ft-publish-pages", args.modes, args.variants, args.repeat, int(args.gib * 1024) + 1024,
                 ["--gib", str(args.gib), "--ahead", str(args.ahead), "--threads", str(args.threads),
                  "--files", str(args.files)])

if __name__ == "__main__":
    main()
