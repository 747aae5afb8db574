"""``SharedOffloadSession.offload_from_profile(..., checkpoint=)``: the creator reads safetensors straight into the
shared blocks; outputs equal the plain model; a bad checkpoint is the creator's named error (published to the
followers like any creator failure) and nothing is left in /dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.shm.names import manager_namespace
from tests.client.test_session import LEASE, expected_output, finish, matches, output_of, read_result, spawn
from tests.helpers.checkpoints import checkpoint_tensors, save_checkpoint, tiny_profile
from tests.helpers.models import DEVICE, TinyTransformer, cpu_config, tiny_transformer, token_ids
from tests.leftovers import shm_names


@pytest.fixture
def profile(tmp_path: Path) -> str:
    return tiny_profile(tmp_path / "profile")


def _follower() -> TinyTransformer:
    with ft.init_empty_weights():
        return TinyTransformer()


@pytest.mark.parametrize("shards", [1, 2])
def test_creator_reads_the_checkpoint_into_the_shared_blocks(namespace: str, profile: str, tmp_path: Path,
                                                             shards: int) -> None:
    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt", shards=shards)
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             follower_model_factory=_follower, checkpoint=str(path))
        assert session.role("model") == "creator"
        assert session.report()[0]["shared_bytes"] > 0
        with torch.no_grad():
            out = model(token_ids().to(DEVICE)).cpu()
        assert matches(out, expected_output())
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_without_checkpoint_the_creator_factory_is_still_required(namespace: str, profile: str) -> None:
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(TypeError, match="creator_model_factory"):
        session.offload_from_profile(profile, name="model", follower_model_factory=_follower)
    session.close()


@pytest.mark.parametrize("damage, error, match", [
    ("missing", KeyError, r"blocks\.3\.attn\.out\.bias"),
    ("shape", ValueError, r"blocks\.0\.down\.weight"),
    ("truncated", ValueError, "truncated"),
])
def test_a_bad_checkpoint_fails_the_creator_by_name_and_leaves_nothing(namespace: str, profile: str,
                                                                        tmp_path: Path, damage: str, error: type,
                                                                        match: str) -> None:
    from safetensors.torch import save_file

    tensors = checkpoint_tensors(tiny_transformer(seed=0))
    if damage == "missing":
        del tensors["blocks.3.attn.out.bias"]
    if damage == "shape":
        tensors["blocks.0.down.weight"] = torch.zeros(32, 65)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(error, match=match):
        session.offload_from_profile(profile, config=cpu_config(), name="model", follower_model_factory=_follower,
                                     checkpoint=str(path))
    session.close()
    assert shm_names(manager_namespace(namespace, "model")) == []
    assert ft.get_offload_manager("model").model is None


@pytest.mark.slow
def test_a_follower_of_a_checkpoint_creator_gets_equal_outputs(namespace: str, profile: str,
                                                                                   tmp_path: Path) -> None:
    good = save_checkpoint(tiny_transformer(seed=0), tmp_path / "good", shards=2)
    creator = spawn(namespace, profile, "--checkpoint", str(good), "--hold")
    first = read_result(creator)
    assert first["role"] == "creator"
    follower = spawn(namespace, profile, "--checkpoint", str(good))
    second = read_result(follower)
    assert second["role"] == "follower"
    assert finish(follower) == 0 and finish(creator) == 0
    for result in (first, second):
        assert matches(output_of(result), expected_output())
    assert shm_names(manager_namespace(namespace, "model")) == []

