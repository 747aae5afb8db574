"""Host-side rates behind a sharing group's costs, measured without a GPU (part of ``bench_scale``).

Why: a creator's publish and a follower's resident copy are bounded by what this host does with shared-memory
pages, not by the device; these measures say which bound a size runs into.

* :func:`tmpfs_rates`: how fast fresh ``/dev/shm`` pages are allocated (several ways) against plain copies, the
  bound of a creator whose model is in RAM.
* :func:`follower_read_rates`: the host side of a follower's resident copy, on a segment as large as a store, in
  fresh processes, one alone and several started together: map the segment, then read it into the pinned ring
  of :class:`~flextensor.runtime.pinned.bounce_copy.StagedCopy` (its registration left out, the device copy replaced
  by a no-op into a ``meta`` tensor) either with ``pread`` from the segment's file (what a follower does) or with
  ``memmove`` from the mapping, pre-faulted from helper threads (what it did before), and unmap it. Reported per
  process: the map, the ring's pages, the read (GB/s) and the unmap.

Worker processes: ``python bench/shm_rates.py --worker read PARAMS_JSON`` (the JSON-line protocol of
``common.JsonLineWorker``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import JsonLineWorker, median  # noqa: E402

__all__ = ["tmpfs_rates", "follower_read_rates", "read_rows"]

#: How a follower reads the store: ``file`` (pread, today's way) and ``mapping`` (memmove, pre-faulted).
READ_MODES = ("file", "mapping")


def tmpfs_rates(nbytes: int) -> dict:
    """How fast this host gets fresh /dev/shm pages (several ways) against plain copies, for ``nbytes``: GB/s."""
    import ctypes
    import mmap

    import posix_ipc
    import torch

    from concurrent.futures import ThreadPoolExecutor

    from flextensor.shm.prefault import MADV_POPULATE_WRITE, _populate, populate_write, populate_write_range

    src = torch.ones(nbytes, dtype=torch.uint8)
    rates: dict = {"bytes": nbytes, "torch_threads": torch.get_num_threads()}

    def fresh_segment(size: int = nbytes) -> mmap.mmap:
        name = f"/ftscale{uuid.uuid4().hex[:10]}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        mapping = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED)
        shm.close_fd()
        posix_ipc.unlink_shared_memory(name)  # the mapping keeps the pages until it is closed
        return mapping

    def copy_into(mapping: mmap.mmap) -> float:
        dst = torch.frombuffer(mapping, dtype=torch.uint8)
        begin = time.perf_counter()
        dst.copy_(src)
        seconds = time.perf_counter() - begin
        del dst
        return seconds

    def address_of(mapping: mmap.mmap) -> int:
        anchor = ctypes.c_char.from_buffer(mapping)
        address = ctypes.addressof(anchor)
        del anchor
        return address

    def one_thread(mapping: mmap.mmap) -> None:
        code = _populate(address_of(mapping), nbytes, MADV_POPULATE_WRITE)
        if code:
            raise OSError(code, os.strerror(code))

    def threads(mapping: mmap.mmap) -> None:
        if not populate_write(mapping, nbytes):
            raise OSError("the kernel lacks MADV_POPULATE_WRITE")

    anon = torch.empty(nbytes, dtype=torch.uint8)
    begin = time.perf_counter()
    anon.copy_(src)
    rates["copy into fresh anonymous memory"] = nbytes / (time.perf_counter() - begin) / 1e9
    del anon
    mapping = fresh_segment()
    rates["copy into a fresh segment (the copy faults the pages)"] = nbytes / copy_into(mapping) / 1e9
    mapping.close()
    for parts in (8, 16):  # an arena's parts (flextensor.shm.blocks): tmpfs allocates each file under its own locks
        segments = [fresh_segment(nbytes // parts) for _ in range(parts)]
        try:
            begin = time.perf_counter()
            with ThreadPoolExecutor(parts) as pool:
                done = list(pool.map(lambda m: populate_write_range(address_of(m), nbytes // parts, threads=1),
                                     segments))
            seconds = time.perf_counter() - begin
            rates[f"allocate: {parts} segments of 1/{parts}, a thread each"] = (
                nbytes / seconds / 1e9 if all(done) else "n/a (the kernel lacks MADV_POPULATE_WRITE)")
        finally:
            for mapping in segments:
                mapping.close()
    for label, populate in (("allocate: MADV_POPULATE_WRITE from several threads", threads),
                            ("allocate: MADV_POPULATE_WRITE, one thread", one_thread)):
        mapping = fresh_segment()
        try:
            begin = time.perf_counter()
            populate(mapping)
            rates[label] = nbytes / (time.perf_counter() - begin) / 1e9
            rates[f"copy into those pages ({label.split(': ')[1]})"] = nbytes / copy_into(mapping) / 1e9
        except OSError as exc:
            rates[label] = f"n/a ({exc})"
        finally:
            mapping.close()
    return rates


def follower_read_rates(nbytes: int, together: int, timeout: float = 120.0) -> dict:
    """The host side of a follower's resident copy of ``nbytes`` (see module docs), per read mode, for one
    process alone and ``together`` started at once: ``{"bytes", "threads", "runs": {"MODE xN": [per process]}}``."""
    import torch

    from flextensor.runtime.pinned.bounce_copy import THREADS
    from flextensor.shm.segment import SharedSegment

    name = f"/ftreads{uuid.uuid4().hex[:10]}"
    segment = SharedSegment.create(name, nbytes)
    try:
        segment.tensor(torch.uint8, (nbytes,)).fill_(1)
        data: dict = {"bytes": nbytes, "threads": THREADS, "runs": {}}
        for mode in READ_MODES:
            for count in sorted({1, max(1, together)}):
                workers = [JsonLineWorker(__file__, "read", {"name": name, "mode": mode}) for _ in range(count)]
                try:
                    for w in workers:
                        if w.read(timeout).get("stage") != "loaded":
                            raise RuntimeError(f"read worker {w.proc.pid} did not report its imports")
                    for w in workers:
                        w.send("go")
                    data["runs"][f"{mode} x{count}"] = [w.read(timeout) for w in workers]
                finally:
                    for w in workers:
                        w.proc.wait(timeout=timeout)
        return data
    finally:
        segment.close()
        SharedSegment.unlink_name(name)


def read_rows(data: dict) -> list[list[str]]:
    """Table rows of :func:`follower_read_rates`: per run, medians per process and the group's rate."""
    rows = []
    for label, runs in data["runs"].items():
        mode, count = label.split(" x")
        what = "pread from the file" if mode == "file" else "memmove from the mapping, pre-faulted"
        slowest = max(r["read_s"] for r in runs)
        rows.append([f"{what}, {count} process{'es' if count != '1' else ''}",
                     f"{median([r['map_s'] for r in runs]) * 1e3:.1f} ms",
                     f"{median([r['ring_s'] for r in runs]) * 1e3:.1f} ms",
                     f"{median([data['bytes'] / r['read_s'] for r in runs]) / 1e9:.1f} GB/s",
                     f"{data['bytes'] * len(runs) / slowest / 1e9:.1f} GB/s",
                     f"{median([r['close_s'] for r in runs]) * 1e3:.1f} ms"])
    return rows


READ_HEADERS = ["follower reads", "map", "ring pages", "read per process (median)", "all together",
                "unmap (median)"]


def _read_worker(params: dict) -> dict:
    """One follower's host side: map, ring, read, unmap (see module docs)."""
    import torch

    from flextensor.runtime.pinned.bounce_copy import StagedCopy
    from flextensor.shm.segment import SharedSegment

    torch.set_num_threads(1)
    print(json.dumps({"stage": "loaded"}), flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("parent went away before 'go'")
    begin = time.perf_counter()
    segment = SharedSegment.open(params["name"])
    mapped = time.perf_counter()
    copier = StagedCopy(min_bytes=0, register=lambda _ptr, _n: None, unregister=lambda _ptr: None)
    copier.prepare()
    ringed = time.perf_counter()
    src = segment.tensor(torch.uint8, (segment.size,))
    dst = torch.empty(segment.size, dtype=torch.uint8, device="meta")  # the device copy left out
    if params["mode"] == "file":
        fd = segment.open_file()
        try:
            copier(dst, src, (fd, 0))
        finally:
            os.close(fd)
    else:
        copier(dst, src)
    read = time.perf_counter()
    del src
    segment.close()
    closed = time.perf_counter()
    return {"map_s": mapped - begin, "ring_s": ringed - mapped, "read_s": read - ringed, "close_s": closed - read,
            "source": copier.last.source, "threads": copier.last.threads}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker" and sys.argv[2] == "read":
        try:
            print(json.dumps(_read_worker(json.loads(sys.argv[3]))), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            raise SystemExit(3)
    else:
        raise SystemExit("usage: bench/shm_rates.py is run by bench_scale.py (--worker read PARAMS_JSON)")
