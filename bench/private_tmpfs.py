"""Running a benchmark's work on a tmpfs of its own, in a private mount namespace (root, ``unshare(1)``).

Why: the page-size benchmarks and experiments compare the same work on 4 KiB pages and on a tmpfs mounted
``huge=always``; each mode gets a tmpfs of the same size that only the mount options tell apart, mounted where
nothing else on the host can see it, and gone with the namespace when the work ends. Each run starts from
compacted free memory, so a run does not pay for the previous one's fragmentation when it asks for 2 MiB pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

__all__ = ["TMPFS_MODES", "compact_memory", "run_on_tmpfs", "last_json_line", "run_variants"]

#: Mount options appended per page mode.
TMPFS_MODES = {"4 KiB": "", "huge=always": ",huge=always"}


def compact_memory() -> float | None:
    """Ask the kernel to compact free memory (root); returns the seconds it took, None where it cannot."""
    begin = time.monotonic()
    try:
        with open("/proc/sys/vm/compact_memory", "w") as f:
            f.write("1")
    except OSError:
        return None
    return time.monotonic() - begin


def run_on_tmpfs(directory: str, size_mib: int, options: str, argv: Sequence[str], *, after: str = "",
                 **run_kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``argv`` with a tmpfs of ``size_mib`` MiB (mode 1777, ``options`` appended, e.g. ``,huge=always``)
    mounted at ``directory`` in a private mount namespace; ``after`` is shell run once ``argv`` ended (before
    the namespace, and the mount with it, goes). Output is captured as text."""
    mount = f"mount -t tmpfs -o size={size_mib}m,mode=1777{options} tmpfs {directory}"
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                           f'{mount} && "$@"; code=$?; {after}exit $code', "sh", *argv],
                          capture_output=True, text=True, **run_kwargs)


def last_json_line(proc: subprocess.CompletedProcess, tail: int = 2000) -> dict:
    """The last line of ``proc``'s output that is a JSON object, else ``{"error": <its stderr's tail>}``."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": proc.stderr[-tail:]}


def run_variants(script: str, name: str, modes: Sequence[str], variants: Sequence[str], repeat: int, size_mib: int,
                 child_args: Sequence[str]) -> None:
    """An experiment's runs: for each page mode (:data:`TMPFS_MODES`), ``repeat`` times each variant, in a fresh
    ``python script *child_args --child DIR VARIANT`` on its own tmpfs at ``DIR``; prints one JSON line per run
    (mode, variant and what the child printed last)."""
    for mode in modes:
        for _ in range(repeat):
            for variant in variants:
                compact_memory()
                directory = f"/tmp/{name}-{os.getpid()}"
                os.makedirs(directory, exist_ok=True)
                try:
                    proc = run_on_tmpfs(directory, size_mib, TMPFS_MODES[mode],
                                        [sys.executable, script, *child_args, "--child", directory, variant])
                finally:
                    os.rmdir(directory)
                print(json.dumps({"mode": mode, "variant": variant, **last_json_line(proc, 500)}), flush=True)
