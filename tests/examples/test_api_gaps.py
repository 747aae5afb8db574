"""What a launcher needs from the public API: a supervisor cleans up with the workers' lock directory."""

from __future__ import annotations

from pathlib import Path

import pytest

import flextensor as ft


def test_cleanup_namespace_accepts_the_workers_lock_directory(namespace: str, tmp_path: Path) -> None:
    """A supervisor whose TMPDIR differs from its workers' (another container, a systemd unit with PrivateTmp)
    names their lock directory; nothing there is a no-op, and a directory that does not exist is an error."""
    workers = tmp_path / "workers-tmp" / "flextensor-0"
    with pytest.raises(FileNotFoundError, match="workers-tmp/flextensor-0.*does not exist"):
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["llm"], timeout=0, lock_dir=workers)
    workers.mkdir(parents=True)
    reports = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["llm"], timeout=0,
                                                        lock_dir=workers)
    assert reports[0].generation is None  # nothing there: a no-op
    assert sorted(p.name for p in workers.iterdir()) == []
