"""Segments whose pages are reserved range by range (``reserve=False`` + ``reserve_range``): a creator that frees
its private copy while it fills the segment holds one copy, not two."""

from __future__ import annotations

import os

import pytest
import torch

from flextensor.shm.segment import SharedSegment

MIB = 1 << 20


@pytest.fixture
def seg_name(namespace):
    name = f"/{namespace}.seg"
    yield name
    SharedSegment.unlink_name(name)


def _allocated(name: str) -> int:
    return os.stat(f"/dev/shm{name}").st_blocks * 512


def test_pages_come_only_with_each_reserved_range(seg_name):
    seg = SharedSegment.create(seg_name, 8 * MIB, reserve=False)
    try:
        assert seg.reserved is False and seg.size == 8 * MIB
        assert _allocated(seg_name) == 0
        seg.reserve_range(2 * MIB + 100, MIB)  # rounded out to whole pages
        assert MIB <= _allocated(seg_name) <= MIB + 2 * 4096
        view = seg.tensor(torch.uint8, (MIB,), offset=2 * MIB + 100)
        view.fill_(7)
        assert int(view.sum()) == 7 * MIB
        assert _allocated(seg_name) <= MIB + 2 * 4096
        with pytest.raises(ValueError, match="not inside segment"):
            seg.reserve_range(8 * MIB - 10, 20)
        del view
    finally:
        seg.close()


def test_a_segment_reserved_whole_ignores_reserve_range(seg_name):
    seg = SharedSegment.create(seg_name, 4 * MIB)
    try:
        assert seg.reserved is True and _allocated(seg_name) == 4 * MIB
        seg.reserve_range(0, MIB)
        assert _allocated(seg_name) == 4 * MIB
    finally:
        seg.close()
