"""The benchmarks' page-cache helpers (bench/page_cache.py): ``resident_bytes`` reports what is cached, page by
page, and ``evict`` drops a file from the cache wherever the file system allows it (tmpfs does not)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import page_cache  # noqa: E402

SIZE = 64 * mmap.PAGESIZE


def _file(tmp_path: Path) -> str:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(SIZE))
    return str(path)


def test_a_file_just_read_is_all_resident(tmp_path: Path) -> None:
    path = _file(tmp_path)
    assert page_cache.make_resident([path]) == SIZE
    assert page_cache.resident_bytes([path, path]) == 2 * SIZE


def test_evict_drops_the_file_unless_the_page_cache_is_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path)
    page_cache.evict([path])
    if page_cache.filesystem_type(path) == "tmpfs":  # the pages are the file's only copy: they stay
        assert page_cache.resident_bytes([path]) == SIZE
        return
    assert page_cache.resident_bytes([path]) == 0
    with open(path, "rb", buffering=0) as f:  # read one page in the middle: that page, and no readahead before it
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(f.fileno(), mmap.PAGESIZE, SIZE // 2)
    resident = page_cache.resident_bytes([path])
    assert mmap.PAGESIZE <= resident < SIZE


def test_filesystem_type_names_the_mount_holding_the_path(tmp_path: Path) -> None:
    assert page_cache.filesystem_type("/proc/self") == "proc"
    assert page_cache.filesystem_type(tmp_path) not in ("", "unknown")
