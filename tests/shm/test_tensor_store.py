"""SharedTensorStore and the engine's shared host blocks: exact round trips, tied names, and refusals."""

from __future__ import annotations

import os
import textwrap

import msgspec
import pytest
import torch
from torch import nn

from flextensor.shm import blocks as blocks_mod
from flextensor.shm import segment as segment_mod
from flextensor.shm import tensor_store as tensor_store_mod
from flextensor.shm.blocks import ARENA_KIND, SharedBlockAllocator, arena_layout
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.manifest import (MANIFEST_PROTOCOL, StoreManifest, TensorRecord, decode_manifest,
                                     validate_manifest)
from flextensor.shm.names import manager_namespace
from flextensor.shm.segment import SharedSegment
from flextensor.shm.tensor_store import DATA_KIND, MANIFEST_KIND, SharedTensorStore, data_kind, store_layout
from tests.helpers.forkserver import run_code


class TinyLM(nn.Module):
    """Embedding tied to the head, a norm, persistent and non-persistent buffers, mixed dtypes."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim, bias=False).to(torch.bfloat16)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(dim, dtype=torch.float64))
        self.register_buffer("steps", torch.tensor([7], dtype=torch.int64), persistent=False)


def _model(seed: int = 0, device: str = "cpu") -> TinyLM:
    torch.manual_seed(seed)
    with torch.device(device):
        return TinyLM()


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "model")


def test_round_trip_preserves_values_ties_and_persistence(ns: str) -> None:
    source = _model()
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=creator.memory_owner)
        creator.notify_ready()
        with ShmCoordinator(ns, lease_seconds=2.0) as follower:
            assert not follower.is_creator
            follower.wait_for_ready(timeout=5)
            attached = SharedTensorStore.attach(ns, shm_owner=follower.memory_owner)
            target = _model(device="meta")
            attached.materialize(target, "cpu")
            assert target.head.weight is target.embed.weight
            assert set(target.state_dict()) == set(source.state_dict())
            for name, value in source.state_dict().items():
                assert torch.equal(target.state_dict()[name], value), name
            assert torch.equal(target.steps, source.steps)
            assert "steps" in target._non_persistent_buffers_set
            assert target.proj.weight.dtype == torch.bfloat16
            # zero-copy on CPU: the installed tensor views the shared segment
            assert target.embed.weight.data_ptr() == attached.tensors()["embed.weight"].data_ptr()
            # tied weights are stored once
            assert [r.name for r in attached.records].count("embed.weight") == 1
            assert sum(len(r.all_names) for r in attached.records) == len(dict(source.named_parameters(remove_duplicate=False))) + 2
            del target
            attached.close()
        store.close()


def test_copies_made_ahead_are_installed_as_they_are_and_must_be_on_the_target_device(ns: str) -> None:
    source = _model()
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=creator.memory_owner)
        copies = store.copies_on("cpu")  # what a follower's attach thread makes (on its GPU there)
        assert set(copies) == {r.name for r in store.records}
        assert all(copies[n].data_ptr() != v.data_ptr() for n, v in store.tensors().items() if n in copies)
        target = _model(device="meta")
        store.materialize(target, "cpu", copies=copies)
        assert target.embed.weight.data_ptr() == copies["embed.weight"].data_ptr()
        assert target.head.weight is target.embed.weight
        for name, value in source.state_dict().items():
            assert torch.equal(target.state_dict()[name], value), name
        with pytest.raises(ValueError, match="the copy of 'embed.weight' is on meta, not on cpu"):
            store.materialize(_model(device="meta"), "cpu", copies={"embed.weight": copies["embed.weight"].to("meta")})
        del target
        store.close()


def test_copies_are_one_transfer_viewed_per_record_with_the_records_strides(ns: str) -> None:
    """The attach thread copies the store's bytes once; each record is a view of that one copy with the dtype,
    shape, strides and storage offset its record gives (mixed dtypes and alignments, an empty buffer, and a
    record read as a transposed view with an offset, which the creator never writes but the format allows)."""

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(12, dtype=torch.float32).reshape(3, 4))
            self.register_buffer("ids", torch.arange(5, dtype=torch.int64))
            self.register_buffer("empty", torch.zeros(0, 3, dtype=torch.bfloat16))
            self.h = torch.nn.Parameter(torch.linspace(-1, 1, 7).to(torch.bfloat16))

    source = Mixed()
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=creator.memory_owner)
        w = next(r for r in store.records if r.name == "w")
        # the same bytes read as the transpose of its last 2x4 rows: shape (4, 2), strides (1, 4), offset 4
        odd = msgspec.structs.replace(w, shape=[4, 2], stride=[1, 4], storage_offset=4, nbytes=32)
        store.manifest = msgspec.structs.replace(
            store.manifest, tensors=[odd if r.name == "w" else r for r in store.manifest.tensors])
        copies = store.copies_on("cpu")
        hosts = {r.name: store.tensor(r) for r in store.records}
        for name, copy in copies.items():
            assert (copy.dtype, copy.shape, copy.stride()) == (hosts[name].dtype, hosts[name].shape,
                                                               hosts[name].stride()), name
            assert torch.equal(copy, hosts[name]) and (copy.numel() == 0 or copy.data_ptr() != hosts[name].data_ptr())
        assert torch.equal(copies["w"], source.w[1:].t())
        assert copies["empty"].shape == (0, 3) and copies["empty"].dtype == torch.bfloat16
        storages = {t.untyped_storage().data_ptr() for t in copies.values() if t.numel()}
        assert len(storages) == 1  # one allocation for every record
        buffer = store.device_buffer("cpu")  # what the attach thread allocates early and has filled last
        filled = store.copies_on("cpu", buffer=buffer)
        assert all(t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                   for t in filled.values() if t.numel())
        assert all(torch.equal(filled[n], copies[n]) for n in copies)
        with pytest.raises(ValueError, match="the buffer must be device_buffer"):
            store.copies_on("cpu", buffer=torch.empty(buffer.numel() + 1, dtype=torch.uint8))
        del copies, hosts, filled, buffer
        store.close()


def test_a_fill_supplies_the_bytes_and_a_segment_without_pages_gets_them_record_by_record(ns: str) -> None:
    """What a creator does: the store's segment is made ahead without its pages (a model in RAM is freed into it),
    each record's bytes come from ``fill`` (here: from a second model, for a source on meta) and the pages are
    allocated record by record on a thread; the bytes read back are the model's."""
    source = _model()
    meta = _model(device="meta")
    registrations = dict(source.named_parameters(remove_duplicate=False)) | dict(source.named_buffers())
    filled: list[str] = []

    def fill(record, view, tensor) -> None:
        assert tensor.is_meta  # the sources are meta: allowed because a fill supplies the bytes
        view.copy_(registrations[record.name].detach())
        filled.append(record.name)

    unique = {id(t): t for t in [*source.parameters(), *source.buffers()]}.values()
    total = sum(-(-t.numel() * t.element_size() // 256) * 256 for t in unique)  # each record 256-byte aligned
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        owner = creator.memory_owner
        owner.prepare_segments({"sd": total}, reserve=False)
        store = SharedTensorStore.create_from_model(ns, meta, shm_owner=owner, fill=fill, window=1 << 20)
        assert store.nbytes == total and sorted(filled) == sorted(r.name for r in store.records)
        for name, value in source.state_dict().items():
            assert torch.equal(store.tensors()[name], value), name
        with pytest.raises(ValueError, match="on the meta device"):
            SharedTensorStore.create_from_model(ns, meta, shm_owner=owner)  # without a fill, meta has no bytes
        store.close()


def test_the_layout_deals_records_to_parts_in_turn_by_key_at_aligned_offsets() -> None:
    # aligned to 256: 256 + 512 + 256 + 256 + 768 = 2048 bytes, 2048 // 512 = 4 parts
    layout = store_layout({"b": 300, "a": 100, "c": 50, "d": 10, "e": 600}, part_min_bytes=512)
    assert layout.order == ("a", "b", "c", "d", "e")
    assert layout.places == {"a": (0, 0), "b": (1, 0), "c": (2, 0), "d": (3, 0), "e": (0, 256)}
    assert layout.part_sizes == (1024, 512, 256, 256)
    assert layout.kinds == {"sd": 1024, "sd1": 512, "sd2": 256, "sd3": 256}
    one = store_layout({"b": 300, "a": 100}, part_min_bytes=1 << 20)  # a small store stays one segment
    assert one.places == {"a": (0, 0), "b": (0, 256)} and one.part_sizes == (768,)
    assert store_layout({}).part_sizes == (256,)
    many = store_layout({f"t{i:02}": 1 << 20 for i in range(20)}, part_min_bytes=1)
    assert len(many.part_sizes) == 8  # never more than STORE_MAX_PARTS


def test_a_store_in_parts_round_trips_and_hands_every_part_to_one_fill(ns: str) -> None:
    """Six records in six parts (``.sd`` .. ``.sd5``): a follower maps them all, installs equal values with the
    tie restored, and ``copies_on`` hands one fill a piece per part, each with its own file."""
    source = _model()
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        owner = creator.memory_owner
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=owner, part_min_bytes=256)
        assert store.parts == 6 and len(store.manifest.part_sizes) == 6
        assert sorted({r.part for r in store.records}) == list(range(6))
        for part in range(6):
            assert os.path.exists(f"/dev/shm{owner.resource_name(data_kind(part))}")
        creator.notify_ready()
        with ShmCoordinator(ns, lease_seconds=2.0) as follower:
            follower.wait_for_ready(timeout=5)
            attached = SharedTensorStore.attach(ns, shm_owner=follower.memory_owner)
            assert attached.parts == 6
            target = _model(device="meta")
            attached.materialize(target, "cpu")
            assert target.head.weight is target.embed.weight
            for name, value in source.state_dict().items():
                assert torch.equal(target.state_dict()[name], value), name
            pieces_seen = []

            def fill(pieces: list) -> None:
                for dst, src, (fd, offset) in pieces:
                    assert os.pread(fd, src.numel(), offset) == src.numpy().tobytes()
                    dst.copy_(src)
                pieces_seen.append(len(pieces))

            copies = attached.copies_on("cpu", fill=fill)
            assert pieces_seen == [6]
            for record in attached.records:
                assert torch.equal(copies[record.name], attached.tensor(record)), record.name
            del target, copies
            attached.close()
        store.close()


def test_a_registration_in_ranges_covers_every_byte_once_and_direct_copies_never_span_two(
        ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``unpinned_ranges`` cuts every data segment into ``REGISTER_RANGE_BYTES`` ranges not yet registered; the
    store counts as pinned once every byte is; a direct ``copies_on`` copies at most one range per copy, and the
    copies equal the records. (The driver is stood in for: ``host_register`` records the ranges.)"""
    step = 2 * 4096
    monkeypatch.setattr(tensor_store_mod, "REGISTER_RANGE_BYTES", step)
    registered: list[tuple[int, int]] = []
    monkeypatch.setattr(segment_mod, "host_register",
                        lambda ptr, nbytes, read_only=False: registered.append((ptr, nbytes)))
    monkeypatch.setattr(segment_mod, "host_unregister", lambda ptr: None)
    source = _model()
    source.embed.weight.data = torch.randn(1024, 16)  # 64 KiB: several ranges in its part
    source.head.weight = source.embed.weight
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=creator.memory_owner, part_min_bytes=256)
        ranges = store.unpinned_ranges()
        sizes = {id(segment): segment.size for segment, _offset, _nbytes in ranges}
        assert sum(sizes.values()) == sum(nbytes for _segment, _offset, nbytes in ranges)  # every byte, once
        assert all(offset % step == 0 and 0 < nbytes <= step for _segment, offset, nbytes in ranges)
        assert len(ranges) > store.parts and not store.pinned
        first, rest = ranges[:3], ranges[3:]
        for segment, offset, nbytes in first:
            segment.pin(read_only=True, offset=offset, nbytes=nbytes)
        assert not store.pinned
        assert store.unpinned_ranges() == rest  # a later registration goes on from where this one stopped
        for segment, offset, nbytes in rest:
            segment.pin(read_only=True, offset=offset, nbytes=nbytes)
        assert store.pinned and store.unpinned_ranges() == []
        spans: list[tuple[int, int]] = []
        real_copy = torch.Tensor.copy_

        def copy_(dst: torch.Tensor, src: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            spans.append((src.data_ptr(), src.numel()))
            return real_copy(dst, src, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        copies = store.copies_on("cpu")
        monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        for record in store.records:
            assert torch.equal(copies[record.name], store.tensor(record)), record.name
        within = [any(ptr <= at and at + n <= ptr + size for ptr, size in registered) for at, n in spans]
        assert spans and all(within), spans  # each copy inside one registered range
        assert sum(n for _at, n in spans) > step  # the large part was copied in several pieces
        store.close()


def test_a_store_pinned_whole_has_no_range_left_to_register(ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segment_mod, "host_register", lambda ptr, nbytes, read_only=False: None)
    monkeypatch.setattr(segment_mod, "host_unregister", lambda ptr: None)
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, _model(), shm_owner=creator.memory_owner)
        assert not store.pinned and store.unpinned_ranges()
        store.pin()  # whole segments, as a creator registers them
        assert store.pinned and store.unpinned_ranges() == []
        store.close()


def test_copies_on_hands_the_one_copy_to_a_fill_with_the_data_file(ns: str) -> None:
    """The fill gets the data segment's file, open for pread at the range's offset (closed after the fill), and
    None once the segment's name is gone (the mapping still serves)."""
    source = _model()
    calls = []

    def fill(pieces: list) -> None:
        assert len(pieces) == 1  # a small store is one part
        dst, src, file = pieces[0]
        calls.append((dst.numel(), src.numel(), file))
        if file is not None:
            fd, offset = file
            assert os.pread(fd, src.numel(), offset) == src.numpy().tobytes()
        dst.copy_(src)

    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=creator.memory_owner)
        copies = store.copies_on("cpu", fill=fill)  # no buffer given: one is allocated for the fill
        assert len(calls) == 1 and calls[0][0] == calls[0][1] and calls[0][2] is not None
        with pytest.raises(OSError):
            os.fstat(calls[0][2][0])  # closed after the fill
        SharedSegment.unlink_name(creator.memory_owner.resource_name(DATA_KIND))
        assert torch.equal(store.copies_on("cpu", fill=fill)["scale"], source.scale) and calls[1][2] is None
        hosts = {r.name: store.tensor(r) for r in store.records}  # copies are by record name (no aliases)
        assert set(copies) == set(hosts)
        for name, value in hosts.items():
            assert torch.equal(copies[name], value), name
        del copies, hosts
        store.close()


def test_attach_from_another_process_sees_identical_bytes(ns: str) -> None:
    source = _model(seed=3)
    expected = {k: v.double().sum().item() for k, v in source.state_dict().items()}
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, source, shm_owner=creator.memory_owner)
        creator.notify_ready()
        code = textwrap.dedent(
            f"""
            import json, sys
            from flextensor.shm.tensor_store import SharedTensorStore
            store = SharedTensorStore.attach({ns!r}, timeout=10, lease_seconds=2.0)
            out = {{name: t.double().sum().item() for name, t in store.tensors().items()}}
            store.close()
            print(json.dumps(out))
            """
        )
        result = run_code(code, timeout=60)
        assert result.returncode == 0, result.stderr
        got = msgspec.json.decode(result.stdout.strip().splitlines()[-1])
        for name, value in expected.items():
            assert got[name] == value, name
        store.close()


def test_mismatched_follower_model_is_refused_by_tensor_name_and_left_unchanged(ns: str) -> None:
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(ns, _model(), shm_owner=creator.memory_owner)
        creator.notify_ready()
        other = TinyLM(vocab=64).to("meta")  # only the tied embedding/head differs
        with pytest.raises(ValueError, match=r"embed\.weight.*shape"):
            store.materialize(other)
        assert other.embed.weight.is_meta  # nothing was installed
        wrong_dtype = _model(device="meta").to(torch.float16)
        with pytest.raises(ValueError, match="dtype"):
            store.validate_against(wrong_dtype)
        store.close()


def test_store_only_publishes_selected_names(ns: str) -> None:
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        store = SharedTensorStore.create_from_model(
            ns, _model(), names=["norm.weight", "norm.bias", "scale"], shm_owner=creator.memory_owner
        )
        assert sorted(n for r in store.records for n in r.all_names) == ["norm.bias", "norm.weight", "scale"]
        with pytest.raises(ValueError, match="no such parameter"):
            SharedTensorStore.create_from_model(ns, _model(), names=["nope"], shm_owner=creator.memory_owner)
        store.close()


def _record(**overrides) -> TensorRecord:
    fields = dict(
        name="layer.weight", kind="parameter", persistent=True, dtype="float32", shape=[4, 4], stride=[4, 1],
        storage_offset=0, byte_offset=0, nbytes=64,
    )
    fields.update(overrides)
    return TensorRecord(**fields)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(byte_offset=4096), "past the end"),
        (dict(dtype="float33"), "unknown dtype"),
        (dict(stride=[8, 1]), "bad stride"),
        (dict(stride=[4]), "different ranks"),
        (dict(byte_offset=2), "not aligned"),
        (dict(shape=[-1, 4]), "negative dimension"),
    ],
)
def test_corrupted_manifest_records_are_named(overrides: dict, message: str) -> None:
    manifest = StoreManifest(protocol=MANIFEST_PROTOCOL, library_version="x", generation=1, data_size=1024,
                             part_sizes=[1024], tensors=[_record(**overrides)])
    with pytest.raises(ShmProtocolError, match=rf"'layer\.weight'.*{message}"):
        validate_manifest(manifest, [1024])


def test_malformed_or_foreign_manifest_bytes_are_refused(ns: str) -> None:
    with pytest.raises(ShmProtocolError, match="malformed"):
        decode_manifest(b"\x93\x01\x02")
    bad_protocol = StoreManifest(protocol=99, library_version="x", generation=1, data_size=0, part_sizes=[0],
                                 tensors=[])
    with pytest.raises(ShmProtocolError, match="protocol 99"):
        validate_manifest(bad_protocol, [0])
    no_such_part = StoreManifest(protocol=MANIFEST_PROTOCOL, library_version="x", generation=1, data_size=2048,
                                 part_sizes=[1024, 1024], tensors=[_record(part=2)])
    with pytest.raises(ShmProtocolError, match=r"'layer\.weight' lies in part 2, but the store has 2 part"):
        validate_manifest(no_such_part, [1024, 1024])
    with pytest.raises(ShmProtocolError, match="2 part.*1 data segment"):
        validate_manifest(no_such_part, [1024])
    with pytest.raises(ShmProtocolError, match="1024 bytes in part 1 but its data segment holds 512"):
        validate_manifest(no_such_part, [1024, 512])
    # a creator that publishes an out-of-range record: followers refuse it at attach
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        owner = creator.memory_owner
        owner.create_segment("sd", 256).close()
        forged = StoreManifest(
            protocol=MANIFEST_PROTOCOL, library_version="x", generation=owner.generation, data_size=256,
            part_sizes=[256], tensors=[_record(byte_offset=512)],
        )
        owner.write_blob(MANIFEST_KIND, msgspec.msgpack.encode(forged))
        creator.notify_ready()
        with ShmCoordinator(ns, lease_seconds=2.0) as follower:
            with pytest.raises(ShmProtocolError, match=r"'layer\.weight'.*past the end"):
                SharedTensorStore.attach(ns, shm_owner=follower.memory_owner)


def _attached_blocks(follower: ShmCoordinator, sizes: list[int]):
    """A follower's allocator, its mappings of the arena's parts and its views of the blocks."""
    theirs = SharedBlockAllocator(follower.memory_owner)
    seen = theirs.attach(sizes)
    return theirs, seen, theirs.views(seen, sizes)


def _fill_each_block(blocks: SharedBlockAllocator, arena, layout) -> list[torch.Tensor]:
    """The creator's views of its blocks, block ``i`` filled with the byte ``i + 1``."""
    mine = blocks.views(arena, layout)
    for i, view in enumerate(mine):
        view.fill_(i + 1)
    return mine


def test_shared_host_blocks_live_in_one_arena_at_page_aligned_offsets(ns: str) -> None:
    sizes = [4096, 10, 5000]
    layout = arena_layout(sizes)
    assert layout.offsets == (0, 4096, 8192) and layout.total == 16384  # every block on its own page
    assert layout.parts == (0, 0, 0) and layout.part_sizes == (16384,)  # a small arena is one segment
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        blocks = SharedBlockAllocator(creator.memory_owner)
        arena = blocks.create(sizes)
        assert [a.name for a in arena] == blocks.names(sizes) == [creator.memory_owner.resource_name(ARENA_KIND)]
        mine = _fill_each_block(blocks, arena, sizes)
        creator.notify_ready()
        with ShmCoordinator(ns, lease_seconds=2.0) as follower:
            theirs, seen, views = _attached_blocks(follower, sizes)
            assert [v.numel() for v in views] == sizes
            assert all(torch.equal(a, b) for a, b in zip(views, mine))
            with pytest.raises(ValueError, match="needs 20480"):
                theirs.attach([*sizes, 4096])
            with pytest.raises(RuntimeError, match="only the creator"):
                theirs.create(sizes)
            del views
            for segment in seen:
                segment.close()
        with pytest.raises(ValueError, match="positive integer size"):
            blocks.create([64, 0])
        del mine
        for segment in arena:
            segment.close()


def test_a_large_arena_is_cut_into_parts_that_take_blocks_in_turn(ns: str, monkeypatch) -> None:
    """Blocks go to the parts round robin (consecutive blocks in different files, whose pages the kernel allocates
    in parallel); each part is its own segment, ``h``, ``h1``, ...; a follower computes the same layout from the
    sizes alone and reads the creator's bytes."""
    monkeypatch.setattr(blocks_mod, "ARENA_PART_MIN_BYTES", 8192)
    sizes = [4096, 10, 5000, 8192, 100]
    layout = arena_layout(sizes)
    assert layout.parts == (0, 1, 0, 1, 0)  # 23 KiB of blocks / 8 KiB: 2 parts (never more than the bytes allow)
    assert layout.offsets == (0, 0, 4096, 4096, 12288)
    assert layout.part_sizes == (16384, 12288) and layout.total == 28672
    assert list(layout.kinds) == [ARENA_KIND, f"{ARENA_KIND}1"]
    many = arena_layout([4096] * 20)
    assert len(many.part_sizes) == blocks_mod.ARENA_MAX_PARTS == 8 and many.parts[:9] == (*range(8), 0)
    monkeypatch.setattr(blocks_mod, "ARENA_MAX_PARTS", 3)
    assert len(arena_layout([4096] * 20).part_sizes) == 3
    monkeypatch.setattr(blocks_mod, "ARENA_MAX_PARTS", 8)
    with ShmCoordinator(ns, lease_seconds=2.0) as creator:
        blocks = SharedBlockAllocator(creator.memory_owner)
        arena = blocks.create(layout)
        owner = creator.memory_owner
        assert [a.name for a in arena] == [owner.resource_name(ARENA_KIND), owner.resource_name(f"{ARENA_KIND}1")]
        assert [os.stat(f"/dev/shm{a.name}").st_size for a in arena] == [16384, 12288]
        mine = _fill_each_block(blocks, arena, layout)
        creator.notify_ready()
        with ShmCoordinator(ns, lease_seconds=2.0) as follower:
            theirs, seen, views = _attached_blocks(follower, sizes)
            assert [torch.unique(v).tolist() for v in views] == [[i + 1] for i in range(len(sizes))]
            del views
            for segment in seen:
                segment.close()
            # A part smaller than the layout needs is refused, and the parts mapped before it are unmapped.
            with pytest.raises(ValueError, match=r"h1 holds 12288 bytes but the published plan needs 16384"):
                theirs.attach([4096, 16384, 100])
        del mine
        for segment in arena:
            segment.close()
