"""Pieces of private tensors written into shared segments on a pool of threads (flextensor.runtime.piece_copy):
every byte where it belongs, batches reported in order and only once written, the sources' pages given back and
counted, errors raised with nothing left writing, every file it opened closed."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, Iterator

import pytest
import torch
from torch import nn

from flextensor.runtime.piece_copy import CopyPool, PieceCopier
from flextensor.runtime.source_pages import SourcePages, releasable
from flextensor.shm.segment import SharedSegment

MIB = 1 << 20


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + piece, nbytes)) for lo in range(0, nbytes, piece)]


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def segments(namespace: str) -> Iterator[Callable[[int], SharedSegment]]:
    """Make segments of a given size (reserved whole, zeroed); each is closed and unlinked after the test."""
    made: list[SharedSegment] = []

    def make(size: int) -> SharedSegment:
        made.append(SharedSegment.create(f"/{namespace}.p{len(made)}", size))
        return made[-1]

    yield make
    for segment in made:
        segment.close()
        SharedSegment.unlink_name(segment.name)


def _bytes(segment: SharedSegment, at: int, nbytes: int) -> torch.Tensor:
    return segment.tensor(torch.uint8, (nbytes,), offset=at)


def test_every_byte_lands_in_place_and_batches_are_reported_in_order(segments) -> None:
    sizes = (3 * MIB + 17, 5 * MIB, 4099, 1)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    parts = [segments(9 * MIB), segments(9 * MIB)]  # the batches alternate between two files, at odd offsets
    places = [(parts[k % 2], k // 2 * 6 * MIB + 5) for k in range(len(sources))]
    reported: list[tuple[int, bool]] = []
    before = _open_fds()
    with CopyPool(3) as pool, PieceCopier(pool) as copier:
        for k, (source, (segment, at)) in enumerate(zip(sources, places)):
            for lo, hi in _pieces(source.numel(), MIB + 3):
                copier.write(segment, at + lo, source.data_ptr() + lo, hi - lo)
            copier.end_batch(lambda k=k, s=source, g=segment, a=at: reported.append(
                (k, torch.equal(s, _bytes(g, a, s.numel())))))
        copier.drain()
        assert len(_open_fds() - before) == 2  # one descriptor per file, however many pieces
    assert _open_fds() == before
    assert reported == [(0, True), (1, True), (2, True), (3, True)]
    assert copier.released_bytes == 0
    assert int(_bytes(parts[0], 0, 5).count_nonzero()) == 0  # nothing written outside the places


def test_closed_batches_stay_open_up_to_a_bound_in_bytes_beyond_the_newest(segments) -> None:
    reported: list[int] = []
    source = torch.arange(MIB, dtype=torch.uint8)
    segment = segments(MIB)
    with CopyPool(2) as pool, PieceCopier(pool, open_bytes=2 * MIB) as copier:
        for k in range(6):
            copier.write(segment, 0, source.data_ptr(), MIB)
            copier.end_batch(lambda k=k: reported.append(k))
            assert reported == list(range(max(0, k - 2)))  # at most 2 MiB open besides the newest batch
        copier.drain()
    assert reported == list(range(6))


def test_a_cancelled_drain_reports_no_further_batch_and_close_waits_for_what_runs(segments) -> None:
    reported: list[int] = []
    source = torch.arange(MIB, dtype=torch.uint8)
    segment = segments(MIB)
    before = _open_fds()
    pool = CopyPool(2)
    copier = PieceCopier(pool)
    for k in range(4):
        copier.write(segment, 0, source.data_ptr(), MIB)
        copier.end_batch(lambda k=k: reported.append(k))
    assert copier.drain(cancelled=lambda: len(reported) == 2) is False
    copier.close()
    pool.close()
    assert reported == [0, 1]
    assert _open_fds() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]


def test_two_fills_share_one_pool_and_closing_one_leaves_the_pool_to_the_other(segments) -> None:
    sources = [torch.randint(0, 255, (4 * MIB,), dtype=torch.uint8) for _ in range(2)]
    targets = [segments(4 * MIB) for _ in sources]
    with CopyPool(2) as pool:
        first, second = PieceCopier(pool), PieceCopier(pool)
        for copier, source, target in zip((first, second), sources, targets):
            for lo, hi in _pieces(source.numel(), MIB):
                copier.write(target, lo, source.data_ptr() + lo, hi - lo)
            copier.end_batch(lambda: None)
        assert second.drain() and torch.equal(sources[1], _bytes(targets[1], 0, 4 * MIB))
        first.close()  # the other fill's pieces not started yet are dropped; the pool goes on
        assert pool.threads == 2
        second.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]


def test_a_segment_whose_name_was_removed_is_refused_at_its_first_piece(segments) -> None:
    """The file is opened again by name: a name gone (or naming another file) is an error naming the segment,
    before anything is queued, and the copier still closes cleanly."""
    segment = segments(MIB)
    SharedSegment.unlink_name(segment.name)
    source = torch.arange(MIB, dtype=torch.uint8)
    before = _open_fds()
    with CopyPool(2) as pool, PieceCopier(pool) as copier:
        with pytest.raises(FileNotFoundError, match=segment.name):
            copier.write(segment, 0, source.data_ptr(), MIB)
        copier.end_batch(lambda: None)
        assert copier.drain()
    assert _open_fds() == before


def test_the_sources_whole_pages_inside_each_piece_are_given_back_and_counted(segments) -> None:
    page = mmap.PAGESIZE
    weight = nn.Parameter(torch.arange(8 * MIB // 4, dtype=torch.float32), requires_grad=False)
    assert releasable(weight)
    expected = weight.detach().clone()
    release = SourcePages(weight)
    address, nbytes = weight.data_ptr(), weight.numel() * 4
    target = segments(nbytes)
    pieces = _pieces(nbytes, MIB + 100)  # edges inside pages: those pages stay until the tensor is freed
    with CopyPool(4) as pool, PieceCopier(pool) as copier:
        for lo, hi in pieces:
            copier.write(target, lo, address + lo, hi - lo, release=release, offset=lo)
        copier.end_batch(lambda: None)
        copier.drain()
    inside = sum(max(0, (address + hi) // page * page - -(-(address + lo) // page) * page) for lo, hi in pieces)
    assert copier.released_bytes == inside > 0
    assert torch.equal(target.tensor(torch.float32, (nbytes // 4,)), expected)
    zeros = int((weight.detach() == 0).sum()) * 4  # the pages given back read zeros; element 0 was zero already
    assert zeros in (inside, inside + 4)


def test_a_failed_piece_is_raised_once_nothing_copies_and_later_batches_are_not_reported(segments) -> None:
    class Failing:
        def release_inside(self, lo: int, hi: int) -> int:
            raise OSError(12, "refused")

    source = torch.arange(2 * MIB, dtype=torch.uint8)
    target = segments(2 * MIB)
    reported: list[int] = []
    before = _open_fds()
    pool = CopyPool(2)
    copier = PieceCopier(pool)
    copier.write(target, 0, source.data_ptr(), MIB, release=Failing(), offset=0)  # type: ignore[arg-type]
    copier.end_batch(lambda: reported.append(0))
    copier.write(target, MIB, source.data_ptr() + MIB, MIB)
    copier.end_batch(lambda: reported.append(1))
    with pytest.raises(OSError, match="refused"):
        copier.drain()
    copier.close()
    copier.close()  # idempotent
    pool.close()
    assert reported == []
    assert _open_fds() == before
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]


def test_threads_spread_over_lanes_with_at_most_so_many_writers_on_one() -> None:
    """A free thread takes the oldest piece whose file has room: one lane's queue never holds every thread while
    another lane waits, and no lane ever has more writers than allowed."""
    lock = threading.Lock()
    busy: dict[str, int] = {"a": 0, "b": 0}
    most = {"a": 0, "b": 0, "both": 0}
    order: list[str] = []

    def piece(lane: str) -> int:
        with lock:
            busy[lane] += 1
            most[lane] = max(most[lane], busy[lane])
            most["both"] = max(most["both"], busy["a"] + busy["b"])
            order.append(lane)
        threading.Event().wait(0.02)
        with lock:
            busy[lane] -= 1
        return 0

    with CopyPool(4, lane_writers=1) as pool:
        futures = [pool.submit("a", piece, "a") for _ in range(6)] + [pool.submit("b", piece, "b") for _ in range(6)]
        assert [f.result() for f in futures] == [0] * 12
    assert most["a"] == most["b"] == 1  # never two writers on one lane, though 4 threads were free
    assert most["both"] == 2 and "b" in order[:2]  # lane b did not wait for lane a's queue to drain
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]


def test_a_closed_pool_refuses_work_and_its_queue_ran_first() -> None:
    done: list[int] = []
    pool = CopyPool(2)
    futures = [pool.submit(k % 3, lambda k=k: done.append(k) or k) for k in range(9)]
    pool.close()
    pool.close()  # idempotent
    assert sorted(done) == list(range(9)) and [f.result() for f in futures] == list(range(9))
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(0, lambda: 0)


def test_a_close_interrupted_while_it_waits_leaves_the_files_open_until_a_later_close_has_waited(
        segments, monkeypatch) -> None:
    """An interrupt in close()'s wait must not let the next close() shut a file a piece is still writing: its
    descriptor number could by then name another file, which the piece would write into."""
    import flextensor.runtime.piece_copy as piece_copy_mod

    segment = segments(MIB)
    source = torch.arange(MIB, dtype=torch.uint8)
    running, finish = threading.Event(), threading.Event()

    class Slow:
        def release_inside(self, lo: int, hi: int) -> int:
            running.set()
            finish.wait(10)
            return 0

    before = _open_fds()
    real_wait = piece_copy_mod.wait
    interrupts = iter([KeyboardInterrupt()])

    def interrupted_wait(futures):
        error = next(interrupts, None)
        if error is not None:
            raise error
        return real_wait(futures)

    monkeypatch.setattr(piece_copy_mod, "wait", interrupted_wait)
    with CopyPool(2) as pool:
        copier = PieceCopier(pool)
        copier.write(segment, 0, source.data_ptr(), MIB, release=Slow(), offset=0)  # type: ignore[arg-type]
        copier.end_batch(lambda: None)
        assert running.wait(10)
        with pytest.raises(KeyboardInterrupt):
            copier.close()
        assert len(_open_fds() - before) == 1  # the piece still runs: its file stays open
        threading.Timer(0.1, finish.set).start()
        copier.close()  # waits for the piece, then closes the file
        assert finish.is_set() and _open_fds() == before
    assert torch.equal(_bytes(segment, 0, MIB), source)
