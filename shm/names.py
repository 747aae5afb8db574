"""Namespaces and every name derived from them.

Users give a *base namespace* (often derived from the model identity) and a *manager name*; the pair selects
one set of shared resources.  Those strings are free text, so they are validated here, before any resource
is opened, and never used verbatim in POSIX names: a per-manager namespace is

    "ft" + <up to 12 chars of the sanitized base, [A-Za-z0-9_-]> + "-" + <16 hex chars of blake2b>

i.e. at most 31 characters.  The readable part only helps a human running ``ls /dev/shm``; uniqueness comes
from the 64-bit hash of the full inputs.  Every POSIX name built from such a namespace therefore stays far
below NAME_MAX (255) and below the 64 characters some tools (and old BSD-derived limits) assume:

    /{ns}.c                        coordinator segment (header + lease table), one per namespace
    /{ns}.g{gen}.{kind}            generation resource: b0 (host block 0), sd/sm (store data/manifest), p (plan)
    /{ns}.g{gen}.l{...}            semaphore locks (posix_ipc shows them as /dev/shm/sem.{ns}.g...)
    {lock_directory()}/{ns}.lock     coordinator file lock
    {lock_directory()}/{ns}.journal  ownership journal

The lock directory lives under ``TMPDIR`` (read from the environment at every call: not through ``tempfile``,
which caches its choice at first use and silently falls back to ``/tmp`` when ``TMPDIR`` is full or not
writable; a lock directory that cannot be made or written is an error naming it) and is private
to the uid: it is created 0700 and refused when group or others can write into it, because a foreign writer
there could plant lock files or journals that make us unlink the wrong resources. In a shared sticky ``TMPDIR``
another user can take the name ``flextensor-{uid}`` first; the user's lock directory is then a numbered
fallback it owns (:func:`find_lock_directory` has the protocol), with a WARNING naming the other uid.

Every function that derives a path inside the lock directory takes an optional ``lock_dir``.  ``None`` (the
default, what workers use) means :func:`lock_directory` of the calling process.  An explicit directory is used
as given, neither created nor checked: it exists for ``ftd``, which serves namespaces of other users (their
``TMPDIR`` and uid are not its own) and validates the directory itself before acting in it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_USER_NAME_LENGTH",
    "MAX_NAMESPACE_LENGTH",
    "validate_base_namespace",
    "validate_manager_name",
    "validate_namespace",
    "manager_namespace",
    "compute_shm_namespace",
    "segment_name",
    "coordinator_segment_name",
    "generation_resource_name",
    "lock_directory",
    "lock_directory_path",
    "find_lock_directory",
    "temp_base",
    "resolve_lock_directory",
    "coordinator_lock_path",
    "journal_path",
]

#: Longest base namespace / manager name accepted (they are hashed, so this only bounds nonsense input).
MAX_USER_NAME_LENGTH = 200
#: Longest per-manager namespace accepted when one is passed directly (ours are <= 31 characters).
MAX_NAMESPACE_LENGTH = 64
#: Longest POSIX name we build, leading "/" excluded: NAME_MAX (255) minus posix_ipc's "sem." prefix.
MAX_POSIX_NAME_LENGTH = 251

_READABLE_CHARS = 12
_HASH_BYTES = 8  # 64-bit hash -> 16 hex characters
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]+")
_PREFIX_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,7}")
_KIND_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,15}")
_SUFFIX_RE = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_UNSAFE_RUN_RE = re.compile(r"[^A-Za-z0-9_-]+")


def _shown(value: object, limit: int = 40) -> str:
    """repr of a bad value, truncated so a 10 MB string does not end up in a log line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validate_user_name(value: object, argument: str) -> str:
    allowed = (
        f"a non-empty str of at most {MAX_USER_NAME_LENGTH} printable characters without '/', '..', "
        "NUL or whitespace"
    )

    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid {argument} {_shown(value)}: {reason}; {argument} must be {allowed}")

    if not isinstance(value, str):
        raise bad(f"it is a {type(value).__name__}, not a str")
    if not value:
        raise bad("it is empty")
    if len(value) > MAX_USER_NAME_LENGTH:
        raise bad(f"it has {len(value)} characters")
    if "\x00" in value:
        raise bad("it contains NUL")
    if "/" in value:
        raise bad("it contains '/'")
    if ".." in value:
        raise bad("it contains '..'")
    for ch in value:
        if ch.isspace():
            raise bad(f"it contains whitespace {ch!r}")
        if not ch.isprintable():
            raise bad(f"it contains the non-printable character {ch!r}")
    return value


def validate_base_namespace(ns: str) -> str:
    """Return ``ns`` unchanged if it is an acceptable base namespace, else raise ``ValueError``."""
    return _validate_user_name(ns, "base namespace")


def validate_manager_name(name: str) -> str:
    """Return ``name`` unchanged if it is an acceptable manager name, else raise ``ValueError``."""
    return _validate_user_name(name, "manager name")


def validate_namespace(ns: str) -> str:
    """Validate a per-manager namespace given directly (e.g. to ``ftd cleanup``): it goes into POSIX names
    and file names verbatim, so only ``[A-Za-z0-9_.-]``, at most 64 characters, no ``..`` and no leading
    ``.`` or ``-`` (which would hide the file or read as a command-line option)."""
    allowed = (
        f"1 to {MAX_NAMESPACE_LENGTH} characters from [A-Za-z0-9_.-], not starting with '.' or '-' and "
        "without '..' (as made by manager_namespace())"
    )
    if not isinstance(ns, str):
        raise ValueError(f"invalid namespace {_shown(ns)}: it is a {type(ns).__name__}, not a str; "
                         f"namespace must be {allowed}")
    if (
        not ns
        or len(ns) > MAX_NAMESPACE_LENGTH
        or not _NAMESPACE_RE.fullmatch(ns)
        or ".." in ns
        or ns[0] in ".-"
    ):
        raise ValueError(f"invalid namespace {_shown(ns)}: namespace must be {allowed}")
    return ns


def _readable(text: str) -> str:
    """The human hint inside a namespace: unsafe runs become '_', then the first 12 characters."""
    return _UNSAFE_RUN_RE.sub("_", text)[:_READABLE_CHARS]


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_HASH_BYTES).hexdigest()


def manager_namespace(base: str, manager: str) -> str:
    """The compact per-manager namespace of (``base``, ``manager``); both are validated first.

    The hash covers ``base NUL manager``; NUL is refused inside either, so distinct pairs never encode to the
    same bytes (``("a", "bc")`` vs ``("ab", "c")``).
    """
    validate_base_namespace(base)
    validate_manager_name(manager)
    digest = _digest(base.encode("utf-8") + b"\x00" + manager.encode("utf-8"))
    return f"ft{_readable(base)}-{digest}"


def _identity_bytes(identity: Any) -> tuple[bytes, str]:
    """Canonical bytes of a model identity plus its readable hint; a type tag keeps kinds apart."""
    if isinstance(identity, str):
        return b"s\x00" + identity.encode("utf-8"), identity
    if isinstance(identity, (bytes, bytearray, memoryview)):
        raw = bytes(identity)
        return b"b\x00" + raw, ""
    if isinstance(identity, Mapping):
        try:
            text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False, default=str)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"invalid model identity {_shown(identity)}: it cannot be encoded as JSON ({exc}); pass a str, "
                "bytes or a mapping of JSON values such as {'model': ..., 'revision': ..., 'dtype': ...}"
            ) from None
        hint = identity.get("model", "")
        return b"j\x00" + text.encode("utf-8"), hint if isinstance(hint, str) else ""
    raise ValueError(
        f"invalid model identity {_shown(identity)}: it is a {type(identity).__name__}; pass a str, bytes or a "
        "mapping of JSON values such as {'model': ..., 'revision': ..., 'dtype': ...}"
    )


def compute_shm_namespace(identity: Any, *, prefix: str = "ft") -> str:
    """A stable, compact namespace for a model identity (str, bytes, or JSON-able mapping).

    Same for the same identity in every process and on every run (mappings are serialized with sorted keys),
    different as soon as any field differs.  The result is itself a valid base namespace and a valid
    per-manager namespace: ``prefix + <12 readable chars> + "-" + <16 hex>``.
    """
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"invalid prefix {_shown(prefix)}: prefix must be a letter followed by at most 7 "
                         "characters from [A-Za-z0-9_]")
    if isinstance(identity, str) and not identity:
        raise ValueError("invalid model identity '': it is empty; pass the model name or a mapping such as "
                         "{'model': ..., 'revision': ..., 'dtype': ...}")
    data, hint = _identity_bytes(identity)
    return f"{prefix}{_readable(hint)}-{_digest(data)}"


def segment_name(ns: str, suffix: str) -> str:
    """``/{ns}.{suffix}`` after validating both parts and the total length."""
    validate_namespace(ns)
    if not isinstance(suffix, str) or not _SUFFIX_RE.fullmatch(suffix):
        raise ValueError(f"invalid name suffix {_shown(suffix)}: suffix must be dot-separated non-empty parts "
                         "from [A-Za-z0-9_-]")
    name = f"/{ns}.{suffix}"
    if len(name) - 1 > MAX_POSIX_NAME_LENGTH:
        raise ValueError(f"POSIX name {_shown(name)} is {len(name) - 1} characters long; the limit is "
                         f"{MAX_POSIX_NAME_LENGTH}: use a shorter suffix")
    return name


def coordinator_segment_name(ns: str) -> str:
    """The coordinator segment of a namespace: ``/{ns}.c``."""
    return segment_name(ns, "c")


def generation_resource_name(ns: str, generation: int, kind: str) -> str:
    """``/{ns}.g{generation}.{kind}``, e.g. kind ``"b0"``, ``"sd"``, ``"sm"``, ``"p"`` or ``"l..."``."""
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"invalid generation {_shown(generation)}: generation must be an int >= 0")
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise ValueError(f"invalid resource kind {_shown(kind)}: kind must be a letter followed by at most 15 "
                         "characters from [A-Za-z0-9_-], e.g. 'b0', 'sd', 'sm', 'p'")
    return segment_name(ns, f"g{generation}.{kind}")


def temp_base() -> Path:
    """The first of ``$TMPDIR``, ``$TEMP``, ``$TMP`` that is set (non-empty), else ``/tmp``; read now, never
    cached, never replaced by another directory when it is unusable."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(var)
        if value:
            return Path(value)
    return Path("/tmp")


def _owner_of(path: Path) -> tuple[bool, int] | None:
    """``(is a real directory, owner uid)`` of ``path`` (symlinks not followed), None when it does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return stat.S_ISDIR(st.st_mode), st.st_uid


def _fallbacks(base: Path, uid: int) -> list[tuple[int, Path]]:
    """The fallback lock directories ``flextensor-{uid}.{n}`` (n >= 1) that exist in ``base``, by n."""
    prefix = f"flextensor-{uid}."
    found: list[tuple[int, Path]] = []
    try:
        with os.scandir(base) as entries:
            for entry in entries:
                rest = entry.name[len(prefix):] if entry.name.startswith(prefix) else ""
                if rest.isdigit() and rest[0] != "0":
                    found.append((int(rest), base / entry.name))
    except OSError:
        return []
    return sorted(found)


#: (TMPDIR, uid) -> the fallback lock directory of that uid found there (re-checked at every use).
_fallbacks_found: dict[tuple[str, int], Path] = {}


def find_lock_directory(base: str | os.PathLike[str], uid: int) -> tuple[Path, list[tuple[Path, int]]]:
    """Where ``uid``'s lock directory under ``base`` is, neither created nor checked; also the squatted
    candidates passed over, as ``(path, owner uid)``.

    Protocol (every worker, cleanup and ``ftd`` of the user agree on it without talking): the directory is
    ``{base}/flextensor-{uid}`` when that is a directory ``uid`` owns. When another uid has taken that name (in a
    shared sticky ``TMPDIR`` anyone may create it first), the lock directory is the lowest-numbered
    ``{base}/flextensor-{uid}.{n}`` (n >= 1) that ``uid`` owns, else the lowest ``n`` still free, which the
    first worker creates. An existing directory of ``uid`` always wins over a free name, so a squatter that
    removes its directory later cannot make two workers of one job pick different ones. A squatter can only
    ever push the directory to a later name, never into one it controls.
    """
    base = Path(base)
    primary = base / f"flextensor-{uid}"
    owner = _owner_of(primary)
    if owner is not None and (owner[1] == uid):
        return primary, []  # ours (a non-directory of ours is reported by lock_directory)
    skipped = [] if owner is None else [(primary, owner[1])]
    known = _fallbacks_found.get((str(base), uid))
    if known is not None and _owner_of(known) == (True, uid):
        return known, skipped  # found before: no listing of a TMPDIR that may hold thousands of entries
    taken: set[int] = set()
    for n, path in _fallbacks(base, uid):
        found = _owner_of(path)
        if found is None:
            continue
        if found == (True, uid):
            _fallbacks_found[(str(base), uid)] = path
            return path, skipped
        taken.add(n)
        skipped.append((path, found[1]))
    if owner is None:
        return primary, skipped
    n = 1
    while n in taken:
        n += 1
    return base / f"flextensor-{uid}.{n}", skipped


_warned_squatters: set[tuple[str, int]] = set()


def _warn_squatted(skipped: list[tuple[Path, int]], chosen: Path) -> None:
    for path, owner in skipped:
        if (str(path), owner) in _warned_squatters:
            continue
        _warned_squatters.add((str(path), owner))
        logging.getLogger(__name__).warning(
            "lock directory %s belongs to uid %d, not to this user (uid %d): another user may be trying to block "
            "this user's jobs; using %s instead. That user or root can remove it (`rm -r %s`); a TMPDIR private to "
            "each user avoids it", path, owner, os.getuid(), chosen, path)


def lock_directory_path() -> Path:
    """Where :func:`lock_directory` is (``$TMPDIR/flextensor-{uid}``, or the fallback of
    :func:`find_lock_directory` when another user took that name), neither created nor checked: for tools that
    only look (a sweep of dead namespaces, the ``ftd`` command line), which must leave nothing behind."""
    return find_lock_directory(temp_base(), os.getuid())[0]


def lock_directory() -> Path:
    """``$TMPDIR/flextensor-{uid}`` (or its fallback, see :func:`find_lock_directory`, with a WARNING naming the
    uid that took the name), created 0700 when missing and checked to be private to this uid.

    Raises ``PermissionError`` when the directory found is not a real directory of ours, or when group or
    others may write into it; ``OSError`` naming the directory when it cannot be created (``TMPDIR`` missing,
    full or read-only): there is no silent fall-back to another ``TMPDIR``, which would hide the journals from
    the other workers and from cleanup.
    """
    uid = os.getuid()
    base = temp_base()
    for _ in range(100):  # each turn loses a mkdir race to another uid; a squatter cannot win them forever
        path, skipped = find_lock_directory(base, uid)
        if skipped:
            _warn_squatted(skipped, path)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            found = _owner_of(path)
            if found is not None and found[1] != uid:
                continue  # another uid made this name between our look and our mkdir: look again
        except OSError as exc:
            raise type(exc)(exc.errno, f"cannot create the flextensor lock directory {path} ({exc.strerror}): "
                            f"TMPDIR={str(base)!r} must be an existing, writable directory with free space, the "
                            "same for every worker of a job", str(path)) from exc
        else:
            os.chmod(path, 0o700)  # mkdir honours the umask; make the mode exact
        break
    else:
        raise PermissionError(f"every lock directory name tried under {base} was taken by another user as this one "
                              "was made; point TMPDIR at a directory private to this user")
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"lock directory {path} exists but is not a directory (or is a symlink); remove "
                              "it or point TMPDIR elsewhere")
    if st.st_uid != uid:
        raise PermissionError(f"lock directory {path} is owned by uid {st.st_uid}, not by us (uid {uid}); "
                              "someone may be trying to hijack it: remove it or point TMPDIR elsewhere")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"lock directory {path} has mode {stat.S_IMODE(st.st_mode):04o}, writable by "
                              f"group or others; fix it with `chmod 700 {path}`")
    return path


def resolve_lock_directory(lock_dir: str | os.PathLike[str] | None = None) -> Path:
    """``lock_dir`` as a ``Path`` when given (used as is: the caller vouches for it), else
    :func:`lock_directory` (created and checked)."""
    return lock_directory() if lock_dir is None else Path(lock_dir)


def coordinator_lock_path(ns: str, lock_dir: str | os.PathLike[str] | None = None) -> Path:
    """``{lock_dir}/{ns}.lock``; ``lock_dir`` defaults to :func:`lock_directory` (which creates it)."""
    validate_namespace(ns)
    return resolve_lock_directory(lock_dir) / f"{ns}.lock"


def journal_path(ns: str, lock_dir: str | os.PathLike[str] | None = None) -> Path:
    """``{lock_dir}/{ns}.journal``; ``lock_dir`` defaults to :func:`lock_directory` (which creates it)."""
    validate_namespace(ns)
    return resolve_lock_directory(lock_dir) / f"{ns}.journal"


def validate_posix_name(name: object, what: str, max_chars: int) -> str:
    """A POSIX IPC name: ``/`` then 1 to ``max_chars`` characters without ``/`` or NUL (and not ``.``/``..``).

    Segments allow 255 characters after the slash (NAME_MAX); semaphores 251 (glibc prefixes ``sem.``).
    """
    if (
        not isinstance(name, str)
        or len(name) < 2
        or name[0] != "/"
        or "/" in name[1:]
        or "\x00" in name
        or len(name) - 1 > max_chars
        or name in ("/.", "/..")
    ):
        shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:37] + "..."
        raise ValueError(f"invalid {what} name {shown}: it must be '/' followed by 1 to {max_chars} characters "
                         "without '/' or NUL (see flextensor.shm.names)")
    return name
