"""What another user's interference costs a job: the allocation gate held, and generation names squatted.

    sudo python bench/bench_other_users.py [--repeat 5] [--size-mib 256] [--no-docs]

Needs root (it plays uid 65534, the other user, and uid 65533, a non-root owner); run it in a private
``/dev/shm`` (``unshare -m`` and a tmpfs) to keep other jobs of the host out of the numbers. Scenarios, each
against a root owner and a non-root owner, alternating with the same scenario undisturbed so that both see the
same machine (in both orders: a run right after another pays for the pages that one freed):

1. gate held: uid 65534 holds the ``flock`` on ``/dev/shm`` (the allocation gate) for the whole run; a creator
   makes one namespace of ``--size-mib`` and publishes it (``ShmCoordinator`` to READY). Goal: <= 1.1x the
   undisturbed time (before, every creator waited 120 s per segment of 1 MiB or more).
2. squatted restart: a job runs generation 1, uid 65534 creates the five names of generation 2, the job is
   SIGKILLed and restarted: time of the restart to READY (it reclaims generation 1 and skips 2) against a
   restart after the same crash with no squat.

The lock directory, the foreign job and the drain attacks have no timing to speak of; the tests
(tests/shm/test_other_users.py, tests/daemon/test_daemon_other_users.py) say they work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import docs_body, machine_description, write_docs_section  # noqa: E402

from flextensor.shm.names import manager_namespace  # noqa: E402
from flextensor.shm.segment import SharedSegment  # noqa: E402

from tests.helpers.other_user import run_as_user, start_as_user  # noqa: E402

OTHER, NON_ROOT = 65534, 65533

_TO_READY = """
from flextensor.shm.coordinator import ShmCoordinator
start = time.monotonic()
c = ShmCoordinator({ns!r}, lease_seconds=5, timeout=30)
c.memory_owner.create_segment("sd", {size}).close()
c.notify_ready()
elapsed = time.monotonic() - start
print(json.dumps({{"generation": c.generation, "s": elapsed}}), flush=True)
if {keep!r}:
    sys.stdin.read()
else:
    c.close()
"""


def _hold_gate() -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import fcntl, os, sys
        os.setgroups([]); os.setgid({OTHER}); os.setuid({OTHER})
        fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _to_ready(uid: int, ns: str, size: int, tmpdir: Path) -> dict:
    run = run_as_user(uid, _TO_READY.format(ns=ns, size=size, keep=False), tmpdir=str(tmpdir), timeout=600)
    if run.returncode != 0:
        raise RuntimeError(run.stderr)
    return json.loads(run.stdout)


def gate(uid: int, size: int, tmpdir: Path, held: bool) -> float:
    ns = manager_namespace(f"bench-{uuid.uuid4().hex[:10]}", "m")
    holder = _hold_gate() if held else None
    try:
        return _to_ready(uid, ns, size, tmpdir)["s"]
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def gate_pass_ms(held: bool, repeat: int = 200) -> float:
    """Median cost of passing the gate itself (acquire + release, a 4 MiB segment), in this process."""
    import logging
    import time

    from flextensor.shm import allocation_gate

    logging.getLogger("flextensor.shm.allocation_gate").setLevel(logging.ERROR)  # one WARNING per holder: not timed
    holder = _hold_gate() if held else None
    try:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            allocation_gate.release(allocation_gate.acquire("/dev/shm", 4 << 20))
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def restart(uid: int, size: int, tmpdir: Path, squat: bool) -> float:
    ns = manager_namespace(f"bench-{uuid.uuid4().hex[:10]}", "m")
    names = [f"/{ns}.g2.{kind}" for kind in ("h", "sd", "sm", "p", "b0")]
    job = start_as_user(uid, _TO_READY.format(ns=ns, size=size, keep=True), tmpdir=str(tmpdir))
    try:
        assert json.loads(job.stdout.readline())["generation"] == 1, job.stderr.read()
        if squat:
            made = run_as_user(OTHER, "from flextensor.shm.segment import SharedSegment\n"
                                      f"for name in {names!r}:\n    SharedSegment.create(name, 4096).close()\n",
                               tmpdir="/tmp")
            assert made.returncode == 0, made.stderr
        job.kill()
        job.wait()
        again = _to_ready(uid, ns, size, tmpdir)
        assert again["generation"] == (3 if squat else 2), again
        return again["s"]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for name in names:
            SharedSegment.unlink_name(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--no-docs", action="store_true", help="do not write the results into docs/benchmarks.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root: it plays uids 65534 and 65533")
    size = args.size_mib << 20
    tmpdir = Path(tempfile.mkdtemp(prefix="ft-others-bench-", dir="/tmp"))
    os.chmod(tmpdir, 0o1777)
    rows = []
    try:
        for owner, uid in (("root", 0), ("uid 65533", NON_ROOT)):
            for what, run in (("creator to READY, gate held by uid 65534", gate),
                              ("restart to READY, generation 2 squatted by uid 65534", restart)):
                samples: dict[bool, list[float]] = {False: [], True: []}
                for i in range(args.repeat):  # alternate, in both orders, so both see the same machine
                    for disturbed in ((False, True) if i % 2 == 0 else (True, False)):
                        samples[disturbed].append(run(uid, size, tmpdir, disturbed))
                plain, attacked = samples[False], samples[True]
                a, b = statistics.median(plain), statistics.median(attacked)
                rows.append((what, owner, a, b))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    free_ms, held_ms = gate_pass_ms(False), gate_pass_ms(True)
    lines = ["| attack | owner | undisturbed | attacked | ratio |", "|---|---|---:|---:|---:|"]
    lines += [f"| {what} | {owner} | {a:.3f} s | {b:.3f} s | {b / a:.2f}x |" for what, owner, a, b in rows]
    lines.append(f"| the gate itself (acquire + release), held by uid 65534 | root | {free_ms:.3f} ms | {held_ms:.3f} ms "
                 "| - |")
    print(f"# {machine_description()}; {args.size_mib} MiB, median of {args.repeat}")
    print("\n".join(lines))
    if not args.no_docs:
        heading = f"{args.size_mib} MiB namespace, median of {args.repeat} alternating runs"
        path = write_docs_section("bench_other_users", docs_body([(heading, "\n".join(lines))]))
        print(f"wrote the results into {path} (section bench_other_users; --no-docs skips this)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
