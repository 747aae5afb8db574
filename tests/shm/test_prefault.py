"""Allocating a segment's pages ahead: every page of the range is allocated, by a few threads per file."""

from __future__ import annotations

import os
import threading
import time

from flextensor.shm import prefault
from flextensor.shm.segment import SharedSegment

MIB = 1 << 20


def test_a_range_is_allocated_whole_by_at_most_the_threads_one_file_can_use(namespace, monkeypatch):
    name = f"/{namespace}.pages"
    segment = SharedSegment.create(name, 64 * MIB, reserve=False)
    try:
        assert os.stat(f"/dev/shm{name}").st_blocks == 0
        assert prefault.populate_write_range(segment.address, 64 * MIB)
        assert os.stat(f"/dev/shm{name}").st_blocks * 512 == 64 * MIB  # every page, nothing else
    finally:
        segment.close()
        SharedSegment.unlink_name(name)

    threads: set[int] = set()
    real = prefault.madvise

    def recorded(address: int, length: int, advice: int) -> int:
        threads.add(threading.get_ident())
        time.sleep(0.01)  # long enough that every pool thread takes a piece
        return real(address, length, advice)

    monkeypatch.setattr(prefault, "madvise", recorded)
    for asked, expected in ((None, prefault.WRITE_THREADS_PER_FILE), (1, 1)):
        threads.clear()
        segment = SharedSegment.create(name, 64 * MIB, reserve=False)
        try:
            assert prefault.populate_write_range(segment.address, 64 * MIB, threads=asked)
        finally:
            segment.close()
            SharedSegment.unlink_name(name)
        assert len(threads) == min(expected, os.cpu_count() or 1), (asked, len(threads))
