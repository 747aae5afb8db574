"""Experiment (follower time to ready): a follower's staged resident copy and its model factory share the GIL.

A follower copies its resident tensors (``StagedCopy``: workers ``pread`` the store's file into a pinned ring and
queue each chunk to the device) on a thread while its model factory (pure Python, a model on ``meta``) runs on
the caller's thread. This measures, in one process on a CUDA host, with a segment of ``--gib`` GiB in /dev/shm:
the factory alone, the copy alone, and both together, at a few chunk sizes and worker counts, and optionally with
a shorter GIL switch interval. Prints one JSON line per run and a table of medians.

``--queues`` compares how chunks are queued (the CUDA runtime with the GIL kept, or PyTorch's calls);
``--process`` also runs the copy in a child process beside the factory, so that the two share the cores and the
memory but no GIL; ``--beside N`` also runs copy + factory with N workers until the factory returns and the
others after (what a follower does). The factory passes over initialisers on meta, as a follower's does
(``--run-init``: it runs them, as in the measurements below).

Measured on the H200 host (2026-12-02 15:05 UTC, 6 GiB, 94 layers, medians of 3): the factory takes 0.07 s
alone. Beside the copy, with the runtime queue: 12 workers and 8 MiB chunks end both in 0.22 s (factory 0.13 s),
16 MiB chunks in 0.23 s (factory 0.09 s), 16 workers in 0.26-0.27 s (factory 0.26-0.27 s); with PyTorch's calls
0.23-0.25 s (factory 0.12-0.16 s) with 12 and 0.25-0.30 s with 16. The copy in another process: 12 workers leave
the factory at 0.07-0.09 s (both 0.20-0.22 s), 16 workers at 0.08 s (both 0.18-0.20 s); in an earlier run
(14:52 UTC) 16 workers in another process slowed it to 0.29 s while 12 did not. The store in 8 parts copies as
fast as one segment. Neither a 0.5 ms switch interval nor lower-priority workers (nice 5 and 10 per thread; tried
and removed) kept the factory's time beside 16 workers in one process.

With the factory's initialisers skipped on meta (2026-12-02 21:35 UTC, runtime queue, medians of 3): the factory
alone 0.03 s; the copy alone 0.18-0.19 s with 16 workers; beside the factory, 12 workers until it returns and 16
after end both in 0.21 s (the factory 0.07-0.09 s), 16 from the start in 0.20-0.21 s (the factory 0.15-0.20 s).

    scripts/gpu-suite.sh bench experiment_attach_gil --gib 6 --threads 16 --beside 12 --queues runtime --process
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

import flextensor.runtime.pinned.bounce_chunks as chunk_queue_mod
from flextensor.loading.lazy_init import skip_init_on_meta
from flextensor.runtime.pinned.bounce_copy import StagedCopy
from flextensor.shm.segment import SharedSegment
from models import ModelSpec, build_meta_model


#: Whether the factory passes over initialisers on meta, as a follower's does (``--run-init``: it does not).
SKIP_INIT = True


def run(copy: bool, factory: bool, chunk: int, threads: int, segs: list[SharedSegment], spec: ModelSpec,
        dst: torch.Tensor, beside: int | None = None) -> dict:
    """One run: the staged copy of every segment (one piece each, as a store in parts is copied) on a thread
    and/or the factory on this one; seconds of each and of both. ``beside``: only that many workers copy until
    the factory returns, as in a follower (``caller_free``)."""
    result: dict = {"chunk_mib": chunk >> 20, "threads": threads, "parts": len(segs), "copy": copy,
                    "factory": factory, "switch_interval": sys.getswitchinterval(), "beside": beside}
    caller_free = threading.Event() if beside is not None and factory else None
    copier = StagedCopy(chunk_bytes=chunk, slots=max(2 * threads, (256 << 20) // chunk), threads=threads,
                        threads_beside=beside or threads, stream=torch.cuda.Stream(), caller_free=caller_free)
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
            with skip_init_on_meta() if SKIP_INIT else contextlib.nullcontext():  # as a follower's factory runs
                build_meta_model(spec, torch.bfloat16)
            result["factory_s"] = time.perf_counter() - begin
            if caller_free is not None:
                caller_free.set()
        if thread is not None:
            thread.join()
        result["both_s"] = time.perf_counter() - start
    finally:
        for fd in fds:
            os.close(fd)
        copier.close()
    return result


def copy_in_child(chunk: int, threads: int, segs: list[SharedSegment], spec: ModelSpec, factory: bool) -> dict:
    """The same copy in another process (its own CUDA context, device buffer and ring, set up before the clock),
    the factory (if asked) in this one: what the pair costs without a GIL in common."""
    result: dict = {"chunk_mib": chunk >> 20, "threads": threads, "parts": len(segs), "copy": True,
                    "factory": factory, "process": True, "switch_interval": sys.getswitchinterval()}
    child = subprocess.Popen([sys.executable, __file__, "--child", str(chunk), str(threads),
                              *[seg.name for seg in segs]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the copying child did not start")
        start = time.perf_counter()
        child.stdin.write("go\n")
        child.stdin.flush()
        if factory:
            begin = time.perf_counter()
            with skip_init_on_meta() if SKIP_INIT else contextlib.nullcontext():  # as a follower's factory runs
                build_meta_model(spec, torch.bfloat16)
            result["factory_s"] = time.perf_counter() - begin
        result["copy_s"] = float(child.stdout.readline())
        result["both_s"] = time.perf_counter() - start
    finally:
        child.kill()
        child.wait()
    return result


def child_main(chunk: int, threads: int, names: list[str]) -> None:
    """The child of :func:`copy_in_child`: set up, say ``ready``, copy at ``go``, print the copy's seconds."""
    torch.cuda.set_device(0)
    segs = [SharedSegment.open(name) for name in names]
    dst = torch.empty(sum(seg.size for seg in segs), dtype=torch.uint8, device="cuda")
    copier = StagedCopy(chunk_bytes=chunk, slots=max(2 * threads, (256 << 20) // chunk), threads=threads,
                        stream=torch.cuda.Stream())
    copier.prepare()
    fds = [seg.open_file() for seg in segs]
    pieces, at = [], 0
    for seg, fd in zip(segs, fds):
        pieces.append((dst.narrow(0, at, seg.size), seg.tensor(torch.uint8, (seg.size,)), (fd, 0)))
        at += seg.size
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    begin = time.perf_counter()
    copier.copy_pieces(pieces)
    print(time.perf_counter() - begin, flush=True)
    copier.close()


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
    p.add_argument("--queues", nargs="+", default=["runtime"], choices=["runtime", "torch"],
                   help="how chunks are queued in process: the CUDA runtime with the GIL kept, or PyTorch's calls")
    p.add_argument("--run-init", action="store_true",
                   help="run the factory's initialisers on meta (a follower passes over them)")
    p.add_argument("--beside", type=int, nargs="*", default=[],
                   help="also run copy + factory with only this many workers until the factory returns")
    p.add_argument("--process", action="store_true",
                   help="also run the copy in a child process beside the factory (no GIL in common)")
    p.add_argument("--switch-interval", type=float, nargs="*", default=[],
                   help="also run every configuration at these sys.setswitchinterval values (seconds)")
    args = p.parse_args()
    global SKIP_INIT
    SKIP_INIT = not args.run_init
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    spec = ModelSpec(hidden=4096, layers=args.layers, vocab=32000)
    build_meta_model(ModelSpec(hidden=128, layers=1, vocab=16, head_dim=128), torch.bfloat16)
    nbytes = int(args.gib * 2**30)
    rows: dict[tuple, list[dict]] = {}
    runtime = chunk_queue_mod._runtime
    default_interval = sys.getswitchinterval()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for r in (run(False, True, 8 << 20, 1, [], spec, dst) for _ in range(args.repeat)):
        print(json.dumps(r), flush=True)
        rows.setdefault(("-", 0, 0, 0, False, True), []).append(r)
    for parts in args.parts:
        segs = make_segments(nbytes, parts)
        try:
            dst.zero_()
            for _ in range(args.repeat):
                for interval in [default_interval, *args.switch_interval]:
                    sys.setswitchinterval(interval)
                    try:
                        for queue, chunk, threads in itertools.product(args.queues, args.chunks, args.threads):
                            chunk_queue_mod._runtime = runtime if queue == "runtime" else lambda: None
                            runs = [(True, False, None), (True, True, None), *((True, True, b) for b in args.beside)]
                            for copy, factory, beside in runs:
                                r = {**run(copy, factory, chunk << 20, threads, segs, spec, dst, beside),
                                     "queue": queue}
                                print(json.dumps(r), flush=True)
                                where = f"{interval * 1e3:g} ms, {queue}" + (f", {beside} beside" if beside else "")
                                rows.setdefault((where, chunk, threads, parts, copy, factory), []).append(r)
                    finally:
                        sys.setswitchinterval(default_interval)
                        chunk_queue_mod._runtime = runtime
                if args.process:
                    for chunk in args.chunks:
                        for threads in args.threads:
                            for factory in (False, True):
                                r = copy_in_child(chunk << 20, threads, segs, spec, factory)
                                print(json.dumps(r), flush=True)
                                rows.setdefault(("process", chunk, threads, parts, True, factory), []).append(r)
            assert bool((dst[:: 1 << 20] == 7).all())
        finally:
            drop_segments(segs)
    print(f"\n{args.gib} GiB copy, {args.layers}-layer meta factory; medians of {args.repeat}")
    print("| switch interval, queue (or: copy in another process) | chunk | workers | parts | runs | copy s (GB/s) | factory s | both s |")
    print("|---|---|---|---|---|---|---|---|")
    for (interval, chunk, threads, parts, copy, factory), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("copy_s", "factory_s", "both_s") if k in rs[0]}
        what = " + ".join(w for w, on in (("copy", copy), ("factory", factory)) if on)
        copy_text = f"{med['copy_s']:.3f} ({nbytes / med['copy_s'] / 1e9:.1f})" if "copy_s" in med else "-"
        factory_text = f"{med['factory_s']:.3f}" if "factory_s" in med else "-"
        print(f"| {interval} | {chunk or '-'} MiB | {threads or '-'} | {parts or '-'} | {what} | "
              f"{copy_text} | {factory_text} | {med['both_s']:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        main()
