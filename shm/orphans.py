"""Everything a namespace can own, found from its name alone (no journal, no header needed).

The journal is the record of what a generation created, but names are also *derivable*: every resource of
namespace ``ns`` is one of (``names.py``)::

    {shm_dir}/{ns}.c                             coordinator segment
    {shm_dir}/{ns}.g{N}.{kind}                   generation N's segments
    /dev/shm/sem.{ns}.g{N}.{kind}                generation N's semaphores (glibc's file for "/{ns}.g{N}.{kind}")
    {lock_dir}/{ns}.lock, {lock_dir}/{ns}.journal
    {lock_dir}/{ns}.g{N}.{kind}.lock             generation N's file locks

``kind`` never contains a dot, so ``{ns}.g{N}.`` followed by a dot-free kind can only belong to ``ns``: a
namespace ``a`` never matches the resources of ``a.g1.x`` (their kind part would contain dots).

Two users of this list:

* reclaiming a generation (``cleanup.remove_generation_locked``) also removes every ``{ns}.g{N}.*`` the
  journal does not name: resources of a generation whose journal was lost or truncated, or orphans an older
  version left behind, which would otherwise make every later creator fail with ``FileExistsError``.  This
  runs under the coordinator lock with no live lease, so none of them can be in use by a participant.
* forced cleanup (``cleanup_manager_namespace(..., force=True)``, ``ftd cleanup --force``) removes the whole
  list, for an operator who stopped every worker and whose metadata is corrupt or lost.

``{shm_dir}`` is the namespace's directory (``segment_dir.py``); ``/dev/shm`` is always looked in too (the
semaphores are there, and so are the segments of a run that used the default).

Only entries owned by ``owner_uid`` are listed: ``/dev/shm`` is shared by every user of the host, and a
same-named entry of another user is never ours to remove (``squatters`` lists those, for error messages).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from flextensor.shm import segment_dir
from flextensor.shm.names import validate_namespace

__all__ = ["Derived", "derived_resources", "squatters", "squatted_generations", "SHM_DIR", "shm_directories"]

SHM_DIR = Path(segment_dir.DEFAULT_DIRECTORY)
_KIND = r"[A-Za-z][A-Za-z0-9_-]*"


class Derived:
    """Paths of one namespace's resources that exist now, split by where they live."""

    def __init__(self) -> None:
        self.coordinator: list[Path] = []  # {shm_dir}/{ns}.c
        self.generation_shm: list[Path] = []  # segments and semaphore files of any generation
        self.generation_locks: list[Path] = []  # {ns}.g{N}.{kind}.lock
        self.namespace_files: list[Path] = []  # {ns}.journal, {ns}.lock

    def all(self) -> list[Path]:
        return self.generation_shm + self.generation_locks + self.coordinator + self.namespace_files


def _patterns(namespace: str) -> tuple[re.Pattern[str], re.Pattern[str], re.Pattern[str]]:
    ns = re.escape(validate_namespace(namespace))
    shm = re.compile(rf"(?:sem\.)?{ns}\.g\d+\.{_KIND}")
    lock = re.compile(rf"{ns}\.g\d+\.{_KIND}\.lock")
    return shm, lock, re.compile(rf"{ns}\.(?:journal|lock)")


def _owned(path: Path, owner_uid: int | None) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return owner_uid is None or st.st_uid == owner_uid


def shm_directories(namespace: str, shm_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Where ``namespace``'s shared-memory files may be: ``shm_dir`` (default: the namespace's directory,
    ``segment_dir.namespace_directory``), then ``/dev/shm`` if that is another."""
    first = Path(shm_dir if shm_dir is not None else segment_dir.namespace_directory(namespace))
    return [first] if first == SHM_DIR else [first, SHM_DIR]


def derived_resources(namespace: str, lock_dir: str | os.PathLike[str], *, owner_uid: int | None,
                      shm_dir: str | os.PathLike[str] | None = None) -> Derived:
    """The resources of ``namespace`` that exist now and belong to ``owner_uid`` (None: anyone's), looked for in
    :func:`shm_directories` and ``lock_dir``."""
    shm_re, lock_re, ns_re = _patterns(namespace)
    out = Derived()
    for directory in shm_directories(namespace, shm_dir):
        for entry in sorted(_listdir(directory)):
            path = directory / entry
            if entry == f"{namespace}.c":
                if _owned(path, owner_uid):
                    out.coordinator.append(path)
            elif shm_re.fullmatch(entry) and _owned(path, owner_uid):
                out.generation_shm.append(path)
    directory = Path(lock_dir)
    for entry in sorted(_listdir(directory)):
        path = directory / entry
        if lock_re.fullmatch(entry) and _owned(path, owner_uid):
            out.generation_locks.append(path)
        elif ns_re.fullmatch(entry) and _owned(path, owner_uid):
            out.namespace_files.append(path)
    return out


def squatters(names: list[str], owner_uid: int, shm_dir: Path = SHM_DIR) -> list[tuple[str, int]]:
    """``(entry, uid)`` for each of ``names`` (``/dev/shm`` entry names) that exists and belongs to a uid
    other than ``owner_uid``."""
    out = []
    for name in names:
        try:
            st = os.lstat(shm_dir / name)
        except FileNotFoundError:
            continue
        if st.st_uid != owner_uid:
            out.append((name, st.st_uid))
    return out


def squatted_generations(namespace: str, owner_uid: int, shm_dir: str | os.PathLike[str] | None = None
                         ) -> dict[int, tuple[str, int]]:
    """Generations of ``namespace`` that have a name in :func:`shm_directories` (segment or semaphore) owned by a
    uid other than ``owner_uid``: ``{generation: (first such entry, its uid)}``. A creator skips these numbers
    (see ``coordinator.py``): another user who made ``{ns}.g{N}.sd`` first would otherwise fail generation N."""
    pattern = re.compile(rf"(?:sem\.)?{re.escape(validate_namespace(namespace))}\.g(\d+)\.{_KIND}")
    out: dict[int, tuple[str, int]] = {}
    for directory in shm_directories(namespace, shm_dir):
        for entry in sorted(_listdir(directory)):
            match = pattern.fullmatch(entry)
            if match is None:
                continue
            try:
                uid = os.lstat(directory / entry).st_uid
            except FileNotFoundError:
                continue
            if uid != owner_uid:
                out.setdefault(int(match.group(1)), (entry, uid))
    return out


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
