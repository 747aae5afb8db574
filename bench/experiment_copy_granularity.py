"""Experiment (the warm-up sweep): what copying a layer tensor by tensor costs against one copy.

The resident warm-up copies every offloaded tensor once, tensor by tensor, from where the model keeps it
(registered in place), while a pinned buffer can be copied in one piece. This takes the difference apart on
four layers of the bench model's shapes (per layer: two 8 KiB norms and 256 MiB of matrices, bf16):

- one ``pin_memory()`` buffer: in one copy, in the six pieces of each layer, the four large pieces only, the
  two norms only (what a tiny copy costs on its own), and the six pieces alternating between two streams;
- the tensors as a model holds them (one pageable allocation each) registered in place with
  ``cudaHostRegister`` (as ``flextensor.runtime.pinned.in_place`` does), copied tensor by tensor on one stream and on two;
- the same tensors each ``pin_memory()``'d.

Each variant is timed with CUDA events around all its copies, ten times, median; the per-copy cost is the
difference to the one-copy time divided by the number of extra copies. Prints one JSON line per variant.

Run on the GPU host: ``python bench/experiment_copy_granularity.py`` (about 15 s).

"""

from __future__ import annotations

import json
import statistics
import sys

import torch

KIB, MIB = 1 << 10, 1 << 20
LAYER = [8 * KIB, 96 * MIB, 32 * MIB, 8 * KIB, 64 * MIB, 64 * MIB]  # attn_norm, qkv, out, mlp_norm, up, down
LAYERS = 4
REPEAT = 10
TOTAL = sum(LAYER) * LAYERS


def timed(copies: list[tuple[torch.Tensor, torch.Tensor]], streams: list[torch.cuda.Stream],
          repeat: int = REPEAT) -> float:
    """Milliseconds from before the first copy to after the last, the copies taking turns on ``streams``
    (median of ``repeat``)."""
    return statistics.median(copy_times_ms(copies, streams, repeat))


def copy_times_ms(copies: list[tuple[torch.Tensor, torch.Tensor]], streams: list[torch.cuda.Stream],
                  repeat: int) -> list[float]:
    """What :func:`timed` takes the median of: each of ``repeat`` runs of the copies, in milliseconds."""
    current = torch.cuda.current_stream()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(current)
        for stream in streams:
            stream.wait_event(start)
        for i, (dst, src) in enumerate(copies):
            with torch.cuda.stream(streams[i % len(streams)]):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)
        end.record(current)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def report(name: str, ms: float, nbytes: int, copies: int, whole_ms: float | None) -> None:
    row = {"variant": name, "copies": copies, "bytes": nbytes, "ms": round(ms, 3), "gbps": round(nbytes / ms / 1e6, 2)}
    if whole_ms is not None and copies > 1:
        row["us_per_extra_copy"] = round((ms - whole_ms * nbytes / TOTAL) * 1e3 / (copies - 1), 1)
    print(json.dumps(row))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("experiment_copy_granularity needs a CUDA device")

    sizes = LAYER * LAYERS
    one = [torch.cuda.Stream()]
    two = [torch.cuda.Stream(), torch.cuda.Stream()]
    dst = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
    src = torch.ones(TOTAL, dtype=torch.uint8).pin_memory()
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = [(dst[o:o + n], src[o:o + n]) for o, n in zip(offsets, sizes)]
    large = [p for p, n in zip(pieces, sizes) if n > MIB]
    norms = [p for p, n in zip(pieces, sizes) if n <= MIB]
    timed([(dst, src)], one)  # warm-up
    whole = timed([(dst, src)], one)
    report("pinned buffer, one copy", whole, TOTAL, 1, None)
    report("pinned buffer, 6 pieces a layer", timed(pieces, one), TOTAL, len(pieces), whole)
    report("pinned buffer, 6 pieces a layer, two streams", timed(pieces, two), TOTAL, len(pieces), whole)
    report("pinned buffer, the 4 large pieces a layer", timed(large, one), sum(n for n in sizes if n > MIB),
           len(large), whole)
    norms_ms = timed(norms, one)
    print(json.dumps({"variant": "pinned buffer, the 2 norms a layer only", "copies": len(norms),
                      "us_per_copy": round(norms_ms * 1e3 / len(norms), 1)}))

    tensors = [torch.ones(n, dtype=torch.uint8) for n in sizes]  # one pageable allocation each, as a model's
    targets = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    from flextensor.runtime.pinned.in_place import register_in_place, unregister_in_place

    registered = [register_in_place(t) for t in tensors]
    if all(registered):
        model_like = list(zip(targets, tensors))
        report("registered in place, tensor by tensor, the first copy after registering", timed(model_like, one, 1),
               TOTAL, len(sizes), whole)
        report("registered in place, tensor by tensor", timed(model_like, one), TOTAL, len(sizes), whole)
        report("registered in place, tensor by tensor, two streams", timed(model_like, two), TOTAL, len(sizes), whole)
    else:
        print(json.dumps({"variant": "registered in place", "skipped": "cudaHostRegister failed"}))
    for t, ok in zip(tensors, registered):
        if ok:
            unregister_in_place(t)
    pinned = list(zip(targets, [t.pin_memory() for t in tensors]))
    report("pin_memory() per tensor, the first copy", timed(pinned, one, 1), TOTAL, len(sizes), whole)
    report("pin_memory() per tensor, tensor by tensor", timed(pinned, one), TOTAL, len(sizes), whole)


if __name__ == "__main__":
    sys.exit(main())
