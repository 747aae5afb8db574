"""Unregistering and unmapping pinned segments behind the caller: :func:`release_in_background`.

Why
---
A process that registered a segment's ranges with CUDA must unregister them (``cudaHostUnregister``) before it
unmaps them, and that is slow: seconds for the host blocks of a large model (docs/benchmarks.md, Figures behind
the code). Nobody needs to wait for it. The coordinator's close unlinks the namespace's names whether or
not this process still maps the memory, and the pages are freed when the last mapping goes. So ``close()`` hands
its pinned segments to one process-wide thread (``ft-release``) and returns. The thread unregisters each range
in its own driver call, pausing :data:`PAUSE_S` between two calls (each call holds a driver lock that the
process's kernel launches wait for: a forward of another model running meanwhile is held up by one range at
most), and unmaps a segment only after its last range: the driver never has pages locked that are no longer
mapped. Segments are released in the order they were handed over.

Exit
----
An ``atexit`` hook stops the thread after the call in flight and joins it (at most :data:`EXIT_JOIN_S`). What is
still registered and mapped then goes with the process: the driver drops a dying process's registrations and the
kernel its mappings, exactly as after a crash. So a process that exits right after ``close()`` neither waits for
the rest nor leaves anything in ``/dev/shm`` (its names were unlinked by ``close()`` itself). Before it returns,
the hook drops this process's page-table entries for those mappings from several threads
(:func:`~flextensor.shm.prefault.drop_page_tables`), which the dying process would otherwise tear down in one
thread: a third off the exit of four workers ending together with 24 GiB mapped (docs/benchmarks.md, the exit
floor). The pages stay in their files and registered; nothing reads them any more. The hook runs
before PyTorch's own exit handlers (``atexit`` runs last-registered first, and it is registered when the first
segment is handed over, after CUDA was initialised), so no driver call of the thread overlaps the driver's
teardown. :func:`wait_released` waits until every segment handed over is released (tests; callers that want
the memory back before going on).

Freeing the pages
-----------------
Whichever process unmaps a file's pages last after its name is gone frees them, at a few GB/s: seconds for a
large model, paid inside that process's exit when it exits right after ``close()`` (docs/benchmarks.md, the exit
floor). So a segment handed over keeps a read-only descriptor of its file (opened by name before ``close()``
unlinks it), closed once the segment is unmapped here. At exit, when :data:`REAP_MIN_BYTES` or more are still
queued, the hook hands those descriptors to a small process of its own (``python -I -S``, nothing imported),
which waits for this process to end and then exits, so the pages are freed in that process, after this one
is gone; the descriptors die with it, whatever ends it.

Failure policy: a range the driver refuses to unregister is logged and forgotten (the unmap releases it, as in
:meth:`~flextensor.shm.segment.SharedSegment.unpin`); the thread goes on with the next.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

from .prefault import drop_page_tables
from .segment import SharedSegment

__all__ = ["release_in_background", "wait_released", "pending_releases", "PAUSE_S", "EXIT_JOIN_S"]

logger = logging.getLogger(__name__)

#: Pause between two unregistrations (lets the process's kernel launches through the driver lock).
PAUSE_S = 0.001
#: Longest wait at exit for the driver call in flight.
EXIT_JOIN_S = 30.0
#: The fewest bytes still queued at exit for which the pages are handed to a process of their own.
REAP_MIN_BYTES = 1 << 30
#: That process: wait for the process that started it to end (``argv[1]``), then exit with its descriptors.
#: The parent checked after the pidfd is open: until then its pid may have been reused (it died meanwhile).
_REAPER = """import os, select, sys, time
pid = int(sys.argv[1])
try:
    fd = os.pidfd_open(pid)
except (AttributeError, OSError):
    fd = None
if fd is not None and os.getppid() == pid:
    select.select([fd], [], [])
else:
    while os.getppid() == pid:
        time.sleep(0.05)
"""

_cond = threading.Condition()
_queue: deque[Any] = deque()
_thread: threading.Thread | None = None
_stopping = False
_hooked = False
_files: dict[int, int] = {}  # id(segment) -> a descriptor of its file, while it is queued
_reaper: subprocess.Popen | None = None  # the process that frees what was still mapped at exit


def release_in_background(segment: Any) -> None:
    """Unregister every pinned range of ``segment`` (a :class:`~flextensor.shm.segment.SharedSegment`, or any
    mapping offering the same ``name``, ``pinned``, ``unpin_one()`` and ``close()``: a follower's staging ring) and
    then unmap it, on the release thread; the caller must not use the segment any more. A segment with nothing
    pinned is closed at once. At interpreter exit (the hook has run) the segment is left to the process's end."""
    global _thread, _hooked
    if not segment.pinned:
        segment.close()
        return
    held = _hold_file(segment)
    with _cond:
        if _stopping or any(queued is segment for queued in _queue):  # exiting, or handed over already
            if held is not None:
                os.close(held)
            return
        _queue.append(segment)
        if held is not None:
            _files[id(segment)] = held
        if not _hooked:
            atexit.register(_stop_at_exit)
            _hooked = True
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="ft-release", daemon=True)
            _thread.start()
        _cond.notify_all()


def pending_releases() -> int:
    """Segments handed over and not yet unmapped."""
    with _cond:
        return len(_queue)


def wait_released(timeout: float | None = None) -> bool:
    """Wait until every segment handed over so far is unmapped; False if ``timeout`` seconds passed first."""
    with _cond:
        _cond.wait_for(lambda: not _queue or _stopping, timeout)
        return not _queue


def _pause() -> None:
    time.sleep(PAUSE_S)


def _run() -> None:
    while True:
        with _cond:
            _cond.wait_for(lambda: _queue or _stopping)
            if _stopping:
                return
            segment = _queue[0]  # stays queued until unmapped, so wait_released() sees it
        started = time.monotonic()
        ranges = 0
        try:
            while True:
                with _cond:
                    if _stopping:
                        return
                try:
                    if not segment.unpin_one():
                        break
                except RuntimeError as exc:  # forgotten by the segment; the unmap releases the pages
                    logger.warning("could not unregister a range of %s: %s", segment.name, exc)
                ranges += 1
                _pause()
            segment.close()
        except Exception:  # noqa: BLE001 - one segment's failure must not stop the thread for the others
            logger.exception("releasing shared-memory segment %s failed", getattr(segment, "name", "?"))
        logger.debug("released %s in the background: %d ranges in %.3f s", segment.name, ranges,
                     time.monotonic() - started)
        with _cond:
            held = _files.pop(id(segment), None)
        if held is not None:
            os.close(held)  # the pages are freed here if nothing else maps the file any more
        with _cond:  # only now: wait_released() promises the memory back
            _queue.popleft()
            _cond.notify_all()


def _stop_at_exit() -> None:
    """Stop after the driver call in flight; the rest goes with the process (see the module docstring)."""
    global _stopping
    with _cond:
        _stopping = True
        left = len(_queue)
        _cond.notify_all()
        thread = _thread
    if thread is not None:
        thread.join(EXIT_JOIN_S)
        if thread.is_alive():  # a driver call that never returned: leave its segment alone
            return
    if not left:
        return
    with _cond:
        # shared segments; a staging ring (private, a few hundred MiB) is left to the process's end
        ranges = [(segment.address, segment.size) for segment in _queue if isinstance(segment, SharedSegment)]
        held = [segment for segment in _queue if id(segment) in _files]
        files = [_files.pop(id(segment)) for segment in held]
    held_bytes = sum(segment.size for segment in held)
    try:
        refused = drop_page_tables(ranges)
        logger.debug("exit: %d segment(s) left registered for the process's end to release; their page tables "
                     "dropped (%d pieces refused)", left, refused)
        if files and held_bytes >= REAP_MIN_BYTES:
            _hand_to_reaper(files, held_bytes)
    finally:
        for fd in files:
            os.close(fd)


def _hold_file(segment: Any) -> int | None:
    """A descriptor of a shared segment's file (None: not a shared segment, or its name is gone already)."""
    if not isinstance(segment, SharedSegment):
        return None
    try:
        return segment.open_file()
    except (OSError, ValueError) as exc:  # removed or replaced meanwhile: its pages are freed as before
        logger.debug("no descriptor kept for %s: %s", segment.name, exc)
        return None


def _hand_to_reaper(files: list[int], nbytes: int) -> None:
    """Start the process that holds ``files`` until this process has ended (see the module docstring)."""
    global _reaper
    if not sys.executable or "python" not in os.path.basename(sys.executable).lower():
        return  # an embedding program, not an interpreter to start: the pages go with this process, as before
    try:
        _reaper = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid())],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   pass_fds=files, start_new_session=True)
    except Exception as exc:  # noqa: BLE001 - at exit: the pages are freed by this process's end, as without it
        logger.debug("exit: no process to free %d bytes after this one: %s", nbytes, exc)
        return
    logger.debug("exit: %d bytes of shared pages are freed by process %d once this one has ended", nbytes,
                 _reaper.pid)


def _after_fork_in_child() -> None:
    """A forked child has no release thread and owns none of its parent's registrations."""
    global _thread, _cond
    _cond = threading.Condition()
    _queue.clear()
    _thread = None
    for fd in _files.values():  # the child's copies would keep its parent's pages alive
        os.close(fd)
    _files.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
