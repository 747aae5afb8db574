"""Reclaiming generations nobody holds any more, with the same code as ``cleanup_namespace``.

The reaper never decides on its own authority: it only *calls* ``cleanup_manager_namespace(ns, timeout=0,
lock_dir=...)`` (``flextensor.shm.cleanup``; inside ``acting_in``, as the namespace's owner), which takes the
coordinator lock, re-reads the journal and the lease table and removes nothing while any lease is live or the
metadata cannot be trusted.  The registry's view (possibly a few hundred milliseconds old) only picks the
candidates:

* ``death``   - the last live lease was ended by the daemon (a watched process exited);
* ``expired`` - every lease ran out (processes that never registered, or from another pid namespace);
* ``orphan``  - a journal without a (complete) coordinator segment: an interrupted creation or cleanup. A
  creation *in progress* holds the coordinator lock, so cleanup's one-try lock acquisition fails
  (``TimeoutError``) and the candidate is simply retried at the next scan.

Generations whose journal or header cannot be trusted (``CORRUPT``) are never touched; the error is logged
once and shown by ``ftd ls``.

Cleanup requests from the CLI (``ftd cleanup ... --timeout S``) are *deferred*: rather than block the event
loop for ``S`` seconds, each pending request is retried with ``timeout=0`` on every loop turn until it
succeeds for all its namespaces or its deadline passes.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from flextensor.shm.cleanup import CleanupReport, cleanup_manager_namespace
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.ftd_protocol import CleanupReply, CleanupRow, ErrorReply
from flextensor.shm.identity import host_clock_ns

from flextensor.daemon.lockdirs import LockDir, acting_in
from flextensor.daemon.registry import NamespaceView, Registry

__all__ = ["Reaper", "PendingCleanup", "RECLAIMABLE_STATES"]

logger = logging.getLogger(__name__)

RECLAIMABLE_STATES = ("INITIALIZING", "READY", "FAILED", "ORPHAN", "CREATING")


#: A waiting cleanup is retried after 50 ms, then less and less often, up to every 0.5 s: a handful of queued
#: requests must not keep the daemon busy (deaths on this host are seen at once; expiries come when they come).
PENDING_RETRY_MIN_S = 0.05
PENDING_RETRY_MAX_S = 0.5


@dataclasses.dataclass
class PendingCleanup:
    """A ``cleanup`` request waiting for leases to expire (answered by the server when done)."""

    reply_to: list[bytes]  # routing frames of the requester
    lock_dir: LockDir
    namespaces: list[str]
    deadline: float  # time.monotonic()
    uid: int = -1  # the requester (bounds how many cleanups one user may queue)
    next_try: float = 0.0  # time.monotonic() of the next attempt (backs off while leases stay live)
    backoff: float = PENDING_RETRY_MIN_S
    started: float = dataclasses.field(default_factory=time.monotonic)
    reports: list[CleanupRow] = dataclasses.field(default_factory=list)
    last_error: str = ""


class Reaper:
    """Runs reclaims for the server (one thread: the server's)."""

    def __init__(self, registry: Registry, metrics) -> None:
        self.registry = registry
        self.metrics = metrics
        self.pending: list[PendingCleanup] = []

    # ------------------------------------------------------------------ automatic reclaims
    def candidates(self) -> list[tuple[NamespaceView, str]]:
        out = []
        for view in list(self.registry.views.values()):
            if view.state not in RECLAIMABLE_STATES or view.live:
                continue
            if view.namespace in self.registry.holds:
                continue  # our own hold is live by definition; a lost one is dropped by the server first
            if view.state in ("ORPHAN", "CREATING"):
                reason = "orphan"
            elif view.dead_at_ns:
                reason = "death"
            else:
                reason = "expired"
            out.append((view, reason))
        return out

    def reap(self) -> int:
        """Try every candidate of the last scan; returns how many generations were reclaimed."""
        return sum(1 for view, reason in self.candidates() if self.reclaim(view, reason) is not None)

    def reclaim(self, view: NamespaceView, reason: str) -> CleanupReport | None:
        """``cleanup_manager_namespace(ns, timeout=0)`` as the namespace's owner; None if not done now."""
        ns = view.namespace
        since = view.reclaimable_since_ns
        try:
            with acting_in(view.lock_dir):
                report = cleanup_manager_namespace(ns, timeout=0, lock_dir=view.lock_dir.path)
        except TimeoutError as exc:
            logger.debug("not reclaiming %s now: %s", ns, exc)  # live lease or the lock is taken: next scan
            return None
        except (ShmProtocolError, OSError) as exc:
            self.metrics.reclaim_errors.inc()
            view.state, view.error = "CORRUPT" if isinstance(exc, ShmProtocolError) else view.state, str(exc)
            if view.logged_error != str(exc):  # once per distinct error, not once per scan
                view.logged_error = str(exc)
                logger.error("not reclaiming %s (retried at every scan): %s", ns, exc)
            return None
        self.registry.forget(ns)
        if report.generation is not None or report.removed:
            self.metrics.reclaims.labels(reason=reason).inc()
            if since is not None:
                self.metrics.reclaim_latency.observe(max(0.0, (host_clock_ns() - since) / 1e9))
            logger.info("reclaimed %s generation %s (%s): removed %d resources", ns, report.generation, reason,
                        len(report.removed))
        return report

    # ------------------------------------------------------------------ cleanup requests
    def add_pending(self, job: PendingCleanup) -> None:
        self.pending.append(job)

    def _advance(self, job: PendingCleanup) -> bool:
        """Try the job's remaining namespaces once; True when it is finished (all done or failed)."""
        while job.namespaces:
            ns = job.namespaces[0]
            try:
                with acting_in(job.lock_dir):
                    report = cleanup_manager_namespace(ns, timeout=0, lock_dir=job.lock_dir.path)
            except TimeoutError as exc:
                job.last_error = str(exc)
                return False
            except (ShmProtocolError, OSError, ValueError) as exc:
                job.last_error = f"{type(exc).__name__}: {exc}"
                job.namespaces.clear()
                return True
            self.registry.forget(ns)
            if report.generation is not None:
                self.metrics.reclaims.labels(reason="request").inc()
            job.reports.append(CleanupRow(namespace=report.namespace, generation=report.generation,
                                          removed=list(report.removed), already_absent=list(report.already_absent),
                                          waited_s=round(time.monotonic() - job.started, 6)))
            job.namespaces.pop(0)
        job.last_error = ""
        return True

    def poll_pending(self) -> list[tuple[list[bytes], CleanupReply | ErrorReply]]:
        """Advance every pending cleanup; returns (routing frames, reply) for the finished ones."""
        done: list[tuple[list[bytes], CleanupReply | ErrorReply]] = []
        now = time.monotonic()
        for job in list(self.pending):
            if now < job.next_try and now < job.deadline:
                continue
            finished = self._advance(job)
            if not finished and now < job.deadline:
                job.next_try = now + job.backoff
                job.backoff = min(job.backoff * 2, PENDING_RETRY_MAX_S)
                continue
            self.pending.remove(job)
            if job.last_error:
                code = "timeout" if not finished else "conflict"
                partial = ", ".join(r.namespace for r in job.reports)
                message = job.last_error + (f" (already cleaned: {partial})" if partial else "")
                done.append((job.reply_to, ErrorReply(code=code, message=message)))
            else:
                done.append((job.reply_to, CleanupReply(reports=job.reports)))
        return done

    def next_pending_delay(self) -> float | None:
        """Seconds until pending jobs should be retried (None: nothing pending)."""
        if not self.pending:
            return None
        now = time.monotonic()
        return max(0.0, min(min(job.next_try, job.deadline) for job in self.pending) - now)
