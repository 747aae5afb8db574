"""The daemon's request table: every request type of the wire protocol has a handler, and only those do."""

from __future__ import annotations

import typing
from pathlib import Path

from flextensor.daemon.handlers import Peer, RequestHandler
from flextensor.daemon.metrics import DaemonMetrics
from flextensor.daemon.reaper import Reaper
from flextensor.daemon.registry import Registry
from flextensor.shm import ftd_protocol as proto


def _handler(lock_dir: Path) -> RequestHandler:
    metrics = DaemonMetrics()
    registry = Registry([str(lock_dir)], metrics)
    return RequestHandler(registry, Reaper(registry, metrics), {"version": "test", "socket": "", "started": 0.0,
                                                                "metrics": metrics})


def test_every_request_type_has_one_handler(tmp_path: Path) -> None:
    handler = _handler(tmp_path)
    assert set(handler.handlers) == set(typing.get_args(proto.Request))
    assert len(set(handler.handlers.values())) == len(handler.handlers)  # no two types share a handler by mistake


def test_a_request_is_answered_by_its_type(tmp_path: Path) -> None:
    handler = _handler(tmp_path)
    status = handler.handle(proto.StatusRequest(), Peer(uid=0, gid=0, pid=1), [])
    assert isinstance(status, proto.StatusReply) and status.version == "test"
    assert isinstance(handler.handle(proto.ListRequest(), None, []), proto.ListReply)
    refused = handler.handle(proto.ReleaseRequest(namespace="ftnone-0123456789abcdef"), None, [])
    assert isinstance(refused, proto.ErrorReply) and refused.code == "forbidden"  # no credentials: refused
