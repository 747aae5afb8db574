"""Experiment: the creator's arena fill (``flextensor.sharing.publish.fill_blocks``) copied from the filling thread
or on a pool of threads (``flextensor.runtime.piece_copy``), on 4 KiB pages and on a tmpfs mounted ``huge=always``.

Why: ``bench/experiment_publish_pages.py`` measures bare copies into one file; this runs the product's own fill
(its arena parts, pieces, populate-ahead window and page give-back) over a model-like set of private bfloat16
tensors (per block four ``H x H`` and two ``2H x H`` matrices), so the two can be compared on one host and the
gap between them found. Each run is a fresh process in a private mount namespace (root) on a tmpfs this script
mounts, after compacting free memory.

Usage: ``python bench/experiment_fill_blocks.py [--gib 8] [--hidden 4096] [--repeat 1]`` as root, with flextensor
importable (``scripts/gpu-suite.sh bench experiment_fill_blocks``). One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from private_tmpfs import TMPFS_MODES, run_variants  # noqa: E402

#: on threads: a pool of a thread per core, as on a tmpfs of huge pages; "no heap trim" skips the ``malloc_trim``
#: after each block, "one populating worker per part" allocates ahead on fewer threads than the product's, "store
#: beside" publishes the first eighth of the blocks' tensors into a store on the same pool while the arena fills
#: with the rest (``publish_store`` beside ``fill_blocks``, as a creator does).
VARIANTS = ("copied here", "on threads", "on threads, no heap trim", "on threads, one populating worker per part",
            "on threads, store beside")
STORE_SHARE = 8


def child(directory: str, gib: float, hidden: int, variant: str) -> None:
    import torch

    from flextensor.runtime.packed_layout import pack_block
    from flextensor.runtime.piece_copy import CopyPool
    from flextensor.sharing import publish
    from flextensor.shm import segment_dir
    from flextensor.shm.blocks import SharedBlockAllocator, arena_layout
    from flextensor.shm.segment import SharedSegment
    from flextensor.state import ModelTensor

    segment_dir.set_default_directory(directory)
    store_beside = "store beside" in variant
    shapes = [(hidden, hidden)] * 4 + [(2 * hidden, hidden), (hidden, 2 * hidden)]
    per_block = sum(rows * cols * 2 for rows, cols in shapes)
    tensors, layouts = {}, []
    resident = torch.nn.ParameterDict()  # the store's tensors ("store beside")
    blocks = max(1, int(gib * 2**30 // per_block))
    for i in range(blocks):
        entries = []
        in_store = store_beside and i < max(1, blocks // STORE_SHARE)
        for j, shape in enumerate(shapes):
            name = f"b{i}.t{j}"
            weight = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16).fill_(1.5), requires_grad=False)
            if in_store:
                resident[f"b{i}_t{j}"] = weight
                continue
            tensors[name] = ModelTensor(name, "param", weight, True, [])
            entries.append((name, torch.bfloat16, shape, (shape[1], 1)))
        if entries:
            layouts.append(pack_block(len(layouts), f"b{i}", entries))
    layout = arena_layout([b.nbytes for b in layouts])
    token = f"ftfill{os.getpid()}"
    segments = [SharedSegment.create(f"/{token}.a{k}", size, reserve=False) for k, size in enumerate(layout.part_sizes)]
    try:
        views = SharedBlockAllocator.views(segments, layout)
        total = sum(b.nbytes for b in layouts) + sum(p.nbytes for p in resident.values())
        if "no heap trim" in variant:
            publish.return_free_heap = lambda: False
        if "one populating worker" in variant:
            publish._populate_workers = lambda parts, window, piece: parts
        pool = CopyPool(label="ft-publish-copy") if variant.startswith("on threads") else None
        store_names = [f"resident.{key}" for key in resident]
        holder = torch.nn.Module()
        holder.resident = resident
        begin = time.perf_counter()
        store_call = store = None
        try:
            if store_beside:  # the arena fills on a thread while the store fills here, as in a creator
                store_call = publish.BackgroundCall(lambda views=views: publish.fill_blocks(
                    tensors, layouts, views, segments, layout, None, label="fill", copy_pool=pool), name="fill")
                store_report: dict[str, float] = {}
                store = publish.publish_store(f"ftfillstore{os.getpid()}", holder, store_names, None, None,
                                              window=publish.populate_window(sum(p.nbytes for p in resident.values())),
                                              report=store_report, copy_pool=pool)
                store_s = time.perf_counter() - begin
                failure = store_call.join()
                if failure is not None:
                    raise failure
                report = {"store_s": store_s, **store_report}
            else:
                report = publish.fill_blocks(tensors, layouts, views, segments, layout, None, label="fill",
                                             copy_pool=pool)
        finally:
            if store_call is not None:
                store_call.join()
            if pool is not None:
                pool.close()
        seconds = time.perf_counter() - begin
        if store is not None:
            shared = store.tensors()  # every resident weight is its record in the store now, with the model's bytes
            report["store_ok"] = float(all(shared[f"resident.{key}"].data_ptr() == p.data_ptr()
                                           and bool((p[::97] == 1.5).all()) for key, p in resident.items()))
        spans = [(seg.address, seg.address + seg.size) for seg in segments]
        ok = all(any(lo <= t.tensor.data_ptr() < hi for lo, hi in spans) and bool((t.tensor[::97] == 1.5).all())
                 for t in tensors.values())  # every weight is its shared copy now, with the model's bytes
        huge = sum(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("ShmemHugePages")) << 10
        print(json.dumps({"gib": round(total / 2**30, 2), "gbps": round(total / seconds / 1e9, 2),
                          "seconds": round(seconds, 3), "bytes_ok": ok, "shmem_huge_gib": round(huge / 2**30, 2),
                          **{k: round(v, 3) for k, v in report.items()}}), flush=True)
        del views
    finally:
        tensors.clear()
        if store is not None:
            resident.clear()
            store.close()
        for segment in segments:
            segment.close()
            SharedSegment.unlink_name(segment.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--modes", nargs="+", choices=list(TMPFS_MODES), default=list(TMPFS_MODES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.gib, args.hidden, args.child[1])
        return
    run_variants(__file__, "ft-fill-blocks", args.modes, args.variants, args.repeat, int(args.gib * 1024) + 2048,
                 ["--gib", str(args.gib), "--hidden", str(args.hidden)])

if __name__ == "__main__":
    main()
