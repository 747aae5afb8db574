"""A private tensor copied into its shared place on several threads (flextensor.runtime.span_copy): every byte,
pieces reported in order and only once copied, the source's pages given back, errors raised with nothing still
copying."""

from __future__ import annotations

import mmap
import time

import pytest
import torch
from torch import nn

from flextensor.runtime.source_pages import SourcePages, releasable
from flextensor.runtime.span_copy import COPY_SPAN, PIECES_IN_FLIGHT, SpanCopier

MIB = 1 << 20


def _pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + piece, nbytes)) for lo in range(0, nbytes, piece)]


def test_every_byte_is_copied_and_pieces_are_reported_in_order_once_copied() -> None:
    nbytes = 37 * MIB + 4321  # pieces and spans that do not divide it
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    into = torch.zeros(nbytes, dtype=torch.uint8)
    pieces = _pieces(nbytes, 6 * MIB + 17)
    events: list[tuple[str, int]] = []

    def after(end: int) -> None:
        # everything up to this piece's end is copied when it is reported
        assert torch.equal(into[:end], source[:end])
        events.append(("after", end))

    with SpanCopier(threads=4) as copier:
        copier.copy(into.data_ptr(), source.data_ptr(), pieces, release=None,
                    before=lambda end: events.append(("before", end)), after=after)
    assert torch.equal(into, source)
    ends = [hi for _lo, hi in pieces]
    assert [e for kind, e in events if kind == "before"] == ends
    assert [e for kind, e in events if kind == "after"] == ends
    # a piece is started only once at most PIECES_IN_FLIGHT earlier pieces are unreported
    for index, end in enumerate(ends):
        started = events.index(("before", end))
        reported = sum(1 for kind, _e in events[:started] if kind == "after")
        assert index - reported <= PIECES_IN_FLIGHT


def test_the_sources_pages_go_back_and_through_counts_each_byte_once() -> None:
    nbytes = 24 * MIB
    weight = nn.Parameter(torch.full((nbytes // 4,), 3.0), requires_grad=False)
    assert releasable(weight)
    pages = SourcePages(weight)
    into = torch.zeros(nbytes // 4)
    with SpanCopier(threads=3) as copier:
        copier.copy(into.data_ptr(), weight.data_ptr(), _pieces(nbytes, 5 * MIB + 100), release=pages,
                    before=lambda end: None, after=pages.through)
    assert into.eq(3.0).all()
    assert nbytes - mmap.PAGESIZE <= pages.released_bytes <= nbytes
    assert weight.detach()[MIB:nbytes // 4 - MIB].eq(0).all()  # given back: the pages read zeros now


def test_an_error_before_a_piece_is_raised_after_the_pieces_in_flight_end() -> None:
    nbytes = 16 * MIB
    source = torch.ones(nbytes, dtype=torch.uint8)
    into = torch.zeros(nbytes, dtype=torch.uint8)
    reported: list[int] = []

    def before(end: int) -> None:
        if end > 8 * MIB:
            raise MemoryError("no room for the third piece")

    with SpanCopier(threads=2) as copier:
        with pytest.raises(MemoryError, match="third piece"):
            copier.copy(into.data_ptr(), source.data_ptr(), _pieces(nbytes, 4 * MIB), release=None,
                        before=before, after=reported.append)
        # nothing copies once the error is out: the bytes stay as they are, and none past the pieces started
        snapshot = into.clone()
        time.sleep(0.05)
        assert torch.equal(into, snapshot) and into[8 * MIB:].eq(0).all()
        assert reported == []


class _FailingRelease(SourcePages):
    def release_inside(self, lo: int, hi: int) -> None:
        if lo >= COPY_SPAN:
            raise OSError("the span's give-back failed")


def test_an_error_in_a_span_is_raised_once_every_span_of_its_piece_ended() -> None:
    nbytes = 4 * COPY_SPAN
    weight = nn.Parameter(torch.ones(nbytes // 4), requires_grad=False)
    into = torch.zeros(nbytes // 4)
    reported: list[int] = []
    with SpanCopier(threads=4) as copier:
        with pytest.raises(OSError, match="give-back failed"):
            copier.copy(into.data_ptr(), weight.data_ptr(), [(0, nbytes)], release=_FailingRelease(weight),
                        before=lambda end: None, after=reported.append)
    assert into.eq(1).all()  # every span of the piece ran to its end
    assert reported == []  # the failed piece is never reported written
