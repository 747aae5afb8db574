"""Pinned staging of the warm-up weights (flextensor.runtime.pinned.in_place) and its lifecycle inside the engine.

On the CPU: region planning (distinct storages, views, overlaps, already-pinned, empty), the exactly-once
bookkeeping with a recording stand-in for cudart, the engine's lifecycle hooks (staged at offload, released after
DISCOVERY for tensors made resident, per block at the INFERENCE build, at release), and that the real policy stages
nothing without CUDA while outputs stay exactly equal. On the GPU (@pytest.mark.cuda): real registrations seen
through ``is_pinned()`` on views of the original storages, the pageable fallback on a registration failure, and
weights that were already pinned.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import flextensor as ft
from flextensor.engine.phase import Phase
from flextensor.runtime.pinned.in_place import PinnedStaging, plan_regions
from flextensor.runtime.loaders.warm_loader import WarmLoader
from tests.helpers.fake_cudart import FakeCudart, inject_staging
from tests.helpers.models import (
    ALL,
    DEVICE,
    cpu_config,
    mlp_stack,
    reference,
    same,
    snapshot,
    tiny_transformer,
    token_ids,
)


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------------- planning
def test_plan_regions_dedupes_views_merges_overlaps_and_skips():
    a = torch.randn(10)
    view = a[2:5]
    pinned = torch.randn(3)
    buf = bytearray(4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f1 = torch.frombuffer(buf, dtype=torch.uint8, count=1000, offset=0)
        f2 = torch.frombuffer(buf, dtype=torch.uint8, count=1000, offset=500)  # another storage, same bytes
    tensors = {"a": a, "view": view, "pinned": pinned, "f1": f1, "f2": f2, "empty": torch.empty(0),
               "meta": torch.empty(3, device="meta")}
    regions = plan_regions(tensors, is_pinned=lambda s: s.data_ptr() == _ptr(pinned))
    by_names = {frozenset(r.names): r for r in regions}
    assert set(by_names) == {frozenset({"a", "view"}), frozenset({"f1", "f2"})}
    ra, rf = by_names[frozenset({"a", "view"})], by_names[frozenset({"f1", "f2"})]
    assert (ra.ptr, ra.nbytes) == (_ptr(a), 40)  # the whole storage, exactly
    assert (rf.ptr, rf.nbytes) == (_ptr(f1), 1500)  # [0, 1000) and [500, 1500) merged
    assert [r.ptr for r in regions] == sorted(r.ptr for r in regions)


# ---------------------------------------------------------------------------------------------------- bookkeeping
def test_staging_release_by_name_then_all_exactly_once():
    fake = FakeCudart()
    staging = fake.staging()
    x, y = torch.randn(8), torch.randn(4)
    staged = staging.stage({"x": x, "x_view": x[1:3], "y": y}, torch.device("cpu"))
    assert staged == 32 + 16 and staging.active and not staging.failed
    assert sorted(p for _, p, _ in fake.registers) == sorted([_ptr(x), _ptr(y)])
    assert staging.release(["x"]) == 0  # "x_view" still uses the region
    assert staging.release(["x_view", "x_view", "unknown"]) == 1
    assert fake.calls[-2:] == [("sync",), ("unregister", _ptr(x))]  # synchronized before unregistering
    assert staging.regions == [(_ptr(y), 16)]
    assert staging.release_all() == 1 and staging.release_all() == 0
    assert staging.release(["y"]) == 0
    assert sorted(fake.unregisters) == sorted([_ptr(x), _ptr(y)]) and not fake.live
    assert not staging.active and staging.registered_bytes == 0
    assert staging.stage({"x": x}, torch.device("cpu")) == 32  # usable again after release_all
    with pytest.raises(RuntimeError, match="twice"):
        staging.stage({"y": y}, torch.device("cpu"))
    staging.release_all()
    assert not fake.live


def test_staging_release_calls_between_once_between_two_unregistrations():
    """A background release pauses between regions (the driver lock of each cudaHostUnregister), never before the
    first or after the last, and not at all when there is only one."""
    fake = FakeCudart()
    staging = fake.staging()
    a, b, c = torch.randn(8), torch.randn(8), torch.randn(8)
    staging.stage({"a": a, "b": b, "c": c}, torch.device("cpu"))

    def pause() -> None:
        fake.calls.append(("pause",))

    assert staging.release(["a", "b", "c"], between=pause) == 3
    kinds = [call[0] for call in fake.calls if call[0] != "register"]
    assert kinds == ["sync", "unregister", "pause", "unregister", "pause", "unregister"]
    assert not fake.live
    staging.stage({"a": a}, torch.device("cpu"))
    fake.calls.clear()
    assert staging.release(["a"], between=pause) == 1
    assert [call[0] for call in fake.calls] == ["sync", "unregister"]


def test_staging_registration_failure_undoes_and_warns_once(caplog):
    fake = FakeCudart(fail_register_at=2)
    staging = fake.staging()
    tensors = {f"t{i}": torch.randn(4) for i in range(3)}
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        assert staging.stage(tensors, torch.device("cpu")) == 0
    warnings_ = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 1 and "pageable" in warnings_[0].getMessage()
    assert staging.failed and not staging.active
    assert len(fake.registers) == 1 and fake.unregisters == [fake.registers[0][1]] and not fake.live
    assert staging.release_all() == 0 and len(fake.unregisters) == 1


def test_staging_registers_on_several_threads_and_undoes_them_all_on_a_failure(monkeypatch):
    """Enough bytes are registered on REGISTER_THREADS threads (each region once); a failure on one of them
    undoes every region the others registered, and nothing stays registered."""
    import flextensor.runtime.pinned.in_place as staging_mod

    monkeypatch.setattr(staging_mod, "PARALLEL_MIN_BYTES", 0)
    tensors = {f"t{i}": torch.randn(64) for i in range(16)}
    fake = FakeCudart()
    threads: set[str] = set()

    def register(ptr: int, nbytes: int) -> None:
        threads.add(threading.current_thread().name)
        time.sleep(0.002)  # long enough that the pool's threads take turns
        fake.register(ptr, nbytes)

    staging = PinnedStaging(register=register, unregister=fake.unregister, synchronize=fake.synchronize,
                            is_pinned=lambda s: False)
    assert staging.stage(tensors, torch.device("cpu")) == 16 * 256 and not staging.failed
    assert sorted(p for _, p, _ in fake.registers) == sorted(_ptr(t) for t in tensors.values())
    assert len(threads) > 1 and all(name.startswith("ft-stage") for name in threads)
    assert staging.release_all() == 16 and not fake.live

    failing = FakeCudart(fail_register_at=5)
    staging = PinnedStaging(register=failing.register, unregister=failing.unregister,
                            synchronize=failing.synchronize, is_pinned=lambda s: False)
    assert staging.stage(tensors, torch.device("cpu")) == 0
    assert staging.failed and not staging.active and not failing.live
    assert sorted(failing.unregisters) == sorted(p for _, p, _ in failing.registers)


def test_background_staging_registers_in_the_given_order_and_copies_wait_for_their_region():
    tensors = {name: torch.randn(16) for name in ("c", "a", "b", "d")}
    fake = FakeCudart()
    release_b = threading.Event()

    def register(ptr: int, nbytes: int) -> None:
        if ptr == _ptr(tensors["b"]):
            assert release_b.wait(10)
        fake.register(ptr, nbytes)

    staging = PinnedStaging(register=register, unregister=fake.unregister, synchronize=fake.synchronize,
                            is_pinned=lambda s: False)
    assert staging.stage_in_background(tensors, torch.device("cpu"), ["d", "b", "c", "a"]) == 4 * 64
    staging.wait_for(tensors["d"])  # registered first, so ready while "b" still blocks the thread
    assert [p for _, p, _ in fake.registers] == [_ptr(tensors["d"])] and staging.regions == [(_ptr(tensors["d"]), 64)]
    threading.Timer(0.1, release_b.set).start()
    staging.wait_for(tensors["b"])
    staging.wait_for(torch.randn(3))  # not staged: no wait
    staging.join()
    assert [p for _, p, _ in fake.registers] == [_ptr(tensors[n]) for n in ("d", "b", "c", "a")]
    assert not staging.failed and staging.registered_bytes == 4 * 64
    assert staging.release_all() == 4 and not fake.live


def test_background_staging_failure_keeps_what_it_registered_and_warns_once(caplog):
    tensors = {f"t{i}": torch.randn(8) for i in range(5)}
    order = sorted(tensors)
    fake = FakeCudart(fail_register_at=3)
    staging = fake.staging()
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        staging.stage_in_background(tensors, torch.device("cpu"), order)
        for tensor in tensors.values():
            staging.wait_for(tensor)  # none waits forever: the regions never tried are ready too
        staging.join()
    assert staging.failed
    assert [r.getMessage() for r in caplog.records if "pinned staging" in r.getMessage()] == [
        "pinned staging of the warm-up weights stopped after 64 of 160 bytes (cudaHostRegister failed: "
        "cudaErrorMemoryAllocation (2)); the rest is copied from pageable memory during DISCOVERY/PROFILING "
        "(slower). Raise RLIMIT_MEMLOCK (`ulimit -l unlimited`) or pass weights that are already pinned to avoid "
        "this"]
    assert staging.regions == [(_ptr(tensors["t0"]), 32), (_ptr(tensors["t1"]), 32)]
    assert staging.release(["t2", "t3", "t4"]) == 0  # never registered: nothing to undo
    assert staging.release_all() == 2 and not fake.live


def _in_time(call, timeout: float = 10.0) -> list:
    """Run ``call`` on a daemon thread and wait for it at most ``timeout`` s: a wait that never ends fails the test
    instead of hanging it. Returns ``[result]``, or ``[]`` when it did not return in time."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), name="test-waiter", daemon=True)
    thread.start()
    thread.join(timeout)
    return out


def _held_after_first(tensors: dict[str, torch.Tensor], first: str):
    """A staging whose registration of ``first`` blocks until told, and a turn taken (on a thread) while it is
    in flight: returns (staging, fake cudart, release_first, taken)."""
    fake = FakeCudart()
    first_in, release_first = threading.Event(), threading.Event()

    def register(ptr: int, nbytes: int) -> None:
        if ptr == _ptr(tensors[first]):
            first_in.set()
            assert release_first.wait(10)
        fake.register(ptr, nbytes)

    staging = PinnedStaging(register=register, unregister=fake.unregister, synchronize=fake.synchronize,
                            is_pinned=lambda s: False)
    staging.stage_in_background(tensors, torch.device("cpu"), sorted(tensors))
    assert first_in.wait(10)
    taken = threading.Event()
    threading.Thread(target=lambda: (staging.turns.take(), taken.set()), name="test-launch", daemon=True).start()
    return staging, fake, release_first, taken


def test_background_registrations_wait_while_a_copy_holds_the_turn_and_a_wait_gives_it_back():
    """A copy takes the launches' turn after the registration in flight; no registration starts until it is given
    back (the trap's exit), and waiting for a region not registered yet gives it back first, so the wait cannot
    hold up what it waits for."""
    tensors = {name: torch.randn(16) for name in ("a", "b", "c")}
    staging, fake, release_a, taken = _held_after_first(tensors, "a")
    try:
        assert not taken.wait(0.2)  # "a" is in flight: it ends first
        release_a.set()
        assert taken.wait(10)
        time.sleep(0.2)
        assert [p for _, p, _ in fake.registers] == [_ptr(tensors["a"])]  # "b" waits for the turn
        assert _in_time(lambda: staging.wait_for(tensors["c"])) == [True]  # gave the turn back: "b", "c" went on
        staging.join()
        assert [p for _, p, _ in fake.registers] == [_ptr(tensors[n]) for n in ("a", "b", "c")]
        assert staging.turns.closed and not staging.turns.held
        assert staging.release_all() == 3 and not fake.live
    finally:
        release_a.set()
        staging.turns.close()  # a failed assert above leaves no thread waiting for the turn


def test_joining_a_background_staging_with_the_turn_held_gives_it_back():
    tensors = {f"t{i}": torch.randn(8) for i in range(4)}
    staging, fake, release_first, taken = _held_after_first(tensors, "t0")
    try:
        release_first.set()
        assert taken.wait(10) and staging.turns.held  # the other registrations now wait for the turn
        assert _in_time(lambda: staging.join()) == [None]
        assert staging.registered_bytes == 4 * 32 and staging.turns.closed and not staging.turns.held
        assert staging.release_all() == 4 and not fake.live
    finally:
        release_first.set()
        staging.turns.close()


def test_release_all_while_registrations_wait_for_the_turn_registers_none_of_them():
    """Registrations waiting for the turn when release_all() cancels the staging look at the cancel again once
    they get the turn, and register nothing more."""
    tensors = {f"t{i}": torch.randn(8) for i in range(6)}
    staging, fake, release_first, taken = _held_after_first(tensors, "t0")
    try:
        release_first.set()
        assert taken.wait(10)
        time.sleep(0.1)  # the pool's threads reach the turn and wait there
        assert _in_time(staging.release_all) == [1]  # only the first was registered; it is undone
        assert len(fake.registers) == 1 and not fake.live and staging.regions == []
    finally:
        release_first.set()
        staging.turns.close()


def test_the_huge_page_hint_names_the_setting_only_where_it_helps(caplog, monkeypatch):
    """The hint names THP_MEM_ALLOC_ENABLE=1 where the kernel gives huge pages on request and the setting is
    not there; a background staging logs it once, at INFO."""
    from flextensor.runtime.pinned.in_place import huge_page_hint

    hint = huge_page_hint(3 << 30, env={}, thp_mode="madvise")
    assert hint is not None and "3.0 GiB" in hint and "THP_MEM_ALLOC_ENABLE=1" in hint
    assert huge_page_hint(3 << 30, env={"THP_MEM_ALLOC_ENABLE": "1"}, thp_mode="madvise") is None
    assert huge_page_hint(3 << 30, env={}, thp_mode="always") is None
    assert huge_page_hint(3 << 30, env={}, thp_mode="never") is None

    import flextensor.runtime.pinned.in_place as staging_mod

    monkeypatch.setattr(staging_mod, "huge_page_hint", lambda nbytes: f"hint for {nbytes} bytes")
    tensors = {f"t{i}": torch.randn(8) for i in range(3)}
    fake = FakeCudart()
    staging = fake.staging()
    with caplog.at_level(logging.INFO, logger="flextensor"):
        staging.stage_in_background(tensors, torch.device("cpu"), sorted(tensors))
        staging.join()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("hint")] == ["hint for 96 bytes"]
    assert staging.release_all() == 3 and not fake.live


def test_release_all_stops_a_background_staging_after_the_region_in_flight():
    tensors = {f"t{i}": torch.randn(8) for i in range(6)}
    fake = FakeCudart()
    first_in = threading.Event()

    def register(ptr: int, nbytes: int) -> None:
        fake.register(ptr, nbytes)
        first_in.set()
        deadline = time.monotonic() + 10
        while not staging.stopping:  # the first registration ends only once release_all() asked to stop
            assert time.monotonic() < deadline
            time.sleep(0.001)

    staging = PinnedStaging(register=register, unregister=fake.unregister, synchronize=fake.synchronize,
                            is_pinned=lambda s: False)
    staging.stage_in_background(tensors, torch.device("cpu"), sorted(tensors))
    assert first_in.wait(10)
    assert staging.release_all() == 1  # the one in flight, unregistered after the thread stopped
    assert len(fake.registers) == 1 and not fake.live and staging.regions == []


def test_staging_unregister_failure_is_not_retried(caplog):
    x, y = torch.randn(4), torch.randn(4)
    fake = FakeCudart(fail_unregister={_ptr(x)})
    staging = fake.staging()
    staging.stage({"x": x, "y": y}, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="flextensor"):
        assert staging.release_all() == 2
    assert "could not unregister" in caplog.text
    assert sorted(fake.unregisters) == sorted([_ptr(x), _ptr(y)])
    assert staging.release_all() == 0 and len(fake.unregisters) == 2


def test_default_policy_needs_cuda_and_pinned_memory():
    cfg = cpu_config()
    assert not PinnedStaging.default_policy(cfg, torch.device("cpu"))
    assert not PinnedStaging.default_policy(ft.OffloadConfig(enabled=False), torch.device("cpu"))
    assert not PinnedStaging.default_policy(cfg, torch.device("cuda", 0))  # pinned_memory=False
    assert PinnedStaging.default_policy(ft.OffloadConfig(enabled=False, pinned_memory=True), torch.device("cuda", 0))


# ----------------------------------------------------------------------------------------------- in the engine (CPU)
def _param_ptrs(model: nn.Module, prefix: str = "") -> dict[str, int]:
    return {n: _ptr(p) for n, p in model.named_parameters() if n.startswith(prefix)}


def test_engine_without_cuda_stages_nothing_and_is_exact():
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ft.offload(model, cpu_config(load_strategy=ALL, profiling_iters=2))
    om = ft.get_offload_manager()
    if DEVICE.type == "cpu":
        assert om.engine.warm.staging.regions == [] and not om.engine.warm.staging.failed and not om.engine.warm.loader.non_blocking
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            assert same(model(x), ref)
    assert om.phase is Phase.INFERENCE and om.engine.warm.staging.regions == []


@pytest.mark.parametrize("warmup", [None, "resident"])  # resident: copies kept across passes (flextensor.warmup)
def test_engine_staging_lifecycle_with_recorded_cudart(warmup, monkeypatch):
    """The manager's hooks: staged at offload, per block at the INFERENCE build, exactly once each."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ptrs = _param_ptrs(model)
    fake = FakeCudart()
    om = ft.get_offload_manager()
    inject_staging(monkeypatch, fake.staging(policy=lambda cfg, dev: True))
    om.set_engine_policy(warmup=warmup)
    ft.offload(model, cpu_config(load_strategy=ALL, profiling_iters=2))
    assert sorted(p for _, p, _ in fake.registers) == sorted(ptrs.values())
    assert om.engine.warm.loader.non_blocking
    with torch.no_grad():
        for _ in range(om.iters_before_inference - 1):
            assert same(model(x), ref)
        assert om.phase is Phase.PROFILING and len(fake.unregisters) == 0
        assert same(model(x), ref)  # the last PROFILING pass plans (resident: blocks built behind inference)
    assert om.phase is Phase.INFERENCE
    om.wait_for_host_blocks()
    om.engine.warm.staging.join()  # after a streamed warm-up the originals are released on a thread
    assert sorted(fake.unregisters) == sorted(ptrs.values()) and not fake.live
    first_sync = fake.calls.index(("sync",))
    assert all(c[0] != "unregister" for c in fake.calls[:first_sync])
    with torch.no_grad():
        assert same(model(x), ref)
    ft.release()
    assert len(fake.unregisters) == len(ptrs)  # nothing unregistered twice
    assert same(reference(model, x), ref)


def _offload_staging_on_a_thread(monkeypatch, model: nn.Module, warmup: str, register, fake: FakeCudart,
                                 after_copy) -> "ft.OffloadManager":
    """ft.offload() of ``model`` whose warm-up weights are registered on a thread by ``register`` (any size),
    undone through ``fake``; ``after_copy(host)`` is called after each warm-up copy. Returns the manager."""
    import flextensor.engine.warmup as warmup_mod

    monkeypatch.setattr(warmup_mod, "BACKGROUND_STAGING_BYTES", 0)
    real_copy = WarmLoader._copy

    def copy(loader, host):
        copied = real_copy(loader, host)
        after_copy(host)
        return copied

    monkeypatch.setattr(WarmLoader, "_copy", copy)
    om = ft.get_offload_manager()
    inject_staging(monkeypatch, PinnedStaging(register=register, unregister=fake.unregister,
                                              synchronize=fake.synchronize, is_pinned=lambda s: False,
                                              policy=lambda cfg, dev: True))
    om.set_engine_policy(warmup=warmup)
    ft.offload(model, cpu_config(load_strategy=ALL, profiling_iters=2))
    return om


@pytest.mark.parametrize("warmup", ["stream", "resident"])  # copies per trap call, or once before the first pass
def test_a_large_warm_up_is_staged_on_a_thread_while_offload_returns(warmup, monkeypatch):
    """From BACKGROUND_STAGING_BYTES on, offload() leaves the registration to a thread (in trap order) and
    returns; the first pass's copies wait for their own regions; outputs stay exact and every region is
    registered and unregistered once, from that thread."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ptrs = _param_ptrs(model)
    fake = FakeCudart()
    threads: set[str] = set()
    go_on = threading.Event()

    def register(ptr: int, nbytes: int) -> None:
        threads.add(threading.current_thread().name)
        assert go_on.wait(10)  # held until offload() returned
        time.sleep(0.005)  # slower than the pass's copies: without their waits, a copy would come first
        fake.register(ptr, nbytes)

    # Per copy from an original: its region was registered before it. (After a stream-mode warm-up, the copies
    # per call of the first inference pass may read a host block the build already filled instead.)
    originals = set(ptrs.values())
    copied_pinned: list[bool] = []
    om = _offload_staging_on_a_thread(
        monkeypatch, model, warmup, register, fake,
        lambda host: copied_pinned.append(_ptr(host) in fake.live) if _ptr(host) in originals else None)
    assert fake.registers == [] and om.engine.warm.loader.non_blocking
    go_on.set()
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            assert same(model(x), ref)
    assert threads == {"ft-stage"}
    assert sorted(p for _, p, _ in fake.registers) == sorted(ptrs.values())
    assert copied_pinned and all(copied_pinned)
    ft.release()
    assert sorted(fake.unregisters) == sorted(ptrs.values()) and not fake.live


@pytest.mark.parametrize("mode", ["stream", "resident"])
def test_the_first_pass_copies_and_computes_only_between_registrations(mode, monkeypatch):
    """While the registration runs on its thread, no warm-up copy is made (nor the trap's compute launched after
    it) while a registration call is in flight: the copies take the launches' turn, and a trap's exit gives it
    back. Outputs stay exact and every region is registered once."""
    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    fake = FakeCudart()
    lock = threading.Lock()
    in_flight = [0]

    def register(ptr: int, nbytes: int) -> None:
        with lock:
            in_flight[0] += 1
        time.sleep(0.003)  # long enough for a copy to come in between, were the two not taking turns
        fake.register(ptr, nbytes)
        with lock:
            in_flight[0] -= 1

    seen: list[int] = []  # per copy: registration calls in flight right after it
    om = _offload_staging_on_a_thread(monkeypatch, model, mode, register, fake,
                                      lambda host: seen.append(in_flight[0]))
    turns = om.engine.warm.staging.turns
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            assert same(model(x), ref)
            assert not turns.held  # given back at each trap's exit and after a preload
    assert seen and set(seen) == {0}
    assert len(fake.registers) == len({p for _, p, _ in fake.registers}) == len(_param_ptrs(model))
    ft.release()
    assert not fake.live


def test_a_first_pass_that_fails_in_a_trap_leaves_the_registration_going(monkeypatch):
    """The turn a trap's copies took is kept past the trap's exit for the next trap's launches; a pass that ends
    there (the model raised inside that trap: the first layer's matmul refuses a width of 5 after its copies)
    gives it back, so the registrations left finish without another pass or a join."""
    _the_registration_goes_on_after(monkeypatch, lambda model: model(torch.randn(3, 5, device=DEVICE)), RuntimeError)


def test_a_trap_called_outside_the_forward_gives_the_turn_back_at_its_exit(monkeypatch):
    """A trap called directly (no pass around it, as ``generate`` calls an encoder) keeps no turn past its exit:
    the registrations left finish without a pass."""
    _the_registration_goes_on_after(monkeypatch, lambda model: model[0](torch.randn(3, 16, device=DEVICE)))


def _the_registration_goes_on_after(monkeypatch, call, raises: type[BaseException] | None = None) -> None:
    """Offload with the registration on a thread and a launch slice far longer than any trap, ``call(model)``
    once the registration started (expecting ``raises``), then wait (bounded) for every region to be registered
    without another pass or a join."""
    import flextensor.runtime.pinned.launch_turns as launch_turns

    monkeypatch.setattr(launch_turns, "LAUNCH_SLICE_S", 60.0)  # a trap's exit alone never gives the turn back
    model = mlp_stack()
    fake = FakeCudart()
    started = threading.Event()

    def register(ptr: int, nbytes: int) -> None:
        started.set()
        time.sleep(0.003)
        fake.register(ptr, nbytes)

    om = _offload_staging_on_a_thread(monkeypatch, model, "stream", register, fake, lambda host: None)
    assert started.wait(10)
    with torch.no_grad(), (pytest.raises(raises) if raises else contextlib.nullcontext()):
        call(model)
    deadline = time.monotonic() + 10
    while len(fake.registers) < len(_param_ptrs(model)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.registers) == len(_param_ptrs(model)) and not om.engine.warm.staging.turns.held
    ft.release()
    assert not fake.live


class _KeepResident:
    """A plan that streams nothing: every weight stays on the device."""

    name = "keep_resident"

    def plan(self, inp):
        from flextensor.planning.plan_model import make_plan

        return make_plan(inp, self.name, {}, inp.num_blocks)


def test_a_plan_that_streams_nothing_unregisters_the_staging_off_the_callers_thread(monkeypatch):
    """After a resident warm-up, a plan that keeps everything resident still switches at once: the staged
    originals (the slow part: cudaHostUnregister of every offloadable weight) are unregistered by the
    background build, not inside the last PROFILING pass, and the outputs stay exact."""
    import threading

    model = mlp_stack()
    x = torch.randn(3, 16, device=DEVICE)
    ref = reference(model, x)
    ptrs = _param_ptrs(model)
    fake = FakeCudart()
    threads: list[str] = []
    unregister = fake.unregister

    def recorded_unregister(ptr: int) -> None:
        threads.append(threading.current_thread().name)
        unregister(ptr)

    om = ft.get_offload_manager()
    inject_staging(monkeypatch, PinnedStaging(register=fake.register, unregister=recorded_unregister,
                                synchronize=fake.synchronize, is_pinned=lambda s: False,
                                policy=lambda cfg, dev: True))
    om.set_engine_policy(warmup="resident")
    ft.offload(model, cpu_config(load_strategy=_KeepResident(), profiling_iters=2))
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            assert same(model(x), ref)
    assert om.phase is Phase.INFERENCE and om.engine.inference.deferred is not None and fake.unregisters == []
    with torch.no_grad():
        assert same(model(x), ref)  # the first inference pass starts the build
    om.wait_for_host_blocks()
    assert sorted(fake.unregisters) == sorted(ptrs.values()) and not fake.live
    assert set(threads) == {"ft-host-blocks"}
    assert om.offloaded_tensors == {} and om.loader is not None and om.loader.layouts == []
    with torch.no_grad():
        assert same(model(x), ref)
    ft.release()
    assert same(reference(model, x), ref)


@pytest.mark.parametrize("warmup", [None, "resident"])
def test_engine_staging_released_early_for_resident_tensors_and_at_release(warmup, monkeypatch):
    """Tensors made resident by DISCOVERY leave the staging then; an early release() unregisters the rest."""
    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    before = snapshot(model)
    blocks_list = _param_ptrs(model, "blocks.")  # "blocks" (ModuleList) is a trap but its tensors are used outside
    fake = FakeCudart()
    om = ft.get_offload_manager()
    inject_staging(monkeypatch, fake.staging(policy=lambda cfg, dev: True))
    om.set_engine_policy(warmup=warmup)
    ft.offload(model, cpu_config(load_strategy=ALL, profiling_iters=3))
    registered = {p for _, p, _ in fake.registers}
    assert set(blocks_list.values()) <= registered
    assert _ptr(model.embed.weight) not in registered  # tied: used by two traps, resident from the start
    with torch.no_grad():
        assert same(model(ids), ref)  # the DISCOVERY pass
    assert om.phase is Phase.PROFILING
    assert set(fake.unregisters) == set(blocks_list.values())
    with torch.no_grad():
        assert same(model(ids), ref)
    ft.release()
    assert sorted(fake.unregisters) == sorted(registered) and not fake.live
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------------- CUDA
def _cuda_model_and_ref(dtype=torch.bfloat16):
    model = tiny_transformer().to(dtype)
    ids = token_ids().cuda()
    with torch.no_grad():
        ref = model.cuda()(ids).float()
    model.cpu()
    return model, ids, ref


def _cuda_cfg(**kwargs) -> ft.OffloadConfig:
    kwargs.setdefault("include_patterns", ["class:DecoderBlock"])
    kwargs.setdefault("profiling_iters", 2)
    return ft.OffloadConfig(pinned_memory=True, load_strategy=ALL, num_blocks=2, min_blocks=2, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["torch", "host_register"])
def test_cuda_staged_during_warmup_unregistered_at_inference(mode):
    model, ids, ref = _cuda_model_and_ref()
    host = {n: p.data for n, p in model.named_parameters() if n.startswith("blocks.")}  # views of the originals
    ft.offload(model, _cuda_cfg(pinned_memory_mode=mode))
    om = ft.get_offload_manager()
    assert om.engine.warm.staging.active and om.engine.warm.loader.non_blocking
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in host.values()}
    assert om.engine.warm.staging.registered_bytes == sum(storages.values())  # exact bytes of each distinct storage
    with torch.no_grad():
        while om.phase is not Phase.INFERENCE:
            assert all(t.is_pinned() for t in host.values()), "staged storages must stay pinned during warm-up"
            torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
        om.wait_for_host_blocks()
        assert om.engine.warm.staging.regions == []
        assert not any(t.is_pinned() for t in host.values()), "staging must be unregistered once INFERENCE runs"
        assert all(b.tensor.is_pinned() for b in om.engine.inference.host_blocks)
        for _ in range(2):
            torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
    ft.release()
    assert not any(t.is_pinned() for t in host.values())
    with torch.no_grad():
        torch.testing.assert_close(model.cuda()(ids).float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_release_during_warmup_unregisters_and_keeps_weights():
    model, ids, ref = _cuda_model_and_ref()
    before = snapshot(model)
    host = {n: p.data for n, p in model.named_parameters() if n.startswith("blocks.")}
    ft.offload(model, _cuda_cfg(profiling_iters=3))
    om = ft.get_offload_manager()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
    assert om.phase is not Phase.INFERENCE and all(t.is_pinned() for t in host.values())
    ft.release()
    assert not any(t.is_pinned() for t in host.values())
    after = snapshot(model)
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], before[k]) for k in before)


@pytest.mark.cuda
def test_cuda_already_pinned_weights_are_not_registered_or_unregistered():
    model, ids, ref = _cuda_model_and_ref()
    for name, p in model.named_parameters():
        if name.startswith("blocks."):
            p.data = p.data.pin_memory()
    host = {n: p.data for n, p in model.named_parameters() if n.startswith("blocks.")}
    ft.offload(model, _cuda_cfg())
    om = ft.get_offload_manager()
    assert om.engine.warm.staging.regions == [] and not om.engine.warm.staging.failed and om.engine.warm.loader.non_blocking
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
    assert all(t.is_pinned() for t in host.values())  # torch's pinned memory: never ours to unregister


@pytest.mark.cuda
def test_cuda_background_staging_pins_every_weight_and_outputs_match(monkeypatch):
    """The warm-up staged on a thread (as for a large model): every host weight ends up pinned, the passes are
    exact, and release() unpins them all."""
    import flextensor.engine.warmup as warmup_mod

    monkeypatch.setattr(warmup_mod, "BACKGROUND_STAGING_BYTES", 0)
    model, ids, ref = _cuda_model_and_ref()
    host = {n: p.data for n, p in model.named_parameters() if n.startswith("blocks.")}
    ft.offload(model, _cuda_cfg(profiling_iters=3))
    om = ft.get_offload_manager()
    staging = om.engine.warm.staging
    with torch.no_grad():
        torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
    staging.join()
    assert not staging.failed and all(t.is_pinned() for t in host.values())
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 1):
            torch.testing.assert_close(model(ids).float(), ref, atol=2e-2, rtol=2e-2)
    assert om.phase is Phase.INFERENCE
    ft.release()
    assert not any(t.is_pinned() for t in host.values())


@pytest.mark.cuda
def test_cuda_read_only_mapping_is_staged(tmp_path):
    """Staging registers read-only (the device only reads staged memory), so weights in a read-only file
    mapping, which cannot be registered for writing, are staged too and the warm-up copies them asynchronously."""
    model, ids, ref = _cuda_model_and_ref(torch.float32)
    weight = model.blocks[0].down.weight
    path = tmp_path / "w.bin"
    path.write_bytes(weight.detach().numpy().tobytes())
    with open(path, "rb") as fh:
        mapped = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the given buffer is not writable"
        readonly = torch.frombuffer(mapped, dtype=torch.float32).view(weight.shape)
    weight.data = readonly
    ft.offload(model, _cuda_cfg())
    om = ft.get_offload_manager()
    staging = om.engine.warm.staging
    assert not staging.failed and om.engine.warm.loader.non_blocking
    assert (readonly.data_ptr(), readonly.untyped_storage().nbytes()) in staging.regions
    with torch.no_grad():
        for _ in range(om.iters_before_inference + 2):
            torch.testing.assert_close(model(ids).float(), ref, atol=1e-4, rtol=1e-4)
    assert om.phase is Phase.INFERENCE
    ft.release()
    assert not readonly.is_pinned()
    del weight, readonly


@pytest.mark.cuda
def test_cuda_registration_failure_falls_back_to_pageable(caplog, monkeypatch):
    """A storage of which another part of the process already registered a range cannot be registered again
    (the driver refuses a byte twice): staging undoes what it registered and the warm-up copies from pageable
    memory, with one warning and no CUDA error left for a later kernel to raise."""
    from flextensor.shm.pinning import host_register, host_unregister

    import flextensor.runtime.pinned.in_place as staging_mod

    model, ids, ref = _cuda_model_and_ref(torch.float32)
    host = [p.data for n, p in model.named_parameters() if n.startswith("blocks.")]
    # The staged weight highest in memory fails: regions are tried in address order (one thread below), so the
    # ones before it are registered first and must be undone.
    target = max((t for t in host if t.untyped_storage().nbytes() >= 3 * 4096), key=lambda t: t.data_ptr())
    inside = target.data_ptr() + target.untyped_storage().nbytes() // 2 // 4096 * 4096
    host_register(inside, 4096)  # someone else's registration in the middle: torch still sees it unpinned
    registered: list[int] = []
    real_register = staging_mod._default_register

    def counted(ptr: int, nbytes: int) -> None:
        real_register(ptr, nbytes)
        registered.append(ptr)

    monkeypatch.setattr(staging_mod, "_default_register", counted)
    monkeypatch.setattr(staging_mod, "PARALLEL_MIN_BYTES", 1 << 62)
    try:
        with caplog.at_level(logging.WARNING, logger="flextensor"):
            ft.offload(model, _cuda_cfg())
        om = ft.get_offload_manager()
        staging = om.engine.warm.staging
        assert staging.failed and staging.regions == [] and not om.engine.warm.loader.non_blocking
        assert registered  # regions before the failing one were registered ...
        assert not any(t.is_pinned() for t in host)  # ... and undone
        assert len([r for r in caplog.records if "pinned staging" in r.getMessage()]) == 1
        with torch.no_grad():
            for _ in range(om.iters_before_inference + 2):  # and no stale CUDA error surfaces in later kernels
                torch.testing.assert_close(model(ids).float(), ref, atol=1e-4, rtol=1e-4)
        assert om.phase is Phase.INFERENCE
        ft.release()
    finally:
        host_unregister(inside)
