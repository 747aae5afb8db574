"""FileLock and SemaphoreLock with real processes: contention, timeouts, SIGKILL of the holder, safe unlink."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import posix_ipc
import pytest

from flextensor.shm.locks import _POLL_FAST_MAX_S, _POLL_MAX_S, FileLock, SemaphoreLock, make_lock
from flextensor.shm.names import lock_directory


@pytest.fixture
def lock_path(namespace):
    path = lock_directory() / f"{namespace}.lock"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture
def sem_name(namespace):
    name = f"/{namespace}.g0.l0"
    yield name
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def _start_holder(code: str) -> subprocess.Popen:
    """Start a child that takes a lock, prints 'held', then waits for a line on stdin (or to be killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline().strip()
    if line != "held":
        proc.kill()
        raise AssertionError(f"holder did not start: {line!r} {proc.stderr.read()}")
    return proc


FILE_HOLDER = """
import sys
from flextensor.shm.locks import FileLock
lock = FileLock({path!r})
lock.acquire(timeout=5)
print("held", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
"""

SEM_HOLDER = """
import sys
from flextensor.shm.locks import SemaphoreLock
lock = SemaphoreLock({name!r})
lock.acquire(timeout=5)
print("held", flush=True)
sys.stdin.readline()
lock.release()
lock.close()
print("released", flush=True)
"""


def test_file_lock_basic_use(lock_path):
    lock = FileLock(lock_path)
    assert not lock.held
    lock.acquire()
    assert lock.held and lock_path.exists()
    assert (os.stat(lock_path).st_mode & 0o777) == 0o600
    with pytest.raises(RuntimeError, match="not re-entrant"):
        lock.acquire(timeout=0)
    lock.release()
    with pytest.raises(RuntimeError, match="not held"):
        lock.release()
    with lock:
        assert lock.held
    assert not lock.held
    lock.close()
    lock.close()


def test_two_handles_in_one_process_exclude_each_other(lock_path):
    first, second = FileLock(lock_path), FileLock(lock_path)
    first.acquire()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        second.acquire(timeout=0.2)
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 1.0
    assert str(lock_path) in str(info.value) and "fuser" in str(info.value)
    with pytest.raises(TimeoutError):
        second.acquire(timeout=0)
    first.release()
    second.acquire(timeout=0)
    assert second.held
    second.close()
    first.close()


def test_file_lock_contention_and_sigkill_of_the_holder(lock_path):
    holder = _start_holder(FILE_HOLDER.format(path=str(lock_path)))
    try:
        waiter = FileLock(lock_path)
        with pytest.raises(TimeoutError, match=str(lock_path)):
            waiter.acquire(timeout=0.3)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        t0 = time.monotonic()
        waiter.acquire(timeout=5)  # the kernel dropped the dead holder's lock
        assert time.monotonic() - t0 < 1.0
        waiter.close()
    finally:
        holder.kill()
        holder.wait()


def test_file_lock_released_by_the_holder_wakes_the_waiter(lock_path):
    holder = _start_holder(FILE_HOLDER.format(path=str(lock_path)))
    try:
        waiter = FileLock(lock_path)
        result: list[float] = []
        thread = threading.Thread(target=lambda: (waiter.acquire(timeout=5), result.append(time.monotonic())))
        thread.start()
        time.sleep(0.2)
        assert not result  # still blocked
        released_at = time.monotonic()
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        thread.join(timeout=5)
        assert result and result[0] - released_at < 1.0
        assert waiter.held
        waiter.close()
    finally:
        holder.kill()
        holder.wait()


def test_waiting_polls_at_most_every_2_ms_for_the_first_half_second(lock_path, monkeypatch):
    """A waiter that sleeps long after the lock came free loses that time: joins of several workers at once
    hold the coordinator lock about a millisecond each, so the first half second polls every 2 ms at most, and
    only a longer wait backs off to 20 ms. Read from the sleeps acquire() really makes."""
    import flextensor.shm.locks as locks_mod

    holder, waiter = FileLock(lock_path), FileLock(lock_path)
    holder.acquire(timeout=0)
    sleeps: list[tuple[float, float]] = []
    real_sleep, start = time.sleep, time.monotonic()

    def recording_sleep(seconds: float) -> None:
        sleeps.append((time.monotonic() - start, seconds))
        real_sleep(seconds)

    monkeypatch.setattr(locks_mod.time, "sleep", recording_sleep)
    with pytest.raises(TimeoutError):
        waiter.acquire(timeout=0.8)
    holder.release()
    early = [d for at, d in sleeps if at < 0.45]
    late = [d for at, d in sleeps if at > 0.6]
    assert early[0] == pytest.approx(0.0002) and max(early) <= _POLL_FAST_MAX_S
    assert late and max(late) == pytest.approx(_POLL_MAX_S)
    assert max(d for _, d in sleeps) <= _POLL_MAX_S
    holder.close()
    waiter.close()


def test_unlink_if_held_never_gives_two_holders(lock_path):
    a, b, c = FileLock(lock_path), FileLock(lock_path), FileLock(lock_path)
    with pytest.raises(RuntimeError, match="must be held"):
        a.unlink_if_held()
    a.acquire()
    got_b = threading.Event()

    def wait_b():
        b.acquire(timeout=5)  # opens the current (soon unlinked) inode and polls it
        got_b.set()

    thread = threading.Thread(target=wait_b)
    thread.start()
    time.sleep(0.1)
    old_inode = os.stat(lock_path).st_ino
    assert a.unlink_if_held() is True
    assert not lock_path.exists()
    assert a.unlink_if_held() is False  # already gone
    c.acquire(timeout=1)  # a newcomer creates and locks a fresh file at the path
    new_inode = os.stat(lock_path).st_ino
    a.release()  # b now gets the *old* inode's lock; it must notice and retry on c's file
    time.sleep(0.3)
    assert not got_b.is_set(), "b took the lock on an unlinked file while c holds the live one"
    c.release()
    thread.join(timeout=5)
    assert got_b.is_set() and b.held
    assert new_inode != old_inode
    assert os.fstat(b._fd).st_ino == os.stat(lock_path).st_ino == new_inode  # b holds the live file
    b.close()
    c.close()
    a.close()


def test_unlink_if_held_then_release_lets_a_waiter_recreate(lock_path):
    a, b = FileLock(lock_path), FileLock(lock_path)
    a.acquire()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (b.acquire(timeout=5), done.set()))
    thread.start()
    time.sleep(0.1)
    a.unlink_if_held()
    a.release()
    thread.join(timeout=5)
    assert done.is_set() and b.held
    assert lock_path.exists()  # b recreated the file it now holds
    assert os.fstat(b._fd).st_ino == os.stat(lock_path).st_ino
    b.unlink_if_held()
    b.close()
    a.close()


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1", True])
def test_bad_timeouts_are_refused(lock_path, sem_name, timeout):
    with pytest.raises(ValueError, match="timeout"):
        FileLock(lock_path).acquire(timeout)
    lock = SemaphoreLock(sem_name)
    with pytest.raises(ValueError, match="timeout"):
        lock.acquire(timeout)
    lock.close()
    lock.unlink()


def test_semaphore_lock_basic_use_and_unlink(sem_name):
    lock = SemaphoreLock(sem_name)
    sem_file = f"/dev/shm/sem.{sem_name[1:]}"
    assert os.path.exists(sem_file)
    assert (os.stat(sem_file).st_mode & 0o777) == 0o600
    with lock:
        assert lock.held
        other = SemaphoreLock(sem_name)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=sem_name):
            other.acquire(timeout=0.2)
        assert 0.15 <= time.monotonic() - t0 < 1.0
        with pytest.raises(TimeoutError):
            other.acquire(timeout=0)
        with pytest.raises(RuntimeError, match="not re-entrant"):
            lock.acquire(timeout=0)
    other.acquire(timeout=0)
    other.release()
    other.close()
    assert lock.unlink() is True
    assert lock.unlink() is False
    assert not os.path.exists(sem_file)
    lock.close()
    lock.close()
    with pytest.raises(ValueError, match="closed"):
        lock.acquire(timeout=0)


def test_semaphore_lock_across_processes(sem_name):
    holder = _start_holder(SEM_HOLDER.format(name=sem_name))
    try:
        lock = SemaphoreLock(sem_name)
        with pytest.raises(TimeoutError, match=sem_name):
            lock.acquire(timeout=0.2)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        lock.acquire(timeout=5)
        assert holder.stdout.readline().strip() == "released"
        lock.release()
        lock.close()
    finally:
        holder.kill()
        holder.wait()


def test_semaphore_is_not_released_when_its_holder_dies(sem_name):
    # Documented trade-off of the semaphore backend: a SIGKILLed holder keeps it taken until it is unlinked.
    holder = _start_holder(SEM_HOLDER.format(name=sem_name))
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=10)
    lock = SemaphoreLock(sem_name)
    with pytest.raises(TimeoutError, match="not released when its holder dies"):
        lock.acquire(timeout=0.1)
    assert lock.unlink() is True
    lock.close()
    fresh = SemaphoreLock(sem_name)  # a new semaphore under the same name starts free
    fresh.acquire(timeout=0)
    fresh.close()
    fresh.unlink()


@pytest.mark.parametrize("name", ["noslash", "/a/b", "/", "", None])
def test_semaphore_bad_names(name):
    with pytest.raises(ValueError, match="semaphore name"):
        SemaphoreLock(name)


def test_make_lock(lock_path, sem_name):
    file_lock = make_lock("file", path=lock_path, timeout=1.0)
    assert isinstance(file_lock, FileLock) and file_lock.timeout == 1.0
    sem_lock = make_lock("semaphore", name=sem_name)
    assert isinstance(sem_lock, SemaphoreLock)
    sem_lock.close()
    sem_lock.unlink()
    with pytest.raises(ValueError, match="'file', 'semaphore'"):
        make_lock("flock", path=lock_path)
    with pytest.raises(ValueError, match="path="):
        make_lock("file", name=sem_name)
    with pytest.raises(ValueError, match="name="):
        make_lock("semaphore", path=lock_path)
