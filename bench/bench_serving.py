"""Benchmark of serving at any batch size: latency mode profiled at one batch, served at every other, single
process and a sharing group, each pass timed against a resident twin in the same run.

What is measured, and why: a user profiles once (at a large batch) and then serves a mix of batch sizes (decode at
1-64 tokens, prefill at thousands). A latency-mode plan must hold at each of them from its first pass (Note [the
smallest pass] in ``flextensor/runtime/device_read_rate.py``). Same process, same run:

- fixed batches, in the order served (1, 16, 256, 4096, then 1 again): ``--repeat`` passes each, every one
  right after a pass of the resident twin (the same weights kept whole on the device); the first pass's ratio
  and the worst's;
- a serving trace (``serving_trace.trace``): ``--passes`` batch sizes drawn at random from the powers of two
  1..4096 and odd sizes between them, each batch class equally likely; per batch class p50 / p99 / max of
  both, the p99 ratio, and the worst first pass at a new size;
- the same in ``--workers`` processes of one ``SharedOffloadSession`` adopting the profile saved here
  (``serving_group``), each with its own twin, serving in turns; nothing of the namespace may remain after;
- what the plan keeps on the device against the resident model, and the start-up: ``ft.offload()``'s wall time
  (goal <= 0.5 s for 6 GiB), whether it imported ``torch._dynamo``, the first INFERENCE pass over the steady pass
  at the profiled batch (goal <= 3x).

Model (default on CUDA): 24 layers of fc1/fc2 4096x16384 in bfloat16, 6.0 GiB,
``OffloadConfig(include_patterns=["layers.*"])`` (latency mode), profiled at batch 4096. ``--quick``: a small
float32 model on the CPU (checks the paths only).

Usage: ``python bench/bench_serving.py [--layers 24 --d 4096 --h 16384] [--passes 500] [--workers 4] [--no-docs]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from serving_group import GroupParams, run_group, serving_config  # noqa: E402
from serving_trace import Inputs, Timer, build, repeated, serve, summarise, trace  # noqa: E402

import flextensor as ft  # noqa: E402

NAME = "bench_serving"
FIRST_GOAL, TRACE_GOAL, PROFILED_GOAL = 1.10, 1.05, 1.02


def _status(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _trace_rows(summary: list[dict], who: str) -> list[list]:
    return [[who, s["batch_class"], s["passes"], f"{s['res_p50']:.2f} / {s['res_p99']:.2f} / {s['res_max']:.2f}",
             f"{s['off_p50']:.2f} / {s['off_p99']:.2f} / {s['off_max']:.2f}", f"{s['p99_ratio']:.3f}x",
             f"{s['first_worst']:.3f}x" if s["first_worst"] is not None else "-",
             "yes" if s["equal"] else "NO"] for s in summary]


def main() -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=int)
    p.add_argument("--d", type=int)
    p.add_argument("--h", type=int)
    p.add_argument("--profile-batch", type=int)
    p.add_argument("--batches", type=int, nargs="+", help="fixed batches served in order")
    p.add_argument("--repeat", type=int, default=10, help="passes at each fixed batch")
    p.add_argument("--passes", type=int, help="passes of the random trace (default 500)")
    p.add_argument("--workers", type=int, default=4, help="workers of the sharing group (0: none)")
    p.add_argument("--group-passes", type=int, help="trace passes per group worker (default: --passes)")
    p.add_argument("--no-docs", action="store_true")
    args = p.parse_args()
    small = args.quick or not cuda
    args.layers = args.layers or (4 if small else 24)
    args.d = args.d or (256 if small else 4096)
    args.h = args.h or (1024 if small else 16384)
    args.profile_batch = args.profile_batch or (512 if small else 4096)
    largest = args.profile_batch
    args.batches = args.batches or [1, 16, 256, largest, 1]
    args.passes = args.passes or (60 if small else 500)
    args.group_passes = args.group_passes or args.passes
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    timer, inputs = Timer(cuda), Inputs(args.d, dtype, device)

    twin = build(args.layers, args.d, args.h, dtype, device, draw_on=device)
    model = build(args.layers, args.d, args.h, dtype, torch.device("cpu"), draw_on=device)
    model_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    dynamo_before = "torch._dynamo" in sys.modules
    start = time.perf_counter()
    ft.offload(model, serving_config(cuda))
    offload_s = time.perf_counter() - start
    dynamo_imported = "torch._dynamo" in sys.modules and not dynamo_before
    om = ft.get_offload_manager()
    big = inputs(args.profile_batch)
    for _ in range(om.iters_before_inference):
        timer(model, big)
    first_inference_s = timer(model, big)
    om.wait_for_host_blocks()
    profiled_steady = statistics.median(timer(model, big) for _ in range(5))
    usage = om.get_gpu_memory_usage()
    tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    profile = tmp / "profile"
    om.save_profile(str(profile))

    fixed = [dict(batch=b, **repeated(model, twin, inputs(b), args.repeat, timer)) for b in args.batches]
    batches = trace(args.passes, seed=0, largest=largest)
    records = serve(model, twin, batches, inputs, timer)
    summary = summarise(records)
    replans = om.engine.inference.replan.applied_count
    streamed_end = len(om.offloaded_tensors)
    ft.release()
    del model

    group = None
    if args.workers > 0:
        del twin
        if cuda:
            torch.cuda.empty_cache()
        params = GroupParams(layers=args.layers, d=args.d, h=args.h, profile=str(profile), namespace="",
                             batches=trace(args.group_passes, seed=1, largest=largest), repeat=args.repeat)
        group = run_group(params, args.workers)

    fixed_rows = [[f["batch"], f"{f['first']:.3f}x", f"{f['worst']:.3f}x", f"{f['median']:.3f}x",
                   _status(f["median"] <= PROFILED_GOAL if f["batch"] == args.profile_batch
                           else f["worst"] <= FIRST_GOAL)]
                  for f in fixed]
    trace_rows = _trace_rows(summary, "1 process")
    group_rows: list[list] = []
    goals = []
    at_one = [f for f in fixed if f["batch"] == 1]
    goals.append(["first pass at batch 1 / resident", f"{at_one[0]['first']:.3f}x" if at_one else "-",
                  f"<= {FIRST_GOAL}x", _status(bool(at_one) and at_one[0]["first"] <= FIRST_GOAL)])
    worst_one = max((f["worst"] for f in at_one), default=float("nan"))
    goals.append([f"passes 1-{args.repeat} at batch 1, worst / resident", f"{worst_one:.3f}x", f"<= {FIRST_GOAL}x",
                  _status(worst_one <= FIRST_GOAL)])
    p99 = max(s["p99_ratio"] for s in summary)
    goals.append(["random trace, p99 / resident p99 (worst class)", f"{p99:.3f}x", f"<= {TRACE_GOAL}x",
                  _status(p99 <= TRACE_GOAL)])
    at_big = [f for f in fixed if f["batch"] == args.profile_batch]
    goals.append([f"batch {args.profile_batch}, median / resident", f"{at_big[0]['median']:.3f}x" if at_big else "-",
                  f"<= {PROFILED_GOAL}x", _status(bool(at_big) and at_big[0]["median"] <= PROFILED_GOAL)])
    if group is not None:
        for i, served in enumerate(group["served"]):
            who = f"worker {i} ({group['ready'][i]['role']})"
            group_rows += _trace_rows(summarise(served["records"]), who)
            b1 = served["batch1"]
            goals.append([f"{who}: batch 1 first / worst of {args.repeat}", f"{b1['first']:.3f}x / {b1['worst']:.3f}x",
                          f"<= {FIRST_GOAL}x", _status(b1["worst"] <= FIRST_GOAL and b1["first"] <= FIRST_GOAL)])
        group_p99 = max(s["p99_ratio"] for served in group["served"] for s in summarise(served["records"]))
        goals.append([f"{args.workers} shared workers: trace p99 / resident p99 (worst class, worst worker)",
                      f"{group_p99:.3f}x", f"<= {TRACE_GOAL}x", _status(group_p99 <= TRACE_GOAL)])
        goals.append(["/dev/shm after the group closed", f"{len(group['left'])} entries", "0",
                      _status(not group["left"])])
    kept = usage.block_bytes + usage.resident_bytes
    plan = common.table(["measure", "value"], [
        ["model bytes", common.gib(model_bytes)],
        ["on the device after the profile: resident + rotating blocks",
         f"{common.gib(usage.resident_bytes)} + {common.gib(usage.block_bytes)}"],
        ["device memory saved against the resident model", common.gib(max(0, model_bytes - kept))],
        ["blocks streamed after serving, replans applied", f"{streamed_end}, {replans}"],
    ])
    first_ratio = first_inference_s / profiled_steady
    startup = common.table(["measure", "value", "goal", "status"], [
        ["ft.offload() of the model in host RAM", f"{offload_s:.3f} s", "<= 0.5 s (6 GiB)", _status(offload_s <= 0.5)],
        ["torch._dynamo imported by ft.offload()", "yes" if dynamo_imported else "no", "no",
         _status(not dynamo_imported)],
        [f"first INFERENCE pass / steady pass (batch {args.profile_batch})",
         f"{first_inference_s * 1e3:.1f} / {profiled_steady * 1e3:.1f} ms = {first_ratio:.2f}x", "<= 3x",
         _status(first_ratio <= 3)],
    ])
    headers = ["process", "batch class", "passes", "resident p50 / p99 / max (ms)", "offloaded p50 / p99 / max (ms)",
               "p99 / resident p99", "worst first pass at a size", "outputs equal"]
    note = (f"Model: {args.layers} layers of fc1/fc2 {args.d}x{args.h}, {dtype}, {common.gib(model_bytes)}, "
            f"OffloadConfig(include_patterns=['layers.*']) (latency mode), profiled at batch {args.profile_batch}. "
            f"Every offloaded pass follows a pass of the resident twin at the same input; at a size's first pass the "
            f"twin runs once more before it.")
    sections = [
        ("Goals", common.table(["measure", "value", "goal", "status"], goals)),
        ("Fixed batches, in the order served (each offloaded pass / the resident twin's median in the same loop)",
         common.table(["batch", "first pass", f"worst of {args.repeat}", "median",
                      f"goal (worst <= {FIRST_GOAL}x; the profiled batch: median <= {PROFILED_GOAL}x)"], fixed_rows)),
        (f"Random trace, {args.passes} passes, one process", common.table(headers, trace_rows) + "\n\n" + note),
    ]
    if group_rows:
        sections.append((f"Random trace, {args.group_passes} passes per worker, {args.workers} workers of one "
                         f"SharedOffloadSession (adopting the profile, serving in turns)",
                         common.table(headers, group_rows)))
    sections += [("Plan", plan), ("Start-up", startup)]
    common.report(NAME, "Serving at any batch size (bench_serving)", sections, dict(
        model_bytes=model_bytes, offload_s=offload_s, first_inference_s=first_inference_s,
        profiled_steady_s=profiled_steady, fixed=fixed, trace=summary, replans=replans,
        resident_bytes=usage.resident_bytes, block_bytes=usage.block_bytes,
        group=None if group is None else {"roles": [r["role"] for r in group["ready"]], "left": group["left"],
                                          "batch1": [s["batch1"] for s in group["served"]],
                                          "trace": [summarise(s["records"]) for s in group["served"]]},
    ), docs=not args.no_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
