"""Pieces of private tensors copied on a pool of threads (flextensor.runtime.piece_copy): every byte where it belongs,
batches reported in order and only once copied, the sources' pages given back and counted, errors raised with
nothing left copying."""

from __future__ import annotations

import mmap
import threading

import pytest
import torch
from torch import nn

from flextensor.runtime.piece_copy import CopyPool, PieceCopier
from flextensor.runtime.source_pages import SourcePages, releasable

MIB = 1 << 20


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + piece, nbytes)) for lo in range(0, nbytes, piece)]


def test_every_byte_lands_in_place_and_batches_are_reported_in_order() -> None:
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (3 * MIB + 17, 5 * MIB, 4099, 1)]
    targets = [torch.zeros_like(s) for s in sources]
    reported: list[tuple[int, bool]] = []
    with CopyPool(3) as pool, PieceCopier(pool) as copier:
        for k, (source, target) in enumerate(zip(sources, targets)):
            for lo, hi in _pieces(source.numel(), MIB + 3):
                copier.copy(target.data_ptr() + lo, source.data_ptr() + lo, hi - lo)
            copier.end_batch(lambda k=k, s=source, t=target: reported.append((k, torch.equal(s, t))))
        copier.drain()
    assert reported == [(0, True), (1, True), (2, True), (3, True)]
    assert copier.released_bytes == 0


def test_closed_batches_stay_open_up_to_a_bound_in_bytes_beyond_the_newest() -> None:
    reported: list[int] = []
    source = torch.arange(MIB, dtype=torch.uint8)
    target = torch.zeros_like(source)
    with CopyPool(2) as pool, PieceCopier(pool, open_bytes=2 * MIB) as copier:
        for k in range(6):
            copier.copy(target.data_ptr(), source.data_ptr(), MIB)
            copier.end_batch(lambda k=k: reported.append(k))
            assert reported == list(range(max(0, k - 2)))  # at most 2 MiB open besides the newest batch
        copier.drain()
    assert reported == list(range(6))


def test_a_cancelled_drain_reports_no_further_batch_and_close_waits_for_what_runs() -> None:
    reported: list[int] = []
    source = torch.arange(MIB, dtype=torch.uint8)
    target = torch.zeros_like(source)
    pool = CopyPool(2)
    copier = PieceCopier(pool)
    for k in range(4):
        copier.copy(target.data_ptr(), source.data_ptr(), MIB)
        copier.end_batch(lambda k=k: reported.append(k))
    assert copier.drain(cancelled=lambda: len(reported) == 2) is False
    copier.close()
    pool.close()
    assert reported == [0, 1]
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]


def test_two_fills_share_one_pool_and_closing_one_leaves_the_pool_to_the_other() -> None:
    sources = [torch.randint(0, 255, (4 * MIB,), dtype=torch.uint8) for _ in range(2)]
    targets = [torch.zeros_like(s) for s in sources]
    with CopyPool(2) as pool:
        first, second = PieceCopier(pool), PieceCopier(pool)
        for copier, source, target in zip((first, second), sources, targets):
            for lo, hi in _pieces(source.numel(), MIB):
                copier.copy(target.data_ptr() + lo, source.data_ptr() + lo, hi - lo)
            copier.end_batch(lambda: None)
        assert second.drain() and torch.equal(sources[1], targets[1])
        first.close()  # the other fill's pieces not started yet are dropped; the pool goes on
        assert pool.threads == 2
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]


def test_the_sources_whole_pages_inside_each_piece_are_given_back_and_counted() -> None:
    page = mmap.PAGESIZE
    weight = nn.Parameter(torch.arange(8 * MIB // 4, dtype=torch.float32), requires_grad=False)
    assert releasable(weight)
    expected = weight.detach().clone()
    release = SourcePages(weight)
    target = torch.zeros_like(expected)
    address, nbytes = weight.data_ptr(), weight.numel() * 4
    pieces = _pieces(nbytes, MIB + 100)  # edges inside pages: those pages stay until the tensor is freed
    with CopyPool(4) as pool, PieceCopier(pool) as copier:
        for lo, hi in pieces:
            copier.copy(target.data_ptr() + lo, address + lo, hi - lo, release=release, offset=lo)
        copier.end_batch(lambda: None)
        copier.drain()
    inside = sum(max(0, (address + hi) // page * page - -(-(address + lo) // page) * page) for lo, hi in pieces)
    assert copier.released_bytes == inside > 0
    assert torch.equal(target, expected)
    zeros = int((weight.detach() == 0).sum()) * 4  # the pages given back read zeros; element 0 was zero already
    assert zeros in (inside, inside + 4)


def test_a_failed_piece_is_raised_once_nothing_copies_and_later_batches_are_not_reported() -> None:
    class Failing:
        def release_inside(self, lo: int, hi: int) -> int:
            raise OSError(12, "refused")

    source = torch.arange(2 * MIB, dtype=torch.uint8)
    target = torch.zeros_like(source)
    reported: list[int] = []
    pool = CopyPool(2)
    copier = PieceCopier(pool)
    copier.copy(target.data_ptr(), source.data_ptr(), MIB, release=Failing(), offset=0)  # type: ignore[arg-type]
    copier.end_batch(lambda: reported.append(0))
    copier.copy(target.data_ptr() + MIB, source.data_ptr() + MIB, MIB)
    copier.end_batch(lambda: reported.append(1))
    with pytest.raises(OSError, match="refused"):
        copier.drain()
    copier.close()
    copier.close()  # idempotent
    pool.close()
    assert reported == []
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-piece-copy")]
