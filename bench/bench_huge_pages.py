"""Benchmark: the shared copy on 4 KiB pages against a tmpfs of huge pages, in one run on one host.

Why: allocating, zeroing, faulting in and registering the shared copy one 4 KiB page at a time is what is left
of the publish and registration costs (docs/huge-pages.md); a tmpfs mounted with ``huge=always`` removes most of
it. Each mode runs in a private mount namespace (``unshare -m``, root) on a tmpfs this bench mounts itself, of
the same size, with and without ``huge=always``, so the two differ only in the pages; the workers find it
through ``FT_SHM_DIR``. Each mode starts after the kernel compacted free memory (``/proc/sys/vm/compact_memory``),
so the mode that runs second does not find memory fragmented by the first. Per mode:

1. **registration**: a segment of ``--register-gib`` GiB is created and filled in one process; a fresh process
   maps it and registers it with CUDA as a follower does (``SharedSegment.pin(read_only=True, prefault=True)``),
   timed per GiB (skipped without CUDA);
2. **a sharing group** at ``--sizes`` GiB (``bench_scale.py``'s, in-RAM factory, ``--workers`` processes): the
   creator's publish rate, a follower's time to ready after READY (alone), its background registration, and
   the exit after ``close()`` of the workers that closed together; then nothing may be left in the directory;
3. **checkpoint to READY**: a session creator from a safetensors checkpoint of ``--checkpoint-gib`` GiB in a warm
   page cache (``bench_checkpoint.py --session-warm-only``, one checkpoint for both modes), median of 3.

Goals (from the 4 KiB figures of docs/benchmarks.md): publish >= 25 GB/s at 24 GiB, registration <= 10 ms/GiB,
a follower alone ready after READY no slower than on 4 KiB pages, exit after ``close()`` <= 0.5 s, checkpoint to
READY <= 0.5 s at 6 GiB.

Run: ``scripts/gpu-suite.sh bench bench_huge_pages`` (GPU host as root: 24 GiB, 4 workers, about 5 minutes),
``python bench/bench_huge_pages.py --quick`` (CPU, 0.25 GiB: checks the paths, not the speed). Raw results go to
``bench_huge_pages.json`` and the Markdown body to ``bench_huge_pages.md`` in the results directory;
``--docs-from FILE`` writes a saved body into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, docs_body, median, report, table, write_docs_section  # noqa: E402
from private_tmpfs import compact_memory, last_json_line, run_on_tmpfs  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GIB = 1 << 30
MODES = {"4 KiB pages": "", "huge=always": ",huge=always"}
GOALS = {"publish_gbps": 25.0, "register_ms_per_gib": 10.0, "exit_s": 0.5, "checkpoint_ready_s": 0.5}
#: GiB of one block of bench_checkpoint.py's model at its defaults: fc1 + fc2 of 4096x16384 in bfloat16 on a GPU,
#: 1024x8192 in float32 on the CPU (``--quick``); the checkpoint of ``--checkpoint-gib`` has that many blocks.
CHECKPOINT_BLOCK_GIB = {False: 2 * 4096 * 16384 * 2 / GIB, True: 2 * 1024 * 8192 * 4 / GIB}

_REGISTER = r"""
import json, subprocess, sys, time
import torch
from flextensor.shm.segment import SharedSegment
from flextensor.shm import segment_dir
name, size = sys.argv[1], int(sys.argv[2])
if sys.argv[3] == "create":
    seg = SharedSegment.create(name, size)
    seg.tensor(torch.uint8, (seg.size,)).fill_(1)
    child = subprocess.run([sys.executable, "-c", sys.argv[4], name, str(size), "pin", sys.argv[4]],
                           capture_output=True, text=True)
    seg.close()
    SharedSegment.unlink_name(name)
    print(child.stdout.strip() or json.dumps({"error": child.stderr[-2000:]}))
else:
    seg = SharedSegment.open(name)
    out = {"size": seg.size, "page_size": seg.page_size,
           "pages": segment_dir.page_info(seg.directory).describe()}
    if torch.cuda.is_available():
        torch.cuda.init()
        begin = time.perf_counter()
        seg.pin(read_only=True, prefault=True)
        out["register_s"] = time.perf_counter() - begin
        out["huge_mapped"] = segment_dir.huge_mapped_bytes(seg.directory + name)
        begin = time.perf_counter()
        seg.unpin()
        out["unregister_s"] = time.perf_counter() - begin
    seg.close()
    print(json.dumps(out))
"""


def _mounted(directory: str, options: str, size_gib: float, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run ``argv`` on a tmpfs of ``size_gib`` GiB at ``directory``, privately; its output ends with how many
    entries were left there (``LEFT n``)."""
    left = f'echo "LEFT $(ls -A {directory} | wc -l)"; '
    return run_on_tmpfs(directory, int(size_gib * 1024), options, argv, after=left, cwd=REPO, env=env)


def run_mode(label: str, options: str, args: argparse.Namespace, out_dir: Path) -> dict:
    directory = tempfile.mkdtemp(prefix="ft-huge-bench-")
    env = dict(os.environ, FT_SHM_DIR=directory, FLEXTENSOR_BENCH_OUT=str(out_dir), PYTHONUNBUFFERED="1")
    result: dict = {"mode": label, "compact_s": compact_memory()}
    try:
        if args.register_gib > 0:
            size = int(args.register_gib * GIB)
            proc = _mounted(directory, options, args.register_gib * 1.1 + 1,
                            [sys.executable, "-c", _REGISTER, f"/ftbenchreg{os.getpid()}", str(size), "create",
                             _REGISTER], env)
            result["register"] = last_json_line(proc)
            print(f"[{label}] registration: {result['register']}", flush=True)
        if args.checkpoint_gib > 0:
            ckpt_argv = [sys.executable, str(BENCH / "bench_checkpoint.py"), "--session-warm-only",
                         args.checkpoint_root, "--repeat", "3", "--no-docs",
                         "--layers", str(max(1, round(args.checkpoint_gib / CHECKPOINT_BLOCK_GIB[args.quick])))]
            proc = _mounted(directory, options, args.checkpoint_gib * 1.3 + 2, ckpt_argv, env)
            result["checkpoint"] = last_json_line(proc)
            print(f"[{label}] checkpoint to READY: {result['checkpoint']}", flush=True)
        scale_argv = [sys.executable, str(BENCH / "bench_scale.py"), "--sizes", *map(str, args.sizes), "--workers",
                      str(args.workers), "--no-docs", "--no-cprofile", "--tmpfs-gib", "0", "--reads-gib", "0",
                      "--timeout", str(args.timeout)] + (["--quick"] if args.quick else [])
        begin = time.monotonic()
        proc = _mounted(directory, options, args.shm_gib, scale_argv, env)
        result["scale_wall_s"] = time.monotonic() - begin
        result["left_in_dir"] = next((int(line.split()[1]) for line in proc.stdout.splitlines()
                                      if line.startswith("LEFT ")), None)
        print(proc.stdout[-4000:], flush=True)
        if proc.returncode:
            result["error"] = proc.stderr[-4000:]
        try:
            result["scale"] = json.loads((out_dir / "bench_scale.json").read_text())
        except (OSError, ValueError) as exc:
            result.setdefault("error", f"no bench_scale.json: {exc}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return result


def _numbers(mode: dict) -> list[dict]:
    """Per size: the figures the goals name."""
    rows = []
    for size in (mode.get("scale") or {}).get("sizes", []):
        group = size.get("group") or {}
        creator, alone = group.get("creator") or {}, group.get("alone") or {}
        together = [w for w in group.get("followers") or [] if "exit_s" in w]
        rows.append({
            "gib": size["gib"],
            "publish_gbps": creator["shared_bytes"] / max(creator["publish_s"], 1e-9) / 1e9
            if creator.get("publish_s") else None,
            "alone_after_ready_s": alone.get("after_ready_s"),
            "alone_register_s": alone.get("register_s"),
            "exit_s": max((w["exit_s"] for w in together), default=None),
            "error": size.get("error"),
        })
    return rows


def _fmt(value: float | None, unit: str, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def sections(data: dict) -> list[tuple[str, str]]:
    headers = ["measure"] + [mode["mode"] for mode in data["modes"]] + ["goal (huge pages)"]
    rows = []
    regs = [mode.get("register") or {} for mode in data["modes"]]
    if any("register_s" in r for r in regs):
        rows.append([f"registration of a {data['register_gib']:g} GiB segment, ms/GiB"]
                    + [_fmt(r["register_s"] * 1e3 / (r["size"] / GIB), "", 1) if "register_s" in r else "-"
                       for r in regs] + [f"<= {GOALS['register_ms_per_gib']:g}"])
        rows.append(["  of it on huge pages"] + [f"{r.get('huge_mapped', 0) / max(r.get('size', 1), 1):.0%}"
                                                  if "register_s" in r else "-" for r in regs] + [""])
    ckpts = [mode.get("checkpoint") or {} for mode in data["modes"]]
    if any(c.get("ready_s") for c in ckpts):
        size = next(c["model_bytes"] for c in ckpts if c.get("ready_s")) / GIB
        rows.append([f"session creator, checkpoint to READY, warm page cache, {size:.2g} GiB (median of 3)"]
                    + [_fmt(median(c["ready_s"]), " s") if c.get("ready_s") else "-"
                       for c in ckpts] + [f"<= {GOALS['checkpoint_ready_s']:g} s at 6 GiB"])
    numbers = [_numbers(mode) for mode in data["modes"]]
    for index, size in enumerate(data["sizes"]):
        cells = [n[index] if index < len(n) else {} for n in numbers]
        rows.append([f"creator publish, in-RAM factory, {size:g} GiB"]
                    + [_fmt(c.get("publish_gbps"), " GB/s", 1) for c in cells] + [f">= {GOALS['publish_gbps']:g} GB/s"])
        rows.append([f"follower alone ready after READY, {size:g} GiB"]
                    + [_fmt(c.get("alone_after_ready_s"), " s") for c in cells] + ["no slower than 4 KiB"])
        rows.append([f"follower alone background registration, {size:g} GiB"]
                    + [_fmt(c.get("alone_register_s"), " s") for c in cells] + [""])
        rows.append([f"exit after close(), {data['workers'] - 1} followers together, {size:g} GiB"]
                    + [_fmt(c.get("exit_s"), " s") for c in cells] + [f"<= {GOALS['exit_s']:g} s"])
    rows.append(["entries left in the directory afterwards"]
                + [str(mode.get("left_in_dir")) for mode in data["modes"]] + ["0"])
    errors = [f"- {mode['mode']}: {mode['error'][-300:]}" for mode in data["modes"] if mode.get("error")]
    text = table(headers, rows) + ("\n\nErrors:\n" + "\n".join(errors) if errors else "")
    return [("4 KiB pages against a tmpfs mounted huge=always", text)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", help="model sizes in GiB (default 24; --quick 0.25)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="the modes to run (default both, in one run: the comparison the goals name)")
    p.add_argument("--register-gib", type=float, help="segment registered per mode (default 8; --quick 0: no CUDA)")
    p.add_argument("--checkpoint-gib", type=float,
                   help="session creator from a checkpoint, warm cache, per mode (default 6; --quick 0.125; 0: skip)")
    p.add_argument("--shm-gib", type=float, help="size of each mode's tmpfs (default: 2.3x the largest size + 4)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="small sizes on the CPU: checks the paths, not the speed")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--docs-from", metavar="FILE", help="write a saved bench_huge_pages.md into docs/benchmarks.md")
    args = p.parse_args()
    if args.docs_from:
        with open(args.docs_from) as f:
            print(f"wrote {write_docs_section('bench_huge_pages', f.read())} (section bench_huge_pages)")
        return
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        sys.exit("bench_huge_pages mounts its own tmpfs in a private mount namespace: run it as root, with unshare(1)")
    args.sizes = args.sizes or ([0.25] if args.quick else [24.0])
    args.register_gib = (0.0 if args.quick else 8.0) if args.register_gib is None else args.register_gib
    args.shm_gib = args.shm_gib or 2.3 * max(args.sizes) + 4
    args.checkpoint_gib = (0.125 if args.quick else 6.0) if args.checkpoint_gib is None else args.checkpoint_gib
    data: dict = {"sizes": args.sizes, "workers": args.workers, "register_gib": args.register_gib,
                  "shm_gib": args.shm_gib, "modes": []}
    # One checkpoint for both modes, on the temp dir's file system (not the tmpfs under test), kept warm.
    args.checkpoint_root = tempfile.mkdtemp(prefix="ft-huge-ckpt-")
    try:
        for label, options in MODES.items():
            if label not in args.modes:
                continue
            out_dir = RESULTS_DIR / f"huge_pages_{'huge' if options else '4k'}"
            out_dir.mkdir(parents=True, exist_ok=True)
            print(f"=== {label}", flush=True)
            data["modes"].append(run_mode(label, options, args, out_dir))
    finally:
        shutil.rmtree(args.checkpoint_root, ignore_errors=True)
    report("bench_huge_pages", "Huge pages for the shared copy", sections(data), data,
           docs=not args.quick and not args.no_docs)
    (RESULTS_DIR / "bench_huge_pages.md").write_text(docs_body(sections(data)))  # for --docs-from elsewhere


if __name__ == "__main__":
    main()
