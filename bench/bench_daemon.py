"""What ``ftd`` buys on a host where workers crash: time to reclaim and to fail fast, and warm restarts.

    python bench/bench_daemon.py [--lease 5] [--repeat 3] [--size-mib 256] [--no-docs]

Scenarios (real worker processes through ``ShmCoordinator``, real ``/dev/shm``, SIGKILL):

1. SIGKILL -> reclaimed: three workers of one namespace are SIGKILLed; time until ``/dev/shm`` holds nothing
   of it.  Without the daemon the best a supervisor can do is ``cleanup_manager_namespace(ns, timeout=...)``
   right after the kill (it returns once the leases have expired); with ``ftd`` the pidfds report the exits.
2. creator death -> followers' error: a creator that never publishes is SIGKILLed while two followers wait in
   ``wait_for_ready``; time until both raised ``ShmCreatorDiedError`` (lease expiry vs. ``end_lease``).
3. restart under ``ftd hold``: a restarted worker attaches to the held generation (join + wait + map) vs.
   a cold load of the same checkpoint file into a fresh generation (read into a new segment).  The checkpoint
   is in the page cache, so the cold number is a lower bound for a real load from disk.

Without the daemon, reclaim needs someone to run it (here a supervisor's cleanup right after the kill; else
the next session of any job of the user, ``ftd cleanup --dead`` or its timer): nothing is reclaimed on its own.
On one host and pid namespace a killed worker's lease counts as dead at once, so neither scenario waits for the
lease; workers in another pid namespace are only seen dead when their lease (30 s by default) runs out.  The table
gives medians over ``--repeat`` runs, with the date and the machine, and goes into docs/benchmarks.md unless
``--no-docs`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from common import docs_body, write_docs_section  # noqa: E402

from flextensor.shm.cleanup import cleanup_manager_namespace  # noqa: E402
from flextensor.shm.names import manager_namespace  # noqa: E402

from tests.daemon.helpers import Daemon, Worker, run_cli, wait_until  # noqa: E402
from tests.leftovers import shm_names  # noqa: E402


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}: {model}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python " \
           f"{platform.python_version()}"


def _base() -> str:
    return f"bench-{uuid.uuid4().hex[:10]}"


def sigkill_to_reclaim(lease: float, socket: Path | None, supervisor: bool) -> float:
    base = _base()
    ns = manager_namespace(base, "m")
    workers = [Worker(base, "m", "--lease", str(lease), socket=socket)]
    workers[0].wait_event("published")
    workers += [Worker(base, "m", "--lease", str(lease), socket=socket) for _ in range(2)]
    for w in workers[1:]:
        w.wait_event("ready")
    t0 = time.monotonic()
    for w in workers:
        w.signal(signal.SIGKILL)
    if supervisor:  # no daemon: an operator/supervisor runs the offline cleanup at once and waits for the leases
        cleanup_manager_namespace(ns, timeout=lease * 3)
    assert wait_until(lambda: shm_names(ns) == [], lease * 3, 0.002), shm_names(ns)
    elapsed = time.monotonic() - t0
    for w in workers:
        w.kill()
    return elapsed


def creator_death_to_error(lease: float, socket: Path | None) -> float:
    base = _base()
    creator = Worker(base, "m", "--lease", str(lease), "--no-publish", socket=socket)
    creator.wait_event("joined")
    followers = [Worker(base, "m", "--lease", str(lease), socket=socket) for _ in range(2)]
    for f in followers:
        f.wait_event("joined")
    time.sleep(0.2)
    killed = time.time()
    creator.signal(signal.SIGKILL)
    errors = [f.wait_event("error", timeout=lease * 3) for f in followers]
    assert all(e["type"] == "ShmCreatorDiedError" for e in errors), errors
    for f in followers:
        f.close()
    creator.kill()
    ns = manager_namespace(base, "m")
    wait_until(lambda: shm_names(ns) == [], 5.0)
    return max(e["t"] for e in errors) - killed


def restart_under_hold(daemon: Daemon, checkpoint: Path) -> tuple[float, float]:
    """(cold load seconds, warm re-attach seconds) of one worker."""
    base = _base()
    first = Worker(base, "m", "--lease", "5", "--checkpoint", str(checkpoint), socket=daemon.socket)
    cold = first.wait_event("published", timeout=120)["load_s"]
    run_cli("hold", base, "--manager", "m", "--socket", str(daemon.socket))
    first.close()
    again = Worker(base, "m", "--lease", "5", "--checkpoint", str(checkpoint), socket=daemon.socket)
    ready = again.wait_event("ready", timeout=120)
    assert not again.has("published")
    again.close()
    run_cli("release", base, "--manager", "m", "--socket", str(daemon.socket))
    return cold, ready["attach_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lease", type=float, default=5.0, help="lease seconds of the workers (default 5)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=256, help="checkpoint size for the restart scenario")
    parser.add_argument("--no-docs", action="store_true", help="do not write the results into docs/benchmarks.md")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ftd-bench-"))
    os.environ["TMPDIR"] = str(work / "tmp")
    (work / "tmp").mkdir()
    tempfile.tempdir = None
    nowhere = work / "no-daemon.sock"
    lock_dir = work / "tmp" / f"flextensor-{os.getuid()}"
    checkpoint = work / "model.bin"
    with open(checkpoint, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(args.size_mib):
            f.write(chunk)

    results: dict[str, tuple[list[float], list[float]]] = {}
    os.environ["FT_DAEMON_SOCKET"] = str(nowhere)
    reclaim = "SIGKILL -> reclaimed: supervisor's cleanup / ftd (s)"
    results[reclaim] = ([sigkill_to_reclaim(args.lease, nowhere, True) for _ in range(args.repeat)], [])
    results["creator death -> followers' error (s)"] = ([creator_death_to_error(args.lease, nowhere)
                                                         for _ in range(args.repeat)], [])
    daemon = Daemon(work / "run" / "ftd.sock", lock_dir, reap_interval=1.0).start()
    try:
        results[reclaim][1].extend(sigkill_to_reclaim(args.lease, daemon.socket, False) for _ in range(args.repeat))
        results["creator death -> followers' error (s)"][1].extend(creator_death_to_error(args.lease, daemon.socket)
                                                                   for _ in range(args.repeat))
        pairs = [restart_under_hold(daemon, checkpoint) for _ in range(args.repeat)]
        results[f"worker restart: cold load vs hold re-attach, {args.size_mib} MiB (s)"] = (
            [p[0] for p in pairs], [p[1] for p in pairs])
    finally:
        daemon.stop()

    print(f"# ftd benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# machine: {_machine()}")
    print(f"# lease {args.lease:g} s, median of {args.repeat} runs; ratio = without / with ftd")
    print()
    lines = [f"| {'scenario':<58} | {'without ftd':>11} | {'with ftd':>9} | {'ratio':>7} |",
             f"|{'-' * 60}|{'-' * 12}:|{'-' * 10}:|{'-' * 8}:|"]
    for name, (without, with_) in results.items():
        a, b = statistics.median(without), statistics.median(with_)
        lines.append(f"| {name:<58} | {a:>11.4f} | {b:>9.4f} | {a / b:>6.0f}x |")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)
    if not args.no_docs:
        heading = f"Lease {args.lease:g} s, median of {args.repeat} runs; ratio = without / with ftd"
        path = write_docs_section("bench_daemon", docs_body([(heading, "\n".join(lines))]))
        print(f"wrote the results into {path} (section bench_daemon; --no-docs skips this)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
