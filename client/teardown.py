"""Undoing an offload: :meth:`OffloadManager.release` and the teardown shared with failed setups.

Order matters, and is the same whether the manager reached INFERENCE or failed half-way through ``offload()``
or an adoption:

0. a host-block build still running behind resident inference (``flextensor.deferred_build``) is cancelled and
   joined; the weights it would have streamed still hold their device copies;
1. the block loader stops (in-flight side-stream copies finish) and any warm-up device copies are dropped: a
   streamed trap's and the kept ones of a resident warm-up (``flextensor.warmup``) get their original host data
   back, exactly as it was, with no device-to-host copy;
2. every tensor gets real data again: an offloaded tensor is copied out of its host block back to its original
   device (``preserve_model=True``) or becomes a ``meta`` tensor of the same shape (``preserve_model=False``);
   any other tensor returns to the device it came from;
3. the trap and root forwards are unpatched (the class was never touched);
4. the pinned warm-up staging is unregistered (after a device synchronize inside ``PinnedStaging``: a queued
   warm-up copy may still read it), then host blocks (unpinned/unmapped by their provider) and the SHM
   coordinator are released;
5. the manager's state is reset, so the same manager can offload again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flextensor.host_memory import block_view
from flextensor.traps import assign_data

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.host_memory import HostBlock, HostBlockProvider, TensorPlacement
    from flextensor.loader import BlockLoader
    from flextensor.staging import PinnedStaging
    from flextensor.state import ModelTensor, TensorManagerState
    from flextensor.traps import Trap, WarmLoader

__all__ = ["ReleaseMixin"]


class ReleaseMixin:
    """``release`` / ``_teardown`` / ``_close_resources`` of ``OffloadManager`` (see the module docstring)."""

    # State owned by OffloadManager._reset (declared for readers and type checkers).
    model: nn.Module | None
    _pending_state: "TensorManagerState | None"
    _tensors: dict[str, "ModelTensor"]
    _orig_device: dict[str, torch.device]
    _placement: dict[str, "tuple[int, TensorPlacement]"]
    _host_blocks: "list[HostBlock]"
    _provider: "HostBlockProvider | None"
    _loader: "BlockLoader | None"
    _deferred: Any
    _deferred_plan: Any
    _traps: dict[str, "Trap"]
    _warm: "WarmLoader"
    _staging: "PinnedStaging"
    _shm_coordinator: Any

    if TYPE_CHECKING:  # pragma: no cover - provided by OffloadManager / PhaseMixin
        def _check_thread(self) -> None: ...
        def _reset(self) -> None: ...
        def _uninstall_root(self) -> None: ...

    def release(self, preserve_model: bool = True) -> None:
        """Undo everything: weights back into the model (unless ``preserve_model=False``), forwards unpatched,
        device and host blocks freed. The manager can offload again afterwards."""
        self._check_thread()
        self._pending_state = None
        if self.model is None:
            self._close_resources()
            return
        self._teardown(preserve_model)

    def _teardown(self, preserve_model: bool) -> None:
        build, self._deferred = self._deferred, None
        if build is not None:  # host blocks still being built: stop it; the tensors still hold device copies
            build.cancel()
            self._provider = build.provider
        plan, self._deferred_plan = self._deferred_plan, None  # also left by a failed build
        streamed = [t for tensors in plan[3] for t in tensors] if plan is not None else []
        if not preserve_model:  # what INFERENCE would stream is dropped like streamed weights: onto meta
            for t in streamed:
                assign_data(t, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
        if self._loader is not None:
            self._loader.close()
        self._warm.unload()
        self._warm.restore()
        for name, entry in self._tensors.items():
            t = entry.tensor
            orig = self._orig_device.get(name, torch.device("cpu"))
            target = torch.device("cpu") if orig.type == "meta" else orig
            placed = self._placement.get(name)
            if placed is not None:
                index, p = placed
                if preserve_model:
                    host_view = block_view(self._host_blocks[index].tensor, p)
                    t.data = host_view.clone() if target.type == "cpu" else host_view.to(target)
                else:
                    assign_data(t, torch.empty_strided(p.shape, p.stride, dtype=p.dtype, device="meta"))
            elif preserve_model and not t.is_meta and t.device != target:
                t.data = t.data.to(target)
        for trap in self._traps.values():
            trap.uninstall()
        self._uninstall_root()
        self._close_resources()
        self._reset()

    def _close_resources(self) -> None:
        self._staging.release_all()
        self._loader = None
        self._host_blocks = []
        if self._provider is not None:
            self._provider.close()
            self._provider = None
        if self._shm_coordinator is not None:
            try:
                self._shm_coordinator.close()
            finally:
                self._shm_coordinator = None
