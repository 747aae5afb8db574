"""PopulateAhead: a segment's ranges allocated on a thread, in order, no further ahead of the writer than the
window; allocation errors reach the writer; the bytes written through it are the bytes read back."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from flextensor.shm.errors import ShmSpaceError
from flextensor.shm.populate_ahead import PopulateAhead
from flextensor.shm.segment import SharedSegment

MIB = 1 << 20


class RecordingSegment:
    """Stands in for a segment created with reserve=False: records which range was allocated, in order."""

    reserved = False

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[int] = []
        self.fail_at = fail_at
        self.changed = threading.Condition()

    def reserve_range(self, offset: int, nbytes: int) -> None:
        if offset // MIB == self.fail_at:
            raise ShmSpaceError("no space in /dev/shm for shared-memory segment '/x'", segment="/x", wanted=nbytes,
                                free=0)
        with self.changed:
            self.calls.append(offset // MIB)
            self.changed.notify_all()

    def settled(self, count: int) -> list[int]:
        """The calls once ``count`` were made (fails after 10 s), then after a moment for any extra one."""
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= count, 10), self.calls
        time.sleep(0.05)
        return list(self.calls)


def _ranges(n: int) -> list[tuple[int, int]]:
    return [(i * MIB, MIB) for i in range(n)]


def test_the_thread_stays_within_the_window_beyond_the_range_being_written():
    segment = RecordingSegment()
    ahead = PopulateAhead(segment, _ranges(8), window=3 * MIB).start()
    try:
        ahead.wait(0)
        assert segment.settled(4) == [0, 1, 2, 3]  # range 0 (being written) and 3 MiB beyond it, no more
        ahead.done(0)
        assert segment.settled(5) == [0, 1, 2, 3, 4]
        for i in range(1, 8):
            ahead.wait(i)
            ahead.done(i)
        assert segment.calls == list(range(8))
    finally:
        ahead.close()


def test_a_window_smaller_than_a_range_allocates_each_range_only_when_it_is_written():
    segment = RecordingSegment()
    ahead = PopulateAhead(segment, _ranges(4), window=MIB // 2).start()
    try:
        for i in range(4):
            ahead.wait(i)
            assert segment.settled(i + 1) == list(range(i + 1))
            ahead.done(i)
    finally:
        ahead.close()


def test_an_allocation_error_reaches_the_writer_at_that_range():
    segment = RecordingSegment(fail_at=2)
    ahead = PopulateAhead(segment, _ranges(4), window=8 * MIB).start()
    try:
        ahead.wait(0)
        ahead.done(0)
        ahead.wait(1)
        ahead.done(1)
        with pytest.raises(ShmSpaceError, match="no space"):
            ahead.wait(2)
    finally:
        ahead.close()
    with pytest.raises(ValueError, match="out of order"):
        ahead.done(3)


def test_close_stops_the_thread_and_a_later_wait_says_so():
    segment = RecordingSegment()
    ahead = PopulateAhead(segment, _ranges(4), window=MIB // 2).start()
    ahead.wait(0)
    ahead.close()
    with pytest.raises(RuntimeError, match="closed before range 2"):
        ahead.wait(2)


def test_bytes_written_through_it_are_read_back_and_pages_come_only_as_allowed(namespace):
    name = f"/{namespace}.ahead"
    n, window = 8, 2 * MIB
    segment = SharedSegment.create(name, n * MIB, reserve=False)
    ahead = PopulateAhead(segment, _ranges(n), window=window).start()
    try:
        expected = torch.arange(n * MIB, dtype=torch.int64).remainder(251).to(torch.uint8)
        for i in range(n):
            ahead.wait(i)
            allocated = os.stat(f"/dev/shm{name}").st_blocks * 512
            assert allocated <= (i + 1) * MIB + window  # never more than the window beyond the range written
            segment.tensor(torch.uint8, (MIB,), offset=i * MIB).copy_(expected[i * MIB:(i + 1) * MIB])
            ahead.done(i)
        assert torch.equal(segment.tensor(torch.uint8, (n * MIB,)), expected)
        assert ahead.error is None
    finally:
        ahead.close()
        segment.close()
        SharedSegment.unlink_name(name)


def test_a_caller_that_writes_several_ranges_before_done_is_never_held_by_the_window():
    """Checkpoint reads run in batches: ranges are written, then marked done together. Waiting for the next range
    allocates it whatever the window, so the batch cannot wait for its own completion."""
    segment = RecordingSegment()
    ahead = PopulateAhead(segment, _ranges(6), window=MIB // 2).start()
    try:
        for i in range(4):
            ahead.wait(i)  # none done yet: beyond range 0 the window allows nothing, the waits do
        assert segment.settled(4) == [0, 1, 2, 3]
        for i in range(4):
            ahead.done(i)
        ahead.wait(5)
        assert segment.calls == list(range(6))
    finally:
        ahead.close()
