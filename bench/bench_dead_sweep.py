"""What the dead-namespace sweep costs (``flextensor.shm.dead_sweep``): every session pays it before it joins.

    python bench/bench_dead_sweep.py [--unrelated 1000] [--live 8] [--repeat 50] [--no-docs]

Run it in a private /dev/shm for clean numbers (``unshare -m sh -c 'mount -t tmpfs tmpfs /dev/shm && ...'``).
Beside ``--unrelated`` files in ``/dev/shm`` that belong to nobody's namespace and ``--live`` live namespaces
(coordinators of this process, each with a journal in the lock directory), it times:

1. the sweep a session runs before it joins (``sweep_before_join``) when nothing is dead: the price every
   start pays;
2. the same sweep when one dead namespace (its only worker SIGKILLed after publishing 1 MiB) is waiting: the
   price of the start that reclaims it;
3. ``ftd cleanup --dead``'s sweep (``look_in_shm``: it also lists ``/dev/shm`` for dead namespaces journaled
   elsewhere) when nothing is dead.

Medians, 95th percentiles and maxima in milliseconds, with the date and the machine; the table goes into
docs/benchmarks.md unless ``--no-docs`` is given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import median, percentile, report, table  # noqa: E402

_DEAD_JOB = """
import sys
from flextensor.shm.coordinator import ShmCoordinator
c = ShmCoordinator(sys.argv[1], lease_seconds=30)
c.memory_owner.create_segment("w", 1 << 20).close()
c.notify_ready()
print("published", flush=True)
sys.stdin.read()
"""


def _dead_namespace(ns: str) -> None:
    """A namespace whose only worker published, then was SIGKILLed."""
    proc = subprocess.Popen([sys.executable, "-c", _DEAD_JOB, ns], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "published"
    proc.kill()
    proc.wait()


def _ms(samples: list[float]) -> list[str]:
    return [f"{median(samples) * 1e3:.2f}", f"{percentile(samples, 95) * 1e3:.2f}", f"{max(samples) * 1e3:.2f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unrelated", type=int, default=1000, help="unrelated entries in /dev/shm (default 1000)")
    parser.add_argument("--live", type=int, default=8, help="live namespaces journaled beside (default 8)")
    parser.add_argument("--repeat", type=int, default=50, help="sweeps timed per scenario (default 50)")
    parser.add_argument("--dead-repeat", type=int, default=10, help="dead namespaces reclaimed (default 10)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args()

    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="bench-dead-sweep-")
    import time

    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.dead_sweep import sweep_before_join, sweep_dead_namespaces
    from flextensor.shm.names import manager_namespace

    token = uuid.uuid4().hex[:8]
    unrelated = [Path(f"/dev/shm/bench-unrelated-{token}-{i}") for i in range(args.unrelated)]
    live: list[ShmCoordinator] = []
    try:
        for path in unrelated:
            path.write_bytes(b"")
        for i in range(args.live):
            coordinator = ShmCoordinator(manager_namespace(f"live{token}", f"m{i}"), lease_seconds=30)
            coordinator.memory_owner.create_segment("w", 1 << 16).close()
            coordinator.notify_ready()
            live.append(coordinator)
        joiner = manager_namespace(f"join{token}", "m")

        def timed_sweep(fn) -> tuple[float, object]:
            start = time.perf_counter()
            result = fn()
            return time.perf_counter() - start, result

        sweep_before_join(joiner)  # warm: imports and the first listing
        nothing = [timed_sweep(lambda: sweep_before_join(joiner))[0] for _ in range(args.repeat)]
        shm_scan = [timed_sweep(lambda: sweep_dead_namespaces(look_in_shm=True))[0] for _ in range(args.repeat)]
        reclaiming = []
        for i in range(args.dead_repeat):
            _dead_namespace(manager_namespace(f"dead{token}", f"m{i}"))
            seconds, sweep = timed_sweep(lambda: sweep_before_join(joiner))
            assert len(sweep.reclaimed) == 1, sweep
            reclaiming.append(seconds)
    finally:
        for coordinator in live:
            coordinator.close()
        for path in unrelated:
            path.unlink(missing_ok=True)

    rows = [
        ["sweep before a join, nothing dead", len(nothing), *_ms(nothing)],
        ["sweep before a join, one dead namespace reclaimed (1 MiB)", len(reclaiming), *_ms(reclaiming)],
        ["`ftd cleanup --dead` sweep (also lists /dev/shm), nothing dead", len(shm_scan), *_ms(shm_scan)],
    ]
    text = (f"{args.unrelated} unrelated entries in /dev/shm, {args.live} live namespaces journaled beside; "
            "milliseconds per sweep.\n\n"
            + table(["sweep", "runs", "median ms", "p95 ms", "max ms"], rows))
    report("bench_dead_sweep", "Dead-namespace sweep", [("Cost of a sweep", text)],
           {"unrelated": args.unrelated, "live": args.live, "nothing_s": nothing, "reclaiming_s": reclaiming,
            "shm_scan_s": shm_scan}, docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
