"""New weights written into a generation's host copy, in place: ``SharedOffloadSession.update_weights``.

Why in place
------------
Colocated training and serving publishes new weights after every training step. Every worker of a host serves
from the one host copy (the tensor store and the arena), so writing the new weights there once reaches them
all: a worker that wakes afterwards copies its resident tensors from the store and streams its blocks from the
arena, both new (Note [sleep and wake] in ``flextensor.engine.sleep``). Nothing is allocated, nothing is
published again, and the plan, the arena's layout and every worker's mappings stay.

Order
-----
1. The source becomes a list of ``(name, tensor)`` (a mapping's items; an iterator is consumed, because every
   name is checked before anything is written; a safetensors file or directory is opened for its headers only,
   ``flextensor.loading.checkpoint``).
2. Each name is found among the published tensors, aliases included (a tied pair is written once): a streamed
   tensor's place in its host block (the engine's placements, which the published plan gave it) or a resident
   tensor's record in the store's manifest (``flextensor.shm.manifest``). An unknown name is a ``KeyError``, a
   dtype or shape that differs a ``ValueError``, each naming the tensor; nothing has been written then.
3. The coordinator marks the copy WRITING (``WorkersAwakeError`` while any participant of the namespace is
   awake: Note [sleeping participants and weight updates] in ``flextensor.shm.activity``).
4. Block by block in arena order, then the store's records in their order, each tensor is copied to its place:
   from host memory with PyTorch's CPU copy, from a checkpoint with ``preadv`` straight into its place, from a
   device through a pinned staging pair (:class:`DeviceStaging`), because this process's mapping of the
   shared copy is registered with CUDA read-only and a device may not write into it.
5. The version is published and the writer sleeps again; a failure on the way marks the copy TORN (raised).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Union

import torch

from flextensor.loading.checkpoint import ReadPlan, SafetensorsCheckpoint, TensorEntry
from flextensor.runtime.host_memory import block_views
from flextensor.shm.tensor_store import SharedTensorStore
from flextensor.state import dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.shm.activity import Participation

__all__ = ["WeightsSource", "UpdateReport", "DeviceStaging", "prepare", "write_update", "update_host_copy"]

logger = logging.getLogger(__name__)

#: What ``update_weights`` takes: a state dict, ``(name, tensor)`` pairs, or a safetensors file or directory.
WeightsSource = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]], str, os.PathLike]

#: Bytes per staged chunk of a copy from a device (two of them, pinned, alternate).
STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class Target:
    """Where one published tensor's bytes are in the host copy: a streamed block's view or a store record's."""

    name: str
    view: torch.Tensor
    order: tuple[int, int]  # (block index, or one past the last for the store; position within)
    persistent: bool  # a parameter or persistent buffer (what a state_dict holds)


@dataclass
class UpdateReport:
    """What one update wrote: tensors, bytes, seconds, and the version it published."""

    version: int
    tensors: int
    nbytes: int
    seconds: float
    complete: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


def resolve_targets(ctx: EngineContext, store: SharedTensorStore) -> tuple[dict[str, Target], int]:
    """Every published name (aliases included) -> its :class:`Target`; and how many distinct persistent tensors
    (parameters and persistent buffers) there are: an update that writes them all is complete."""
    targets: dict[str, Target] = {}
    inference = ctx.inference
    count = 0
    for layout in inference.layouts:
        views = block_views(inference.host_blocks[layout.index].tensor, layout.tensors)
        for position, (placement, view) in enumerate(zip(layout.tensors, views)):
            entry = ctx.tensors[placement.name]
            target = Target(placement.name, view, (layout.index, position), entry.persistent)
            count += target.persistent
            for alias in (placement.name, *ctx.tensors[placement.name].aliases):
                targets[alias] = target
    last = len(inference.layouts)
    for position, record in enumerate(store.records):
        target = Target(record.name, store.tensor(record), (last, position), record.persistent)
        count += target.persistent
        for alias in record.all_names:
            targets[alias] = target
    return targets, count


def _source_items(source: WeightsSource) -> tuple[list[tuple[str, Any]], SafetensorsCheckpoint | None]:
    """Step 1 of the module docstring."""
    if isinstance(source, (str, os.PathLike)):
        checkpoint = SafetensorsCheckpoint(source)
        return list(checkpoint.entries.items()), checkpoint
    if isinstance(source, Mapping):
        return list(source.items()), None
    try:
        items = list(source)
    except TypeError:
        raise TypeError(f"update_weights takes a state dict, an iterable of (name, tensor) pairs, or the path of a "
                        f"safetensors file or directory, not {type(source).__name__}") from None
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"update_weights: every item of an iterable source must be a (name, tensor) pair, got "
                            f"{item!r:.80}")
    return items, None


def _meta_of(value: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(value, TensorEntry):
        return value.dtype, tuple(value.shape)
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    raise TypeError(f"update_weights: a weight must be a torch.Tensor, got {type(value).__name__}")


def plan_update(targets: dict[str, Target], items: list[tuple[str, Any]], namespace: str
                ) -> list[tuple[Target, Any]]:
    """Step 2 of the module docstring: the writes, in arena order then store order; a tensor given under two
    of its names is written once."""
    writes: dict[str, tuple[Target, Any]] = {}
    for name, value in items:
        target = targets.get(name)
        if target is None:
            raise KeyError(f"update_weights: {name!r} is not a tensor published in namespace {namespace!r} (the "
                           "new weights must have the names of the model's parameters and buffers, as in its "
                           "state_dict())")
        dtype, shape = _meta_of(value)
        view = target.view
        if dtype != view.dtype:
            raise ValueError(f"update_weights: {name!r} is {dtype_name(dtype)} in the new weights but "
                             f"{dtype_name(view.dtype)} in the published model; convert it (tensor.to(dtype)) first")
        if shape != tuple(view.shape):
            raise ValueError(f"update_weights: {name!r} has shape {list(shape)} in the new weights but "
                             f"{list(view.shape)} in the published model")
        writes.setdefault(target.name, (target, value))
    return sorted(writes.values(), key=lambda write: write[0].order)


def _dense(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s elements fill the span from its first byte without gaps or overlaps (any order of
    its dimensions, so a transposed or channels-last layout counts), which is what :func:`_byte_view` needs."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda dim: dim[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a dense tensor's bytes (the span its elements cover)."""
    nbytes = tensor.numel() * tensor.element_size()
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return out.set_(tensor.untyped_storage(), tensor.storage_offset() * tensor.element_size(), (nbytes,), (1,))


class DeviceStaging:
    """Copies from a CUDA device into host memory the device may not write (this process registered the shared
    copy read-only) through two pinned chunks: the device copies chunk k+1 into one while the CPU copies chunk k
    out of the other."""

    def __init__(self, device: torch.device, chunk_bytes: int = STAGING_BYTES) -> None:
        self.device = device
        self.chunk = chunk_bytes
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.stream = torch.cuda.Stream(device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst`` (host, dense) := ``src`` (device), same dtype and shape."""
        if src.stride() != dst.stride() or not _dense(src):
            laid = torch.empty_strided(dst.shape, dst.stride(), dtype=dst.dtype, device=src.device)
            laid.copy_(src)
            src = laid
        src_bytes, dst_bytes = _byte_view(src), _byte_view(dst)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # src's last writer
        pending: tuple[int, int, int] | None = None  # (buffer, offset, bytes) copied to the host, not yet out
        for k, offset in enumerate(range(0, src_bytes.numel(), self.chunk)):
            n = min(self.chunk, src_bytes.numel() - offset)
            slot = k % 2
            with torch.cuda.stream(self.stream):
                self.buffers[slot][:n].copy_(src_bytes[offset:offset + n], non_blocking=True)
                self.events[slot].record(self.stream)
            if pending is not None:
                self._drain(dst_bytes, *pending)
            pending = (slot, offset, n)
        if pending is not None:
            self._drain(dst_bytes, *pending)
        src.record_stream(self.stream)

    def _drain(self, dst_bytes: torch.Tensor, slot: int, offset: int, n: int) -> None:
        self.events[slot].synchronize()
        dst_bytes[offset:offset + n].copy_(self.buffers[slot][:n])


def write_update(writes: list[tuple[Target, Any]], checkpoint: SafetensorsCheckpoint | None) -> int:
    """Step 4 of the module docstring; returns the bytes written."""
    staging: dict[torch.device, DeviceStaging] = {}  # one per source device: its copies run on that device's stream
    reads = ReadPlan(label="update_weights", populate=None) if checkpoint is not None else None
    nbytes = 0
    with torch.no_grad():
        for target, value in writes:
            view = target.view
            nbytes += view.numel() * view.element_size()
            if isinstance(value, TensorEntry):
                assert reads is not None
                reads.add(value, view)
            elif value.device.type == "cuda":
                if value.device not in staging:
                    staging[value.device] = DeviceStaging(value.device)
                staging[value.device].copy(view, value.detach())
            else:
                view.copy_(value.detach())
        if reads is not None:
            reads.read(populate=None)  # the shared pages exist: read straight into them, in file order
    return nbytes


def prepare(ctx: EngineContext, store: SharedTensorStore, source: WeightsSource, namespace: str
            ) -> tuple[list[tuple[Target, Any]], SafetensorsCheckpoint | None, bool]:
    """Steps 1 and 2: the writes, the checkpoint they read from (if any), and whether they are complete: every
    parameter and persistent buffer (what ``state_dict()`` holds; buffers the model computes need no update)."""
    items, checkpoint = _source_items(source)
    targets, count = resolve_targets(ctx, store)
    writes = plan_update(targets, items, namespace)
    return writes, checkpoint, sum(target.persistent for target, _ in writes) == count


def update_host_copy(ctx: EngineContext, store: SharedTensorStore, participation: Participation,
                     source: WeightsSource, version: int | None) -> UpdateReport:
    """Steps 1-5 of the module docstring for one manager's share: ``ctx`` is its sleeping engine (the places of
    the streamed tensors), ``store`` its tensor store, ``participation`` its coordinator's."""
    writes, checkpoint, complete = prepare(ctx, store, source, participation.namespace)
    target = participation.begin_update(version, complete=complete)
    start = time.perf_counter()
    try:
        nbytes = write_update(writes, checkpoint)
    except BaseException:
        participation.abort_update()
        raise
    seconds = time.perf_counter() - start
    participation.end_update(target)
    report = UpdateReport(target, len(writes), nbytes, seconds, complete)
    logger.info("namespace %s: weights version %d written in place (%d tensors, %.1f MiB in %.3f s, %.2f GB/s%s)",
                participation.namespace, target, report.tensors, nbytes / 2**20, seconds, report.gbps,
                "" if complete else ", the other tensors unchanged")
    return report
