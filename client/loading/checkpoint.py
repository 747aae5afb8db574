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
While the readers work, a thread allocates the destination pages of the ranges next in line, a bounded window
ahead of them, so a read from disk is not stretched by page faults: ``checkpoint_pages.py`` says how and why (and
why it is not the segments' ``PopulateAhead``). :meth:`ReadPlan.read` says how long the reading took, how many
bytes were populated ahead and in how many seconds.
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
from typing import Iterator, Mapping

import torch

from flextensor.loading.checkpoint_pages import POPULATE_AHEAD_BYTES, Populate, ReadQueue, populate_pages

__all__ = ["CHUNK_BYTES", "READ_THREADS", "POPULATE_AHEAD_BYTES", "PROGRESS_INTERVAL_S", "TensorEntry",
           "SafetensorsCheckpoint", "ReadPlan", "ReadStats", "CheckpointTensor", "CheckpointWeights",
           "populate_pages"]

logger = logging.getLogger(__name__)

#: Each read is at most this many bytes (a tensor larger than it is read in several ranges, in parallel).
CHUNK_BYTES = 32 << 20
#: Reader threads (``preadv`` releases the GIL); a few suffice to keep an NVMe queue busy.
READ_THREADS = max(2, min(8, os.cpu_count() or 2))
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
        ahead = ReadQueue(ranges, self.populate if populate is True else populate or None, self.populate_ahead)
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
            stats.populated_bytes, stats.populate_s = ahead.populated_bytes, ahead.populate_s
        for tmp, dest in copies:
            dest.copy_(tmp)
        progress.finish()
        return stats


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

