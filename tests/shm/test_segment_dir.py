"""Where segments live and what pages they get (``flextensor.shm.segment_dir``), on huge-page mounts and here.

The mounted cases run in a private mount namespace (``tests/helpers/huge_mount.py``): a tmpfs mounted with
``huge=always``, and a hugetlbfs where this host can reserve huge pages (skipped, naming why, elsewhere).
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest

from flextensor.shm import segment_dir
from flextensor.shm.blocks import ARENA_ALIGN, arena_layout
from flextensor.shm.journal import create_journal, read_journal, remove_journal
from flextensor.shm.names import manager_namespace
from flextensor.shm.segment import SharedSegment

from tests.helpers.huge_mount import reserved_huge_pages, run_mounted

HUGE = 2 << 20


@pytest.fixture(autouse=True)
def fresh_bindings(monkeypatch: pytest.MonkeyPatch):
    """Each test starts from no binding and no default set in this process (both are process-wide)."""
    monkeypatch.setattr(segment_dir, "_bound", {})
    monkeypatch.setattr(segment_dir, "_default", None)


# ------------------------------------------------------------------------------------------ in this process
def test_dev_shm_is_the_default_and_ft_shm_dir_moves_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert segment_dir.default_directory() == "/dev/shm"
    assert segment_dir.segment_path("/ftx-0123456789abcdef.g1.sd") == "/dev/shm/ftx-0123456789abcdef.g1.sd"
    monkeypatch.setenv("FT_SHM_DIR", str(tmp_path) + "/")
    assert segment_dir.default_directory() == str(tmp_path)
    monkeypatch.setenv("FT_SHM_DIR", "relative/dir")
    with pytest.raises(ValueError, match="FT_SHM_DIR must be an absolute directory path"):
        segment_dir.default_directory()
    monkeypatch.setenv("FT_SHM_DIR", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="is not an existing directory: mount a tmpfs"):
        segment_dir.default_directory()


def test_a_namespace_binding_wins_and_the_longest_namespace_decides(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    segment_dir.bind_namespace("ns", tmp_path / "a")
    segment_dir.bind_namespace("ns.x", tmp_path / "b")
    assert segment_dir.segment_path("/ns.g1.sd") == f"{tmp_path}/a/ns.g1.sd"
    assert segment_dir.segment_path("/ns.x.g1.sd") == f"{tmp_path}/b/ns.x.g1.sd"
    assert segment_dir.segment_path("/other.g1.sd") == "/dev/shm/other.g1.sd"
    assert segment_dir.namespace_directory("ns") == f"{tmp_path}/a"


def test_dev_shm_segments_are_exactly_what_shm_open_makes(namespace: str) -> None:
    import posix_ipc

    name = f"/{namespace}.g1.sd"
    with SharedSegment.create(name, 12345, mode=0o640) as seg:
        assert seg.size == 12345 and seg.directory == "/dev/shm"
        seg.buffer[:5] = b"hello"
        other = posix_ipc.SharedMemory(name, 0)  # the POSIX name reaches the same file
        try:
            assert os.pread(other.fd, 5, 0) == b"hello" and os.fstat(other.fd).st_size == 12345
        finally:
            other.close_fd()
        assert SharedSegment.mode_of(name) == 0o640
        with pytest.raises(FileExistsError, match=f"already exists \\(/dev/shm{name}\\)"):
            SharedSegment.create(name, 4096)
    assert SharedSegment.unlink_name(name) and not SharedSegment.unlink_name(name)


def test_a_journal_records_the_directory_and_reading_it_binds_the_namespace(tmp_path: Path) -> None:
    ns = manager_namespace("hp", "m")
    huge = tmp_path / "huge"
    huge.mkdir()
    create_journal(ns, 1, shm_dir=str(huge))
    try:
        lines = (Path(os.environ["TMPDIR"]) / f"flextensor-{os.getuid()}" / f"{ns}.journal").read_text()
        assert json.loads(lines.splitlines()[0])["shm_dir"] == str(huge)
        assert segment_dir.namespace_directory(ns) == "/dev/shm"  # nothing read yet
        assert read_journal(ns).header.shm_dir == str(huge)
        assert segment_dir.segment_path(f"/{ns}.g1.sd") == f"{huge}/{ns}.g1.sd"
    finally:
        remove_journal(ns)
    create_journal(ns, 1, shm_dir="/dev/shm")  # the default directory is left out of the line, as before
    try:
        assert "shm_dir" not in (Path(os.environ["TMPDIR"]) / f"flextensor-{os.getuid()}" / f"{ns}.journal").read_text()
        assert read_journal(ns).header.shm_dir == "/dev/shm"
    finally:
        remove_journal(ns)


def test_arena_blocks_start_on_the_alignment_given() -> None:
    sizes = [3 << 20, 5000, 1 << 20]
    assert arena_layout(sizes).offsets == (0, align := 3 << 20, align + 8192)
    layout = arena_layout(sizes, align=HUGE)
    assert layout.offsets == (0, 4 << 20, 6 << 20) and layout.part_sizes == (8 << 20,)
    with pytest.raises(ValueError, match="power of two"):
        arena_layout(sizes, align=3 * ARENA_ALIGN)


def test_page_info_of_dev_shm_and_block_alignment() -> None:
    info = segment_dir.page_info("/dev/shm")
    assert info.fs == "tmpfs" and info.size >= mmap.PAGESIZE
    assert segment_dir.block_alignment("/dev/shm") == min(max(ARENA_ALIGN, info.size), HUGE)
    assert info.describe().endswith("(tmpfs)") or "huge=" in info.describe() or "shmem_enabled" in info.describe()


# ------------------------------------------------------------------------------------------ huge-page mounts
def test_segments_on_a_huge_tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    token = request.node.ft_token
    report = run_mounted("tmpfs", tmp_path / "huge", "segment", token)
    assert (report["fs"], report["source"], report["page_size"]) == ("tmpfs", "huge=always", HUGE)
    assert report["describe"] == "2 MiB pages (tmpfs huge=always)"
    # sized in whole huge pages, and the kernel really mapped them huge
    assert report["size"] == 4 * 2**20 and report["segment_page_size"] == HUGE
    assert report["huge_mapped"] == report["size"]
    # another process sees the same bytes through the same name; pread reads the file
    assert report["reader_sum"] == report["expected_sum"] and report["pread_ok"] and report["mode"] == 0o600
    # a range reserved on huge pages allocates the whole pages around it: [1 MiB + 3, 6 MiB + 3) -> [0, 8 MiB)
    assert report["lazy_allocated"] == 8 * 2**20
    assert report["lazy_huge"] == 8 * 2**20  # and the writer's pages are huge ones, mapped whole
    assert "no space in" in report["space_error"] and str(tmp_path / "huge") in report["space_error"]
    assert "remount,size=" in report["space_error"] and not report["big_left"]
    # reserved ahead of a writer (posix_fallocate on huge pages): a range that no longer fits is a named error
    stage, message = report["late_error"]
    assert stage == "reserve" and "no space in" in message and report["late_removed"] == [True, True]
    # written through its file without a reservation (a creator's copy pool): the write allocates the whole pages
    # it touches ([3, 2 MiB + 8) -> two pages), the bytes read back through the mapping, a write past the room
    # left is a named error, and a range outside the segment is refused before it could grow the file
    written = report["written"]
    assert written["allocated"] == 2 * HUGE and written["same"]
    assert "no space in" in written["full_error"] and str(tmp_path / "huge") in written["full_error"]
    assert "is not inside segment" in written["outside_error"] and written["size_kept"]
    assert written["removed"] == [True, True]
    assert report["removed"] == [True, True]
    assert report["left"] == {"dir": [], "dev_shm": [], "lock_dir": []}


def test_segments_on_hugetlbfs(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    token = request.node.ft_token
    with reserved_huge_pages(16):
        report = run_mounted("hugetlbfs", tmp_path / "huge", "segment", token, size="32M")
    assert (report["fs"], report["page_size"]) == ("hugetlbfs", HUGE)
    assert report["describe"] == "2 MiB pages (hugetlbfs pagesize=2M)"
    # hugetlbfs refuses a size that is not whole pages: the segment is rounded up, and all of it is huge
    assert report["size"] == 4 * 2**20 and report["huge_mapped"] == report["size"]
    assert report["reader_sum"] == report["expected_sum"] and report["pread_ok"]
    assert report["lazy_allocated"] in (0, 8 * 2**20)  # hugetlbfs may count reserved pages in st_blocks or not
    assert "Reserve more huge pages" in report["space_error"] and not report["big_left"]
    stage, message = report["late_error"]  # the mapping reserved the pages: the filler is refused
    assert stage == "filler" and "Reserve more huge pages" in message and report["late_removed"] == [True, False]
    assert report["left"] == {"dir": [], "dev_shm": [], "lock_dir": []}


def test_a_journal_whose_directory_is_another_file_system_here_is_never_reclaimed(tmp_path: Path) -> None:
    """A process that sees another file system at a journal's directory (another mount namespace or container
    sharing the lock directory) cannot see the segments: the sweep leaves the namespace alone, cleanup refuses."""
    import msgspec

    from flextensor.shm.cleanup import cleanup_manager_namespace
    from flextensor.shm.dead_sweep import sweep_dead_namespaces
    from flextensor.shm.errors import ShmDirectoryUnseenError
    from flextensor.shm.header import LIBRARY_VERSION
    from flextensor.shm.journal import JournalHeader
    from flextensor.shm.names import journal_path, lock_directory

    ns = manager_namespace("hp-elsewhere", "m")
    elsewhere = tmp_path / "mounted-elsewhere"
    elsewhere.mkdir()
    lock_directory().mkdir(mode=0o700, exist_ok=True)
    header = JournalHeader(protocol=1, library_version=LIBRARY_VERSION, namespace=ns, generation=1,
                           shm_dir=str(elsewhere), shm_dev=os.stat(elsewhere).st_dev + 1)
    path = journal_path(ns)
    path.write_bytes(msgspec.json.encode(header) + b"\n")
    try:
        sweep = sweep_dead_namespaces()
        assert [(s.namespace, s.reason) for s in sweep.skipped] == [(ns, "elsewhere")] and not sweep.reclaimed
        assert "another file system in this process" in sweep.skipped[0].detail
        with pytest.raises(ShmDirectoryUnseenError, match=f"segments of namespace '{ns}' are in {elsewhere}"):
            cleanup_manager_namespace(ns, timeout=0)
        assert path.exists() and sorted(p.name for p in lock_directory().iterdir()) == [path.name]
    finally:
        path.unlink()


def test_a_large_segment_on_small_pages_is_warned_about_once(namespace: str, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Where this host could give huge pages (THP for tmpfs, free hugetlb pages), a segment of 1 GiB or more on
    4 KiB pages is a WARNING naming the mount option, once per process; nothing is allocated for it here."""
    monkeypatch.setattr(segment_dir, "_warned", False)
    if segment_dir.page_info("/dev/shm").huge:
        pytest.skip("/dev/shm of this host has huge pages already")
    names = [f"/{namespace}.g1.h", f"/{namespace}.g1.h1", f"/{namespace}.g1.sd"]
    try:
        with caplog.at_level("WARNING", logger="flextensor.shm.segment_dir"):
            SharedSegment.create(names[0], segment_dir.HUGE_WARN_BYTES - 4096, reserve=False).close()
            assert caplog.records == []  # below the size warned about
            for name in names[1:]:
                SharedSegment.create(name, segment_dir.HUGE_WARN_BYTES, reserve=False).close()
    finally:
        for name in names:
            SharedSegment.unlink_name(name)
    hint = segment_dir.huge_page_hint()
    if not hint:
        assert caplog.records == []
        return
    (record,) = caplog.records
    assert names[1] in record.getMessage() and "huge=always" in record.getMessage()
    assert "4 KiB pages (tmpfs)" in record.getMessage()


@pytest.mark.cuda
@pytest.mark.parametrize("fs", ["tmpfs", "hugetlbfs"])
def test_blocks_on_huge_pages_register_one_by_one_and_copy_to_the_device(fs: str, tmp_path: Path,
                                                                         request: pytest.FixtureRequest) -> None:
    """A follower registers the arena block by block: on huge pages each block starts on its own 2 MiB page,
    and what reaches the device is what was written."""
    token = request.node.ft_token
    if fs == "hugetlbfs":
        with reserved_huge_pages(8):
            report = run_mounted(fs, tmp_path / "huge", "pin", token, size="16M")
    else:
        report = run_mounted(fs, tmp_path / "huge", "pin", token)
    assert report["offsets"] == [0, 4 << 20, 6 << 20]
    assert report["equal"] == [True, True, True] and report["pinned"]
    assert report["left"] == {"dir": [], "dev_shm": [], "lock_dir": []}
