"""``SharedOffloadSession.offload_from_profile(..., checkpoint=)``: the creator reads safetensors straight into the
shared blocks; outputs equal the plain model; a bad checkpoint is the creator's named error (published to the
followers like any creator failure) and nothing is left in /dev/shm."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.shm.names import manager_namespace
from tests.client.sharing.test_session import LEASE, expected_output, finish, matches, output_of, read_result, spawn
from tests.helpers.checkpoints import checkpoint_tensors, save_checkpoint, tiny_profile
from tests.helpers.models import DEVICE, TinyTransformer, cpu_config, tiny_transformer, token_ids
from tests.leftovers import shm_names


@pytest.fixture
def profile(tmp_path: Path) -> str:
    return tiny_profile(tmp_path / "profile")


def _follower() -> TinyTransformer:
    with ft.init_empty_weights():
        return TinyTransformer()


def _creator_raises(namespace: str, profile: str, path: Path, error: type, match: str) -> None:
    """A session that becomes the checkpoint's creator raises ``error`` (its message matching ``match``) from
    ``offload_from_profile``; the session is closed after it, also when the check fails."""
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    try:
        with pytest.raises(error, match=match):
            session.offload_from_profile(profile, config=cpu_config(), name="model",
                                         follower_model_factory=_follower, checkpoint=str(path))
    finally:
        session.close()


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
    _creator_raises(namespace, profile, path, error, match)
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



@pytest.mark.parametrize("source", ["in RAM", "checkpoint"])
def test_an_arena_in_parts_is_published_read_and_removed_whole(namespace: str, profile: str, tmp_path: Path,
                                                               source: str) -> None:
    """A large model's arena is cut into parts (here forced small): the creator fills every part (copied from
    the model in RAM, or read from the checkpoint), followers map each part and compute equal outputs, and the
    last one out removes every part."""
    extra = ["--arena-part-bytes", "4096"]
    if source == "checkpoint":
        extra += ["--checkpoint", str(save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt", shards=2))]
    creator = spawn(namespace, profile, *extra, "--hold")
    followers = []
    try:
        first = read_result(creator)
        assert first["role"] == "creator"
        names = shm_names(manager_namespace(namespace, "model"))
        parts = sorted(n.rsplit(".", 1)[1] for n in names if n.rsplit(".", 1)[1].startswith("h"))
        assert len(parts) > 1 and parts[0] == "h" and parts[1:] == [f"h{k}" for k in range(1, len(parts))], names
        followers = [spawn(namespace, profile, *extra, "--hold") for _ in range(2)]
        results = [read_result(f) for f in followers]
        assert [r["role"] for r in results] == ["follower", "follower"]
        for result in (first, *results):
            assert matches(output_of(result), expected_output())
    finally:
        codes = [finish(p) for p in (*followers, creator)]
    assert codes == [0] * (len(followers) + 1)
    assert shm_names(manager_namespace(namespace, "model")) == []


def _slow_reads(monkeypatch) -> list[int]:
    """Every checkpoint read takes 20 ms (a slow disk): the populating thread and the adoption run ahead of it.
    Returns the sizes of the ranges read, as they are read."""
    from flextensor.loading import checkpoint as ckpt

    real = ckpt._read_range
    reads: list[int] = []

    def slow(fd, r):
        import time

        time.sleep(0.02)
        reads.append(r.nbytes)
        real(fd, r)

    monkeypatch.setattr(ckpt, "_read_range", slow)
    return reads


def _no_reading_thread() -> bool:
    import threading

    return not [t for t in threading.enumerate() if t.name.startswith(("ft-publish-read", "ft-ckpt-"))]


def test_an_arena_full_mid_read_fails_the_creator_by_name_and_leaves_nothing(namespace: str, profile: str,
                                                                             tmp_path: Path, monkeypatch) -> None:
    """The reader allocates the arena's pages ahead of its reads (the segment's reserve_range): when /dev/shm runs
    out part way, the creator raises the segment's ShmSpaceError, every thread stops, nothing is left."""
    from flextensor.shm.errors import ShmSpaceError
    from flextensor.shm.segment import SharedSegment

    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt", shards=2)
    real = SharedSegment.reserve_range
    calls = []

    def reserve_range(segment, offset: int, nbytes: int, **kwargs) -> None:
        import threading

        if threading.current_thread().name == "ft-ckpt-populate":
            calls.append(offset)
            if len(calls) == 2:
                raise ShmSpaceError(f"no space in /dev/shm for shared-memory segment {segment.name!r}",
                                    segment=segment.name, wanted=nbytes, free=0)
        real(segment, offset, nbytes, **kwargs)

    monkeypatch.setattr(SharedSegment, "reserve_range", reserve_range)
    _slow_reads(monkeypatch)
    _creator_raises(namespace, profile, path, ShmSpaceError, "no space in /dev/shm")
    assert len(calls) == 2 and _no_reading_thread()
    assert shm_names(manager_namespace(namespace, "model")) == []
    assert ft.get_offload_manager("model").model is None


def test_an_adoption_failure_while_the_blocks_are_read_stops_the_reads_and_leaves_nothing(
        namespace: str, profile: str, tmp_path: Path, monkeypatch) -> None:
    """The engine adopts the plan while the blocks are read on their thread: when the adoption fails, the reads are
    cancelled and joined before the arena is cleaned up, and the creator raises the adoption's error."""
    from flextensor.manager import OffloadManager

    path = save_checkpoint(tiny_transformer(seed=0), tmp_path / "ckpt")
    reads = _slow_reads(monkeypatch)
    ranges = []

    def refuse(self, model, *args, **kwargs):  # fails once a read finished beside it, with reads still to come
        import time

        ranges.append(len(reads))
        deadline = time.monotonic() + 10.0
        while len(reads) == ranges[0] and time.monotonic() < deadline:
            time.sleep(0.002)
        ranges.append(len(reads))
        raise RuntimeError("the adoption was refused")

    monkeypatch.setattr(OffloadManager, "offload_from_state", refuse)
    _creator_raises(namespace, profile, path, RuntimeError, "the adoption was refused")
    assert _no_reading_thread()
    total = len(checkpoint_tensors(tiny_transformer(seed=0)))
    assert ranges[0] < ranges[1] and len(reads) < total  # reads went on beside the adoption, the rest was cancelled
    assert shm_names(manager_namespace(namespace, "model")) == []
