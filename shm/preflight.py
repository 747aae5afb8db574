"""Preflight checks a creator runs before publishing, so a doomed publish fails early with the exact remedy.

Two things stop a shared publish half-way on real deployments:

- ``/dev/shm`` too small. Docker gives containers 64 MiB by default; Kubernetes pods get the node's tmpfs only
  with ``hostIPC`` or an ``emptyDir`` of ``medium: Memory`` mounted at ``/dev/shm``. Writing past the limit
  would otherwise surface as ENOSPC (or SIGBUS on a sparse mapping) in the middle of a multi-GiB copy.
- Pinning and ``RLIMIT_MEMLOCK``. ``mlock`` beyond the limit needs it raised or ``CAP_IPC_LOCK``.
  ``cudaHostRegister`` is not charged to it by the NVIDIA driver: an unprivileged process registered far more
  than its limit (docs/benchmarks.md, Figures behind the code). ``memlock_shortfall`` therefore only reports
  the gap, and the session logs it as a warning (other pinning mechanisms, or a future driver, may enforce
  it); a registration that does fail raises with the CUDA error and is published to the followers.

- Host RAM itself. A build that allocates more than the host has available would be ended by the
  out-of-memory killer part-way (often another process first); :func:`check_host_memory` refuses it before the
  first byte with :class:`~flextensor.shm.errors.HostMemoryError`, naming the bytes and the fix.

The creator publishes any failure through the coordinator, so followers see the same message.

``check_shm_capacity`` only reads the free space, so two jobs starting together could both pass it. The
decision that counts is taken when a segment is allocated: ``SharedSegment.create`` checks the free space and
reserves every page under a host-wide lock (an ``flock`` on ``/dev/shm`` itself), so of two jobs that do not
fit together, one allocates and the other gets ``ShmSpaceError`` with the remedy at once.
"""

from __future__ import annotations

import os

from flextensor.shm import segment_dir
from flextensor.shm.errors import HostMemoryError, ShmSpaceError
from flextensor.shm.pinning import memlock_limit
from flextensor.shm.segment import SHM_DIR
from flextensor.shm.sizes import format_bytes

_CAP_IPC_LOCK = 14


def shm_free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged writer can still allocate in ``directory`` (a hugetlbfs: its free huge pages)."""
    free = segment_dir.free_bytes(directory)
    return 0 if free is None else free


def _round_up_gib(nbytes: int) -> int:
    return max(1, -(-nbytes // 2**30))


def check_shm_capacity(namespace: str, nbytes: int, *, headroom: float = 0.02) -> None:
    """Raise ``ShmSpaceError`` when the namespace's directory (``segment_dir.py``) cannot hold ``nbytes`` more (plus
    a small headroom)."""
    if nbytes < 0:
        raise ValueError(f"bytes to publish must be >= 0, got {nbytes}")
    directory = segment_dir.namespace_directory(namespace)
    free = shm_free_bytes(directory)
    needed = int(nbytes * (1 + headroom))
    if needed <= free:
        return
    st = os.statvfs(directory)
    total = st.f_blocks * st.f_frsize
    if directory != SHM_DIR:
        raise ShmSpaceError(
            f"cannot publish {format_bytes(nbytes)} for namespace {namespace!r}: {directory} "
            f"({segment_dir.page_info(directory).describe()}) has only {format_bytes(free)} free. Give it more "
            "room: a larger size= of its mount, or more huge pages for a hugetlbfs (`echo N > "
            "/proc/sys/vm/nr_hugepages`); docs/huge-pages.md",
            segment=namespace, wanted=nbytes, free=free)
    size_gib = _round_up_gib(total - free + needed)
    raise ShmSpaceError(
        f"cannot publish {format_bytes(nbytes)} for namespace {namespace!r}: {SHM_DIR} has only "
        f"{format_bytes(free)} free of {format_bytes(total)}. Give the workers a larger shared-memory mount: "
        f"`docker run --shm-size={size_gib}g` (compose: `shm_size: {size_gib}gb` or `ipc: host`), on Kubernetes "
        f"`hostIPC: true` or an `emptyDir: {{medium: Memory, sizeLimit: {size_gib}Gi}}` volume mounted at /dev/shm, "
        f"or on a host `mount -o remount,size={size_gib}G /dev/shm`",
        segment=namespace,
        wanted=nbytes,
        free=free,
    )


#: Host RAM a check leaves free beyond what the call needs: the page cache, the process's own growth, the rest of
#: the host. 1 GiB, or 5% of the available memory when that is more.
HOST_MEMORY_HEADROOM = 1 << 30


def read_meminfo(meminfo: str = "/proc/meminfo") -> dict[str, int]:
    """The fields of ``/proc/meminfo`` given in kB, in bytes (``MemTotal``, ``MemAvailable``, ...); empty when
    the file cannot be read."""
    fields: dict[str, int] = {}
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
                    fields[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return fields


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``), or None when unknown."""
    return read_meminfo(meminfo).get("MemAvailable")


def check_host_memory(what: str, nbytes: int, fix: str) -> None:
    """Raise ``HostMemoryError`` when ``nbytes`` more of host RAM (plus :data:`HOST_MEMORY_HEADROOM`) is not
    available; ``what`` names the allocation, ``fix`` what the user can change. Silent when the host does not
    say what is available."""
    if nbytes <= 0:
        return
    available = host_available_bytes()
    if available is None:
        return
    headroom = max(HOST_MEMORY_HEADROOM, available // 20)
    if nbytes + headroom <= available:
        return
    raise HostMemoryError(
        f"{what} needs {format_bytes(nbytes)} of host RAM and the host has {format_bytes(available)} available "
        f"(keeping {format_bytes(headroom)} free for the rest of the host); nothing was allocated. {fix}",
        wanted=nbytes, available=available)


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond ``RLIMIT_MEMLOCK`` (effective CAP_IPC_LOCK)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def memlock_shortfall(nbytes: int) -> str | None:
    """A message with the remedy when pinning ``nbytes`` exceeds ``RLIMIT_MEMLOCK``; ``None`` when it fits."""
    limit = memlock_limit()
    if limit is None or nbytes <= limit or has_cap_ipc_lock():
        return None
    return (
        f"pinning {format_bytes(nbytes)} exceeds this process's locked-memory limit (RLIMIT_MEMLOCK = "
        f"{format_bytes(limit)}): raise it with `ulimit -l unlimited` (docker: `--ulimit memlock=-1`, systemd: "
        "`LimitMEMLOCK=infinity`, Kubernetes: a container runtime default or the IPC_LOCK capability), or set "
        "pinned_memory=False to stream from pageable memory"
    )
