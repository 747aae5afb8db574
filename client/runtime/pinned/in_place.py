"""Pinned staging: the warm-up sources (the offload candidates' own CPU storages) page-locked in place.

Why
---
During DISCOVERY and PROFILING the offloadable weights are copied to the device
(:class:`~flextensor.engine.hooks.WarmLoader`): once each when they fit there (resident warm-up, ``flextensor.engine.warmup``),
else before every trap call of every pass. From pageable memory the driver bounces each copy through a small
pinned buffer of its own, at a fraction of the link's rate, and the host thread waits for it. From page-locked
memory the copy is a direct DMA at the link's rate and can be queued (``non_blocking=True``) behind the compute
already in the stream. Registering the storages the weights already live in (``cudaHostRegister``) costs less
than one pageable pass (``docs/benchmarks.md`` has the rates) and needs no second copy of the model in host RAM,
so it pays off even for the single
sweep of a resident warm-up (and, in that mode, a kept copy's host storage stays registered until INFERENCE is
built: the host blocks are filled from it).

Lifecycle (driven by the manager; see ``flextensor.manager``)
-------------------------------------------------------------
- ``offload()`` calls :meth:`PinnedStaging.stage` with the candidates still on the CPU. Every distinct storage is
  registered once with its exact byte extent (``storage.nbytes()``), read-only (the device only reads it), on a
  few threads when there is much of it (``_register_all``). Storages that are already page-locked
  (PyTorch's pinned allocator, a pinned SHM segment) are skipped: they are not ours to unregister. Storages that
  overlap in memory (two storage objects over the same bytes, e.g. ``torch.frombuffer``) are merged into one
  region, because the driver refuses to register a byte twice. If any registration fails, what was registered
  is undone and the warm-up copies come from pageable memory, with ONE warning.
- A region keeps a reference to its storages, so their memory can neither be freed nor handed to another
  allocation while the driver still has the pages locked.
- :meth:`PinnedStaging.release` drops tensor names the warm-up no longer copies (tensors made resident at the end
  of DISCOVERY; each trap's tensors once its host block is filled, at the switch to INFERENCE or on the
  background build's thread, ``flextensor.engine.build``, which is then the staging's only user); a region is
  unregistered when its last name is released. :meth:`release_all` unregisters the rest (end of the INFERENCE
  build, ``release()``, teardown after an error). :meth:`release_later` does a release on a thread of its own
  (``ft-unstage``: tens of ms per GiB of ``cudaHostUnregister`` off the caller's thread); every other call that
  changes the table joins that thread first, so the table has one user at a time. A region leaves the table *before* it is unregistered, so it
  can never be unregistered twice, even when the call fails.
- Before unregistering, the device is synchronized once per call: a queued ``non_blocking`` warm-up copy may
  still be reading the region. This happens at phase switches and teardown only, never on the hot path.

On a CPU compute device, or with ``pinned_memory=False``, nothing is staged (:meth:`wanted` is False) and the
warm-up code path is exactly the pageable one.

CUDA error state
----------------
A failed ``cudaHostRegister`` leaves its code in the CUDA runtime's per-thread "last error"; PyTorch reads (and
raises) that slot after its next kernel launch, far from the cause. :func:`clear_cuda_error` resets it after
every failure handled here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from flextensor.runtime.heap import return_free_heap
from flextensor.runtime.pinned.launch_turns import LaunchTurns
from flextensor.shm.pinning import clear_cuda_error

__all__ = [
    "PinnedStaging",
    "StagedRegion",
    "plan_regions",
    "clear_cuda_error",
    "register_in_place",
    "unregister_in_place",
    "huge_page_hint",
]

logger = logging.getLogger(__name__)

#: Threads that register the staged regions side by side (``PinnedStaging.stage``), when there are at least
#: ``PARALLEL_MIN_BYTES`` to register (less takes a few milliseconds on one thread).
REGISTER_THREADS = 4
PARALLEL_MIN_BYTES = 256 << 20
#: How the driver (or a host without CUDA) refuses a registration: staging then falls back to pageable copies.
_REGISTER_ERRORS = (RuntimeError, ValueError, OSError)


@dataclass
class StagedRegion:
    """One registered byte range: the storages it covers (kept alive) and the tensor names still using it."""

    ptr: int
    nbytes: int
    storages: list[Any] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    registered: bool = False
    #: Set once its registration was tried (:meth:`PinnedStaging.stage_in_background`: copies wait for it).
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes


def _storage_is_pinned(storage: Any) -> bool:
    try:
        return bool(storage.is_pinned())
    except (RuntimeError, AssertionError):  # no usable CUDA: nothing can be pinned
        return False


def plan_regions(
    tensors: Mapping[str, torch.Tensor],
    *,
    is_pinned: Callable[[Any], bool] = _storage_is_pinned,
) -> list[StagedRegion]:
    """The byte ranges to register for ``tensors`` (name -> tensor), sorted by address.

    One region per distinct CPU storage (exact ``nbytes``); empty storages, non-CPU tensors and storages that are
    already page-locked are left out; storages whose bytes overlap are merged into one region.
    """
    by_ptr: dict[int, StagedRegion] = {}
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        if ptr == 0 or nbytes == 0:
            continue
        region = by_ptr.get(ptr)
        if region is None:
            region = by_ptr[ptr] = StagedRegion(ptr, nbytes)
        region.nbytes = max(region.nbytes, nbytes)
        region.storages.append(storage)
        region.names.add(name)
    candidates = sorted((r for r in by_ptr.values() if not is_pinned(r.storages[0])), key=lambda r: r.ptr)
    merged: list[StagedRegion] = []
    for region in candidates:
        last = merged[-1] if merged else None
        if last is not None and region.ptr < last.end:
            last.nbytes = max(last.end, region.end) - last.ptr
            last.storages.extend(region.storages)
            last.names |= region.names
        else:
            merged.append(region)
    return merged


def huge_page_hint(nbytes: int, *, env: Mapping[str, str] | None = None, thp_mode: str | None = None) -> str | None:
    """What to set so that page-locking ``nbytes`` of the model's memory goes faster; None when nothing would.

    ``cudaHostRegister`` works page by page: in transparent huge pages the same memory registers in about half the
    time it takes in 4 KiB pages, and so does a large model's first warm-up pass, which waits for it
    (``docs/benchmarks.md``, "The profile phase alone"). PyTorch backs its large CPU allocations with huge pages when
    ``THP_MEM_ALLOC_ENABLE=1`` is in the environment before the model is loaded; that only matters where the
    kernel gives huge pages on request (``madvise`` mode): with ``always`` they are there already, with ``never``
    not to be had. ``env`` and ``thp_mode`` (the bracketed word of
    ``/sys/kernel/mm/transparent_hugepage/enabled``) default to this process's."""
    env = os.environ if env is None else env
    if env.get("THP_MEM_ALLOC_ENABLE") == "1":
        return None
    if thp_mode is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as modes:
                text = modes.read()
        except OSError:
            return None
        thp_mode = text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else ""
    if thp_mode != "madvise":
        return None
    return (f"page-locking {nbytes / (1 << 30):.1f} GiB of the model's host memory in 4 KiB pages (about 50 ms/GiB on 4 "
            "threads; the first warm-up pass waits for it): set THP_MEM_ALLOC_ENABLE=1 in the environment before the "
            "model is loaded, so that PyTorch puts large CPU tensors in transparent huge pages, which page-lock "
            "about twice as fast")


# ---------------------------------------------------------------------------------------------------- CUDA glue
def _default_register(ptr: int, nbytes: int) -> None:
    """Read-only registration: the device only ever reads staged memory (host-to-device copies), and the driver
    pins such pages without asking for write access, which is faster (``flextensor.shm.pinning``)."""
    from flextensor.shm.pinning import host_register

    host_register(ptr, nbytes, read_only=True)


def _default_unregister(ptr: int) -> None:
    from flextensor.shm.pinning import host_unregister

    host_unregister(ptr)


def register_in_place(tensor: torch.Tensor) -> bool:
    """Page-lock a CPU tensor's storage in place; False (CUDA error state cleared) when that is not possible.

    For short-lived buffers (the transfer sweep): exact size, none of the pinned allocator's power-of-two
    rounding, and nothing left in PyTorch's pinned cache afterwards. Undo with :func:`unregister_in_place`.
    """
    from flextensor.shm.pinning import cudart_available

    if not cudart_available() or tensor.numel() == 0:
        return False
    storage = tensor.untyped_storage()
    try:
        _default_register(int(storage.data_ptr()), int(storage.nbytes()))
    except (RuntimeError, ValueError) as exc:
        clear_cuda_error()
        logger.debug("could not register %d bytes in place: %s", storage.nbytes(), exc)
        return False
    return True


def unregister_in_place(tensor: torch.Tensor) -> None:
    try:
        _default_unregister(int(tensor.untyped_storage().data_ptr()))
    except RuntimeError as exc:
        clear_cuda_error()
        logger.warning("could not unregister a temporary pinned buffer: %s", exc)


# ---------------------------------------------------------------------------------------------------- staging
class PinnedStaging:
    """The registered warm-up regions of one manager (see the module docstring).

    ``register``/``unregister``/``synchronize`` default to ``flextensor.shm.pinning`` and
    ``torch.cuda.synchronize``, and ``policy`` (``(config, device) -> bool``, whether to stage at all) to
    :meth:`default_policy`; they are parameters so the bookkeeping can be checked on hosts without CUDA.
    """

    def __init__(
        self,
        *,
        register: Callable[[int, int], None] | None = None,
        unregister: Callable[[int], None] | None = None,
        synchronize: Callable[[], None] | None = None,
        is_pinned: Callable[[Any], bool] = _storage_is_pinned,
        policy: Callable[[Any, torch.device], bool] | None = None,
    ) -> None:
        self._policy = policy or self.default_policy
        self._register = register or _default_register
        self._unregister = unregister or _default_unregister
        self._synchronize = synchronize
        self._is_pinned = is_pinned
        self._device: torch.device | None = None
        self._regions: dict[int, StagedRegion] = {}  # by start address (unique once overlaps are merged)
        self._region_of: dict[str, StagedRegion] = {}
        self._releasing: threading.Thread | None = None  # release_later's thread
        self._staging: threading.Thread | None = None  # stage_in_background's thread
        self._cancel_staging = threading.Event()
        self._join_lock = threading.Lock()
        self._by_storage: dict[int, StagedRegion] = {}  # storage address -> region (stage_in_background's waits)
        #: While stage_in_background registers, its calls and the warm-up's launches take turns (the loader
        #: takes the turn for a trap's copies and compute; see flextensor.runtime.pinned.launch_turns).
        self.turns = LaunchTurns()
        self.failed = False

    @staticmethod
    def default_policy(config: Any, device: torch.device) -> bool:
        """Staging applies when copies go to a CUDA device and the config asks for pinned memory."""
        return device.type == "cuda" and bool(getattr(config, "pinned_memory", False))

    def wanted(self, config: Any, device: torch.device) -> bool:
        return bool(self._policy(config, device))

    @property
    def active(self) -> bool:
        """True while at least one region is registered (warm-up copies may then be ``non_blocking``)."""
        return bool(self._regions)

    @property
    def regions(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every region registered now."""
        # list(): a release_later may run; registered only: stage_in_background may still be registering
        return [(r.ptr, r.nbytes) for r in list(self._regions.values()) if r.registered]

    @property
    def stopping(self) -> bool:
        """True once :meth:`release_all` told a background staging to stop after the region in flight."""
        return self._cancel_staging.is_set()

    @property
    def registered_bytes(self) -> int:
        return sum(r.nbytes for r in list(self._regions.values()) if r.registered)

    def stage(self, tensors: Mapping[str, torch.Tensor], device: torch.device) -> int:
        """Register the storages of ``tensors`` (name -> tensor); returns the bytes registered (0 on fallback)."""
        regions = self._begin(tensors, device)
        done, errors = self._register_all(regions)
        if errors:
            exc = errors[0]
            clear_cuda_error()
            self.failed = True
            for region in done:
                self._unregister_one(region)
            for error in errors:  # a bug, not a refusal of the driver: raised, not folded into the fallback
                if not isinstance(error, _REGISTER_ERRORS):
                    raise error
            total = sum(r.nbytes for r in regions)
            logger.warning(
                "pinned staging of the warm-up weights failed (%s); DISCOVERY/PROFILING passes copy them from "
                "pageable memory instead (%d bytes in %d regions, slower). Raise RLIMIT_MEMLOCK (`ulimit -l "
                "unlimited`) or pass weights that are already pinned to avoid this", exc, total, len(regions))
            return 0
        self._regions = {region.ptr: region for region in done}
        self._region_of = {name: region for region in done for name in region.names}
        if done:
            logger.debug("staged %d bytes of warm-up weights in %d pinned regions", self.registered_bytes, len(done))
        return self.registered_bytes

    def stage_in_background(self, tensors: Mapping[str, torch.Tensor], device: torch.device,
                            order: Sequence[str]) -> int:
        """:meth:`stage` on a thread (``ft-stage``), region by region in the order of the first of their names in
        ``order`` (the order the warm-up first copies them); returns the bytes it will register.

        For many bytes (``offload()`` of a large model: seconds of registration): the caller goes on, and each copy waits
        only for its own region (:meth:`wait_for`), so the registration overlaps the first warm-up pass instead
        of preceding it. A failure stops the thread (one warning, ``failed``); the regions registered before it
        stay registered and the rest are copied from pageable memory, which is safe: a copy from pageable memory
        returns only once the driver holds the bytes, whatever ``non_blocking`` says. Every other method joins
        the thread first (:meth:`join`; :meth:`release_all` cancels it after the region in flight). While it
        runs, its calls and the warm-up's launches take turns (:attr:`turns`): a copy also waits for the
        registrations already in flight."""
        rank = {name: i for i, name in enumerate(order)}
        regions = sorted(self._begin(tensors, device), key=lambda r: min(rank.get(n, len(rank)) for n in r.names))
        self._regions = {region.ptr: region for region in regions}
        self._region_of = {name: region for region in regions for name in region.names}
        self._by_storage = {int(st.data_ptr()): region for region in regions for st in region.storages}
        self._cancel_staging.clear()
        total = sum(r.nbytes for r in regions)

        def run() -> None:
            errors: list[BaseException] = []
            done: list[StagedRegion] = []
            try:  # this thread's current device first: never a context on another GPU (cuda:0 by default)
                if device.type == "cuda":
                    torch.cuda.set_device(device)
                done, errors = self._register_all(regions, self._cancel_staging, self.turns)
            except BaseException as exc:  # noqa: BLE001 - reported below, like a failed registration
                errors.append(exc)
            finally:
                self.turns.close()  # registering is over: launches no longer wait for a turn
            self.failed = bool(errors)  # before the waiters below wake up
            for region in regions:  # not tried (a failure, a cancel): nobody may wait for them
                region.ready.set()
            if errors:
                for error in errors:
                    if not isinstance(error, _REGISTER_ERRORS):  # a bug: its traceback, beside the fallback below
                        logger.error("staging the warm-up weights on a thread failed unexpectedly", exc_info=error)
                clear_cuda_error()
                logger.warning(
                    "pinned staging of the warm-up weights stopped after %d of %d bytes (%s); the rest is copied "
                    "from pageable memory during DISCOVERY/PROFILING (slower). Raise RLIMIT_MEMLOCK (`ulimit -l "
                    "unlimited`) or pass weights that are already pinned to avoid this",
                    sum(r.nbytes for r in done), total, errors[0])

        if regions:
            hint = huge_page_hint(total)
            if hint is not None:
                logger.info(hint)
            self.turns.open()
            self._staging = threading.Thread(target=run, name="ft-stage", daemon=True)
            try:
                self._staging.start()
            except BaseException:
                self.turns.close()
                self._staging = None
                raise
        return total

    def wait_for(self, tensor: torch.Tensor) -> bool:
        """Block until the region holding ``tensor``'s storage was tried by :meth:`stage_in_background` (at once
        for any other tensor); False when that registration did not happen (a copy from it is pageable)."""
        region = self._by_storage.get(int(tensor.untyped_storage().data_ptr())) if self._by_storage else None
        if region is None:
            return True
        if not region.ready.is_set():
            self.turns.give()  # a turn held while waiting would hold up the registration waited for
            region.ready.wait()
        return region.registered

    def _begin(self, tensors: Mapping[str, torch.Tensor], device: torch.device) -> list[StagedRegion]:
        """What both ways of staging start with: no staging in progress or left, then the regions to register."""
        self.join()
        if self._regions:
            raise RuntimeError("PinnedStaging.stage called twice; release_all() first")
        self._device = device
        self.failed = False
        return plan_regions(tensors, is_pinned=self._is_pinned)

    def _register_all(self, regions: list[StagedRegion], cancel: threading.Event | None = None,
                      turns: LaunchTurns | None = None) -> tuple[list[StagedRegion], list[BaseException]]:
        """Register ``regions`` on up to :data:`REGISTER_THREADS` threads; ``(registered, errors)``.

        Why threads: pinning populated anonymous memory runs faster side by side, up to about four threads. Each
        thread makes the staging's device current first, so no
        thread creates a context on another GPU. Every region is tried, so the caller can undo exactly the ones
        that were registered; after a failure no new registration starts. With ``turns``, each call waits for
        its turn (flextensor.runtime.pinned.launch_turns)."""
        device = self._device
        errors: list[BaseException] = []

        def register(region: StagedRegion) -> StagedRegion | None:
            try:
                if device is not None and device.type == "cuda" and threading.current_thread() is not main:
                    torch.cuda.set_device(device)
                with turns.registration() if turns is not None else contextlib.nullcontext():
                    # Checked once the turn came (it may have been long): a failure or a cancel pins no more.
                    if errors or (cancel is not None and cancel.is_set()):
                        return None
                    self._register(region.ptr, region.nbytes)
                region.registered = True
                return region
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which undoes and reports
                errors.append(exc)
                return None
            finally:
                region.ready.set()

        main = threading.current_thread()
        threads = min(REGISTER_THREADS, len(regions)) if sum(r.nbytes for r in regions) >= PARALLEL_MIN_BYTES else 1
        if threads <= 1:
            results = [register(region) for region in regions]
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="ft-stage") as pool:
                results = list(pool.map(register, regions))
        return [r for r in results if r is not None], errors

    def release(self, names: Iterable[str], between: Callable[[], None] | None = None) -> int:
        """Drop ``names``; unregister every region left without names. Returns the number unregistered.

        ``between`` is called between two unregistrations. ``cudaHostUnregister`` holds a driver lock that other
        threads' launches wait for (a launch-bound pass on the main thread stalls for all of an unregistration in
        one piece, through torch's binding and through ctypes alike). A background release passes a short sleep
        here, so each stall is one region's.
        """
        self.join()
        return self._release(names, between)

    def release_later(self, names: Iterable[str], pause_s: float = 0.001) -> None:
        """:meth:`release` ``names`` on a thread of its own, sleeping ``pause_s`` between two unregistrations.

        For regions nothing reads any more whose release would stall the caller (tens of ms per GiB). The
        device is synchronized on that thread before the first unregistration, as by :meth:`release`; the thread
        makes the staging's device current first, so it never creates a context on another GPU. Freed memory
        goes back to the OS there too (``return_free_heap``). :meth:`join` waits for it."""
        self.join()
        names = list(names)
        device = self._device

        def run() -> None:
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)
                self._release(names, lambda: time.sleep(pause_s))
                return_free_heap()
            except Exception as exc:  # noqa: BLE001 - a leftover registration goes at release_all / process exit
                logger.warning("releasing %d staged warm-up tensors in the background failed: %s", len(names), exc)

        thread = threading.Thread(target=run, name="ft-unstage", daemon=True)
        self._releasing = thread
        thread.start()

    def join(self) -> None:
        """Wait for a :meth:`stage_in_background` or :meth:`release_later` in progress (no-op when there is none,
        or on its own thread). After a staging thread, the regions it did not register leave the table."""
        staging = self._staging
        if staging is not None and staging is not threading.current_thread():
            self.turns.give()  # a turn held while waiting would hold up the registrations waited for
            staging.join()
            with self._join_lock:  # the build thread and the caller's may both get here
                if self._staging is staging:
                    for region in [r for r in self._regions.values() if not r.registered]:
                        del self._regions[region.ptr]
                        for name in region.names:
                            self._region_of.pop(name, None)
                        region.storages.clear()
                    self._by_storage = {}
                    self._staging = None  # last: a caller that sees None finds the table settled
        thread = self._releasing
        if thread is not None and thread is not threading.current_thread():
            thread.join()
            self._releasing = None

    def release_all(self) -> int:
        """Unregister every region still registered (idempotent). Returns the number unregistered."""
        self._cancel_staging.set()  # a staging thread stops after the region in flight
        self.join()
        self._region_of.clear()
        return self._unregister_regions(list(self._regions.values()))

    def _release(self, names: Iterable[str], between: Callable[[], None] | None) -> int:
        freed: list[StagedRegion] = []
        for name in names:
            region = self._region_of.pop(name, None)
            if region is None:
                continue
            region.names.discard(name)
            if not region.names:
                freed.append(region)
        return self._unregister_regions(freed, between)

    # ------------------------------------------------------------------------------------------------ internals
    def _unregister_regions(self, regions: list[StagedRegion], between: Callable[[], None] | None = None) -> int:
        regions = [r for r in regions if self._regions.get(r.ptr) is r]
        if not regions:
            return 0
        self._sync()
        for i, region in enumerate(regions):
            if i and between is not None:
                between()
            del self._regions[region.ptr]  # out of the table first: never unregistered twice
            self._unregister_one(region)
        return len(regions)

    def _unregister_one(self, region: StagedRegion) -> None:
        try:
            self._unregister(region.ptr)
        except RuntimeError as exc:  # teardown must go on; the pages are unlocked at process exit at the latest
            clear_cuda_error()
            logger.warning("could not unregister staged warm-up region at %#x (%d bytes): %s", region.ptr,
                           region.nbytes, exc)
        region.storages.clear()  # only now may the memory be freed

    def _sync(self) -> None:
        if self._synchronize is not None:
            self._synchronize()
        elif self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def __repr__(self) -> str:
        return f"PinnedStaging(regions={len(self._regions)}, bytes={self.registered_bytes}, failed={self.failed})"
