"""Experiment (follower time to ready): a follower's staged resident copy and its model factory share the GIL.

A follower copies its resident tensors (``StagedCopy``: workers ``pread`` the store's file into a pinned ring and
queue each chunk to the device) on a thread while its model factory (pure Python, a model on ``meta``) runs on
the caller's thread. This measures, in one process on a CUDA host, with a segment of ``--gib`` GiB in /dev/shm:
the factory alone, the copy alone, and both together, at a few chunk sizes and worker counts, and optionally with
a shorter GIL switch interval. Prints one JSON line per run and a table of medians.

Measured on the H200 host (2026-12-02, 6 GiB, 94 layers, 16 workers, 8 MiB chunks, medians of 3): the factory
takes 0.07 s alone and 0.27-0.29 s beside the copy, which takes 0.19 s alone and 0.25-0.27 s beside it. Queueing
each chunk's copy and event with the GIL kept (a ctypes binding of PyTorch's CUDA runtime: one GIL hand-over per
chunk instead of four) made the copy beside the factory about 12% faster and left the factory's time as it was,
so the library queues through PyTorch's own calls: the hand-overs per chunk are not what slows the factory.
Workers and switch interval (same host, 13:25 UTC, the last of 3 runs): with 8 workers the factory keeps its
0.07-0.08 s beside the copy (copy 0.27-0.29 s, 8 or 32 MiB chunks); with 16 it takes 0.20-0.26 s and the copy
0.21-0.24 s (0.19-0.21 s alone); a 0.5 ms switch interval changes neither. Lowering the helper workers' priority
(nice 5 and 10 per thread, tried at 13:27 UTC, medians of 3, then removed) left the factory at 0.24-0.26 s beside
16 workers and brought it to 0.13-0.15 s beside 12: not a plain share of the cores either. 16 workers still end
both soonest in one process (0.21-0.24 s).

    scripts/gpu-suite.sh bench experiment_attach_gil --gib 6 --threads 8 16 --parts 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

from flextensor.runtime.staged_copy import StagedCopy
from flextensor.shm.segment import SharedSegment
from models import ModelSpec, build_meta_model


def run(copy: bool, factory: bool, chunk: int, threads: int, segs: list[SharedSegment], spec: ModelSpec,
        dst: torch.Tensor) -> dict:
    """One run: the staged copy of every segment (one piece each, as a store in parts is copied) on a thread
    and/or the factory on this one; seconds of each and of both."""
    result: dict = {"chunk_mib": chunk >> 20, "threads": threads, "parts": len(segs), "copy": copy,
                    "factory": factory, "switch_interval": sys.getswitchinterval()}
    copier = StagedCopy(chunk_bytes=chunk, slots=max(2 * threads, (256 << 20) // chunk), threads=threads,
                        stream=torch.cuda.Stream())
    copier.prepare()
    fds = [seg.open_file() for seg in segs]

    def do_copy() -> None:
        torch.cuda.set_device(dst.device)
        pieces, at = [], 0
        for seg, fd in zip(segs, fds):
            pieces.append((dst.narrow(0, at, seg.size), seg.tensor(torch.uint8, (seg.size,)), (fd, 0)))
            at += seg.size
        begin = time.perf_counter()
        copier.copy_pieces(pieces)
        result["copy_s"] = time.perf_counter() - begin

    try:
        thread = threading.Thread(target=do_copy) if copy else None
        start = time.perf_counter()
        if thread is not None:
            thread.start()
        if factory:
            begin = time.perf_counter()
            build_meta_model(spec, torch.bfloat16)
            result["factory_s"] = time.perf_counter() - begin
        if thread is not None:
            thread.join()
        result["both_s"] = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
        copier.close()
    return result


def make_segments(nbytes: int, parts: int) -> list[SharedSegment]:
    """``parts`` segments of about ``nbytes / parts`` each (whole pages), every byte 7."""
    page = os.sysconf("SC_PAGE_SIZE")
    size = -(-nbytes // parts // page) * page
    segs: list[SharedSegment] = []
    try:
        for k in range(parts):
            seg = SharedSegment.create(f"/ftexp-gil-{os.getpid()}-{k}", min(size, nbytes - k * size))
            segs.append(seg)
            seg.tensor(torch.uint8, (seg.size,)).fill_(7)
    except BaseException:
        drop_segments(segs)
        raise
    return segs


def drop_segments(segs: list[SharedSegment]) -> None:
    for seg in segs:
        name = seg.name
        seg.close()
        SharedSegment.unlink_name(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=6.0)
    p.add_argument("--layers", type=int, default=94)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--chunks", type=int, nargs="+", default=[8, 16], help="chunk sizes in MiB")
    p.add_argument("--threads", type=int, nargs="+", default=[16], help="copy workers")
    p.add_argument("--parts", type=int, nargs="+", default=[1],
                   help="copy from this many segments (as a follower copies a store in parts)")
    p.add_argument("--switch-interval", type=float, nargs="*", default=[],
                   help="also run every configuration at these sys.setswitchinterval values (seconds)")
    args = p.parse_args()
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    spec = ModelSpec(hidden=4096, layers=args.layers, vocab=32000)
    build_meta_model(ModelSpec(hidden=128, layers=1, vocab=16, head_dim=128), torch.bfloat16)
    nbytes = int(args.gib * 2**30)
    rows: dict[tuple, list[dict]] = {}
    default_interval = sys.getswitchinterval()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for r in (run(False, True, 8 << 20, 1, [], spec, dst) for _ in range(args.repeat)):
        print(json.dumps(r), flush=True)
        rows.setdefault((default_interval, 0, 0, 0, False, True), []).append(r)
    for parts in args.parts:
        segs = make_segments(nbytes, parts)
        try:
            dst.zero_()
            for _ in range(args.repeat):
                for interval in [default_interval, *args.switch_interval]:
                    sys.setswitchinterval(interval)
                    try:
                        for chunk in args.chunks:
                            for threads in args.threads:
                                for copy, factory in ((True, False), (True, True)):
                                    r = run(copy, factory, chunk << 20, threads, segs, spec, dst)
                                    print(json.dumps(r), flush=True)
                                    rows.setdefault((interval, chunk, threads, parts, copy, factory), []).append(r)
                    finally:
                        sys.setswitchinterval(default_interval)
            assert bool((dst[:: 1 << 20] == 7).all())
        finally:
            drop_segments(segs)
    print(f"\n{args.gib} GiB copy, {args.layers}-layer meta factory; medians of {args.repeat}")
    print("| switch interval | chunk | workers | parts | runs | copy s (GB/s) | factory s | both s |")
    print("|---|---|---|---|---|---|---|---|")
    for (interval, chunk, threads, parts, copy, factory), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("copy_s", "factory_s", "both_s") if k in rs[0]}
        what = " + ".join(w for w, on in (("copy", copy), ("factory", factory)) if on)
        copy_text = f"{med['copy_s']:.3f} ({nbytes / med['copy_s'] / 1e9:.1f})" if "copy_s" in med else "-"
        factory_text = f"{med['factory_s']:.3f}" if "factory_s" in med else "-"
        print(f"| {interval * 1e3:g} ms | {chunk or '-'} MiB | {threads or '-'} | {parts or '-'} | {what} | "
              f"{copy_text} | {factory_text} | {med['both_s']:.3f} |")


if __name__ == "__main__":
    main()
