"""Benchmark of the shared-memory foundation.

1. Publish rate: copying weights into shared memory, against copying the same weights into fresh anonymous
   memory in the same run (goal: >= 0.9x the plain fill). Two ways: *cold* (create and populate the segment, then
   copy: what a publish costs when nothing was prepared) and *prepared* (the segment was created and populated
   ahead, as a session creator does while its checkpoint loads, ``ShmOwner.prepare_segments``; only the copy is
   timed, and the allocation ahead is reported beside it). Frees and unlinks are outside every timed region.
2. Attach + validate time of a published store with 10 / 1,000 / 10,000 tensors (goal: < 50 ms + 10 us/tensor).
3. Host RAM: sum of PSS growth of 4 processes attached to a 2 GiB store, against 4 private copies (goal ~1x).
4. With CUDA: cudaHostRegister ms/GiB, and H2D GB/s from a registered segment against ``pin_memory()`` and
   pageable memory in the same run (goal: >= 0.97x ``pin_memory()``).

Run: ``.venv/bin/python bench/bench_shm.py [--size-gib 2] [--no-docs]``; it writes its tables into
docs/benchmarks.md unless ``--no-docs`` is given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
import uuid

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gib, median, pss_bytes, report, table  # noqa: E402

from flextensor.shm.coordinator import ShmCoordinator  # noqa: E402
from flextensor.shm.names import manager_namespace  # noqa: E402
from flextensor.shm.segment import SharedSegment  # noqa: E402
from flextensor.shm.tensor_store import SharedTensorStore  # noqa: E402


def _ns(tag: str) -> str:
    return manager_namespace(f"bench-{uuid.uuid4().hex[:8]}", tag)


def bench_publish(nbytes: int, repeat: int) -> dict:
    src = torch.randn(nbytes // 4)  # touched, so only the destination pays for fresh pages
    plain, cold, prepared, allocate = [], [], [], []
    for i in range(repeat + 1):  # the first round warms up and is dropped
        start = time.perf_counter()
        dst = torch.empty_like(src)
        dst.copy_(src)
        plain_s = time.perf_counter() - start
        del dst
        name = f"/ftbench-{uuid.uuid4().hex[:12]}"
        start = time.perf_counter()
        seg = SharedSegment.create(name, nbytes)
        try:
            seg.tensor(torch.float32, (nbytes // 4,)).copy_(src)
            cold_s = time.perf_counter() - start
        finally:
            seg.close()
            SharedSegment.unlink_name(name)
        start = time.perf_counter()
        seg = SharedSegment.create(name, nbytes)  # what prepare_segments does on its thread
        try:
            allocate_s = time.perf_counter() - start
            start = time.perf_counter()
            seg.tensor(torch.float32, (nbytes // 4,)).copy_(src)
            prepared_s = time.perf_counter() - start
        finally:
            seg.close()
            SharedSegment.unlink_name(name)
        if i:
            plain.append(plain_s), cold.append(cold_s), prepared.append(prepared_s), allocate.append(allocate_s)
    gbps = lambda seconds: nbytes / median(seconds) / 1e9  # noqa: E731
    return {
        "bytes": nbytes,
        "plain_s": median(plain), "cold_s": median(cold), "prepared_s": median(prepared),
        "allocate_ahead_s": median(allocate),
        "plain_gbps": gbps(plain), "cold_gbps": gbps(cold), "prepared_gbps": gbps(prepared),
        "cold_ratio": median(plain) / median(cold), "prepared_ratio": median(plain) / median(prepared),
    }


class ManyTensors(nn.Module):
    def __init__(self, count: int, numel: int = 256, device: str = "cpu") -> None:
        super().__init__()
        self.params = nn.ParameterList(
            [nn.Parameter(torch.zeros(numel, device=device), requires_grad=False) for _ in range(count)]
        )


def bench_attach(counts: list[int], repeat: int) -> list[dict]:
    results = []
    for count in counts:
        ns = _ns(f"attach{count}")
        with ShmCoordinator(ns, lease_seconds=30.0) as creator:
            store = SharedTensorStore.create_from_model(ns, ManyTensors(count), shm_owner=creator.memory_owner)
            creator.notify_ready()
            store.close()
            meta_model = ManyTensors(count, device="meta")
            samples = []
            for _ in range(repeat):
                start = time.perf_counter()
                follower = ShmCoordinator(ns, lease_seconds=30.0)
                follower.wait_for_ready(timeout=30)
                attached = SharedTensorStore.attach(ns, shm_owner=follower.memory_owner)
                attached.validate_against(meta_model)
                samples.append(time.perf_counter() - start)
                attached.close()
                follower.close()
        goal = 0.050 + 10e-6 * count
        results.append({"tensors": count, "median_s": median(samples), "goal_s": goal})
    return results


_ATTACHED_CHILD = textwrap.dedent(
    """
    import sys, torch
    from flextensor.shm.tensor_store import SharedTensorStore
    store = SharedTensorStore.attach(sys.argv[1], timeout=60)
    total = sum(float(t.sum()) for t in store.tensors().values())  # touch every page
    print("ready", flush=True)
    sys.stdin.readline()
    """
)

_PRIVATE_CHILD = textwrap.dedent(
    """
    import sys, torch
    nbytes = int(sys.argv[1])
    weights = torch.ones(nbytes // 4)  # a private copy, every page touched
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def _measure_children(argv_list: list[list[str]]) -> int:
    """Start children, wait until each printed 'ready', sum their PSS, then let them exit."""
    children = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for argv in argv_list
    ]
    try:
        for child in children:
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"benchmark child failed: {line!r}")
        baseline = _baseline_pss()
        return sum(pss_bytes(c.pid) - baseline for c in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.stdin.write("\n")
                child.stdin.flush()
        for child in children:
            child.wait(timeout=60)


def _baseline_pss() -> int:
    """PSS of a child that imports the same libraries but holds no weights (what every worker pays anyway)."""
    global _BASELINE
    if _BASELINE is None:
        _BASELINE = _measure_children_raw([sys.executable, "-c", _PRIVATE_CHILD, "4"])
    return _BASELINE


_BASELINE: int | None = None


def _measure_children_raw(argv: list[str]) -> int:
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        return pss_bytes(child.pid)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=60)


def bench_pss(nbytes: int, workers: int) -> dict:
    ns = _ns("pss")
    model = nn.Module()
    model.register_buffer("w", torch.ones(nbytes // 4))
    with ShmCoordinator(ns, lease_seconds=30.0) as creator:
        store = SharedTensorStore.create_from_model(ns, model, shm_owner=creator.memory_owner)
        creator.notify_ready()
        store.close()  # the creator keeps its lease but drops its own mapping
        del model
        shared = _measure_children([[sys.executable, "-c", _ATTACHED_CHILD, ns] for _ in range(workers)])
    private = _measure_children([[sys.executable, "-c", _PRIVATE_CHILD, str(nbytes)] for _ in range(workers)])
    return {
        "bytes": nbytes,
        "workers": workers,
        "shared_pss_growth": shared,
        "private_pss_growth": private,
        "shared_over_model": shared / nbytes,
        "private_over_model": private / nbytes,
    }


def bench_cuda(nbytes: int, repeat: int) -> dict | None:
    if not torch.cuda.is_available():
        return None
    device = torch.device("cuda", 0)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def h2d(src: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dst.copy_(src, non_blocking=True)  # warm-up
        best = []
        for _ in range(repeat):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best.append(start.elapsed_time(end) / 1e3)
        return nbytes / median(best) / 1e9

    name = f"/ftbench-{uuid.uuid4().hex[:12]}"
    seg = SharedSegment.create(name, nbytes)
    try:
        view = seg.tensor(torch.uint8, (nbytes,))
        view.fill_(1)
        start = time.perf_counter()
        seg.pin()
        register_s = time.perf_counter() - start
        shm_gbps = h2d(view)
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        pageable_gbps = h2d(pageable)
        pinned = pageable.pin_memory()
        pinned_gbps = h2d(pinned)
        seg.unpin()
    finally:
        seg.close()
        SharedSegment.unlink_name(name)
    return {
        "bytes": nbytes,
        "register_ms_per_gib": register_s * 1e3 / (nbytes / 2**30),
        "shm_registered_gbps": shm_gbps,
        "pin_memory_gbps": pinned_gbps,
        "pageable_gbps": pageable_gbps,
        "ratio_vs_pin_memory": shm_gbps / pinned_gbps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0, help="store size for the PSS and CUDA runs")
    parser.add_argument("--publish-gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--no-docs", action="store_true", help="do not write the results into docs/benchmarks.md")
    args = parser.parse_args()
    size = int(args.size_gib * 2**30)
    publish = bench_publish(int(args.publish_gib * 2**30), args.repeat)
    attach = bench_attach([10, 1_000, 10_000], args.repeat)
    pss = bench_pss(size, args.workers)
    cuda = bench_cuda(min(size, 2**30), args.repeat)
    sections = [
        ("Publish rate", table(
            ["bytes", "fresh anonymous copy", "SHM publish, prepared segment", "ratio (goal >= 0.9)",
             "its allocation ahead", "SHM publish, cold (create+fill)", "cold ratio"],
            [[gib(publish["bytes"]), f"{publish['plain_gbps']:.2f} GB/s", f"{publish['prepared_gbps']:.2f} GB/s",
              f"{publish['prepared_ratio']:.2f}x", f"{publish['allocate_ahead_s'] * 1e3:.0f} ms",
              f"{publish['cold_gbps']:.2f} GB/s", f"{publish['cold_ratio']:.2f}x"]],
        )),
        ("Attach + validate", table(
            ["tensors", "median", "goal (50 ms + 10 us/tensor)"],
            [[r["tensors"], f"{r['median_s'] * 1e3:.1f} ms", f"{r['goal_s'] * 1e3:.1f} ms"] for r in attach],
        )),
        (f"Host RAM, {pss['workers']} processes, {gib(pss['bytes'])} of weights", table(
            ["layout", "sum of PSS growth", "x model bytes"],
            [["attached to one shared store", gib(pss["shared_pss_growth"]), f"{pss['shared_over_model']:.2f}x"],
             ["private copies", gib(pss["private_pss_growth"]), f"{pss['private_over_model']:.2f}x"]],
        )),
    ]
    if cuda:
        sections.append(("Pinning and H2D (CUDA)", table(
            ["cudaHostRegister", "H2D from registered SHM", "H2D from pin_memory()", "H2D pageable",
             "SHM / pin_memory (goal >= 0.97)"],
            [[f"{cuda['register_ms_per_gib']:.1f} ms/GiB", f"{cuda['shm_registered_gbps']:.1f} GB/s",
              f"{cuda['pin_memory_gbps']:.1f} GB/s", f"{cuda['pageable_gbps']:.1f} GB/s",
              f"{cuda['ratio_vs_pin_memory']:.3f}x"]],
        )))
    report("bench_shm", "flextensor.shm benchmark", sections,
           {"publish": publish, "attach": attach, "pss": pss, "cuda": cuda}, docs=not args.no_docs)


if __name__ == "__main__":
    main()
