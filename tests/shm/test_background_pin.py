"""BackgroundPinner: order, waiting, failure fallback and teardown, with stand-in segments (no CUDA needed)."""

from __future__ import annotations

import logging
import mmap
import threading
import time

import pytest

from flextensor.shm.background_pin import BackgroundPinner


class FakeSegment:
    """A real anonymous mapping (so the pre-fault has pages to map) whose ``pin`` only records the call."""

    def __init__(self, index: int, log: list[int], *, delay: float = 0.0, fail: bool = False,
                 gate: threading.Event | None = None) -> None:
        self.index, self.log, self.delay, self.fail, self.gate = index, log, delay, fail, gate
        self._mapping = mmap.mmap(-1, 1 << 16)
        import ctypes

        anchor = ctypes.c_char.from_buffer(self._mapping)
        self.address = ctypes.addressof(anchor)
        del anchor
        self.size = 1 << 16
        self.read_only: bool | None = None

    def pin(self, *, read_only: bool = False, prefault: bool = False) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("cudaHostRegister of 65536 bytes failed: cudaErrorMemoryAllocation (2)")
        self.read_only = read_only
        self.log.append(self.index)

    def close(self) -> None:
        self._mapping.close()


@pytest.fixture
def segments_factory():
    made: list[FakeSegment] = []

    def make(n: int, log: list[int], **kw) -> list[FakeSegment]:
        segs = [FakeSegment(i, log, **{k: (v(i) if callable(v) else v) for k, v in kw.items()}) for i in range(n)]
        made.extend(segs)
        return segs

    yield make
    for seg in made:
        seg.close()


def test_blocks_are_registered_read_only_in_schedule_order_then_the_rest(segments_factory) -> None:
    log: list[int] = []
    segs = segments_factory(5, log)
    pinner = BackgroundPinner(segs, [3, 1, 3, 0]).start()  # block 3 appears twice: registered once
    assert pinner.wait_all(10)
    pinner.close()
    assert log == [3, 1, 0, 2, 4]
    assert pinner.pinned_blocks == 5 and pinner.error is None and pinner.done
    assert all(seg.read_only is True for seg in segs)


def test_wait_returns_once_that_block_is_registered_not_before(segments_factory) -> None:
    log: list[int] = []
    release = threading.Event()
    segs = segments_factory(3, log, gate=lambda i: release if i == 1 else None)
    pinner = BackgroundPinner(segs, [0, 1, 2]).start()
    pinner.wait(0)
    assert log == [0]
    waiter = threading.Thread(target=pinner.wait, args=(1,))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive(), "wait(1) returned before block 1 was registered"
    release.set()
    waiter.join(10)
    assert not waiter.is_alive() and 1 in log
    pinner.close()
    assert log == [0, 1, 2] and pinner.waited_s > 0.05


def test_a_refused_registration_warns_once_and_releases_every_waiter(segments_factory, caplog) -> None:
    log: list[int] = []
    segs = segments_factory(4, log, fail=lambda i: i == 1)
    with caplog.at_level(logging.WARNING, logger="flextensor.shm.background_pin"):
        pinner = BackgroundPinner(segs, [0, 1, 2, 3], label="session t").start()
        for block in range(4):
            pinner.wait(block)  # never hangs: the rest are copied from pageable memory
        pinner.close()
    assert log == [0]
    assert isinstance(pinner.error, RuntimeError) and pinner.pinned_blocks == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "session t" in warnings[0] and "1 of 4" in warnings[0] and "ulimit -l" in warnings[0]


def test_close_stops_after_the_block_in_flight_and_joins(segments_factory) -> None:
    log: list[int] = []
    segs = segments_factory(20, log, delay=0.05)
    pinner = BackgroundPinner(segs, list(range(20))).start()
    pinner.wait(0)
    pinner.close()
    assert 1 <= len(log) < 20 and log == list(range(len(log)))
    assert not any(t.name == "ft-pin" for t in threading.enumerate())
    pinner.wait(19)  # released, not blocked, after close
    pinner.close()  # idempotent


def test_no_segments_and_bad_orders(segments_factory) -> None:
    empty = BackgroundPinner([], []).start()
    assert empty.done
    empty.wait_all(0)
    empty.close()
    with pytest.raises(ValueError, match="outside 0..1"):
        BackgroundPinner(segments_factory(2, []), [0, 2])
