"""Host RAM per way of offloading a model held in memory: one copy of the weights, or two?

Each path runs in a fresh process that builds the model, creates the CUDA context and runs one block of the
model on the device (per-process constants: the driver's memory, the math libraries), then resets its peak
(``/proc/self/clear_refs``), reads ``VmRSS`` and makes the call, runs forward passes until the model streams
from its host blocks (``wait_for_host_blocks``), and reads ``VmHWM``. Two ratios per row:

- ``peak / before``: ``VmHWM`` over the RSS just before the call (the model is most of that RSS);
- ``growth / model``: what the call added at its peak, over the model's bytes (0 means no second copy).

Paths, each with the configuration's defaults (``pinned_memory_mode="torch"``) unless named:

- ``offload, memory mode``: ``ft.offload(model, OffloadConfig(max_gpu_mem_fraction=0.015))``: the warm-up
  streams, and the host blocks are built behind the first inference passes;
- ``offload, latency mode``: ``ft.offload(model, OffloadConfig())`` (no cap: the warm-up keeps every weight on
  the device while it profiles);
- ``offload, model on the GPU``: the model is built on the device and offloaded in memory mode: the host RSS
  growth over the bytes offloaded (the host copy is the only host copy: 1.0 is the floor);
- ``offload_from_profile``: a profile saved by the memory-mode path, adopted by a model in RAM.

Every output is compared with a reference computed before the baseline, layer by layer on the device from the
host weights. Beside the memory, each row gives the time from the call to streaming from host blocks, and the
streamed pass rate against the pinned host-to-device rate measured in a process of its own (``pinned H2D``).

Model: ``--layers`` MLP blocks of ``d x h`` and ``h x d`` bfloat16 weights (256 MiB a block at the default
4096 x 16384); ``--sizes`` in GiB picks the layer count. The weights are one random block's copies, scaled per
layer (filling GiBs from a random generator would take minutes).

Usage: ``python bench/bench_host_memory.py [--sizes 6 24] [--paths ...] [--no-docs]`` (needs CUDA).

The configurations name the traps (``include_patterns=["class:Block"]``) and leave everything else at its
default: the default ``["*"]`` traps the ``blocks`` ``ModuleList``, which is never called, so nothing would
stream.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import proc_status, report, reset_peak_rss, table  # noqa: E402

PATHS = {
    "memory": "offload, memory mode",
    "latency": "offload, latency mode",
    "gpu": "offload, model on the GPU (growth / offloaded bytes)",
    "profile": "offload_from_profile (memory mode's profile)",
}
D, H = 4096, 16384
BLOCK_BYTES = 2 * D * H * 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(layers: int, device: str) -> Stack:
    """The model in bfloat16 on ``device``, built without a float32 copy: one random block, copied and scaled."""
    with torch.device("meta"):
        model = Stack(layers)
    gen = torch.Generator().manual_seed(0)
    up = (torch.randn(H, D, generator=gen) * D ** -0.5).to(torch.bfloat16).to(device)
    down = (torch.randn(D, H, generator=gen) * (0.1 * H ** -0.5)).to(torch.bfloat16).to(device)
    for i, block in enumerate(model.blocks):
        scale = 1.0 + 0.01 * (i % 7)
        block.up.weight = nn.Parameter(up * scale, requires_grad=False)
        block.down.weight = nn.Parameter(down * scale, requires_grad=False)
    return model.eval()


def reference(model: Stack, x: torch.Tensor) -> torch.Tensor:
    """Layer by layer on the device, each block's weights copied there and dropped after it."""
    with torch.no_grad():
        x = x.cuda()
        for block in model.blocks:
            up, down = block.up.weight.cuda(), block.down.weight.cuda()
            x = x + torch.relu(x @ up.t()) @ down.t()
        return x.cpu()


def worker(args: argparse.Namespace) -> dict:
    import flextensor as ft

    layers, path = args.layers, args.path
    on_gpu = path == "gpu"
    model = build(layers, "cuda" if on_gpu else "cpu")
    x = torch.randn(args.batch, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = reference(model, x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    traps = dict(include_patterns=["class:Block"])
    if path in ("memory", "gpu", "profile"):
        config = ft.OffloadConfig(max_gpu_mem_fraction=0.015, **traps)
    else:
        config = ft.OffloadConfig(**traps)
    reset_peak_rss()
    before = proc_status("VmRSS")
    start = time.monotonic()
    if path == "profile":
        model = ft.offload_from_profile(model, args.profile, config)
    else:
        model = ft.offload(model, config)
    manager = ft.get_offload_manager()
    xd = x.cuda()
    with torch.no_grad():
        for _ in range(manager.iters_before_inference + 1):
            model(xd)
        manager.wait_for_host_blocks()
        model(xd)
        torch.cuda.synchronize()
        ready_s = time.monotonic() - start
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = model(xd)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = proc_status("VmHWM")
    sizes = {name: t.numel() * t.element_size() for name, t in model.named_parameters()}
    streamed = sum(sizes.get(name, 0) for names in manager.offloaded_tensors.values() for name in names)
    if args.save_profile:
        ft.save_profile(args.save_profile)
    equal = bool(torch.allclose(out.cpu().float(), expected.float(), atol=2e-2, rtol=2e-2))
    ft.release()
    return {"path": path, "layers": layers, "model_bytes": layers * BLOCK_BYTES, "before": before, "peak": peak,
            "ready_s": ready_s, "pass_s": min(times), "streamed_bytes": streamed, "equal": equal}


def pinned_h2d_rate() -> float:
    """Pinned host-to-device rate, GB/s: 1 GiB copied 5 times, the fastest."""
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return (1 << 30) / best / 1e9


def _spawn(*argv: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(lines[-1])


def run(args: argparse.Namespace) -> None:
    rate = _spawn("--h2d", timeout=120).get("rate", float("nan"))
    rows, data = [], {"pinned_h2d_gbs": rate, "runs": []}
    tmp = Path(tempfile.mkdtemp(prefix="ft-hostmem-"))
    for size in args.sizes:
        layers = max(1, round(size * 2**30 / BLOCK_BYTES))
        profile = tmp / f"profile-{layers}"
        for path in args.paths:
            extra = ["--save-profile", str(profile)] if path == "memory" and "profile" in args.paths else []
            if path == "profile":
                if not profile.exists():
                    continue
                extra = ["--profile", str(profile)]
            result = _spawn("--worker", "--path", path, "--layers", str(layers), "--batch", str(args.batch), *extra,
                            timeout=args.timeout)
            result.setdefault("path", path)
            result["size_gib"] = size
            data["runs"].append(result)
            print(json.dumps(result)[:600], flush=True)
            if "error" in result:
                rows.append([f"{size} GiB", PATHS[path], "error", "", "", "", "", ""])
                continue
            growth = result["peak"] - result["before"]
            base = result["streamed_bytes"] if path == "gpu" and result["streamed_bytes"] else result["model_bytes"]
            stream_gbs = result["streamed_bytes"] / result["pass_s"] / 1e9 if result["streamed_bytes"] else 0.0
            rows.append([f"{size} GiB", PATHS[path], f"{result['before'] / 2**30:.2f} -> {result['peak'] / 2**30:.2f} GiB",
                         f"{result['peak'] / max(result['before'], 1):.3f}x", f"{growth / max(base, 1):.3f}x",
                         f"{result['ready_s']:.1f} s",
                         f"{stream_gbs:.1f} GB/s ({stream_gbs / rate:.2f}x)" if stream_gbs else "-",
                         "yes" if result["equal"] else "NO"])
    headers = ["model", "path", "RSS before -> peak", "peak / before", "growth / model", "to streaming",
               "streamed pass", "output equal"]
    sections = [("Host RAM per path (defaults: pinned_memory_mode='torch')",
                 f"Pinned host-to-device rate on this host: {rate:.1f} GB/s.\n\n" + table(headers, rows))]
    report("bench_host_memory", "Host RAM per offload path", sections, data, docs=not args.no_docs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=float, nargs="+", default=[6, 24])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--h2d", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=list(PATHS), help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.add_argument("--save-profile", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.h2d:
        print(json.dumps({"rate": pinned_h2d_rate()}))
    elif args.worker:
        print(json.dumps(worker(args)), flush=True)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_host_memory needs CUDA")
        run(args)


if __name__ == "__main__":
    main()
