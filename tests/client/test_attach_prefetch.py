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

    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             creator_model_factory=_unused_creator_factory,
                                             follower_model_factory=factory)
        assert session.role("model") == "follower"
        with torch.no_grad():
            assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
        steps = session.report()[0]["steps"]
        assert {"factory", "prefetch_wait", "prefetch_store", "prefetch_blocks", "adopt"} <= set(steps)
    assert threads and all(name.startswith("ft-attach") for name in threads)
    del model  # on a CPU host its resident tensors are views of the store's mapping
    gc.collect()
    assert _mapped(namespace) == []


def test_factory_failure_closes_what_the_thread_opened(namespace: str, profile: str, creator):
    def factory():
        raise RuntimeError("checkpoint config not found")

    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(RuntimeError, match="checkpoint config not found"):
        session.offload_from_profile(profile, config=cpu_config(), name="model",
                                     creator_model_factory=_unused_creator_factory, follower_model_factory=factory)
    assert _mapped(namespace) == []
    assert session.report() == []
    session.close()


def test_thread_failure_is_raised_and_nothing_stays_mapped(namespace: str, profile: str, creator, monkeypatch):
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
                                                                           monkeypatch):
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
