"""Joining a worker thread through Ctrl-C: :func:`join_through_interrupts`.

Why not ``Thread.join`` in a loop on ``is_alive()``: on Python 3.11 a ``Thread.join`` that an interrupt (a
``KeyboardInterrupt`` from SIGINT) stops can mark a thread that still runs as stopped, so the loop ends while the
thread still works, and a caller that then cleans up what the thread writes into races it. The thread sets an
``Event`` as its work ends instead; the caller waits on that (an interrupted ``Event.wait`` leaves nothing
inconsistent), then joins the thread, which by then only has its last instructions left.
"""

from __future__ import annotations

import threading

__all__ = ["join_through_interrupts"]


def join_through_interrupts(thread: threading.Thread, done: threading.Event,
                            cancel: threading.Event | None = None) -> None:
    """Return once ``done`` is set (``thread``'s work ended) and ``thread`` is joined. An interrupt meanwhile sets
    ``cancel`` (the thread's cue to stop early) and the wait goes on; the first interrupt is re-raised at the end.
    A thread never started is not waited for."""
    if thread.ident is None:
        return
    interrupted: BaseException | None = None
    while not done.is_set():
        try:
            done.wait()
        except BaseException as exc:  # noqa: BLE001 - e.g. KeyboardInterrupt: finish the wait, then raise
            interrupted = interrupted or exc
            if cancel is not None:
                cancel.set()
    try:
        thread.join()
    except BaseException as exc:  # noqa: BLE001 - the work is done; the interrupt goes on below
        interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
