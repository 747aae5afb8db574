"""Publish a model's resident parameters and buffers once per host; attach and install them anywhere.

The creator copies each selected tensor into one data segment (``/{ns}.g{gen}.sd``) and writes a msgpack
manifest (``.sm``, see ``manifest.py``) through its ``ShmOwner``, *before* the coordinator turns READY, so a
follower that sees READY finds complete bytes. Followers decode and validate the manifest against the real
segment size, then ``materialize`` checks every record against their own (usually ``meta``) model before
touching it: a mismatched name, kind, dtype, shape or buffer persistence is refused with the tensor's name and
the model is left unchanged.

Tied registrations (one tensor under several names) are stored once and restored as one object under every
name, so ``lm_head.weight is embed.weight`` holds again in the follower. On a CPU target device the installed
tensors are zero-copy views of the shared segment (read-only by convention: writing to them changes every
worker's copy); on a GPU target they are copied to the device.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.populate_ahead import PopulateAhead
from flextensor.shm.sizes import align_up
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

DATA_KIND = "sd"
MANIFEST_KIND = "sm"
#: Alignment of every tensor span in the data segment: generous enough for vectorised copies and DMA.
ALIGNMENT = 256


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


def _plan_records(model: Any, names: Iterable[str] | None, *, allow_meta: bool = False
                  ) -> tuple[list[TensorRecord], list[Any], int]:
    """Group tied names, lay tensors out contiguously (aligned) and return records, sources and total size.
    ``allow_meta``: a tensor on ``meta`` is laid out too (its bytes come from elsewhere)."""
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
    records: list[TensorRecord] = []
    sources: list[Any] = []
    offset = 0
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
            )
        )
        sources.append(tensor)
        offset = align_up(offset + nbytes, ALIGNMENT)
    return records, sources, max(offset, ALIGNMENT)


class SharedTensorStore:
    """A published set of tensors in one shared data segment plus its manifest.

    Construct with :meth:`create_from_model` (creator) or :meth:`attach` (followers). Pass the coordinator's
    ``memory_owner`` as ``shm_owner`` so the store lives exactly as long as the sharing group; without one,
    the store opens (and on :meth:`close` closes) a coordinator of its own for ``namespace``.
    """

    def __init__(
        self,
        manifest: StoreManifest,
        segment: "SharedSegment",
        owner: "ShmOwner",
        own_coordinator: "ShmCoordinator | None" = None,
    ) -> None:
        self.manifest = manifest
        self._segment = segment
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
        fill: "Callable[[TensorRecord, torch.Tensor, torch.Tensor], None] | None" = None,
        window: int = 0,
    ) -> "SharedTensorStore":
        """Copy ``model``'s selected parameters and buffers (all when ``names`` is None) into shared memory.

        ``fill(record, view, source)``, when given, writes each record's bytes into its ``view`` instead of
        ``view.copy_(source)`` (a source may then be on ``meta``: the fill supplies its bytes, e.g. from a
        checkpoint; the fill may also point the model at the view). A segment the owner prepared without its
        pages (``prepare_segments(..., reserve=False)``) gets them record by record, allocated on a thread up to
        ``window`` bytes ahead of the copy (``populate_ahead.py``; 0: each just before its copy)."""
        owner, coordinator = _resolve_owner(namespace, shm_owner, lease_seconds, creating=True)
        segment = None
        try:
            records, sources, total = _plan_records(model, names, allow_meta=fill is not None)
            segment = owner.create_segment(DATA_KIND, total)
            segment.check_intact()
            populate = None
            if not segment.reserved:
                populate = PopulateAhead([(segment, r.byte_offset, r.nbytes) for r in records],
                                         window=max(1, window)).start()
            try:
                for index, (record, source) in enumerate(zip(records, sources)):
                    if populate is not None:
                        populate.wait(index)
                    view = segment.tensor(_torch_dtype(record.dtype), record.shape, record.stride,
                                          record.byte_offset)
                    if fill is None:
                        view.copy_(source.detach())
                    else:
                        fill(record, view, source)
                    if populate is not None:
                        populate.done(index)
            finally:
                if populate is not None:
                    populate.close()
            manifest = StoreManifest(
                protocol=MANIFEST_PROTOCOL,
                library_version=_library_version(),
                generation=owner.generation,
                data_size=total,
                tensors=records,
            )
            segment.check_intact()
            owner.write_blob(MANIFEST_KIND, encode_manifest(manifest))
            logger.info(
                "published %d tensors (%.1f MiB) to %s generation %d",
                len(records), total / 2**20, owner.namespace, owner.generation,
            )
            if coordinator is not None:
                coordinator.notify_ready()
        except BaseException as exc:
            if segment is not None:
                segment.close()  # the owner unlinks the name with the generation; drop our mapping now
            if coordinator is not None:
                coordinator.mark_failed(exc)
                coordinator.close()
            raise
        return cls(manifest, segment, owner, coordinator)

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
            segment = owner.open_segment(DATA_KIND)
            validate_manifest(manifest, segment.size)
        except BaseException:
            if coordinator is not None:
                coordinator.close()
            raise
        return cls(manifest, segment, owner, coordinator)

    # ---------------------------------------------------------------------------------------------- reading
    @property
    def records(self) -> list[TensorRecord]:
        return list(self.manifest.tensors)

    @property
    def nbytes(self) -> int:
        return self.manifest.data_size

    def tensor(self, record: TensorRecord) -> "torch.Tensor":
        """Zero-copy view of one record in the shared segment."""
        self._check_open()
        return self._segment.tensor(
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

    def _record_spans(self) -> tuple[list[tuple[TensorRecord, int, int]], int, int]:
        """(record, first byte, bytes spanned) per record, and the byte range covering all of them; the range
        starts 256-aligned so each record keeps its alignment inside a copy of the range."""
        spans = []
        for record in self.manifest.tensors:
            itemsize = DTYPE_SIZES[record.dtype]
            start = record.byte_offset + record.storage_offset * itemsize
            spans.append((record, start, span_bytes(record.shape, record.stride, 0, itemsize)))
        if not spans:
            return spans, 0, 0
        low = min(start for _, start, _ in spans)
        low -= low % 256
        return spans, low, max(start + nbytes for _, start, nbytes in spans)

    def device_buffer(self, device: Any) -> "torch.Tensor":
        """Uninitialised device memory for :meth:`copies_on` (allocate it early, fill it later: see there)."""
        import torch

        self._check_open()
        _spans, low, high = self._record_spans()
        return torch.empty(high - low, dtype=torch.uint8, device=torch.device(device))

    def copies_on(self, device: Any, *, buffer: "torch.Tensor | None" = None,
                  fill: "Callable[[torch.Tensor, torch.Tensor, tuple[int, int] | None], None] | None" = None
                  ) -> dict[str, "torch.Tensor"]:
        """Every published record copied to ``device``, by record name: made ahead (e.g. on a thread while the
        model is built) and handed to :meth:`materialize`.

        One copy of the bytes every record spans, then one view per record (same dtype, shape, strides and
        relative placement as in the segment), rather than one copy per record: each copy from unregistered
        memory makes the calling thread wait, and each call between them needs the GIL, which the model factory
        running beside the attach thread holds most of the time. The records share that one device allocation,
        so it is freed only when none of them is referenced any more. ``buffer`` (from :meth:`device_buffer`)
        is filled instead of allocating: the attach thread allocates it before it warms PyTorch's cache with
        the loader's device blocks, so that this allocation cannot be carved out of one of them. ``fill(dst,
        src, file)`` makes the one copy instead of ``dst.copy_(src)`` (a follower's staged copy through pinned
        memory, ``flextensor.runtime.staged_copy``); it returns once ``dst`` holds the bytes on the caller's
        stream. ``file`` is ``(fd, offset)``: the data segment opened again, ``src``'s bytes from ``offset``, to
        be read with ``pread`` so that no page of the mapping is faulted into this process (closed after the
        fill); None when the segment's name is gone (read ``src`` then).
        """
        import torch

        self._check_open()
        device = torch.device(device)
        spans, low, high = self._record_spans()
        if not spans:
            return {}
        host = self._segment.tensor(torch.uint8, (high - low,), offset=low)
        if buffer is None and fill is None:
            whole = host.to(device, copy=True)
        else:
            if buffer is None:
                buffer = self.device_buffer(device)
            if buffer.dtype != torch.uint8 or tuple(buffer.shape) != (high - low,) or buffer.device.type != device.type:
                raise ValueError(f"copies_on: the buffer must be device_buffer({device}) of this store "
                                 f"({high - low} bytes), got {buffer.dtype} {tuple(buffer.shape)} on {buffer.device}")
            if fill is None:
                whole = buffer.copy_(host)
            else:
                fd = self._open_data_file()
                try:
                    fill(buffer, host, None if fd is None else (fd, low))
                finally:
                    if fd is not None:
                        os.close(fd)
                whole = buffer
        copies = {}
        for record, start, nbytes in spans:
            itemsize = DTYPE_SIZES[record.dtype]
            if (start - low) % itemsize:
                raise ShmProtocolError(f"published tensor {record.name!r} starts at byte {start}, not aligned for "
                                       f"{record.dtype}: the store's manifest is corrupt; restart the workers")
            copies[record.name] = (whole.narrow(0, start - low, nbytes).view(_torch_dtype(record.dtype))
                                   .as_strided(record.shape, record.stride))
        return copies

    def _open_data_file(self) -> int | None:
        """The data segment's file, opened again (``SharedSegment.open_file``); None when its name is gone."""
        try:
            return self._segment.open_file()
        except FileNotFoundError as exc:
            logger.debug("reading the store of %s through its mapping: %s", self._owner.namespace, exc)
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
        """Register this handle's mapping of the data segment with CUDA (read-only: the device only reads it),
        so copies of the records to a device run at full speed (``SharedSegment.pin``; ``RuntimeError`` when
        the driver refuses). Undone by :meth:`close`."""
        self._check_open()
        self._segment.pin(read_only=True)

    @property
    def pinned(self) -> bool:
        return not self._closed and self._segment.pinned

    # ------------------------------------------------------------------------------------------- lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SharedTensorStore is closed")

    def close(self, *, background: bool = False) -> None:
        """Drop this handle's mapping (views handed out stay valid until they die) and its own coordinator.
        ``background=True``: a pinned mapping is unregistered and unmapped on the release thread
        (``SharedSegment.close``)."""
        if self._closed:
            return
        self._closed = True
        self._segment.close(background=background)
        if self._own_coordinator is not None:
            self._own_coordinator.close()

    def __enter__(self) -> "SharedTensorStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
