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
    """The engine's ``HostCopy`` over a session share's tensor store and coordinator."""

    def __init__(self, store: SharedTensorStore, coordinator: ShmCoordinator) -> None:
        self._store = store
        self._coordinator = coordinator

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
            copier = StagedCopy()
            try:
                views = store.copies_on(device, fill=copier.copy_pieces)
                torch.cuda.current_stream(device).synchronize()
            finally:
                copier.close()
        return {name: views[record.name] for record in store.records for name in record.all_names}

    def fell_asleep(self) -> None:
        self._coordinator.participation.sleep()

    def waking(self) -> None:
        self._coordinator.participation.wake()
