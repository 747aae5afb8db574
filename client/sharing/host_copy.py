"""A session worker's ``HostCopy``: where its sleeping model wakes from, and its lease's record of the sleep.

Every resident tensor of a session's model is in the generation's tensor store already (the creator published
it there), so a worker that sleeps keeps no private copy: it drops its device copies, its lease slot says
SLEEPING, and at the wake it copies the records back to its device from the store, which may hold new weights
by then (``SharedOffloadSession.update_weights``). Note [sleep and wake] in ``flextensor.engine.sleep`` and
Note [sleeping participants and weight updates] in ``flextensor.shm.activity`` say the rest.
"""

from __future__ import annotations

from typing import Mapping

import torch

from flextensor.runtime.pinned.bounce_copy import StagedCopy
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.tensor_store import SharedTensorStore

__all__ = ["SharedHostCopy"]


class SharedHostCopy:
    """The engine's ``HostCopy`` over a session share's tensor store and coordinator, for a model on ``device``.

    On a CUDA device the copy's pinned ring is registered on a thread while the model sleeps, so the wake finds
    it ready; :meth:`close` releases a ring no wake used (the session closes it with the share)."""

    def __init__(self, store: SharedTensorStore, coordinator: ShmCoordinator, device: torch.device) -> None:
        self._store = store
        self._coordinator = coordinator
        self._device = device
        self._copier: StagedCopy | None = None

    def names(self) -> set[str]:
        return {name for record in self._store.records for name in record.all_names}

    def values_on(self, device: torch.device) -> Mapping[str, torch.Tensor]:
        """Zero-copy views on a CPU; on a device, one copy per store part through a pinned ring read with
        ``pread`` (this process need not have registered the store: a follower does not), as a follower's
        attach copies them (``flextensor.sharing.attach_prefetch``)."""
        store = self._store
        if device.type == "cpu":
            views = {record.name: store.tensor(record) for record in store.records}
        else:
            copier, self._copier = self._copier or StagedCopy(), None
            try:
                views = store.copies_on(device, fill=copier.copy_pieces)
                torch.cuda.current_stream(device).synchronize()
            finally:
                copier.close()
        return {name: views[record.name] for record in store.records for name in record.all_names}

    def fell_asleep(self) -> None:
        self._coordinator.participation.sleep()
        if self._device.type == "cuda" and self._copier is None:
            self._copier = StagedCopy()
            if self._store.nbytes >= self._copier.min_bytes:
                self._copier.prepare_in_background(self._device)

    def waking(self) -> None:
        self._coordinator.participation.wake()

    def close(self) -> None:
        """Release a ring prepared for a wake that never came."""
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.close()
