"""One manager's share of a ``SharedOffloadSession``: what it holds, and the steps a follower takes with it.

Kept apart from ``flextensor.sharing.session`` (which elects, publishes and attaches) so that each stays one job: the
record a session keeps per manager (:class:`ManagerShare`, reported by ``session.report()``), the checks a
follower makes before it adopts a published plan, and the small steps around them (timing a step, running the
user's factory beside the attach thread, registering with ``ftd``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from flextensor.sharing.attach_prefetch import FollowerPrefetch
from flextensor.loading.lazy_init import skip_init_on_meta
from flextensor.shm.background_pin import BackgroundPinner, PinRange
from flextensor.shm.blocks import SharedBlockAllocator
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.ftd_client import register_participant
from flextensor.shm.names import lock_directory
from flextensor.shm.owner import ShmOwner
from flextensor.shm.tensor_store import SharedTensorStore
from flextensor.state import TensorManagerState, model_tensors

__all__ = ["ManagerShare", "PLAN_KIND", "timed_step", "run_factory_while_attaching", "read_published_plan",
           "check_offloaded_metadata", "privatize_shared_views", "block_pinner", "device_index",
           "register_with_daemon"]

#: Kind of the blob that carries the published plan (``/{ns}.g{gen}.p``).
PLAN_KIND = "p"


@contextmanager
def timed_step(steps: dict[str, float], name: str) -> Iterator[None]:
    """Time one step of attaching (reported by ``session.report()`` so slow steps can be found)."""
    start = time.monotonic()
    try:
        yield
    finally:
        steps[name] = time.monotonic() - start


def run_factory_while_attaching(prefetch: FollowerPrefetch, factory: Callable[[], Any], steps: dict[str, float],
                                 take_over: Callable[[], None]) -> nn.Module:
    """Run the follower's model factory on this thread while the attach thread works, then join the thread.

    The thread is joined even when the factory fails (its wait for READY, if any, cancelled first) or the caller
    is interrupted, and ``take_over`` gives whatever the thread opened an owner before any error propagates; then
    the thread's error, then the factory's result is checked."""
    model = None
    try:
        with timed_step(steps, "factory"), skip_init_on_meta():  # its weights come from the publication
            model = factory()
    except BaseException:
        prefetch.cancel()
        raise
    finally:
        prefetch.factory_returned()  # the copy's held-back workers start (see flextensor.runtime.pinned.bounce_copy)
        try:
            with timed_step(steps, "prefetch_wait"):
                prefetch.join()  # waits for the thread even when interrupted
        finally:
            take_over()
    if prefetch.error is not None:
        raise prefetch.error
    if not isinstance(model, nn.Module):
        raise TypeError(f"follower_model_factory returned {type(model).__name__}, not an nn.Module")
    return model


def read_published_plan(owner: ShmOwner, namespace: str) -> TensorManagerState:
    """The plan the creator of ``namespace``'s generation published (``PLAN_KIND``), validated."""
    return TensorManagerState.from_json(owner.read_blob(PLAN_KIND), source=f"published plan of {namespace}")


@dataclass
class ManagerShare:
    """What one manager of the session holds, and how it got there (reported by ``session.report()``)."""

    name: str
    namespace: str
    coordinator: ShmCoordinator
    role: str = "follower"
    generation: int = 0
    model: nn.Module | None = None
    store: SharedTensorStore | None = None
    segments: list[Any] = field(default_factory=list)
    released: bool = False
    ready_s: float = 0.0
    wait_s: float = 0.0
    shared_bytes: int = 0
    pinner: BackgroundPinner | None = None  # background registration of this process's block mappings
    steps: dict[str, float] = field(default_factory=dict)  # seconds per step: sharing.creator, .follower
    block_views: list[Any] = field(default_factory=list)  # a creator's views of the arena, handed to the engine
    publish: dict[str, float] = field(default_factory=dict)  # a creator's publish: rate, waits, registration
    resident_copy: dict[str, Any] = field(default_factory=dict)  # a CUDA follower's copy of the resident tensors
    host_copy: Any = None  # flextensor.sharing.host_copy.SharedHostCopy: what its model wakes from

    def take_from(self, prefetch: FollowerPrefetch) -> None:
        """Own what a follower's attach thread opened (store, arena), so the session's cleanup closes it, and
        report the thread's parts as ``prefetch_*`` steps."""
        self.store = prefetch.store
        self.segments.extend(prefetch.segments)
        self.steps.update({f"prefetch_{part}": seconds for part, seconds in prefetch.timings.items()})
        report = prefetch.copy_report
        if report is not None:  # the ring's parts ran on a thread of their own: reported apart from the steps
            self.resident_copy = {**report._asdict(), "gbps": report.gbps}

    def summary(self) -> dict[str, Any]:
        pinner = self.pinner
        report = {
            "manager": self.name, "namespace": self.namespace, "role": self.role, "generation": self.generation,
            "ready_s": self.ready_s, "wait_s": self.wait_s, "shared_bytes": self.shared_bytes,
            # the background registration of this process's block mappings so far (CUDA)
            "register_s": pinner.elapsed_s if pinner is not None else 0.0, "steps": dict(self.steps),
        }
        if self.publish:
            report["publish"] = dict(self.publish)
        if self.resident_copy:
            report["resident_copy"] = dict(self.resident_copy)
        if pinner is not None:  # registration runs in the background: is it finished, how long did copies wait
            report.update(registered=pinner.pinned_blocks == pinner.block_count, register_wait_s=pinner.waited_s)
        return report


def check_offloaded_metadata(model: nn.Module, state: TensorManagerState) -> None:
    """Compare the plan's dtype/shape of every tensor with the follower's model, naming the first mismatch."""
    tensors = model_tensors(model)
    for t in state.tensors:
        entry = tensors.get(t.name)
        if entry is None:
            raise ValueError(f"published tensor {t.name!r} does not exist in the follower's model: both factories "
                             "must build the same topology")
        dtype = str(entry.tensor.dtype).removeprefix("torch.")
        if dtype != t.dtype or list(entry.tensor.shape) != list(t.shape):
            raise ValueError(
                f"published tensor {t.name!r} is {t.dtype}{tuple(t.shape)} but the follower's model has "
                f"{dtype}{tuple(entry.tensor.shape)}: both factories must build the same model"
            )
    extra = sorted(set(tensors) - {t.name for t in state.tensors})
    if extra:
        raise ValueError(f"the follower's model has tensor {extra[0]!r} that the published plan does not know")


def privatize_shared_views(model: nn.Module, store: SharedTensorStore) -> None:
    """Give the store's tensors that still view shared memory (CPU hosts) private storage of their own."""
    shared = {name for record in store.records for name in record.all_names}
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if name in shared and tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()


def block_pinner(arenas: Sequence[Any], state: TensorManagerState, layout: Any, device: torch.device, *,
                 label: str) -> BackgroundPinner:
    """The background registration of this process's mappings of the arena's parts (``arenas``, laid out by
    ``layout``), block by block in ``state``'s schedule order (see ``flextensor.shm.background_pin``); the caller
    starts it after adopting."""
    index_of = {b.label: b.index for b in state.blocks}
    order = [index_of[label] for label in state.schedule if label in index_of]
    ranges = [PinRange(*block) for block in SharedBlockAllocator.ranges(arenas, layout)]
    return BackgroundPinner(ranges, order, device=device_index(device), label=label)


def device_index(device: torch.device) -> int | None:
    """The CUDA device ordinal the background registration must make current (None off CUDA)."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def register_with_daemon(coordinator: ShmCoordinator, base: str, manager: str) -> None:
    """Tell a running ``ftd`` about this participant (death seen at once, not after the lease); without a daemon
    this costs a ``stat`` and returns. A draining namespace refuses the join: ``NamespaceDrainingError``
    (a ``RuntimeError``) propagates and the session leaves the generation."""
    register_participant(coordinator.namespace, coordinator.lease_slot, coordinator.identity, lock_directory(),
                         base=base, manager=manager, refuse_if_draining=True)
