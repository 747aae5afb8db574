"""The tensor-store manifest: what crosses from the creator to followers, and how a follower checks it.

A manifest is a msgspec Struct encoded as msgpack (never pickle: a follower must be able to reject a hostile
or corrupted manifest without executing anything). It describes where each published tensor lives inside the
store's data segments (the store's parts, see ``tensor_store.py``):

``TensorRecord``
    name            registered name in the model (``layers.0.attn.weight``)
    kind            ``"parameter"`` or ``"buffer"``
    persistent      buffers only: whether it is part of ``state_dict`` (parameters are always ``True``)
    requires_grad   parameters only, restored as published
    dtype           torch dtype name without the ``torch.`` prefix (``"bfloat16"``)
    shape, stride   in elements; ``len(shape) == len(stride)``
    storage_offset  in elements, counted from ``byte_offset``
    part            which data segment (part) holds it: ``0 <= part < len(part_sizes)``
    byte_offset     where this tensor's storage span begins in its part (aligned to the element size)
    nbytes          length of the span; it must cover the highest element the shape and stride address
    aliases         further registered names of the same tensor (tied weights), all of the same kind

``StoreManifest`` adds the protocol version, library version, generation, the bytes of every part
(``part_sizes``, in part order) and their sum (``data_size``).

Validation (``validate_manifest``) trusts nothing: unknown dtypes, negative or mismatched dims, misaligned or
out-of-range spans, parts that do not exist and duplicate names raise ``ShmProtocolError`` naming the tensor.
This module does not import torch.
"""

from __future__ import annotations

from typing import Literal, Sequence

import msgspec

from flextensor.shm.errors import ShmProtocolError

#: 2: the data in parts (``part``, ``part_sizes``).
MANIFEST_PROTOCOL = 2

#: Element size in bytes of every dtype a manifest may name. Kept here (not derived from torch) so that the
#: daemon and validation run without torch.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


class TensorRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One published tensor (see the module docstring for the fields)."""

    name: str
    kind: Literal["parameter", "buffer"]
    persistent: bool
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int
    byte_offset: int
    nbytes: int
    requires_grad: bool = False
    aliases: list[str] = []
    part: int = 0

    @property
    def all_names(self) -> list[str]:
        return [self.name, *self.aliases]


class StoreManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a follower needs to attach the store's data segments."""

    protocol: int
    library_version: str
    generation: int
    data_size: int
    part_sizes: list[int]
    tensors: list[TensorRecord]


def span_bytes(shape: list[int], stride: list[int], storage_offset: int, element_size: int) -> int:
    """Bytes from the span start to one past the highest addressed element (0 for an empty tensor)."""
    if any(dim == 0 for dim in shape):
        return 0
    last = storage_offset + sum((dim - 1) * step for dim, step in zip(shape, stride))
    return (last + 1) * element_size


def contiguous_stride(shape: Sequence[int]) -> list[int]:
    """Row-major strides (in elements) of ``shape``; size-0 and size-1 dims count as 1."""
    stride: list[int] = []
    running = 1
    for dim in reversed(shape):
        stride.append(running)
        running *= max(dim, 1)
    return list(reversed(stride))


def validate_record(record: TensorRecord, part_sizes: Sequence[int]) -> None:
    """Raise ``ShmProtocolError`` naming ``record.name`` when any field is impossible for parts of
    ``part_sizes`` bytes."""

    def bad(what: str) -> ShmProtocolError:
        return ShmProtocolError(
            f"tensor store manifest: tensor {record.name!r} {what}; the published store is corrupted or was "
            "written by another flextensor version: restart all workers with the same version"
        )

    element_size = DTYPE_SIZES.get(record.dtype)
    if element_size is None:
        raise bad(f"has unknown dtype {record.dtype!r} (known: {', '.join(sorted(DTYPE_SIZES))})")
    if len(record.shape) != len(record.stride):
        raise bad(f"has shape {record.shape} and stride {record.stride} of different ranks")
    if any(dim < 0 for dim in record.shape):
        raise bad(f"has a negative dimension in shape {record.shape}")
    if any(step < 0 for step in record.stride):
        raise bad(f"has a negative stride {record.stride}")
    if record.storage_offset < 0 or record.byte_offset < 0 or record.nbytes < 0:
        raise bad("has a negative offset or size")
    if record.byte_offset % element_size:
        raise bad(f"starts at byte {record.byte_offset}, not aligned to its {element_size}-byte elements")
    needed = span_bytes(record.shape, record.stride, record.storage_offset, element_size)
    if needed > record.nbytes:
        raise bad(f"addresses {needed} bytes but its span is only {record.nbytes} bytes (bad stride or offset)")
    if not 0 <= record.part < len(part_sizes):
        raise bad(f"lies in part {record.part}, but the store has {len(part_sizes)} part(s)")
    if record.byte_offset + record.nbytes > part_sizes[record.part]:
        raise bad(f"ends at byte {record.byte_offset + record.nbytes}, past the end of its part {record.part} "
                  f"({part_sizes[record.part]} bytes)")
    if record.kind == "parameter" and not record.persistent:
        raise bad("is a parameter marked non-persistent")


def validate_manifest(manifest: StoreManifest, segment_sizes: Sequence[int]) -> None:
    """Validate every record and the manifest's header fields against the real sizes of the data segments (one
    per part, in part order)."""
    if manifest.protocol != MANIFEST_PROTOCOL:
        raise ShmProtocolError(
            f"tensor store manifest has protocol {manifest.protocol}, this flextensor speaks {MANIFEST_PROTOCOL}: "
            "restart all workers with the same flextensor version"
        )
    if manifest.data_size != sum(manifest.part_sizes) or len(segment_sizes) != len(manifest.part_sizes):
        raise ShmProtocolError(
            f"tensor store manifest describes {len(manifest.part_sizes)} part(s) of {manifest.part_sizes} bytes "
            f"({manifest.data_size} in all) but {len(segment_sizes)} data segment(s) were opened: the store is "
            "corrupted; run cleanup for this namespace and restart the workers"
        )
    for part, (described, held) in enumerate(zip(manifest.part_sizes, segment_sizes)):
        if described > held:
            raise ShmProtocolError(
                f"tensor store manifest describes {described} bytes in part {part} but its data segment holds "
                f"{held}: the segment is truncated; run cleanup for this namespace and restart the workers"
            )
    seen: set[str] = set()
    for record in manifest.tensors:
        validate_record(record, manifest.part_sizes)
        for name in record.all_names:
            if name in seen:
                raise ShmProtocolError(f"tensor store manifest names tensor {name!r} twice")
            seen.add(name)


def encode_manifest(manifest: StoreManifest) -> bytes:
    return msgspec.msgpack.encode(manifest)


def decode_manifest(data: bytes) -> StoreManifest:
    """Decode without trusting the bytes: any type or structure error becomes ``ShmProtocolError``."""
    try:
        return msgspec.msgpack.decode(data, type=StoreManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ShmProtocolError(
            f"tensor store manifest is malformed ({exc}); run cleanup for this namespace and restart the workers"
        ) from exc
