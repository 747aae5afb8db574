"""Isolation for every test: its own TMPDIR (hence its own lock directory) and namespace, and a hard check
that nothing it created is left in /dev/shm or the lock directory afterwards."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _remove_leftovers(names: set[str]) -> None:
    for name in names:
        try:
            os.unlink(SHM_DIR / name)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def isolated_host(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Give the test a private TMPDIR, daemon socket path and name token; fail it when it leaks resources.

    Anything that appears in /dev/shm during the test fails it. Only entries carrying the test's own token
    (every name derived from the ``namespace`` fixture does) are removed afterwards: entries of other
    processes on the host, such as a colleague's run or a live deployment, are reported, never deleted.
    """
    token = uuid.uuid4().hex[:10]
    request.node.ft_token = token
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", None)
    # No test talks to a daemon it did not start itself.
    monkeypatch.setenv("FT_DAEMON_SOCKET", str(tmp_path / "no-daemon" / "ftd.sock"))
    for key in [k for k in os.environ if k.startswith("FT_") and k != "FT_DAEMON_SOCKET"]:
        monkeypatch.delenv(key)
    before = _shm_entries()
    yield tmpdir
    leaked = _shm_entries() - before
    lock_dir = tmpdir / f"flextensor-{os.getuid()}"
    leaked_locks = sorted(p.name for p in lock_dir.iterdir()) if lock_dir.is_dir() else []
    _remove_leftovers({name for name in leaked if token in name})
    for name in leaked_locks:  # the lock directory is this test's own (its TMPDIR)
        try:
            (lock_dir / name).unlink()
        except OSError:
            pass
    assert not leaked, f"/dev/shm gained entries during this test (ours carry {token!r}): {sorted(leaked)}"
    assert not leaked_locks, f"test left files in the lock directory {lock_dir}: {leaked_locks}"


@pytest.fixture(autouse=True)
def release_managers(isolated_host: Path):
    """Every test releases every manager it created, even when it fails, before the leak check above."""
    yield
    api = sys.modules.get("flextensor.api")
    if api is not None:  # never imported for the shm and daemon tests, which must not load torch
        api.release_all()


@pytest.fixture
def namespace(request: pytest.FixtureRequest, isolated_host: Path) -> str:
    """A base namespace no other test uses; every POSIX name derived from it carries the test's token."""
    return f"t-{request.node.ft_token}"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session):
    """What the collection imports and builds (torch, transformers, every test module and item) lives as long as
    the run: the garbage collector stays off while it is made (each of its full collections would scan all of it
    again), then collects the collection's garbage once and moves the rest out of its sight, as the fork server
    does for its children. The full collections during the tests then scan only what the tests make; objects the
    tests make are collected as ever. About 9 s of full collections per run otherwise, on a 2-core host."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
        gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The fork servers the collected tests will fork their workers from (tests/helpers/forkserver.py) start now,
    so that their imports run beside the first tests instead of in front of the first worker. Those that import
    torch only where this process has torch imported already (a run of the shm and daemon tests alone never
    loads it)."""
    from tests.helpers import forkserver

    here, parts = Path(__file__).parent, set()
    for item in session.items:
        path = Path(str(item.path))
        if here in path.parents:
            parts.add(path.relative_to(here).parts[0])
    if parts & {"daemon", "shm"}:  # shm children, ftd and its workers, other users' scripts
        forkserver.prestart(forkserver.BARE)
    if "torch" not in sys.modules:
        return
    if parts & {"client", "daemon", "shm"}:  # session and checkpoint workers
        forkserver.prestart(forkserver.TORCH)
    if "examples" in parts:  # the examples' workers
        forkserver.prestart(forkserver.TRANSFORMERS)


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _dir_in_tmp(prefix: str, mode: int):
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(path, mode)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shared_dir():
    """A directory every uid can traverse (mode 0711; pytest's tmp_path is 0700), removed afterwards."""
    yield from _dir_in_tmp("ft-traverse-", 0o711)


@pytest.fixture
def shared_tmp():
    """A TMPDIR every uid can use, sticky like /tmp (mode 1777), as the deploy files set up for several users."""
    yield from _dir_in_tmp("ft-shared-", 0o1777)
