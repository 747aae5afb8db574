"""SharedSegment on the real /dev/shm: exclusive create, modes, zero-copy views across handles and processes,
bounds/alignment errors, ENOSPC, close with live views, and pinning."""

from __future__ import annotations

import errno
import gc
import os
import stat
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from flextensor.shm.errors import ShmSpaceError
from flextensor.shm.pinning import cudart_available, memlock_limit
from flextensor.shm.segment import SharedSegment
from tests.helpers.forkserver import run_code


@pytest.fixture
def seg_name(namespace):
    """A unique segment name, unlinked after the test whatever happened."""
    name = f"/{namespace}.seg"
    yield name
    SharedSegment.unlink_name(name)


def _mapped_in_self(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(f"/dev/shm{name}" in line for line in f)


def test_create_open_and_exclusive(seg_name):
    seg = SharedSegment.create(seg_name, 10_000)
    try:
        assert (seg.name, seg.size, seg.created, seg.pinned) == (seg_name, 10_000, True, False)
        assert os.stat(f"/dev/shm{seg_name}").st_size == 10_000
        assert bytes(seg.buffer) == bytes(10_000)  # fresh memory is zeroed
        with pytest.raises(FileExistsError, match=seg_name):
            SharedSegment.create(seg_name, 10_000)
        other = SharedSegment.open(seg_name)
        assert (other.size, other.created) == (10_000, False)
        seg.buffer[100:104] = b"abcd"
        assert bytes(other.buffer[100:104]) == b"abcd"
        other.buffer[-1] = 7
        assert seg.buffer[-1] == 7
        other.close()
    finally:
        seg.close()
    # closing does not unlink: data survives for the next opener
    with SharedSegment.open(seg_name, min_size=10_000) as again:
        assert bytes(again.buffer[100:104]) == b"abcd"


def test_open_file_reads_the_mapped_bytes_and_refuses_a_truncated_or_replaced_file(seg_name):
    """The file behind a mapping, opened again for pread: the same bytes; a truncated file is a protocol error
    (its mapping would SIGBUS), a removed or replaced name a FileNotFoundError (the mapping is still good)."""
    from flextensor.shm.errors import ShmProtocolError

    with SharedSegment.create(seg_name, 3 * 4096) as seg:
        seg.buffer[5000:5004] = b"wxyz"
        follower = SharedSegment.open(seg_name)
        fd = follower.open_file()
        try:
            assert os.pread(fd, 4, 5000) == b"wxyz" and os.fstat(fd).st_size == 3 * 4096
            with pytest.raises(OSError):
                os.write(fd, b"x")  # read-only
        finally:
            os.close(fd)
        os.truncate(f"/dev/shm{seg_name}", 4096)
        with pytest.raises(ShmProtocolError, match="truncated"):
            follower.open_file()
        SharedSegment.unlink_name(seg_name)
        with pytest.raises(FileNotFoundError, match="removed"):
            follower.open_file()
        with SharedSegment.create(seg_name, 3 * 4096):
            with pytest.raises(FileNotFoundError, match="another file"):
                follower.open_file()
        follower.close()
        with pytest.raises(ValueError, match="closed"):
            follower.open_file()


def test_default_mode_is_0600(seg_name):
    with SharedSegment.create(seg_name, 4096):
        st = os.stat(f"/dev/shm{seg_name}")
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
        assert SharedSegment.mode_of(seg_name) == 0o600


@pytest.mark.parametrize("mode", [0o640, 0o666, 0o400 | 0o200])
def test_custom_mode_is_exact_despite_umask(seg_name, mode):
    old = os.umask(0o077)
    try:
        with SharedSegment.create(seg_name, 4096, mode=mode):
            assert stat.S_IMODE(os.stat(f"/dev/shm{seg_name}").st_mode) == mode
    finally:
        os.umask(old)


@pytest.mark.parametrize("size", [0, -1, True, 1.5, "10", 1 << 62])
def test_bad_size_is_refused(seg_name, size):
    with pytest.raises(ValueError, match="size"):
        SharedSegment.create(seg_name, size)
    assert not os.path.exists(f"/dev/shm{seg_name}")


@pytest.mark.parametrize("name", ["", "noslash", "/a/b", "/", "/" + "x" * 256, "/nul\x00", None])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError, match="segment name"):
        SharedSegment.create(name, 4096)
    with pytest.raises(ValueError, match="segment name"):
        SharedSegment.open(name)


def test_open_missing_and_too_small(seg_name):
    with pytest.raises(FileNotFoundError, match=seg_name) as info:
        SharedSegment.open(seg_name)
    assert info.value.errno == errno.ENOENT
    with SharedSegment.create(seg_name, 4096):
        with pytest.raises(ValueError, match=rf"{seg_name}.*4096 bytes.*8192"):
            SharedSegment.open(seg_name, min_size=8192)
        with SharedSegment.open(seg_name, min_size=4096, populate=True) as ok:
            assert ok.size == 4096


def test_unlink_name_is_idempotent_and_keeps_mappings(seg_name):
    seg = SharedSegment.create(seg_name, 4096)
    seg.buffer[0] = 42
    assert SharedSegment.unlink_name(seg_name) is True
    assert SharedSegment.unlink_name(seg_name) is False
    assert not os.path.exists(f"/dev/shm{seg_name}")
    assert seg.buffer[0] == 42  # the mapping outlives the name
    seg.close()
    with pytest.raises(FileNotFoundError):
        SharedSegment.open(seg_name)


VIEW_CASES = [
    # dtype, shape, stride (elements), byte offset
    (torch.float32, (3, 5), None, 0),
    (torch.float32, (5, 3), (1, 5), 64),  # transposed (non-contiguous)
    (torch.float16, (7,), (3,), 2),  # every third element, odd-ish offset aligned to 2
    (torch.bfloat16, (2, 3, 4), None, 1026),
    (torch.float64, (4, 4), (8, 2), 4096),  # sparse rows and columns
    (torch.int64, (6,), None, 8),
    (torch.int32, (3, 4), (0, 1), 12),  # broadcast row (stride 0)
    (torch.uint8, (17,), None, 3),
    (torch.int8, (2, 2), (2, 1), 4095),
    (torch.bool, (9,), None, 1),
    (torch.complex64, (2, 3), None, 24),
]


def _pattern(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(1, n + 1, dtype=torch.float64)
    if dtype == torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype).reshape(shape)
    return (base % 100).to(dtype).reshape(shape)


@pytest.mark.parametrize(("dtype", "shape", "stride", "offset"), VIEW_CASES)
def test_zero_copy_views_across_handles(seg_name, dtype, shape, stride, offset):
    with SharedSegment.create(seg_name, 8192) as writer, SharedSegment.open(seg_name) as reader:
        view = writer.tensor(dtype, shape, stride, offset)
        assert view.shape == shape and view.dtype == dtype
        if stride is not None:
            assert view.stride() == stride
        assert view.data_ptr() == writer.address + offset  # zero copy: points into the mapping
        expected = _pattern(dtype, shape)
        if stride is not None and 0 in stride:
            expected = expected[:1].expand(shape)  # a stride-0 view can only hold one row
            view[:1].copy_(expected[:1])
        else:
            view.copy_(expected)
        seen = reader.tensor(dtype, shape, stride, offset)
        assert torch.equal(seen, expected)
        # the bytes really are in the segment at the documented place
        first = expected.reshape(-1)[:1].clone()
        first_bytes = first.view(torch.uint8).numpy().tobytes()
        assert bytes(reader.buffer[offset : offset + len(first_bytes)]) == first_bytes
        del view, seen


def test_views_are_shared_with_another_process(seg_name):
    with SharedSegment.create(seg_name, 1 << 16) as seg:
        seg.tensor(torch.float32, (4, 8), offset=256).copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8))
        seg.tensor(torch.bfloat16, (16,), (2,), offset=4096).copy_(torch.linspace(-1, 1, 16))
        child = textwrap.dedent(
            f"""
            import torch
            from flextensor.shm.segment import SharedSegment
            seg = SharedSegment.open({seg_name!r}, min_size=1 << 16)
            a = seg.tensor(torch.float32, (8, 4), (1, 8), offset=256)   # transposed view of the parent's data
            assert torch.equal(a, torch.arange(32, dtype=torch.float32).reshape(4, 8).t()), a
            b = seg.tensor(torch.bfloat16, (16,), (2,), offset=4096)
            assert torch.equal(b, torch.linspace(-1, 1, 16).to(torch.bfloat16)), b
            seg.tensor(torch.int64, (3,), offset=8192).copy_(torch.tensor([7, -8, 1 << 40]))
            seg.close()
            print("child-ok")
            """
        )
        out = run_code(child, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "child-ok"
        assert seg.tensor(torch.int64, (3,), offset=8192).tolist() == [7, -8, 1 << 40]


def test_bounds_and_alignment_errors(seg_name):
    with SharedSegment.create(seg_name, 4096) as seg:
        assert seg.tensor(torch.float32, (1024,)).numel() == 1024  # exactly the whole segment
        assert seg.tensor(torch.uint8, (1,), offset=4095).numel() == 1  # the last byte
        with pytest.raises(ValueError, match=rf"{seg_name}.*4100.*4096"):
            seg.tensor(torch.float32, (1025,))
        with pytest.raises(ValueError, match="bytes up to"):
            seg.tensor(torch.float32, (2, 2), (1023, 1), offset=0)  # last element at 4096..4100
        with pytest.raises(ValueError, match="bytes up to"):
            seg.tensor(torch.uint8, (2,), offset=4095)
        with pytest.raises(ValueError, match="not aligned.*multiple of 4"):
            seg.tensor(torch.float32, (2,), offset=2)
        with pytest.raises(ValueError, match="not aligned.*multiple of 8"):
            seg.tensor(torch.float64, (2,), offset=12)
        with pytest.raises(ValueError, match="strides must be >= 0"):
            seg.tensor(torch.float32, (2,), (-1,), offset=8)
        with pytest.raises(ValueError, match="different lengths"):
            seg.tensor(torch.float32, (2, 2), (1,))
        with pytest.raises(ValueError, match="sizes must be >= 0"):
            seg.tensor(torch.float32, (-1,))
        with pytest.raises(ValueError, match="offset"):
            seg.tensor(torch.float32, (1,), offset=-4)
        with pytest.raises(ValueError, match="dtype"):
            seg.tensor("float32", (1,))
        with pytest.raises(ValueError, match="shape"):
            seg.tensor(torch.float32, (1.5,))
        with pytest.raises(ValueError, match="shape"):
            seg.tensor(torch.float32, (True,))
        empty = seg.tensor(torch.float32, (0, 3), offset=4096)
        assert empty.shape == (0, 3)
        with pytest.raises(ValueError, match="past the end"):
            seg.tensor(torch.float32, (0,), offset=4100)
        assert seg.tensor(torch.float32, torch.Size([2, 2]), offset=16).shape == (2, 2)


def test_enospc_names_everything_and_leaves_nothing(seg_name):
    st = os.statvfs("/dev/shm")
    if st.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit here")
    free = st.f_bavail * st.f_frsize
    wanted = max(free, st.f_blocks * st.f_frsize) + (1 << 30)  # more than /dev/shm can ever hold: fails at once
    with pytest.raises(ShmSpaceError) as info:
        SharedSegment.create(seg_name, wanted)
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert (err.segment, err.wanted) == (seg_name, wanted)
    assert err.free is not None and abs(err.free - free) < (1 << 30)
    message = str(err)
    assert seg_name in message and str(wanted) in message and "GiB" in message
    assert str(err.free) in message
    assert "--shm-size" in message and "medium: Memory" in message and "remount" in message
    assert not os.path.exists(f"/dev/shm{seg_name}")
    with pytest.raises(FileNotFoundError):
        SharedSegment.open(seg_name)


def test_write_from_writes_inside_the_segment_only_and_names_a_full_file_system(seg_name):
    seg = SharedSegment.create(seg_name, 3 * 4096)
    data = torch.arange(5000, dtype=torch.int64).remainder(251).to(torch.uint8)
    fd = seg.open_file(write=True)
    try:
        seg.write_from(fd, 7, data.data_ptr(), data.numel())
        assert torch.equal(seg.tensor(torch.uint8, (5000,), offset=7), data)  # the mapping sees the write
        with pytest.raises(ValueError, match="is not inside segment"):
            seg.write_from(fd, seg.size - 10, data.data_ptr(), 11)
        assert os.fstat(fd).st_size == seg.size  # refused before it could grow the file
    finally:
        os.close(fd)
    with open("/dev/full", "wb", buffering=0) as full:  # a file system with no room: ENOSPC from every write
        with pytest.raises(ShmSpaceError, match="no space") as info:
            seg.write_from(full.fileno(), 0, data.data_ptr(), 100)
    assert info.value.segment == seg_name
    seg.close()


def test_errors_survive_pickling():
    # errors may cross a process boundary (multiprocessing workers): their attributes must survive
    import pickle

    from flextensor.shm.errors import ShmCreatorFailedError, ShmError, ShmProtocolError

    space = pickle.loads(pickle.dumps(ShmSpaceError("full", segment="/x", wanted=10, free=3)))
    assert (type(space), space.errno, space.segment, space.wanted, space.free) == (ShmSpaceError, errno.ENOSPC,
                                                                                    "/x", 10, 3)
    assert str(space) == f"[Errno {errno.ENOSPC}] full"
    failed = pickle.loads(pickle.dumps(ShmCreatorFailedError("creator failed", "CUDA OOM")))
    assert isinstance(failed, ShmError) and isinstance(failed, RuntimeError)
    assert (str(failed), failed.creator_message) == ("creator failed", "CUDA OOM")
    assert issubclass(ShmProtocolError, ValueError)


def test_close_with_live_views_defers_the_unmap(seg_name):
    seg = SharedSegment.create(seg_name, 8192)
    view = seg.tensor(torch.int32, (4,), offset=64)
    view.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    raw = seg.buffer[0:16]  # a memoryview slice also keeps the mapping alive
    seg.close()  # must not raise
    assert seg.closed
    seg.close()  # idempotent
    assert view.tolist() == [1, 2, 3, 4]  # still mapped: reading is safe
    assert _mapped_in_self(seg_name)
    with pytest.raises(ValueError, match="closed"):
        seg.tensor(torch.int32, (1,))
    with pytest.raises(ValueError, match="closed"):
        _ = seg.buffer
    del view
    gc.collect()
    assert _mapped_in_self(seg_name)  # the slice still holds it
    raw.release()
    del raw
    gc.collect()
    assert not _mapped_in_self(seg_name)  # unmapped once the last view died


def test_close_without_views_unmaps_at_once(seg_name):
    seg = SharedSegment.create(seg_name, 4096)
    assert seg.tensor(torch.float32, (4,)).sum().item() == 0
    assert seg.buffer[0] == 0
    assert _mapped_in_self(seg_name)
    seg.close()
    assert not _mapped_in_self(seg_name)


@pytest.mark.skipif(cudart_available(), reason="checks the CPU-only behaviour")
def test_pin_without_cuda_raises_a_clear_error(seg_name):
    with SharedSegment.create(seg_name, 4096) as seg:
        with pytest.raises(RuntimeError, match="pinning needs CUDA; use pinned_memory=False on CPU hosts"):
            seg.pin()
        assert not seg.pinned
        seg.unpin()  # never pinned: a no-op


def test_memlock_limit_matches_rlimit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert memlock_limit() == (None if soft == resource.RLIM_INFINITY else soft)


@pytest.mark.cuda
def test_pin_registers_the_mapping_in_place(seg_name):
    with SharedSegment.create(seg_name, (1 << 20) + 123) as seg:  # not a page multiple: exact size is pinned
        host = seg.tensor(torch.float32, (1 << 18,))
        host.copy_(torch.arange(1 << 18, dtype=torch.float32))
        assert not host.is_pinned()
        seg.pin()
        seg.pin()  # idempotent
        assert seg.pinned and host.is_pinned()
        on_gpu = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), host)
        with SharedSegment.open(seg_name) as other:  # every process/handle pins its own mapping
            other.pin()
            assert other.tensor(torch.float32, (4,)).is_pinned()
        seg.unpin()
        seg.unpin()
        assert not seg.pinned and not host.is_pinned()
        seg.pin()
        del host
    # close() unpinned before unmapping; re-open and pin again works
    with SharedSegment.open(seg_name) as again:
        again.pin()
        assert again.pinned


@pytest.mark.cuda
def test_read_only_prefaulted_pin_of_a_fresh_mapping_serves_device_copies(seg_name):
    """A follower's way: another handle wrote the pages; this one pre-faults and registers read-only."""
    with SharedSegment.create(seg_name, 4 << 20) as seg:
        seg.tensor(torch.int32, (1 << 20,)).copy_(torch.arange(1 << 20, dtype=torch.int32))
        with SharedSegment.open(seg_name) as follower:
            follower.pin(read_only=True, prefault=True)
            host = follower.tensor(torch.int32, (1 << 20,))
            assert follower.pinned and host.is_pinned()
            on_gpu = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
            on_gpu.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(on_gpu.cpu(), torch.arange(1 << 20, dtype=torch.int32))
            del host


@pytest.mark.parametrize("offset, nbytes, what", [
    (100, 4096, "page-aligned"), (-4096, 4096, "page-aligned"), (0, 0, "not inside"), (4096, 1 << 20, "not inside"),
])
def test_pin_range_outside_or_unaligned_is_refused_before_the_driver(seg_name, offset, nbytes, what):
    with SharedSegment.create(seg_name, 1 << 20) as seg:
        with pytest.raises(ValueError, match=what):
            seg.pin(offset=offset, nbytes=nbytes)
        assert not seg.pinned


@pytest.mark.cuda
def test_page_aligned_ranges_pin_one_by_one_and_close_unpins_them_all(seg_name):
    """An arena's blocks are registered one range at a time; a range over a registered page is refused."""
    page = 4096
    with SharedSegment.create(seg_name, 16 * page) as seg:
        seg.tensor(torch.int32, (4 * page,)).copy_(torch.arange(4 * page, dtype=torch.int32))
        seg.pin(read_only=True, offset=0, nbytes=3 * page + 10)  # ends inside page 3: that page is taken
        seg.pin(read_only=True, offset=4 * page, nbytes=4 * page)
        seg.pin(read_only=True, offset=4 * page, nbytes=4 * page)  # the same range again: a no-op
        with pytest.raises(ValueError, match="overlaps"):
            seg.pin(offset=3 * page, nbytes=page)
        first = seg.tensor(torch.int32, (page,), offset=0)
        second = seg.tensor(torch.int32, (page,), offset=4 * page)
        last = seg.tensor(torch.int32, (page,), offset=12 * page)
        assert seg.pinned and first.is_pinned() and second.is_pinned() and not last.is_pinned()
        on_gpu = second.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), torch.arange(page, 2 * page, dtype=torch.int32))
        seg.close()
        assert not seg.pinned and not first.is_pinned() and not second.is_pinned()
        del first, second, last


@pytest.mark.cuda
def test_close_with_live_views_unpins(seg_name):
    seg = SharedSegment.create(seg_name, 1 << 20)
    seg.pin()
    view = seg.tensor(torch.uint8, (16,))
    seg.close()
    assert not seg.pinned and not view.is_pinned()
    del view


_RACE_SCRIPT = """
import os
import flextensor.shm.segment as seg
from flextensor.shm.errors import ShmSpaceError
first = seg.SharedSegment.create("/ftrace-a", 40 << 20)
seg._shm_free_bytes = lambda: None  # as if /dev/shm filled up between the check and the allocation
try:
    seg.SharedSegment.create("/ftrace-b", 40 << 20)
    print("created")
except ShmSpaceError as exc:
    print("ShmSpaceError", exc.errno, exc.wanted)
print(sorted(os.listdir("/dev/shm")))
first.close()
seg.SharedSegment.unlink_name("/ftrace-a")
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a private 64 MiB /dev/shm")
def test_space_running_out_during_allocation_is_shmspaceerror_and_leaves_nothing() -> None:
    """Past the free-space check, the parallel page allocation itself must report ENOSPC (never SIGBUS later)."""
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -c '{_RACE_SCRIPT}'"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == f"ShmSpaceError {errno.ENOSPC} {40 << 20}"
    assert lines[1] == "['ftrace-a']"  # the failed segment was unlinked
