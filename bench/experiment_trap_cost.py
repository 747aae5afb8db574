"""Experiment: what one trap costs a launch-bound pass, and what stalls the first inference pass.

1. *Per-trap host cost.* 16 tiny layers (``Linear(64, 64)``) on the device, so a pass is launch-bound and any
   host work the engine adds shows in the wall time. Offloaded passes alternate with passes of a resident twin
   (300 pairs, medians); the difference over 16 traps is one trap's cost. Variants: PROFILING with a CUDA
   event at every trap entry (forced: no pass may count as keeping up, ``flextensor.runtime.trap_windows``); PROFILING
   as the engine runs it (traps timed on the host's clock once a pass showed the device keeping up);
   INFERENCE of a plan that streams nothing, with its traps bypassed (``Trap.bypass``) and with the enter/exit
   wrapper kept.
2. *Unregistering on a thread.* 64 regions of 64 MiB registered with ``cudaHostRegister``; a thread
   unregisters them in one go, frees them, or does both region by region with a 1 ms pause, while the main
   thread times launch-bound passes (``flextensor.deferred_build`` does the last after a resident warm-up).

Run on the GPU host: ``python bench/experiment_trap_cost.py`` (under a minute). Prints JSON lines.

"""

from __future__ import annotations

import copy
import json
import statistics
import threading
import time
from typing import Callable

import torch
from torch import nn

import flextensor as ft
import flextensor.engine.build as build
import flextensor.engine.profiling as profiling
from flextensor.shm.pinning import host_register, host_unregister

LAYERS = 16


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64)) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def per_trap_us(proxy: nn.Module, twin: nn.Module, x: torch.Tensor, pairs: int = 300) -> dict:
    """Median pass of the twin and of the proxy, alternated, and the difference per trap (microseconds)."""
    mine, theirs = [], []
    with torch.no_grad():
        for _ in range(pairs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            twin(x)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            proxy(x)
            torch.cuda.synchronize()
            theirs.append(t1 - t0)
            mine.append(time.perf_counter() - t1)
    twin_us, proxy_us = statistics.median(theirs) * 1e6, statistics.median(mine) * 1e6
    return {"twin_us": twin_us, "proxy_us": proxy_us, "per_trap_us": (proxy_us - twin_us) / LAYERS}


def _always_device_marks(real: Callable) -> Callable:
    """``read_pass`` that never lets a pass count as kept up: every PROFILING entry keeps its CUDA event."""
    return lambda clock, record, check_span=True: real(clock, record, check_span)._replace(kept_up=False)


def trap_costs(device: torch.device) -> list[dict]:
    x = torch.randn(1, 64, device=device)
    real = profiling.read_pass
    variants = [("PROFILING, a device mark per entry (forced)", _always_device_marks(real)),
                ("PROFILING, as the engine runs it (host clock once a pass kept up)", real)]
    out = []
    try:
        for label, read in variants:
            profiling.read_pass = read
            model = Tiny().to(device)
            twin = copy.deepcopy(model)
            proxy = ft.offload(model, ft.OffloadConfig(include_patterns=["blocks.*"], skip_discovery=True,
                                                       profiling_iters=100_000), name="cost")
            out.append({"variant": label, **per_trap_us(proxy, twin, x)})
            ft.release("cost")
    finally:
        profiling.read_pass = real
    bypass = build.bypass_untimed_traps
    for label, patched in [("INFERENCE, nothing streamed, traps bypassed", bypass),
                           ("INFERENCE, nothing streamed, wrapper kept", lambda ctx, streamed: None)]:
        build.bypass_untimed_traps = patched
        try:
            model = Tiny().to(device)
            twin = copy.deepcopy(model)
            proxy = ft.offload(model, ft.OffloadConfig(include_patterns=["blocks.*"], skip_discovery=True,
                                                       profiling_iters=3), name="cost")
            manager = ft.get_offload_manager("cost")
            with torch.no_grad():
                for _ in range(manager.iters_before_inference + 2):
                    proxy(x)
            manager.wait_for_host_blocks()
            streamed = sum(1 for names in manager.offloaded_tensors.values() if names)
            out.append({"variant": label, "streamed_traps": streamed, **per_trap_us(proxy, twin, x)})
            ft.release("cost")
        finally:
            build.bypass_untimed_traps = bypass
    return out


def unregister_stalls(device: torch.device) -> list[dict]:
    x = torch.randn(1, 4096, device=device)
    weights = [torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) for _ in range(4)]

    def work() -> float:  # about 200 small launches
        t0 = time.perf_counter()
        y = x.to(torch.bfloat16)
        for _ in range(50):
            for w in weights:
                y = y @ w
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def registered() -> list[torch.Tensor]:
        regions = [torch.empty(64 << 20, dtype=torch.uint8) for _ in range(64)]
        for r in regions:
            r.fill_(1)
            host_register(r.data_ptr(), r.numel())
        return regions

    def during(label: str, fn: Callable[[], None], idle: float) -> dict:
        done, passes = threading.Event(), []
        thread = threading.Thread(target=lambda: (fn(), done.set()))
        t0 = time.perf_counter()
        thread.start()
        while not done.is_set():
            passes.append(work())
        thread.join()
        return {"variant": label, "thread_ms": (time.perf_counter() - t0) * 1e3, "passes": len(passes),
                "pass_median_ms": statistics.median(passes), "pass_max_ms": max(passes), "idle_ms": idle}

    for _ in range(3):
        work()
    idle = statistics.median(work() for _ in range(20))
    regions = registered()
    out = [during("unregister 64 x 64 MiB in one go", lambda: [host_unregister(r.data_ptr()) for r in regions],
                  idle),
           during("free them afterwards", regions.clear, idle)]
    regions = registered()

    def paced() -> None:
        while regions:
            region = regions.pop()
            host_unregister(region.data_ptr())
            del region
            time.sleep(0.001)

    out.append(during("unregister + free region by region, 1 ms pauses", paced, idle))
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("experiment_trap_cost needs a CUDA device: it measures CUDA events and cudaHostUnregister")
    device = torch.device("cuda")
    for row in trap_costs(device) + unregister_stalls(device):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
