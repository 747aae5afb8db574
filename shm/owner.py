"""``ShmOwner``: creating and opening a generation's resources so that they share the coordinator's lifetime.

Every segment and lock made through an owner is named inside the generation
(``/{ns}.g{gen}.{kind}``; locks ``/{ns}.g{gen}.l{kind}`` or ``{lockdir}/{ns}.g{gen}.l{kind}.lock``) and
journaled, under the coordinator lock, *before* it is created. So the last participant to leave (or offline
cleanup) finds and unlinks all of it, and nothing depends on the creator still being around: a follower
that joined can keep attaching after the creator closed.

The coordinator lock is held only for the journal append (and never for ``posix_fallocate`` of a large
segment): a participant holding a live lease is never reclaimed, so its journaled name cannot be removed
between the append and the create.

Blobs (``write_blob``/``read_blob``) are small segments for manifests and plans::

    offset 0   u64  length (stored last, aligned, after the bytes)
    offset 8   length bytes of payload

Segments made ahead (``prepare_segments``): allocating tmpfs pages is the slow part of publishing (a fresh
anonymous copy is 1.4-4x faster on the machines measured, see ``docs/benchmarks.md``), and a creator knows its block
sizes from the profile before its checkpoint is loaded. So it can have the segments created, journaled and
populated on a background thread (``ft-prepare``) while it loads; ``create_segment(kind, size)`` then hands out
the prepared segment (waiting for it if needed, raising its creation error such as ``ShmSpaceError``) instead of
allocating. A prepared segment whose size differs from the one asked for is unlinked and made again. ``close()``
stops the preparation after the segment in flight and unmaps the segments nobody took (their names stay in
the journal, so the last participant unlinks them).

Setup tracking: every call runs inside ``setup()``; ``close()`` (called by ``ShmCoordinator.close``) waits
for setup in progress in other threads to finish and then rejects new setup with ``RuntimeError``. Segments
and locks the owner handed out belong to the caller, who closes them; the owner does not unmap them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager

from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.header import load_u64, store_u64
from flextensor.shm.journal import IntentKind, append_intent
from flextensor.shm.locks import FileLock, LockBackend, SemaphoreLock
from flextensor.shm.names import generation_resource_name, lock_directory
from flextensor.shm.segment import SharedSegment, check_file_intact

__all__ = ["ShmOwner", "BLOB_HEADER_SIZE"]

BLOB_HEADER_SIZE = 8

logger = logging.getLogger(__name__)


class ShmOwner:
    """The resource factory of one coordinator handle (``ShmCoordinator.memory_owner``).

    ``registration`` is a context manager factory from the coordinator that holds the coordinator lock (and
    refuses once the coordinator is closed); tests and tools never build an owner directly.
    """

    def __init__(
        self,
        namespace: str,
        generation: int,
        is_creator: bool,
        registration: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._namespace = namespace
        self._generation = generation
        self._is_creator = is_creator
        self._registration = registration
        self._journaled: set[tuple[str, str]] = set()
        self._cond = threading.Condition()
        self._active: Counter[int] = Counter()  # thread ident -> nesting depth of setup() in that thread
        self._closed = False
        self._preparer: ThreadPoolExecutor | None = None
        self._prepared: dict[str, tuple[int, Future[SharedSegment]]] = {}  # kind -> (size, segment being made)
        self._made: list[tuple[str, int, int | None]] = []  # (name, size, inode) of every segment created here

    # ------------------------------------------------------------------ identity
    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def is_creator(self) -> bool:
        return self._is_creator

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def block_alignment(self) -> int:
        """Where the arena's blocks start in this namespace's directory (``segment_dir.block_alignment``: a page
        of its mount, 2 MiB at most); every participant lays the arena out with it."""
        from flextensor.shm import segment_dir

        return segment_dir.block_alignment(segment_dir.namespace_directory(self._namespace))

    @property
    def huge_tmpfs(self) -> bool:
        """Whether this namespace's directory is a tmpfs that gives files huge pages unasked
        (``segment_dir.PageInfo.huge_unasked``): allocating a page there costs the cores little, so a creator's
        publish from RAM is its copy."""
        from flextensor.shm import segment_dir

        return segment_dir.page_info(segment_dir.namespace_directory(self._namespace)).huge_unasked

    def resource_name(self, kind: str) -> str:
        """``/{ns}.g{gen}.{kind}`` (``ValueError`` for a bad kind)."""
        return generation_resource_name(self._namespace, self._generation, kind)

    # ------------------------------------------------------------------ setup tracking
    @contextmanager
    def setup(self) -> Iterator[ShmOwner]:
        """Mark local setup in progress: ``close()`` waits for it. ``RuntimeError`` once the owner is closed
        (nested calls from a thread already inside ``setup()`` are allowed to finish their work)."""
        me = threading.get_ident()
        with self._cond:
            if self._closed and not self._active[me]:
                raise RuntimeError(
                    f"the shared-memory owner of namespace {self._namespace!r} (generation {self._generation}) is "
                    "closed (its session or coordinator was closed): it creates nothing more; open a new session"
                )
            self._active[me] += 1
        try:
            yield self
        finally:
            with self._cond:
                self._active[me] -= 1
                if not self._active[me]:
                    del self._active[me]
                self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Reject new setup and wait for setup running in other threads. Idempotent.

        ``RuntimeError`` when called from inside ``setup()`` (it would wait for itself); ``TimeoutError``
        when other threads' setup does not finish within ``timeout``.
        """
        me = threading.get_ident()
        with self._cond:
            if self._active[me]:
                raise RuntimeError(f"cannot close the owner of {self._namespace!r} from inside its own setup()")
            self._closed = True
        if self._preparer is not None:
            self._preparer.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            if not self._cond.wait_for(lambda: not self._active, timeout):
                raise TimeoutError(
                    f"setup of namespace {self._namespace!r} is still running in {len(self._active)} other "
                    f"thread(s) after {timeout:g} s; close() can be retried once it finishes"
                )
        self._drop_prepared()

    def _drop_prepared(self) -> None:
        """Unmap the prepared segments nobody took (their journaled names are unlinked by the last participant)."""
        prepared, self._prepared = self._prepared, {}
        for _size, future in prepared.values():
            try:
                segment = future.result()  # cancelled ones raise at once; a running one is finishing now
            except BaseException:  # noqa: BLE001 - cancelled or failed: nothing was mapped here
                continue
            segment.close()

    # ------------------------------------------------------------------ journal
    def _journal(self, kind: IntentKind, name: str) -> None:
        key = (kind, name)
        if key in self._journaled:
            return
        with self._registration():
            append_intent(self._namespace, kind, name, self._generation)
        self._journaled.add(key)

    # ------------------------------------------------------------------ segments
    def create_segment(self, kind: str, size: int, *, populate: bool = True, reserve: bool = True) -> SharedSegment:
        """Journal, then create ``/{ns}.g{gen}.{kind}`` of ``size`` bytes (``FileExistsError`` if it exists).

        A segment prepared for ``kind`` (:meth:`prepare_segments`) is handed out instead, once it is ready.
        """
        with self.setup():
            name = self.resource_name(kind)
            entry = self._prepared.pop(kind, None)
            if entry is not None:
                prepared_size, future = entry
                if prepared_size == size:
                    return future.result()  # its creation error, if any, is this call's error
                logger.debug("prepared segment %s has %d bytes, %d wanted: making it again", name, prepared_size, size)
                try:
                    future.result().close()
                except Exception:  # noqa: BLE001 - a failed preparation of the wrong size does not matter
                    pass
                SharedSegment.unlink_name(name)
            self._journal("segment", name)
            return self._track(SharedSegment.create(name, size, populate=populate, reserve=reserve))

    def prepare_segments(self, sizes: Mapping[str, int], *, reserve: bool = True) -> None:
        """Start creating (journal, allocate, populate) these segments on a background thread; see the module
        docs. Errors surface from the :meth:`create_segment` call that takes the segment. ``reserve=False``
        only creates and maps them: their pages are allocated range by range as they are filled
        (``SharedSegment.reserve_range``), for a creator whose private copy of the data is freed meanwhile."""
        with self.setup():
            if not self._is_creator:
                raise RuntimeError(f"only the creator of {self._namespace!r} prepares segments")
            if self._preparer is None:
                self._preparer = ThreadPoolExecutor(1, thread_name_prefix="ft-prepare")
            for kind, size in sizes.items():
                if kind in self._prepared:
                    continue
                self.resource_name(kind)  # ValueError for a bad kind, now rather than later
                self._prepared[kind] = (int(size), self._preparer.submit(self._create_now, kind, int(size),
                                                                         reserve))

    def _create_now(self, kind: str, size: int, reserve: bool = True) -> SharedSegment:
        with self.setup():
            name = self.resource_name(kind)
            self._journal("segment", name)
            return self._track(SharedSegment.create(name, size, populate=True, reserve=reserve))

    def _track(self, segment: SharedSegment) -> SharedSegment:
        with self._cond:
            self._made.append((segment.name, segment.size, segment.inode))
        return segment

    def check_intact(self) -> None:
        """``ShmProtocolError`` when a segment this owner created was truncated since (see
        ``SharedSegment.check_intact``); the coordinator calls it right before publishing READY."""
        with self._cond:
            made = list(self._made)
        for name, size, inode in made:
            check_file_intact(name, size, inode)

    def open_segment(self, kind: str, *, min_size: int = 0) -> SharedSegment:
        """Map ``/{ns}.g{gen}.{kind}`` (``FileNotFoundError`` when the creator has not made it; ``ValueError``
        when it holds fewer than ``min_size`` bytes, e.g. truncated since it was published)."""
        with self.setup():
            return SharedSegment.open(self.resource_name(kind), min_size=min_size)

    # ------------------------------------------------------------------ locks
    def _lock(self, kind: str, backend: LockBackend, timeout: float | None) -> FileLock | SemaphoreLock:
        name = self.resource_name(f"l{kind}")
        if backend == "semaphore":
            self._journal("semaphore", name)
            return SemaphoreLock(name, timeout=timeout)
        if backend == "file":
            filename = f"{name[1:]}.lock"
            self._journal("lockfile", filename)
            return FileLock(lock_directory() / filename, timeout=timeout)
        raise ValueError(f"unknown lock backend {backend!r}: choose 'file' or 'semaphore'")

    def create_lock(self, kind: str, backend: LockBackend = "file", *, timeout: float | None = None
                    ) -> FileLock | SemaphoreLock:
        """A per-resource lock of this generation (journaled; removed by the last participant)."""
        with self.setup():
            return self._lock(kind, backend, timeout)

    def open_lock(self, kind: str, backend: LockBackend = "file", *, timeout: float | None = None
                  ) -> FileLock | SemaphoreLock:
        """The same lock as ``create_lock`` from another participant. Both backends create the lock on first
        use, so opening journals it too (whoever comes first creates it)."""
        with self.setup():
            return self._lock(kind, backend, timeout)

    # ------------------------------------------------------------------ blobs
    def write_blob(self, kind: str, data: bytes) -> None:
        """Publish ``data`` in a new segment ``/{ns}.g{gen}.{kind}``: payload first, then its length."""
        payload = bytes(data)
        with self.setup():
            segment = self.create_segment(kind, BLOB_HEADER_SIZE + len(payload))
            try:
                segment.check_intact()
                buf = segment.buffer
                buf[BLOB_HEADER_SIZE:BLOB_HEADER_SIZE + len(payload)] = payload
                store_u64(buf, 0, len(payload))
                del buf
            finally:
                segment.close()

    def read_blob(self, kind: str) -> bytes:
        """The bytes published by ``write_blob``; ``ShmProtocolError`` when the length does not fit."""
        with self.setup():
            segment = self.open_segment(kind)
            try:
                if segment.size < BLOB_HEADER_SIZE:
                    raise ShmProtocolError(f"blob segment {segment.name} has {segment.size} bytes, fewer than its "
                                           f"{BLOB_HEADER_SIZE}-byte length prefix; it is corrupt")
                buf = segment.buffer
                length = load_u64(buf, 0)
                if BLOB_HEADER_SIZE + length > segment.size:
                    raise ShmProtocolError(f"blob segment {segment.name} declares {length} bytes but holds only "
                                           f"{segment.size - BLOB_HEADER_SIZE}; it is truncated or corrupt")
                data = bytes(buf[BLOB_HEADER_SIZE:BLOB_HEADER_SIZE + length])
                del buf
                return data
            finally:
                segment.close()

    def __repr__(self) -> str:
        role = "creator" if self._is_creator else "follower"
        return f"ShmOwner({self._namespace!r}, generation={self._generation}, {role}, closed={self._closed})"
