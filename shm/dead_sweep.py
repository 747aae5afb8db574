"""Reclaiming every dead namespace of one lock directory, without being told their names and without a daemon.

Why: with ``ftd`` running, a job whose workers were all SIGKILLed is reclaimed within a second.  Without it,
such a job's segments stay in ``/dev/shm`` until someone restarts the very same namespace or names it to
``cleanup_namespace`` (base namespace *and* every manager name): a host that runs batch jobs without a daemon
slowly fills its RAM with dead weights.  This module finds those namespaces from the lock directory alone and
reclaims them with the same code and locking as ``cleanup_manager_namespace``.  Three callers:

* ``SharedOffloadSession`` sweeps before each join (:func:`sweep_before_join`: bounded in time, the namespace it
  is joining left to its own election), so any job of the user starting on the host reclaims what crashed jobs
  left;
* ``flextensor.cleanup_dead_namespaces()`` (:func:`cleanup_dead_namespaces`) for scripts and supervisors;
* ``ftd cleanup --dead`` (a systemd timer or a Kubernetes CronJob on hosts without the daemon, ``deploy/``).

Which namespaces: every ``{ns}.journal`` of the lock directory (the journal exists from before a generation's
first resource until after its last; lone lock files hold no memory and are left alone).  A namespace is
*dead* when no lease of its coordinator segment is live under the lease reader's one rule (``leases.py``: on
this host and in our pid namespace a participant whose pid + start time no longer runs is dead at once; one
in another pid namespace only when its heartbeat expired), or when it has a journal but no coordinator segment
(an interrupted creation or cleanup).  That first look takes no lock.  A dead-looking namespace is then handed
to ``cleanup_manager_namespace(ns, timeout=0)``, which takes the coordinator lock without waiting, looks again
under it and removes nothing unless no lease is live: a worker that joins meanwhile wins, and one whose
election holds the lock right now makes the sweep leave the namespace for the next one.

Never touched, each reported in :attr:`DeadSweep.skipped` with its reason (``SKIP_REASONS``): a namespace with
a live lease (``live``), one kept by an ``ftd hold`` (``held``: a live DURABLE slot), anything of another uid
(``other-user``: the lock directory, a journal or a coordinator segment), a lock directory that cannot be
listed (``unreadable``) or that group or others may write (``untrusted``: anyone could plant a journal there),
metadata that cleanup refuses (``corrupt``: its message names ``ftd cleanup NS --force``), a namespace whose
lock is taken now (``busy``), and, when asked to look in ``/dev/shm`` (``look_in_shm``, ``ftd cleanup --dead``),
a dead coordinator segment of this user whose journal is not in this lock directory (``elsewhere``: its workers
had another ``TMPDIR``; only their lock directory's lock makes a removal safe); ``elsewhere`` is also a journal
whose directory of segments is another file system in this process (another mount namespace or container that
shares the lock directory: its segments may be alive where this process cannot see them).

Cost: one ``listdir`` of the lock directory and, per journal, a lock-free map of ``/{ns}.c`` to read its slots;
``/dev/shm`` is listed only to reclaim a namespace (its generation's names and their bytes) or with
``look_in_shm``.  ``bench/bench_dead_sweep.py`` measures it beside 1,000 unrelated entries of ``/dev/shm``.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from flextensor.shm.cleanup import CleanupReport, cleanup_manager_namespace
from flextensor.shm.errors import ShmDirectoryUnseenError, ShmNamespaceHeldError, ShmProtocolError
from flextensor.shm.journal import JOURNAL_SUFFIX, JournalHeader, read_journal
from flextensor.shm.leases import LeaseTable
from flextensor.shm.names import lock_directory_path, validate_namespace
from flextensor.shm import segment_dir
from flextensor.shm.names import coordinator_segment_name
from flextensor.shm.orphans import SHM_DIR, derived_resources

__all__ = ["DeadSweep", "ReclaimedNamespace", "SkippedNamespace", "SKIP_REASONS", "JOIN_SWEEP_BUDGET_S",
           "cleanup_dead_namespaces", "sweep_before_join", "sweep_dead_namespaces"]

logger = logging.getLogger(__name__)

#: Why a namespace was left alone; the first five are normal on a shared host, the rest need an operator.
SKIP_REASONS = ("live", "held", "busy", "other-user", "elsewhere", "unreadable", "untrusted", "corrupt", "error")
#: Reasons that mean this sweep could not do its job in its lock directory (``ftd cleanup --dead`` exits 1); so
#: does a lock directory of another user. ``elsewhere`` is outside the directory swept: a hint, not a failure.
PROBLEM_REASONS = frozenset({"unreadable", "untrusted", "corrupt", "error"})
#: A session's sweep examines no new namespace after this long (the first one is always examined).
JOIN_SWEEP_BUDGET_S = 0.05


class ReclaimedNamespace(msgspec.Struct, frozen=True):
    """One dead namespace removed: the cleanup's report, the names the journal gave it, and the ``/dev/shm``
    memory its files held (allocated blocks, counted just before the removal)."""

    report: CleanupReport
    base: str | None
    manager: str | None
    shm_bytes: int


class SkippedNamespace(msgspec.Struct, frozen=True):
    """A namespace (or, for ``unreadable`` / ``untrusted`` / ``other-user`` lock directories, the directory)
    left untouched; ``reason`` is one of ``SKIP_REASONS``, ``detail`` says why in words and what to do."""

    namespace: str
    reason: str
    detail: str


class DeadSweep(msgspec.Struct):
    """What one sweep of ``lock_dir`` did. ``complete`` is False when its time budget ran out first."""

    lock_dir: str
    reclaimed: list[ReclaimedNamespace] = msgspec.field(default_factory=list)
    skipped: list[SkippedNamespace] = msgspec.field(default_factory=list)
    elapsed_s: float = 0.0
    complete: bool = True

    @property
    def problems(self) -> list[SkippedNamespace]:
        """The skipped entries that mean this lock directory was not fully swept (see ``PROBLEM_REASONS``)."""
        return [s for s in self.skipped
                if s.reason in PROBLEM_REASONS or (s.reason == "other-user" and s.namespace == self.lock_dir)]


def _check_lock_dir(directory: Path, uid: int) -> SkippedNamespace | None:
    """None when ``directory`` may be swept by ``uid``, else why not (a missing directory is handled earlier)."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        return SkippedNamespace(str(directory), "untrusted", f"lock directory {directory} is not a directory (or is "
                                "a symlink); nothing in it is trusted")
    if st.st_uid != uid:
        return SkippedNamespace(str(directory), "other-user", f"lock directory {directory} belongs to uid "
                                f"{st.st_uid}; a dead-namespace sweep reclaims only the calling user's (uid {uid}) "
                                "namespaces: run it as that user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return SkippedNamespace(str(directory), "untrusted", f"lock directory {directory} has mode "
                                f"{stat.S_IMODE(st.st_mode):04o}, writable by group or others, so anyone could plant "
                                f"a journal in it; fix it with `chmod 700 {directory}`")
    return None


def _journaled_namespaces(directory: Path) -> list[str]:
    out = []
    for entry in os.listdir(directory):
        if entry.endswith(JOURNAL_SUFFIX):
            try:
                out.append(validate_namespace(entry[: -len(JOURNAL_SUFFIX)]))
            except ValueError:
                continue  # not a name we make
    return sorted(out)


_DEAD = "dead"  # _peek: a valid coordinator segment without a live lease
_UNSURE = "unsure"  # _peek: no coordinator segment, or one that cannot be read now: judged under the lock


def _peek(ns: str, uid: int) -> SkippedNamespace | str:
    """A lock-free look at ``/{ns}.c`` (in the directory its journal names, read just before: ``segment_dir.py``):
    why the namespace is left alone, or ``_DEAD`` / ``_UNSURE``."""
    path = Path(segment_dir.segment_path(coordinator_segment_name(ns)))
    try:
        owner = os.stat(path).st_uid
    except FileNotFoundError:
        return _UNSURE  # a journal without a coordinator: an interrupted creation or cleanup
    if owner != uid:
        return SkippedNamespace(ns, "other-user", f"{path} belongs to uid {owner}, not to uid {uid}")
    try:
        with LeaseTable.open(ns) as table:
            live = table.live_slots()
    except (OSError, ShmProtocolError):
        return _UNSURE  # an aborted creation is reclaimed under the lock; anything else is refused there, with why
    held = [s for s in live if s.durable]
    if held:
        pids = ", ".join(str(s.identity.pid) for s in held if s.identity is not None)
        return SkippedNamespace(ns, "held", f"an `ftd hold` keeps it (daemon pid {pids})")
    if live:
        pids = ", ".join(str(s.identity.pid) for s in live if s.identity is not None)
        return SkippedNamespace(ns, "live", f"{len(live)} live participant(s) (pids {pids})")
    return _DEAD


def _labels(ns: str, directory: Path) -> JournalHeader | None:
    try:
        return read_journal(ns, lock_dir=directory).header
    except (OSError, ShmProtocolError):
        return None  # an empty or damaged journal: the cleanup under the lock decides what it means


def _shm_bytes(ns: str, directory: Path, uid: int) -> int:
    found = derived_resources(ns, directory, owner_uid=uid)
    total = 0
    for path in found.coordinator + found.generation_shm:
        try:
            total += os.lstat(path).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def _reclaim(ns: str, directory: Path, uid: int, labels: JournalHeader | None
             ) -> ReclaimedNamespace | SkippedNamespace | None:
    shm_bytes = _shm_bytes(ns, directory, uid)
    try:
        report = cleanup_manager_namespace(ns, timeout=0, lock_dir=directory)
    except ShmNamespaceHeldError as exc:
        return SkippedNamespace(ns, "held", str(exc))
    except TimeoutError as exc:
        return SkippedNamespace(ns, "busy", f"in use right now (a worker is joining or leaving): {exc}")
    except ShmProtocolError as exc:
        return SkippedNamespace(ns, "corrupt", str(exc))
    except ShmDirectoryUnseenError as exc:
        return SkippedNamespace(ns, "elsewhere", str(exc))
    except OSError as exc:
        return SkippedNamespace(ns, "error", f"{type(exc).__name__}: {exc}")
    if report.generation is None and not report.removed:
        return None  # someone else reclaimed it meanwhile
    return ReclaimedNamespace(report, labels.base if labels else None, labels.manager if labels else None,
                              shm_bytes)


def _dead_elsewhere(directory: Path, uid: int, journaled: set[str]) -> list[SkippedNamespace]:
    """Dead coordinator segments of ``uid`` whose journal is not in ``directory`` (see ``elsewhere``), in
    ``/dev/shm`` and this process's default directory of segments."""
    out = []
    shm_dirs = dict.fromkeys([SHM_DIR, Path(segment_dir.default_directory())])
    for shm_dir in shm_dirs:
        out += _dead_in(shm_dir, directory, uid, journaled)
    return out


def _dead_in(shm_dir: Path, directory: Path, uid: int, journaled: set[str]) -> list[SkippedNamespace]:
    out = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return out
    for entry in entries:
        if not entry.endswith(".c"):
            continue
        try:
            ns = validate_namespace(entry[:-2])
        except ValueError:
            continue
        if ns in journaled:
            continue
        try:
            if os.lstat(shm_dir / entry).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        segment_dir.bind_namespace(ns, shm_dir)  # no journal to say where: it is where it was found
        if _peek(ns, uid) == _DEAD:
            out.append(SkippedNamespace(ns, "elsewhere", f"{shm_dir / entry} has no live lease, but its journal is "
                                        f"not in {directory}: its workers used another TMPDIR. Reclaim it from "
                                        "theirs: `ftd cleanup --dead --lock-dir THEIR_TMPDIR/flextensor-"
                                        f"{uid}`"))
    return out


def sweep_dead_namespaces(lock_dir: str | os.PathLike[str] | None = None, *, budget_s: float | None = None,
                          exclude: Iterable[str] = (), look_in_shm: bool = False) -> DeadSweep:
    """Reclaim every dead namespace journaled in ``lock_dir`` (default: this user's, ``$TMPDIR/flextensor-<uid>``,
    not created: a sweep where no worker ever ran leaves nothing behind) that belongs to the calling user; see the module docstring for what "dead" means and what is never touched.

    ``budget_s``: examine no new namespace once this many seconds have passed (``complete`` is then False);
    ``exclude``: namespaces to leave to someone else (a joiner's own, whose election reclaims it itself);
    ``look_in_shm``: also report dead coordinator segments of this user journaled elsewhere. Never raises for
    one namespace's trouble: it is reported in ``skipped``.
    """
    start = time.monotonic()
    directory = lock_directory_path() if lock_dir is None else Path(lock_dir)
    sweep = DeadSweep(str(directory))
    uid = os.geteuid()
    excluded = set(exclude)
    try:
        refused = _check_lock_dir(directory, uid)
        namespaces = [] if refused else _journaled_namespaces(directory)
    except FileNotFoundError:
        refused, namespaces = None, []  # no worker ever ran with this TMPDIR: nothing is journaled here
    except PermissionError as exc:
        refused, namespaces = SkippedNamespace(str(directory), "unreadable", f"cannot list lock directory "
                                               f"{directory} ({exc.strerror}); its namespaces were not examined"), []
    if refused is not None:
        sweep.skipped.append(refused)
    examined = 0
    for ns in namespaces:
        if ns in excluded:
            continue
        if budget_s is not None and examined and time.monotonic() - start > budget_s:
            sweep.complete = False  # the first namespace is always examined, so every sweep makes progress
            break
        examined += 1
        try:
            journal_uid = os.lstat(directory / f"{ns}{JOURNAL_SUFFIX}").st_uid
        except FileNotFoundError:
            continue  # reclaimed by its last participant meanwhile
        if journal_uid != uid:
            sweep.skipped.append(SkippedNamespace(ns, "other-user", f"its journal belongs to uid {journal_uid}"))
            continue
        labels = _labels(ns, directory)  # reading the journal also tells where its segments are
        peeked = _peek(ns, uid)
        outcome = peeked if isinstance(peeked, SkippedNamespace) else _reclaim(ns, directory, uid, labels)
        if isinstance(outcome, ReclaimedNamespace):
            sweep.reclaimed.append(outcome)
        elif outcome is not None:
            sweep.skipped.append(outcome)
    if look_in_shm and refused is None and sweep.complete:
        sweep.skipped += _dead_elsewhere(directory, uid, set(namespaces))
    sweep.elapsed_s = time.monotonic() - start
    return sweep


def _describe(item: ReclaimedNamespace) -> str:
    from flextensor.shm.sizes import format_bytes

    name = f"{item.base} / {item.manager} ({item.report.namespace})" if item.base else item.report.namespace
    return (f"{name} generation {item.report.generation}: {len(item.report.removed)} resources, "
            f"{format_bytes(item.shm_bytes)} of {segment_dir.namespace_directory(item.report.namespace)}")


def _log(sweep: DeadSweep, context: str) -> None:
    for item in sweep.reclaimed:
        logger.warning("%s: reclaimed dead namespace %s (every participant was gone)", context, _describe(item))
    for skipped in sweep.skipped:
        level = logging.WARNING if skipped.reason in PROBLEM_REASONS else logging.DEBUG
        logger.log(level, "%s: left %s alone (%s): %s", context, skipped.namespace, skipped.reason, skipped.detail)


def cleanup_dead_namespaces(lock_dir: str | os.PathLike[str] | None = None) -> list[CleanupReport]:
    """Reclaim every namespace of the calling user whose participants are all gone; returns what was reclaimed.

    ``lock_dir``: the workers' lock directory (default: this process's, ``$TMPDIR/flextensor-<uid>``). A
    namespace with one live lease, one kept by ``ftd hold``, another user's, or one in a lock directory that
    cannot be read is never touched (logged, with the reason). The same locking as ``cleanup_namespace``: a
    worker joining meanwhile wins. ``ftd cleanup --dead`` is the same from a shell.
    """
    sweep = sweep_dead_namespaces(lock_dir)
    _log(sweep, "cleanup_dead_namespaces")
    return [item.report for item in sweep.reclaimed]


def sweep_before_join(namespace: str) -> DeadSweep | None:
    """A joiner's sweep of its own lock directory (see the module docstring), within ``JOIN_SWEEP_BUDGET_S``;
    ``namespace`` is left to the joiner's election. Logs what it reclaimed; never raises (None on a failure,
    logged): a sweep must not stop a worker from starting."""
    try:
        sweep = sweep_dead_namespaces(budget_s=JOIN_SWEEP_BUDGET_S, exclude=(namespace,))
    except Exception as exc:  # noqa: BLE001 - the join goes on; the next start sweeps again
        logger.warning("sweep of dead namespaces before joining %s failed: %s: %s", namespace, type(exc).__name__,
                       exc)
        return None
    _log(sweep, f"before joining {namespace}")
    logger.debug("dead-namespace sweep before joining %s: %d reclaimed, %d left alone, %.1f ms%s", namespace,
                 len(sweep.reclaimed), len(sweep.skipped), sweep.elapsed_s * 1e3,
                 "" if sweep.complete else " (budget spent: the rest at the next start)")
    return sweep
