"""``ftd serve``: the socket, the event loop, start-up and shutdown.

Event loop
----------
One thread does everything that touches the registry: a ``zmq.Poller`` waits at once on

* the ROUTER socket bound at ``ipc://<socket>`` (requests; see ``flextensor.shm.ftd_protocol``),
* one pidfd per watched process (readable when it exits -> end its lease, maybe reclaim),
* the read end of a self-pipe that signal handlers write to (``signal.set_wakeup_fd``),

with a timeout that brings the next scan (every ``reap_interval``: rescan the journals, count expiries,
adopt processes, reclaim) or the next retry of a pending cleanup.  Nothing in the loop blocks for long:
cleanup and hold use one-try / 1-second lock acquisitions, and cleanups that wait for leases are deferred.

Single instance
---------------
``<socket>.lock`` is ``flock``ed for the daemon's whole life (the kernel releases it if the daemon is
killed).  A second daemon for the same socket fails to take it and exits with an error naming the first
one's pid; a socket file left by a killed daemon is then known to be stale and is replaced.  As a second
guard, a socket that still accepts connections is never replaced.

Permissions
-----------
The socket's directory is created 0700 (0750 with ``socket_group``) and the socket file is 0600 (0660 with
the group): by default only the daemon's user can connect.  An existing directory writable by others
without the sticky bit is refused.  On a clean exit (SIGTERM/SIGINT) the daemon releases its holds (or, with
``keep_holds_on_exit``, stops refreshing them and leaves them to the next daemon), closes its pidfds, and
removes its socket file (if it is still the one it bound) and lock file.

State across restarts
---------------------
``<socket>.state`` (``state_file.py``) records the daemon's holds and the processes it watches.  It is read
once at start, right after the instance lock is taken and the first scan rebuilt the view: watched processes
that died meanwhile have their leases ended, live ones are watched again, and every hold is re-taken
(``holds.restore_hold``) before the first reap.  From then on the file is rewritten whenever the set of holds
or of watched processes changes, before the reply to the request that changed it.  A daemon that fails to
start never touches it.
"""

from __future__ import annotations

import grp
import logging
import os
import signal
import socket as pysocket
import stat
import time
from pathlib import Path

import zmq

from flextensor.shm import ftd_protocol as proto
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.identity import boot_id
from flextensor.shm.locks import FileLock
from flextensor.shm.names import manager_namespace, validate_namespace

from flextensor.daemon.config import DaemonSettings
from flextensor.daemon.handlers import RequestHandler, peer_of
from flextensor.daemon.holds import HoldGone, drop_hold, restore_hold
from flextensor.daemon.metrics import DaemonMetrics
from flextensor.daemon.reaper import Reaper
from flextensor.daemon.lockdirs import configured_lock_dir, inspect_lock_dir, lock_dir_name_uid, segment_owner_uid
from flextensor.daemon.registry import Registry
from flextensor.daemon.state_file import (
    PersistedHold,
    PersistedParticipant,
    StateFile,
    StateStore,
    pid_namespace,
    state_path,
)

__all__ = ["Daemon", "StartupError", "run"]

logger = logging.getLogger(__name__)

_MAX_MESSAGES_PER_TURN = 256


class StartupError(RuntimeError):
    """The daemon cannot start (another one runs, bad permissions...); the message says what to do."""


def _library_version() -> str:
    from flextensor.shm._version import __version__

    return __version__


def _resolve_group(group: str | int | None) -> int | None:
    if group is None:
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise StartupError(f"socket_group {group!r} does not exist on this host") from None


def _prepare_directory(directory: Path, gid: int | None) -> None:
    mode = 0o750 if gid is not None else 0o700
    try:
        os.mkdir(directory, mode)
    except FileExistsError:
        st = os.lstat(directory)
        if not stat.S_ISDIR(st.st_mode):
            raise StartupError(f"socket directory {directory} is not a directory (or is a symlink)") from None
        if st.st_uid not in (0, os.geteuid()):
            raise StartupError(f"socket directory {directory} belongs to uid {st.st_uid}: someone else could replace "
                               "the socket; use a directory of your own (--socket)") from None
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise StartupError(f"socket directory {directory} is writable by others without the sticky bit; "
                               "use a private directory (e.g. /run/flextensor)") from None
        return
    except FileNotFoundError:
        raise StartupError(f"the parent of the socket directory {directory} does not exist; create it or choose "
                           "another --socket") from None
    except PermissionError:
        raise StartupError(f"cannot create the socket directory {directory} (permission denied); choose a "
                           "--socket under a directory you own (e.g. $XDG_RUNTIME_DIR) or run as root") from None
    os.chmod(directory, mode)
    if gid is not None:
        os.chown(directory, -1, gid)


def _socket_alive(path: str) -> bool:
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.settimeout(0.2)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _check_lock_dirs(paths: list[str]) -> None:
    """Refuse to start with a configured lock directory that can never be watched (a daemon that serves on,
    logging one ERROR, would silently never reclaim anything there).  A directory that does not exist *yet* is
    fine when its parent does (no worker of that user ran yet): it is checked again at every scan."""
    for configured in paths:
        # A name another uid took in a shared TMPDIR stands for the fallback its user's workers take (the
        # registry watches that one and names the squatter in a WARNING): it must not stop the daemon.
        path, _squatted = configured_lock_dir(configured)
        try:
            inspect_lock_dir(path)
        except FileNotFoundError:
            parent = Path(path).parent
            if not parent.is_dir():
                raise StartupError(f"lock directory {path}: its parent {parent} does not exist; pass the workers' "
                                   "$TMPDIR/flextensor-<uid>") from None
            if lock_dir_name_uid(Path(path).name) is None:
                raise StartupError(f"lock directory {path} is not a flextensor lock directory: it must be named "
                                   "flextensor-<uid of its owner> ($TMPDIR/flextensor-<uid> of the workers)") from None
        except (PermissionError, OSError) as exc:
            raise StartupError(f"cannot watch lock directory {path}: {exc}") from None


class Daemon:
    """One ``ftd`` instance; :meth:`start` then :meth:`serve_forever` (or :func:`run`)."""

    def __init__(self, settings: DaemonSettings) -> None:
        self.settings = settings
        self.socket_path = os.path.abspath(settings.socket)
        self.metrics = DaemonMetrics()
        self.registry = Registry(settings.effective_lock_dirs, self.metrics)
        self.reaper = Reaper(self.registry, self.metrics)
        self.context: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.poller = zmq.Poller()
        self._instance_lock: FileLock | None = None
        self._socket_ino: int | None = None
        self._stop = False
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self.started = time.monotonic()
        self.state = StateStore(state_path(self.socket_path))
        self._state_loaded = False  # only a daemon that read the previous state may overwrite it
        self._state_key: object = None  # what the state file describes now (see _save_state)
        self._state_error = False
        self.handler = RequestHandler(self.registry, self.reaper, {
            "version": _library_version(),
            "socket": self.socket_path,
            "started": self.started,
            "metrics": self.metrics,
            "send": self._send,
            "save_state": self._save_state,
        })
        self.registry.on_watch_added = lambda fd: self.poller.register(fd, zmq.POLLIN)
        self.registry.on_watch_removed = self._unregister_fd

    def _unregister_fd(self, fd: int) -> None:
        try:
            self.poller.unregister(fd)
        except KeyError:
            pass

    # ------------------------------------------------------------------ start-up
    def start(self) -> None:
        """Take the instance lock, bind the socket, start metrics, install signal handlers, first scan."""
        _check_lock_dirs(self.settings.lock_dirs)
        gid = _resolve_group(self.settings.socket_group)
        path = Path(self.socket_path)
        _prepare_directory(path.parent, gid)
        lock = FileLock(str(path) + ".lock")
        try:
            lock.acquire(0)
        except TimeoutError:
            lock.close()
            other = ""
            try:
                other = f" (pid {Path(str(path) + '.lock').read_text().strip()})"
            except OSError:
                pass
            raise StartupError(f"another ftd{other} already serves {path}; stop it first, or choose another --socket")
        self._instance_lock = lock
        try:
            with open(str(path) + ".lock", "w") as f:
                f.write(f"{os.getpid()}\n")
            if os.path.lexists(path):
                if _socket_alive(str(path)):
                    raise StartupError(f"something already listens on {path}; stop it first, or choose another --socket")
                logger.warning("replacing the stale socket %s of a daemon that is gone", path)
                os.unlink(path)
            self.context = zmq.Context()
            router = self.context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, proto.HARD_FRAME_LIMIT)
            router.setsockopt(zmq.SNDHWM, 1000)
            old_umask = os.umask(0o177)
            try:
                router.bind(f"ipc://{path}")
            finally:
                os.umask(old_umask)
            self.router = router
            os.chmod(path, 0o660 if gid is not None else 0o600)
            if gid is not None:
                os.chown(path, -1, gid)
            self._socket_ino = os.stat(path).st_ino
            self.poller.register(router, zmq.POLLIN)
            if self.settings.metrics_port is not None:
                self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self.poller.register(self._wake_r, zmq.POLLIN)
            signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        except BaseException:
            self.shutdown()
            raise
        self.registry.scan()  # rebuild from journals + lease tables (adopts live processes)
        self._restore_state()  # before the first reap: restored holds keep their generations
        logger.info("ftd %s serving on %s (lock dirs: %s; reap every %.2f s; pid %d)", _library_version(), path,
                    ", ".join(self.settings.effective_lock_dirs), self.settings.reap_interval, os.getpid())

    # ------------------------------------------------------------------ state across restarts
    def _restore_state(self) -> None:
        """Carry on from the previous daemon's ``<socket>.state``, then rewrite it as this daemon's."""
        previous = self.state.load()
        if previous is not None:
            self._restore_from(previous)
            self.registry.scan()
        self._state_loaded = True
        self._save_state(force=True)

    def _restore_from(self, previous: StateFile) -> None:
        stamp = previous.daemon
        learned = {p.lock_dir for p in previous.watched if p.lock_dir is not None}
        for path in sorted(learned - set(self.registry.configured_lock_dirs)):
            try:  # lock directories learned from registrations: keep scanning them
                self.registry.learn_lock_dir(inspect_lock_dir(path))
            except OSError as exc:
                logger.info("not scanning %s any more: %s", path, exc)
        if learned:
            self.registry.scan()
        if previous.watched:
            if stamp.boot_id == boot_id() and stamp.pid_ns is not None and stamp.pid_ns == pid_namespace():
                outcomes = [self._guard("re-watching a participant", self.registry.rewatch, p.namespace, p.slot,
                                        p.identity, p.pid, p.uid, p.adopted) for p in previous.watched]
                logger.info("the previous daemon watched %d process(es): %d still run, %d exited while no daemon ran",
                            len(outcomes), outcomes.count("watching"), outcomes.count("ended"))
            else:
                logger.info("not re-watching the %d process(es) of the previous daemon (pid %d): it ran in another "
                            "pid namespace or boot, where their pids meant other processes", len(previous.watched),
                            stamp.pid)
        may_adopt = previous.heartbeats_stopped or not stamp.alive()
        if previous.holds and not may_adopt:
            logger.warning("the daemon that wrote %s (pid %d) still runs: its hold slots are left to it, fresh ones "
                           "are joined", self.state.path, stamp.pid)
        for record in previous.holds:
            self._guard(f"restoring the hold on {record.namespace}", self._restore_hold, record, may_adopt)

    def _restore_hold(self, record: PersistedHold, may_adopt: bool) -> None:
        ns = record.namespace
        what = f"{ns} (base {record.base!r}, manager {record.manager!r}) generation {record.generation}"
        try:
            validate_namespace(ns)
            lock_dir = inspect_lock_dir(record.lock_dir)
            owner = segment_owner_uid(ns)
            if owner is not None and owner != lock_dir.uid:
                raise HoldGone(f"its coordinator segment belongs to uid {owner}, not to the owner of {lock_dir.path}")
            hold = restore_hold(record, lock_dir, lock_dir.uid, may_adopt=may_adopt)
        except (HoldGone, ValueError, OSError, RuntimeError) as exc:  # OSError covers TimeoutError
            kind = "" if isinstance(exc, (HoldGone, ShmProtocolError)) else f"{type(exc).__name__}: "
            logger.warning("dropped the hold on %s kept by the previous daemon: %s%s (run `ftd hold` again to keep "
                           "a generation warm)", what, kind, exc)
            return
        reg = self.registry
        reg.holds[ns] = hold
        reg.unwatch(ns, hold.identity.token)  # the first scan may have adopted a previous daemon still exiting
        reg.learn_lock_dir(lock_dir)
        if record.base is not None and record.manager is not None:
            try:
                if manager_namespace(record.base, record.manager) == ns:
                    reg.labels[ns] = (record.base, record.manager)
            except ValueError:
                pass
        reg.refresh(reg.view_for(ns, lock_dir))
        how = "took over the previous daemon's" if hold.adopted else "joined a fresh"
        logger.info("restored the hold on %s: %s lease slot %d (lease %.1f s)", what, how, hold.slot,
                    hold.lease_ns / 1e9)

    def _save_state(self, *, force: bool = False, heartbeats_stopped: bool = False) -> None:
        """Rewrite ``<socket>.state`` when the holds or the watched processes changed (or ``force``)."""
        if not self._state_loaded:
            return
        reg = self.registry
        key = (tuple((ns, h.generation, h.slot, h.identity.token) for ns, h in sorted(reg.holds.items())),
               frozenset(reg.participants))
        if key == self._state_key and not force:
            return
        holds = [PersistedHold(namespace=ns, base=reg.labels.get(ns, (None, None))[0],
                               manager=reg.labels.get(ns, (None, None))[1], generation=h.generation,
                               created_at_ns=h.created_at_ns, lock_dir=h.lock_dir.path, owner_uid=h.owner_uid,
                               slot=h.slot, identity=h.identity, lease_ns=h.lease_ns, since=h.since)
                 for ns, h in sorted(reg.holds.items())]
        watched = [PersistedParticipant(namespace=p.namespace, slot=p.slot_index, identity=p.identity, pid=p.pid,
                                        uid=p.uid, adopted=p.adopted, lock_dir=_lock_dir_of(reg, p.namespace))
                   for p in reg.participants.values()]
        try:
            self.state.save(holds, watched, heartbeats_stopped=heartbeats_stopped)
        except OSError as exc:
            if not self._state_error:  # once per failure streak, not at every change
                self._state_error = True
                logger.error("cannot write the daemon state file %s: %s; holds and watched processes will not "
                             "survive a restart of the daemon until it can", self.state.path, exc)
            return
        self._state_error = False
        self._state_key = key

    def _on_signal(self, signum: int, frame) -> None:
        self._stop = True

    # ------------------------------------------------------------------ loop
    def serve_forever(self) -> None:
        next_scan = time.monotonic()
        while not self._stop:
            now = time.monotonic()
            delay = max(0.0, next_scan - now)
            pending = self.reaper.next_pending_delay()
            if pending is not None:
                delay = min(delay, pending)
            events = dict(self.poller.poll(int(delay * 1000) + 1))
            if self._wake_r is not None and self._wake_r in events:
                try:
                    while os.read(self._wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            if self._stop:
                break
            if self.router in events:
                self._serve_requests()
            for fd in [fd for fd in events if isinstance(fd, int) and fd in self.registry.by_fd]:
                self._on_process_exit(fd)
            if self.reaper.pending:
                for frames, reply in self.reaper.poll_pending():
                    self._send(frames, reply)
            if time.monotonic() >= next_scan:
                self._scan_and_reap()
                next_scan = time.monotonic() + self.settings.reap_interval
            self._save_state()

    def _guard(self, what: str, func, *args):
        try:
            return func(*args)
        except Exception:  # noqa: BLE001 - one bad namespace must never stop the daemon
            logger.exception("%s failed", what)
            return None

    def _on_process_exit(self, fd: int) -> None:
        views = self._guard("handling a process exit", self.registry.process_exited, fd) or []
        for view in views:
            if view.live == 0 and view.namespace not in self.registry.holds:
                self._guard(f"reclaiming {view.namespace}", self.reaper.reclaim, view, "death")

    def _scan_and_reap(self) -> None:
        for ns, hold in list(self.registry.holds.items()):
            if getattr(hold.heartbeat, "lost", False):
                logger.warning("lost the hold on %s (its lease was ended or taken over)", ns)
                del self.registry.holds[ns]
                hold.table = None  # type: ignore[assignment]  # drop memoryview users before unmapping
                hold.heartbeat = None
                hold.segment.close()
        self._guard("scanning", self.registry.scan)
        self._guard("reaping", self.reaper.reap)

    # ------------------------------------------------------------------ requests
    def _send(self, frames: list[bytes], reply) -> None:
        try:
            data = proto.encode(reply)
            self.router.send_multipart([*frames, data], zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError as exc:  # requester gone or not reading: drop the reply
            logger.debug("could not send a reply: %s", exc)

    def _serve_requests(self) -> None:
        assert self.router is not None
        for _ in range(_MAX_MESSAGES_PER_TURN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.warning("receive failed: %s", exc)
                return
            routing = [frames[0].bytes]
            middle = frames[1:-1]
            payload = frames[-1] if len(frames) > 1 else None
            if payload is None or len(middle) > 1 or (middle and middle[0].bytes != b""):
                self.metrics.bad_frames.labels(code="bad_request").inc()
                self._send(routing + [m.bytes for m in middle[:1]],
                           proto.ErrorReply(code="bad_request", message="a request is exactly one frame"))
                continue
            reply_to = routing + [m.bytes for m in middle]
            limit = self.settings.max_frame_bytes
            if len(payload) > limit:
                self.metrics.bad_frames.labels(code="too_large").inc()
                self._send(reply_to, proto.ErrorReply(code="too_large", message=f"request of {len(payload)} bytes "
                                                      f"exceeds the limit of {limit}"))
                continue
            try:
                request = proto.decode_request(payload.bytes)
            except proto.ProtocolDecodeError as exc:
                self.metrics.bad_frames.labels(code=exc.code).inc()
                self._send(reply_to, proto.ErrorReply(code=exc.code, message=str(exc)[:500]))
                continue
            try:
                reply = self.handler.handle(request, peer_of(payload), reply_to)
            except Exception as exc:  # noqa: BLE001
                logger.exception("request %s failed", type(request).__name__)
                reply = proto.ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}"[:500])
            self._save_state()  # a hold, release or registration is on disk before its reply goes out
            if reply is not None:
                self._send(reply_to, reply)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Release (or keep) holds, save the state, stop watching, close and remove the socket and lock file.

        Idempotent."""
        if self.settings.keep_holds_on_exit and self._state_loaded and self.registry.holds:
            self._keep_holds()
        releasing = list(self.registry.holds.items())
        self.registry.holds.clear()
        self._save_state()  # first: a daemon killed while releasing must not re-take these holds next time
        for ns, hold in releasing:
            try:
                if drop_hold(hold) == 0:
                    view = self.registry.view_for(ns, hold.lock_dir)
                    self.reaper.reclaim(view, "release")
            except Exception:  # noqa: BLE001
                logger.exception("releasing the hold on %s failed; it expires after its lease", ns)
        if self._state_loaded:
            self._save_state(force=True, heartbeats_stopped=True)  # every heartbeat thread has stopped by now
            self._state_loaded = False
        for job in self.reaper.pending:
            self._send(job.reply_to, proto.ErrorReply(code="internal", message="the daemon is shutting down"))
        self.reaper.pending.clear()
        self.registry.close()
        if self.router is not None:
            self.router.close(0)
            self.router = None
            try:
                if os.stat(self.socket_path).st_ino == self._socket_ino:
                    os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        if self.context is not None:
            self.context.term()
            self.context = None
        self.metrics.close()
        if self._wake_w is not None:
            signal.set_wakeup_fd(-1)
            os.close(self._wake_w)
            os.close(self._wake_r)  # type: ignore[arg-type]
            self._wake_r = self._wake_w = None
        if self._instance_lock is not None:
            lock, self._instance_lock = self._instance_lock, None
            try:
                lock.unlink_if_held()
            except (RuntimeError, OSError):
                pass
            lock.close()


    def _keep_holds(self) -> None:
        """``keep_holds_on_exit``: stop refreshing the holds, record them for the next daemon, leave the slots."""
        holds = self.registry.holds
        for hold in holds.values():
            hold.heartbeat.stop()  # type: ignore[attr-defined]
        self._save_state(force=True, heartbeats_stopped=True)
        if self._state_error:
            return  # not recorded: release them as usual rather than leave them to expire unclaimed
        lease = max(h.lease_ns for h in holds.values()) / 1e9
        logger.info("keeping %d hold(s) for the next ftd on %s (%s): start it within %.0f s to take their lease "
                    "slots over", len(holds), self.socket_path, ", ".join(sorted(holds)), lease)
        for ns, hold in list(holds.items()):
            del holds[ns]
            hold.table = None  # type: ignore[assignment]
            hold.heartbeat = None
            hold.segment.close()
        self._state_loaded = False  # the file now describes the kept holds: nothing below may overwrite it


def _lock_dir_of(registry: Registry, namespace: str) -> str | None:
    view = registry.views.get(namespace)
    return None if view is None else view.lock_dir.path


def run(settings: DaemonSettings) -> int:
    """Start, serve until SIGTERM/SIGINT, shut down; 0 on a clean exit (``StartupError`` propagates)."""
    daemon = Daemon(settings)
    daemon.start()
    try:
        daemon.serve_forever()
    finally:
        logger.info("ftd stopping")
        daemon.shutdown()
    return 0

