"""A session follower's steps: from a joined generation to a model offloaded over the creator's host copy.

A follower calls ``follower_model_factory()`` (normally a ``meta`` model) while a thread waits for READY
(``ShmCreatorDiedError`` when the creator's lease ends first, ``TimeoutError`` after ``wait_timeout``; a failing
factory cancels the wait), decodes the plan, attaches the tensor store, maps the arena and copies the resident
tensors to the device (``flextensor.sharing.attach_prefetch``), so a follower that arrives before READY has its
model built by then (:func:`attach_when_ready`). Then (:func:`adopt_published`) it checks the published metadata
against the model (naming the offending tensor), installs the resident tensors and adopts the plan over the
creator's host blocks, views of the arena (laid out once, on the thread): no private copy.

``session.report()["steps"]`` times each step, the thread's parts included. No step of the caller contains
another, so they add up to at most ``ready_s``; the attach thread's (``wait`` and ``plan``, or ``join``,
``daemon`` and ``plan`` when it joined, and every ``prefetch_*`` but ``prefetch_wait``) run beside ``factory``
and ``prefetch_wait``, and on a CUDA device ``prefetch_blocks`` and ``prefetch_slots`` run beside
``prefetch_resident`` (``flextensor.sharing.attach_prefetch``). With pinning on CUDA the follower registers its
mappings of the blocks in the background, in schedule order (``flextensor.shm.background_pin``): it is ready as
soon as the plan is adopted, and a copy from a block waits only until that block is registered.

Whatever a step opens belongs to the manager's share (:class:`~flextensor.sharing.share.ManagerShare`) before any
error goes on, so the session's cleanup closes it. The session joins the generation (on this thread, or on the
attach thread while the factory runs) and hands the share here; kept apart so that each module has one job.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

from flextensor.configuration.config import OffloadConfig
from flextensor.manager import OffloadManager, compute_device
from flextensor.sharing.attach_prefetch import FollowerPrefetch
from flextensor.sharing.share import (ManagerShare, block_pinner, check_offloaded_metadata, read_published_plan,
                                      run_factory_while_attaching, timed_step)
from flextensor.shm.blocks import SharedBlockAllocator
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.state import TensorManagerState

__all__ = ["attach_when_ready", "adopt_published"]


def attach_when_ready(share: ManagerShare, manager: OffloadManager, cfg: OffloadConfig,
                      remaining: Callable[[], float | None], factory: Callable[[], nn.Module], *,
                      base: str) -> nn.Module:
    """A follower of a generation not READY yet: a thread waits for READY (at most ``remaining()`` seconds, None:
    no limit), reads the plan and opens the store, host blocks and resident copies while the factory builds the
    model (see ``flextensor.sharing.attach_prefetch``), so a follower that arrives before READY has its model by
    the time the creator publishes; then :func:`adopt_published`. ``base`` is the session's namespace."""
    coordinator = share.coordinator
    steps = share.steps
    cancel = threading.Event()

    def wait_then_read() -> tuple[ShmCoordinator, TensorManagerState]:
        with timed_step(steps, "wait"):
            coordinator.wait_for_ready(remaining(), cancel=cancel)
        with timed_step(steps, "plan"):
            return coordinator, read_published_plan(coordinator.memory_owner, share.namespace)

    prefetch = FollowerPrefetch(share.namespace, compute_device(cfg), num_blocks=cfg.num_blocks,
                                min_blocks=cfg.min_blocks, elect=wait_then_read, cancel=cancel).start()
    model = run_factory_while_attaching(prefetch, factory, steps, lambda: share.take_from(prefetch))
    share.wait_s = steps["wait"]
    return adopt_published(share, manager, cfg, model, prefetch, base=base)


def adopt_published(share: ManagerShare, manager: OffloadManager, cfg: OffloadConfig, model: nn.Module,
                    prefetch: FollowerPrefetch, *, base: str) -> nn.Module:
    """The follower's last steps, with the store and arena attached: check, install, adopt, register.

    ``prefetch`` is the attach thread, finished without error: its plan, resident copies and the arena's
    layout, which it computed once to map the arena and which serves here for the views and the pinning.
    ``base`` is the session's namespace, for messages."""
    steps = share.steps
    device = compute_device(cfg)
    state, layout = prefetch.state, prefetch.layout
    if state is None or layout is None:  # the thread finished without error, so it read both: a bug if not
        raise RuntimeError(
            f"internal error in session {base!r}: the attach thread finished without the published "
            "plan or the arena layout; please report it (a fresh start of the worker joins again)"
        )
    with timed_step(steps, "validate"):
        check_offloaded_metadata(model, state)
    assert share.store is not None  # taken from the attach thread, which opened it
    with timed_step(steps, "resident"):  # the copies made on the thread (CUDA); zero-copy views on a CPU host
        share.store.materialize(model, device, copies=prefetch.device_copies)
    sizes = layout.sizes
    gate = None
    with timed_step(steps, "block_views"):
        host_blocks = SharedBlockAllocator.views(share.segments, layout) if sizes else []
        if cfg.pinned_memory and torch.cuda.is_available() and sizes:
            # Registration runs behind the follower's return and first forward, block by block in schedule
            # order; each copy from a block waits for that block only (see flextensor.shm.background_pin).
            share.pinner = block_pinner(share.segments, state, layout, device, label=f"session {share.namespace}")
            gate = share.pinner.wait
    share.shared_bytes = layout.total + share.store.nbytes
    with timed_step(steps, "adopt"):
        proxy = manager.offload_from_state(model, state, cfg, allow_strategy_replan=False,
                                           host_blocks=host_blocks, host_block_gate=gate)
    if share.pinner is not None:
        # Started only now: the driver serialises cudaHostRegister with device allocations, so registering
        # during adoption (which allocates the rotating device blocks) would hold the follower back.
        with timed_step(steps, "pin_start"):
            share.pinner.start()
    return proxy
