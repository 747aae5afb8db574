"""The ownership journal: what a generation created, readable by a process that never joined it.

``{lock_dir}/{ns}.journal`` (mode 0600) is a JSON-lines file; every line is one msgspec Struct
tagged by its ``record`` field:

line 1, ``JournalHeader`` (``base`` and ``manager`` only when the creator was given them; ``shm_dir`` only when
the segments live elsewhere than ``/dev/shm``)::

    {"record": "header", "protocol": 1, "library_version": "0.1.0", "namespace": "<ns>", "generation": 3,
     "base": "my_run", "manager": "default", "shm_dir": "/mnt/ft-huge"}

lines 2.., ``Intent`` (one per resource, appended and fsynced *before* the resource is created)::

    {"record": "intent", "kind": "segment",   "name": "/<ns>.g3.sd",        "generation": 3}
    {"record": "intent", "kind": "semaphore", "name": "/<ns>.g3.lb0",       "generation": 3}
    {"record": "intent", "kind": "lockfile",  "name": "<ns>.g3.lb0.lock",   "generation": 3}

The header implies the namespace's fixed resources (coordinator segment ``/{ns}.c``, lock file
``{ns}.lock`` and the journal itself); they are not listed as intents.

Life cycle: the creator writes the header (one ``write`` + ``fsync`` of a new file, O_EXCL) under the
coordinator lock before it creates ``/{ns}.c``; participants append intents under the same lock before
each ``create``; the last participant to leave (or offline cleanup) unlinks every named resource, then the
coordinator segment, then the journal, then the lock file. So a journal can name resources that were never
created (a crash between the intent and the create): removing them is an ENOENT, which is fine.

Where the segments are: the header's ``shm_dir`` (``segment_dir.py``) and that directory's device (``shm_dev``).
Reading a journal binds its namespace to that directory in the reading process, so whoever reclaims or lists the
namespace (cleanup, the dead sweep, ``ftd``) finds the segments where the creator made them, whatever its own
default. A reader that sees another file system at that path (a private mount namespace, another container
sharing the lock directory) cannot see the segments, and must not take them for gone: cleanup refuses it
(``ShmDirectoryUnseenError``, ``cleanup.py``).

Reading trusts nothing (``read_journal``): an unknown protocol, a line that is not a known record, a
generation that differs from the header's, or a name outside this namespace and generation raises
``ShmProtocolError`` naming the file and the line. Cleanup never guesses, so it deletes nothing then.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Literal

import msgspec

from flextensor.shm import segment_dir
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.header import LIBRARY_VERSION
from flextensor.shm.names import journal_path, resolve_lock_directory, validate_namespace

__all__ = [
    "JOURNAL_SUFFIX",
    "MAX_JOURNAL_BYTES",
    "IntentKind",
    "JournalHeader",
    "Intent",
    "Journal",
    "create_journal",
    "append_intent",
    "read_journal",
    "remove_journal",
    "list_journals",
    "resolve_journal_path",
]

JOURNAL_SUFFIX = ".journal"
#: The journal format's own version (the coordinator header has another, ``header.PROTOCOL_VERSION``).
PROTOCOL_VERSION = 1
#: No journal is ever this long (a generation journals a few resources per host block); larger files are refused
#: unread, so a planted sparse file cannot make a reader (``ftd``) load gigabytes.
MAX_JOURNAL_BYTES = 1 << 20
IntentKind = Literal["segment", "semaphore", "lockfile"]
_KIND_PART = r"[A-Za-z][A-Za-z0-9_-]{0,31}"


class JournalHeader(msgspec.Struct, tag="header", tag_field="record", forbid_unknown_fields=True, frozen=True,
                    omit_defaults=True):
    protocol: int
    library_version: str
    namespace: str
    generation: int
    #: The base namespace and manager name the per-manager namespace was derived from (when the creator knew
    #: them): what operators type, shown by ``ftd ls``. Readers check ``manager_namespace(base, manager)``.
    base: str | None = None
    manager: str | None = None
    #: The directory of the namespace's segments (absolute; omitted for ``/dev/shm``).
    shm_dir: str = segment_dir.DEFAULT_DIRECTORY
    #: ``st_dev`` of that directory when the journal was made (0: not recorded): a reader whose ``shm_dir`` is
    #: another file system (another mount namespace or container) must not take the segments for gone.
    shm_dev: int = 0


class Intent(msgspec.Struct, tag="intent", tag_field="record", forbid_unknown_fields=True, frozen=True):
    kind: IntentKind
    name: str
    generation: int


class Journal(msgspec.Struct, frozen=True):
    """A validated journal: where it was read from, its header and its intents in file order."""

    path: str
    header: JournalHeader
    intents: list[Intent]

    @property
    def namespace(self) -> str:
        return self.header.namespace

    @property
    def generation(self) -> int:
        return self.header.generation

    def resources(self) -> list[Intent]:
        """The intents without repeats (a retried setup may journal a name twice), in file order."""
        seen: set[tuple[str, str]] = set()
        out = []
        for intent in self.intents:
            key = (intent.kind, intent.name)
            if key not in seen:
                seen.add(key)
                out.append(intent)
        return out


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(JournalHeader | Intent)


def resolve_journal_path(ns_or_path: str | os.PathLike[str],
                         lock_dir: str | os.PathLike[str] | None = None) -> Path:
    """A namespace (no '/') means ``{lock_dir}/{ns}.journal`` (``lock_dir`` defaults to ``lock_directory()``);
    anything else is a path (``lock_dir`` is then ignored)."""
    text = os.fspath(ns_or_path)
    if "/" in text or text.endswith(JOURNAL_SUFFIX):
        return Path(text)
    return journal_path(text, lock_dir)


def _write_line(fd: int, record: JournalHeader | Intent, path: Path) -> None:
    line = _encoder.encode(record) + b"\n"
    try:
        written = os.write(fd, line)  # one write: a killed writer leaves a whole line or none (O_APPEND)
        if written != len(line):
            raise OSError(errno.ENOSPC, f"short write ({written} of {len(line)} bytes)")
        os.fsync(fd)
    except OSError as exc:
        raise type(exc)(exc.errno, f"cannot write the ownership journal {path} ({exc.strerror}): free space in "
                        f"the lock directory {path.parent} (under TMPDIR) or point TMPDIR at a writable "
                        "directory shared by every worker", str(path)) from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_journal(namespace: str, generation: int, *, lock_dir: str | os.PathLike[str] | None = None,
                   base: str | None = None, manager: str | None = None, shm_dir: str | None = None) -> Path:
    """Create ``{ns}.journal`` holding only the header (exclusively; caller holds the coordinator lock).

    ``lock_dir`` defaults to ``lock_directory()``; ``shm_dir`` (the directory of the segments) to the namespace's
    (``segment_dir.namespace_directory``). ``FileExistsError`` when a journal is already there
    (reclaim it first).
    """
    validate_namespace(namespace)
    path = journal_path(namespace, lock_dir)
    if (base is None) != (manager is None):
        raise ValueError("pass both base and manager, or neither")
    if base is not None:
        from flextensor.shm.names import manager_namespace

        if manager_namespace(base, manager) != namespace:  # type: ignore[arg-type]
            raise ValueError(f"base {base!r} and manager {manager!r} do not derive namespace {namespace!r}")
    directory = shm_dir or segment_dir.namespace_directory(namespace)
    if directory == segment_dir.DEFAULT_DIRECTORY:
        directory = segment_dir.DEFAULT_DIRECTORY  # the default object itself: msgspec omits a default by identity
    header = JournalHeader(protocol=PROTOCOL_VERSION, library_version=LIBRARY_VERSION, namespace=namespace,
                           generation=generation, base=base, manager=manager, shm_dir=directory,
                           shm_dev=segment_dir.directory_device(directory))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        _write_line(fd, header, path)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    _fsync_dir(path.parent)
    return path


def append_intent(namespace: str, kind: IntentKind, name: str, generation: int, *,
                  lock_dir: str | os.PathLike[str] | None = None) -> None:
    """Record that ``name`` is about to be created (caller holds the coordinator lock); fsynced on return.

    The name is checked exactly as ``read_journal`` will check it, so we never write a journal we could not
    clean up. ``FileNotFoundError`` when the generation's journal is gone.
    """
    intent = Intent(kind=kind, name=name, generation=generation)
    _check_intent(intent, namespace, generation, where=f"intent for {name!r}")
    path = journal_path(namespace, lock_dir)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    try:
        _write_line(fd, intent, path)
    finally:
        os.close(fd)


def _name_pattern(kind: str, namespace: str, generation: int) -> re.Pattern[str]:
    ns = re.escape(namespace)
    if kind == "lockfile":
        return re.compile(rf"{ns}\.g{generation}\.{_KIND_PART}\.lock")
    return re.compile(rf"/{ns}\.g{generation}\.{_KIND_PART}")


def _check_intent(intent: Intent, namespace: str, generation: int, *, where: str) -> None:
    if intent.generation != generation:
        raise ShmProtocolError(f"{where}: intent generation {intent.generation} differs from the journal's "
                               f"generation {generation}")
    if not _name_pattern(intent.kind, namespace, generation).fullmatch(intent.name):
        raise ShmProtocolError(
            f"{where}: {intent.kind} name {intent.name!r} is not a resource of namespace {namespace!r} "
            f"generation {generation}; refusing to touch it"
        )


def _fail(path: Path, lineno: int, problem: str) -> ShmProtocolError:
    return ShmProtocolError(
        f"ownership journal {path}, line {lineno}: {problem}. Nothing was removed; the journal was written by "
        "another flextensor version or is corrupt: run cleanup with the flextensor version that created it, or "
        "stop every worker of this namespace and remove its resources by hand"
    )


def read_journal(ns_or_path: str | os.PathLike[str], *, lock_dir: str | os.PathLike[str] | None = None) -> Journal:
    """Read and validate a journal (by namespace, in ``lock_dir``, or by path), and bind its namespace to the
    directory of its segments (see the module docstring). ``FileNotFoundError`` when it does not exist."""
    path = resolve_journal_path(ns_or_path, lock_dir)
    with open(path, "rb") as f:
        data = f.read(MAX_JOURNAL_BYTES + 1)
    if len(data) > MAX_JOURNAL_BYTES:
        raise _fail(path, 1, f"the file is larger than {MAX_JOURNAL_BYTES} bytes, which no journal is")
    if not data:
        raise _fail(path, 1, "the file is empty (its creator died before writing the header?)")
    lines = data.split(b"\n")
    if lines[-1] != b"":
        raise _fail(path, len(lines), "the last line is incomplete (no newline)")
    lines.pop()
    # Line 1 first as plain JSON: a future protocol may change the records, so check the version before
    # interpreting anything else.
    try:
        first = msgspec.json.decode(lines[0])
    except msgspec.DecodeError as exc:
        raise _fail(path, 1, f"not JSON ({exc})") from None
    if not isinstance(first, dict) or first.get("record") != "header":
        raise _fail(path, 1, "the first line is not a journal header record")
    protocol = first.get("protocol")
    if protocol != PROTOCOL_VERSION:
        raise _fail(path, 1, f"journal protocol {protocol!r} (written by flextensor "
                             f"{first.get('library_version')!r}); this flextensor {LIBRARY_VERSION} reads protocol "
                             f"{PROTOCOL_VERSION} only")
    records = []
    for lineno, line in enumerate(lines, start=1):
        try:
            records.append(_decoder.decode(line))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _fail(path, lineno, f"malformed record ({exc})") from None
    header = records[0]
    if not isinstance(header, JournalHeader):  # pragma: no cover - checked above
        raise _fail(path, 1, "the first line is not a journal header record")
    try:
        validate_namespace(header.namespace)
    except ValueError as exc:
        raise _fail(path, 1, f"invalid namespace ({exc})") from None
    if path.name.endswith(JOURNAL_SUFFIX) and path.name[: -len(JOURNAL_SUFFIX)] != header.namespace:
        raise _fail(path, 1, f"the header names namespace {header.namespace!r}, not the file's")
    if header.generation < 1:
        raise _fail(path, 1, f"generation {header.generation} is invalid")
    if (header.base is None) != (header.manager is None):
        raise _fail(path, 1, "base and manager must both be present or both absent")
    if header.base is not None:
        from flextensor.shm.names import manager_namespace

        try:
            derived = manager_namespace(header.base, header.manager)  # type: ignore[arg-type]
        except ValueError as exc:
            raise _fail(path, 1, f"invalid base or manager ({exc})") from None
        if derived != header.namespace:
            raise _fail(path, 1, f"base {header.base!r} and manager {header.manager!r} do not derive namespace "
                                 f"{header.namespace!r}")
    if "\x00" in header.shm_dir or not os.path.isabs(header.shm_dir) or \
            os.path.normpath(header.shm_dir) != header.shm_dir:
        raise _fail(path, 1, f"shm_dir {header.shm_dir!r} is not an absolute, normalised directory path")
    intents: list[Intent] = []
    for lineno, record in enumerate(records[1:], start=2):
        if not isinstance(record, Intent):
            raise _fail(path, lineno, "a second header record")
        try:
            _check_intent(record, header.namespace, header.generation, where="intent")
        except ShmProtocolError as exc:
            raise _fail(path, lineno, str(exc)) from None
        intents.append(record)
    segment_dir.bind_namespace(header.namespace, header.shm_dir)
    return Journal(path=str(path), header=header, intents=intents)


def remove_journal(namespace: str, *, lock_dir: str | os.PathLike[str] | None = None) -> bool:
    """Unlink the namespace's journal (in ``lock_dir``, default ``lock_directory()``); True if it existed."""
    try:
        os.unlink(journal_path(namespace, lock_dir))
    except FileNotFoundError:
        return False
    return True


def list_journals(lock_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Namespaces that have a journal in ``lock_dir`` (default: this user's lock directory), sorted.

    File names that are not valid namespaces are skipped: they cannot be ours.
    """
    directory = resolve_lock_directory(lock_dir)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        if not entry.endswith(JOURNAL_SUFFIX):
            continue
        ns = entry[: -len(JOURNAL_SUFFIX)]
        try:
            validate_namespace(ns)
        except ValueError:
            continue
        out.append(ns)
    return sorted(out)
