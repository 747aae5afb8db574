"""Hostile input and foreign users: garbage frames keep the daemon serving; another uid is refused."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flextensor.shm import ftd_protocol as proto
from flextensor.shm.names import manager_namespace

from tests.daemon.helpers import Daemon, wait_until
from tests.helpers.other_user import run_as_user
from tests.leftovers import shm_names

NOBODY = 65534


def _ask_raw(socket_path: Path, frames: list[bytes], timeout_ms: int = 2000) -> list[bytes] | None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{socket_path}")
        s.send_multipart(frames)
        if not s.poll(timeout_ms):
            return None
        return s.recv_multipart()
    finally:
        s.close(0)


def _error_code(reply: list[bytes]) -> str:
    decoded = proto.decode_reply(reply[-1])
    assert isinstance(decoded, proto.ErrorReply), decoded
    return decoded.code


def test_garbage_frames_get_error_replies_and_the_daemon_keeps_serving(daemon):
    sock = daemon.socket
    cases = [
        ([b"\xff\x00garbage"], "bad_request"),
        ([b""], "bad_request"),
        ([msgspec.msgpack.encode([1, 2, 3])], "bad_request"),
        ([msgspec.msgpack.encode({"type": "status", "v": 99})], "unsupported_version"),
        ([msgspec.msgpack.encode({"type": "launch_missiles", "v": 1})], "bad_request"),
        ([proto.encode(proto.ReleaseRequest(namespace="x"))[:-1]], "bad_request"),  # truncated
        ([msgspec.msgpack.encode({"type": "release", "v": 1, "namespace": "../../etc"})], "bad_request"),
        ([b"a", b"b", b"c"], "bad_request"),  # too many frames
        ([b"x" * (proto.MAX_FRAME_BYTES + 1)], "too_large"),
    ]
    for frames, code in cases:
        reply = _ask_raw(sock, frames)
        assert reply is not None, frames[:1]
        assert _error_code(reply) == code, frames[0][:40]
    # A REQ-style envelope (empty delimiter) is answered in kind.
    reply = _ask_raw(sock, [b"", proto.encode(proto.StatusRequest())])
    assert reply[0] == b"" and isinstance(proto.decode_reply(reply[-1]), proto.StatusReply)
    # Beyond the hard limit libzmq drops the connection: no reply, no memory blow-up, still serving.
    assert _ask_raw(sock, [b"y" * (proto.HARD_FRAME_LIMIT + 1024)], timeout_ms=500) is None
    assert daemon.answers()
    assert daemon.proc.poll() is None


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
_tags = st.sampled_from(["status", "ls", "register", "unregister", "drain", "hold", "release", "cleanup", "ok", "x"])


@st.composite
def _near_valid(draw):
    """Maps that look like requests (right tag and version) with random field values."""
    body = draw(st.dictionaries(st.sampled_from(["namespace", "namespaces", "slot_index", "identity", "lock_dir",
                                                 "timeout", "base", "managers", "undo"]), _msgpack_values, max_size=5))
    return msgspec.msgpack.encode({"type": draw(_tags), "v": draw(st.sampled_from([1, 1, 1, 0, 2])), **body})


def test_fuzz_random_bytes_and_msgpack(daemon):
    sock = daemon.socket
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{sock}")

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.one_of(st.binary(max_size=300), _msgpack_values.map(msgspec.msgpack.encode), _near_valid()))
    def hammer(frame: bytes) -> None:
        s.send(frame)
        assert s.poll(3000), f"no reply to {frame[:60]!r}"
        reply = proto.decode_reply(s.recv())  # every reply is a valid protocol message
        if not isinstance(reply, proto.ErrorReply):
            assert isinstance(reply, (proto.StatusReply, proto.ListReply, proto.OkReply, proto.CleanupReply))

    try:
        hammer()
    finally:
        s.close(0)
    assert daemon.answers() and daemon.proc.poll() is None
    assert "Traceback" not in daemon.read_log()


def _cli_as_nobody(socket_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the ftd CLI with uid/gid 65534. The checkout, its venv or the interpreter may be root-only (a clone in
    a 0700 folder), so the child starts as root, imports what it needs, then drops to nobody *before* it connects
    (SO_PEERCRED records the credentials at connect time): tests/helpers/other_user.py."""
    argv = list(args) + ["--socket", str(socket_path), "--json"]
    return run_as_user(NOBODY, f"sys.exit(cli.main({argv!r}))\n", tmpdir="/tmp", timeout=30,
                       extra_modules=["zmq", "flextensor.daemon.cli", "flextensor.daemon.config",
                                      "flextensor.daemon.lockdirs"],
                       # argparse imports gettext/locale lazily: build the parser while the stdlib is readable
                       prepare="import flextensor.daemon.cli as cli\ncli.build_parser()\n")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as another uid")
def test_another_uid_is_refused(shared_dir, lock_dir, workers, namespace):
    import json

    sock = shared_dir / "run" / "ftd.sock"
    daemon = Daemon(sock, lock_dir, extra=["--socket-group", str(NOBODY)]).start()
    try:
        w = workers(namespace, "m", "--lease", "5", socket=sock)
        w.wait_event("published")
        assert daemon.cli("hold", namespace, "--manager", "m")[1]["ok"] is True
        # Read-only commands are open to whoever can connect (the socket group)...
        ls = _cli_as_nobody(sock, "ls")
        assert ls.returncode == 0, ls.stderr
        assert len(json.loads(ls.stdout)) == 1
        # ...but changing someone else's namespace is refused, whatever the client claims.
        for args in (["drain", namespace, "--manager", "m"], ["hold", namespace, "--manager", "m", "--lock-dir",
                                                              str(lock_dir)],
                     ["release", namespace, "--manager", "m"],
                     ["cleanup", namespace, "--manager", "m", "--lock-dir", str(lock_dir)]):
            result = _cli_as_nobody(sock, *args)
            assert result.returncode == 1, (args, result.stdout, result.stderr)
            reply = json.loads(result.stdout)
            assert reply["error"] == "forbidden", (args, reply)
            assert "uid 0" in reply["message"] and f"uid {NOBODY}" in reply["message"], reply
        assert daemon.cli("status")[1]["held"] and not daemon.cli("status")[1]["draining"]
        # The owner can do it.
        assert "reclaimed" not in daemon.cli("release", namespace, "--manager", "m")[1]["message"]
        w.close()
    finally:
        daemon.stop()
    # Without the socket group the other uid cannot even connect.
    private = Daemon(shared_dir / "private" / "ftd.sock", lock_dir).start()
    try:
        result = _cli_as_nobody(private.socket, "status")
        assert result.returncode == 1 and json.loads(result.stdout)["up"] is False
        assert "Permission denied" in result.stderr or "cannot" in result.stderr
    finally:
        private.stop()
    assert shm_names(namespace) == []


def _root_daemon_and_shared_tmp(shared_dir, lock_dir):
    """A daemon whose socket uid 65534 may use, and a world-writable (sticky) TMPDIR for that user's worker."""
    sock = shared_dir / "run" / "ftd.sock"
    tmp = shared_dir / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    return sock, tmp, Daemon(sock, lock_dir, extra=["--socket-group", str(NOBODY)]).start()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a worker as another uid")
def test_root_daemon_reclaims_for_another_user_as_that_user(shared_dir, lock_dir, workers, namespace):
    """A worker of uid 65534 registers with a root daemon (socket group), then is SIGKILLed: the daemon ends its
    lease and reclaims with that user's identity (its lock directory is learned from the registration)."""
    sock, tmp, daemon = _root_daemon_and_shared_tmp(shared_dir, lock_dir)
    try:
        env = dict(os.environ, TMPDIR=str(tmp))
        w = workers(namespace, "m", "--lease", "30", "--as-uid", str(NOBODY), socket=sock, env=env)
        assert w.wait_event("joined")["registered"] is True, w.stderr()
        w.wait_event("published")
        names = shm_names(manager_namespace(namespace, "m"))
        assert names and all(os.stat(f"/dev/shm/{n}").st_uid == NOBODY for n in names)
        foreign_lock_dir = tmp / f"flextensor-{NOBODY}"
        status = daemon.cli("status")[1]
        assert str(foreign_lock_dir) in status["lock_dirs"] and status["registered"] == 1
        t0 = time.monotonic()
        w.signal(signal.SIGKILL)
        assert wait_until(lambda: shm_names(manager_namespace(namespace, "m")) == [], 2.0)
        assert time.monotonic() - t0 < 2.0
        assert wait_until(lambda: not any(foreign_lock_dir.iterdir()), 1.0), list(foreign_lock_dir.iterdir())
        assert os.getuid() == 0 and daemon.answers()  # it switched back
        w.kill()
        assert wait_until(lambda: "(death)" in daemon.read_log(), 2.0), daemon.read_log()  # logged after the cleanup
        log = daemon.read_log()
        assert "Traceback" not in log, log
    finally:
        daemon.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="switching the effective uid needs root")
def test_acting_in_switches_only_the_effective_ids(shared_dir):
    """A root daemon acts for a user with its effective uid/gid only: the real and saved uids stay root (the
    user can neither signal nor trace it), files it creates belong to the user, and root comes back."""
    from flextensor.daemon.lockdirs import LockDir, acting_in, inspect_lock_dir

    directory = shared_dir / f"flextensor-{NOBODY}"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, NOBODY)
    lock_dir = inspect_lock_dir(directory)
    groups = os.getgroups()
    with acting_in(lock_dir):
        assert os.getresuid() == (0, NOBODY, 0)
        assert os.getresgid()[1] == lock_dir.gid and os.getgroups() == []
        os.close(os.open(directory / "made", os.O_CREAT | os.O_WRONLY, 0o600))
        with pytest.raises(PermissionError):
            os.open(shared_dir / "root-only", os.O_CREAT | os.O_WRONLY, 0o600)  # really acting as the user
        with acting_in(lock_dir):  # re-entrant for the same owner
            assert os.geteuid() == NOBODY
        with pytest.raises(RuntimeError, match=f"acting for uid {NOBODY} already"):
            with acting_in(LockDir(str(shared_dir), 0, 0)):
                pass
    assert os.getresuid() == (0, 0, 0) and os.getgroups() == groups and os.getegid() == 0
    st = os.stat(directory / "made")
    assert (st.st_uid, st.st_gid) == (NOBODY, lock_dir.gid)
    with pytest.raises(ZeroDivisionError):
        with acting_in(lock_dir):
            1 / 0  # noqa: B018 - an error in the body still gives root back
    assert os.getresuid() == (0, 0, 0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a worker as another uid")
def test_root_daemon_recreates_lock_files_as_the_namespace_owner(shared_dir, lock_dir, workers, namespace):
    """`ftd hold` re-creates a missing coordinator lock file for a namespace of uid 65534: the file must belong
    to that user, or its workers could no longer take the lock (their clean close would fail)."""
    sock, tmp, daemon = _root_daemon_and_shared_tmp(shared_dir, lock_dir)
    try:
        ns = manager_namespace(namespace, "m")
        w = workers(namespace, "m", "--lease", "30", "--as-uid", str(NOBODY), socket=sock,
                    env=dict(os.environ, TMPDIR=str(tmp)))
        assert w.wait_event("joined")["registered"] is True, w.stderr()
        w.wait_event("published")
        foreign_lock_dir = tmp / f"flextensor-{NOBODY}"
        lock_file = foreign_lock_dir / f"{ns}.lock"
        assert os.stat(lock_file).st_uid == NOBODY
        lock_file.unlink()  # e.g. removed by a careless tmp cleaner while the job runs
        _, reply, _ = daemon.cli("hold", namespace, "--manager", "m", "--lock-dir", str(foreign_lock_dir))
        assert reply["ok"] is True
        st = os.stat(lock_file)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), (st.st_uid, st.st_gid)
        uids = [line for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")]
        assert uids == ["Uid:\t0\t0\t0\t0"]
        assert w.close() == 0, w.stderr()  # the worker's close takes the lock file the daemon created
        assert w.wait_event("closed")
        assert shm_names(ns)  # the hold keeps the generation
        _, released, _ = daemon.cli("release", namespace, "--manager", "m")
        assert "generation 1 reclaimed" in released["message"], released
        assert shm_names(ns) == [] and list(foreign_lock_dir.iterdir()) == []
        assert "Traceback" not in daemon.read_log()
    finally:
        daemon.stop()
