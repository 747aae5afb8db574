"""Benchmark of serving after a profile: latency mode at batch sizes other than the profiled one, the first
inference pass, and the cost of ``ft.offload()`` itself.

What is measured, and why: a user profiles once (at a large batch) and then serves a mix of batch sizes (decode at
1-64 tokens, prefill at thousands). A latency-mode plan streams the layers whose copies hid under the profiled
compute; at a smaller batch they no longer hide, and the engine must notice the stalls and replan (Note
[replanning] in ``flextensor/engine/replan.py``). Same process, same run, for each served batch:

- the resident pass (the same model kept whole on the device: the floor latency mode aims at);
- the offloaded model's passes at that batch, in the order served (1, 16, 256, 4096, then 1 again): the first
  pass and how many passes until one is within 1.05x of the resident pass; then ``--steady`` pairs of one
  resident and one offloaded pass, interleaved (the GPU's clocks drift between blocks of passes), whose medians
  give the steady ratio;
- what streams after the sequence, and the replans applied.

Also the first INFERENCE pass after the profile against the steady pass at the profiled batch (goal <= 3x, no
environment variable set), and ``ft.offload()``'s wall time for the model (goal <= 0.5 s for 6 GiB) with whether
it imported ``torch._dynamo``.

Model (default on CUDA): 24 layers of fc1/fc2 4096x16384 in bfloat16, 6.0 GiB, ``OffloadConfig(include_patterns=
["layers.*"])``, profiled at batch 4096. ``--quick``: a small float32 model on the CPU (checks the paths only).

Usage: ``python bench/bench_serving.py [--layers 24 --d 4096 --h 16384] [--batches 1 16 256 4096] [--no-docs]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import flextensor as ft  # noqa: E402

NAME = "bench_serving"
GOAL = 1.05


class Layer(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h, bias=False)
        self.fc2 = nn.Linear(h, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, layers: int, d: int, h: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d, h) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[Stack, Stack]:
    """The model in host RAM, and the same weights kept whole on ``device`` (the resident reference). Weights
    are drawn on ``device`` (a 6 GiB CPU init takes tens of seconds) and copied to the host."""
    with torch.device("meta"):
        host, resident = Stack(args.layers, args.d, args.h), Stack(args.layers, args.d, args.h)
    host, resident = host.to_empty(device="cpu").to(dtype), resident.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p, q in zip(host.parameters(), resident.parameters()):
            q.copy_(torch.randn(q.shape, generator=gen, device=device, dtype=dtype).mul_(0.02))
            p.copy_(q)
    return host.eval(), resident.eval()


def _pass_s(model: nn.Module, x: torch.Tensor, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        model(x)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int)
    p.add_argument("--d", type=int)
    p.add_argument("--h", type=int)
    p.add_argument("--profile-batch", type=int)
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--passes", type=int, default=30, help="passes served at each batch")
    p.add_argument("--steady", type=int, default=10, help="then this many resident/offloaded pairs, interleaved")
    p.add_argument("--profile-offload", action="store_true", help="print a cProfile of the ft.offload() call")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    small = args.quick or not cuda
    args.layers = args.layers or (4 if small else 24)
    args.d = args.d or (256 if small else 4096)
    args.h = args.h or (1024 if small else 16384)
    args.profile_batch = args.profile_batch or (512 if small else 4096)
    args.batches = args.batches or ([1, 16, 256, 512, 1] if small else [1, 16, 256, 4096, 1])
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    # ft.offload() of a model in host RAM: what the call costs, and whether it pulled in torch._dynamo.
    model, resident = _build(args, device, dtype)
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    dynamo_before = "torch._dynamo" in sys.modules
    profiler = cProfile.Profile() if args.profile_offload else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    ft.offload(model, ft.OffloadConfig(include_patterns=["layers.*"], pinned_memory=cuda))
    offload_s = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
    dynamo_after = "torch._dynamo" in sys.modules
    om = ft.get_offload_manager()
    big = torch.randn(args.profile_batch, args.d, device=device, dtype=dtype)
    for _ in range(om.iters_before_inference):
        _pass_s(model, big, cuda)
    first_inference_s = _pass_s(model, big, cuda)
    om.wait_for_host_blocks()
    profiled_steady = statistics.median(_pass_s(model, big, cuda) for _ in range(5))
    streamed_after_profile = len(om.offloaded_tensors)
    usage_profile = om.get_gpu_memory_usage()

    rows, data_rows = [], []
    for batch in args.batches:
        x = torch.randn(batch, args.d, device=device, dtype=dtype)
        ref_s = statistics.median(_pass_s(resident, x, cuda) for _ in range(5))
        times = [_pass_s(model, x, cuda) for _ in range(args.passes)]
        within = next((i + 1 for i, t in enumerate(times) if t <= GOAL * ref_s), None)
        pairs = [(_pass_s(resident, x, cuda), _pass_s(model, x, cuda)) for _ in range(args.steady)]  # interleaved
        ref_s = statistics.median(r for r, _ in pairs)
        steady = statistics.median(o for _, o in pairs)
        ratio = steady / ref_s
        with torch.no_grad():
            same = torch.equal(model(x), resident(x))
        status = om.strategy_replan_status
        rows.append([batch, f"{ref_s * 1e3:.2f} ms", f"{times[0] * 1e3:.2f} ms", within or "-",
                     f"{steady * 1e3:.2f} ms", f"{ratio:.3f}x", "met" if ratio <= GOAL else "NOT met",
                     len(om.offloaded_tensors), "yes" if same else "NO"])
        data_rows.append(dict(batch=batch, resident_ms=ref_s * 1e3, first_ms=times[0] * 1e3, passes_to_goal=within,
                              steady_ms=steady * 1e3, ratio=ratio, streamed_blocks=len(om.offloaded_tensors),
                              replan_state=status.state, equal=same))
    replans = om.engine.inference.replan.applied_count
    usage_end = om.get_gpu_memory_usage()
    streamed_end = len(om.offloaded_tensors)
    ft.release()

    serving = common.table(
        ["batch", "resident pass", "first pass", "passes to <= 1.05x", f"steady (median of {args.steady} paired)",
         "x resident", f"goal <= {GOAL}x", "streamed blocks after", "output equal"], rows)
    first_ratio = first_inference_s / profiled_steady
    startup = common.table(["measure", "value", "goal", "status"], [
        ["ft.offload() of the model in host RAM", f"{offload_s:.3f} s", "<= 0.5 s (6 GiB)",
         "met" if offload_s <= 0.5 else "NOT met"],
        ["torch._dynamo imported by ft.offload()", "yes" if dynamo_after and not dynamo_before else "no", "no",
         "met" if not (dynamo_after and not dynamo_before) else "NOT met"],
        [f"first INFERENCE pass / steady pass (batch {args.profile_batch})",
         f"{first_inference_s * 1e3:.1f} / {profiled_steady * 1e3:.1f} ms = {first_ratio:.2f}x", "<= 3x",
         "met" if first_ratio <= 3 else "NOT met"],
    ])
    plan = common.table(["after", "streamed blocks", "rotating device blocks", "resident on the device"], [
        [f"profile at batch {args.profile_batch}", streamed_after_profile, common.gib(usage_profile.block_bytes),
         common.gib(usage_profile.resident_bytes)],
        [f"serving {args.batches} ({replans} replans applied)", streamed_end,
         common.gib(usage_end.block_bytes), common.gib(usage_end.resident_bytes)],
    ])
    note = (f"Model: {args.layers} layers of fc1/fc2 {args.d}x{args.h}, {dtype}, {common.gib(model_bytes)}, "
            f"OffloadConfig(include_patterns=['layers.*']) (latency mode), profiled at batch {args.profile_batch}; "
            f"{args.passes} passes served per batch, in the order shown.")
    common.report(NAME, "Serving at other batch sizes (bench_serving)", [
        ("Latency mode served at other batch sizes than the profiled one", serving + "\n\n" + note),
        ("Plan", plan),
        ("Start-up", startup),
    ], dict(model_bytes=model_bytes, offload_s=offload_s, first_inference_s=first_inference_s,
            profiled_steady_s=profiled_steady, rows=data_rows, replans=replans), docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
