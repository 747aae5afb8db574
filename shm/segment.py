"""One shared-memory segment, mapped into this process, with zero-copy torch views.

Life of a segment
-----------------
A segment is a file of the directory ``segment_dir.py`` names for it: ``/dev/shm`` by default, where it is exactly
the file ``shm_open`` makes, or a tmpfs or hugetlbfs of huge pages the operator chose. ``create`` makes the file
exclusively (``O_CREAT|O_EXCL|O_NOFOLLOW``), fixes the mode with ``fchmod`` (the umask applies at creation, we
want the mode asked for), passes the host-wide allocation gate
(``allocation_gate.py``: one creator at a time, never held up by another user), checks the free space, sizes it with
``ftruncate`` (in whole pages of its mount where those are huge: a hugetlbfs refuses anything else), maps it
(asking for huge pages with ``MADV_HUGEPAGE`` on a tmpfs mounted ``huge=advise``) and allocates every page up front: ``MADV_POPULATE_WRITE`` over ranges in parallel
threads (``prefault.py``; 4-5x faster than ``posix_fallocate``, which zeroes tmpfs pages in one thread under
the inode lock), or ``posix_fallocate`` on kernels older than 5.14. On tmpfs that step is what actually
reserves memory: without it a full ``/dev/shm`` would surface much later as a SIGBUS on first touch, in
whichever process happened to write there. With it, a full ``/dev/shm`` is an error here, turned into
:class:`ShmSpaceError` (which names the segment, the size, the free space and the fix) after the partial
segment is unlinked.

The fd is closed right after ``mmap``: the mapping keeps the memory alive, and not holding fds means no fd
leaks across ``fork``/``exec`` and no limit on how many segments a process maps. The creator's mapping comes
back with its page tables already filled by the allocation, so the first publish pays no fault per 4 KiB.

Views and unmapping
-------------------
``tensor()`` builds each view from a *fresh* ``memoryview`` of the mapping.  torch keeps a reference to the
object it was given, and a live memoryview holds a buffer export on the ``mmap``, so ``mmap.close()`` raises
``BufferError`` while any view exists instead of unmapping memory under it (which would crash the process
on the next access).  ``close()`` catches that and simply drops its own reference: the mapping is unmapped
when the last view is garbage collected.

Pinning (``pin``/``unpin``) registers the whole mapping, or page-aligned ranges of it one by one (the blocks of
a host-block arena, ``blocks.py``), with ``cudaHostRegister`` (see ``pinning.py``); ranges never overlap, since
the driver refuses to register a page twice. ``close`` always unregisters everything before it tries to unmap;
``close(background=True)`` does both on a thread of its own (``background_release.py``), so the caller does not
wait for the driver.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import stat
from typing import TYPE_CHECKING, Any

from . import allocation_gate, segment_dir
from .errors import ShmSpaceError
from .manifest import contiguous_stride
from .names import validate_posix_name
from .pinning import host_register, host_unregister
from .prefault import populate_read, populate_write, populate_write_range, read_threads
from .sizes import align_up, format_bytes

if TYPE_CHECKING:  # torch is imported lazily: flextensor.shm must import in milliseconds
    import torch

__all__ = ["SharedSegment", "SHM_DIR", "format_bytes", "check_file_intact", "squatter_hint"]

logger = logging.getLogger(__name__)

#: The default directory of segments (``segment_dir.py`` says where a given segment lives).
SHM_DIR = segment_dir.DEFAULT_DIRECTORY
_NAME_MAX = 255
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC  # shm_open's flags


def _page_end(n: int) -> int:
    """``n`` rounded up to a page: the driver registers whole pages."""
    return align_up(n, mmap.PAGESIZE)


def _validate_name(name: object) -> str:
    return validate_posix_name(name, "segment", _NAME_MAX)


def check_file_intact(name: str, size: int, inode: int | None) -> None:
    """Raise ``ShmProtocolError`` when segment ``name`` (the file with ``inode``) now holds fewer than ``size``
    bytes.

    Touching a mapped page beyond the end of a truncated tmpfs file kills the process with SIGBUS, so
    publishers check before each step and attachers on open.  A name that was unlinked (or now names another
    file) no longer reaches our file and cannot truncate it: that is not an error.
    """
    if inode is None:
        return
    path = segment_dir.segment_path(name)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_ino == inode and st.st_size < size:
        from .errors import ShmProtocolError

        raise ShmProtocolError(
            f"shared-memory segment {name!r} ({path}) was truncated to {st.st_size} bytes while in use "
            f"({size} expected): another process of the same user (uid {st.st_uid}) changed it. Nothing of it "
            "can be trusted: stop every worker of this namespace, clean it up and start again"
        )


def squatter_hint(name: str, path: str | None = None) -> str:
    """When POSIX name ``name`` (file ``path``, default the segment's file) exists and belongs to another user:
    who, and what to do (else "")."""
    path = path or segment_dir.segment_path(name)
    try:
        st = os.stat(path)
    except OSError:
        return ""
    if st.st_uid == os.geteuid():
        return ""
    try:
        import pwd

        who = f"uid {st.st_uid} ({pwd.getpwuid(st.st_uid).pw_name})"
    except (KeyError, ImportError):
        who = f"uid {st.st_uid}"
    return (f"; {path} belongs to {who}, not to this user (uid {os.geteuid()}): that user or root must remove "
            f"it (`rm {path}`, or `ftd cleanup --force` as that user), or use another namespace")


def _space_error(name: str, size: int, err: int) -> ShmSpaceError:
    directory = segment_dir.directory_of(name)
    free = segment_dir.free_bytes(directory)
    cause = {
        errno.ENOSPC: f"no space in {directory}",
        errno.EFBIG: f"size too large for {directory}",
        errno.ENOMEM: f"out of memory (ENOMEM: e.g. the container's memory limit, or too few free huge pages) "
                      f"while filling {directory}",
        errno.EDQUOT: f"over the user's quota in {directory}",
    }.get(err, f"no space in {directory}")
    if directory == SHM_DIR:
        fix = (f"Enlarge {SHM_DIR}: `docker run --shm-size=<size>` for Docker, an emptyDir volume with "
               "`medium: Memory` (and a sizeLimit) mounted at /dev/shm on Kubernetes, or "
               f"`mount -o remount,size=<size> {SHM_DIR}` on a host")
    elif segment_dir.page_info(directory).hugetlbfs:
        fix = (f"Reserve more huge pages (`echo N > /proc/sys/vm/nr_hugepages`, or the `hugepages-2Mi` resource "
               f"on Kubernetes) or raise the size= of the hugetlbfs mounted at {directory}")
    else:
        fix = f"Enlarge the file system mounted at {directory} (`mount -o remount,size=<size> {directory}`)"
    message = (
        f"{cause} for shared-memory segment {name!r}: it needs {size} bytes ({format_bytes(size)}) and "
        f"{free if free is not None else 'an unknown number of'} bytes ({format_bytes(free)}) are free there. "
        f"{fix}; or free space by cleaning up stale namespaces (`ftd cleanup`)"
    )
    return ShmSpaceError(message, segment=name, wanted=size, free=free)


class SharedSegment:
    """A mapped POSIX shared-memory segment (see the module docstring for the life cycle).

    Attributes: ``name`` (POSIX name, with leading ``/``), ``size`` (bytes mapped), ``created`` (this handle
    created the name), ``pinned``.  Closing does not unlink; :meth:`unlink_name` does.
    """

    name: str
    size: int
    created: bool

    def __init__(self, name: str, size: int, created: bool, mapping: mmap.mmap) -> None:
        """Internal: use :meth:`create` or :meth:`open`."""
        self.name = name
        self.size = size
        self.created = created
        self._mmap: mmap.mmap | None = mapping
        self._buffer: memoryview | None = None
        self._pinned: dict[int, int] = {}  # registered ranges: offset -> bytes
        self.inode: int | None = None  # of the file mapped (set by create/open): check_intact() compares it
        self.reserved = True  # every page allocated (False: ranges are reserved one by one, reserve_range)
        self.directory = segment_dir.directory_of(name)  # where its file is (segment_dir.py)
        self.page_size = mmap.PAGESIZE  # what its mount gives it (set by create/open)
        # its mount's PageInfo.huge_unasked (set by create/open): its ranges are reserved with posix_fallocate
        self.huge_tmpfs = False

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, name: str, size: int, *, mode: int = 0o600, populate: bool = True,
               reserve: bool = True) -> SharedSegment:
        """Create ``name`` exclusively with ``size`` bytes of allocated, zeroed memory and map it.

        ``FileExistsError`` when the name exists; ``ShmSpaceError`` (an ``OSError`` with ``errno.ENOSPC``)
        when its directory is too small, with nothing left behind; ``ValueError`` for a bad name or size. In a
        directory of huge pages the size is rounded up to a whole page (``size`` then says how much was mapped).
        ``populate=True`` (the default, for a creator about to write) also maps every page into this process;
        ``populate=False`` only reserves them, for a segment that this process will not touch soon.
        ``reserve=False`` allocates nothing yet: the creator reserves each range with :meth:`reserve_range`
        just before it writes there, so host memory grows only as fast as it is filled (a creator that frees its
        private copy of the weights while it fills the segment never holds both). Writing to a range that was
        not reserved risks SIGBUS on a full ``/dev/shm``; the free space is still checked here.
        """
        _validate_name(name)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size < 1 << 62:
            raise ValueError(f"invalid size {size!r} for segment {name!r}: it must be an int > 0 (bytes)")
        if not isinstance(mode, int) or mode & ~0o777:
            raise ValueError(f"invalid mode {mode!r} for segment {name!r}: use permission bits such as 0o600")
        directory = segment_dir.directory_of(name)
        path = directory + name
        pages = segment_dir.page_info(directory)
        if pages.huge:
            size = align_up(size, pages.size)
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"shared-memory segment {name!r} already exists "
                                  f"({path}); another process created it, or a crashed run left it "
                                  f"(clean up with `ftd cleanup`){squatter_hint(name)}") from None
        except PermissionError as exc:
            raise PermissionError(errno.EACCES, f"cannot create shared-memory segment {name!r} ({path}): "
                                  f"{exc.strerror}{squatter_hint(name)}") from None
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"cannot create shared-memory segment {name!r}: its directory "
                                    f"{directory} does not exist; mount it or fix shm_dir / "
                                    f"{segment_dir.ENV_VAR}") from None
        reservation = allocation_gate.acquire(directory, size)  # see allocation_gate.py: who is waited for
        try:
            os.fchmod(fd, mode)  # the umask applied at creation; make the mode exactly what was asked
            free = segment_dir.free_bytes(directory)
            if free is not None and size > free:
                raise _space_error(name, size, errno.ENOSPC)
            mapping = None
            try:
                os.ftruncate(fd, size)
                mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if pages.advise:
                    mapping.madvise(mmap.MADV_HUGEPAGE)
                # Allocate every page now, so a full /dev/shm fails here and not as SIGBUS in the middle of a
                # copy: populate=True also maps them in this process (parallel MADV_POPULATE_WRITE, see
                # prefault.py; the fast path), populate=False only reserves them (posix_fallocate, one thread).
                if reserve and not (populate and populate_write(mapping, size, page_size=pages.size)):
                    os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if mapping is not None:
                    mapping.close()
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EFAULT):
                    raise _space_error(name, size, exc.errno) from None
                raise
        except BaseException:
            os.close(fd)
            cls.unlink_name(name)
            raise
        finally:
            allocation_gate.release(reservation)
        inode = os.fstat(fd).st_ino
        os.close(fd)
        logger.debug("created shared-memory segment %s (%d bytes, mode %04o, %s in %s)", name, size, mode,
                     pages.describe(), directory)
        segment_dir.warn_if_small_pages(name, size, pages, directory)
        segment = cls(name, size, True, mapping)
        segment.inode = inode
        segment.reserved = reserve
        segment.page_size = pages.size
        segment.huge_tmpfs = pages.huge_unasked
        return segment

    @classmethod
    def open(cls, name: str, min_size: int = 0, *, populate: bool = False) -> SharedSegment:
        """Map an existing segment (its whole current size).

        ``FileNotFoundError`` naming the segment when it does not exist; ``ValueError`` when it is smaller
        than ``min_size`` bytes (or empty: its creator has not sized it yet).  ``populate=True`` pre-faults
        the page tables (useful before a bulk read); by default pages fault in on first touch.
        """
        _validate_name(name)
        directory = segment_dir.directory_of(name)
        try:
            fd = os.open(directory + name, _OPEN_FLAGS)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"shared-memory segment {name!r} does not exist "
                                    f"({directory}{name}): its creator has not made it yet, or it was already "
                                    "removed") from None
        except PermissionError as exc:
            hint = squatter_hint(name) or "; it belongs to another user or has a restrictive mode"
            raise PermissionError(errno.EACCES, f"cannot open shared-memory segment {name!r}: {exc.strerror}"
                                  f"{hint}") from None
        pages = segment_dir.page_info(directory)
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size == 0 or size < min_size:
                raise ValueError(
                    f"shared-memory segment {name!r} has {size} bytes, fewer than the {max(min_size, 1)} "
                    "expected: it is truncated, still being created, or belongs to another protocol version"
                )
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            if pages.advise:
                mapping.madvise(mmap.MADV_HUGEPAGE)
        finally:
            os.close(fd)
        segment = cls(name, size, False, mapping)
        segment.inode = st.st_ino
        segment.page_size = pages.size
        segment.huge_tmpfs = pages.huge_unasked
        return segment

    def check_intact(self) -> None:
        """Raise ``ShmProtocolError`` when the file this handle maps was truncated below the mapped size
        (see :func:`check_file_intact`)."""
        check_file_intact(self.name, self.size, self.inode)

    def open_file(self, *, write: bool = False) -> int:
        """A descriptor of the file this handle maps, opened again by name (the mapping keeps no fd): read-only,
        for reading its bytes with ``pread`` (the kernel copies them without mapping a page into this process; a
        fresh mapping faults once per 4 KiB page on first touch), or with ``write`` for writing them with
        ``pwrite`` (on a tmpfs of huge pages a write that covers a whole page spares tmpfs zeroing it, where a
        store through the mapping first faults it in zeroed). The caller closes it.

        ``FileNotFoundError`` when the name is gone or now names another file (use the mapping then: it still
        holds this file's pages); ``ShmProtocolError`` when the file was truncated below the mapped size.
        """
        self._mapping()
        try:
            fd = os.open(self.directory + self.name,
                         (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"shared-memory segment {self.name!r} was removed; use its "
                                    "mapping") from None
        try:
            st = os.fstat(fd)
            if self.inode is not None and st.st_ino != self.inode:
                raise FileNotFoundError(errno.ENOENT, f"the name of shared-memory segment {self.name!r} now names "
                                        "another file; use its mapping")
            check_file_intact(self.name, self.size, st.st_ino)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write_from(self, fd: int, at: int, address: int, nbytes: int) -> None:
        """Write ``nbytes`` from ``address`` (this process's memory) into this segment's file at byte ``at``
        through ``fd`` (:meth:`open_file` with ``write``), whole: any thread may write its own range meanwhile.
        Pages not allocated yet are allocated by the write, so a full directory is a :class:`ShmSpaceError` here
        (not a SIGBUS later); ``ValueError`` for a range outside the segment (a write there would grow the
        file)."""
        if at < 0 or nbytes < 0 or at + nbytes > self.size:
            raise ValueError(f"range [{at}, {at + nbytes}) is not inside segment {self.name!r} ({self.size} bytes)")
        source = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B") if nbytes else b""
        done = 0
        try:
            while done < nbytes:
                wrote = os.pwrite(fd, source[done:], at + done)
                if wrote <= 0:  # never for a file with room; not a reason to spin
                    raise OSError(errno.ENOSPC, f"pwrite wrote nothing into {self.name!r}")
                done += wrote
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT):
                raise _space_error(self.name, self.size, exc.errno) from None
            raise

    @staticmethod
    def unlink_name(name: str) -> bool:
        """Remove the name ``name`` (mappings stay valid until unmapped).  True if it existed.

        ``PermissionError`` naming the file and its owner when it belongs to another user (``/dev/shm`` is
        sticky: only its owner or root may remove it)."""
        _validate_name(name)
        try:
            os.unlink(segment_dir.segment_path(name))
        except FileNotFoundError:
            return False
        except PermissionError as exc:
            raise PermissionError(errno.EACCES, f"cannot remove shared-memory segment {name!r}: {exc.strerror}"
                                  f"{squatter_hint(name)}") from None
        return True

    @staticmethod
    def mode_of(name: str) -> int:
        """Permission bits of an existing segment (from its file)."""
        return stat.S_IMODE(os.stat(segment_dir.segment_path(_validate_name(name))).st_mode)

    # ------------------------------------------------------------------ access
    def _mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"shared-memory segment {self.name!r} is closed in this handle; open it again")
        return self._mmap

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def buffer(self) -> memoryview:
        """A writable memoryview of the whole mapping (the same object on every access)."""
        if self._buffer is None:
            self._buffer = memoryview(self._mapping())
        return self._buffer

    @property
    def address(self) -> int:
        """Virtual address of the mapping in this process (for pinning and diagnostics)."""
        import ctypes

        anchor = ctypes.c_char.from_buffer(self._mapping())
        try:
            return ctypes.addressof(anchor)
        finally:
            del anchor  # drop the buffer export at once, or close() could never unmap

    def tensor(self, dtype: torch.dtype, shape: Any, stride: Any = None, offset: int = 0) -> torch.Tensor:
        """A zero-copy tensor of ``dtype``/``shape``/``stride`` (in elements) starting ``offset`` bytes in.

        ``ValueError`` when ``offset`` is not a multiple of the element size (the mapping is page aligned,
        so this is pointer alignment), when a stride is negative, or when the highest addressed byte falls
        outside the segment.  Writes through the tensor are seen by every process that maps the segment.
        """
        import torch

        mapping = self._mapping()
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"invalid dtype {dtype!r} for a view of segment {self.name!r}: pass a torch.dtype")
        shape_t = _int_tuple(shape, "shape", self.name)
        if any(d < 0 for d in shape_t):
            raise ValueError(f"invalid shape {shape_t} for a view of segment {self.name!r}: sizes must be >= 0")
        if stride is None:
            stride_t = tuple(contiguous_stride(shape_t))
        else:
            stride_t = _int_tuple(stride, "stride", self.name)
            if len(stride_t) != len(shape_t):
                raise ValueError(f"stride {stride_t} and shape {shape_t} of a view of segment {self.name!r} have "
                                 "different lengths")
            if any(s < 0 for s in stride_t):
                raise ValueError(f"invalid stride {stride_t} for a view of segment {self.name!r}: strides must "
                                 "be >= 0")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"invalid offset {offset!r} for a view of segment {self.name!r}: it must be an "
                             "int >= 0 (bytes)")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError(f"offset {offset} into segment {self.name!r} is not aligned for {dtype} (element "
                             f"size {itemsize}): use a multiple of {itemsize}")
        if math.prod(shape_t) == 0:
            if offset > self.size:
                raise ValueError(f"offset {offset} is past the end of segment {self.name!r} ({self.size} bytes)")
            return torch.empty(0, dtype=dtype).as_strided(shape_t, stride_t)
        span = 1 + sum((d - 1) * s for d, s in zip(shape_t, stride_t))  # elements from first to last addressed
        end = offset + span * itemsize
        if end > self.size:
            raise ValueError(
                f"view {dtype} shape={shape_t} stride={stride_t} offset={offset} of segment {self.name!r} needs "
                f"bytes up to {end}, but the segment has {self.size}"
            )
        # A fresh memoryview per view: it pins the mmap (BufferError on close) for exactly the view's lifetime.
        flat = torch.frombuffer(memoryview(mapping), dtype=dtype, offset=offset, count=span)
        return flat.as_strided(shape_t, stride_t)

    def reserve_range(self, offset: int, nbytes: int, *, threads: int | None = None) -> None:
        """Allocate the pages of ``[offset, offset + nbytes)`` of a segment created with ``reserve=False``, before
        writing there: populated (allocated and mapped) from up to ``threads`` threads (default
        ``prefault.WRITE_THREADS_PER_FILE``: more only wait for the file's locks), or on a tmpfs of huge pages
        reserved with ``posix_fallocate`` (``huge_tmpfs``; ``prefault.py`` says why). A full ``/dev/shm`` is a
        :class:`ShmSpaceError` here rather than a SIGBUS in the copy. A no-op on a segment reserved whole."""
        if self.reserved or nbytes <= 0:
            return
        if offset < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is not inside segment {self.name!r} "
                             f"({self.size} bytes)")
        page = self.page_size  # whole pages of the mount: a huge page is allocated whole anyway
        start = offset - offset % page
        length = align_up(offset + nbytes, page) - start
        length = min(length, self.size - start)
        try:
            # On a tmpfs of huge pages, or on kernels before 5.14 (no MADV_POPULATE_WRITE): posix_fallocate.
            if self.huge_tmpfs or not populate_write_range(self.address + start, length, threads=threads,
                                                           page_size=page):
                fd = os.open(self.directory + self.name, _OPEN_FLAGS)
                try:
                    os.posix_fallocate(fd, start, length)
                finally:
                    os.close(fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EFAULT):
                raise _space_error(self.name, self.size, exc.errno) from None
            raise

    # ------------------------------------------------------------------ pinning
    @property
    def pinned(self) -> bool:
        """True when any part of the mapping is registered."""
        return bool(self._pinned)

    @property
    def pinned_ranges(self) -> dict[int, int]:
        """The registered ranges, ``offset -> bytes`` (a copy)."""
        return dict(self._pinned)

    def pin(self, *, read_only: bool = False, prefault: bool = False, offset: int = 0,
            nbytes: int | None = None) -> None:
        """Page-lock ``[offset, offset + nbytes)`` (default: the whole mapping) for fast DMA
        (``cudaHostRegister``, Portable).  Idempotent for the same range.

        Every process that maps the segment and copies from it to a GPU pins its own mapping.  ``offset`` must
        be page aligned and the range inside the segment, not overlapping a range already pinned
        (``ValueError``).  Raises ``RuntimeError`` without CUDA or when the driver refuses (often ``ulimit -l``).
        ``read_only``: the device only reads this range (host -> device copies), which lets the driver pin
        faster where supported. ``prefault``: first map every existing page of the range into this process from
        several threads (``MADV_POPULATE_READ``), for a fresh mapping of pages another process wrote. Each
        roughly halves the registration of a fresh mapping (``pinning.py`` and ``prefault.py`` say why).
        """
        nbytes = self.size - offset if nbytes is None else nbytes
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % mmap.PAGESIZE:
            raise ValueError(f"pin offset {offset!r} into segment {self.name!r} must be a page-aligned "
                             f"({mmap.PAGESIZE} bytes) non-negative int")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or offset + nbytes > self.size:
            raise ValueError(f"pin range [{offset}, {offset}+{nbytes!r}) is not inside segment {self.name!r} "
                             f"({self.size} bytes)")
        if self._pinned.get(offset) == nbytes:
            return
        end = _page_end(offset + nbytes)
        for start, length in self._pinned.items():
            if offset < _page_end(start + length) and start < end:
                raise ValueError(f"pin range [{offset}, {offset + nbytes}) of segment {self.name!r} overlaps the "
                                 f"registered range [{start}, {start + length}); unpin() first")
        ptr = self.address + offset
        if prefault:
            populate_read(ptr, nbytes, threads=read_threads(self.page_size))
        host_register(ptr, nbytes, read_only=read_only)
        self._pinned[offset] = nbytes

    def unpin(self) -> None:
        """Undo every :meth:`pin`.  Idempotent; a no-op on a segment that was never pinned.  A range the
        driver fails to unregister is forgotten anyway (the unmap releases it) and the first error raised."""
        error: RuntimeError | None = None
        while self._pinned:
            try:
                self.unpin_one()
            except RuntimeError as exc:
                error = error or exc
        if error is not None:
            raise error

    def unpin_one(self) -> bool:
        """Undo the most recent :meth:`pin` still in place (one driver call); False when nothing is pinned.

        A range the driver fails to unregister is forgotten anyway (the unmap releases it): ``RuntimeError``."""
        if not self._pinned:
            return False
        offset, _nbytes = self._pinned.popitem()
        host_unregister(self.address + offset)
        return True

    # ------------------------------------------------------------------ teardown
    def close(self, *, background: bool = False) -> None:
        """Unpin, then unmap.  Idempotent; never raises because views are alive.

        If tensors (or memoryviews) still view the mapping, it cannot be unmapped now; this handle drops its
        reference and the mapping is unmapped when the last view is collected. ``background=True`` hands a
        pinned segment to the release thread (``background_release.py``: unregistered range by range, then
        unmapped) and returns at once; the caller must not use the segment afterwards.
        """
        if self._mmap is None:
            return
        if background and self._pinned:
            from .background_release import release_in_background

            release_in_background(self)
            return
        try:
            self.unpin()
        except RuntimeError:
            logger.warning("could not unregister pinned segment %s; unmapping anyway", self.name, exc_info=True)
        self._buffer = None  # our memoryview: if nobody else holds it, this drops its export
        mapping, self._mmap = self._mmap, None
        try:
            mapping.close()
        except BufferError:
            logger.debug("segment %s still has live views; it is unmapped when the last one dies", self.name)

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else ("pinned" if self.pinned else "mapped")
        return f"SharedSegment({self.name!r}, size={self.size}, created={self.created}, {state})"


def _int_tuple(value: Any, what: str, name: str) -> tuple[int, ...]:
    """``value`` as a tuple of ints (an int, a sequence or a torch.Size); bools and floats are refused."""
    import operator

    items = (value,) if isinstance(value, int) else value
    try:
        items = tuple(items)
        if any(isinstance(item, bool) for item in items):
            raise TypeError
        return tuple(operator.index(item) for item in items)
    except TypeError:
        raise ValueError(f"invalid {what} {value!r} for a view of segment {name!r}: pass a sequence of ints") \
            from None


