"""Running a scenario beside a file system of huge pages: a tmpfs mounted ``huge=always`` or a hugetlbfs.

Why a subprocess: mounting needs root, and a mount made by the test process would outlive a killed run. So
:func:`run_mounted` runs ``tests.helpers.huge_scenarios`` under ``unshare -m`` (a private mount namespace):
the mount exists only for that process and its children (the workers it starts) and disappears with them,
whatever happens. The scenario prints one JSON line of facts; the test asserts on them.

hugetlbfs needs huge pages reserved host-wide (``/proc/sys/vm/nr_hugepages``): :func:`reserved_huge_pages` raises
the pool by what the test needs, as root, and gives back exactly that afterwards; where that is not possible the
test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.forkserver import fork_env

REPO = Path(__file__).resolve().parents[2]
THP = Path("/sys/kernel/mm/transparent_hugepage")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
FREE_2M = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
#: The scenarios that start session workers (``huge_scenarios._worker``).
WORKER_SCENARIOS = ("session", "crash", "mismatch")


def mount_unavailable() -> str | None:
    """Why this host cannot run the scenarios (None when it can)."""
    if os.geteuid() != 0:
        return "mounting a tmpfs with huge=always needs root (in a private mount namespace, unshare -m)"
    if shutil.which("unshare") is None:
        return "unshare(1) is missing"
    if not (THP / "shmem_enabled").exists():
        return "this kernel has no transparent huge pages for tmpfs (no /sys/kernel/mm/transparent_hugepage/shmem_enabled)"
    return None


def mount_command(fs: str, directory: str, size: str) -> str:
    """The shell command that mounts ``fs`` at ``directory`` (mode 1777, like /dev/shm)."""
    if fs == "tmpfs":
        return f"mount -t tmpfs -o size={size},huge=always,mode=1777 tmpfs {directory}"
    if fs == "hugetlbfs":
        return f"mount -t hugetlbfs -o pagesize=2M,size={size},mode=1777 none {directory}"
    raise ValueError(f"unknown file system {fs!r}")


def run_mounted(fs: str, directory: Path, scenario: str, *args: str, size: str = "256m", timeout: float = 120.0,
                env: dict[str, str] | None = None) -> dict:
    """Mount ``fs`` at ``directory`` in a private mount namespace and run ``scenario`` (of
    ``tests.helpers.huge_scenarios``) there with the directory as its first argument; its JSON report."""
    reason = mount_unavailable()
    if reason:
        pytest.skip(reason)
    directory.mkdir(parents=True, exist_ok=True)
    script = f'{mount_command(fs, str(directory), size)} && exec "$@"'
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
           sys.executable, "-m", "tests.helpers.huge_scenarios", scenario, str(directory), *args]
    env = dict(os.environ if env is None else env)
    if scenario in WORKER_SCENARIOS:  # the scenario forks its workers as the test process would (no CUDA)
        env = fork_env(env)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, (f"scenario {scenario} on {fs} exited {proc.returncode}\n"
                                            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}")
    report = json.loads(lines[-1])
    report["stderr"] = proc.stderr
    return report


@contextlib.contextmanager
def reserved_huge_pages(pages: int) -> Iterator[None]:
    """At least ``pages`` free 2 MiB huge pages for the block (the pool raised by what is missing, and lowered by
    exactly as much afterwards); skips the test, naming why, where the pool cannot grow."""
    reason = mount_unavailable()
    if reason:
        pytest.skip(reason)
    try:
        free = int(FREE_2M.read_text())
        total = int(NR_HUGEPAGES.read_text())
    except (OSError, ValueError) as exc:
        pytest.skip(f"this kernel has no 2 MiB hugetlb pages to reserve ({exc})")
    missing = max(0, pages - free)
    if missing:
        try:
            NR_HUGEPAGES.write_text(str(total + missing))
        except OSError as exc:
            pytest.skip(f"cannot reserve {missing} huge pages in {NR_HUGEPAGES} ({exc.strerror})")
        if int(FREE_2M.read_text()) < pages:
            NR_HUGEPAGES.write_text(str(total))
            pytest.skip(f"the kernel found only {int(FREE_2M.read_text())} free 2 MiB pages of the {pages} needed "
                        "(fragmented memory)")
    try:
        yield
    finally:
        if missing:
            NR_HUGEPAGES.write_text(str(max(0, int(NR_HUGEPAGES.read_text()) - missing)))
