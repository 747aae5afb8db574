"""Participant identity: start time from /proc, liveness of dead/zombie/recycled processes, tokens, clock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import msgspec
import pytest

from flextensor.shm.identity import (
    ParticipantIdentity,
    boot_id,
    host_clock_ns,
    is_same_process_alive,
    pid_namespace,
    process_gone,
    process_start_time,
)


def _naive_start_time(pid: int) -> int:
    """Field 22 the simple way; only correct while comm has no spaces or parentheses."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().split()[21])


def test_current_identity_describes_this_process():
    me = ParticipantIdentity.current()
    assert me.pid == os.getpid()
    assert me.start_time == _naive_start_time(os.getpid()) == process_start_time(os.getpid())
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    assert 0 < me.start_time <= uptime_s * os.sysconf("SC_CLK_TCK") + 1
    assert me.boot_id == boot_id() == open("/proc/sys/kernel/random/boot_id").read().strip()
    uuid.UUID(me.boot_id)
    assert len(me.token) == 32 and int(me.token, 16) >= 0
    assert is_same_process_alive(me)


def test_each_handle_gets_its_own_token():
    a, b = ParticipantIdentity.current(), ParticipantIdentity.current()
    assert a.token != b.token
    assert (a.pid, a.start_time, a.boot_id) == (b.pid, b.start_time, b.boot_id)
    assert a != b


def test_identity_round_trips_through_msgspec():
    me = ParticipantIdentity.current()
    for encode, decode in ((msgspec.json.encode, msgspec.json.decode), (msgspec.msgpack.encode,
                                                                       msgspec.msgpack.decode)):
        assert decode(encode(me), type=ParticipantIdentity) == me
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"pid": "x", "start_time": 1, "boot_id": "b", "token": "t"}',
                            type=ParticipantIdentity)


def test_start_time_with_spaces_and_parentheses_in_comm():
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import sys
            with open("/proc/self/stat") as f:
                print(int(f.read().split()[21]), flush=True)      # before the rename: simple parse is right
            with open("/proc/self/comm", "w") as f:
                f.write("a) (b c) 9 9")
            print("renamed", flush=True)
            sys.stdin.readline()
            """
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        expected = int(child.stdout.readline())
        assert child.stdout.readline().strip() == "renamed"
        with open(f"/proc/{child.pid}/comm") as f:
            assert f.read().strip() == "a) (b c) 9 9"
        assert process_start_time(child.pid) == expected
        assert _naive_start_time(child.pid) != expected  # proves the name really breaks the naive split
    finally:
        child.kill()
        child.wait()


def _state(pid: int) -> str:
    """The process's state letter in /proc/<pid>/stat (R, S, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def test_dead_and_zombie_processes_are_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE)
    start = process_start_time(child.pid)
    assert start is not None
    ident = ParticipantIdentity(pid=child.pid, start_time=start, boot_id=boot_id(), token="00" * 16)
    assert is_same_process_alive(ident)
    os.kill(child.pid, signal.SIGKILL)
    # Not reaped yet: a zombie, which must count as gone. Waited for by its state, not by process_start_time,
    # which says gone already while the process is still exiting (state R, its teardown under way).
    deadline = time.monotonic() + 5
    while _state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(child.pid) == "Z"
    assert process_start_time(child.pid) is None
    assert not is_same_process_alive(ident)
    child.wait()
    assert process_start_time(child.pid) is None
    assert not is_same_process_alive(ident)


_TEARDOWN_CHILD = textwrap.dedent("""
    import mmap, sys
    size = 2 << 30
    memory = mmap.mmap(-1, size)
    memory.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages: a teardown long enough to be watched
    chunk = b"\\1" * (64 << 20)
    for offset in range(0, size, len(chunk)):
        memory[offset:offset + len(chunk)] = chunk
    print("ready", flush=True)
    sys.stdin.readline()
""")


def test_a_process_counts_as_gone_from_the_start_of_its_exit_not_from_its_zombie():
    # A SIGKILLed process first has its memory torn down (here 2 GiB of 4 KiB pages), then becomes a zombie;
    # it must count as gone during that teardown already, while /proc still shows it running.
    child = subprocess.Popen([sys.executable, "-c", _TEARDOWN_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        start = process_start_time(child.pid)
        assert start is not None and not process_gone(child.pid, start, boot_id(), pid_namespace())
        os.kill(child.pid, signal.SIGKILL)
        seen_exiting = []  # (state, process_start_time, process_gone) of samples showing the exit begun
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{child.pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except FileNotFoundError:
                break
            if fields[0] == "Z":
                break
            if int(fields[6]) & 0x4:  # PF_EXITING, field 9
                seen_exiting.append((fields[0], process_start_time(child.pid),
                                     process_gone(child.pid, start, boot_id(), pid_namespace())))
        assert seen_exiting, "the teardown of 2 GiB finished before it could be watched"
        assert all(start_time is None and gone for _state, start_time, gone in seen_exiting), seen_exiting
    finally:
        child.kill()
        child.wait()


def test_recycled_pid_or_other_boot_is_not_the_same_process():
    me = ParticipantIdentity.current()
    assert not is_same_process_alive(msgspec.structs.replace(me, start_time=me.start_time + 1))
    assert not is_same_process_alive(msgspec.structs.replace(me, boot_id=str(uuid.uuid4())))
    assert not is_same_process_alive(msgspec.structs.replace(me, pid=2**22 + 12345))  # beyond pid_max
    assert process_start_time(2**22 + 12345) is None
    for bad in (0, -1, True, "1"):
        with pytest.raises(ValueError, match="pid"):
            process_start_time(bad)


def test_host_clock_is_boottime_and_monotonic():
    a = host_clock_ns()
    b = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    c = host_clock_ns()
    assert a <= b <= c
    assert c - a < 1_000_000_000
    with open("/proc/uptime") as f:
        uptime_ns = float(f.read().split()[0]) * 1e9
    assert abs(c - uptime_ns) < 5e9  # CLOCK_BOOTTIME counts from boot, like /proc/uptime
