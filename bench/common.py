"""Shared helpers for the benchmarks: machine description, memory readings, timing and table output.

Benchmarks report ratios measured in the same run (the machines are shared and noisy). Each prints Markdown
tables headed by the date and machine, saves the raw numbers as JSON under ``bench/results/``, and writes the
same tables into its own section of ``docs/benchmarks.md`` (between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; ``--no-docs`` skips that), so the document always holds the latest run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import cProfile
    import pstats

RESULTS_DIR = Path(os.environ.get("FLEXTENSOR_BENCH_OUT", Path(__file__).resolve().parent / "results"))
DOCS_BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine_description() -> str:
    """One line: date, CPU model and count, RAM, GPU (when torch sees one)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
        else:
            gpu = f"no GPU (torch {torch.__version__})"
    except ImportError:
        pass
    today = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return f"{today}, {os.cpu_count()} x {cpu}, {mem_gib:.0f} GiB RAM, {gpu}"


def pss_bytes(pid: int | None = None) -> int:
    """Proportional set size of a process (shared pages divided among their mappers), in bytes."""
    path = f"/proc/{pid or 'self'}/smaps_rollup"
    with open(path) as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss line in {path}")


def proc_status(field: str) -> int:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``, ``RssAnon``, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs``, Linux 4.0+), so a peak read later counts
    only what came after; a no-op where the file cannot be written."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def timed(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call for ``repeat`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def cuda_forward(fn: Callable[[object], object], inputs: object) -> tuple[float, float, object, object]:
    """One ``fn(inputs)`` under ``torch.no_grad`` on CUDA, synchronized before and after: (wall seconds, host
    seconds to launch it, start event, end event). The events give its GPU time (``start.elapsed_time(end)``)
    and let a caller place other events against the pass."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    with torch.no_grad():
        fn(inputs)
    end.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, t1 - t0, start, end


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def report(name: str, title: str, sections: list[tuple[str, str]], data: dict, *, docs: bool = True) -> None:
    """Print the Markdown report, save the raw numbers as JSON under bench/results/ and, unless ``docs`` is
    false, write the report into section ``name`` of docs/benchmarks.md."""
    header = f"## {title}\n\nMeasured {machine_description()}.\n"
    body = "\n\n".join(f"### {heading}\n\n{text}" for heading, text in sections)
    print(header + "\n" + body + "\n", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"{name}.json"
    out.write_text(json.dumps({"machine": machine_description(), **data}, indent=2, default=str))
    if docs:
        path = write_docs_section(name, docs_body(sections))
        print(f"wrote the results into {path} (section {name}; --no-docs skips this)", flush=True)


# --------------------------------------------------------------------------------------------------------------
# The latest results in docs/benchmarks.md
# --------------------------------------------------------------------------------------------------------------


def docs_markers(name: str) -> tuple[str, str]:
    """The two comment lines that delimit benchmark ``name``'s results in docs/benchmarks.md."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def docs_body(sections: Sequence[tuple[str, str]], when: _dt.datetime | None = None,
              machine: str | None = None) -> str:
    """A run's tables for the docs: a line with the date (UTC) and the machine, then one bold heading per table
    (bold, not a heading level, so the tables sit inside whatever section of the document holds them).
    ``machine``: a saved run's :func:`machine_description` (its date and machine) instead of this one's."""
    if machine is not None:
        date, _, described = machine.partition(", ")
        head = f"Latest run: {date}; machine: {described}."
    else:
        when = when or _dt.datetime.now(_dt.timezone.utc)
        stamp = when.strftime("%Y-%m-%d %H:%M UTC")
        head = f"Latest run: {stamp}; machine: {machine_description().split(', ', 1)[1]}."
    return "\n\n".join([head, *(f"**{heading}**\n\n{text}" for heading, text in sections)])


def replace_docs_section(text: str, name: str, body: str) -> str:
    """``text`` with everything between benchmark ``name``'s markers replaced by ``body``; the markers and all
    text outside them stay byte for byte. Raises ``ValueError`` when a marker is missing, repeated or out of
    order."""
    start, end = docs_markers(name)
    for marker in (start, end):
        count = text.count(marker)
        if count != 1:
            raise ValueError(
                f"docs/benchmarks.md must hold the marker {marker!r} exactly once, found it {count} times; "
                f"add the pair {start!r} ... {end!r} around the {name} section"
            )
    i, j = text.index(start) + len(start), text.index(end)
    if j < i:
        raise ValueError(f"marker {end!r} comes before {start!r} in docs/benchmarks.md")
    return text[:i] + "\n" + body.strip("\n") + "\n" + text[j:]


def write_docs_section(name: str, body: str, path: Path = DOCS_BENCHMARKS) -> Path:
    """Replace benchmark ``name``'s section of ``path`` (docs/benchmarks.md) with ``body``, atomically."""
    path = Path(path)
    new = replace_docs_section(path.read_text(encoding="utf-8"), name, body)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------------------------


class JsonLineWorker:
    """A benchmark's worker process, ``python SCRIPT --worker MODE PARAMS_JSON``: it reports one JSON object per
    line on stdout (other output there is skipped; ``{"error": ...}`` is a failure) and takes commands on stdin."""

    def __init__(self, script: str, mode: str, params: dict) -> None:
        argv = [sys.executable, os.path.abspath(script), "--worker", mode, json.dumps(params)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.mode = mode

    def read(self, timeout: float | None = None) -> dict:
        """The next JSON line (within ``timeout`` s when given); RuntimeError when the worker failed, went quiet
        or exited."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None:
                ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise RuntimeError(f"{self.mode} worker {self.proc.pid} sent nothing within {timeout:.0f} s")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.mode} worker {self.proc.pid} exited (rc={self.proc.wait()}) without a "
                                   "report")
            if line.startswith("{"):
                data = json.loads(line)
                if "error" in data:
                    raise RuntimeError(f"{self.mode} worker {self.proc.pid} failed: {data['error']}")
                return data

    def read_stage(self, timeout: float | None = None) -> None:
        """Wait for the worker's 'loaded' line (imports done, waiting for "go": see :func:`loaded_then_wait`)."""
        stage = self.read(timeout)
        if stage.get("stage") != "loaded":
            raise RuntimeError(f"{self.mode} worker {self.proc.pid}: expected the 'loaded' line, got {stage}")

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def exited(self) -> bool:
        """True once the process has exited; a non-zero exit is a RuntimeError."""
        if self.proc.poll() is None:
            return False
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.mode} worker {self.proc.pid} exited with {self.proc.returncode}")
        return True


def json_worker_main(label: str, run: Callable[[], None]) -> None:
    """A worker process's main (the side of :class:`JsonLineWorker`): warnings go to stderr tagged ``label`` and
    the pid; an exception is reported to the parent as ``{"error": ...}`` before it is raised."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{label} {os.getpid()}] %(asctime)s %(name)s: %(message)s")
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        raise


def report_close(session) -> None:
    """A worker's answer to "close" (the side of :func:`close_together`): ``session.close()``, timed, reported as
    ``close_s``."""
    begin = time.perf_counter()
    session.close()
    print(json.dumps({"close_s": time.perf_counter() - begin}), flush=True)


def namespace_leftovers(namespace: str, manager: str) -> list[str]:
    """Entries of manager ``manager`` of ``namespace`` left in /dev/shm and in the directory of the segments
    (``FT_SHM_DIR``)."""
    from flextensor.shm.names import manager_namespace
    from flextensor.shm.segment_dir import default_directory

    ns = manager_namespace(namespace, manager)
    found: set[str] = set()
    for directory in {"/dev/shm", default_directory()}:
        try:
            found.update(name for name in os.listdir(directory) if ns in name)
        except FileNotFoundError:
            pass
    return sorted(found)


def close_together(workers: Sequence[JsonLineWorker], timeout: float) -> list[tuple[float, float]]:
    """Tell every worker to "close" at once; per worker, (its ``close_s`` report, seconds from that report to the
    process's exit). The exits are watched together (every 2 ms), so one slow exit does not delay the others'
    readings; a worker still alive ``timeout`` s after its report is killed and reported as a RuntimeError."""
    for w in workers:
        w.send("close")
    closes, replied = [], []
    for w in workers:
        closes.append(w.read(timeout)["close_s"])
        replied.append(time.monotonic())
    exits: list[float | None] = [None] * len(workers)
    while any(e is None for e in exits):
        now = time.monotonic()
        for i, w in enumerate(workers):
            if exits[i] is None and w.exited():
                exits[i] = now - replied[i]
            elif exits[i] is None and now - replied[i] > timeout:
                w.kill()
                raise RuntimeError(f"{w.mode} worker {w.proc.pid} did not exit within {timeout:.0f} s of close()")
        time.sleep(0.002)
    return [(c, float(e)) for c, e in zip(closes, exits)]


def loaded_then_wait() -> None:
    """A worker's side of :func:`start_together`: tell the parent the imports are done, then wait for "go", so
    that timed work never competes with other workers' interpreter start-up (seconds of CPU each), only with
    their timed work."""
    print(json.dumps({"stage": "loaded"}), flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("parent went away before 'go'")


def start_together(workers: Sequence[JsonLineWorker], timeout: float | None = None) -> list[dict]:
    """Let every worker finish its imports, then start them all at once (concurrent attaches or loads, as when a
    server's workers start together); their reports (each within ``timeout`` s when given)."""
    for w in workers:
        w.read_stage(timeout)
    for w in workers:
        w.send("go")
    return [w.read(timeout) for w in workers]


def cleanup_namespace(namespace: str, manager: str, timeout: float) -> None:
    """Safety net after a sharing group: reclaim whatever a failed worker left in ``namespace`` (a no-op when all
    closed cleanly). A failure here is printed, never raised: it must not hide the benchmark's own error."""
    import flextensor as ft

    try:
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=[manager], timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported, never hides the benchmark's own error
        print(f"cleanup_namespace({namespace!r}) failed: {exc}", file=sys.stderr, flush=True)


def write_cprofile(profiler: "cProfile.Profile", path: str | Path) -> "pstats.Stats":
    """A worker's cProfile as text into ``path``: by cumulative time (40 entries), then by own time (25). Returns
    the stats for a caller that picks entries out of them."""
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(out.getvalue())
    return stats
