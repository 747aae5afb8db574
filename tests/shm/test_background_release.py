"""close(background=True): pinned ranges unregistered on the release thread, the mapping kept until the last one,
the caller not held; at exit the thread stops after the call in flight and nothing is left in /dev/shm.

CUDA registration is faked (``flextensor.shm.segment.host_register`` / ``host_unregister``): the bookkeeping and
the order are what is tested, on hosts without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import flextensor.shm.background_release as release_mod
import flextensor.shm.segment as segment_mod
from flextensor.shm.segment import SharedSegment
from tests.leftovers import shm_names

PAGE = 4096
RANGES = 4
REPO = Path(__file__).resolve().parents[2]


class FakeDriver:
    """Records registrations; each unregistration waits for ``gate`` and checks the range is still mapped."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.mapped_at_unregister: list[bool] = []
        self.gate = threading.Event()
        self.segment: SharedSegment | None = None

    def register(self, ptr: int, nbytes: int, *, read_only: bool = False) -> None:
        assert ptr not in self.live
        self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        assert self.gate.wait(10), "the test never let the unregistration through"
        assert self.segment is not None
        self.mapped_at_unregister.append(not self.segment.closed)
        del self.live[ptr]
        self.unregistered.append(ptr)


@pytest.fixture
def driver(monkeypatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(segment_mod, "host_register", fake.register)
    monkeypatch.setattr(segment_mod, "host_unregister", fake.unregister)
    monkeypatch.setattr(release_mod, "PAUSE_S", 0.0)
    return fake


def test_close_returns_while_the_unregistration_runs_and_unmaps_after_the_last_range(namespace, driver):
    name = f"/{namespace}.rel"
    segment = SharedSegment.create(name, RANGES * PAGE)
    driver.segment = segment
    try:
        for i in range(RANGES):
            segment.pin(offset=i * PAGE, nbytes=PAGE)
        assert len(driver.live) == RANGES
        segment.close(background=True)  # returns although every unregistration is held back
        assert driver.unregistered == [] and not segment.closed
        assert release_mod.pending_releases() == 1
        driver.gate.set()
        assert release_mod.wait_released(timeout=30)
        assert segment.closed and driver.live == {}
        assert len(driver.unregistered) == RANGES
        assert driver.mapped_at_unregister == [True] * RANGES  # never unmapped under a registration
    finally:
        driver.gate.set()
        release_mod.wait_released(timeout=30)
        segment.close()
        SharedSegment.unlink_name(name)
    assert shm_names(namespace) == []


def test_a_segment_without_pins_is_closed_at_once(namespace, driver):
    name = f"/{namespace}.nopin"
    segment = SharedSegment.create(name, PAGE)
    try:
        segment.close(background=True)
        assert segment.closed and release_mod.pending_releases() == 0
    finally:
        SharedSegment.unlink_name(name)


def test_a_refused_unregistration_is_logged_and_the_rest_still_released(namespace, driver, caplog, monkeypatch):
    name = f"/{namespace}.refuse"
    segment = SharedSegment.create(name, 2 * PAGE)
    driver.segment = segment
    driver.gate.set()
    refused = []

    def unregister(ptr: int) -> None:
        if not refused:
            refused.append(ptr)
            driver.live.pop(ptr)
            raise RuntimeError("cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered (713)")
        driver.unregister(ptr)

    monkeypatch.setattr(segment_mod, "host_unregister", unregister)
    try:
        segment.pin(offset=0, nbytes=PAGE)
        segment.pin(offset=PAGE, nbytes=PAGE)
        segment.close(background=True)
        assert release_mod.wait_released(timeout=30)
        assert segment.closed and driver.live == {} and len(driver.unregistered) == 1
        assert "could not unregister" in caplog.text
    finally:
        SharedSegment.unlink_name(name)


EXIT_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import flextensor.shm.background_release as release_mod
    import flextensor.shm.segment as segment_mod
    from flextensor.shm.segment import SharedSegment

    log = open(sys.argv[2], "a", buffering=1)
    segment_mod.host_register = lambda ptr, nbytes, read_only=False: log.write("register\\n")

    def slow_unregister(ptr):
        time.sleep(0.2)
        log.write("unregister\\n")

    segment_mod.host_unregister = slow_unregister
    segment = SharedSegment.create(sys.argv[1], 64 * 4096)
    for i in range(64):
        segment.pin(offset=i * 4096, nbytes=4096)
    SharedSegment.unlink_name(sys.argv[1])  # what the last participant's close() does before it returns
    segment.close(background=True)
    log.write("closed\\n")
    # the interpreter exits now, with 64 slow unregistrations handed over
""")


def test_exit_right_after_close_stops_the_release_and_leaves_nothing(namespace, tmp_path):
    log = tmp_path / "calls.log"
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, f"/{namespace}.exit", str(log)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().split()
    assert calls.count("register") == 64 and "closed" in calls
    # The exit hook stopped the thread after the call in flight: the process did not wait for all 64 (12.8 s);
    # its end released the rest.
    assert calls.count("unregister") < 64
    assert shm_names(namespace) == []


DROP_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import flextensor.shm.background_release as release_mod
    import flextensor.shm.segment as segment_mod
    from flextensor.shm.segment import SharedSegment

    segment_mod.host_register = lambda ptr, nbytes, read_only=False: None
    segment_mod.host_unregister = lambda ptr: time.sleep(0.5)  # the release thread is still at it at exit

    def rss_kib(address):
        lines = open("/proc/self/smaps").read().splitlines()
        for i, line in enumerate(lines):
            if line.split()[0].split("-")[0] == format(address, "x"):
                return next(int(l.split()[1]) for l in lines[i + 1:] if l.startswith("Rss:"))
        raise LookupError(address)

    segment = SharedSegment.create(sys.argv[1], 64 << 20)
    segment.tensor(__import__("torch").uint8, (64 << 20,)).fill_(7)  # every page mapped, as streaming leaves them
    for i in range(4):
        segment.pin(offset=i << 24, nbytes=1 << 24)
    address = segment.address
    before = rss_kib(address)
    SharedSegment.unlink_name(sys.argv[1])
    segment.close(background=True)
    release_mod._stop_at_exit()  # what the interpreter's exit runs
    print(json.dumps({"before": before, "after": rss_kib(address)}))
""")


def test_the_exit_hook_drops_the_page_tables_of_what_is_still_mapped(namespace):
    proc = subprocess.run([sys.executable, "-c", DROP_SCRIPT, f"/{namespace}.drop"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rss = json.loads(proc.stdout.splitlines()[-1])
    assert rss["before"] == 64 << 10  # KiB: the whole segment mapped in this process
    assert rss["after"] == 0  # still mapped (and registered), its page-table entries gone before the exit
    assert shm_names(namespace) == []


REAP_SCRIPT = textwrap.dedent("""
    import atexit, json, os, sys, time
    import flextensor.shm.background_release as release_mod
    import flextensor.shm.segment as segment_mod
    from flextensor.shm.segment import SharedSegment

    segment_mod.host_register = lambda ptr, nbytes, read_only=False: None
    segment_mod.host_unregister = lambda ptr: time.sleep(0.5)  # the release thread is still at it at exit
    release_mod.REAP_MIN_BYTES = int(sys.argv[2])

    def held(pid, path):
        found = 0
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(path)
            except OSError:
                pass
        return found

    def report():  # registered first, so it runs after the release's own exit hook
        reaper = release_mod._reaper
        time.sleep(0.3 if reaper else 0)  # long enough for a process that did not wait for this one to be gone
        print(json.dumps({"mapped": mapped, "handed": handed, "at_exit": held(os.getpid(), path),
                          "reaper": reaper.pid if reaper else None,
                          "reaper_waits": reaper.poll() is None if reaper else False,
                          "reaper_holds": held(reaper.pid, path) if reaper else 0}), flush=True)

    atexit.register(report)
    segment = SharedSegment.create(sys.argv[1], 64 << 20)
    path = segment.directory + sys.argv[1]
    for i in range(4):
        segment.pin(offset=i << 24, nbytes=1 << 24)
    mapped = held(os.getpid(), path)  # what the mapping itself holds (CPython's mmap keeps a descriptor)
    segment.close(background=True)  # as a session's close: handed over while the name exists
    handed = held(os.getpid(), path)
    SharedSegment.unlink_name(sys.argv[1])  # then the last participant's coordinator removes the names
""")


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie no init has reaped yet
    except FileNotFoundError:
        return True


def test_at_exit_the_pages_still_mapped_are_freed_by_a_process_that_outlives_this_one(namespace):
    proc = subprocess.run([sys.executable, "-c", REAP_SCRIPT, f"/{namespace}.reap", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    # the hand-over kept a descriptor of the file; at the real exit the hook gave it to a process of its own
    assert report["handed"] == report["mapped"] + 1 and report["at_exit"] == report["mapped"]
    assert report["reaper"] is not None and report["reaper_waits"] and report["reaper_holds"] == 1
    deadline = time.monotonic() + 10
    while not _ended(report["reaper"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(report["reaper"])  # it ended after the process that started it
    assert shm_names(namespace) == []


def test_below_the_threshold_the_exit_frees_the_pages_itself(namespace):
    proc = subprocess.run([sys.executable, "-c", REAP_SCRIPT, f"/{namespace}.noreap", str(1 << 40)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["reaper"] is None  # no process started
    assert report["handed"] == report["mapped"] + 1 and report["at_exit"] == report["mapped"]  # closed its own
    assert shm_names(namespace) == []


def test_the_release_thread_lets_go_of_the_file_once_it_unmapped_the_segment(namespace, driver):
    segment = SharedSegment.create(f"/{namespace}.held", RANGES * PAGE * 16)
    path = segment.directory + segment.name
    driver.segment = segment
    for i in range(RANGES):
        segment.pin(offset=i * PAGE * 16, nbytes=PAGE * 16)

    def held() -> int:
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith(path) for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    mapped = held()  # what the mapping itself holds (CPython's mmap keeps a descriptor)
    segment.close(background=True)
    segment.close(background=True)  # handed over twice: still one descriptor, one release
    SharedSegment.unlink_name(segment.name)
    assert held() == mapped + 1  # until the thread unmapped it, the file stays open here: nobody frees its pages
    assert release_mod.pending_releases() == 1
    driver.gate.set()
    assert release_mod.wait_released(10)
    assert held() == 0
    assert shm_names(namespace) == []
