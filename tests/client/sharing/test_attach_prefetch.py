"""A session follower opens the publication on a thread while its model factory runs (flextensor.sharing.attach_prefetch).

The creator is a real worker process holding its generation open for the whole module; each test's follower
runs in this process, so the test can see its threads and its memory mappings (``/proc/self/maps``): nothing the
thread opened may stay mapped after the test, and nothing may stay in /dev/shm once the creator is gone.
"""

from __future__ import annotations

import gc
import os
import tempfile
import threading
import time
import uuid

import pytest
import torch

import flextensor as ft
import flextensor.sharing.attach_prefetch as prefetch_mod
from flextensor.sharing.attach_prefetch import FollowerPrefetch
from flextensor.shm.blocks import SharedBlockAllocator, arena_layout
from flextensor.shm.names import manager_namespace
from tests.helpers.models import DEVICE, TinyTransformer, cpu_config, token_ids
from tests.client.sharing.test_session import LEASE, expected_output, finish, make_profile, matches, read_result
from tests.helpers.forkserver import spawn_module
from tests.leftovers import shm_names


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One saved profile per module (profiling is in-process and touches no shared memory)."""
    return make_profile(tmp_path_factory.mktemp("prefetch") / "profile")


@pytest.fixture(scope="module")
def _creator(profile: str, tmp_path_factory: pytest.TempPathFactory):
    """One creator process for the module: it published the model and holds it until the last test is done.
    Each test attaches and closes its own followers in this process; the generation outlives them. Its TMPDIR
    (hence lock directory) is the module's, and nothing of it may be left at the end."""
    tmpdir = tmp_path_factory.mktemp("prefetch-tmp")
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    args = ["--ns", namespace, "--profile", profile, "--lease", str(LEASE), "--hold"]
    proc = spawn_module("tests.helpers.session_worker", args, env={**os.environ, "TMPDIR": str(tmpdir)})
    try:
        assert read_result(proc)["role"] == "creator"
        yield namespace, tmpdir
    finally:
        assert finish(proc) == 0
        assert shm_names(manager_namespace(namespace, "model")) == []
        lock_dir = tmpdir / f"flextensor-{os.getuid()}"
        assert not lock_dir.is_dir() or not list(lock_dir.iterdir()), list(lock_dir.iterdir())


@pytest.fixture
def held_ns(_creator, monkeypatch: pytest.MonkeyPatch) -> str:
    """The namespace whose generation the module's creator holds; this test elects under the creator's lock
    directory (its TMPDIR)."""
    namespace, tmpdir = _creator
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return namespace


@pytest.fixture(params=["join on the thread", "join first"])
def join_path(request, monkeypatch) -> str:
    """Both follower paths: a READY generation is joined on the attach thread while the factory runs, or (as
    when the follower arrives before READY) the caller joins first and the thread only attaches."""
    if request.param == "join first":
        import flextensor.sharing.session as session_mod

        monkeypatch.setattr(session_mod, "peek_ready", lambda _namespace: False)
    return request.param


def _mapped(namespace: str) -> list[str]:
    """This process's mappings of the namespace's shared-memory segments."""
    ns = manager_namespace(namespace, "model")
    with open("/proc/self/maps") as maps:
        return [line.split()[-1] for line in maps if ns in line]


def _running(name: str) -> list[threading.Thread]:
    """Threads called ``name`` still running, after a moment for one that has only its last instructions left."""
    deadline = time.monotonic() + 2.0
    while (found := [t for t in threading.enumerate() if t.name == name]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def _meta_model() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


def _unused_creator_factory():
    raise AssertionError("the creator process publishes; this follower never creates")


def _offload_as_follower(session: ft.SharedOffloadSession, profile: str, factory) -> torch.nn.Module:
    """``session`` joins the module's generation as a follower whose model ``factory`` builds (CPU config)."""
    return session.offload_from_profile(profile, config=cpu_config(), name="model",
                                        creator_model_factory=_unused_creator_factory, follower_model_factory=factory)


def _follow_and_check(namespace: str, profile: str, factory) -> dict:
    """Attach as a follower with ``factory``, check the output, close; the session's report of the manager."""
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = _offload_as_follower(session, profile, factory)
        assert session.role("model") == "follower"
        with torch.no_grad():
            assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
        report = session.report()[0]
    del model  # on a CPU host its resident tensors are views of the store's mapping
    gc.collect()
    assert _mapped(namespace) == []
    return report


def test_blocks_are_opened_on_a_thread_while_the_factory_runs(held_ns: str, profile: str, monkeypatch):
    opened_during_factory = threading.Event()
    factory_running = threading.Event()
    threads: set[str] = set()
    original = SharedBlockAllocator.attach

    def open_arena(self, layout):
        threads.add(threading.current_thread().name)
        if factory_running.wait(timeout=30):  # run sequentially, the factory would only start after this
            opened_during_factory.set()
        return original(self, layout)

    monkeypatch.setattr(SharedBlockAllocator, "attach", open_arena)

    def factory():
        factory_running.set()
        # Opened sequentially, the arena could not be opened before this returns: the wait would run out.
        overlapped = opened_during_factory.wait(timeout=30)
        assert overlapped, "the host blocks were not opened while the model factory ran"
        return _meta_model()

    steps = _follow_and_check(held_ns, profile, factory)["steps"]
    assert {"factory", "prefetch_wait", "prefetch_store", "prefetch_blocks", "adopt"} <= set(steps)
    assert threads and all(name.startswith("ft-attach") for name in threads)


def test_the_follower_factory_runs_no_initialiser_on_meta(held_ns: str, profile: str, monkeypatch):
    """The follower's weights come from the publication, so its factory's initialisers on ``meta`` (which compute
    nothing) are passed over; the same model built outside the session calls them."""
    calls: list[str] = []
    original = torch.nn.init.kaiming_uniform_

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.device.type)
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", counted)
    _meta_model()
    assert calls and set(calls) == {"meta"}  # the control: built outside the session, they run
    calls.clear()
    during: list[int] = []

    def factory():
        model = _meta_model()
        during.append(len(calls))
        return model

    _follow_and_check(held_ns, profile, factory)
    assert during == [0]
    assert torch.nn.init.kaiming_uniform_ is counted


@pytest.mark.parametrize("fails", [False, True])
def test_the_copy_hears_the_factory_returned_before_the_session_waits_for_it(fails):
    """The attach thread's copy holds some workers back while the factory runs; it is told the factory returned
    (also when it raised) before the session waits for the thread, then the session takes over what it opened."""
    from flextensor.sharing.share import run_factory_while_attaching

    events: list[str] = []

    class Prefetch:  # the interface run_factory_while_attaching uses
        error = None

        def cancel(self):
            events.append("cancel")

        def factory_returned(self):
            events.append("factory returned")

        def join(self):
            events.append("join")

    def factory():
        events.append("factory")
        if fails:
            raise RuntimeError("config not found")
        return torch.nn.Linear(2, 2)

    if fails:
        with pytest.raises(RuntimeError, match="config not found"):
            run_factory_while_attaching(Prefetch(), factory, {}, lambda: events.append("take over"))
    else:
        run_factory_while_attaching(Prefetch(), factory, {}, lambda: events.append("take over"))
    assert events == ["factory", *(["cancel"] if fails else []), "factory returned", "join", "take over"]


def test_factory_failure_closes_what_the_thread_opened(held_ns: str, profile: str, join_path):
    def factory():
        raise RuntimeError("checkpoint config not found")

    session = ft.SharedOffloadSession(held_ns, lease_seconds=LEASE)
    with pytest.raises(RuntimeError, match="checkpoint config not found"):
        _offload_as_follower(session, profile, factory)
    assert _mapped(held_ns) == []
    assert session.report() == []
    session.close()


def test_thread_failure_is_raised_and_nothing_stays_mapped(held_ns: str, profile: str, monkeypatch,
                                                           join_path):
    def open_arena(self, layout):  # after the store was attached: the thread must hand the store over too
        raise OSError(24, "Too many open files")

    session = ft.SharedOffloadSession(held_ns, lease_seconds=LEASE)
    with monkeypatch.context() as patch, pytest.raises(OSError, match="Too many open files"):
        patch.setattr(SharedBlockAllocator, "attach", open_arena)
        _offload_as_follower(session, profile, _meta_model)
    assert _mapped(held_ns) == []
    session.close()
    # the generation is intact: the next follower attaches as if nothing happened
    with ft.SharedOffloadSession(held_ns, lease_seconds=LEASE) as again:
        model = _offload_as_follower(again, profile, _meta_model)
        with torch.no_grad():
            assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    del model
    gc.collect()
    assert _mapped(held_ns) == []


def test_interrupt_while_waiting_for_the_thread_still_hands_everything_over(held_ns: str, profile: str,
                                                                           monkeypatch, join_path):
    """A Ctrl-C (a real SIGINT) that lands while the session waits for the attach thread: the wait finishes, the
    session owns what the thread opened, and the interrupt reaches the caller."""
    import signal

    original_open, original_join = SharedBlockAllocator.attach, FollowerPrefetch.join
    joining = threading.Event()
    opened: list[float] = []

    def join(self):
        joining.set()
        return original_join(self)

    def slow_open_arena(self, layout):
        joining.wait(10)
        time.sleep(0.05)  # the session is inside the join, waiting for this thread
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.2)  # still opening while the interrupt is handled
        segments = original_open(self, layout)
        opened.append(time.monotonic())
        return segments

    session = ft.SharedOffloadSession(held_ns, lease_seconds=LEASE)
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(SharedBlockAllocator, "attach", slow_open_arena)
        patch.setattr(FollowerPrefetch, "join", join)
        _offload_as_follower(session, profile, _meta_model)
    raised = time.monotonic()
    assert opened and opened[0] < raised  # the interrupt went on only once the thread had opened everything
    assert not _running("ft-attach")
    assert _mapped(held_ns) == []
    session.close()


# ------------------------------------------------------------------------------------------ joining on the thread
def test_a_follower_of_a_ready_generation_joins_on_the_thread_while_its_factory_runs(held_ns: str, profile: str,
                                                                                   monkeypatch):
    """The election (the coordinator lock) overlaps the factory instead of preceding it."""
    import flextensor.sharing.session as session_mod

    factory_running, joined_during_factory = threading.Event(), threading.Event()
    threads: set[str] = set()
    real_coordinator = session_mod.ShmCoordinator

    def coordinator(*args, **kwargs):
        threads.add(threading.current_thread().name)
        if factory_running.wait(timeout=30):  # joined first, the factory would only start after this
            joined_during_factory.set()
        return real_coordinator(*args, **kwargs)

    monkeypatch.setattr(session_mod, "ShmCoordinator", coordinator)

    def factory():
        factory_running.set()
        assert joined_during_factory.wait(timeout=30), "the generation was not joined while the factory ran"
        return _meta_model()

    steps = _follow_and_check(held_ns, profile, factory)["steps"]
    assert {"sweep", "join", "daemon", "plan", "factory", "prefetch_blocks", "block_views", "adopt",
            "host_copy"} <= set(steps)
    assert threads == {"ft-attach"}


def test_a_join_that_makes_this_process_the_creator_drops_the_follower_model_and_publishes(namespace: str,
                                                                                        profile: str, monkeypatch):
    """The READY generation seen without the lock may be gone by the join: then this process creates the next
    one, with the creator's factory, and the model the follower factory built is dropped."""
    import flextensor.sharing.session as session_mod

    monkeypatch.setattr(session_mod, "peek_ready", lambda ns: True)  # as if a generation ended right after
    calls: list[str] = []

    def creator_factory():
        calls.append("creator")
        torch.manual_seed(0)
        return TinyTransformer()

    def follower_factory():
        calls.append("follower")
        return _meta_model()

    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             creator_model_factory=creator_factory,
                                             follower_model_factory=follower_factory)
        assert session.role("model") == "creator" and calls == ["follower", "creator"]
        with torch.no_grad():
            assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    del model
    gc.collect()
    assert _mapped(namespace) == [] and shm_names(manager_namespace(namespace, "model")) == []


def test_a_failure_after_the_join_on_the_thread_leaves_the_generation(held_ns: str, profile: str,
                                                                      monkeypatch):
    """The thread joined, then its next step failed (here the daemon registration): the session owns the
    coordinator from the join on, so the error reaches the caller and this process leaves the generation."""
    import flextensor.sharing.session as session_mod
    from flextensor.shm.leases import LeaseTable

    def refuse(*_args, **_kwargs):
        raise RuntimeError("ftd refused the participant (test)")

    monkeypatch.setattr(session_mod, "register_with_daemon", refuse)
    session = ft.SharedOffloadSession(held_ns, lease_seconds=LEASE)
    with pytest.raises(RuntimeError, match="refused the participant"):
        _offload_as_follower(session, profile, _meta_model)
    table = LeaseTable.open(manager_namespace(held_ns, "model"))
    try:
        assert table.live_count() == 1  # the creator alone: the follower's lease was given back
    finally:
        table.close()
    assert _mapped(held_ns) == []
    session.close()


def test_a_busy_coordinator_lock_leaves_the_join_to_the_callers_thread(held_ns: str, profile: str,
                                                                       monkeypatch):
    """The thread waits for the lock only briefly (its work stays bounded); then the caller joins, with the
    model already built: the factory still runs once."""
    import flextensor.sharing.session as session_mod
    from flextensor.shm.locks import FileLock
    from flextensor.shm.names import coordinator_lock_path

    monkeypatch.setattr(session_mod, "ELECT_LOCK_WAIT_S", 0.05)
    joined_on_main_thread: list[bool] = []  # one entry per coordinator joined (a join given up raises first)
    real_coordinator = session_mod.ShmCoordinator

    def coordinator(*args, **kwargs):
        joined = real_coordinator(*args, **kwargs)
        joined_on_main_thread.append(threading.current_thread() is threading.main_thread())
        return joined

    monkeypatch.setattr(session_mod, "ShmCoordinator", coordinator)
    assert prefetch_mod.ELECT_LOCK_WAIT_S == 2.0
    held = FileLock(coordinator_lock_path(manager_namespace(held_ns, "model")))
    held.acquire(timeout=5)
    release = threading.Timer(0.5, held.release)
    release.start()
    builds: list[int] = []

    def factory():
        builds.append(1)
        time.sleep(0.05)
        return _meta_model()

    try:
        with ft.SharedOffloadSession(held_ns, lease_seconds=LEASE) as session:
            model = _offload_as_follower(session, profile, factory)
            assert session.role("model") == "follower" and builds == [1]
            steps = session.report()[0]["steps"]
            assert joined_on_main_thread == [True]  # the thread gave up its join: this thread joined
            assert steps["join"] >= 0.2  # once the lock came free
            assert steps["factory"] >= 0.05  # the build beside the thread's attempt, not the reuse of its model
            with torch.no_grad():
                assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    finally:
        release.join()
        held.close()
    del model
    gc.collect()
    assert _mapped(held_ns) == []


# ------------------------------------------------------------------------------------------ one layout, disjoint steps
def test_a_follower_lays_out_the_arena_once(held_ns: str, profile: str, monkeypatch, join_path):
    """The thread computes the arena's layout to map it and hands it on: the blocks' views, the registration
    ranges and the shared bytes use that layout instead of computing it again from the plan's sizes."""
    import flextensor.sharing.follower as follower_mod
    import flextensor.sharing.session as session_mod
    import flextensor.shm.blocks as blocks_mod

    laid_out: list[int] = []  # the number of blocks of each layout computed in this (the follower's) process

    def counted(sizes, **kwargs):
        laid_out.append(len(sizes))
        return arena_layout(sizes, **kwargs)

    # wherever the follower's path could call it from
    for module in (blocks_mod, prefetch_mod, session_mod, follower_mod):
        monkeypatch.setattr(module, "arena_layout", counted, raising=False)
    _follow_and_check(held_ns, profile, _meta_model)
    assert len(laid_out) == 1 and laid_out[0] > 0


def test_the_steps_of_each_thread_add_up_to_at_most_its_time(held_ns: str, profile: str, monkeypatch,
                                                             join_path):
    """Sums of the reported steps do not count time twice: the attach thread's steps add up to at most the
    thread's run (on a CUDA device the arena and the device blocks, which open beside the copy, add up to at most
    it on their own), the caller's to at most the time to ready."""
    runs: list[float] = []
    original = FollowerPrefetch._run

    def timed_run(self):
        start = time.monotonic()
        try:
            original(self)
        finally:
            runs.append(time.monotonic() - start)

    monkeypatch.setattr(FollowerPrefetch, "_run", timed_run)
    report = _follow_and_check(held_ns, profile, _meta_model)
    steps = report["steps"]
    on_thread = {name for name in steps if name.startswith("prefetch_") and name != "prefetch_wait"}
    if join_path == "join on the thread":
        assert {"join", "daemon", "plan"} <= set(steps)
        on_thread |= {"join", "daemon", "plan"}
    else:  # joined first: the thread waits for READY and reads the plan while the factory runs
        assert {"wait", "plan"} <= set(steps)
        on_thread |= {"wait", "plan"}
    assert len(runs) == 1 and {"prefetch_store", "prefetch_blocks"} <= on_thread
    # On a CUDA device the arena and the device blocks open beside the resident copy, on a thread of their own.
    beside = {"prefetch_blocks", "prefetch_slots"} if "prefetch_resident" in steps else set()
    assert sum(steps[name] for name in on_thread - beside) <= runs[0], steps
    assert sum(steps[name] for name in beside) <= runs[0], steps
    assert sum(seconds for name, seconds in steps.items() if name not in on_thread) <= report["ready_s"], steps


# ------------------------------------------------------------------------------------------ arguments
def _elect():  # never called: the constructor refuses or accepts before any thread runs
    raise AssertionError("the thread was started")


@pytest.mark.parametrize("given", [("owner",), ("state",), ("owner", "state")])
def test_follower_prefetch_refuses_elect_beside_owner_or_state(given):
    """``elect`` takes the owner and the plan from the generation it joins: an owner or state passed beside it
    would be silently replaced, so the mix is refused, naming the arguments and what to pass."""
    kwargs = {name: object() for name in given}
    with pytest.raises(ValueError) as refused:
        FollowerPrefetch("ns", torch.device("cpu"), num_blocks=2, min_blocks=1, elect=_elect, **kwargs)
    message = str(refused.value)
    assert f"elect together with {' and '.join(given)}" in message
    assert "pass elect alone, or owner and state without elect" in message


@pytest.mark.parametrize("given", [(), ("owner",), ("state",)])
def test_follower_prefetch_without_elect_needs_owner_and_state(given):
    kwargs = {name: object() for name in given}
    missing = " and ".join(name for name in ("owner", "state") if name not in given)
    with pytest.raises(ValueError, match=f"got no {missing}: pass owner and state .* or elect alone"):
        FollowerPrefetch("ns", torch.device("cpu"), num_blocks=2, min_blocks=1, **kwargs)


def test_follower_prefetch_accepts_either_role_alone():
    for kwargs in ({"elect": _elect}, {"owner": object(), "state": object()}):
        prefetch = FollowerPrefetch("ns", torch.device("cpu"), num_blocks=2, min_blocks=1, **kwargs)
        assert prefetch.error is None and prefetch.state is kwargs.get("state")


@pytest.mark.cuda
def test_a_cuda_follower_hands_its_registered_blocks_to_the_release_thread_on_close(held_ns: str, profile: str,
                                                                                   monkeypatch):
    """close() leaves the generation at once; the release thread unregisters the follower's blocks and unmaps
    them afterwards (flextensor.shm.background_release); the resident tensors came through the pinned ring
    (staged here whatever their size: about 10 KiB in 1 KiB chunks), read from the store's file by several workers."""
    import flextensor.shm.background_release as release_mod
    from flextensor.runtime.pinned.bounce_copy import StagedCopy

    monkeypatch.setattr(prefetch_mod, "StagedCopy",
                        lambda **kwargs: StagedCopy(min_bytes=0, chunk_bytes=1024, threads=2, slots=4, **kwargs))
    config = ft.OffloadConfig(pinned_memory=True, num_blocks=2, min_blocks=2)
    session = ft.SharedOffloadSession(held_ns, lease_seconds=LEASE)
    model = session.offload_from_profile(profile, config=config, name="model",
                                         creator_model_factory=_unused_creator_factory,
                                         follower_model_factory=_meta_model)
    with torch.no_grad():
        assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    report = session.report()[0]
    assert report["registered"] is True and "prefetch_resident" in report["steps"]
    copied = report["resident_copy"]
    assert (copied["staged"], copied["source"], copied["threads"]) == (True, "file", 2) and copied["nbytes"] > 0
    session.close()
    assert release_mod.wait_released(timeout=60)
    del model
    gc.collect()
    assert _mapped(held_ns) == []


@pytest.mark.cuda
def test_a_cuda_follower_maps_the_arena_while_it_copies_the_resident_tensors(held_ns: str, profile: str,
                                                                            monkeypatch):
    """The copy needs neither the arena nor the loader's device blocks, so they open on a thread of their own
    (``ft-attach-blocks``) while it runs: each side below waits for the other to have started, which a
    sequential order could not satisfy."""
    from flextensor.runtime.pinned.bounce_copy import StagedCopy

    copying, arena_opened = threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    original_open, original_copy = SharedBlockAllocator.attach, StagedCopy.copy_pieces

    def open_arena(self, layout):
        seen["arena thread"] = threading.current_thread().name
        seen["copy had started"] = copying.wait(timeout=10)
        try:
            return original_open(self, layout)
        finally:
            arena_opened.set()

    def copy_pieces(self, pieces):
        copying.set()
        seen["arena opened meanwhile"] = arena_opened.wait(timeout=10)
        return original_copy(self, pieces)

    monkeypatch.setattr(SharedBlockAllocator, "attach", open_arena)
    monkeypatch.setattr(StagedCopy, "copy_pieces", copy_pieces)
    steps = _follow_and_check(held_ns, profile, _meta_model)["steps"]
    assert seen == {"arena thread": "ft-attach-blocks", "copy had started": True, "arena opened meanwhile": True}
    assert {"prefetch_blocks", "prefetch_slots", "prefetch_resident"} <= set(steps)
    assert not _running("ft-attach-blocks")


@pytest.mark.cuda
def test_a_failed_resident_copy_still_hands_over_the_arena_opened_beside_it(held_ns: str, profile: str,
                                                                           monkeypatch):
    """The copy fails while the arena opens beside it: the copy's error reaches the caller once that thread is
    done, and nothing either of them opened stays mapped."""
    from flextensor.runtime.pinned.bounce_copy import StagedCopy

    def failing_copy(self, pieces):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(StagedCopy, "copy_pieces", failing_copy)
    session = ft.SharedOffloadSession(held_ns, lease_seconds=LEASE)
    with pytest.raises(OSError, match="Input/output error"):
        _offload_as_follower(session, profile, _meta_model)
    assert not _running("ft-attach-blocks")
    assert _mapped(held_ns) == []
    session.close()
