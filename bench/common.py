"""Shared helpers for the benchmarks: machine description, memory readings, timing and table output.

Benchmarks report ratios measured in the same run (the machines are shared and noisy), and print a Markdown
table headed by the date and machine so the numbers can go straight into the README.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

RESULTS_DIR = Path(os.environ.get("FLEXTENSOR_BENCH_OUT", Path(__file__).resolve().parent / "results"))


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


def report(name: str, title: str, sections: list[tuple[str, str]], data: dict) -> None:
    """Print the Markdown report and save the raw numbers as JSON under bench/results/."""
    header = f"## {title}\n\nMeasured {machine_description()}.\n"
    body = "\n\n".join(f"### {heading}\n\n{text}" for heading, text in sections)
    print(header + "\n" + body + "\n", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"{name}.json"
    out.write_text(json.dumps({"machine": machine_description(), **data}, indent=2, default=str))
