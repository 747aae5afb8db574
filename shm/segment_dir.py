"""Where shared-memory segments live, and what pages that place gives them: the one module that knows.

Why a directory
---------------
A segment is a file of a memory file system, made exclusively, sized, mapped and unlinked by name. POSIX
``shm_open`` puts every such file in ``/dev/shm``, a tmpfs of 4 KiB pages; allocating, zeroing and registering
pages with CUDA one 4 KiB page at a time is what the publish and registration of a large model cost
(docs/huge-pages.md). A host operator can give the shared copy huge pages with one mount: a tmpfs mounted with
``huge=always`` (or ``within_size``, or ``advise``, which the segments then ask for with ``MADV_HUGEPAGE``), or a
hugetlbfs. So the segments live in a directory: ``/dev/shm`` by default, where they are exactly the files
``shm_open`` would make (``O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC``), or the directory the operator names
(``OffloadConfig(shm_dir=...)``, ``FT_SHM_DIR``, ``shm_dir:`` in ``ftd.yaml``). Semaphores stay in
``/dev/shm`` (``sem.*``, made by glibc); the lock directory and its journals do not move either.

Which directory for which segment
---------------------------------
Every segment name is ``/{namespace}.{kind}`` (``names.py``), and a namespace lives in one directory. This
process knows that directory from (first match wins):

1. a binding made by whoever joined or read the namespace (:func:`bind_namespace`): a ``ShmCoordinator`` binds the
   directory it was given; reading a namespace's journal binds the directory its creator recorded there
   (``journal.py``), so cleanup, the dead sweep and ``ftd`` find the segments of a job that used another
   directory than their own default;
2. the process's default (:func:`default_directory`): :func:`set_default_directory` (``ftd``'s ``shm_dir``),
   else ``$FT_SHM_DIR``, else ``/dev/shm``.

Pages
-----
:func:`page_info` reads the mount that holds a directory (``/proc/self/mountinfo``): a hugetlbfs gives its
``pagesize`` (its files must be sized in whole pages: ``ftruncate`` refuses anything else); a tmpfs with
``huge=always`` / ``within_size`` / ``advise`` (or any tmpfs when ``shmem_enabled`` is ``force``) gives PMD-sized
pages (2 MiB on x86-64) to every aligned 2 MiB of a file; anything else gives base pages. Segments in a
directory of huge pages are sized in whole pages and their blocks start on a huge-page boundary
(:func:`block_alignment`), so each block has its pages to itself and each call that allocates, pre-faults or
registers covers whole huge pages.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_DIRECTORY", "ENV_VAR", "HUGE_WARN_BYTES", "PageInfo", "bind_namespace", "block_alignment",
    "check_directory", "default_directory", "directory_device", "directory_of", "free_bytes", "huge_mapped_bytes",
    "huge_page_hint", "sees_directory",
    "namespace_directory",
    "page_info", "segment_path", "set_default_directory", "warn_if_small_pages",
]

logger = logging.getLogger(__name__)

DEFAULT_DIRECTORY = "/dev/shm"
#: The environment variable naming the directory (the guide's ``FT_*`` style, read by ``OffloadConfig`` too).
ENV_VAR = "FT_SHM_DIR"
#: A segment at least this large on base pages, where the host could give huge ones, is warned about (once).
HUGE_WARN_BYTES = 1 << 30
#: Blocks never start further apart than this, whatever the page: a 1 GiB hugetlbfs page per block would waste
#: up to a page per block. 2 MiB is the PMD size, what registration and copies gain from.
MAX_BLOCK_ALIGNMENT = 2 << 20

_HUGETLBFS_PAGE_RE = re.compile(r"pagesize=(\d+)([KMG]?)")
_THP = Path("/sys/kernel/mm/transparent_hugepage")

_lock = threading.Lock()
_default: str | None = None  # set_default_directory(); None: $FT_SHM_DIR or DEFAULT_DIRECTORY
_bound: dict[str, str] = {}  # namespace -> directory
_pages: dict[tuple[str, int], PageInfo] = {}  # (directory, st_dev) -> its pages
_warned = False


def check_directory(path: object, what: str = "shm_dir") -> str:
    """``path`` as an absolute, normalised directory path; ``ValueError`` naming ``what`` and the fix otherwise
    (a relative path, NUL, a path that is not an existing directory)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{what} must be a directory path (str), got {type(path).__name__} {path!r}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\x00" in text or not os.path.isabs(text):
        raise ValueError(f"{what} must be an absolute directory path such as /dev/shm or /mnt/ft-huge, got {path!r}")
    text = os.path.normpath(text)
    if not os.path.isdir(text):
        raise ValueError(f"{what} {text!r} is not an existing directory: mount a tmpfs (huge=always) or a "
                         "hugetlbfs there first (docs/huge-pages.md), or leave it unset for /dev/shm")
    return text


def set_default_directory(path: str | os.PathLike[str] | None) -> None:
    """Make ``path`` this process's default directory (None: back to ``$FT_SHM_DIR`` or ``/dev/shm``)."""
    global _default
    checked = None if path is None else check_directory(path)
    with _lock:
        _default = checked


def default_directory() -> str:
    """This process's default: :func:`set_default_directory`, else ``$FT_SHM_DIR``, else ``/dev/shm``."""
    with _lock:
        if _default is not None:
            return _default
    env = os.environ.get(ENV_VAR, "")
    return check_directory(env, ENV_VAR) if env else DEFAULT_DIRECTORY


def bind_namespace(namespace: str, directory: str | os.PathLike[str]) -> str:
    """Record that ``namespace``'s segments live in ``directory`` (an absolute path, returned normalised; it need
    not exist any more: a journal may name a directory unmounted since, whose segments are gone with it)."""
    checked = os.path.normpath(os.fspath(directory))
    if "\x00" in checked or not os.path.isabs(checked):
        raise ValueError(f"the directory of namespace {namespace!r} must be an absolute path, got {directory!r}")
    with _lock:
        _bound[namespace] = checked
    return checked


def namespace_directory(namespace: str) -> str:
    """The directory of ``namespace``'s segments: its binding, else the default."""
    with _lock:
        bound = _bound.get(namespace)
    return bound if bound is not None else default_directory()


def directory_of(name: str) -> str:
    """The directory of segment ``name`` (``/{namespace}.{kind}``): its namespace's binding (the longest bound
    namespace the name starts with), else the default."""
    with _lock:
        best = None
        for index, char in enumerate(name):
            if char == "." and name[1:index] in _bound:
                best = _bound[name[1:index]]
    return best if best is not None else default_directory()


def segment_path(name: str) -> str:
    """The file of segment ``name`` (``/{namespace}.{kind}``; the leading slash joins it to its directory)."""
    return directory_of(name) + name


@dataclass(frozen=True)
class PageInfo:
    """What a directory's mount gives a segment: ``size`` bytes per page, the file system, the mount option
    that decided it (``source``), and whether a mapping must ask for huge pages (``advise``: ``huge=advise``)."""

    size: int
    fs: str
    source: str
    advise: bool = False

    @property
    def huge(self) -> bool:
        return self.size > mmap.PAGESIZE

    @property
    def hugetlbfs(self) -> bool:
        return self.fs == "hugetlbfs"

    @property
    def huge_unasked(self) -> bool:
        """A tmpfs that gives a file huge pages without a mapping asking for them (``huge=always``,
        ``within_size``): pages allocated outside any mapping (``posix_fallocate``) are huge too. Not
        ``huge=advise``, whose pages come in 4 KiB there, nor a hugetlbfs."""
        return self.huge and not self.hugetlbfs and not self.advise

    def describe(self) -> str:
        """E.g. ``2 MiB pages (tmpfs huge=always)`` or ``4 KiB pages (tmpfs)``."""
        from .sizes import format_bytes

        unit = format_bytes(self.size, digits=0)
        return f"{unit} pages ({self.fs}{' ' + self.source if self.source else ''})"


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _mount_of(path: str) -> tuple[str, str] | None:
    """``(fstype, super options)`` of the mount that holds ``path`` (the last mount at the longest prefix)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best: tuple[int, str, str] | None = None
    for line in lines:
        fields = line.split()
        try:
            dash = fields.index("-")
        except ValueError:
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]) and len(fields) > dash + 3:
            best = (len(point), fields[dash + 1], fields[dash + 3])
    return None if best is None else (best[1], best[2])


def _pmd_size() -> int:
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def _shmem_enabled() -> str:
    """The bracketed choice of ``shmem_enabled`` (``never`` where the kernel has no THP for shmem)."""
    try:
        match = re.search(r"\[(\w+)\]", (_THP / "shmem_enabled").read_text())
    except OSError:
        return "never"
    return match.group(1) if match else "never"


def _read_page_info(directory: str) -> PageInfo:
    mount = _mount_of(directory)
    if mount is None:
        return PageInfo(mmap.PAGESIZE, "unknown", "")
    fs, options = mount
    opts = dict(item.partition("=")[::2] for item in options.split(","))
    if fs == "hugetlbfs":
        size = os.statvfs(directory).f_bsize
        return PageInfo(size, fs, f"pagesize={opts.get('pagesize', size)}")
    if fs == "tmpfs":
        forced = _shmem_enabled()
        huge = opts.get("huge", "never")
        if forced == "deny":
            return PageInfo(mmap.PAGESIZE, fs, "shmem_enabled=deny")
        if forced == "force":
            return PageInfo(_pmd_size(), fs, "shmem_enabled=force")
        if huge in ("always", "within_size", "advise"):
            return PageInfo(_pmd_size(), fs, f"huge={huge}", advise=huge == "advise")
    return PageInfo(mmap.PAGESIZE, fs, "")


def page_info(directory: str | None = None) -> PageInfo:
    """The pages segments in ``directory`` (default: this process's default directory) get; cached per mount."""
    directory = directory or default_directory()
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        return PageInfo(mmap.PAGESIZE, "unknown", "")
    key = (directory, dev)
    with _lock:
        cached = _pages.get(key)
    if cached is None:
        cached = _read_page_info(directory)
        with _lock:
            _pages[key] = cached
    return cached


def block_alignment(directory: str) -> int:
    """Where blocks of a segment in ``directory`` start: on a page of the mount, at most
    :data:`MAX_BLOCK_ALIGNMENT` apart (4 KiB, or the host's base page, on ordinary tmpfs)."""
    return max(4096, mmap.PAGESIZE, min(page_info(directory).size, MAX_BLOCK_ALIGNMENT))


def _hugetlb_free(page: int) -> int | None:
    try:
        return int(Path(f"/sys/kernel/mm/hugepages/hugepages-{page // 1024}kB/free_hugepages").read_text()) * page
    except (OSError, ValueError):
        return None


def free_bytes(directory: str | None = None) -> int | None:
    """Bytes a new segment can still take in ``directory`` (None: unknown). A hugetlbfs mounted without a
    ``size=`` reports no blocks: its room is the host's free huge pages of its size."""
    directory = directory or default_directory()
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    info = page_info(directory)
    if info.hugetlbfs:
        pool = _hugetlb_free(info.size)
        if st.f_blocks == 0:
            return pool
        return min(st.f_bavail * st.f_frsize, pool) if pool is not None else st.f_bavail * st.f_frsize
    return st.f_bavail * st.f_frsize


def huge_page_hint() -> str:
    """How this host could give segments huge pages ("" when it cannot): a tmpfs with ``huge=always`` where the
    kernel has THP for shmem, a hugetlbfs where huge pages are reserved."""
    ways = []
    if _THP.joinpath("shmem_enabled").exists() and _shmem_enabled() != "deny":
        ways.append("a tmpfs mounted with huge=always (`mount -t tmpfs -o size=<size>,huge=always tmpfs DIR`)")
    free = _hugetlb_free(_pmd_size())
    if free:
        ways.append("a hugetlbfs (`mount -t hugetlbfs -o pagesize=2M none DIR`)")
    if not ways:
        return ""
    return f"set shm_dir / {ENV_VAR} to {' or '.join(ways)}; docs/huge-pages.md"


def directory_device(directory: str) -> int:
    """``st_dev`` of ``directory`` (0 when it cannot be read): the file system a journal's segments are on."""
    try:
        return os.stat(directory).st_dev
    except OSError:
        return 0


def sees_directory(directory: str, device: int) -> bool:
    """Whether ``directory`` is, in this process, the file system ``device`` recorded (always, when 0)."""
    return device == 0 or directory_device(directory) == device


def huge_mapped_bytes(path: str) -> int:
    """Bytes of this process's mappings of file ``path`` that sit on huge pages now (``/proc/self/smaps``:
    ``ShmemPmdMapped`` on a tmpfs, the whole mapping on a hugetlbfs): what a segment actually got, for
    diagnostics and benchmarks (reading smaps costs milliseconds in a process with many mappings)."""
    total = 0
    current = False
    try:
        with open("/proc/self/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms offset dev inode path
                    current = line.rstrip("\n").endswith(" " + path) or line.rstrip("\n").endswith(" " + path +
                                                                                           " (deleted)")
                    size = kernel_page = 0
                elif current and head == "Size:":
                    size = int(line.split()[1]) * 1024
                elif current and head == "KernelPageSize:":
                    kernel_page = int(line.split()[1]) * 1024
                    if kernel_page > mmap.PAGESIZE:
                        total += size
                elif current and head == "ShmemPmdMapped:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def warn_if_small_pages(name: str, size: int, info: PageInfo, directory: str) -> None:
    """Warn once per process when segment ``name`` of ``size`` bytes lands on base pages while the host could
    give it huge ones (``huge_page_hint``)."""
    global _warned
    if info.huge or size < HUGE_WARN_BYTES or _warned:
        return
    hint = huge_page_hint()
    if not hint:
        return
    with _lock:
        if _warned:
            return
        _warned = True
    from .sizes import format_bytes

    logger.warning("shared-memory segment %s (%s) is on %s in %s: allocating, registering and copying it costs a "
                   "page fault and a page-table entry per 4 KiB; for huge pages %s", name, format_bytes(size),
                   info.describe(), directory, hint)
