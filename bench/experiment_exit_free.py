"""Experiment: who pays for freeing the shared pages when the last worker exits right after ``close()``.

Why: once a namespace's names are removed, the pages of its files are freed by whichever process lets go of them
last, inside that process's exit when it exits right after ``close()``. ``flextensor.shm.background_release``
hands what is still mapped at exit to a small process of its own, which frees the pages after the worker has
ended. This measures, in fresh processes on a CPU (the CUDA registration is faked: what is timed is the
unmapping and the freeing, not the driver), the time from a worker's last line to its exit as its parent's
``waitpid`` sees it (and until ``/dev/shm`` has the space back), the worker holding ``--gib`` of one segment handed to the release thread and its name
removed, as after a session's ``close()``:

- ``kept``: the pages handed to the other process (the default);
- ``freed_here``: the same with that hand-over off (the threshold above the size), so the exit frees them.

Usage: ``python bench/experiment_exit_free.py [--gib 6] [--repeat 3]`` (root not needed; ``/dev/shm`` must hold
the size). One JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid

_WORKER = r"""
import sys, time
import flextensor.shm.background_release as release_mod
import flextensor.shm.segment as segment_mod
from flextensor.shm.segment import SharedSegment

segment_mod.host_register = lambda ptr, nbytes, read_only=False: None
segment_mod.host_unregister = lambda ptr: time.sleep(0.05)  # ranges still registered at exit, as a worker's
name, size, threshold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
release_mod.REAP_MIN_BYTES = threshold
segment = SharedSegment.create(name, size)
segment.buffer[:size] = b"\x07" * size  # written, as a creator's copy leaves it
for i in range(64):  # the release thread is at the second range or so when the process exits
    segment.pin(offset=i * (size // 64), nbytes=size // 64)
segment.close(background=True)
SharedSegment.unlink_name(name)  # what the last participant's close() does
print("exit", flush=True)
"""


def _free_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def one_exit(gib: float, threshold: int) -> tuple[float, float]:
    """The worker's exit after its last line, and the time until ``/dev/shm`` has the space back."""
    free = _free_bytes()
    name = f"/ftexitfree{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, name, str(int(gib * 64) << 24), str(threshold)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    begin = time.perf_counter()
    proc.wait()
    exited = time.perf_counter() - begin
    if line.strip() != "exit" or proc.returncode:
        raise RuntimeError(f"worker failed ({proc.returncode})")
    while _free_bytes() < free and time.perf_counter() - begin < 60:
        time.sleep(0.005)
    return exited, time.perf_counter() - begin


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=6)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    for mode, threshold in (("kept", 0), ("freed_here", 1 << 62)):
        runs = [one_exit(args.gib, threshold) for _ in range(args.repeat)]
        print(json.dumps({"mode": mode, "gib": args.gib,
                          "exit_s_median": round(statistics.median(r[0] for r in runs), 3),
                          "space_back_s_median": round(statistics.median(r[1] for r in runs), 3),
                          "exit_s": [round(r[0], 3) for r in runs], "cpus": os.cpu_count()}), flush=True)


if __name__ == "__main__":
    main()
