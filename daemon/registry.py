"""The daemon's view of the host: lock directories, namespaces, their generation, participants and holds.

Source of truth
---------------
Nothing here is authoritative: the journals (lock directories) and the lease tables (``/dev/shm/{ns}.c``)
are.  The registry is a cache rebuilt by :meth:`Registry.scan` every ``reap_interval`` and at start, so a
daemon that was SIGKILLed and restarted knows everything it needs after its first scan.  What only the
daemon knows is which processes registered, labels (base/manager), drains, and holds.  Holds and watched
processes (with their lock directories) are kept in ``<socket>.state`` (``state_file.py``) and restored at
start (``holds.restore_hold``, :meth:`Registry.rewatch`); live processes are also re-adopted from the lease
tables (see below).  Drains, and labels of namespaces that are not held, are lost with the daemon.

Watching processes
------------------
A registered participant is watched through a pidfd (``os.pidfd_open``) that the server polls next to its
ZeroMQ socket: it becomes readable the moment the process exits (after the kernel closed its files, so its
``flock`` is already released).  The daemon then ends that participant's lease slot with a compare-and-end
(``end_lease(slot, identity)``: one aligned store of DEAD, only while the slot is ACTIVE, unexpired and still
held by that identity), so followers waiting on a dead creator raise ``ShmCreatorDiedError`` on their next
poll, and a namespace left with no live lease is reclaimed at once.

*Adoption*: at every scan, a live slot whose (pid, start time, boot id) names a process visible in the
daemon's pid namespace is watched too, even if it never registered (and after a daemon restart).  A pid
from another pid namespace (a container without ``hostPID``) does not match the start time and is judged
by its lease alone.

Acting for a user
-----------------
A root daemon serves several users.  It never changes its *real* uid (a process whose real uid is the
user's could be signalled or traced by that user), and it passes the lock directory explicitly to every
``flextensor.shm`` call (``lock_dir=``), so nothing depends on its own ``TMPDIR`` or uid.

* Reading and ending leases need no switch: scanning journals, mapping ``/dev/shm/{ns}.c`` and storing DEAD
  in a lease slot create nothing, and root may do them directly.
* Operations under the coordinator lock that may create or remove files (cleanup and reclaim, hold,
  release) run inside :func:`acting_in`, which switches only the *effective* uid/gid (``seteuid``/``setegid``,
  supplementary groups cleared) to the lock directory's owner and restores root in a ``finally``.  A lock
  file the daemon (re)creates then belongs to that user, so the workers can still open it; and
  ``/dev/shm``'s sticky bit stops the daemon from unlinking another user's segments even if a journal in
  this user's directory were forged to name them.

Lock directories must be named ``flextensor-<uid of their owner>`` (as workers create them) and must not be
writable by group or others (:func:`inspect_lock_dir`).
"""

from __future__ import annotations

import logging
import os
import select
import stat
from pathlib import Path

from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.header import AbortedCreationError, open_coordinator_segment, read_state
from flextensor.shm.identity import ParticipantIdentity, boot_id, host_clock_ns, process_start_time
from flextensor.shm.journal import MAX_JOURNAL_BYTES, list_journals, read_journal
from flextensor.shm.activity import weights_version
from flextensor.shm.leases import Activity, LeaseSlot, LeaseTable, SlotState
from flextensor.shm.names import coordinator_segment_name
from flextensor.shm import segment_dir

from flextensor.daemon.lockdirs import LockDir, configured_lock_dir, inspect_lock_dir, segment_owner_uid
from flextensor.daemon.records import Hold, NamespaceView, Participant

__all__ = ["Participant", "NamespaceView", "Hold", "Registry"]


def _member_state(slot: LeaseSlot) -> str:
    """What ``ftd ls`` says a live participant does: its activity, or ``held`` for an ftd hold."""
    if slot.durable:
        return "held"
    try:
        return Activity(slot.activity).name.lower()
    except ValueError:
        return f"unknown ({slot.activity})"


logger = logging.getLogger(__name__)


class Registry:
    """The daemon's cache of the host (see the module docstring); used only from the server's thread."""

    def __init__(self, lock_dirs: list[str], metrics) -> None:
        self.configured_lock_dirs = [os.path.abspath(d) for d in lock_dirs]
        self.learned_lock_dirs: dict[str, LockDir] = {}  # from registrations / requests of their owners
        self.views: dict[str, NamespaceView] = {}
        self.participants: dict[tuple[str, str], Participant] = {}  # (namespace, token) -> watched process
        self.by_fd: dict[int, list[Participant]] = {}
        self.holds: dict[str, Hold] = {}
        self.draining: dict[str, set[int]] = {}  # per-manager namespace -> uids that drained it
        self.draining_bases: dict[str, set[int]] = {}  # base namespace -> uids that drained it
        self.labels: dict[str, tuple[str | None, str | None]] = {}  # namespace -> (base, manager)
        self.metrics = metrics
        self._logged_dir_errors: set[str] = set()
        self._logged_squatters: set[tuple[str, int]] = set()  # squatted lock directory names (logged once each)
        self._distrusted: set[tuple[str, str, str]] = set()  # journals ignored (logged once each)
        self._boot_id = boot_id()
        self.on_watch_added = lambda fd: None  # set by the server: start polling a pidfd
        self.on_watch_removed = lambda fd: None

    # ------------------------------------------------------------------ lock directories
    def lock_dirs(self) -> list[LockDir]:
        """Every lock directory that exists and may be acted in (configured first, then learned)."""
        out: dict[str, LockDir] = {}
        for configured in self.configured_lock_dirs:
            path, squatted = configured_lock_dir(configured)
            for other, uid in squatted:
                if (other, uid) not in self._logged_squatters:
                    self._logged_squatters.add((other, uid))
                    logger.warning("lock directory %s belongs to uid %d, not to the uid its name gives: another user "
                                   "may be trying to block that user's jobs; watching %s instead (the workers use "
                                   "it too). That user or root can remove it (`rm -r %s`)", other, uid, path, other)
            try:
                out[path] = inspect_lock_dir(path)
                self._logged_dir_errors.discard(path)
            except FileNotFoundError:
                continue  # no worker of that user ran yet
            except PermissionError as exc:
                if path not in self._logged_dir_errors:
                    self._logged_dir_errors.add(path)
                    logger.error("not watching %s: %s", path, exc)
        for path, lock_dir in list(self.learned_lock_dirs.items()):
            if path not in out:
                try:
                    out[path] = inspect_lock_dir(path)
                except (FileNotFoundError, PermissionError):
                    del self.learned_lock_dirs[path]
        return list(out.values())

    def learn_lock_dir(self, lock_dir: LockDir) -> None:
        if lock_dir.path not in self.configured_lock_dirs:
            self.learned_lock_dirs[lock_dir.path] = lock_dir

    # ------------------------------------------------------------------ scanning
    def scan(self) -> list[NamespaceView]:
        """Refresh every namespace of every lock directory; returns the current views."""
        seen: set[str] = set()
        for lock_dir in self.lock_dirs():
            try:
                for ns in list_journals(lock_dir.path):
                    if ns in seen:
                        continue  # the same namespace in two lock directories: first one wins
                    if not self._journal_trusted(lock_dir, ns):
                        continue
                    seen.add(ns)
                    view = self.views.get(ns)
                    if view is None or view.lock_dir.path != lock_dir.path:
                        if view is not None:
                            view.close_mapping()
                        view = self.views[ns] = NamespaceView(ns, lock_dir)
                    self.refresh(view)
            except OSError as exc:
                logger.warning("cannot scan lock directory %s: %s", lock_dir.path, exc)
        for ns in [ns for ns in self.views if ns not in seen]:
            self.forget(ns)
        self.update_gauges()
        return list(self.views.values())

    def _journal_trusted(self, lock_dir: LockDir, ns: str) -> bool:
        """A journal counts only when it is a regular file of the lock directory's owner, at most
        ``MAX_JOURNAL_BYTES`` long, for a namespace whose coordinator segment (if any) belongs to that same
        owner: a file another user planted in their own lock directory never decides how we treat a namespace
        of someone else (and a huge sparse file is never read)."""
        path = Path(lock_dir.path) / f"{ns}.journal"
        try:
            st = os.lstat(path)
        except OSError:
            return False
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "it is not a regular file"
        elif st.st_uid != lock_dir.uid:
            problem = f"it belongs to uid {st.st_uid}, not to the lock directory's owner (uid {lock_dir.uid})"
        elif st.st_size > MAX_JOURNAL_BYTES:
            problem = f"it holds {st.st_size} bytes, more than a journal ever does ({MAX_JOURNAL_BYTES})"
        else:
            owner = segment_owner_uid(ns)
            if owner is not None and owner != lock_dir.uid:
                problem = (f"namespace {ns}'s coordinator segment belongs to uid {owner}, not to the owner of this "
                           f"lock directory (uid {lock_dir.uid})")
        if problem is None:
            return True
        key = (lock_dir.path, ns, problem)
        if key not in self._distrusted:
            self._distrusted.add(key)
            logger.warning("ignoring journal %s: %s", path, problem)
        return False

    def view_for(self, namespace: str, lock_dir: LockDir) -> NamespaceView:
        """The view of ``namespace`` (created and refreshed when new)."""
        view = self.views.get(namespace)
        if view is None:
            view = self.views[namespace] = NamespaceView(namespace, lock_dir)
            self.refresh(view)
        return view

    def _map(self, view: NamespaceView) -> LeaseTable | None:
        """Map (or keep mapped) ``/{ns}.c``; None when it does not exist.  Raises what the header raises."""
        path = segment_dir.segment_path(coordinator_segment_name(view.namespace))  # where the journal said
        try:
            st = os.stat(path)
        except FileNotFoundError:
            view.close_mapping()
            return None
        view.owner_uid = st.st_uid
        if view.segment is not None and view.segment_ino == st.st_ino and view.table is not None:
            return view.table
        view.close_mapping()
        segment, header = open_coordinator_segment(view.namespace)
        try:
            same = os.stat(path).st_ino == st.st_ino
        except FileNotFoundError:
            same = False
        if not same:  # replaced or removed while we mapped it: look again at the next scan
            segment.close()
            return None
        view.segment, view.segment_ino, view.header = segment, st.st_ino, header
        view.table = LeaseTable(segment.buffer, header.slot_count, segment=segment.name)
        view.dead_at_ns.clear()
        view.expired_seen.clear()
        view.adoption_checked.clear()
        return view.table

    def refresh(self, view: NamespaceView) -> None:
        """Re-read one namespace from its journal and lease table (read-only: needs no ``acting_in``)."""
        ns = view.namespace
        view.base, view.manager = self.labels.get(ns, (view.base, view.manager))
        state: str | None = None
        error: str | None = None
        journal = None
        journal_file = Path(view.lock_dir.path) / f"{ns}.journal"
        try:
            if journal_file.stat().st_size == 0:
                state = "CREATING"  # header not written yet, or its creator died: the reaper checks under the lock
            else:
                journal = read_journal(journal_file)
                header = journal.header
                view.shm_dir = header.shm_dir
                if header.base is not None and ns not in self.labels:  # read_journal checked they derive ns
                    self.labels[ns] = (header.base, header.manager)
                    view.base, view.manager = header.base, header.manager
        except FileNotFoundError:
            pass
        except ShmProtocolError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"cannot read journal {journal_file}: {exc}"
        try:
            table = self._map(view)
        except AbortedCreationError:
            table = None
            state = "CREATING"
        except (ShmProtocolError, ValueError, PermissionError) as exc:
            table = None
            view.close_mapping()
            error = error or str(exc)
        if view.owner_uid is None:
            view.owner_uid = view.lock_dir.uid
        now = host_clock_ns()
        if table is not None and view.header is not None:
            try:
                state = read_state(view.segment.buffer, view.header.segment).name  # type: ignore[union-attr]
                slots = table.slots(now)
            except ShmProtocolError as exc:
                error, slots = str(exc), []
            view.generation = view.header.generation
            view.created_at = view.header.created_at_ns / 1e9
            view.live = sum(1 for s in slots if s.live)
            view.members = [(s.identity.pid, s.index, _member_state(s), s.held_version) for s in slots
                            if s.live and s.identity is not None]
            view.weights_version = weights_version(view.segment.buffer)  # type: ignore[union-attr]
            self._track_slots(view, slots, now)
        else:
            state = state or "ORPHAN"
            view.live = 0
            view.members, view.weights_version = [], 0
            view.reclaimable_since_ns = view.reclaimable_since_ns or now
            if journal is not None:
                view.generation = journal.generation
            try:
                view.created_at = view.created_at or journal_file.stat().st_mtime
            except OSError:
                pass
        if error is not None:
            state = "CORRUPT"
            if view.logged_error != error:
                view.logged_error = error
                logger.error("namespace %s cannot be trusted (nothing will be removed): %s", ns, error)
        assert state is not None, "a mapped header gives the state, else an error or ORPHAN did"
        view.state, view.error = state, error
        view.bytes = self._bytes(view, journal)

    def _track_slots(self, view: NamespaceView, slots: list, now: int) -> None:
        """Lease expiries (metric), reclaimable-since, and adoption of unregistered live processes."""
        last_end = None
        for slot in slots:
            if slot.identity is None:
                continue
            token = slot.identity.token
            if slot.state == SlotState.ACTIVE and slot.process_gone:
                # Its process is gone (same host and pid namespace): the lease reader stopped counting it at once,
                # before any pidfd event or registration; a death, not an expiry.
                if self._note_death(view, token, now):
                    logger.info("%s of %s exited (lease slot %d no longer counts)", slot.identity.describe(),
                                view.namespace, slot.index)
                end = view.dead_at_ns[token]
            elif slot.state == SlotState.ACTIVE and not slot.live:
                if token not in view.expired_seen:
                    view.expired_seen.add(token)
                    self.metrics.lease_expiries.inc()
                    logger.info("lease of %s in %s expired", slot.identity.describe(), view.namespace)
                end = slot.heartbeat_ns + slot.lease_ns
            elif slot.state == SlotState.DEAD:
                end = view.dead_at_ns.get(token, now)
            else:
                if slot.live and (view.namespace, token) not in self.participants:
                    self._maybe_adopt(view, slot)
                continue
            last_end = end if last_end is None else max(last_end, end)
        if view.live:
            view.reclaimable_since_ns = None
        elif view.reclaimable_since_ns is None:
            view.reclaimable_since_ns = min(last_end or now, now)

    def _note_death(self, view: NamespaceView, token: str, now: int) -> bool:
        """Record a participant's death once (metric and reclaim reason); True the first time."""
        if token in view.dead_at_ns:
            return False
        view.dead_at_ns[token] = now
        self.metrics.deaths.inc()
        return True

    def _maybe_adopt(self, view: NamespaceView, slot) -> None:
        identity = slot.identity
        if identity.token in view.adoption_checked:
            return
        view.adoption_checked.add(identity.token)
        if identity.boot_id != self._boot_id or identity.pid == os.getpid() or identity.pid <= 0:
            return
        hold = self.holds.get(view.namespace)
        if hold is not None and hold.identity.token == identity.token:
            return  # our own hold, maybe in a slot taken over from a previous daemon that still names its pid
        self._watch(view, slot.index, identity, identity.pid, uid=None, adopted=True)

    def _bytes(self, view: NamespaceView, journal) -> int:
        names = [coordinator_segment_name(view.namespace)]
        if journal is not None:
            names += [i.name for i in journal.resources() if i.kind == "segment"]
        total = 0
        for name in names:
            try:
                total += os.stat(segment_dir.segment_path(name)).st_size
            except OSError:
                pass
        return total

    # ------------------------------------------------------------------ watching processes
    def _watch(self, view: NamespaceView, slot_index: int, identity: ParticipantIdentity, pid: int, *,
               uid: int | None, adopted: bool) -> Participant | None:
        """Open a pidfd on ``pid`` if it is ``identity``'s process; None when it is not (or already gone)."""
        try:
            if process_start_time(pid) != identity.start_time:
                return None
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, ValueError, OSError):
            return None
        if process_start_time(pid) != identity.start_time:  # the pid was recycled between the two reads
            os.close(fd)
            return None
        key = (view.namespace, identity.token)
        old = self.participants.pop(key, None)
        if old is not None:
            self._drop_fd(old)
        participant = Participant(view.namespace, slot_index, identity, pid, fd, uid, adopted)
        self.participants[key] = participant
        self.by_fd.setdefault(fd, []).append(participant)
        self.on_watch_added(fd)
        logger.debug("watching %s of %s (pid %d here, %s)", identity.describe(), view.namespace, pid,
                     "adopted" if adopted else "registered")
        return participant

    def _drop_fd(self, participant: Participant) -> None:
        group = self.by_fd.get(participant.pidfd)
        if group is not None and participant in group:
            group.remove(participant)
            if not group:
                del self.by_fd[participant.pidfd]
                self.on_watch_removed(participant.pidfd)
                os.close(participant.pidfd)

    def unwatch(self, namespace: str, token: str) -> bool:
        participant = self.participants.pop((namespace, token), None)
        if participant is None:
            return False
        self._drop_fd(participant)
        return True

    def register(self, view: NamespaceView, slot_index: int, identity: ParticipantIdentity,
                 peer_pid: int | None, peer_uid: int | None) -> Participant:
        """Watch a participant that says it holds ``slot_index``; ``LookupError``/``RuntimeError`` if not.

        The caller checked ownership and draining.
        """
        table = self._map(view)
        if table is None:
            raise LookupError(f"namespace {view.namespace} has no coordinator segment; register after joining")
        slot = table.slot(slot_index)
        if slot.state != SlotState.ACTIVE or slot.identity != identity:
            raise RuntimeError(f"lease slot {slot_index} of {view.namespace} is not held by "
                               f"{identity.describe()} (state {slot.state.name}); register right after joining")
        candidates = []
        if peer_pid:
            candidates.append(peer_pid)  # the kernel translated it into our pid namespace
        if identity.boot_id == self._boot_id and identity.pid not in candidates:
            candidates.append(identity.pid)
        for pid in candidates:
            participant = self._watch(view, slot_index, identity, pid, uid=peer_uid, adopted=False)
            if participant is not None:
                view.adoption_checked.add(identity.token)
                return participant
        raise RuntimeError(
            f"cannot observe {identity.describe()} from the daemon: no process with its start time is visible in "
            "the daemon's pid namespace (run ftd with hostPID / in the workers' pid namespace); its lease still "
            "protects it"
        )

    def rewatch(self, namespace: str, slot_index: int, identity: ParticipantIdentity, pid: int, uid: int | None,
                adopted: bool) -> str:
        """Carry on watching a participant the previous daemon watched (from ``<socket>.state``).

        The caller checked that the previous daemon ran on this boot in this pid namespace, so ``pid`` (the pid
        that daemon saw, translated by the kernel at registration) still names the same processes here.  If
        the slot still holds ``identity`` with a live lease: a process with that pid and start time is watched
        again; without one, the participant died while no daemon ran and its lease is ended now (the dead
        process cannot refresh it, and ``end_lease`` re-checks identity and expiry right before the store).
        Returns ``"watching"``, ``"ended"`` or ``"gone"`` (it left, expired, or its slot was reused: nothing to do).
        """
        view = self.views.get(namespace)
        if view is None or pid <= 0 or identity.boot_id != self._boot_id:
            return "gone"
        try:
            table = self._map(view)
            slot = None if table is None else table.slot(slot_index)
        except (ShmProtocolError, AbortedCreationError, ValueError, PermissionError, IndexError, OSError):
            return "gone"
        if table is None or slot is None or slot.state != SlotState.ACTIVE or slot.identity != identity or not (
                slot.live or slot.process_gone):
            return "gone"
        if (namespace, identity.token) in self.participants:
            return "watching"  # adopted by the first scan already
        if process_start_time(pid) == identity.start_time:
            view.adoption_checked.add(identity.token)
            self._watch(view, slot_index, identity, pid, uid=uid, adopted=adopted)
            return "watching"
        if not table.end_lease(slot_index, identity):
            return "gone"
        self._note_death(view, identity.token, host_clock_ns())
        logger.info("%s of %s exited while no daemon ran (lease slot %d): lease ended", identity.describe(),
                    namespace, slot_index)
        self.refresh(view)
        return "ended"

    def process_exited(self, fd: int) -> list[NamespaceView]:
        """A pidfd became readable: end the leases its process still held; returns the views to re-check."""
        if not select.select([fd], [], [], 0)[0]:
            return []  # a stale event for an fd number that was closed and reused meanwhile: not a death
        group = self.by_fd.pop(fd, [])
        self.on_watch_removed(fd)
        os.close(fd)
        touched: list[NamespaceView] = []
        now = host_clock_ns()
        for participant in group:
            self.participants.pop((participant.namespace, participant.identity.token), None)
            view = self.views.get(participant.namespace)
            if view is None:
                continue
            try:
                table = self._map(view)
                if table is None:
                    continue
                # Compare-and-end: only the lease the dead process still holds, never a slot reused since.
                if table.end_lease(participant.slot_index, participant.identity):
                    self._note_death(view, participant.identity.token, now)
                    logger.info("%s of %s exited holding lease slot %d: lease ended",
                                participant.identity.describe(), view.namespace, participant.slot_index)
                self.refresh(view)
            except (OSError, ShmProtocolError, IndexError) as exc:
                logger.warning("could not end the lease of %s in %s: %s", participant.identity.describe(),
                               participant.namespace, exc)
                continue
            if view not in touched:
                touched.append(view)
        return touched

    # ------------------------------------------------------------------ forgetting
    def forget(self, namespace: str) -> None:
        """Drop everything cached about ``namespace`` (reclaimed, or its journal disappeared)."""
        view = self.views.pop(namespace, None)
        if view is not None:
            view.close_mapping()
        for key in [k for k in self.participants if k[0] == namespace]:
            self._drop_fd(self.participants.pop(key))
        self.update_gauges()

    # ------------------------------------------------------------------ summaries
    def is_draining(self, namespace: str, base: str | None, owner_uid: int | None) -> bool:
        """Whether a drain applies to ``namespace`` owned by ``owner_uid``.

        A drain only ever applies to namespaces its requester owns (or root's drains, to anyone's): a user who
        drains a name another user has not used yet must not be able to refuse that user's workers.
        """
        def applies(drainers: set[int]) -> bool:
            return any(d == 0 or owner_uid is None or d == owner_uid for d in drainers)

        if applies(self.draining.get(namespace, set())):
            return True
        return base is not None and applies(self.draining_bases.get(base, set()))

    def undrain(self, namespace: str, uid: int) -> None:
        """Undo ``uid``'s drain of ``namespace`` (root: every user's)."""
        self._undo(self.draining, namespace, uid)

    def undrain_base(self, base: str, uid: int) -> None:
        """Undo ``uid``'s drain of base namespace ``base`` (root: every user's)."""
        self._undo(self.draining_bases, base, uid)

    @staticmethod
    def _undo(table: dict[str, set[int]], key: str, uid: int) -> None:
        drainers = table.get(key, set())
        if uid == 0:
            drainers.clear()
        else:
            drainers.discard(uid)
        if not drainers:
            table.pop(key, None)

    def row_state(self, view: NamespaceView) -> str:
        base = view.base or self.labels.get(view.namespace, (None, None))[0]
        if self.is_draining(view.namespace, base, view.owner_uid if view.owner_uid is not None
                            else view.lock_dir.uid):
            return "DRAINING"
        return view.state

    def update_gauges(self) -> None:
        m = self.metrics
        views = list(self.views.values())
        m.namespaces.set(len(views))
        m.set_generation_states(self.row_state(v) for v in views)
        m.bytes_shared.set(sum(v.bytes for v in views))
        m.participants.set(sum(v.live for v in views))
        m.registered.set(len(self.participants))
        m.held.set(len(self.holds))
        m.draining.set(len(self.draining) + len(self.draining_bases))  # names, whoever drained them

    def close(self) -> None:
        for ns in list(self.views):
            self.forget(ns)
        for participant in list(self.participants.values()):
            self._drop_fd(participant)
        self.participants.clear()

