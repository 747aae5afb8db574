"""``SharedOffloadSession``: N workers on a host, one pinned host copy of the offloaded weights.

Per manager name the session runs one sharing generation (see ``flextensor.shm.coordinator``):

creator (elected: the first to create the manager's coordinator segment)
    reads the disk profile, builds the model while the segments are made, fills the store and the arena from
    the model or its checkpoint, adopts the profile over the filled blocks and publishes the plan, then READY
    (``flextensor.sharing.creator``). Any failure before READY is published first (``mark_failed``), so
    followers raise ``ShmCreatorFailedError`` with the creator's message, and only then cleaned up.

follower
    builds its model with ``follower_model_factory()`` (normally a ``meta`` model) while a thread waits for
    READY and attaches the store, the arena and the resident tensors' copies, then checks the published metadata
    against the model and adopts the plan over the creator's host blocks: no private copy
    (``flextensor.sharing.follower``, which also says what ``session.report()["steps"]`` times).
    When the generation is already READY on arrival (``peek_ready``: a lock-free read of the header, a hint
    only), the thread also does the join itself (the election under the coordinator lock, the daemon
    registration, the plan) while the factory runs; if the lock stays busy, or the join elected this process
    creator after all, the session goes on along the paths above (the model built is used, or dropped).

A worker sleeps and wakes through ``ft.sleep(name)`` / ``ft.wake(name)``: its resident tensors wake from the
store (``flextensor.sharing.host_copy``), and its lease says whether it sleeps, so that :meth:`update_weights`
can write new weights into the host copy in place while every worker sleeps (``flextensor.sharing.weight_update``).

Before each join the session reclaims the dead namespaces of its user's lock directory (every participant gone,
nobody restarted them: ``flextensor.shm.dead_sweep.sweep_before_join``, bounded in time, logged), so the next job
to start on a host without ``ftd`` frees what crashed jobs left.

The session copies the caller's config and sets its SHM fields; strategy replanning is off because published
blocks are fixed. A session is used from the thread that created it and reserves its manager names (process
wide) until its ``close()`` succeeds; a failed close keeps what it still holds so ``close()`` can be retried.
``close()`` leaves the generation at once (the last participant unlinks every name) and hands what this process
registered with CUDA to the release thread (``flextensor.shm.background_release``), which unregisters it piece
by piece and unmaps it afterwards, so the caller does not wait for the driver; a process that exits meanwhile
leaves the rest to its own end, with nothing left in ``/dev/shm``.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from typing import Any, Callable, Iterable

from torch import nn

# The engine modules a follower needs are imported with the session (adoption among them, through the creator's
# and the follower's steps), not on its first attach: a fresh worker's time to ready should not include imports.
from flextensor.api import get_offload_manager
from flextensor.sharing.attach_prefetch import ELECT_LOCK_WAIT_S, FollowerPrefetch
from flextensor.configuration.config import OffloadConfig
from flextensor.sharing.creator import publish_as_creator
from flextensor.sharing.creator_source import CreatorSource
from flextensor.sharing.follower import adopt_published, attach_when_ready
from flextensor.sharing.host_copy import SharedHostCopy
from flextensor.manager import OffloadManager, compute_device
from flextensor.shm.checks import check_lease_seconds, check_seconds
from flextensor.shm.cleanup import CleanupReport, cleanup_manager_namespace
from flextensor.shm.coordinator import ShmCoordinator, peek_ready
from flextensor.shm.dead_sweep import sweep_before_join
from flextensor.shm.header import State
from flextensor.shm.names import manager_namespace, validate_base_namespace, validate_manager_name
from flextensor.shm.segment_dir import bind_namespace
from flextensor.sharing.share import (PLAN_KIND, ManagerShare, privatize_shared_views, read_published_plan,
                                      register_with_daemon, run_factory_while_attaching, timed_step)
from flextensor.sharing.weight_update import UpdateReport, WeightsSource, update_host_copy
from flextensor.state import TensorManagerState

logger = logging.getLogger(__name__)

__all__ = ["SharedOffloadSession", "ManagerShare", "PLAN_KIND"]

#: Heartbeat lease of every participant (30 s); tests shorten it through the constructor.
DEFAULT_LEASE_SECONDS = 30.0

_reserved_lock = threading.Lock()
_reserved: set[str] = set()


class _Deadline:
    """What is left of an overall ``wait_timeout``; ``None`` everywhere when there is no limit."""

    def __init__(self, seconds: float) -> None:
        self.end = None if seconds == 0 else time.monotonic() + seconds

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())



class SharedOffloadSession:
    """Share one host copy of a profiled model's weights among the workers of one host (see module docs)."""

    def __init__(self, namespace: str, *, wait_timeout: float = 300.0,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS) -> None:
        self.validate_options(namespace, wait_timeout=wait_timeout)
        self.namespace = namespace
        self.wait_timeout = float(wait_timeout)
        self.lease_seconds = check_lease_seconds(lease_seconds)
        self._thread = threading.get_ident()
        self._shares: dict[str, ManagerShare] = {}
        self._closed = False

    # ------------------------------------------------------------------------------------------ validation
    @staticmethod
    def validate_options(namespace: str, *, wait_timeout: float = 300.0) -> None:
        """Check the namespace and timeout without opening anything (``ValueError`` naming the problem)."""
        validate_base_namespace(namespace)
        check_seconds(wait_timeout, "wait_timeout", allow_none=False)

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise RuntimeError(
                "SharedOffloadSession is used from another thread than the one that created it; create one "
                "session per worker thread (flextensor is single-threaded per manager)"
            )

    # ------------------------------------------------------------------------------------------ main entry
    def offload_from_profile(
        self,
        profile_dir: str,
        *,
        config: OffloadConfig | None = None,
        name: str = "default",
        creator_model_factory: Callable[[], nn.Module] | None = None,
        follower_model_factory: Callable[[], nn.Module],
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> nn.Module:
        """Elect, then publish (creator) or attach (follower); return the offloaded model, ready for inference.

        With ``checkpoint`` (a safetensors file, a directory of shards, or its index JSON) the creator builds its
        model with ``creator_model_factory`` if given, else ``follower_model_factory`` (parameters on ``meta``),
        and reads every tensor once, straight into the shared blocks (``flextensor.sharing.creator_source``); a missing
        tensor is a ``KeyError``, a dtype or shape mismatch a ``ValueError``, both published to the followers."""
        self._check_thread()
        if self._closed:
            raise RuntimeError("this SharedOffloadSession is closed; create a new one")
        validate_manager_name(name)
        if not callable(follower_model_factory) or not (
                callable(creator_model_factory) or (creator_model_factory is None and checkpoint is not None)):
            raise TypeError("follower_model_factory and creator_model_factory must be callables returning nn.Module "
                            "(creator_model_factory may be omitted when checkpoint= is given)")
        source = CreatorSource(creator_model_factory or follower_model_factory, checkpoint)
        if name in self._shares:
            raise RuntimeError(f"this session already offloads manager {name!r}; close() it before offloading again")
        manager = get_offload_manager(name)
        self._reserve(name)
        if manager.model is not None:
            self._unreserve(name)
            raise RuntimeError(f"manager {name!r} already offloads a model in this process; release it first")
        ns = manager_namespace(self.namespace, name)
        cfg = self._session_config(config, ns)
        deadline = _Deadline(self.wait_timeout)
        start = time.monotonic()
        share: ManagerShare | None = None
        built: nn.Module | None = None  # a follower's model, built while its thread joined (see _join_while_building)
        built_s = 0.0
        prefetch: FollowerPrefetch | None = None
        before_join: dict[str, float] = {}  # steps timed before the share that reports them exists
        with timed_step(before_join, "sweep"):
            sweep_before_join(ns)  # what crashed jobs of this user left on the host (flextensor.shm.dead_sweep)
        try:
            if cfg.shm_dir is not None:  # where to peek (the coordinator binds it again when it joins)
                bind_namespace(ns, cfg.shm_dir)
            if peek_ready(ns):
                share, built, prefetch, built_s = self._join_while_building(name, ns, cfg, deadline,
                                                                            follower_model_factory)
            if share is None:
                begin = time.monotonic()
                coordinator = ShmCoordinator(ns, lease_seconds=self.lease_seconds, timeout=deadline.remaining(),
                                             base=self.namespace, manager=name, shm_dir=cfg.shm_dir)
                share = self._new_share(name, ns, coordinator, joined_s=time.monotonic() - begin)
                with timed_step(share.steps, "daemon"):
                    register_with_daemon(coordinator, self.namespace, name)
        except BaseException:
            share = share or self._shares.get(name)  # _join_while_building registers one before it raises
            if share is None:
                self._unreserve(name)
            else:
                self._abandon(share, manager)
            raise
        try:
            if share.coordinator.is_creator:
                share.role = "creator"
                logger.info("session %s/%s: elected creator of generation %d", self.namespace, name, share.generation)
                model = publish_as_creator(share, manager, cfg, profile_dir, source, base=self.namespace)
            elif prefetch is not None and prefetch.state is not None:
                logger.info("session %s/%s: follower of generation %d (joined while the model was built)",
                            self.namespace, name, share.generation)
                assert built is not None  # the thread's results come with the model built beside it
                model = adopt_published(share, manager, cfg, built, prefetch, base=self.namespace)
            else:
                logger.info("session %s/%s: follower of generation %d; waiting for the creator",
                            self.namespace, name, share.generation)
                factory = follower_model_factory if built is None else (lambda: built)
                model = attach_when_ready(share, manager, cfg, deadline.remaining, factory, base=self.namespace)
                if built is not None:  # the model was built beside the thread's join, not by attach_when_ready
                    share.steps["factory"] = built_s
        except BaseException:
            self._abandon(share, manager)
            raise
        share.model = model
        assert share.store is not None
        share.steps.update(before_join)
        with timed_step(share.steps, "host_copy"):
            share.host_copy = SharedHostCopy(share.store, share.coordinator, compute_device(cfg),
                                               pin=bool(cfg.pinned_memory))
            manager.set_host_copy(share.host_copy)  # a sleep keeps no private copy
        share.ready_s = time.monotonic() - start
        logger.info("session %s/%s: %s ready in %.3f s (%.1f MiB shared)", self.namespace, name, share.role,
                    share.ready_s, share.shared_bytes / 2**20)
        return model

    def _new_share(self, name: str, ns: str, coordinator: ShmCoordinator, *, joined_s: float) -> ManagerShare:
        """Register what this session now holds for manager ``name`` (from here, a failure is cleaned up)."""
        share = ManagerShare(name=name, namespace=ns, coordinator=coordinator, generation=coordinator.generation)
        share.steps["join"] = joined_s  # the election, under the coordinator's lock
        self._shares[name] = share
        return share

    def _join_while_building(self, name: str, ns: str, cfg: OffloadConfig, deadline: _Deadline,
                             factory: Callable[[], nn.Module]) -> tuple[ManagerShare | None, nn.Module,
                                                                        FollowerPrefetch, float]:
        """A READY generation exists: build the follower's model while a thread joins it and attaches.

        Returns the share (None when the thread gave up waiting for the coordinator lock: the caller joins on
        its own thread), the model the factory built, the thread's results (see
        ``flextensor.sharing.attach_prefetch``, "Joining on the thread") and the factory's seconds. Whatever the thread
        joined or opened belongs to the share before any error is raised, so the caller's cleanup covers it.
        """
        steps: dict[str, float] = {}
        joined: ShmCoordinator | None = None  # set on the thread as soon as it joined: the share owns it then

        def elect() -> tuple[ShmCoordinator | None, TensorManagerState | None]:
            nonlocal joined
            begin = time.monotonic()
            remaining = deadline.remaining()
            wait = ELECT_LOCK_WAIT_S if remaining is None else min(ELECT_LOCK_WAIT_S, remaining)
            try:  # only the election's wait is short; later registrations and the close keep the session's
                joined = ShmCoordinator(ns, lease_seconds=self.lease_seconds, timeout=remaining, join_timeout=wait,
                                        base=self.namespace, manager=name, shm_dir=cfg.shm_dir)
            except TimeoutError:
                return None, None
            steps["join"] = time.monotonic() - begin
            with timed_step(steps, "daemon"):  # a failure from here leaves ``joined`` to take_over, then _abandon
                register_with_daemon(joined, self.namespace, name)
            if joined.is_creator or joined.state is not State.READY:
                return joined, None
            with timed_step(steps, "plan"):
                state = read_published_plan(joined.memory_owner, ns)
            return joined, state

        prefetch = FollowerPrefetch(ns, compute_device(cfg), num_blocks=cfg.num_blocks, min_blocks=cfg.min_blocks,
                                    elect=elect).start()
        share = None

        def take_over() -> None:  # the share owns what the thread joined and opened before any error goes on
            nonlocal share
            if joined is not None:
                share = self._new_share(name, ns, joined, joined_s=steps.pop("join", 0.0))
                share.steps.update(steps)
                share.take_from(prefetch)

        model = run_factory_while_attaching(prefetch, factory, steps, take_over)
        return share, model, prefetch, steps["factory"]

    def _session_config(self, config: OffloadConfig | None, ns: str) -> OffloadConfig:
        """A copy of the caller's config with the SHM fields set (the caller's object is never changed)."""
        cfg = copy.deepcopy(config) if config is not None else OffloadConfig()
        cfg.shm_enabled = True
        cfg.shm_namespace = ns
        cfg.shm_wait_timeout = self.wait_timeout
        cfg.validate()
        return cfg

    # ------------------------------------------------------------------------------------------ teardown
    def _abandon(self, share: ManagerShare, manager: OffloadManager) -> None:
        """Undo a failed ``offload_from_profile``; what cannot be undone stays for ``close()`` to retry."""
        try:
            self._release_share(share, manager, preserve=False)
        except Exception as exc:  # noqa: BLE001 - the caller sees the original error; close() can retry
            logger.warning("session %s/%s: cleanup after failure incomplete (%s); call close() to retry",
                           self.namespace, share.name, exc)

    def _release_share(self, share: ManagerShare, manager: OffloadManager, *, preserve: bool) -> None:
        if not share.released:
            if manager.model is not None:
                model = manager.model
                manager.release(preserve_model=preserve)
                if preserve and share.store is not None:
                    privatize_shared_views(model, share.store)
            share.released = True
        if share.host_copy is not None:
            share.host_copy.close()
        if share.pinner is not None:  # no registration may race the unpin and unmap below
            share.pinner.close()
        share.block_views = []
        # Unregistering what this process pinned takes the driver seconds for a large model; it runs on the
        # release thread, which unmaps each segment after its last range (flextensor.shm.background_release).
        while share.segments:
            segment = share.segments[-1]
            segment.close(background=True)
            share.segments.pop()
        if share.store is not None:
            share.store.close(background=True)
            share.store = None
        share.coordinator.close()  # the names go now (last participant); the pages when the last mapping does
        self._shares.pop(share.name, None)
        self._unreserve(share.name)

    def close(self, *, preserve_models: bool = False) -> None:
        """Release every manager and leave each generation (the last participant unlinks everything).

        ``preserve_models=True`` first copies managed weights into private storage so the models stay usable.
        Raises the first failure after trying every manager; what failed is kept so ``close()`` can be retried.
        """
        self._check_thread()
        first_error: BaseException | None = None
        for share in list(self._shares.values()):
            try:
                self._release_share(share, get_offload_manager(share.name), preserve=preserve_models)
            except Exception as exc:  # noqa: BLE001 - try the other managers, then report
                logger.warning("session %s/%s: close failed (%s); call close() again to retry",
                               self.namespace, share.name, exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        self._closed = True

    def __enter__(self) -> "SharedOffloadSession":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close(preserve_models=False)
            return
        try:  # an error is already on its way out: a failing close must not replace it
            self.close(preserve_models=False)
        except Exception as close_exc:  # noqa: BLE001
            logger.error("session %s: close() failed while handling %s: %s; call close() again to retry",
                         self.namespace, exc_type.__name__, close_exc)

    # ------------------------------------------------------------------------------------------ new weights
    def update_weights(self, source: WeightsSource, *, name: str = "default",
                       version: int | None = None) -> UpdateReport:
        """Write new weights into the host copy of manager ``name``'s namespace in place, block by block, for
        every worker of the host; ``version`` (default: the current one + 1) is published with them.

        ``source``: a state dict, an iterable of ``(name, tensor)`` pairs, or a safetensors file or directory;
        any subset of the published tensors. Names, dtypes and shapes are checked first (``KeyError``,
        ``ValueError``); ``WorkersAwakeError`` while any worker of the namespace, this one included, is awake
        (``ft.sleep(name)`` first). Workers that wake afterwards compute with the new weights."""
        self._check_thread()
        share = self._shares.get(name)
        manager = get_offload_manager(name)
        if share is None or share.store is None or manager.engine is None:
            raise RuntimeError(f"this session offloads no model under manager {name!r}: offload_from_profile first")
        return update_host_copy(manager.engine, share.store, share.coordinator.participation, source, version)

    def weights_version(self, name: str = "default") -> int:
        """The version of the weights manager ``name``'s model holds: since it attached or last woke (0: as the
        creator published them)."""
        self._check_thread()
        share = self._shares.get(name)
        if share is None:
            raise RuntimeError(f"this session offloads no model under manager {name!r}")
        return share.coordinator.participation.held_version

    # ------------------------------------------------------------------------------------------ reporting
    def report(self) -> list[dict[str, Any]]:
        """Role, generation, timings and shared bytes of each manager this session holds."""
        return [share.summary() for share in self._shares.values()]

    def role(self, name: str = "default") -> str:
        return self._shares[name].role

    def namespace_for(self, name: str = "default") -> str:
        """The per-manager namespace that manager ``name`` shares under (what ``ftd ls`` and the segment names
        in ``/dev/shm`` show): this session's base namespace and the manager name, hashed to a short name."""
        return manager_namespace(self.namespace, validate_manager_name(name))

    # ------------------------------------------------------------------------------------------ supervisors
    @staticmethod
    def cleanup_namespace(namespace: str, *, manager_names: Iterable[str], timeout: float = 60.0,
                          lock_dir: str | os.PathLike[str] | None = None, force: bool = False) -> list[CleanupReport]:
        """Reclaim what killed workers left, from the journal and leases only (no coordinator, no model).

        ``timeout`` bounds the wait for live leases across all managers (0: try once, now); workers killed on
        this host count as gone at once. ``lock_dir``: the workers' lock directory (default: this process's,
        from its ``TMPDIR``). ``force=True``, once every worker is stopped, removes everything derivable from
        the namespace even when its metadata is corrupt or lost. Missing generations are a no-op; unknown
        protocols or malformed metadata raise without deleting anything. Earlier managers may already be
        removed when a later one fails; retrying is safe.
        """
        validate_base_namespace(namespace)
        if isinstance(manager_names, str):
            raise ValueError(f"manager_names must be a list of names, not the string {manager_names!r}")
        names = [validate_manager_name(m) for m in manager_names]
        if not names:
            raise ValueError("manager_names is empty: pass the manager names used by the run, e.g. ['default']")
        deadline = time.monotonic() + check_seconds(timeout, "timeout", allow_none=False)
        reports = []
        for name in names:
            remaining = max(0.0, deadline - time.monotonic())
            reports.append(cleanup_manager_namespace(manager_namespace(namespace, name), timeout=remaining,
                                                     lock_dir=lock_dir, force=force))
        if all(r.generation is None and not r.removed for r in reports):
            # A no-op, as the guide says; but a wrong manager name or TMPDIR looks just like it, so say so.
            logger.warning("cleanup_namespace(%r, manager_names=%r) found nothing to reclaim (namespaces %s, in "
                           "/dev/shm and the lock directory %s): if workers were killed, pass the base namespace "
                           "and manager names they used and their TMPDIR (or lock_dir); `ftd ls` lists what is "
                           "there", namespace, names, ", ".join(r.namespace for r in reports),
                           lock_dir if lock_dir is not None else "of this process's TMPDIR")
        return reports

    # ------------------------------------------------------------------------------------------ reservations
    @staticmethod
    def _reserve(name: str) -> None:
        with _reserved_lock:
            if name in _reserved:
                raise RuntimeError(
                    f"manager {name!r} is reserved by another SharedOffloadSession in this process; close that "
                    "session first or use another manager name"
                )
            _reserved.add(name)

    @staticmethod
    def _unreserve(name: str) -> None:
        with _reserved_lock:
            _reserved.discard(name)
