"""The packed layout of a host block: where each offloaded tensor of a trap lies, and views into it.

Why a module of its own: the layout is a byte contract shared by the host blocks (``host_memory``), the
rotating device blocks (``loaders``), a published plan that followers adopt and the switch to INFERENCE that
packs it, while none of them needs to know how a block is allocated.

Packed layout (one host block per offloaded trap)
-------------------------------------------------
A host block is a 1-D ``torch.uint8`` tensor. The trap's offloaded tensors are laid out one after the other
in the trap's own order, each starting at a multiple of :data:`ALIGN` (256) bytes, so that every dtype view is
aligned and the device copy of the block can be one contiguous memcpy. The block size is the end of the last
tensor rounded up to 256. Each tensor is stored densely: with its own strides when it is non-overlapping and
dense (a transposed weight keeps its strides), else with contiguous strides; its extent is
``numel * itemsize`` bytes and its view is ``block[off:off+nbytes].view(dtype).as_strided(shape, stride)``.
The same layout, at the same offsets, is used for the rotating device blocks, so a device view of tensor ``t``
in slot ``s`` is built exactly like its host view.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch

from flextensor.shm.manifest import contiguous_stride
from flextensor.shm.sizes import align_up

__all__ = ["ALIGN", "TensorPlacement", "BlockLayout", "pack_block", "block_view", "block_views", "packed_stride"]

ALIGN = 256


@functools.lru_cache(maxsize=1024)
def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``contiguous_stride`` as a tuple, cached: a model's layers repeat the same few shapes, and every streamed
    tensor asks at the switch to INFERENCE."""
    return tuple(contiguous_stride(shape))


def packed_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """The stride a tensor keeps in a packed block: its own when non-overlapping and dense, else contiguous."""
    shape = tensor.shape
    if tensor.is_contiguous():
        return _contiguous_stride(shape)
    stride = tuple(tensor.stride())
    dims = sorted((s, n) for s, n in zip(stride, shape) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return _contiguous_stride(shape)
        expected *= n
    return stride


class TensorPlacement(NamedTuple):
    """Where one tensor lives inside a packed block (identical offsets in host and device blocks).

    A named tuple rather than a frozen dataclass: one is made per streamed tensor inside the last PROFILING pass
    (``pack_block``) and per record when a follower adopts a plan, and a frozen dataclass's ``__init__`` costs
    three times as much.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """One trap's packed block: ``index`` (host block number), trap ``label``, size, tensor placements."""

    index: int
    label: str
    nbytes: int
    tensors: tuple[TensorPlacement, ...]


def pack_block(index: int, label: str, tensors: Iterable[tuple[str, torch.dtype, Sequence[int], Sequence[int]]]) -> BlockLayout:
    """Lay ``(name, dtype, shape, stride)`` entries out in order, each 256-byte aligned."""
    offset = 0
    placements: list[TensorPlacement] = []
    for name, dtype, shape, stride in tensors:
        shape = tuple(map(int, shape))
        nbytes = math.prod(shape) * dtype.itemsize
        placements.append(TensorPlacement(name, dtype, shape, tuple(map(int, stride)), offset, nbytes))
        offset = align_up(offset + nbytes, ALIGN)
    return BlockLayout(index, label, max(align_up(offset, ALIGN), ALIGN), tuple(placements))


def block_view(block: torch.Tensor, placement: TensorPlacement) -> torch.Tensor:
    """The tensor ``placement`` describes, as a zero-copy view into the uint8 ``block`` (host or device)."""
    raw = block.narrow(0, placement.byte_offset, placement.nbytes)
    return raw.view(placement.dtype).as_strided(placement.shape, placement.stride)


def block_views(block: torch.Tensor, placements: Sequence[TensorPlacement]) -> list[torch.Tensor]:
    """``[block_view(block, p) for p in placements]`` in a third of the torch calls.

    One typed view of the block per dtype, then one ``as_strided`` per tensor at its element offset, instead of
    ``narrow`` + ``view`` + ``as_strided`` each: adopting a plan makes a host and a device view of every streamed
    tensor (hundreds), and each torch call costs microseconds of dispatch. ``as_strided`` checks only the
    storage's bounds, so each placement is checked against the block here (``ValueError``).
    """
    typed: dict[torch.dtype, torch.Tensor] = {}
    size = block.numel()
    out = []
    for p in placements:
        itemsize = p.dtype.itemsize
        if p.byte_offset < 0 or p.byte_offset + p.nbytes > size or p.byte_offset % itemsize:
            raise ValueError(f"tensor {p.name!r} at bytes [{p.byte_offset}, {p.byte_offset + p.nbytes}) does not fit "
                             f"(aligned for {p.dtype}) in a block of {size} bytes")
        base = typed.get(p.dtype)
        if base is None:
            base = typed[p.dtype] = block.narrow(0, 0, size - size % itemsize).view(p.dtype)
        out.append(base.as_strided(p.shape, p.stride, base.storage_offset() + p.byte_offset // itemsize))
    return out
