"""Reading safetensors checkpoints straight into their final place: one read per tensor, no staging copy.

Why not ``safetensors.safe_open``: it maps the whole file, and every page it touches stays mapped in the
process (RSS) until the handle closes, and ``get_tensor`` copies each tensor into a fresh allocation that the
caller then copies again. A creator that must hold one copy of the model (its shared blocks) would peak near two.
Here the header is parsed (8-byte little-endian length, then JSON: ``{name: {dtype, shape, data_offsets}}``
relative to the end of the header, plus an optional ``__metadata__``) and each tensor's bytes are read with
``os.preadv`` directly into the destination tensor's memory (a host-block view, or a fresh tensor for resident
weights). Reads are collected, sorted by file and offset, cut into ranges of :data:`CHUNK_BYTES`, and run on
:data:`READ_THREADS` threads that take the ranges in file order, so the disk sees large sequential reads.

A checkpoint is one ``.safetensors`` file, a directory of shards with ``model.safetensors.index.json`` (the
Hugging Face layout; a directory with a single ``.safetensors`` file and no index also works), or the index
JSON itself. Every shard's header is checked against the file size when it is opened, so a truncated file is a
``ValueError`` naming the file and the first tensor that does not fit, before any byte is read.

Destination pages ahead of the readers
--------------------------------------
A destination is usually fresh memory (a host block nobody wrote yet): its pages do not exist, and a read into it
faults them in one at a time inside the copy, on the reader's thread, so from disk every read is stretched by
the page allocation. So while the readers work, a thread allocates the pages of the ranges next in line
(``MADV_POPULATE_WRITE``, several threads per range: :func:`flextensor.shm.prefault.populate_write_range`), at
most :data:`POPULATE_AHEAD_BYTES` ahead of them; a range the readers reach first is skipped (they fault it in
themselves, so from a warm page cache the two only add up). Populating a page never changes its bytes, so a
page two ranges share is simply populated twice. The caller may pass its own ``populate(address, nbytes)`` (a
shared segment's, which names a full ``/dev/shm``): its error stops the reads and is raised. The default one is
only a speed-up: a kernel without the advice, or memory that refuses it, just leaves the faults to the readers.
:meth:`ReadPlan.read` says how long the reading took, how many bytes were populated ahead and in how many
seconds.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from flextensor.shm.prefault import populate_write_range

__all__ = ["CHUNK_BYTES", "READ_THREADS", "POPULATE_AHEAD_BYTES", "PROGRESS_INTERVAL_S", "TensorEntry",
           "SafetensorsCheckpoint", "ReadPlan", "ReadStats", "CheckpointTensor", "CheckpointWeights",
           "populate_pages"]

logger = logging.getLogger(__name__)

#: Each read is at most this many bytes (a tensor larger than it is read in several ranges, in parallel).
CHUNK_BYTES = 32 << 20
#: Reader threads (``preadv`` releases the GIL); a few suffice to keep an NVMe queue busy.
READ_THREADS = max(2, min(8, os.cpu_count() or 2))
#: Destination pages are allocated at most this many bytes ahead of the readers (see the module docstring).
POPULATE_AHEAD_BYTES = 1 << 30
#: A read that runs longer than this logs its progress (bytes, rate, ETA) at this interval.
PROGRESS_INTERVAL_S = 2.0
#: The largest header accepted (the format's own reference limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: which file, where its bytes are (absolute offsets), its dtype and shape."""

    key: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse and check one shard's header (``ValueError`` naming the file and the problem)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"checkpoint file {str(path)!r} has {size} bytes: too short to be a safetensors file "
                             "(it is truncated or not safetensors)")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise ValueError(f"checkpoint file {str(path)!r} declares a {length}-byte header but holds {size} bytes: "
                             "it is truncated or not a safetensors file; download or save it again")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"checkpoint file {str(path)!r} has a malformed safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint file {str(path)!r} has a malformed safetensors header (not a JSON object)")
    base = 8 + length
    entries: dict[str, TensorEntry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(s) for s in shape)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"checkpoint file {str(path)!r}: tensor {key!r} has a malformed header entry "
                             f"{info!r}") from None
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"checkpoint file {str(path)!r}: tensor {key!r} has dtype {dtype_name!r}, which this "
                             f"torch cannot hold (known: {sorted(_DTYPES)})")
        expected = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise ValueError(f"checkpoint file {str(path)!r}: tensor {key!r} spans bytes [{begin}, {end}) but "
                             f"{dtype_name}{list(shape)} needs {expected}; the header is corrupt")
        if base + end > size:
            raise ValueError(f"checkpoint file {str(path)!r} is truncated: tensor {key!r} ends at byte {base + end} "
                             f"but the file has {size} bytes; download or save it again")
        entries[key] = TensorEntry(key, str(path), dtype, shape, base + begin, base + end)
    return entries


def _shard_files(path: Path) -> list[Path]:
    """The shard files ``path`` names (see the module docstring); ``FileNotFoundError`` / ``ValueError``."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    index = None
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            index = path / INDEX_NAME
        else:
            files = sorted(path.glob("*.safetensors"))
            if len(files) != 1:
                raise ValueError(f"checkpoint directory {str(path)!r} has no {INDEX_NAME} and {len(files)} "
                                 ".safetensors files; pass one file, or a directory of shards with its index")
            return files
    elif path.name.endswith(".json"):
        index = path
    else:
        return [path]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint index {str(index)!r} is malformed (it needs a 'weight_map'): {exc}") from None
    shards = []
    for name in dict.fromkeys(weight_map.values()):
        shard = index.parent / name
        if not shard.is_file():
            raise FileNotFoundError(f"checkpoint index {str(index)!r} names shard {name!r}, which does not exist")
        shards.append(shard)
    return shards


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint by key (headers only: no tensor data is read on opening)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.files = _shard_files(self.path)
        self.entries: dict[str, TensorEntry] = {}
        for shard in self.files:
            for key, entry in _read_header(shard).items():
                if key in self.entries:
                    raise ValueError(f"checkpoint {str(self.path)!r}: tensor {key!r} is in both "
                                     f"{self.entries[key].path!r} and {entry.path!r}")
                self.entries[key] = entry

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read(self, key: str) -> torch.Tensor:
        """One tensor in a fresh (contiguous, CPU) allocation: its only copy."""
        entry = self.entries[key]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        plan = ReadPlan(threads=1)
        plan.add(entry, out)
        plan.run()
        return out


def _writable(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (works for every dtype, bfloat16 included)."""
    import ctypes

    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass
class _Range:
    path: str
    offset: int
    dest: torch.Tensor  # a contiguous CPU tensor whose memory receives the bytes (it keeps that memory alive)
    dest_offset: int
    nbytes: int

    def pages(self) -> tuple[int, int]:
        """The page-aligned span ``(address, nbytes)`` of memory this range writes."""
        begin = self.dest.data_ptr() + self.dest_offset
        first = begin - begin % _PAGE
        return first, -(-(begin + self.nbytes - first) // _PAGE) * _PAGE


def populate_pages(address: int, nbytes: int) -> bool:
    """The default ``populate`` of a :class:`ReadPlan`: allocate the pages of ``[address, address + nbytes)``
    (``MADV_POPULATE_WRITE`` from several threads); False when this memory or kernel cannot (a speed-up only)."""
    try:
        return populate_write_range(address, nbytes)
    except OSError as exc:
        logger.debug("populating %d bytes at %#x ahead of the reads failed (%s); the reads fault them in", nbytes,
                     address, exc)
        return False


@dataclass
class ReadStats:
    """What one :meth:`ReadPlan.read` (or several, added up) did: seconds from the first read to the last, bytes
    read, bytes whose pages were populated ahead of the readers and the populating thread's seconds."""

    read_s: float = 0.0
    nbytes: int = 0
    populated_bytes: int = 0
    populate_s: float = 0.0

    def add(self, other: "ReadStats") -> None:
        self.read_s += other.read_s
        self.nbytes += other.nbytes
        self.populated_bytes += other.populated_bytes
        self.populate_s += other.populate_s


#: ``populate(address, nbytes)``: allocate those pages; False means "cannot here" (stop trying), an error stops the
#: reads (see the module docstring).
Populate = Callable[[int, int], "bool | None"]


class ReadPlan:
    """Reads collected with :meth:`add`, then done by :meth:`read` (or :meth:`run`) in file order over a few threads.

    A destination that is not contiguous (a transposed weight keeps its strides in a host block) is read into a
    temporary contiguous tensor and copied once; every other destination receives the bytes directly. Each
    pending range holds a reference to its destination, so its memory stays valid while a thread writes it.
    ``populate``: how destination pages are allocated ahead of the readers (see the module docstring; ``None``:
    not at all); :meth:`read` may be given another one for its call.
    """

    def __init__(self, *, threads: int = READ_THREADS, chunk_bytes: int = CHUNK_BYTES, label: str = "checkpoint",
                 populate: Populate | None = populate_pages, populate_ahead: int = POPULATE_AHEAD_BYTES) -> None:
        self.threads = max(1, threads)
        self.chunk_bytes = max(1 << 20, chunk_bytes)
        self.label = label
        self.populate = populate
        self.populate_ahead = max(0, populate_ahead)
        self._ranges: list[_Range] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (temporary, strided destination)
        self._cancel = threading.Event()

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._ranges)

    def add(self, entry: TensorEntry, dest: torch.Tensor) -> None:
        """Read ``entry``'s bytes into ``dest`` (a CPU tensor of its dtype and shape) at :meth:`run`."""
        if dest.dtype != entry.dtype or tuple(dest.shape) != entry.shape or dest.device.type != "cpu":
            raise ValueError(f"checkpoint tensor {entry.key!r} is {entry.dtype}{list(entry.shape)} but its "
                             f"destination is {dest.dtype}{list(dest.shape)} on {dest.device}")
        if entry.nbytes == 0:
            return
        target = dest
        if not dest.is_contiguous():
            target = torch.empty(entry.shape, dtype=entry.dtype)
            self._copies.append((target, dest))
        for offset in range(0, entry.nbytes, self.chunk_bytes):
            self._ranges.append(_Range(entry.path, entry.start + offset, target, offset,
                                       min(self.chunk_bytes, entry.nbytes - offset)))

    def detach(self) -> "ReadPlan":
        """The reads queued so far as a plan of their own (same settings), this one left empty: to run them on
        another thread while whoever flushes this plan finds nothing left to read."""
        other = ReadPlan(threads=self.threads, chunk_bytes=self.chunk_bytes, label=self.label,
                         populate=self.populate, populate_ahead=self.populate_ahead)
        other._ranges, self._ranges = self._ranges, []
        other._copies, self._copies = self._copies, []
        return other

    def cancel(self) -> None:
        """Stop :meth:`run` after the ranges in flight (a failure elsewhere: nobody needs the rest)."""
        self._cancel.set()

    def discard(self) -> None:
        """Drop the queued reads (and their references to the destinations) without reading."""
        self.cancel()
        self._ranges.clear()
        self._copies.clear()

    def run(self, *, populate: Populate | None | bool = True) -> int:
        """:meth:`read`, returning the bytes read."""
        return self.read(populate=populate).nbytes

    def read(self, *, populate: Populate | None | bool = True) -> ReadStats:
        """Do every read queued so far (file order, ``threads`` at a time) and say how it went. An I/O error, a
        short read (the file shrank since it was opened) or the error of a caller's ``populate`` is raised after
        every thread stopped. ``populate``: this call's way of allocating destination pages ahead (``True``: the
        plan's). Reads queued meanwhile wait for the next call."""
        ranges, self._ranges = sorted(self._ranges, key=lambda r: (r.path, r.offset)), []
        copies, self._copies = self._copies, []
        total = sum(r.nbytes for r in ranges)
        stats = ReadStats(nbytes=total)
        if not ranges:
            for tmp, dest in copies:
                dest.copy_(tmp)
            return stats
        ahead = _PopulateAhead(ranges, self.populate if populate is True else populate or None, self.populate_ahead,
                               stats)
        fds: dict[str, int] = {}
        progress = _Progress(self.label, total)

        def worker() -> None:
            while not self._cancel.is_set():
                r = ahead.claim()
                if r is None:
                    return
                _read_range(fds[r.path], r)
                progress.add(r.nbytes)

        start = time.monotonic()
        try:
            for path in dict.fromkeys(r.path for r in ranges):
                fds[path] = os.open(path, os.O_RDONLY)
            progress.start()
            ahead.start(self._cancel)
            threads = min(self.threads, len(ranges))
            errors = []
            if threads == 1:
                try:
                    worker()
                except BaseException as exc:  # noqa: BLE001 - raised below, once the populating thread stopped
                    errors.append(exc)
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="ft-ckpt-read") as pool:
                    futures = [pool.submit(worker) for _ in range(threads)]
                    for future in futures:
                        try:
                            future.result()
                        except BaseException as exc:  # noqa: BLE001 - raised below, once every thread stopped
                            self._cancel.set()
                            errors.append(exc)
            ahead.stop()
            if ahead.error is not None:  # the cause: a read that failed after it (a full /dev/shm) only follows
                raise ahead.error
            if errors:
                raise errors[0]
            if self._cancel.is_set():
                raise RuntimeError(f"reading {self.label} was cancelled")
        finally:
            ahead.stop()
            progress.stop()
            for fd in fds.values():
                os.close(fd)
            stats.read_s = time.monotonic() - start
        for tmp, dest in copies:
            dest.copy_(tmp)
        progress.finish()
        return stats


class _PopulateAhead:
    """The readers' queue of ranges, and the thread (``ft-ckpt-populate``) that allocates the destination pages of
    the next ranges while the readers work (see the module docstring). A range is either claimed by a reader or
    passed by the populating thread first, never both at once."""

    def __init__(self, ranges: list[_Range], populate: Populate | None, window: int, stats: ReadStats) -> None:
        self.ranges = ranges
        self.error: BaseException | None = None
        self._populate = populate
        self._window = window
        self._stats = stats
        self._cond = threading.Condition()
        self._claimed = 0  # ranges [0, _claimed) went to readers
        self._end = [0]  # _end[k]: bytes of ranges [0, k)
        for r in ranges:
            self._end.append(self._end[-1] + r.nbytes)
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self, cancel: threading.Event) -> None:
        if self._populate is not None and self._window > 0 and len(self.ranges) > 1:
            self._thread = threading.Thread(target=self._run, args=(self._populate, cancel), name="ft-ckpt-populate",
                                            daemon=True)
            self._thread.start()

    def claim(self) -> _Range | None:
        """The next range for a reader, or None when every range was handed out."""
        with self._cond:
            if self._claimed >= len(self.ranges):
                return None
            r = self.ranges[self._claimed]
            self._claimed += 1
            self._cond.notify_all()
            return r

    def stop(self) -> None:
        """Stop the populating thread after the range in flight and join it. Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _next(self, position: int, cancel: threading.Event) -> int | None:
        """The next range to populate at or after ``position`` (waiting while it is too far ahead), or None."""
        with self._cond:
            while True:
                if self._stopped or cancel.is_set():
                    return None
                position = max(position, self._claimed)  # the readers took those: they fault them in
                if position >= len(self.ranges):
                    return None
                if self._end[position] - self._end[self._claimed] <= self._window:
                    return position
                self._cond.wait(0.1)

    def _run(self, populate: Populate, cancel: threading.Event) -> None:
        position = 0
        last = (0, 0)  # the span populated last: a page it shares with the next range is populated once
        while (found := self._next(position, cancel)) is not None:
            position = found
            address, nbytes = self.ranges[position].pages()
            if last[0] <= address < last[1]:
                if address + nbytes <= last[1]:  # inside it: nothing new
                    position += 1
                    continue
                nbytes -= last[1] - address
                address = last[1]
            begin = time.monotonic()
            try:
                supported = populate(address, nbytes) is not False
            except BaseException as exc:  # noqa: BLE001 - raised by run() once the readers stopped
                self.error = exc
                cancel.set()
                return
            finally:
                self._stats.populate_s += time.monotonic() - begin
            if not supported:
                return
            self._stats.populated_bytes += nbytes
            last = (address, address + nbytes)
            position += 1


def _read_range(fd: int, r: _Range) -> None:
    view = _writable(r.dest)[r.dest_offset:r.dest_offset + r.nbytes]
    done = 0
    while done < r.nbytes:
        n = os.preadv(fd, [view[done:]], r.offset + done)
        if n <= 0:
            raise ValueError(f"checkpoint file {r.path!r} ended at byte {r.offset + done} while reading "
                             f"{r.nbytes} bytes at {r.offset}: it was truncated after it was opened")
        done += n


class _Progress:
    """Logs bytes, rate and ETA every :data:`PROGRESS_INTERVAL_S` from its own thread, so a slow disk (one
    range taking longer than the interval) still shows the load is alive."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.begin = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.begin = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="ft-ckpt-progress", daemon=True)
        self._thread.start()

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes

    def _loop(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            self._log("reading")

    def _log(self, what: str) -> None:
        elapsed = max(time.monotonic() - self.begin, 1e-9)
        done = self.done
        rate = done / elapsed
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        logger.info("%s %s: %.1f of %.1f MiB (%.0f%%) in %.1f s, %.2f GB/s, ETA %.1f s", what, self.label,
                    done / 2**20, self.total / 2**20, 100 * done / max(self.total, 1), elapsed, rate / 1e9, eta)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def finish(self) -> None:
        elapsed = time.monotonic() - self.begin
        if elapsed >= PROGRESS_INTERVAL_S:
            self._log("read")
        else:
            logger.debug("read %s: %d bytes in %.2f s", self.label, self.total, elapsed)


class CheckpointTensor:
    """A checkpoint tensor not read yet: what the engine's build gets as a ``weights`` value for a meta tensor.

    ``read_into(view)`` queues the read into the host-block view (done at :meth:`CheckpointWeights.flush`, all
    reads together in file order); ``to(device)`` reads it now into a fresh tensor (a resident weight)."""

    def __init__(self, entry: TensorEntry, plan: ReadPlan, owner: "CheckpointWeights | None" = None) -> None:
        self.entry = entry
        self._plan = plan
        self._owner = owner

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.entry.shape)

    def read_into(self, dest: torch.Tensor) -> None:
        self._plan.add(self.entry, dest)

    def to(self, device: torch.device | str) -> torch.Tensor:
        out = torch.empty(self.entry.shape, dtype=self.entry.dtype)
        plan = ReadPlan(threads=self._plan.threads, label=f"{self._plan.label} ({self.entry.key})",
                        populate=self._plan.populate)
        plan.add(self.entry, out)
        stats = plan.read()
        if self._owner is not None:
            self._owner.bytes_read += stats.nbytes
            self._owner.stats.add(stats)
        return out if torch.device(device).type == "cpu" else out.to(device)


class CheckpointWeights(Mapping[str, CheckpointTensor]):
    """``weights=`` for adoption: model tensor name -> its :class:`CheckpointTensor` (see the module docstring).

    The engine's build queues every host-block read and calls :meth:`flush` once all blocks exist; a caller that
    gives up calls :meth:`close`, which drops queued reads."""

    def __init__(self, checkpoint: SafetensorsCheckpoint, keys: Mapping[str, str], *, label: str = "checkpoint"
                 ) -> None:
        self.checkpoint = checkpoint
        self.plan = ReadPlan(label=label)
        self.bytes_read = 0  # block reads at flush() and resident reads (CheckpointTensor.to) alike
        self.stats = ReadStats()  # of the same reads: seconds reading, pages populated ahead
        self._lock = threading.Lock()
        self._values = {name: CheckpointTensor(checkpoint.entries[key], self.plan, self)
                        for name, key in keys.items()}

    def __getitem__(self, name: str) -> CheckpointTensor:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def flush(self, *, populate: Populate | None | bool = True) -> ReadStats:
        """Do the queued reads (parallel, file order); raises the first read error after every thread stopped.
        ``populate``: how the destinations' pages are allocated ahead of the reads (see :meth:`ReadPlan.read`).
        Returns how this flush went (:attr:`stats` adds up every read)."""
        stats = self.plan.read(populate=populate)
        with self._lock:  # a session creator's reads may run on a thread while the engine flushes an empty plan
            self.bytes_read += stats.nbytes
            self.stats.add(stats)
        return stats

    def close(self) -> None:
        self.plan.discard()

