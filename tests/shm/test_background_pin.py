"""BackgroundPinner: order, waiting, failure fallback and teardown, with a stand-in arena (no CUDA needed)."""

from __future__ import annotations

import logging
import mmap
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from flextensor.shm.background_pin import BackgroundPinner, PinRange


BLOCK = 1 << 16


class FakeArena:
    """A real anonymous mapping of ``n`` 64 KiB blocks (so the pre-fault has pages to map) whose ``pin`` only
    records which block's range was asked for; per-block ``delay``/``fail``/``gate`` as in ``kw``."""

    def __init__(self, n: int, log: list[int], **kw) -> None:
        self.log, self.kw = log, kw
        self._mapping = mmap.mmap(-1, n * BLOCK)
        import ctypes

        anchor = ctypes.c_char.from_buffer(self._mapping)
        self.address = ctypes.addressof(anchor)
        del anchor
        self.size = n * BLOCK
        self.page_size = mmap.PAGESIZE  # what a SharedSegment's mount gives it (4 KiB pages: /dev/shm)
        self.read_only: dict[int, bool] = {}

    def _option(self, name: str, index: int, default):
        value = self.kw.get(name, default)
        return value(index) if callable(value) else value

    def pin(self, *, read_only: bool = False, prefault: bool = False, offset: int = 0, nbytes: int | None = None):
        index = offset // BLOCK
        assert offset % BLOCK == 0 and nbytes == BLOCK, (offset, nbytes)
        gate = self._option("gate", index, None)
        if gate is not None:
            assert gate.wait(10)
        time.sleep(self._option("delay", index, 0.0))
        if self._option("fail", index, False):
            raise RuntimeError("cudaHostRegister of 65536 bytes failed: cudaErrorMemoryAllocation (2)")
        self.read_only[index] = read_only
        self.log.append(index)

    def close(self) -> None:
        self._mapping.close()


@pytest.fixture
def segments_factory():
    """``make(n, log, **kw)``: the n blocks of one fake arena, as the session hands them to the pinner."""
    made: list[FakeArena] = []

    def make(n: int, log: list[int], **kw) -> list[PinRange]:
        arena = FakeArena(n, log, **kw)
        made.append(arena)
        return [PinRange(arena, i * BLOCK, BLOCK) for i in range(n)]

    yield make
    for arena in made:
        arena.close()


def test_blocks_are_registered_read_only_in_schedule_order_then_the_rest(segments_factory) -> None:
    log: list[int] = []
    segs = segments_factory(5, log)
    pinner = BackgroundPinner(segs, [3, 1, 3, 0]).start()  # block 3 appears twice: registered once
    assert pinner.wait_all(10)
    pinner.close()
    assert log == [3, 1, 0, 2, 4]
    assert pinner.pinned_blocks == pinner.block_count == 5 and pinner.error is None and pinner.done
    assert segs[0].segment.read_only == {i: True for i in range(5)}


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


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    from flextensor.shm.background_pin import BackgroundPinner, PinRange
    from tests.shm.test_background_pin import BLOCK, FakeArena

    out = open(sys.argv[1], "a", buffering=1)

    class Logged(FakeArena):
        def pin(self, **kw):
            out.write("begin\\n")
            time.sleep(0.2)
            out.write("end\\n")

    arena = Logged(64, [])
    pinner = BackgroundPinner([PinRange(arena, i * BLOCK, BLOCK) for i in range(64)], []).start()
    pinner.wait(0)
    # the interpreter exits now, with the pinner in its second block
""")


def test_exit_stops_a_running_pinner_after_the_block_in_flight(tmp_path) -> None:
    log = tmp_path / "pins.log"
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(log)], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().split()
    # Every registration that began ended before the process did (none cut off inside the driver), and the exit
    # did not wait for the other blocks.
    assert 2 <= calls.count("begin") == calls.count("end") < 64, calls
