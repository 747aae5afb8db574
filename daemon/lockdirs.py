"""Lock directories the daemon acts in, and acting in them as their owner.

A root daemon serves several users: each worker's lock directory (``$TMPDIR/flextensor-<uid>``, mode 0700) is
validated before the daemon trusts a journal in it (``inspect_lock_dir``), and every action that creates or
removes that user's files runs with the owner's effective uid/gid (``acting_in``), so files keep their owner
and ``/dev/shm``'s sticky bit still stops a forged journal from unlinking another user's segments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pwd
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from flextensor.shm.names import coordinator_segment_name, find_lock_directory, validate_namespace
from flextensor.shm.segment_dir import segment_path

__all__ = ["LockDir", "inspect_lock_dir", "acting_in", "segment_owner_uid", "configured_lock_dir",
           "lock_dir_name_uid"]

logger = logging.getLogger(__name__)

#: ``flextensor-<uid>`` or its fallback ``flextensor-<uid>.<n>`` (see ``flextensor.shm.names.find_lock_directory``).
_LOCK_DIR_NAME = re.compile(r"flextensor-(0|[1-9][0-9]*)(?:\.[1-9][0-9]*)?")


@dataclasses.dataclass(frozen=True)
class LockDir:
    """A validated lock directory and its owner."""

    path: str
    uid: int
    gid: int  # primary group of the owner (falls back to the directory's group)


def inspect_lock_dir(path: str | os.PathLike[str]) -> LockDir:
    """Validate a lock directory the daemon may act in; ``PermissionError`` / ``FileNotFoundError`` if not.

    It must be a real directory (not a symlink), named ``flextensor-<owner uid>``, not writable by group or
    others, and — unless the daemon runs as root — owned by the daemon's user.
    """
    p = Path(os.path.abspath(os.fspath(path)))
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"lock directory {p} is not a directory (or is a symlink)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"lock directory {p} is writable by group or others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); refusing to act on journals anyone could forge")
    if lock_dir_name_uid(p.name) != st.st_uid:
        raise PermissionError(f"{p} is not a flextensor lock directory: it must be named flextensor-{st.st_uid} "
                              f"or flextensor-{st.st_uid}.<n> (flextensor-<uid of its owner>, as workers create it "
                              "under their TMPDIR, or its fallback when another user took that name)")
    euid = os.geteuid()
    if euid != 0 and st.st_uid != euid:
        raise PermissionError(f"lock directory {p} belongs to uid {st.st_uid}; this daemon runs as uid {euid} and "
                              "can only act for its own user (run ftd as root to serve several users)")
    try:
        gid = pwd.getpwuid(st.st_uid).pw_gid
    except KeyError:
        gid = st.st_gid
    return LockDir(str(p), st.st_uid, gid)


_acting_lock = threading.RLock()
_acting_uid: int | None = None  # the effective uid acting_in switched to (None: not switched)


@contextlib.contextmanager
def acting_in(lock_dir: LockDir) -> Iterator[None]:
    """Run the body with the effective uid/gid of ``lock_dir``'s owner (see the module docstring).

    Only a daemon whose effective uid is root switches, and only for a directory of another user; the real
    and saved uids stay root.  Serialized (credentials are process-wide) and re-entrant for the same owner;
    nesting for a different owner is a bug (``RuntimeError``).  If switching back to root ever fails the
    daemon exits at once rather than keep running with the wrong privileges.
    """
    global _acting_uid
    with _acting_lock:
        if _acting_uid is not None:
            if _acting_uid != lock_dir.uid:
                raise RuntimeError(f"acting for uid {_acting_uid} already; cannot act for uid {lock_dir.uid} inside")
            yield
            return
        if os.geteuid() != 0 or lock_dir.uid == 0:
            yield  # a per-user daemon acts as itself (inspect_lock_dir checked the owner), root as root
            return
        groups = os.getgroups()
        egid = os.getegid()
        try:
            os.setgroups([])
            os.setegid(lock_dir.gid)
            os.seteuid(lock_dir.uid)  # last: it drops the capabilities the two calls above need
            _acting_uid = lock_dir.uid
            yield
        finally:
            _acting_uid = None
            try:
                os.seteuid(0)
                os.setegid(egid)
                os.setgroups(groups)
            except OSError:  # pragma: no cover - would mean the kernel refused to give root back
                logger.critical("could not switch back to root after acting for uid %d; exiting", lock_dir.uid)
                os._exit(70)


def lock_dir_name_uid(name: str) -> int | None:
    """The uid a lock directory's name gives (``flextensor-<uid>`` or ``flextensor-<uid>.<n>``), else None."""
    match = _LOCK_DIR_NAME.fullmatch(name)
    return None if match is None else int(match.group(1))


def configured_lock_dir(path: str) -> tuple[str, list[tuple[str, int]]]:
    """The directory to watch for a configured ``.../flextensor-<uid>``: itself, or when another uid took that
    name, the fallback the user's workers use (``find_lock_directory``); also the squatted paths passed over as
    ``(path, owner uid)``, for a WARNING. Paths of any other shape are returned as they are."""
    p = Path(os.path.abspath(path))
    match = _LOCK_DIR_NAME.fullmatch(p.name)
    if match is None or "." in p.name:
        return str(p), []
    chosen, skipped = find_lock_directory(p.parent, int(match.group(1)))
    return str(chosen), [(str(q), uid) for q, uid in skipped]


def segment_owner_uid(namespace: str) -> int | None:
    """uid owning ``{shm_dir}/{ns}.c`` (None when it does not exist; ``segment_dir.py`` says where)."""
    try:
        return os.stat(segment_path(coordinator_segment_name(validate_namespace(namespace)))).st_uid
    except FileNotFoundError:
        return None
