"""A session creator fills the store and the arena itself (flextensor.sharing.publish): pages allocated a window ahead of
the copy, the model pointed at each shared copy as it is made, the engine adopting the filled blocks; the
published bytes are the model's, bit for bit."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import flextensor as ft
import flextensor.sharing.publish as publish_mod
import flextensor.shm.store_layout as layout_mod
import flextensor.shm.tensor_store as store_mod
from flextensor.runtime.piece_copy import COPY_THREADS_MAX
from flextensor.shm.blocks import ARENA_KIND
from flextensor.shm.names import manager_namespace
from flextensor.shm.populate_ahead import PopulateAhead
from flextensor.state import TensorManagerState
from tests.client.sharing.test_session import LEASE, make_profile
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
        def __init__(self, ranges, *, window, workers=1):
            super().__init__(ranges, window=window, workers=workers)
            made.append({"ranges": list(ranges), "window": window, "workers": workers})

    monkeypatch.setattr(publish_mod, "PopulateAhead", Recording)
    monkeypatch.setattr(store_mod, "PopulateAhead", Recording)
    return made


def _copy_on_threads(monkeypatch, on: bool) -> None:
    """Copy the arena's and the store's pieces on a pool of threads, as on a tmpfs of huge pages (or never)."""
    from flextensor.shm.owner import ShmOwner

    monkeypatch.setattr(ShmOwner, "huge_tmpfs", property(lambda self: on))


ON_THREADS = pytest.mark.parametrize("on_threads", [False, True], ids=["copied here", "copied on threads"])


def _meta_model() -> TinyTransformer:
    with torch.device("meta"):
        return TinyTransformer()


@ON_THREADS
def test_a_creator_in_ram_publishes_identical_bytes_through_windowed_pages(namespace, profile, populations,
                                                                        monkeypatch, on_threads):
    """Also with the arena's pieces copied on a pool of threads, as on a tmpfs of huge pages."""
    plain = tiny_transformer(seed=0)
    monkeypatch.setattr(publish_mod, "populate_window", lambda total: WINDOW)
    _copy_on_threads(monkeypatch, on_threads)
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
        manager = ft.get_offload_manager("model")
        published = TensorManagerState.from_json(session_owner_blob(namespace))
        if on_threads:  # the pool's writes into the files allocate the pages: nothing is allocated ahead
            assert populations == []
        else:  # pages came through the window: one population for the store's records, one for the arena's blocks
            assert len(populations) == 2  # the arena's fill starts first, on its thread, beside the store's
            block_pop, store_pop = sorted(populations, key=lambda p: p["ranges"][0][0].name.endswith(".sd"))
            assert block_pop["ranges"][0][0].name.endswith(f".{ARENA_KIND}")
            assert len(block_pop["ranges"]) == len(manager.offloaded_tensors) and block_pop["window"] == WINDOW
            assert len(store_pop["ranges"]) == sum(not t.offloaded for t in published.tensors)  # one per record
        assert {b.name for b in published.blocks} == {f"/{manager_namespace(namespace, 'model')}.g1.{ARENA_KIND}"}
        report = session.report()[0]
        assert report["publish"]["gbps"] > 0 and {"store", "blocks", "adopt", "plan"} <= set(report["steps"])
        threads = min(COPY_THREADS_MAX, os.cpu_count() or 1) if on_threads else 0
        assert report["publish"]["copy_threads"] == report["publish"]["store_copy_threads"] == threads
        assert report["publish"]["released_early_bytes"] > 0
        assert report["publish"]["store_released_early_bytes"] > 0
        del model, state
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_a_store_in_parts_is_made_ahead_at_the_sizes_the_publish_takes(namespace, profile, monkeypatch):
    """The creator sizes the store's parts from the plan before its model exists; the publish then takes exactly
    those segments (none is made again), and every resident tensor's shared copy equals the model's."""
    from flextensor.shm.owner import ShmOwner
    from flextensor.shm.tensor_store import SharedTensorStore

    monkeypatch.setattr(layout_mod, "STORE_PART_MIN_BYTES", 4096)
    prepared: dict[str, int] = {}
    created: dict[str, int] = {}
    prepare, create = ShmOwner.prepare_segments, ShmOwner.create_segment

    def recording_prepare(self, sizes, **kwargs):
        prepared.update(sizes)
        return prepare(self, sizes, **kwargs)

    def recording_create(self, kind, size, **kwargs):
        created[kind] = size
        return create(self, kind, size, **kwargs)

    monkeypatch.setattr(ShmOwner, "prepare_segments", recording_prepare)
    monkeypatch.setattr(ShmOwner, "create_segment", recording_create)
    plain = tiny_transformer(seed=0)
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=_meta_model)
        parts = sorted(kind for kind in created if kind.startswith("sd"))
        assert len(parts) > 1 and {kind: created[kind] for kind in parts} == {kind: prepared[kind] for kind in parts}
        with torch.no_grad():
            assert same(model(token_ids().to(DEVICE)), reference(plain, token_ids()))
        from flextensor.shm.coordinator import ShmCoordinator

        with ShmCoordinator(manager_namespace(namespace, "model"), lease_seconds=LEASE) as follower:
            store = SharedTensorStore.attach(follower.namespace, shm_owner=follower.memory_owner)
            assert store.parts == len(parts)
            values = {**dict(plain.named_parameters(remove_duplicate=False)),
                      **dict(plain.named_buffers(remove_duplicate=False))}
            for name, view in store.tensors().items():
                assert torch.equal(view, values[name]), name
            del view
            store.close()
        del model
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


def _slow_assigns(monkeypatch) -> list[int]:
    """Every model tensor pointed at its shared copy takes 20 ms (so a fill is still running when the other one
    fails); returns the list of the copies' element counts, in order."""
    import time

    made: list[int] = []
    real_assign = publish_mod.assign_data

    def slow_assign(tensor, view):
        time.sleep(0.02)
        made.append(view.numel())
        real_assign(tensor, view)

    monkeypatch.setattr(publish_mod, "assign_data", slow_assign)
    return made


def _fails_after(seconds: float, what: str):
    """A stand-in for a fill that fails as a full /dev/shm would, after ``seconds``."""
    import time

    def fail(*args, **kwargs):
        time.sleep(seconds)
        raise OSError(28, f"No space left on device ({what})")

    return fail


def _creator_raises(namespace: str, profile: str, match: str) -> None:
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    try:
        with pytest.raises(OSError, match=match):
            session.offload_from_profile(profile, config=cpu_config(), name="model",
                                         creator_model_factory=lambda: tiny_transformer(seed=0),
                                         follower_model_factory=_meta_model)
    finally:
        session.close()


@ON_THREADS
def test_a_store_failure_stops_the_arena_filling_beside_it_and_leaves_nothing(namespace, profile, monkeypatch,
                                                                            on_threads):
    """From a model in RAM the arena fills on a thread while the store fills: when the store fails, that thread
    is stopped (before its next block) and joined before anything is cleaned up, the creator raises the store's
    error, and nothing is left."""
    import threading
    import time

    import flextensor.sharing.creator as creator_mod
    from flextensor.profiles import read_profile

    _copy_on_threads(monkeypatch, on_threads)
    filled = _slow_assigns(monkeypatch)  # the store is replaced: these are the arena's
    monkeypatch.setattr(creator_mod, "publish_store", _fails_after(0.05, "the store"))
    streamed = sum(t.offloaded for t in read_profile(profile).tensors)
    _creator_raises(namespace, profile, "the store")
    assert not [t for t in threading.enumerate() if t.name == "ft-publish-blocks" or "copy" in t.name]
    stopped_at = len(filled)
    assert 0 < stopped_at < streamed  # the arena's fill had started and was stopped part way
    time.sleep(0.1)
    assert len(filled) == stopped_at  # nothing writes into the arena any more
    assert shm_names(manager_namespace(namespace, "model")) == []


@ON_THREADS
def test_an_arena_fill_failure_stops_the_store_beside_it_and_leaves_nothing(namespace, profile, monkeypatch,
                                                                           on_threads):
    """The other way round: when the arena's fill fails (here at once, as a full /dev/shm would make it), the
    store stops before its next record instead of filling to its end, the creator raises the arena's error, and
    nothing is left."""
    import flextensor.sharing.creator as creator_mod
    from flextensor.profiles import read_profile

    _copy_on_threads(monkeypatch, on_threads)
    stored = _slow_assigns(monkeypatch)  # the arena's fill is replaced: these are the store's
    monkeypatch.setattr(creator_mod, "fill_blocks", _fails_after(0.03, "the arena"))
    resident = sum(not t.offloaded for t in read_profile(profile).tensors)
    _creator_raises(namespace, profile, "the arena")
    assert len(stored) < resident  # the store stopped part way
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_an_interrupt_while_waiting_for_the_arena_fill_cancels_it_and_still_waits_for_it():
    """Ctrl-C while the creator waits for the arena's fill: the fill is told to stop and the thread has ended
    before the interrupt goes on (the cleanup that follows must not race a thread still writing)."""
    import signal
    import threading

    cancel = threading.Event()
    stopped = threading.Event()

    def fill() -> None:  # a fill that only stops when cancelled
        while not cancel.wait(0.01):
            pass
        stopped.set()

    call = publish_mod.BackgroundCall(fill, name="ft-publish-blocks", cancel=cancel)
    threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        call.join()
    assert cancel.is_set() and stopped.is_set()
    assert not [t for t in threading.enumerate() if t.name == "ft-publish-blocks"]


def _one_block_per_weight(weights: dict[str, torch.nn.Parameter]) -> tuple[dict, list]:
    """The model tensors of ``weights`` and a block per weight, in order, each laid out row-major."""
    from flextensor.runtime.packed_layout import pack_block
    from flextensor.state import ModelTensor

    tensors = {name: ModelTensor(name, "param", w, True, []) for name, w in weights.items()}
    layouts = [pack_block(i, f"b{i}", [(name, w.dtype, tuple(w.shape), tuple(torch.empty(w.shape).stride()))])
               for i, (name, w) in enumerate(weights.items())]
    return tensors, layouts


@contextlib.contextmanager
def _arena_parts(namespace: str, layouts: list) -> Iterator[tuple[Any, list, list]]:
    """An arena laid out for ``layouts`` in parts made without their pages: its layout, its parts and its blocks'
    views. The parts are closed and removed afterwards, whatever happened."""
    from flextensor.shm.blocks import SharedBlockAllocator, arena_layout
    from flextensor.shm.segment import SharedSegment

    layout = arena_layout([b.nbytes for b in layouts])
    parts = [SharedSegment.create(f"/{namespace}.part{k}", size, reserve=False)
             for k, size in enumerate(layout.part_sizes)]
    try:
        yield layout, parts, SharedBlockAllocator.views(parts, layout)
    finally:
        for part in parts:
            part.close()
            SharedSegment.unlink_name(part.name)


@ON_THREADS
def test_blocks_larger_than_a_piece_with_padding_fill_in_order(namespace, on_threads):
    """Blocks of several pieces whose last piece ends in padding (a tensor of 3 MiB + 28 bytes): every piece is
    reported written in order whether copied here or on the pool, every weight ends up pointing at its shared
    place with the model's bytes, and its private pages were given back behind the copy."""
    from flextensor.runtime.piece_copy import CopyPool

    numel = (3 << 20) // 4 + 7
    weights = {f"w{i}": torch.nn.Parameter(torch.randn(numel), requires_grad=False) for i in range(4)}
    expected = {name: w.detach().clone() for name, w in weights.items()}
    tensors, layouts = _one_block_per_weight(weights)
    assert all(b.nbytes > publish_mod.FILL_PIECE_MIN_BYTES and b.nbytes % 4096 for b in layouts)
    addresses = [w.data_ptr() for w in weights.values()]
    with _arena_parts(namespace, layouts) as (layout, segments, views):
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(CopyPool(2)) if on_threads else None
            report = publish_mod.fill_blocks(tensors, layouts, views, segments, layout, None, label="padded",
                                             copy_pool=pool)
        spans = [(seg.address, seg.address + seg.size) for seg in segments]
        for name, weight in weights.items():
            assert any(lo <= weight.data_ptr() < hi for lo, hi in spans), name
            assert torch.equal(weight.detach(), expected[name]), name
        assert report["copy_threads"] == (2 if on_threads else 0)
        # The private pages given back: the whole pages inside each tensor (here), inside each piece (on the pool).
        piece = publish_mod.fill_piece(publish_mod.populate_window(layout.total))
        cuts = [(lo, min(lo + piece, numel * 4)) for lo in range(0, numel * 4, piece)] if on_threads \
            else [(0, numel * 4)]
        assert report["released_early_bytes"] == sum(_whole_pages(address + lo, address + hi)
                                                      for address in addresses for lo, hi in cuts) > 0
        del views, weights
        tensors.clear()
    assert shm_names(namespace) == []


def test_a_write_that_finds_no_room_fails_the_fill_on_the_pool_and_leaves_nothing_open(namespace, monkeypatch):
    """On the pool the writes allocate the pages: a part that runs out of room raises its ``ShmSpaceError`` from
    the fill once nothing writes any more, with every file the fill opened closed."""
    from flextensor.runtime.piece_copy import CopyPool
    from flextensor.shm.errors import ShmSpaceError
    from flextensor.shm.segment import SharedSegment

    numel = (3 << 20) // 4
    weights = {f"w{i}": torch.nn.Parameter(torch.randn(numel), requires_grad=False) for i in range(6)}
    tensors, layouts = _one_block_per_weight(weights)
    write_from = SharedSegment.write_from
    writes: list[str] = []

    def filling_up(self, fd, at, address, nbytes):
        writes.append(self.name)
        if len(writes) == 4:
            raise ShmSpaceError(f"no space in /dev/shm for shared-memory segment {self.name!r}", segment=self.name,
                                wanted=nbytes, free=0)
        write_from(self, fd, at, address, nbytes)

    monkeypatch.setattr(SharedSegment, "write_from", filling_up)
    with _arena_parts(namespace, layouts) as (layout, segments, views):
        before = set(os.listdir("/proc/self/fd"))
        with CopyPool(2) as pool, pytest.raises(ShmSpaceError, match="no space"):
            publish_mod.fill_blocks(tensors, layouts, views, segments, layout, None, label="full", copy_pool=pool)
        assert set(os.listdir("/proc/self/fd")) == before
        spans = [(seg.address, seg.address + seg.size) for seg in segments]
        shared = [name for name, w in weights.items() if any(lo <= w.data_ptr() < hi for lo, hi in spans)]
        assert shared in ([], ["w0"])  # w1 (its second piece failed) and the blocks after it keep their own
        del views
        tensors.clear()
    assert shm_names(namespace) == []


def test_on_the_pool_a_strided_weight_is_stored_through_its_view_after_its_pages_and_every_page_is_allocated(
        namespace, monkeypatch):
    """Nothing is reserved ahead of the pool's writes: a weight that cannot be written whole from its address (a
    transposed one) is stored through its view, so its range is reserved first; and once every block is written,
    each part is reserved whole (pages the writes left out, e.g. gaps between blocks, are then not holes)."""
    from flextensor.runtime.piece_copy import CopyPool
    from flextensor.shm.segment import SharedSegment

    plain = torch.randn(512, 384)
    strided = torch.nn.Parameter(torch.randn(384, 512).t(), requires_grad=False)  # (512, 384), not contiguous
    weights = {"w0": torch.nn.Parameter(plain.clone(), requires_grad=False), "w1": strided}
    expected = {name: w.detach().clone() for name, w in weights.items()}
    tensors, layouts = _one_block_per_weight(weights)
    reserved: list[tuple[str, int, int]] = []
    reserve_range = SharedSegment.reserve_range

    def recording(self, offset, nbytes, **kwargs):
        reserved.append((self.name, offset, nbytes))
        return reserve_range(self, offset, nbytes, **kwargs)

    monkeypatch.setattr(SharedSegment, "reserve_range", recording)
    with _arena_parts(namespace, layouts) as (layout, segments, views):
        with CopyPool(2) as pool:
            publish_mod.fill_blocks(tensors, layouts, views, segments, layout, None, label="strided", copy_pool=pool)
        for name, weight in weights.items():
            assert torch.equal(weight.detach(), expected[name]), name
        part = segments[layout.parts[1]]
        first = reserved.index((part.name, layout.offsets[1], layouts[1].nbytes))  # before its store, then whole
        assert sorted(reserved[first + 1:]) == sorted((seg.name, 0, seg.size) for seg in segments)
        del views, weights
        tensors.clear()
    assert shm_names(namespace) == []


def test_a_copy_pool_with_checkpoint_weights_is_refused():
    from flextensor.runtime.piece_copy import CopyPool

    with CopyPool(1) as pool:
        with pytest.raises(ValueError, match="copy_pool or weights"):
            publish_mod.fill_blocks({}, [], [], [], None, {"w": 1}, label="x", copy_pool=pool)  # type: ignore[arg-type]


def _whole_pages(start: int, end: int) -> int:
    """Bytes of the whole pages inside ``[start, end)``."""
    import mmap

    page = mmap.PAGESIZE
    return max(0, end // page * page - -(-start // page) * page)
