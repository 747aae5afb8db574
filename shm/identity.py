"""Who a participant is, and whether that process still runs.

A pid alone is a poor identity: pids are recycled, so "pid 4242 exists" says nothing about whether it is
*our* 4242.  A participant is therefore

    pid + start_time (field 22 of /proc/<pid>/stat, clock ticks since boot) + boot_id + token

The (pid, start_time, boot_id) triple names one process instance on one boot of one machine: a recycled pid
has a later start time, and after a reboot the boot id differs (shared memory does not survive a reboot, but
journals in a persistent TMPDIR may).  The random token distinguishes handles *inside* one process: two
coordinators opened by the same process are two participants with two leases.

Liveness from identity: a lease slot records its process's pid namespace (:func:`pid_namespace`) next to
pid, start time and boot id.  When that namespace is ours and the boot is this one, "no process runs with
this pid and start time" is a *certain* death, seen at once (:func:`process_gone`), whatever the heartbeat
says.  A process in another pid namespace (another container sharing /dev/shm) has a pid that means
nothing here; such participants are judged by their lease heartbeat only.

A process that is exiting counts as gone from the moment its exit begins, not when it becomes a zombie: the
kernel sets ``PF_EXITING`` (bit 0x4 of field 9 of /proc/<pid>/stat) when a SIGKILL or an exit reaches it, and
from then on none of its code runs again. What follows, before the zombie, is the kernel tearing the process
down: its page tables first, then its files (locks, pidfd readers are told only after both). For a process
that mapped tens of GiB of shared blocks in 4 KiB pages that teardown takes seconds, and several such
processes dying together contend for it; a death seen only at the zombie would keep a dead job's namespace in
/dev/shm that long (``leases.py``'s liveness rule and ``ftd``'s scans read this).  Only the main thread is
read: a process whose main thread ended while its other threads run would count as gone, exiting or zombie
alike; Python's main thread waits for the others before it exits.

Clock: ``host_clock_ns()`` is CLOCK_BOOTTIME, which all processes of a host share, is monotonic, and keeps
counting across suspend (so a suspended host does not make every lease look fresh on resume).
"""

from __future__ import annotations

import functools
import os
import secrets
import time

import msgspec

__all__ = [
    "ParticipantIdentity",
    "process_start_time",
    "is_same_process_alive",
    "pid_namespace",
    "process_gone",
    "host_clock_ns",
    "boot_id",
]

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_START_TIME_FIELD = 22  # 1-based field number in proc(5)
_STATE_FIELD = 3
_FLAGS_FIELD = 9
_PF_EXITING = 0x4  # include/linux/sched.h: "getting shut down"


class ParticipantIdentity(msgspec.Struct, frozen=True):
    """One participant: a process instance plus a per-handle random token (crosses process boundaries)."""

    pid: int
    start_time: int  # clock ticks after boot, /proc/<pid>/stat field 22
    boot_id: str
    token: str  # 16 random bytes, hex

    @classmethod
    def current(cls) -> ParticipantIdentity:
        """A new identity for this process with a fresh token (call once per handle)."""
        pid = os.getpid()
        start = process_start_time(pid)
        if start is None:  # /proc is not mounted: refuse rather than invent an identity
            raise RuntimeError(f"cannot read /proc/{pid}/stat to identify this process; flextensor needs /proc "
                               "(mount procfs in the container)")
        return cls(pid=pid, start_time=start, boot_id=boot_id(), token=secrets.token_hex(16))

    def describe(self) -> str:
        """Short text for logs and error messages."""
        return f"pid {self.pid} (start {self.start_time}, token {self.token[:8]})"


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat, or None when the process is gone.

    Field 2 (comm) is the executable name in parentheses and may itself contain spaces and ')' (a process
    can name itself "a) b"), so split after the *last* ')'.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    _head, sep, tail = data.rpartition(b")")
    if not sep:
        return None
    return tail.decode("ascii", "replace").split()


def _ended(fields: list[str]) -> bool:
    """True when the stat fields show a process whose exit has begun: a zombie or dead task, or one the kernel
    is tearing down (``PF_EXITING``, see the module docstring)."""
    if fields[_STATE_FIELD - 3] in ("Z", "X", "x"):
        return True
    try:
        return bool(int(fields[_FLAGS_FIELD - 3]) & _PF_EXITING)
    except (IndexError, ValueError):
        return False


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks after boot, or ``None`` when it is gone.

    A process whose exit has begun (a zombie, or one being torn down) counts as gone: it will never heartbeat
    again.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"invalid pid {pid!r}: it must be an int > 0")
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        start = int(fields[_START_TIME_FIELD - 3])
    except (IndexError, ValueError):
        return None
    return None if _ended(fields) else start


def is_same_process_alive(identity: ParticipantIdentity) -> bool:
    """True when the process of ``identity`` still runs: same boot, pid present with the same start time."""
    if identity.boot_id != boot_id():
        return False
    try:
        return process_start_time(identity.pid) == identity.start_time
    except ValueError:
        return False


def process_gone(pid: int, start_time: int, boot: str | bytes, pid_ns: int) -> bool:
    """True only when the process (``pid``, ``start_time``) of this boot and of pid namespace ``pid_ns`` is
    certainly gone: ``pid_ns`` is ours (and known, not 0), the boot is this one, and no process runs with
    that pid and start time (one whose exit has begun, a zombie included, counts as gone).

    False whenever we cannot tell (another pid namespace, another boot, an unknown namespace): the caller
    then relies on the lease heartbeat.  A pid hidden from us by ``hidepid`` is never taken for a dead one:
    ``kill(pid, 0)`` still tells "no such process" (ESRCH) apart from "not yours" (EPERM).
    """
    ours = pid_namespace()
    if not ours or pid_ns != ours or pid <= 0:
        return False
    this_boot = boot_id() if isinstance(boot, str) else _boot_id_raw()
    if boot != this_boot:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # it exists, we just cannot read its /proc entry
        return False  # exists but /proc/<pid>/stat unreadable: cannot tell
    try:
        start = int(fields[_START_TIME_FIELD - 3])
    except (IndexError, ValueError):
        return False
    return start != start_time or _ended(fields)


_pid_ns_cache: tuple[int, int] | None = None  # (pid, namespace): a forked child looks again


def pid_namespace() -> int:
    """Inode number of this process's pid namespace (``/proc/self/ns/pid``); 0 when it cannot be known.

    0 also when the mounted /proc belongs to another pid namespace (``/proc/self`` is not our pid): pids read
    from that /proc would not be ours, so no death can be concluded from them.  Namespace inode numbers are
    32-bit proc inodes; they are stored in a 64-bit field anyway.
    """
    global _pid_ns_cache
    pid = os.getpid()
    if _pid_ns_cache is not None and _pid_ns_cache[0] == pid:
        return _pid_ns_cache[1]
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino if int(os.readlink("/proc/self")) == pid else 0
    except (OSError, ValueError):
        ns = 0
    _pid_ns_cache = (pid, ns)
    return ns


def host_clock_ns() -> int:
    """Host-wide monotonic clock (CLOCK_BOOTTIME) in nanoseconds, for lease heartbeats."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


@functools.cache
def boot_id() -> str:
    """This boot's id (/proc/sys/kernel/random/boot_id); constant for the life of the process."""
    with open(_BOOT_ID_PATH, encoding="ascii") as f:
        return f.read().strip()


@functools.cache
def _boot_id_raw() -> bytes:
    import uuid

    return uuid.UUID(boot_id()).bytes
