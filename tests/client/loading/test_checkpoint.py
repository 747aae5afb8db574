"""The safetensors reader: one file, shards with an index, exact bytes into strided destinations, named errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from flextensor.loading import checkpoint as ckpt
from flextensor.loading.checkpoint import ReadPlan, SafetensorsCheckpoint
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
    with caplog.at_level(logging.INFO, logger="flextensor.loading.checkpoint"):
        plan = ReadPlan(threads=1, chunk_bytes=1 << 20)
        plan.add(checkpoint.entries["w"], torch.empty(1 << 20))
        plan.run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reading")]
    assert lines and all("MiB" in m and "GB/s" in m and "ETA" in m for m in lines)


def _fresh(nbytes: int) -> torch.Tensor:
    """Fresh anonymous memory (no page written yet), as a uint8 tensor that owns its mapping."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _eight_tensors(tmp_path: Path) -> tuple[SafetensorsCheckpoint, dict[str, torch.Tensor]]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    tensors = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(8)}  # 1 MiB each
    save_file(tensors, str(tmp_path / "m.safetensors"))
    return SafetensorsCheckpoint(tmp_path / "m.safetensors"), tensors


def _queue_into_one_block(plan: ReadPlan, checkpoint: SafetensorsCheckpoint) -> torch.Tensor:
    block = _fresh(checkpoint.nbytes)
    offset = 0
    for key in sorted(checkpoint.entries):
        entry = checkpoint.entries[key]
        plan.add(entry, block[offset:offset + entry.nbytes].view(entry.dtype).view(entry.shape))
        offset += entry.nbytes
    return block


def test_destination_pages_are_populated_ahead_of_the_reads_within_the_window(tmp_path: Path, monkeypatch) -> None:
    """The populating thread gets page-aligned spans inside the destination, never more than the window ahead of
    the readers, each page at most once; the bytes read are exact."""
    checkpoint, tensors = _eight_tensors(tmp_path)
    spans: list[tuple[int, int, int]] = []  # (address, nbytes, bytes the readers had claimed by then)
    claimed = [0]
    real = ckpt._read_range

    def counting(fd, r):
        claimed[0] += r.nbytes
        real(fd, r)

    def populate(address: int, nbytes: int) -> None:
        spans.append((address, nbytes, claimed[0]))

    plan = ReadPlan(threads=1, chunk_bytes=1 << 20, populate=populate, populate_ahead=2 << 20)
    block = _queue_into_one_block(plan, checkpoint)
    monkeypatch.setattr(ckpt, "_read_range", counting)
    stats = plan.read()
    assert stats.nbytes == checkpoint.nbytes and stats.populated_bytes == sum(n for _, n, _ in spans)
    base = block.data_ptr()
    assert all(a % 4096 == 0 and n % 4096 == 0 and base <= a and a + n <= base + block.numel() for a, n, _ in spans)
    covered = [page for a, n, _ in spans for page in range(a, a + n, 4096)]
    assert len(covered) == len(set(covered))  # no page twice
    # A range is populated only while it starts at most 2 MiB past what the readers had claimed (ranges are 1 MiB;
    # the count above lags a claim by at most the range being started).
    assert all(a - base <= seen + (3 << 20) for a, _, seen in spans)
    offset = 0
    for key in sorted(tensors):
        value = tensors[key]
        assert torch.equal(block[offset:offset + value.numel() * 4].view(torch.float32), value), key
        offset += value.numel() * 4


def test_a_populate_error_stops_the_reads_and_is_raised(tmp_path: Path, monkeypatch) -> None:
    """A caller's populate (a shared segment's: a full /dev/shm) fails: the readers stop after the ranges in flight
    and its error, not a read's, reaches the caller once every thread stopped."""
    import threading

    checkpoint, _ = _eight_tensors(tmp_path)
    calls = [0]
    release = threading.Event()

    def populate(address: int, nbytes: int) -> None:
        calls[0] += 1
        if calls[0] == 2:
            release.set()
            raise OSError(28, "no room for the segment")

    real = ckpt._read_range
    read = [0]

    def slow(fd, r):  # the readers stay behind the populating thread
        release.wait(5)
        read[0] += r.nbytes
        real(fd, r)

    plan = ReadPlan(threads=2, chunk_bytes=1 << 20, populate=populate)
    _queue_into_one_block(plan, checkpoint)
    monkeypatch.setattr(ckpt, "_read_range", slow)
    with pytest.raises(OSError, match="no room for the segment"):
        plan.read()
    assert read[0] < checkpoint.nbytes
    assert not [t for t in threading.enumerate() if t.name.startswith(("ft-ckpt-read", "ft-ckpt-populate"))]


def test_memory_that_refuses_populating_is_still_read_exactly(tmp_path: Path) -> None:
    """The default populate is only a speed-up: where the kernel or the memory refuses (False), the thread stops
    and the readers fault the pages in themselves."""
    checkpoint, tensors = _eight_tensors(tmp_path)
    calls = [0]

    def refuse(address: int, nbytes: int) -> bool:
        calls[0] += 1
        return False

    plan = ReadPlan(threads=2, chunk_bytes=1 << 20, populate=refuse)
    block = _queue_into_one_block(plan, checkpoint)
    stats = plan.read()
    assert calls[0] <= 1 and stats.populated_bytes == 0 and stats.nbytes == checkpoint.nbytes
    assert torch.equal(block.view(torch.float32), torch.cat([tensors[k] for k in sorted(tensors)]))
    # The default one, on this host's fresh memory: the same bytes.
    plan = ReadPlan(threads=2, chunk_bytes=1 << 20)
    block = _queue_into_one_block(plan, checkpoint)
    plan.read()
    assert torch.equal(block.view(torch.float32), torch.cat([tensors[k] for k in sorted(tensors)]))


def test_detached_reads_run_apart_and_the_plan_is_left_empty(tmp_path: Path) -> None:
    checkpoint, tensors = _eight_tensors(tmp_path)
    plan = ReadPlan(threads=2, chunk_bytes=1 << 20)
    block = _queue_into_one_block(plan, checkpoint)
    detached = plan.detach()
    assert plan.read().nbytes == 0 and plan.nbytes == 0
    assert detached.read().nbytes == checkpoint.nbytes
    assert torch.equal(block.view(torch.float32), torch.cat([tensors[k] for k in sorted(tensors)]))


def test_pages_are_populated_when_memory_order_differs_from_file_order(tmp_path: Path, monkeypatch) -> None:
    """The block holds the tensors in the reverse of their file order (the reads go in file order): the populating
    thread still covers the pages of every range the reader had not reached."""
    import threading

    checkpoint, tensors = _eight_tensors(tmp_path)
    keys = sorted(checkpoint.entries, key=lambda k: checkpoint.entries[k].start, reverse=True)
    block = _fresh(checkpoint.nbytes)
    spans: list[tuple[int, int]] = []
    populated = threading.Event()

    def populate(address: int, nbytes: int) -> None:
        spans.append((address, nbytes))
        if len(spans) == len(keys) - 1:
            populated.set()

    real = ckpt._read_range

    def first_waits(fd, r):  # the reader holds the first range until the thread populated the rest
        populated.wait(5)
        real(fd, r)

    monkeypatch.setattr(ckpt, "_read_range", first_waits)
    plan = ReadPlan(threads=1, chunk_bytes=1 << 20, populate=populate)
    places = {}
    offset = 0
    for key in keys:
        entry = checkpoint.entries[key]
        places[key] = (block.data_ptr() + offset, entry.nbytes)
        plan.add(entry, block[offset:offset + entry.nbytes].view(entry.dtype).view(entry.shape))
        offset += entry.nbytes
    plan.read()
    covered = {page for a, n in spans for page in range(a, a + n, 4096)}
    first = min(keys, key=lambda k: checkpoint.entries[k].start)
    for key, (address, nbytes) in places.items():
        if key != first:
            assert set(range(address, address + nbytes, 4096)) <= covered, key
    offset = 0
    for key in keys:
        n = tensors[key].numel() * 4
        assert torch.equal(block[offset:offset + n].view(torch.float32), tensors[key]), key
        offset += n
