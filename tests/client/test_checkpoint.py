"""The safetensors reader: one file, shards with an index, exact bytes into strided destinations, named errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from flextensor import checkpoint as ckpt
from flextensor.checkpoint import ReadPlan, SafetensorsCheckpoint
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.models import tiny_transformer


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.f32": torch.randn(33, 7, generator=g),
        "b.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "c.i64": torch.arange(11, dtype=torch.int64),
        "d.bool": torch.tensor([True, False, True]),
        "e.f16": torch.randn(4, generator=g).half(),
        "f.empty": torch.empty(0, 3),
    }


def test_reads_every_dtype_exactly_from_one_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = _tensors()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path / "m.safetensors")
    assert sorted(checkpoint.entries) == sorted(tensors)
    assert checkpoint.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for key, value in tensors.items():
        read = checkpoint.read(key)
        assert read.dtype == value.dtype and torch.equal(read, value), key


def test_sharded_directory_and_index_file_give_the_same_tensors(tmp_path: Path) -> None:
    model = tiny_transformer()
    directory = save_checkpoint(model, tmp_path / "sharded", shards=3)
    single = SafetensorsCheckpoint(save_checkpoint(model, tmp_path / "one"))
    for source in (directory, directory / "model.safetensors.index.json"):
        sharded = SafetensorsCheckpoint(source)
        assert len(sharded.files) == 3
        assert sorted(sharded.entries) == sorted(single.entries)
        for key in single.entries:
            assert torch.equal(sharded.read(key), single.read(key)), key


def test_reads_into_strided_destinations_in_small_chunks_over_threads(tmp_path: Path) -> None:
    """A transposed destination (a packed host block keeps strides) and tensors split over many ranges."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    big = torch.randn(1024, 700, generator=g)  # 2.7 MiB: three 1 MiB ranges
    small = torch.randn(64, 48, generator=g)
    save_file({"big": big, "small": small}, str(tmp_path / "m.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path / "m.safetensors")
    dest_big = torch.full((1024, 700), -1.0)
    dest_small = torch.full((48, 64), -1.0).t()  # non-contiguous, dense
    plan = ReadPlan(threads=4, chunk_bytes=1 << 20)
    plan.add(checkpoint.entries["big"], dest_big)
    plan.add(checkpoint.entries["small"], dest_small)
    assert plan.run() == big.numel() * 4 + small.numel() * 4
    assert torch.equal(dest_big, big) and torch.equal(dest_small, small)


def test_destination_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4, 4)}, str(tmp_path / "m.safetensors"))
    entry = SafetensorsCheckpoint(tmp_path / "m.safetensors").entries["w"]
    with pytest.raises(ValueError, match="'w'"):
        ReadPlan().add(entry, torch.empty(4, 5))


def test_truncated_file_is_refused_on_opening_naming_file_and_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"first": torch.ones(100), "second": torch.ones(100)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ValueError, match="truncated") as info:
        SafetensorsCheckpoint(path)
    assert str(path) in str(info.value) and "second" in str(info.value)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match="too short"):
        SafetensorsCheckpoint(path)


def test_file_truncated_after_opening_fails_the_read(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(1000)}, str(path))
    checkpoint = SafetensorsCheckpoint(path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(ValueError, match="truncated after it was opened"):
        checkpoint.read("w")


def test_bad_paths_and_indexes_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SafetensorsCheckpoint(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors.index.json"):
        SafetensorsCheckpoint(tmp_path / "empty")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "missing-shard.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="missing-shard"):
        SafetensorsCheckpoint(index)
    index.write_text("{}")
    with pytest.raises(ValueError, match="weight_map"):
        SafetensorsCheckpoint(index)


def test_a_slow_read_logs_bytes_rate_and_eta(tmp_path: Path, monkeypatch, caplog) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1 << 20)}, str(tmp_path / "m.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path / "m.safetensors")
    monkeypatch.setattr(ckpt, "PROGRESS_INTERVAL_S", 0.01)
    real = ckpt._read_range

    def slow(fd, r):  # a disk slower than the logging interval
        import time

        time.sleep(0.05)
        real(fd, r)

    monkeypatch.setattr(ckpt, "_read_range", slow)
    with caplog.at_level(logging.INFO, logger="flextensor.checkpoint"):
        plan = ReadPlan(threads=1, chunk_bytes=1 << 20)
        plan.add(checkpoint.entries["w"], torch.empty(1 << 20))
        plan.run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reading")]
    assert lines and all("MiB" in m and "GB/s" in m and "ETA" in m for m in lines)
