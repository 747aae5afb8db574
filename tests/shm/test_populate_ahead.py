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

    def reserve_range(self, offset: int, nbytes: int, *, threads: int | None = None) -> None:
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


def _ranges(segment, n: int) -> list[tuple[object, int, int]]:
    return [(segment, i * MIB, MIB) for i in range(n)]


def test_the_thread_stays_within_the_window_beyond_the_range_being_written():
    segment = RecordingSegment()
    ahead = PopulateAhead(_ranges(segment, 8), window=3 * MIB).start()
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
    ahead = PopulateAhead(_ranges(segment, 4), window=MIB // 2).start()
    try:
        for i in range(4):
            ahead.wait(i)
            assert segment.settled(i + 1) == list(range(i + 1))
            ahead.done(i)
    finally:
        ahead.close()


def test_an_allocation_error_reaches_the_writer_at_that_range():
    segment = RecordingSegment(fail_at=2)
    ahead = PopulateAhead(_ranges(segment, 4), window=8 * MIB).start()
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
    ahead = PopulateAhead(_ranges(segment, 4), window=MIB // 2).start()
    ahead.wait(0)
    ahead.close()
    with pytest.raises(RuntimeError, match="closed before range 2"):
        ahead.wait(2)


def test_bytes_written_through_it_are_read_back_and_pages_come_only_as_allowed(namespace):
    name = f"/{namespace}.ahead"
    n, window = 8, 2 * MIB
    segment = SharedSegment.create(name, n * MIB, reserve=False)
    ahead = PopulateAhead(_ranges(segment, n), window=window).start()
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
    ahead = PopulateAhead(_ranges(segment, 6), window=MIB // 2).start()
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


class MeetingSegment(RecordingSegment):
    """A segment whose allocations wait until ``parties`` of them are in flight at once (fails after 10 s)."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.barrier = barrier
        self.threads: list[int | None] = []

    def reserve_range(self, offset: int, nbytes: int, *, threads: int | None = None) -> None:
        self.threads.append(threads)
        self.barrier.wait(timeout=10)
        super().reserve_range(offset, nbytes)


def test_several_workers_allocate_ranges_of_different_segments_at_once_within_the_window():
    """An arena's parts hold consecutive blocks: with a worker per part, the next ranges are allocated together
    (each from its share of the threads), and still never beyond the window."""
    barrier = threading.Barrier(2)
    parts = [MeetingSegment(barrier), MeetingSegment(barrier)]
    ranges = [(parts[i % 2], i * MIB, MIB) for i in range(6)]
    ahead = PopulateAhead(ranges, window=MIB, workers=2, threads=3).start()
    try:
        ahead.wait(1)  # ranges 0 and 1 meet at the barrier: both were in flight at once
        assert parts[0].settled(1) == [0] and parts[1].settled(1) == [1]
        for i in range(6):
            ahead.wait(i)
            ahead.done(i)
        assert parts[0].calls == [0, 2, 4] and parts[1].calls == [1, 3, 5]
        assert parts[0].threads == parts[1].threads == [3, 3, 3]
    finally:
        ahead.close()


def test_with_several_workers_an_error_stops_them_all_and_reaches_the_writer():
    segment = RecordingSegment(fail_at=1)
    ahead = PopulateAhead(_ranges(segment, 8), window=8 * MIB, workers=3).start()
    try:
        ahead.wait(0)
        with pytest.raises(ShmSpaceError, match="no space"):
            ahead.wait(1)
        with pytest.raises(ShmSpaceError):
            ahead.wait(7)
    finally:
        ahead.close()
    assert 1 not in segment.calls and len(segment.calls) < 8


def test_a_cursor_waits_for_the_pieces_under_the_bytes_written_and_frees_the_window_as_it_goes():
    """A run of 1 MiB pieces (one record cut by cut_into_pieces) written 1.5 MiB at a time: the writer waits only
    for the pieces its bytes reach, and each piece it finished leaves the window, so the thread moves on while the
    rest of the run is still being written."""
    from flextensor.shm.populate_ahead import PieceCursor, cut_into_pieces

    segment = RecordingSegment()
    bounds = cut_into_pieces(6 * MIB, MIB)
    assert bounds == [(i * MIB, (i + 1) * MIB) for i in range(6)] and cut_into_pieces(0, MIB) == [(0, 0)]
    ahead = PopulateAhead([(segment, lo, hi - lo) for lo, hi in bounds], window=MIB).start()
    try:
        cursor = PieceCursor(ahead, 0, bounds)
        assert cursor.spans(MIB // 2, 2 * MIB + 1) == [(MIB // 2, MIB), (MIB, 2 * MIB), (2 * MIB, 2 * MIB + 1)]
        cursor.wait_through(MIB + MIB // 2)  # pieces 0 and 1
        assert segment.settled(2) == [0, 1]  # piece 1 is within the window beyond piece 0: nothing more
        cursor.written_through(MIB + MIB // 2)  # piece 0 is written, piece 1 only half
        assert segment.settled(3) == [0, 1, 2]
        cursor.wait_through(6 * MIB)
        cursor.written_through(6 * MIB)
        assert segment.settled(6) == list(range(6))
    finally:
        ahead.close()
