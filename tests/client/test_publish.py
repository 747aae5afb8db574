"""A session creator fills the store and the arena itself (flextensor.publish): pages allocated a window ahead of
the copy, the model pointed at each shared copy as it is made, the engine adopting the filled blocks; the
published bytes are the model's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor as ft
import flextensor.publish as publish_mod
import flextensor.shm.tensor_store as store_mod
from flextensor.shm.blocks import ARENA_KIND
from flextensor.shm.names import manager_namespace
from flextensor.shm.populate_ahead import PopulateAhead
from flextensor.state import TensorManagerState
from tests.client.test_session import LEASE, make_profile
from tests.helpers.models import (DEVICE, TinyTransformer, cpu_config, reference,
                                  same, tiny_transformer, token_ids)
from tests.helpers.session_worker import shm_ranges
from tests.leftovers import shm_names

WINDOW = 3 * 36864  # about two of the tiny transformer's blocks beyond the one being filled


@pytest.fixture
def profile(tmp_path: Path) -> str:
    return make_profile(tmp_path / "profile")


@pytest.fixture
def populations(monkeypatch) -> list[dict]:
    """Every PopulateAhead the publish makes: its ranges and its window."""
    made: list[dict] = []

    class Recording(PopulateAhead):
        def __init__(self, segment, ranges, *, window):
            super().__init__(segment, ranges, window=window)
            made.append({"ranges": list(ranges), "window": window})

    monkeypatch.setattr(publish_mod, "PopulateAhead", Recording)
    monkeypatch.setattr(store_mod, "PopulateAhead", Recording)
    return made


def _meta_model() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


def test_a_creator_in_ram_publishes_identical_bytes_through_windowed_pages(namespace, profile, populations,
                                                                        monkeypatch):
    plain = tiny_transformer(seed=0)
    monkeypatch.setattr(publish_mod, "populate_window", lambda total: WINDOW)
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=_meta_model)
        assert session.role("model") == "creator"
        with torch.no_grad():
            assert same(model(token_ids().to(DEVICE)), reference(plain, token_ids()))
        # Every published byte is the model's: the blocks (state_dict() reads streamed tensors from their host
        # blocks) and the resident tensors (copied from the store; on a CPU host they view it in place).
        state = dict(model.state_dict())
        for name, value in plain.state_dict().items():
            assert torch.equal(state[name].cpu(), value), name
        if DEVICE.type == "cpu":
            ranges = shm_ranges()
            assert all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in model.parameters())
        # Pages came through the window: one population for the store's records, one for the arena's blocks.
        store_pop, block_pop = populations
        manager = ft.get_offload_manager("model")
        assert len(block_pop["ranges"]) == len(manager.offloaded_tensors) and block_pop["window"] == WINDOW
        published = TensorManagerState.from_json(session_owner_blob(namespace))
        assert len(store_pop["ranges"]) == sum(not t.offloaded for t in published.tensors)  # a range per record
        assert {b.name for b in published.blocks} == {f"/{manager_namespace(namespace, 'model')}.g1.{ARENA_KIND}"}
        report = session.report()[0]
        assert report["publish"]["gbps"] > 0 and {"store", "blocks", "adopt", "plan"} <= set(report["steps"])
        del model, state
    assert shm_names(manager_namespace(namespace, "model")) == []


def session_owner_blob(namespace: str) -> bytes:
    """The published plan, read as a follower would."""
    from flextensor.shm.coordinator import ShmCoordinator

    with ShmCoordinator(manager_namespace(namespace, "model"), lease_seconds=LEASE) as follower:
        assert not follower.is_creator
        return follower.memory_owner.read_blob("p")


def test_a_model_that_does_not_match_the_profile_is_refused_before_anything_is_published(namespace, profile):
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(ValueError, match="another model"):
        session.offload_from_profile(profile, config=cpu_config(), name="model",
                                     creator_model_factory=lambda: tiny_transformer(seed=0, d=48),
                                     follower_model_factory=_meta_model)
    session.close()
    assert shm_names(manager_namespace(namespace, "model")) == []
