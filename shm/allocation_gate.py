"""The host-wide allocation gate: one creator at a time checks the free space of ``/dev/shm`` and reserves.

Why a gate: two jobs that each fit in ``/dev/shm`` alone, allocating at the same time in one too small for both,
would each get part of the pages and both fail with ENOSPC. Through the gate a creator checks the free space and
allocates (reserves every page) before the next one looks, so one wins and the other gets ``ShmSpaceError``
with the remedy, at once.

Protocol
--------
The gate is an exclusive ``flock`` on the ``/dev/shm`` directory itself: shared by every process that can use
the segments, it creates no file (nothing to squat or leave behind) and the kernel drops it when its holder
dies. Any user can open that directory, so any user can also take the lock and keep it; a gate that waited for
every holder would let one user stall the creators of all the others. So a creator waits only for holders it
has reason to trust:

- it tries the lock without blocking; when the lock is busy it reads ``/proc/locks`` for the ``FLOCK`` entry on
  the directory's inode and looks the holder's pid up in ``/proc`` (its owner uid);
- a holder of this effective uid is one of our own creators: wait for it, re-checking the holder every
  ``HOLDER_RECHECK_S``, at most ``ALLOCATION_LOCK_WAIT_S`` in all (a stopped process of ours must not wedge us);
- a holder of another uid, or one this process cannot see, is not waited for: the creator allocates without
  the gate at once and logs a WARNING, once per holder, that names the uid (or says it is unknown). Unseen
  means its pid cannot be looked up (gone), or the lock is busy but ``/proc/locks`` lists no holder twice in a
  row, ``INVISIBLE_RECHECK_S`` apart: the kernel leaves out locks of processes outside the reader's pid
  namespace (another container sharing the host's IPC), and a lock released between the two reads is simply
  taken at the next try.

What that costs: between jobs of different users (or pid namespaces) that allocate at the same moment, the race
the gate prevents can happen again; both creators still check the free space before they allocate and unlink a
segment that could not be allocated, so the loser (or both) fail with ``ShmSpaceError`` and leave nothing.
Creators of one user in one pid namespace keep the full guarantee.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

__all__ = ["ALLOCATION_LOCK_MIN_BYTES", "ALLOCATION_LOCK_WAIT_S", "HOLDER_RECHECK_S", "INVISIBLE_RECHECK_S",
           "acquire", "release", "gate_holder"]

logger = logging.getLogger(__name__)

#: Segments at least this large pass through the gate (small blobs do not need it).
ALLOCATION_LOCK_MIN_BYTES = 1 << 20
#: Longest wait for a holder of our own uid; past it, allocate anyway.
ALLOCATION_LOCK_WAIT_S = 120.0
#: How often a waiting creator looks again at who holds the gate (the holder may change).
HOLDER_RECHECK_S = 0.5
#: Second look when the lock is busy and no holder is listed: a holder this process cannot see if still unlisted.
INVISIBLE_RECHECK_S = 0.05
_POLL_S = 0.005

_warned_holders: set[tuple[int, int | None]] = set()


def gate_holder(directory_fd: int) -> tuple[int, int | None] | None:
    """``(pid, uid)`` of the process ``/proc/locks`` names as the holder of an ``flock`` on the directory open
    as ``directory_fd``; ``uid`` is None when that pid cannot be looked up (it has exited). None when no holder
    is listed (the lock was just released, or its holder is outside our pid namespace) or ``/proc/locks``
    cannot be read."""
    st = os.fstat(directory_fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:19:1 0 EOF"; waiters carry a "->" after the number: skip them.
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        if fields[5] != key and not _same_inode(fields[5], st):
            continue
        try:
            pid = int(fields[4])
        except ValueError:
            continue
        if pid <= 0:
            return pid, None
        try:
            return pid, os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return pid, None
    return None


def _same_inode(field: str, st: os.stat_result) -> bool:
    """``/proc/locks`` prints the device as ``major:minor`` in hex with two digits or more: compare by value."""
    try:
        major, minor, inode = field.split(":")
        return (int(major, 16), int(minor, 16), int(inode)) == (os.major(st.st_dev), os.minor(st.st_dev),
                                                                st.st_ino)
    except ValueError:
        return False


def _warn_once(directory: str, pid: int, uid: int | None) -> None:
    if (pid, uid) in _warned_holders:
        return
    _warned_holders.add((pid, uid))
    who = (f"uid {uid} (pid {pid})" if uid is not None else f"a process that has exited (pid {pid})" if pid > 0
           else "a process this one cannot see (another pid namespace)")
    logger.warning("the allocation lock on %s is held by %s, not by a creator of this user (uid %d); allocating "
                   "without it. Two creators that allocate at once may then both find %s full (ShmSpaceError); "
                   "the holder's owner or root can end it (`grep FLOCK /proc/locks` lists it)",
                   directory, who, os.geteuid(), directory)


def acquire(directory: str, size: int) -> int | None:
    """Pass the gate of ``directory`` for a segment of ``size`` bytes; returns the fd that holds the lock (hand
    it to :func:`release`), or None when the segment is small, the directory cannot be opened, the holder is
    not ours (see the module docstring), or a holder of ours kept it past ``ALLOCATION_LOCK_WAIT_S``."""
    if size < ALLOCATION_LOCK_MIN_BYTES:
        return None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    start = time.monotonic()
    next_look = start
    unlisted = 0  # consecutive looks that found the lock busy and no holder listed
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            pass
        except OSError:
            os.close(fd)
            return None
        now = time.monotonic()
        if now >= next_look:
            holder = gate_holder(fd)
            unlisted = unlisted + 1 if holder is None else 0
            if unlisted >= 2:
                holder = (0, None)  # busy, yet listed for nobody: a holder outside our pid namespace
            if holder is not None and holder[1] != os.geteuid():
                _warn_once(directory, *holder)
                os.close(fd)
                return None
            next_look = now + (INVISIBLE_RECHECK_S if unlisted else HOLDER_RECHECK_S)
        if now - start >= ALLOCATION_LOCK_WAIT_S:
            logger.warning("the allocation lock on %s was held by a process of this user for more than %.0f s; "
                           "allocating without it", directory, ALLOCATION_LOCK_WAIT_S)
            os.close(fd)
            return None
        time.sleep(_POLL_S)


def release(fd: int | None) -> None:
    """Leave the gate: closing the only fd of the open file description drops the flock."""
    if fd is not None:
        os.close(fd)
