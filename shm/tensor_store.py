"""Publish a model's resident parameters and buffers once per host; attach and install them anywhere.

The creator copies each selected tensor into the store's data segments and writes a msgpack manifest (``.sm``,
see ``manifest.py``) through its ``ShmOwner``, *before* the coordinator turns READY, so a follower that sees
READY finds complete bytes. Followers decode and validate the manifest against the real
segment sizes, then ``materialize`` checks every record against their own (usually ``meta``) model before
touching it: a mismatched name, kind, dtype, shape or buffer persistence is refused with the tensor's name and
the model is left unchanged.

Tied registrations (one tensor under several names) are stored once and restored as one object under every
name, so ``lm_head.weight is embed.weight`` holds again in the follower. On a CPU target device the installed
tensors are zero-copy views of the shared segment (read-only by convention: writing to them changes every
worker's copy); on a GPU target they are copied to the device.

The data lies in parts (several segments), laid out by ``store_layout.py``, which says why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple

from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.populate_ahead import PieceCursor, PopulateAhead, cut_into_pieces
from flextensor.shm.sizes import align_up
from flextensor.shm.store_layout import (ALIGNMENT, DATA_KIND, STORE_MAX_PARTS, STORE_PART_MIN_BYTES, StoreLayout,
                                         data_kind, record_key, store_layout)
from flextensor.shm.manifest import (
    MANIFEST_PROTOCOL,
    StoreManifest,
    TensorRecord,
    contiguous_stride,
    decode_manifest,
    encode_manifest,
    span_bytes,
    validate_manifest,
    DTYPE_SIZES,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.owner import ShmOwner
    from flextensor.shm.segment import SharedSegment

logger = logging.getLogger(__name__)

MANIFEST_KIND = "sm"
#: A registration on a thread (:meth:`SharedTensorStore.unpinned_ranges`) registers at most this many bytes per
#: driver call, which holds a driver lock the process's kernel launches wait for (a trainer sharing the process
#: waits for one range at most), and a direct copy (:meth:`SharedTensorStore.copies_on`) copies at most this many,
#: aligned to it within the segment, so that no copy spans two registrations.
REGISTER_RANGE_BYTES = 256 << 20
__all__ = ["ALIGNMENT", "DATA_KIND", "MANIFEST_KIND", "STORE_MAX_PARTS", "STORE_PART_MIN_BYTES", "SharedTensorStore",
           "StoreLayout", "data_kind", "model_registrations", "store_layout"]


@dataclass(frozen=True)
class _Registration:
    """Where a name lives in a model: ``module._parameters[attr]`` or ``module._buffers[attr]``."""

    module: Any
    attr: str
    kind: str
    persistent: bool
    tensor: Any


def model_registrations(model: Any) -> dict[str, _Registration]:
    """Every registered parameter and buffer of ``model`` by its full name, tied names included."""
    found: dict[str, _Registration] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for attr, param in module._parameters.items():
            if param is not None:
                found[prefix + attr] = _Registration(module, attr, "parameter", True, param)
        for attr, buf in module._buffers.items():
            if buf is not None:
                persistent = attr not in module._non_persistent_buffers_set
                found[prefix + attr] = _Registration(module, attr, "buffer", persistent, buf)
    return found


def _dtype_name(dtype: "torch.dtype") -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype {dtype} cannot be published to shared memory (supported: {sorted(DTYPE_SIZES)})")
    return name


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, name)


def _plan_records(model: Any, names: Iterable[str] | None, *, allow_meta: bool = False,
                  part_min_bytes: int | None = None) -> tuple[list[TensorRecord], list[Any], StoreLayout]:
    """Group tied names, lay the tensors out in parts (:func:`store_layout`) and return records and sources in
    fill order, and the layout. ``allow_meta``: a tensor on ``meta`` is laid out too (its bytes come from
    elsewhere)."""
    registrations = model_registrations(model)
    wanted = set(registrations) if names is None else set(names)
    unknown = sorted(wanted - set(registrations))
    if unknown:
        raise ValueError(f"cannot publish {unknown[:5]}: no such parameter or buffer in the model")
    # A tie is one tensor: publishing any of its names publishes all of them, so followers re-tie it.
    wanted_ids = {id(registrations[name].tensor) for name in wanted}
    groups: dict[int, list[str]] = {}
    for name, reg in registrations.items():
        if id(reg.tensor) in wanted_ids:
            groups.setdefault(id(reg.tensor), []).append(name)
    planned: dict[str, tuple[list[str], Any, str, list[int], list[int], int]] = {}
    for group in groups.values():
        first = registrations[group[0]]
        tensor = first.tensor
        if tensor.device.type == "meta" and not allow_meta:
            raise ValueError(f"cannot publish {group[0]!r}: it is on the meta device (it holds no values)")
        kinds = {registrations[n].kind for n in group}
        if len(kinds) != 1:
            raise ValueError(f"tensor registered as both parameter and buffer under {group}: cannot publish it")
        dtype = _dtype_name(tensor.dtype)
        shape = list(tensor.shape)
        stride = contiguous_stride(shape)
        nbytes = span_bytes(shape, stride, 0, DTYPE_SIZES[dtype])
        planned[record_key(group)] = (group, tensor, dtype, shape, stride, nbytes)
    layout = store_layout({key: entry[5] for key, entry in planned.items()}, part_min_bytes=part_min_bytes)
    records: list[TensorRecord] = []
    sources: list[Any] = []
    for key in layout.order:
        group, tensor, dtype, shape, stride, nbytes = planned[key]
        first = registrations[group[0]]
        part, offset = layout.places[key]
        records.append(
            TensorRecord(
                name=group[0],
                kind=first.kind,  # type: ignore[arg-type]
                persistent=first.persistent,
                dtype=dtype,
                shape=shape,
                stride=stride,
                storage_offset=0,
                byte_offset=offset,
                nbytes=nbytes,
                requires_grad=bool(getattr(tensor, "requires_grad", False)),
                aliases=group[1:],
                part=part,
            )
        )
        sources.append(tensor)
    return records, sources, layout


class _PartRange(NamedTuple):
    """The bytes ``[low, high)`` of part ``part`` that cover its records (``low`` 256-aligned, so each record keeps
    its alignment inside a copy of the range), where the range starts in one buffer holding every part's range
    (``at``, 256-aligned), and ``(record, first byte, bytes spanned)`` per record."""

    part: int
    low: int
    high: int
    at: int
    spans: list[tuple[TensorRecord, int, int]]

    @property
    def end(self) -> int:
        """Where the range ends in the buffer."""
        return self.at + self.high - self.low


class SharedTensorStore:
    """A published set of tensors in shared data segments (its parts) plus its manifest.

    Construct with :meth:`create_from_model` (creator) or :meth:`attach` (followers). Pass the coordinator's
    ``memory_owner`` as ``shm_owner`` so the store lives exactly as long as the sharing group; without one,
    the store opens (and on :meth:`close` closes) a coordinator of its own for ``namespace``.
    """

    def __init__(
        self,
        manifest: StoreManifest,
        segments: "list[SharedSegment]",
        owner: "ShmOwner",
        own_coordinator: "ShmCoordinator | None" = None,
    ) -> None:
        self.manifest = manifest
        self._segments = list(segments)
        self._owner = owner
        self._own_coordinator = own_coordinator
        self._closed = False

    # ----------------------------------------------------------------------------------------- construction
    @classmethod
    def create_from_model(
        cls,
        namespace: str,
        model: Any,
        *,
        names: Iterable[str] | None = None,
        shm_owner: "ShmOwner | None" = None,
        lease_seconds: float = 30.0,
        fill: "Callable[..., None] | None" = None,
        window: int = 0,
        part_min_bytes: int | None = None,
        piece: int = 0,
        reserve_ahead: bool = True,
    ) -> "SharedTensorStore":
        """Copy ``model``'s selected parameters and buffers (all when ``names`` is None) into shared memory.

        ``fill(record, view, source)``, when given, writes each record's bytes into its ``view`` instead of
        ``view.copy_(source)`` (a source may then be on ``meta``: the fill supplies its bytes, e.g. from a
        checkpoint; the fill may also point the model at the view). Parts the owner prepared without their pages
        (``prepare_segments(..., reserve=False)``, sizes from :func:`store_layout`) get them record by record,
        allocated up to ``window`` bytes ahead of the copy, a worker per part (``populate_ahead.py``; 0: each just
        before its copy). ``part_min_bytes``: the least bytes per part (default :data:`STORE_PART_MIN_BYTES`).

        ``piece`` (with ``fill``): each record's pages come in pieces of at most that many bytes, and the fill
        takes a fourth argument, the record's :class:`~flextensor.shm.populate_ahead.PieceCursor` (bytes from the
        record's start): it must wait through it before writing and may report what it wrote as it goes, so a
        fill that frees its source as it copies holds a piece of the record twice, not the whole record (a fill
        that reports pieces once it has queued their copies holds what it queued as well). ``reserve_ahead=False``
        (with ``fill``): nothing is allocated ahead, the fill's writes allocate the pages themselves (writes into
        the segments' files, which fail with ``ENOSPC`` where a store through a mapping would raise SIGBUS)."""
        if not reserve_ahead and fill is None:
            raise ValueError("create_from_model: reserve_ahead=False needs a fill that allocates the pages it "
                             "writes; pass fill= or leave reserve_ahead on")
        owner, coordinator = _resolve_owner(namespace, shm_owner, lease_seconds, creating=True)
        segments: list[SharedSegment] = []
        try:
            records, sources, layout = _plan_records(model, names, allow_meta=fill is not None,
                                                     part_min_bytes=part_min_bytes)
            for kind, size in layout.kinds.items():
                segments.append(owner.create_segment(kind, size))
                segments[-1].check_intact()
            populate = None
            in_pieces = piece > 0 and fill is not None
            bounds = [cut_into_pieces(r.nbytes, piece if in_pieces else max(1, r.nbytes)) for r in records]
            first = [0]
            for record_bounds in bounds:
                first.append(first[-1] + len(record_bounds))
            if reserve_ahead and not all(segment.reserved for segment in segments):
                populate = PopulateAhead([(segments[r.part], r.byte_offset + lo, hi - lo)
                                          for r, record_bounds in zip(records, bounds) for lo, hi in record_bounds],
                                         window=max(1, window), workers=len(segments)).start()
            try:
                for index, (record, source) in enumerate(zip(records, sources)):
                    cursor = PieceCursor(populate, first[index], bounds[index], segment=segments[record.part],
                                         start=record.byte_offset)
                    if not in_pieces:
                        cursor.wait_through(record.nbytes)
                    view = segments[record.part].tensor(_torch_dtype(record.dtype), record.shape, record.stride,
                                                        record.byte_offset)
                    if fill is None:
                        view.copy_(source.detach())
                    elif in_pieces:
                        fill(record, view, source, cursor)
                        cursor.wait_through(record.nbytes)
                    else:
                        fill(record, view, source)
                    cursor.written_through(record.nbytes)
            finally:
                if populate is not None:
                    populate.close()
            manifest = StoreManifest(
                protocol=MANIFEST_PROTOCOL,
                library_version=_library_version(),
                generation=owner.generation,
                data_size=sum(layout.part_sizes),
                part_sizes=list(layout.part_sizes),
                tensors=records,
            )
            for segment in segments:
                segment.check_intact()
            owner.write_blob(MANIFEST_KIND, encode_manifest(manifest))
            logger.info(
                "published %d tensors (%.1f MiB in %d part(s)) to %s generation %d",
                len(records), manifest.data_size / 2**20, len(segments), owner.namespace, owner.generation,
            )
            if coordinator is not None:
                coordinator.notify_ready()
        except BaseException as exc:
            for segment in segments:
                segment.close()  # the owner unlinks the names with the generation; drop our mappings now
            if coordinator is not None:
                coordinator.mark_failed(exc)
                coordinator.close()
            raise
        return cls(manifest, segments, owner, coordinator)

    @classmethod
    def attach(
        cls,
        namespace: str,
        *,
        shm_owner: "ShmOwner | None" = None,
        timeout: float | None = None,
        lease_seconds: float = 30.0,
    ) -> "SharedTensorStore":
        """Open a published store; validates the manifest against the segment before returning."""
        owner, coordinator = _resolve_owner(namespace, shm_owner, lease_seconds, creating=False)
        try:
            if coordinator is not None:
                coordinator.wait_for_ready(timeout)
            manifest = decode_manifest(owner.read_blob(MANIFEST_KIND))
            if manifest.generation != owner.generation:
                raise ShmProtocolError(
                    f"tensor store manifest of {namespace!r} is from generation {manifest.generation}, the "
                    f"coordinator is at {owner.generation}: run cleanup for this namespace and restart workers"
                )
            segments: list[SharedSegment] = []
            try:
                for part in range(len(manifest.part_sizes)):
                    segments.append(owner.open_segment(data_kind(part)))
                validate_manifest(manifest, [segment.size for segment in segments])
            except BaseException:
                for segment in segments:
                    segment.close()
                raise
        except BaseException:
            if coordinator is not None:
                coordinator.close()
            raise
        return cls(manifest, segments, owner, coordinator)

    # ---------------------------------------------------------------------------------------------- reading
    @property
    def records(self) -> list[TensorRecord]:
        return list(self.manifest.tensors)

    @property
    def nbytes(self) -> int:
        return self.manifest.data_size

    def tensor(self, record: TensorRecord) -> "torch.Tensor":
        """Zero-copy view of one record in its shared segment."""
        self._check_open()
        return self._segments[record.part].tensor(
            _torch_dtype(record.dtype), record.shape, record.stride,
            record.byte_offset + record.storage_offset * DTYPE_SIZES[record.dtype],
        )

    def tensors(self) -> dict[str, "torch.Tensor"]:
        """Every published name (aliases included) -> zero-copy view; tied names share one view."""
        out: dict[str, Any] = {}
        for record in self.manifest.tensors:
            view = self.tensor(record)
            for name in record.all_names:
                out[name] = view
        return out

    def validate_against(self, model: Any, registrations: dict[str, _Registration] | None = None) -> None:
        """Check every record against ``model``'s registrations (``model_registrations(model)``, walked here
        unless given); raise ``ValueError`` naming the tensor."""
        if registrations is None:
            registrations = model_registrations(model)
        for record in self.manifest.tensors:
            for name in record.all_names:
                reg = registrations.get(name)
                where = f"published tensor {name!r}"
                if reg is None:
                    raise ValueError(f"{where} does not exist in this model: both factories must build the same topology")
                if reg.kind != record.kind:
                    raise ValueError(f"{where} is a {record.kind} in the store but a {reg.kind} in this model")
                if reg.kind == "buffer" and reg.persistent != record.persistent:
                    raise ValueError(
                        f"{where}: buffer persistence differs (store {record.persistent}, model {reg.persistent})"
                    )
                model_dtype = str(reg.tensor.dtype).removeprefix("torch.")
                if model_dtype != record.dtype:
                    raise ValueError(f"{where} has dtype {record.dtype} in the store but {model_dtype} in this model")
                if list(reg.tensor.shape) != record.shape:
                    raise ValueError(
                        f"{where} has shape {tuple(record.shape)} in the store but {tuple(reg.tensor.shape)} in this model"
                    )

    def _part_ranges(self) -> list[_PartRange]:
        """One :class:`_PartRange` per part holding records, in part order."""
        by_part: dict[int, list[tuple[TensorRecord, int, int]]] = {}
        for record in self.manifest.tensors:
            itemsize = DTYPE_SIZES[record.dtype]
            start = record.byte_offset + record.storage_offset * itemsize
            by_part.setdefault(record.part, []).append(
                (record, start, span_bytes(record.shape, record.stride, 0, itemsize)))
        ranges = []
        at = 0
        for part in sorted(by_part):
            spans = by_part[part]
            low = min(start for _, start, _ in spans)
            low -= low % 256
            high = max(start + nbytes for _, start, nbytes in spans)
            ranges.append(_PartRange(part, low, high, at, spans))
            at = align_up(ranges[-1].end, 256)
        return ranges

    def device_buffer(self, device: Any) -> "torch.Tensor":
        """Uninitialised device memory for :meth:`copies_on` (allocate it early, fill it later: see there)."""
        import torch

        self._check_open()
        ranges = self._part_ranges()
        return torch.empty(ranges[-1].end if ranges else 0, dtype=torch.uint8, device=torch.device(device))

    def copies_on(self, device: Any, *, buffer: "torch.Tensor | None" = None,
                  fill: "Callable[[list[Any]], None] | None" = None) -> dict[str, "torch.Tensor"]:
        """Every published record copied to ``device``, by record name: made ahead (e.g. on a thread while the
        model is built) and handed to :meth:`materialize`.

        One copy per part of the bytes its records span, into one device buffer, then one view per record (same
        dtype, shape, strides and relative placement as in its part), rather than one copy per record: each copy
        from unregistered memory makes the calling thread wait, and each call between them needs the GIL, which
        the model factory running beside the attach thread holds most of the time. The records share that one
        device allocation, so it is freed only when none of them is referenced any more. ``buffer`` (from
        :meth:`device_buffer`) is filled instead of allocating: the attach thread allocates it before it warms
        PyTorch's cache with the loader's device blocks, so that this allocation cannot be carved out of one of
        them. ``fill(pieces)`` makes the copies instead of ``dst.copy_(src)`` per part (a follower's staged copy
        through pinned memory, ``flextensor.runtime.pinned.bounce_copy``); it returns once every ``dst`` holds its bytes
        on the caller's stream. Each piece is ``(dst, src, file)``, ``file`` being ``(fd, offset)``: the part's
        segment opened again, ``src``'s bytes from ``offset``, to be read with ``pread`` so that no page of the
        mapping is faulted into this process (closed after the fill); None when the segment's name is gone (read
        ``src`` then).
        """
        import torch

        self._check_open()
        device = torch.device(device)
        ranges = self._part_ranges()
        if not ranges:
            return {}
        if buffer is None:
            buffer = self.device_buffer(device)
        size = ranges[-1].end
        if buffer.dtype != torch.uint8 or tuple(buffer.shape) != (size,) or buffer.device.type != device.type:
            raise ValueError(f"copies_on: the buffer must be device_buffer({device}) of this store "
                             f"({size} bytes), got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")
        copies_from = [(buffer.narrow(0, at, high - low), self._segments[part].tensor(torch.uint8, (high - low,),
                                                                                       offset=low), part, low)
                       for part, low, high, at, _spans in ranges]
        if fill is None:
            for dst, src, _part, low in copies_from:  # no copy spans two registrations
                for start, end in _cut_at(low, low + src.numel(), REGISTER_RANGE_BYTES):
                    dst[start - low:end - low].copy_(src[start - low:end - low])
        else:
            fds: list[int | None] = []
            try:
                for _dst, _src, part, _low in copies_from:
                    fds.append(self._open_data_file(part))
                fill([(dst, src, None if fd is None else (fd, low))
                      for (dst, src, _part, low), fd in zip(copies_from, fds)])
            finally:
                for fd in fds:
                    if fd is not None:
                        os.close(fd)
        copies = {}
        for _part, low, _high, at, spans in ranges:
            for record, start, nbytes in spans:
                itemsize = DTYPE_SIZES[record.dtype]
                if (start - low) % itemsize:
                    raise ShmProtocolError(f"published tensor {record.name!r} starts at byte {start}, not aligned "
                                           f"for {record.dtype}: the store's manifest is corrupt; restart the workers")
                copies[record.name] = (buffer.narrow(0, at + start - low, nbytes).view(_torch_dtype(record.dtype))
                                       .as_strided(record.shape, record.stride))
        return copies

    def _open_data_file(self, part: int) -> int | None:
        """Part ``part``'s segment file, opened again (``SharedSegment.open_file``); None when its name is gone."""
        try:
            return self._segments[part].open_file()
        except FileNotFoundError as exc:
            logger.debug("reading part %d of the store of %s through its mapping: %s", part, self._owner.namespace,
                         exc)
            return None

    def materialize(self, model: Any, device: Any = "cpu", *, copies: dict[str, "torch.Tensor"] | None = None) -> None:
        """Install every published tensor into ``model`` on ``device`` (all checks happen before any change).

        ``copies`` (from :meth:`copies_on` for the same device) are installed instead of copying again."""
        import torch

        registrations = model_registrations(model)  # one walk of the model for the checks and the installs
        self.validate_against(model, registrations)
        device = torch.device(device)
        copies = copies or {}
        for name, value in copies.items():
            if value.device != device and not (device.index is None and value.device.type == device.type):
                raise ValueError(f"the copy of {name!r} is on {value.device}, not on {device}")
        for record in self.manifest.tensors:
            if record.name in copies:
                value = copies[record.name]
            else:
                view = self.tensor(record)
                value = view if device.type == "cpu" else view.to(device, copy=True)
            if record.kind == "parameter":
                value = torch.nn.Parameter(value, requires_grad=record.requires_grad)
            for name in record.all_names:
                reg = registrations[name]
                table = reg.module._parameters if record.kind == "parameter" else reg.module._buffers
                table[reg.attr] = value

    def rebind(self, model: Any) -> None:
        """Point ``model``'s existing CPU tensors at their shared copies, keeping every object's identity.

        Used by a creator on a CPU host after publishing: its private resident copies are dropped and it reads
        the same pages as the followers. Tensors on other devices are left alone.
        """
        import torch

        registrations = model_registrations(model)
        with torch.no_grad():
            for record in self.manifest.tensors:
                view = self.tensor(record)
                for name in record.all_names:
                    reg = registrations.get(name)
                    if reg is not None and reg.tensor.device.type == "cpu" and reg.tensor.dtype == view.dtype \
                            and list(reg.tensor.shape) == record.shape:
                        reg.tensor.data = view

    # ------------------------------------------------------------------------------------------- pinning
    def pin(self) -> None:
        """Register this handle's mappings of the data segments with CUDA (read-only: the device only reads
        them), so copies of the records to a device run at full speed (``SharedSegment.pin``; ``RuntimeError``
        when the driver refuses). Undone by :meth:`close`."""
        self._check_open()
        for segment in self._segments:
            segment.pin(read_only=True)

    @property
    def pinned(self) -> bool:
        """Every byte of every data segment registered in this process (by :meth:`pin`, or range by range)."""
        return not self._closed and all(sum(segment.pinned_ranges.values()) >= segment.size
                                        for segment in self._segments)

    def unpinned_ranges(self) -> list[tuple[Any, int, int]]:
        """``(segment, offset, nbytes)`` of the data segments' :data:`REGISTER_RANGE_BYTES` ranges this handle has
        not registered yet (none overlapping a registered range), for a registration on a thread of the caller's
        (``flextensor.shm.background_pin``); the caller joins that thread before it closes this store."""
        self._check_open()
        ranges = []
        for segment in self._segments:
            registered = segment.pinned_ranges.items()
            for offset in range(0, segment.size, REGISTER_RANGE_BYTES):
                end = min(segment.size, offset + REGISTER_RANGE_BYTES)
                if not any(offset < start + length and start < end for start, length in registered):
                    ranges.append((segment, offset, end - offset))
        return ranges

    @property
    def parts(self) -> int:
        """How many data segments hold the records."""
        return len(self._segments)

    # ------------------------------------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SharedTensorStore is closed")

    def close(self, *, background: bool = False) -> None:
        """Drop this handle's mappings (views handed out stay valid until they die) and its own coordinator.
        ``background=True``: a pinned mapping is unregistered and unmapped on the release thread
        (``SharedSegment.close``)."""
        if self._closed:
            return
        self._closed = True
        for segment in self._segments:
            segment.close(background=background)
        if self._own_coordinator is not None:
            self._own_coordinator.close()

    def __enter__(self) -> "SharedTensorStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cut_at(low: int, high: int, step: int) -> list[tuple[int, int]]:
    """``[low, high)`` cut at the multiples of ``step``, as ``(start, end)`` pairs."""
    cuts = []
    while low < high:
        end = min(high, (low // step + 1) * step)
        cuts.append((low, end))
        low = end
    return cuts


def _library_version() -> str:
    from flextensor.shm.header import LIBRARY_VERSION

    return LIBRARY_VERSION


def _resolve_owner(
    namespace: str, shm_owner: "ShmOwner | None", lease_seconds: float, *, creating: bool
) -> tuple["ShmOwner", "ShmCoordinator | None"]:
    """Use the caller's owner (checking it serves ``namespace``) or open a coordinator of our own."""
    if shm_owner is not None:
        if shm_owner.namespace != namespace:
            raise ValueError(
                f"shm_owner serves namespace {shm_owner.namespace!r}, not {namespace!r}: pass the memory_owner of "
                "the coordinator for this namespace"
            )
        if creating and not shm_owner.is_creator:
            raise RuntimeError(
                f"only the creator of {namespace!r} may publish a tensor store; followers use SharedTensorStore.attach"
            )
        return shm_owner, None
    from flextensor.shm.coordinator import ShmCoordinator

    coordinator = ShmCoordinator(namespace, lease_seconds=lease_seconds)
    if not creating and coordinator.is_creator:
        coordinator.mark_failed("nothing was published")
        coordinator.close()
        raise FileNotFoundError(
            f"no tensor store is published in namespace {namespace!r}: start the creator first"
        )
    if creating and not coordinator.is_creator:
        coordinator.close()
        raise RuntimeError(
            f"namespace {namespace!r} already has a creator: use SharedTensorStore.attach to read its store"
        )
    return coordinator.memory_owner, coordinator
