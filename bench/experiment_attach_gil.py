"""Experiment (follower time to ready): a follower's staged resident copy and its model factory share the GIL.

A follower copies its resident tensors (``StagedCopy``: workers ``pread`` the store's file into a pinned ring and
queue each chunk to the device) on a thread while its model factory (pure Python, a model on ``meta``) runs on
the caller's thread. This measures, in one process on a CUDA host, with a segment of ``--gib`` GiB in /dev/shm:
the factory alone, the copy alone, and both together, with the copies queued through PyTorch's calls (each lets
go of the GIL) or through ``flextensor.runtime.cuda_enqueue`` (GIL kept while queueing), at a few chunk sizes.
Prints one JSON line per run and a table of medians.

    PYTHONPATH=<site> python bench/experiment_attach_gil.py --gib 6 --layers 94 --repeat 3
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

import flextensor.runtime.cuda_enqueue as cuda_enqueue
from flextensor.runtime.staged_copy import StagedCopy
from flextensor.shm.segment import SharedSegment
from models import ModelSpec, build_meta_model


def run(copy: bool, factory: bool, lean: bool, chunk: int, threads: int, seg: SharedSegment, nbytes: int,
        spec: ModelSpec, dst: torch.Tensor) -> dict:
    original = cuda_enqueue.load
    if not lean:
        cuda_enqueue.load = lambda: None  # type: ignore[assignment]
    result: dict = {"lean": lean, "chunk_mib": chunk >> 20, "threads": threads, "copy": copy, "factory": factory}
    try:
        copier = StagedCopy(chunk_bytes=chunk, slots=max(2 * threads, (256 << 20) // chunk), threads=threads,
                            stream=torch.cuda.Stream())
        copier.prepare()
        fd = seg.open_file()

        def do_copy() -> None:
            torch.cuda.set_device(dst.device)
            begin = time.perf_counter()
            copier(dst, seg.tensor(torch.uint8, (nbytes,)), (fd, 0))
            result["copy_s"] = time.perf_counter() - begin

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
        os.close(fd)
        copier.close()
    finally:
        cuda_enqueue.load = original  # type: ignore[assignment]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=6.0)
    p.add_argument("--layers", type=int, default=94)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--chunks", type=int, nargs="+", default=[8, 16], help="chunk sizes in MiB")
    p.add_argument("--threads", type=int, nargs="+", default=[16], help="copy workers")
    p.add_argument("--switch-interval", type=float, default=None, help="also run lean 8 MiB at this sys.setswitchinterval")
    args = p.parse_args()
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    spec = ModelSpec(hidden=4096, layers=args.layers, vocab=32000)
    build_meta_model(ModelSpec(hidden=128, layers=1, vocab=16, head_dim=128), torch.bfloat16)
    nbytes = int(args.gib * 2**30)
    name = f"/ftexp-gil-{os.getpid()}"
    seg = SharedSegment.create(name, nbytes)
    rows: dict[tuple, list[dict]] = {}
    try:
        seg.tensor(torch.uint8, (nbytes,)).fill_(7)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        for _ in range(args.repeat):
            r = run(False, True, True, 8 << 20, 1, seg, nbytes, spec, dst)
            print(json.dumps(r), flush=True)
            rows.setdefault(("-", "-", "-", False, True), []).append(r)
            for lean in (False, True):
                for chunk in args.chunks:
                    for threads in args.threads:
                        for copy, factory in ((True, False), (True, True)):
                            r = run(copy, factory, lean, chunk << 20, threads, seg, nbytes, spec, dst)
                            print(json.dumps(r), flush=True)
                            rows.setdefault((lean, chunk, threads, copy, factory), []).append(r)
            if args.switch_interval is not None:
                default = sys.getswitchinterval()
                sys.setswitchinterval(args.switch_interval)
                try:
                    for copy, factory in ((True, False), (True, True)):
                        r = run(copy, factory, True, 8 << 20, max(args.threads), seg, nbytes, spec, dst)
                        r["switch_interval"] = args.switch_interval
                        print(json.dumps(r), flush=True)
                        rows.setdefault((f"switch {args.switch_interval}", 8, max(args.threads), copy, factory),
                                        []).append(r)
                finally:
                    sys.setswitchinterval(default)
        assert bool((dst[:: 1 << 20] == 7).all())
    finally:
        seg.close()
        SharedSegment.unlink_name(name)
    print(f"\n{args.gib} GiB copy, {args.layers}-layer meta factory; medians of {args.repeat}")
    print("| queued through | chunk | workers | runs | copy s (GB/s) | factory s | both s |")
    print("|---|---|---|---|---|---|---|")
    for (lean, chunk, threads, copy, factory), rs in rows.items():
        med = {k: statistics.median(r[k]) for k in ("copy_s", "factory_s", "both_s") if k in rs[0]}
        how = lean if isinstance(lean, str) else ("cuda_enqueue (GIL kept)" if lean else "PyTorch calls")
        what = " + ".join(w for w, on in (("copy", copy), ("factory", factory)) if on)
        copy_text = f"{med['copy_s']:.3f} ({nbytes / med['copy_s'] / 1e9:.1f})" if "copy_s" in med else "-"
        print(f"| {how} | {chunk} MiB | {threads} | {what} | {copy_text} | {med.get('factory_s', float('nan')):.3f} | "
              f"{med['both_s']:.3f} |")


if __name__ == "__main__":
    main()
