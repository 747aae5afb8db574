"""The wire protocol (msgspec tagged union) and the best-effort client, without a daemon."""

from __future__ import annotations

import logging
import os
import socket
import time

import msgspec
import pytest

from flextensor.shm import ftd_client
from flextensor.shm import ftd_protocol as proto
from flextensor.shm.identity import ParticipantIdentity


def test_every_message_round_trips():
    identity = ParticipantIdentity.current()
    messages = [
        proto.StatusRequest(),
        proto.ListRequest(),
        proto.RegisterRequest(namespace="ftx-0123456789abcdef", slot_index=3, identity=identity, lock_dir="/tmp/x",
                              base="x", manager="m"),
        proto.UnregisterRequest(namespace="ftx-0123456789abcdef", slot_index=3, identity=identity),
        proto.DrainRequest(namespaces=["a"], base="b", managers=["m"], undo=True),
        proto.HoldRequest(namespace="a", lock_dir="/l"),
        proto.ReleaseRequest(namespace="a"),
        proto.CleanupRequest(namespaces=["a", "b"], lock_dir="/l", timeout=1.5),
    ]
    for message in messages:
        frame = proto.encode(message)
        assert proto.decode_request(frame) == message
        assert msgspec.msgpack.decode(frame)["v"] == proto.PROTOCOL_VERSION
    replies = [
        proto.OkReply(message="x"),
        proto.ErrorReply(code="forbidden", message="no"),
        proto.ListReply(rows=[proto.GenerationRow(namespace="n", manager=None, generation=2, state="READY",
                                                  participants=3, bytes=4096, age=1.5)]),
        proto.CleanupReply(reports=[proto.CleanupRow(namespace="n", generation=None, removed=[], already_absent=[],
                                                     waited_s=0.0)]),
    ]
    for reply in replies:
        assert proto.decode_reply(proto.encode(reply)) == reply


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"", "bad_request"),
        (b"\xc1", "bad_request"),  # never-used msgpack byte
        (msgspec.msgpack.encode(42), "bad_request"),
        (msgspec.msgpack.encode({"type": "status"}), "bad_request"),  # no version
        (msgspec.msgpack.encode({"type": "status", "v": 2}), "unsupported_version"),
        (msgspec.msgpack.encode({"type": "nope", "v": 1}), "bad_request"),
        (msgspec.msgpack.encode({"type": "ok", "v": 1}), "bad_request"),  # a reply is not a request
        (msgspec.msgpack.encode({"type": "status", "v": 1, "extra": 1}), "bad_request"),
        (msgspec.msgpack.encode({"type": "release", "v": 1}), "bad_request"),  # missing field
        (msgspec.msgpack.encode({"type": "release", "v": 1, "namespace": 7}), "bad_request"),
        (proto.encode(proto.ReleaseRequest(namespace="abc"))[:-2], "bad_request"),  # truncated
        (b"\x00" * (proto.MAX_FRAME_BYTES + 1), "too_large"),
    ],
)
def test_malformed_requests_are_named(frame, code):
    with pytest.raises(proto.ProtocolDecodeError) as info:
        proto.decode_request(frame)
    assert info.value.code == code
    assert code in proto.ERROR_CODES


def test_socket_path_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(tmp_path / "x.sock"))
    assert ftd_client.daemon_socket_path() == str(tmp_path / "x.sock")
    monkeypatch.delenv("FT_DAEMON_SOCKET")
    expected = "/run/flextensor/ftd.sock" if os.getuid() == 0 else None
    if expected:
        assert ftd_client.daemon_socket_path() == expected


def _register(identity):
    return ftd_client.register_participant("ftx-0123456789abcdef", 0, identity, "/nonexistent")


def test_register_without_daemon_is_fast_false_and_logs_one_debug_line(tmp_path, monkeypatch, caplog):
    identity = ParticipantIdentity.current()
    monkeypatch.setattr(ftd_client, "_missed_once", False)
    caplog.set_level(logging.DEBUG, logger="flextensor.shm.ftd_client")
    # 1. no socket file at all
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(tmp_path / "absent" / "ftd.sock"))
    t0 = time.perf_counter()
    assert _register(identity) is False
    assert time.perf_counter() - t0 < 0.05
    # 2. a stale socket file (its listener is gone): ECONNREFUSED at once, no 200 ms timeout
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(stale))
    t0 = time.perf_counter()
    assert _register(identity) is False
    assert ftd_client.unregister_participant("ftx-0123456789abcdef", 0, identity) is False
    assert time.perf_counter() - t0 < 0.05
    # 3. a regular file where the socket should be
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(plain))
    assert _register(identity) is False
    lines = [r for r in caplog.records if r.name == "flextensor.shm.ftd_client"]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG, [r.getMessage() for r in lines]
    assert not ftd_client.daemon_available(str(stale))
    with pytest.raises(ftd_client.DaemonUnavailableError, match="stale socket"):
        ftd_client.request(proto.StatusRequest(), 1.0, path=str(stale))


def test_a_listener_that_never_answers_costs_about_200_ms(tmp_path, monkeypatch):
    """Something accepts connections but never replies (a hung daemon): registration gives up in ~200 ms."""
    path = tmp_path / "hung.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(path))
    try:
        t0 = time.perf_counter()
        assert _register(ParticipantIdentity.current()) is False
        elapsed = time.perf_counter() - t0
    finally:
        listener.close()
    assert 0.15 <= elapsed < 1.0, elapsed
