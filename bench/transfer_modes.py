"""``bench_engine.py --transfer-modes``: ``allocation_block_transfer`` against ``raw_block_transfer`` in one run.

The two block modes stream the same packed host blocks with one copy per trap; they differ in where the blocks
go on the device: ``num_blocks`` slots, each as large as the largest streamed block (the last one, in memory
mode, possibly sized to a partly streamed trap), or one arena in which each block takes its own bytes (``flextensor.runtime.loaders.arena_loader``). On one model, each configuration is timed
alternately with a resident twin of the model (``bench_engine.offload_run``), in this order:

1. every layer streams (``NthLayerStrategy(1)``), slots then arena: the two mechanisms at equal bytes (with
   layers of one size the arena holds ``num_blocks`` of them, as the slots do), at the small batch
   (transfer-bound) and the large batch (compute-bound), profiled at the small one;
2. memory mode at ``--fraction`` (``max_gpu_mem_fraction``, the default ``AdaptiveStrategy`` and block counts),
   slots then arena, profiled at the small batch: what each keeps resident, what it streams, how fast it runs;
3. the slots in memory mode with ``min_blocks=2``: the arena may go down to two blocks whatever ``min_blocks``
   says, so this row separates what the arena's sizing gives from what fewer blocks give.

Ratios arena / slots are taken within the run. ``--model mlp`` builds a stack of ``layers.N.fc1`` /
``layers.N.fc2`` (``--hidden`` x ``--ffn``, with biases, bf16 on a GPU) trapped by ``include_patterns=
["layers.*"]``: 24 layers of 4096 x 16384 are the 6.0 GiB model of the memory-mode goal below. The default
model is ``bench_engine``'s transformer. A run writes its tables into ``docs/benchmarks.md`` between the
``bench_engine_modes`` markers (not with ``--quick`` or ``--no-docs``).

Goals (memory mode, ``--fraction 0.015`` on the 6.0 GiB MLP on the H200 host): the default configuration (slots,
``num_blocks = min_blocks = 4``) and the arena each stream at most 4.875 GiB a pass (19.5 of 24 layers: FlexTensor
0.5.0, whose last rotating block is fitted to the trap that uses it, keeps 4.5 layers resident at that budget; the
slots do the same with a small last slot, ``flextensor.planning.slot_model``), and the arena's forward takes at
most the slots' time (0.5.0 took 95.98 ms where slots of one size, streaming 5.0 GiB, took 98.3 ms).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

import bench_engine as engine
from engine_report import ms, verdict
from common import gib, report, table
from models import BLOCK_PATTERN, ModelSpec, build_model, default_dtype, make_tokens

import flextensor as ft

GOAL_STREAMED_BYTES = int(19.5 * 256 * (1 << 20))  # 4.875 GiB: 19.5 layers of the 6.0 GiB MLP
GOAL_MEMORY_RATIO = 1.0  # keep the arena only where it is at least as fast as the default slots
MLP_PATTERN = "layers.*"


@dataclass(frozen=True)
class MLPSpec:
    """A stack of ``layers`` MLP layers, ``fc1`` (hidden -> ffn) and ``fc2`` (ffn -> hidden), with biases."""

    hidden: int
    ffn: int
    layers: int

    def layer_bytes(self, dtype: torch.dtype) -> int:
        return (2 * self.hidden * self.ffn + self.hidden + self.ffn) * _itemsize(dtype)

    def total_bytes(self, dtype: torch.dtype) -> int:
        return self.layers * self.layer_bytes(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


class MLPLayer(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class MLPStack(nn.Module):
    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPLayer(spec.hidden, spec.ffn) for _ in range(spec.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@torch.no_grad()
def build_mlp(spec: MLPSpec, device: torch.device, dtype: torch.dtype, seed: int) -> MLPStack:
    """Built on ``meta``, moved with ``to_empty`` and filled from a seeded generator on ``device`` (seconds for
    6 GiB); the residual branch is scaled down so the output stays finite in bf16 through deep stacks."""
    with torch.device("meta"):
        model = MLPStack(spec)
    model = model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        else:
            scale = 1.0 if name.endswith("fc1.weight") else 1.0 / math.sqrt(2 * spec.layers)
            param.normal_(0.0, scale / math.sqrt(param.shape[-1]), generator=gen)
    return model


def _activations(spec: MLPSpec, batch: int, seq: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, seq, spec.hidden, generator=gen).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------------------------


def configurations(args: argparse.Namespace, device: torch.device, pattern: str) -> list[tuple[str, str, object]]:
    """(key, label, config) in run order (module docstring)."""
    nth = ft.NthLayerStrategy(1)
    memory = dict(max_gpu_mem_fraction=args.fraction)
    out = []
    for mode, short in (("allocation_block_transfer", "slots"), ("raw_block_transfer", "arena")):
        out.append((f"{short}_nth", f"{mode}, every layer streams",
                    engine.offload_config(args, device, nth, [pattern], transfer_mode=mode)))
    for mode, short in (("allocation_block_transfer", "slots"), ("raw_block_transfer", "arena")):
        out.append((f"{short}_memory", f"{mode}, memory mode {args.fraction}",
                    engine.offload_config(args, device, None, [pattern], transfer_mode=mode, **memory)))
    out.append(("slots2_memory", f"allocation_block_transfer, min_blocks=2, memory mode {args.fraction}",
                engine.offload_config(args, device, None, [pattern], transfer_mode="allocation_block_transfer",
                                      min_blocks=2, **memory)))
    return out


def main(args: argparse.Namespace) -> None:
    device = args.device
    dtype = default_dtype(device)
    if args.model == "mlp":
        spec: object = MLPSpec(args.hidden, args.ffn or 4 * args.hidden, args.layers)
        model = build_mlp(spec, device, dtype, args.seed)
        work = engine.Workload(small=_activations(spec, *args.small, device, dtype),
                               large=_activations(spec, *args.large, device, dtype))
        pattern, layer_bytes = MLP_PATTERN, spec.layer_bytes(dtype)
        description = f"MLP: {spec.layers} layers of fc1/fc2 {spec.hidden}x{spec.ffn}"
    else:
        spec = ModelSpec(hidden=args.hidden, layers=args.layers, vocab=args.vocab, mlp_ratio=args.mlp_ratio)
        model = build_model(spec, device, dtype, seed=args.seed)
        work = engine.Workload(small=make_tokens(spec, *args.small, device),
                               large=make_tokens(spec, *args.large, device))
        pattern, layer_bytes = BLOCK_PATTERN, spec.block_bytes(dtype)
        description = f"transformer: hidden {spec.hidden}, {spec.layers} layers, vocab {spec.vocab}"
    total_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    r: dict = {"model": description, "spec": asdict(spec), "dtype": str(dtype).replace("torch.", ""),
               "device": str(device), "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
               "layer_bytes": layer_bytes, "small_shape": args.small, "large_shape": args.large,
               "fraction": args.fraction, "device_total_bytes": total_memory, "mlp": args.model == "mlp"}
    print(f"{description}: {gib(r['model_bytes'])} {r['dtype']} on {device}; resident passes", flush=True)
    r["resident"] = engine.resident_run(model, work, device, args.repeat)
    twin = copy.deepcopy(model)
    model.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    both = {"small": work.small, "large": work.large}
    r["runs"] = {}
    for key, label, config in configurations(args, device, pattern):
        print(f"offloaded: {label}", flush=True)
        run = engine.offload_run(model, config, key, work.small, both, work, device, args.repeat, twin=twin)
        run["label"] = label
        r["runs"][key] = run
    report("bench_engine_modes", "flextensor transfer modes: slots against one device arena", build_sections(r), r,
           docs=not (args.no_docs or args.quick))


# ----------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------


def build_sections(r: dict) -> list[tuple[str, str]]:
    res, runs = r["resident"], r["runs"]
    budget = (f"{r['fraction']} x {gib(r['device_total_bytes'])} = {gib(r['fraction'] * r['device_total_bytes'])}"
              if r["device_total_bytes"] else f"{r['fraction']} of host RAM (CPU)")
    model_rows = [[r["model"], f"{r['dtype']} on {r['device']}", gib(r["model_bytes"]), gib(r["layer_bytes"]),
                   f"{tuple(r['small_shape'])}", f"{tuple(r['large_shape'])}", budget]]
    rows = [["resident", ms(res["small_s"]), ms(res["large_s"]), "1.000x", "1.000x", "-", "-", "-",
             "-"]]
    for key, run in runs.items():
        streamed = run["offloaded_bytes"]
        resident = run["device_total_bytes"] - run["device_block_bytes"]
        rows.append([run["label"], ms(run["small_s"]), ms(run["large_s"]),
                     f"{_vs_twin(run, 'small'):.3f}x", f"{_vs_twin(run, 'large'):.3f}x",
                     gib(streamed), gib(resident), gib(run["device_block_bytes"]), run["strategy"]])
    pairs = [("every layer streams", "slots_nth", "arena_nth"), ("memory mode", "slots_memory", "arena_memory"),
             ("memory mode, slots with min_blocks=2", "slots2_memory", "arena_memory")]
    ratio_rows = []
    for label, slots, arena in pairs:
        a, b = runs[slots], runs[arena]
        ratio_rows.append([label, _ratio(_vs_twin(b, "small"), _vs_twin(a, "small")),
                           _ratio(_vs_twin(b, "large"), _vs_twin(a, "large")),
                           _ratio(b["offloaded_bytes"], a["offloaded_bytes"]),
                           _ratio(b["device_block_bytes"], a["device_block_bytes"])])
    mem_slots, mem_arena = runs["slots_memory"], runs["arena_memory"]
    # Medians of the same run, not each against its twin: a transfer-bound pass is ~40x its resident twin, whose
    # noise would dominate a ratio of ratios.
    forward_ratio = mem_arena["small_s"] / mem_slots["small_s"]
    goals = [
        [f"memory mode: the arena's forward <= {GOAL_MEMORY_RATIO:.3f}x the slots' (transfer-bound, medians of "
         "this run)", f"{forward_ratio:.3f}x", verdict(forward_ratio <= GOAL_MEMORY_RATIO)],
        ["memory mode: the arena streams no more than the slots", f"{gib(mem_arena['offloaded_bytes'])} vs "
         f"{gib(mem_slots['offloaded_bytes'])}",
         verdict(mem_arena["offloaded_bytes"] <= mem_slots["offloaded_bytes"])],
        [f"memory mode 0.015, 6.0 GiB MLP, default configuration (slots): streams <= {gib(GOAL_STREAMED_BYTES)}",
         gib(mem_slots["offloaded_bytes"]),
         verdict(mem_slots["offloaded_bytes"] <= GOAL_STREAMED_BYTES
                        if _is_goal_case(r) else None)],
        [f"memory mode 0.015, 6.0 GiB MLP: the arena streams <= {gib(GOAL_STREAMED_BYTES)}",
         gib(mem_arena["offloaded_bytes"]),
         verdict(mem_arena["offloaded_bytes"] <= GOAL_STREAMED_BYTES
                        if _is_goal_case(r) else None)],
        ["outputs equal resident (max |diff|, small batch, worst run)",
         f"{max(run['max_abs_diff'] or 0.0 for run in runs.values()):.3g}", "-"],
    ]
    return [
        ("Model, inputs and budget", table(["model", "dtype / device", "weights", "one layer", "small batch (B, S)",
                                            "large batch (B, S)", "memory-mode budget"], model_rows)),
        ("Forward pass (median, profiled at the small batch)", table(
            ["run", "small batch (transfer-bound)", "large batch (compute-bound)", "small / resident",
             "large / resident", "streamed per pass", "resident on the device", "rotating blocks / arena",
             "plan"], rows)
         + "\n\nEach offloaded row's ratios are against a resident twin of the model timed alternately with it."),
        ("Arena / slots, same run", table(["configurations", "small batch (each / its twin)",
                                           "large batch (each / its twin)", "bytes streamed", "device blocks"],
                                          ratio_rows)),
        ("Goals", table(["goal", "measured", "status"], goals)),
    ]


def _vs_twin(run: dict, batch: str) -> float:
    """A run's pass against its resident twin's, timed alternately with it (the host's drift cancels)."""
    return run[f"{batch}_s"] / run[f"{batch}_twin_s"]


def _ratio(a: float, b: float) -> str:
    return "n/a" if not b else f"{a / b:.3f}x"


def _is_goal_case(r: dict) -> bool:
    """The goal's configuration: the 24 x 4096 x 16384 MLP in memory mode at 0.015."""
    spec = r["spec"]
    return (r["mlp"] and (spec["hidden"], spec["ffn"], spec["layers"]) == (4096, 16384, 24)
            and r["fraction"] == 0.015 and r["dtype"] == "bfloat16")
