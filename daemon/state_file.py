"""``<socket>.state``: what a daemon was doing, so the next daemon on the same socket can carry on.

Why a file
----------
The journals and lease tables describe every generation, and a restarted daemon rebuilds its view from them
(``registry.py``).  Two things live only in the daemon, though, and used to be lost when it was SIGKILLed
or restarted:

* **holds** (``ftd hold``): the daemon's own lease slot in a generation, refreshed by a heartbeat thread of
  the daemon process.  Nobody refreshes it after a crash, so it used to expire after one lease and the
  reaper then reclaimed the held weights once the last worker was gone;
* **watched processes** (registrations): which (pid as seen by the daemon, start time) each registered lease
  slot belongs to.  A worker SIGKILLed while no daemon ran keeps a live-looking lease until it expires, and
  its pid may be one of another pid namespace, so the lease table alone cannot prove it is dead.

The file records both; ``server.py`` rewrites it whenever the set of holds or of watched processes changes
(before the reply to the request that changed it) and reads it once at start.

Format and safety
-----------------
JSON (msgspec) of :class:`StateFile`::

    {"format": 1,
     "daemon": {"pid", "start_time", "boot_id", "token", "pid_ns"},  # who wrote it
     "heartbeats_stopped": false,            # true: the writer stopped refreshing its holds before exiting
     "holds": [{"namespace", "base", "manager", "generation", "created_at_ns", "lock_dir", "owner_uid",
                "slot", "identity", "lease_ns", "since"}],
     "watched": [{"namespace", "slot", "identity", "pid", "uid", "adopted", "lock_dir"}]}

It lives next to the socket, in the daemon's private directory, mode 0600, and is replaced atomically
(written to a temporary file in the same directory, then ``os.replace``): a reader sees the old or the new
file, never half of one.  There is no ``fsync``: the file must survive the daemon *process* dying, not the
host; after a reboot ``/dev/shm`` is empty anyway.  A file that is not a regular file owned by the daemon's
user, is writable by others, or does not decode is ignored with one ERROR line (and replaced at the next
write).  Only the daemon holding ``<socket>.lock`` reads or writes it, so two daemons never share it.
"""

from __future__ import annotations

import logging
import os
import stat

import msgspec

from flextensor.shm.identity import ParticipantIdentity, is_same_process_alive

__all__ = [
    "FORMAT",
    "DaemonStamp",
    "PersistedHold",
    "PersistedParticipant",
    "StateFile",
    "StateStore",
    "state_path",
    "pid_namespace",
]

logger = logging.getLogger(__name__)

#: Version of the file's layout; a file of another version is ignored (with an ERROR line).
FORMAT = 1
_MAX_BYTES = 16 << 20  # far more than thousands of entries; a bigger file is not ours


def state_path(socket_path: str) -> str:
    """Where the daemon serving ``socket_path`` keeps its state: ``<socket>.state``."""
    return f"{socket_path}.state"


def pid_namespace() -> str | None:
    """An id of this process's pid namespace (``dev:ino`` of ``/proc/self/ns/pid``); None when unreadable.

    Pids recorded by one daemon mean the same processes to the next one only inside the same pid namespace
    (a restarted container without ``hostPID`` gets a new one).
    """
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


class DaemonStamp(msgspec.Struct, frozen=True):
    """The daemon process that wrote the file (pid, start time and boot id identify it)."""

    pid: int
    start_time: int
    boot_id: str
    token: str
    pid_ns: str | None

    @classmethod
    def current(cls) -> DaemonStamp:
        me = ParticipantIdentity.current()
        return cls(pid=me.pid, start_time=me.start_time, boot_id=me.boot_id, token=me.token, pid_ns=pid_namespace())

    def alive(self) -> bool:
        """The writer still runs (same boot, pid with the same start time; a zombie counts as gone).

        When the pid namespace differs the pid cannot be checked, and the writer counts as gone: the instance
        lock (``<socket>.lock``, which the kernel drops only when its holder exits) already proved that.
        """
        if self.pid_ns is None or self.pid_ns != pid_namespace():
            return False
        return is_same_process_alive(ParticipantIdentity(self.pid, self.start_time, self.boot_id, self.token))


class PersistedHold(msgspec.Struct, frozen=True):
    """One ``ftd hold``: the generation (number + creation time), where it is journaled, and the lease slot."""

    namespace: str  # per-manager namespace
    base: str | None
    manager: str | None
    generation: int
    created_at_ns: int  # header's creation time: tells a generation from a later one with the same number
    lock_dir: str
    owner_uid: int
    slot: int
    identity: ParticipantIdentity  # what the slot holds (maybe the identity of an earlier daemon: see holds.py)
    lease_ns: int
    since: float  # wall clock of the original ``ftd hold``


class PersistedParticipant(msgspec.Struct, frozen=True):
    """A watched process: its lease slot, and its pid *as the daemon saw it* (translated by the kernel)."""

    namespace: str
    slot: int
    identity: ParticipantIdentity
    pid: int
    uid: int | None
    adopted: bool
    lock_dir: str | None = None  # where its namespace is journaled (re-learned at start: it may not be configured)


class StateFile(msgspec.Struct):
    daemon: DaemonStamp
    heartbeats_stopped: bool = False
    holds: list[PersistedHold] = msgspec.field(default_factory=list)
    watched: list[PersistedParticipant] = msgspec.field(default_factory=list)
    format: int = FORMAT


class StateStore:
    """Reads and atomically replaces one state file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stamp = DaemonStamp.current()

    def load(self) -> StateFile | None:
        """The previous daemon's state; None when there is none or it cannot be trusted (logged once)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.error("ignoring the daemon state file %s: %s", self.path, exc)
            return None
        try:
            st = os.fstat(fd)
            problem = None
            if not stat.S_ISREG(st.st_mode):
                problem = "not a regular file"
            elif st.st_uid != os.geteuid():
                problem = f"owned by uid {st.st_uid}, not by the daemon's uid {os.geteuid()}"
            elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                problem = f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
            elif st.st_size > _MAX_BYTES:
                problem = f"{st.st_size} bytes is too large"
            if problem is not None:
                logger.error("ignoring the daemon state file %s: %s; holds and watched processes of the previous "
                             "daemon are not restored", self.path, problem)
                return None
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(_MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            header = msgspec.json.decode(data, type=dict)
            if header.get("format") != FORMAT:
                raise ValueError(f"format {header.get('format')!r}, this daemon reads format {FORMAT}")
            return msgspec.json.decode(data, type=StateFile)
        except (msgspec.DecodeError, ValueError) as exc:
            logger.error("ignoring the daemon state file %s (it cannot be decoded: %s); holds and watched processes "
                         "of the previous daemon are not restored", self.path, exc)
            return None

    def save(self, holds: list[PersistedHold], watched: list[PersistedParticipant], *,
             heartbeats_stopped: bool = False) -> None:
        """Replace the file with this daemon's state (remove it when there is nothing to keep).

        ``OSError`` when it cannot be written (the previous file, if any, is then unchanged).
        """
        if not holds and not watched:
            self.remove()
            return
        data = msgspec.json.encode(StateFile(daemon=self.stamp, heartbeats_stopped=heartbeats_stopped,
                                             holds=holds, watched=watched))
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.fchmod(fd, 0o600)  # an old temporary file of a recycled pid keeps its mode otherwise
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
