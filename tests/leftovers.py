"""What a test's namespace still has in /dev/shm: shared by the shm, client and daemon tests."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"


def shm_names(namespace: str) -> list[str]:
    """Entries of /dev/shm that carry ``namespace`` (segments, and semaphores as ``sem.<name>``), sorted."""
    return sorted(n for n in os.listdir(SHM_DIR) if namespace in n)
