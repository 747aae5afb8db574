"""A session worker's ``HostCopy``: where its sleeping model wakes from, and its lease's record of the sleep.

Every resident tensor of a session's model is in the generation's tensor store already (the creator published
it there), so a worker that sleeps keeps no private copy: it drops its device copies, its lease slot says
SLEEPING, and at the wake it copies the records back to its device from the store, which may hold new weights
by then (``SharedOffloadSession.update_weights``). Note [sleep and wake] in ``flextensor.engine.sleep`` and
Note [sleeping participants and weight updates] in ``flextensor.shm.activity`` say the rest.

Note [a wake at link rate]
--------------------------
A worker does not register the store with CUDA when it attaches (its host blocks are what it streams from;
the store's records are copied once, through a staged copy: ``flextensor.sharing.attach_prefetch``). A copy
from unregistered memory goes through a pinned ring (``pread`` into it, then DMA), about two thirds of the link
rate. So while the model sleeps (seconds to minutes of training in colocated RL), a thread registers this
process's mappings of the store's segments, in ranges of ``REGISTER_RANGE_BYTES`` (``flextensor.shm.background_pin``;
a training step in this process waits for one range's driver call at most):

- ``fell_asleep`` starts it on the ranges not registered yet (with pinning on and a CUDA device);
- ``values_on`` at the wake: every range registered -> direct copies, at link rate; otherwise the registration
  is told to stop after the range in flight (it ends on its own thread; the next sleep or
  :meth:`SharedHostCopy.close` joins it, and the next sleep goes on where it stopped), and the wake copies
  through the staged ring meanwhile (correct, slower);
- the registration stays until the session closes (the store is then released on the release thread), so every
  later wake is at link rate and costs no registration;
- a registration the driver refuses (``ulimit -l``) is logged once by its pinner, and pinning stops for this
  copy: later sleeps prepare the staged copy's ring in the background instead (as with ``pinned_memory=False``),
  so their wakes do not pay for it.

Nothing of host RAM is added: registering maps the store's shared pages into this process, where they count
once on the host (the sum of the workers' PSS), where the ring it replaces was 256 MiB of private pinned memory
per worker.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from flextensor.runtime.pinned.bounce_copy import StagedCopy
from flextensor.sharing.share import device_index
from flextensor.shm.background_pin import BackgroundPinner, PinRange
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.tensor_store import SharedTensorStore

__all__ = ["SharedHostCopy"]

logger = logging.getLogger(__name__)


class SharedHostCopy:
    """The engine's ``HostCopy`` over a session share's tensor store and coordinator, for a model on ``device``.

    ``pin``: register the store while the model sleeps so that wakes copy at link rate (Note [a wake at link
    rate]); :meth:`close` stops that registration (the session closes the store after it)."""

    def __init__(self, store: SharedTensorStore, coordinator: ShmCoordinator, device: torch.device, *,
                 pin: bool = True) -> None:
        self._store = store
        self._coordinator = coordinator
        self._device = device
        self._pin = pin and device.type == "cuda"
        self._pinner: BackgroundPinner | None = None
        self._copier: StagedCopy | None = None  # a ring prepared at the sleep where nothing is registered

    def names(self) -> set[str]:
        return {name for record in self._store.records for name in record.all_names}

    def values_on(self, device: torch.device) -> Mapping[str, torch.Tensor]:
        """Zero-copy views on a CPU; on a device, direct copies when this process registered the whole store,
        else through a pinned ring read with ``pread``, as a follower's attach copies them."""
        store = self._store
        if device.type == "cpu":
            views = {record.name: store.tensor(record) for record in store.records}
        else:
            if self._pinner is not None:
                self._pinner.stop()  # ends after the range in flight, on its own thread
            copier, self._copier = self._copier, None
            try:
                if store.pinned:
                    views = store.copies_on(device)
                else:
                    copier = copier or StagedCopy()
                    views = store.copies_on(device, fill=copier.copy_pieces)
                torch.cuda.current_stream(device).synchronize()
            finally:
                if copier is not None:
                    copier.close()
        return {name: views[record.name] for record in store.records for name in record.all_names}

    def wake_ready(self, timeout: float | None = 0.0) -> bool:
        """Whether a wake now copies at link rate: waits up to ``timeout`` seconds (None: no limit) for the
        registration started at the sleep."""
        if self._pinner is not None:
            self._pinner.wait_all(timeout)
        return self._store.pinned

    def fell_asleep(self) -> None:
        self._coordinator.participation.sleep()
        if self._device.type != "cuda":
            return
        self._join_pinner()
        if self._pin:
            unpinned = self._store.unpinned_ranges()
            if not unpinned:
                return
            try:
                ranges = [PinRange(segment, offset, nbytes) for segment, offset, nbytes in unpinned]
                self._pinner = BackgroundPinner(ranges, [], device=device_index(self._device),
                                                label=f"the wake copy of {self._coordinator.namespace}").start()
                return
            except Exception as exc:  # noqa: BLE001 - the wake copies through the staged ring instead
                logger.warning("%s: the registration of the wake copy could not start (%s: %s); wakes copy "
                               "through a staged ring", self._coordinator.namespace, type(exc).__name__, exc)
                self._pin = False
        if self._copier is None and self._store.nbytes > 0:
            self._copier = StagedCopy()
            if self._store.nbytes >= self._copier.min_bytes:
                self._copier.prepare_in_background(self._device)

    def waking(self) -> None:
        self._coordinator.participation.wake()

    def _join_pinner(self) -> None:
        """Join the registration thread; after a refusal, pin no more (the pinner logged it once)."""
        pinner, self._pinner = self._pinner, None
        if pinner is not None:
            pinner.close()
            if pinner.error is not None:
                self._pin = False

    def close(self) -> None:
        """Stop a registration in flight (after its range) and join it, and release a ring prepared for a wake
        that never came: the store may be closed afterwards."""
        self._join_pinner()
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.close()
