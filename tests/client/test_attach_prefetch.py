"""A session follower opens the publication on a thread while its model factory runs (flextensor.attach_prefetch).

The creator is a real worker process holding its generation open; the follower runs in this process, so the
test can see its threads and its memory mappings (``/proc/self/maps``): nothing the thread opened may stay
mapped after a failure, and nothing may stay in /dev/shm once the creator is gone.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.shm.blocks import SharedBlockAllocator
from flextensor.shm.names import manager_namespace
from tests.client.models import DEVICE, TinyTransformer, cpu_config, release_managers, token_ids  # noqa: F401
from tests.client.test_session import LEASE, expected_output, finish, make_profile, matches, read_result, spawn
from tests.leftovers import shm_names


@pytest.fixture
def profile(tmp_path: Path) -> str:
    return make_profile(tmp_path / "profile")


@pytest.fixture
def creator(namespace: str, profile: str):
    """A creator process that published the model and holds it until the test ends."""
    proc = spawn(namespace, profile, "--hold")
    assert read_result(proc)["role"] == "creator"
    yield proc
    assert finish(proc) == 0
    assert shm_names(manager_namespace(namespace, "model")) == []


@pytest.fixture(params=["join on the thread", "join first"])
def join_path(request, monkeypatch) -> str:
    """Both follower paths: a READY generation is joined on the attach thread while the factory runs, or (as
    when the follower arrives before READY) the caller joins first and the thread only attaches."""
    if request.param == "join first":
        import flextensor.session as session_mod

        monkeypatch.setattr(session_mod, "peek_ready", lambda _namespace: False)
    return request.param


def _mapped(namespace: str) -> list[str]:
    """This process's mappings of the namespace's shared-memory segments."""
    ns = manager_namespace(namespace, "model")
    with open("/proc/self/maps") as maps:
        return [line.split()[-1] for line in maps if ns in line]


def _meta_model() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


def _unused_creator_factory():
    raise AssertionError("the creator process publishes; this follower never creates")


def _follow_and_check(namespace: str, profile: str, factory) -> dict[str, float]:
    """Attach as a follower with ``factory``, check the output, close; the session's step times."""
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             creator_model_factory=_unused_creator_factory,
                                             follower_model_factory=factory)
        assert session.role("model") == "follower"
        with torch.no_grad():
            assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
        steps = session.report()[0]["steps"]
    del model  # on a CPU host its resident tensors are views of the store's mapping
    gc.collect()
    assert _mapped(namespace) == []
    return steps


def test_blocks_are_opened_on_a_thread_while_the_factory_runs(namespace: str, profile: str, creator, monkeypatch):
    opened_during_factory = threading.Event()
    factory_running = threading.Event()
    threads: set[str] = set()
    original = SharedBlockAllocator.attach

    def attach(self, sizes):
        threads.add(threading.current_thread().name)
        if factory_running.wait(timeout=30):  # run sequentially, the factory would only start after this
            opened_during_factory.set()
        return original(self, sizes)

    monkeypatch.setattr(SharedBlockAllocator, "attach", attach)

    def factory():
        factory_running.set()
        # Opened sequentially, the arena could not be opened before this returns: the wait would run out.
        overlapped = opened_during_factory.wait(timeout=30)
        assert overlapped, "the host blocks were not opened while the model factory ran"
        return _meta_model()

    steps = _follow_and_check(namespace, profile, factory)
    assert {"factory", "prefetch_wait", "prefetch_store", "prefetch_blocks", "adopt"} <= set(steps)
    assert threads and all(name.startswith("ft-attach") for name in threads)


def test_factory_failure_closes_what_the_thread_opened(namespace: str, profile: str, creator, join_path):
    def factory():
        raise RuntimeError("checkpoint config not found")

    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(RuntimeError, match="checkpoint config not found"):
        session.offload_from_profile(profile, config=cpu_config(), name="model",
                                     creator_model_factory=_unused_creator_factory, follower_model_factory=factory)
    assert _mapped(namespace) == []
    assert session.report() == []
    session.close()


def test_thread_failure_is_raised_and_nothing_stays_mapped(namespace: str, profile: str, creator, monkeypatch,
                                                           join_path):
    def attach(self, sizes):  # after the store was attached: the thread must hand the store over too
        raise OSError(24, "Too many open files")

    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with monkeypatch.context() as patch, pytest.raises(OSError, match="Too many open files"):
        patch.setattr(SharedBlockAllocator, "attach", attach)
        session.offload_from_profile(profile, config=cpu_config(), name="model",
                                     creator_model_factory=_unused_creator_factory,
                                     follower_model_factory=_meta_model)
    assert _mapped(namespace) == []
    session.close()
    # the generation is intact: the next follower attaches as if nothing happened
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as again:
        model = again.offload_from_profile(profile, config=cpu_config(), name="model",
                                           creator_model_factory=_unused_creator_factory,
                                           follower_model_factory=_meta_model)
        with torch.no_grad():
            assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    del model
    gc.collect()
    assert _mapped(namespace) == []


def test_interrupt_while_waiting_for_the_thread_still_hands_everything_over(namespace: str, profile: str, creator,
                                                                           monkeypatch, join_path):
    """A Ctrl-C that lands while the session waits for the attach thread: the wait finishes, the session owns
    what the thread opened, and the interrupt reaches the caller."""
    import flextensor.attach_prefetch as prefetch_mod

    original_attach = SharedBlockAllocator.attach

    def slow_attach(self, sizes):
        time.sleep(0.2)  # the thread is still opening when the session starts waiting
        return original_attach(self, sizes)

    class InterruptedOnce(threading.Thread):
        interrupted = False

        def join(self, timeout=None):
            if self.name == "ft-attach" and not InterruptedOnce.interrupted:
                InterruptedOnce.interrupted = True
                raise KeyboardInterrupt
            return super().join(timeout)

    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(SharedBlockAllocator, "attach", slow_attach)
        patch.setattr(prefetch_mod.threading, "Thread", InterruptedOnce)
        session.offload_from_profile(profile, config=cpu_config(), name="model",
                                     creator_model_factory=_unused_creator_factory,
                                     follower_model_factory=_meta_model)
    assert InterruptedOnce.interrupted
    assert _mapped(namespace) == []
    session.close()


# ------------------------------------------------------------------------------------------ joining on the thread
def test_a_follower_of_a_ready_generation_joins_on_the_thread_while_its_factory_runs(namespace: str, profile: str,
                                                                                   creator, monkeypatch):
    """The election (the coordinator lock) overlaps the factory instead of preceding it."""
    import flextensor.session as session_mod

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

    steps = _follow_and_check(namespace, profile, factory)
    assert {"join", "plan", "factory", "prefetch_elect", "prefetch_blocks", "adopt"} <= set(steps)
    assert threads == {"ft-attach"}


def test_a_join_that_makes_this_process_the_creator_drops_the_follower_model_and_publishes(namespace: str,
                                                                                        profile: str, monkeypatch):
    """The READY generation seen without the lock may be gone by the join: then this process creates the next
    one, with the creator's factory, and the model the follower factory built is dropped."""
    import flextensor.session as session_mod

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


def test_a_failure_after_the_join_on_the_thread_leaves_the_generation(namespace: str, profile: str, creator,
                                                                      monkeypatch):
    """The thread joined, then its next step failed (here the daemon registration): the session owns the
    coordinator from the join on, so the error reaches the caller and this process leaves the generation."""
    import flextensor.session as session_mod
    from flextensor.shm.leases import LeaseTable

    def refuse(*_args, **_kwargs):
        raise RuntimeError("ftd refused the participant (test)")

    monkeypatch.setattr(session_mod, "_register_with_daemon", refuse)
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(RuntimeError, match="refused the participant"):
        session.offload_from_profile(profile, config=cpu_config(), name="model",
                                     creator_model_factory=_unused_creator_factory,
                                     follower_model_factory=_meta_model)
    table = LeaseTable.open(manager_namespace(namespace, "model"))
    try:
        assert table.live_count() == 1  # the creator alone: the follower's lease was given back
    finally:
        table.close()
    assert _mapped(namespace) == []
    session.close()


def test_a_busy_coordinator_lock_leaves_the_join_to_the_callers_thread(namespace: str, profile: str, creator,
                                                                       monkeypatch):
    """The thread waits for the lock only briefly (its work stays bounded); then the caller joins, with the
    model already built: the factory still runs once."""
    import flextensor.attach_prefetch as prefetch_mod
    import flextensor.session as session_mod
    from flextensor.shm.locks import FileLock
    from flextensor.shm.names import coordinator_lock_path

    monkeypatch.setattr(session_mod, "ELECT_LOCK_WAIT_S", 0.05)
    assert prefetch_mod.ELECT_LOCK_WAIT_S == 2.0
    held = FileLock(coordinator_lock_path(manager_namespace(namespace, "model")))
    held.acquire(timeout=5)
    release = threading.Timer(0.5, held.release)
    release.start()
    builds: list[int] = []

    def factory():
        builds.append(1)
        time.sleep(0.05)
        return _meta_model()

    try:
        with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
            model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                                 creator_model_factory=_unused_creator_factory,
                                                 follower_model_factory=factory)
            assert session.role("model") == "follower" and builds == [1]
            steps = session.report()[0]["steps"]
            assert "prefetch_elect" not in steps  # the thread gave up its join: this thread joined
            assert steps["join"] >= 0.2  # once the lock came free
            assert steps["factory"] >= 0.05  # the build beside the thread's attempt, not _attach's reuse of it
            with torch.no_grad():
                assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    finally:
        release.join()
        held.close()
    del model
    gc.collect()
    assert _mapped(namespace) == []
