"""Fixtures of the daemon tests: a real ``ftd`` on a private socket, watching the test's lock directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.daemon.helpers import Daemon, Worker


@pytest.fixture
def lock_dir(isolated_host: Path) -> Path:
    """The lock directory the test's workers will use (TMPDIR/flextensor-<uid>; created by them)."""
    return isolated_host / f"flextensor-{os.getuid()}"


@pytest.fixture
def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "ftd.sock"


@pytest.fixture
def daemon(socket_path: Path, lock_dir: Path):
    d = Daemon(socket_path, lock_dir).start()
    yield d
    d.stop()


@pytest.fixture
def workers():
    """Factory of workers; any still running at teardown are closed cleanly (then killed)."""
    started: list[Worker] = []

    def make(*args, **kwargs) -> Worker:
        w = Worker(*args, **kwargs)
        started.append(w)
        return w

    yield make
    for w in started:
        if w.proc.poll() is None:
            try:
                w.close(timeout=5)
            except Exception:  # noqa: BLE001
                w.kill()
