"""Host blocks: where offloaded weights live between their trips to the device, and how they are packed.

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

Providers
---------
:class:`HostBlockProvider` allocates the blocks:

- ``pageable``: ``torch.empty`` (no pinning; the CPU-only path, and ``pinned_memory=False``);
- ``torch``: ``torch.empty(..., pin_memory=True)`` from PyTorch's pinned allocator (rounds up to powers of two);
- ``host_register``: ``torch.empty`` then ``cudaHostRegister`` in place (exact size); falls back to ``torch``
  with a WARNING when the cudart binding is unusable;
- ``shm``: one POSIX shared-memory segment per block through ``flextensor.shm.blocks.SharedBlockAllocator``
  (creator allocates, followers attach), registered in place with ``segment.pin()`` when pinning is asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

__all__ = [
    "ALIGN",
    "TensorPlacement",
    "BlockLayout",
    "HostBlock",
    "HostBlockProvider",
    "PageableProvider",
    "TorchPinnedProvider",
    "HostRegisterProvider",
    "ShmProvider",
    "make_provider",
    "pack_block",
    "block_view",
    "packed_stride",
]

logger = logging.getLogger(__name__)

ALIGN = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def packed_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """The stride a tensor keeps in a packed block: its own when non-overlapping and dense, else contiguous."""
    shape, stride = tuple(tensor.shape), tuple(tensor.stride())
    if tensor.is_contiguous():
        return _contiguous_stride(shape)
    dims = sorted((s, n) for s, n in zip(stride, shape) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return _contiguous_stride(shape)
        expected *= n
    return stride


@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor lives inside a packed block (identical offsets in host and device blocks)."""

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
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        placements.append(TensorPlacement(name, dtype, tuple(int(s) for s in shape), tuple(int(s) for s in stride),
                                          offset, nbytes))
        offset = _align(offset + nbytes)
    return BlockLayout(index, label, max(_align(offset), ALIGN), tuple(placements))


def block_view(block: torch.Tensor, placement: TensorPlacement) -> torch.Tensor:
    """The tensor ``placement`` describes, as a zero-copy view into the uint8 ``block`` (host or device)."""
    raw = block.narrow(0, placement.byte_offset, placement.nbytes)
    return raw.view(placement.dtype).as_strided(placement.shape, placement.stride)


# ----------------------------------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class HostBlock:
    """An allocated host block. ``prefilled`` is True when it was attached with data already in it (an SHM
    follower): the engine must not copy weights into it. ``name`` is the SHM name, '' for private memory."""

    tensor: torch.Tensor
    name: str = ""
    prefilled: bool = False


class HostBlockProvider:
    """Allocates host blocks and frees/unpins them on :meth:`close`."""

    kind = "abstract"
    pinned = False

    def allocate(self, index: int, nbytes: int) -> HostBlock:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        """Release what the provider holds (unpin, unmap). Tensors still viewing a block keep its memory."""


class PageableProvider(HostBlockProvider):
    kind = "pageable"

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        return HostBlock(torch.empty(nbytes, dtype=torch.uint8))


class TorchPinnedProvider(HostBlockProvider):
    """PyTorch's caching pinned allocator (``pinned_memory_mode="torch"``)."""

    kind = "torch"
    pinned = True

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        return HostBlock(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))


class HostRegisterProvider(HostBlockProvider):
    """Plain host allocations registered in place with ``cudaHostRegister`` (exact size, no rounding)."""

    kind = "host_register"
    pinned = True

    def __init__(self) -> None:
        self._registered: list[tuple[int, torch.Tensor]] = []

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        from flextensor.shm.pinning import host_register

        tensor = torch.empty(nbytes, dtype=torch.uint8)
        host_register(tensor.data_ptr(), nbytes)
        self._registered.append((tensor.data_ptr(), tensor))
        return HostBlock(tensor)

    def close(self) -> None:
        from flextensor.shm.pinning import host_unregister

        # The provider keeps a reference to every registered tensor, so the memory cannot be freed (and reused
        # by another allocation) while it is still registered.
        while self._registered:
            ptr, _tensor = self._registered.pop()
            try:
                host_unregister(ptr)
            except RuntimeError as exc:  # teardown must go on; the process exit releases the pages anyway
                logger.warning("could not unregister host block at %#x: %s", ptr, exc)


class ShmProvider(HostBlockProvider):
    """Host blocks in POSIX shared memory, one segment per block, through ``SharedBlockAllocator``.

    The creator of the sharing generation allocates (fresh blocks, ``prefilled=False``); a follower attaches the
    creator's blocks (``prefilled=True``: the weights are already there). Pinned in place when ``pin``.
    """

    kind = "shm"

    def __init__(self, owner: Any, *, pin: bool) -> None:
        from flextensor.shm.blocks import SharedBlockAllocator

        self.owner = owner
        self.pinned = pin
        self._allocator = SharedBlockAllocator(owner)
        self._segments: list[Any] = []

    def allocate(self, index: int, nbytes: int) -> HostBlock:
        creator = bool(self.owner.is_creator)
        segment = self._allocator.allocate(index, nbytes) if creator else self._allocator.attach(index, nbytes)
        self._segments.append(segment)
        if self.pinned:
            segment.pin()
        return HostBlock(segment.tensor(torch.uint8, (nbytes,)), name=segment.name, prefilled=not creator)

    def close(self) -> None:
        while self._segments:
            segment = self._segments.pop()
            try:
                segment.close()
            except Exception as exc:  # noqa: BLE001 - keep closing the others
                logger.warning("could not close shared host block %s: %s", getattr(segment, "name", "?"), exc)


def make_provider(config: Any, device: torch.device, *, shm_owner: Any = None) -> HostBlockProvider:
    """The provider the config asks for. ``pinned_memory`` on a CPU compute device is refused earlier, at
    manager construction; here it can only mean CUDA."""
    pin = bool(config.pinned_memory) and device.type == "cuda"
    if config.shm_enabled:
        if shm_owner is None:
            raise RuntimeError(
                "shm_enabled=True needs a shared-memory owner for the host blocks; use SharedOffloadSession, or "
                "pass shm_owner (a ShmCoordinator's memory_owner) to OffloadManager.offload"
            )
        return ShmProvider(shm_owner, pin=pin)
    if not pin:
        return PageableProvider()
    if config.pinned_memory_mode == "host_register":
        from flextensor.shm.pinning import cudart_available

        if cudart_available():
            return HostRegisterProvider()
        logger.warning(
            "pinned_memory_mode='host_register' requested but the CUDA runtime binding (torch.cuda.cudart()) is "
            "unusable; falling back to pinned_memory_mode='torch' (tensor.pin_memory())"
        )
    return TorchPinnedProvider()
