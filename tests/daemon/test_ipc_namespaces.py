"""Two IPC namespaces elect independent creators for the same namespace name (the multi-host picture).

What separates two "hosts" for flextensor is everything its names live in:

* POSIX semaphores and SysV IPC: the IPC namespace (``unshare --ipc``);
* ``/dev/shm`` segments: ``/dev/shm`` is a *filesystem* (tmpfs), not part of the IPC namespace, so an IPC
  namespace alone still shares the host's segments. A private ``/dev/shm`` needs a mount namespace with its
  own tmpfs (``unshare --ipc --mount`` + ``mount -t tmpfs tmpfs /dev/shm``) — which is what a container
  without ``hostIPC`` / ``ipc: host`` gets;
* the lock directory (journal, coordinator lock): under ``TMPDIR``, so each side needs its own ``TMPDIR``
  (a container has its own ``/tmp``).

Each side below gets all three; both then elect a creator of generation 1 of the very same per-manager
namespace at the same time, while the host's ``/dev/shm`` never sees their segments.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from flextensor.shm.names import manager_namespace

from tests.daemon.helpers import Worker
from tests.leftovers import shm_names


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare(1) is not installed"
    probe = subprocess.run(["unshare", "--ipc", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --ipc --mount is not permitted here: {probe.stderr.strip()}"
    return None


_SKIP = _unshare_works() if os.getuid() == 0 else "needs root for unshare and mount"


@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_two_ipc_namespaces_elect_independent_creators(isolated_host, namespace):
    ns = manager_namespace(namespace, "m")
    prefix = ["unshare", "--ipc", "--mount", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]
    sides = []
    for name in ("host-a", "host-b"):
        tmp = isolated_host / name
        tmp.mkdir()
        env = dict(os.environ, TMPDIR=str(tmp))
        sides.append(Worker(namespace, "m", "--lease", "5", env=env, cmd_prefix=prefix))
    joined = [w.wait_event("joined") for w in sides]
    published = [w.wait_event("published") for w in sides]  # both alive at once, each the creator
    assert [j["creator"] for j in joined] == [True, True]
    assert [j["generation"] for j in joined] == [1, 1]
    assert [j["namespace"] for j in joined] == [ns, ns]
    assert published[0]["checksum"] == published[1]["checksum"]
    assert shm_names(ns) == []  # the host's /dev/shm never saw them
    for w in sides:
        assert w.close() == 0
        assert w.has("closed")
    for name in ("host-a", "host-b"):
        lock_dir = isolated_host / name / f"flextensor-{os.getuid()}"
        assert not lock_dir.exists() or not any(lock_dir.iterdir())
