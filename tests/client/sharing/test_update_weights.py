"""sleep / wake of a session worker and SharedOffloadSession.update_weights, in one process on the CPU.

The multi-process case (a trainer and two workers) is examples/colocated_rl.py, run by tests/examples.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import flextensor as ft
from flextensor.engine.policy import EnginePolicy, set_default_engine_policy
from flextensor.shm.names import manager_namespace
from tests.client.sharing.test_session import make_profile
from tests.helpers.models import DEVICE, cpu_config, reference, tiny_transformer, token_ids
from tests.leftovers import shm_names

LEASE = 2.0


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_profile(tmp_path_factory.mktemp("update") / "profile")


@pytest.fixture(params=["in place", "streamed"])
def policy(request: pytest.FixtureRequest):
    """A CPU computes from the shared blocks in place; "streamed" makes it stream through the loader as a GPU."""
    previous = set_default_engine_policy(EnginePolicy(stream_on_cpu=request.param == "streamed"))
    yield request.param
    set_default_engine_policy(previous)


def _new_weights(seed: int) -> dict[str, torch.Tensor]:
    return tiny_transformer(seed=seed).state_dict()


def _expected(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    plain = tiny_transformer(seed=0)
    plain.load_state_dict(weights)
    return reference(plain, token_ids())


def _serve(session: ft.SharedOffloadSession, profile: str):
    return session.offload_from_profile(profile, config=cpu_config(), name="default",
                                        creator_model_factory=lambda: tiny_transformer(seed=0),
                                        follower_model_factory=lambda: tiny_transformer(seed=0))


def _out(model) -> torch.Tensor:
    with torch.no_grad():
        return model(token_ids().to(DEVICE))


def test_new_weights_reach_the_model_after_a_wake_and_the_version_is_published(namespace: str, profile: str,
                                                                               policy: str):
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = _serve(session, profile)
        assert torch.equal(_out(model), _expected(tiny_transformer(seed=0).state_dict()))
        assert session.weights_version() == 0
        for version, seed in ((1, 1), (5, 2)):
            ft.sleep()
            weights = _new_weights(seed)
            report = session.update_weights(weights, version=None if version == 1 else version)
            assert (report.version, report.complete) == (version, True)  # complete: every state_dict tensor
            distinct = {t.data_ptr(): t for t in weights.values()}.values()  # the tied pair is written once
            assert (report.tensors, report.nbytes) == (len(distinct), sum(t.numel() * t.element_size()
                                                                          for t in distinct))
            assert session.weights_version() == (0 if version == 1 else 1)  # what the model holds: until it wakes
            ft.wake()
            assert session.weights_version() == version
            assert torch.equal(_out(model), _expected(weights))


def test_an_update_is_refused_while_awake_and_checked_before_any_byte_is_written(namespace: str, profile: str):
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = _serve(session, profile)
        before = _out(model)
        weights = _new_weights(1)
        with pytest.raises(ft.WorkersAwakeError, match=r"ft.sleep\(name\)") as refused:
            session.update_weights(weights)
        assert refused.value.pids == (__import__("os").getpid(),)
        ft.sleep()
        name = next(iter(weights))
        for bad, error, match in [
            ({**weights, "no.such.tensor": torch.zeros(1)}, KeyError, "no.such.tensor"),
            ({**weights, name: weights[name].double()}, ValueError, "float64 in the new weights"),
            ({**weights, name: weights[name].flatten()}, ValueError, "has shape"),
            (42, TypeError, "state dict"),
        ]:
            with pytest.raises(error, match=match):
                session.update_weights(bad)
        ft.wake()
        assert session.weights_version() == 0
        assert torch.equal(_out(model), before)  # nothing was written


def test_sources_a_subset_an_iterator_and_a_safetensors_file(namespace: str, profile: str, tmp_path: Path):
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = _serve(session, profile)
        ft.sleep()
        new = _new_weights(3)
        file = tmp_path / "model.safetensors"
        save_file({k: v.contiguous() for k, v in new.items() if k != "head.weight"}, str(file))  # the tie's other name
        report = session.update_weights(str(file))
        assert report.complete and report.version == 1
        ft.wake()
        assert torch.equal(_out(model), _expected(new))
        ft.sleep()
        subset = {k: v for k, v in _new_weights(4).items() if k.startswith("blocks.0.")}
        report = session.update_weights(iter(subset.items()))
        assert not report.complete and report.tensors == len(subset)
        ft.wake()
        assert torch.equal(_out(model), _expected({**new, **subset}))


def test_close_of_a_sleeping_session_worker_leaves_nothing(namespace: str, profile: str):
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    _serve(session, profile)
    ft.sleep()
    session.close()
    assert shm_names(manager_namespace(namespace, "default")) == []


@pytest.mark.cuda
def test_on_cuda_new_weights_from_the_device_reach_the_woken_model(namespace: str, tmp_path: Path):
    cuda_profile = make_profile(tmp_path / "profile")
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(cuda_profile, config=cpu_config(pinned_memory=True), name="default",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=lambda: tiny_transformer(seed=0))
        _out(model)  # a pass: the background registration of the blocks has begun
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        ft.sleep()
        assert torch.cuda.memory_allocated() < held
        trainer = tiny_transformer(seed=5).to(DEVICE)  # the new weights live on the device, as a trainer's do
        report = session.update_weights(trainer.state_dict())
        assert report.complete
        ft.wake()
        expected = reference(tiny_transformer(seed=5), token_ids())
        assert torch.allclose(_out(model).float(), expected.float(), atol=1e-4, rtol=1e-4)


def test_wake_ready_is_false_awake_and_without_pinning(namespace: str, profile: str):
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = _serve(session, profile)
        manager = ft.get_offload_manager()
        assert manager.wake_ready() is False  # awake
        before = _out(model)
        ft.sleep()
        assert manager.wake_ready(timeout=1.0) is False  # pinning off in this configuration (and no CUDA here)
        ft.wake()
        assert manager.wake_ready() is False
        assert torch.equal(_out(model), before)


@pytest.mark.cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_on_cuda_a_sleeping_worker_registers_the_shared_copy_and_wakes_from_it(namespace: str, tmp_path: Path,
                                                                               pinned: bool):
    cuda_profile = make_profile(tmp_path / "profile")
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(cuda_profile, config=cpu_config(pinned_memory=pinned), name="default",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=lambda: tiny_transformer(seed=0))
        manager = ft.get_offload_manager()
        before = _out(model)
        for _cycle in range(2):  # the second sleep finds the copy registered already
            ft.sleep()
            assert manager.wake_ready(timeout=60.0) is pinned
            ft.wake()
            assert torch.equal(_out(model), before)
        ft.sleep()
        report = session.update_weights(_new_weights(5))  # written into the registered copy in place
        assert report.complete
        ft.wake()
        expected = _expected(_new_weights(5)).to(DEVICE)
        assert torch.allclose(_out(model).float(), expected.float(), atol=1e-4, rtol=1e-4)
    assert shm_names(manager_namespace(namespace, "default")) == []


@pytest.mark.cuda
def test_on_cuda_a_wake_before_the_registration_ends_copies_staged_and_the_next_sleep_finishes_it(
        namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import flextensor.shm.segment as segment_mod
    import flextensor.shm.store_layout as store_layout_mod

    monkeypatch.setattr(store_layout_mod, "STORE_PART_MIN_BYTES", 4096)  # a store of several segments
    real_register = segment_mod.host_register

    def slow_register(ptr: int, nbytes: int, read_only: bool = False) -> None:
        time.sleep(0.3)
        real_register(ptr, nbytes, read_only=read_only)

    monkeypatch.setattr(segment_mod, "host_register", slow_register)
    cuda_profile = make_profile(tmp_path / "profile")
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(cuda_profile, config=cpu_config(pinned_memory=True), name="default",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=lambda: tiny_transformer(seed=0))
        manager = ft.get_offload_manager()
        before = _out(model)
        ft.sleep()
        assert manager.wake_ready() is False  # the registration has just begun
        ft.wake()  # stops it after the segment in flight and copies through the staged ring
        assert torch.equal(_out(model), before)
        ft.sleep()  # goes on with the segments not registered yet
        assert manager.wake_ready(timeout=60.0) is True
        ft.wake()
        assert torch.equal(_out(model), before)
    assert shm_names(manager_namespace(namespace, "default")) == []


@pytest.mark.cuda
def test_on_cuda_a_refused_registration_warns_once_and_wakes_through_the_staged_copy(
        namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    import flextensor.shm.segment as segment_mod

    cuda_profile = make_profile(tmp_path / "profile")
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(cuda_profile, config=cpu_config(pinned_memory=True), name="default",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=lambda: tiny_transformer(seed=0))
        manager = ft.get_offload_manager()
        before = _out(model)

        def refuse(ptr: int, nbytes: int, read_only: bool = False) -> None:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaErrorMemoryAllocation (2)")

        monkeypatch.setattr(segment_mod, "host_register", refuse)
        with caplog.at_level(logging.WARNING, logger="flextensor.shm.background_pin"):
            for _cycle in range(3):
                ft.sleep()
                assert manager.wake_ready(timeout=10.0) is False
                ft.wake()
                assert torch.equal(_out(model), before)
        warnings = [r.getMessage() for r in caplog.records
                    if r.name == "flextensor.shm.background_pin" and "the wake copy" in r.getMessage()]
        assert len(warnings) == 1 and "ulimit -l" in warnings[0]  # the first sleep's; later sleeps do not retry
    assert shm_names(manager_namespace(namespace, "default")) == []
