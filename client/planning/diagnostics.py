"""Plain-text tables that explain a strategy's choice (``OffloadConfig(enable_diagnostics=True)``).

Three tables are logged after strategy computation: Memory Transfer Statistics (tensor size ->
transfer time and bandwidth), Trap Duration Statistics (per trap: min, max, median, avg, std, coefficient of
variation; it lists every trap created during profiling, so it is how users confirm which patterns became
traps) and the block assignment table. ``format_candidates`` adds what AdaptiveStrategy compared.
Pure formatting: no torch, no logging; the engine logs the returned strings.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from flextensor.shm.text_table import format_columns
from flextensor.shm.sizes import format_bytes as _format_bytes

from flextensor.planning.plan_model import Plan, TransferModel, TrapCost

__all__ = [
    "format_block_assignment",
    "format_bytes",
    "format_candidates",
    "format_table",
    "format_transfer_stats",
    "format_trap_durations",
]


def format_bytes(nbytes: int) -> str:
    """Human-readable binary size with two decimals: ``512 B``, ``1.50 KiB``, ``3.00 GiB``."""
    return _format_bytes(nbytes, digits=2)


def format_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]],
                 footer: Sequence[str] = (), align: str | None = None) -> str:
    """An aligned table. ``align`` has one letter per column, ``l`` or ``r``; by default the first column
    (labels) is left-aligned and the others (numbers) right-aligned."""
    align = align or "l" + "r" * (len(headers) - 1)
    header, *body = format_columns(headers, rows, align)
    rule = "-" * max(len(line) for line in [header, *body])
    out = [title, rule, header, rule, *body, rule, *footer]
    return "\n".join(out)


def format_transfer_stats(samples: Sequence[tuple[int, float]], model: TransferModel | None = None) -> str:
    """Memory Transfer Statistics: one row per measured sample (the fastest copy of a size), sorted by size."""
    rows = []
    for nbytes, seconds in sorted(samples):
        rate = f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "inf"
        rows.append([format_bytes(nbytes), nbytes, f"{seconds * 1e3:.3f}", rate])
    footer = []
    if model is not None:
        footer.append(f"fit: {model.bandwidth_bytes_per_s / 1e9:.2f} GB/s, latency {model.latency_s * 1e6:.1f} us")
    return format_table("Memory Transfer Statistics", ["Tensor size", "Bytes", "Time (ms)", "Bandwidth (GB/s)"],
                        rows, footer)


def format_trap_durations(durations: Mapping[str, Sequence[float]]) -> str:
    """Trap Duration Statistics in ms (std is the population std; CV = std / avg)."""
    rows = []
    for label, values in durations.items():
        if not values:
            rows.append([label, 0, "-", "-", "-", "-", "-", "-"])
            continue
        avg = statistics.fmean(values)
        std = statistics.pstdev(values)
        cv = f"{std / avg:.3f}" if avg > 0 else "-"
        rows.append([label, len(values), *(f"{v * 1e3:.3f}" for v in
                                           (min(values), max(values), statistics.median(values), avg, std)), cv])
    return format_table("Trap Duration Statistics",
                        ["Trap", "N", "Min (ms)", "Max (ms)", "Median (ms)", "Avg (ms)", "Std (ms)", "CV"], rows,
                        [f"{len(rows)} traps"])


def _names(names: Sequence[str], limit: int = 60) -> str:
    text = ""
    for k, name in enumerate(names):
        piece = name if not text else f"{text}, {name}"
        if len(piece) > limit and text:
            return f"{text}, +{len(names) - k} more"
        text = piece
    return text or "-"


def format_block_assignment(plan: Plan, traps: Sequence[TrapCost]) -> str:
    """Block assignment: per trap in execution order, what it offloads and which device block slot it uses (for
    a device arena: the byte offset of its first call)."""
    slots = plan.block_slots()
    rows = []
    for trap in traps:
        names = plan.offloaded.get(trap.label, ())
        sizes = {t.name: t.nbytes for t in trap.tensors}
        off = sum(sizes.get(n, 0) for n in names)
        slot = slots.get(trap.label)
        rows.append([trap.label, f"{trap.compute_s * 1e3:.3f}", f"{len(names)}/{len(trap.tensors)}",
                     format_bytes(off), format_bytes(trap.total_bytes - off), "-" if slot is None else slot,
                     _names(names)])
    blocks = (f"a device arena of {format_bytes(plan.rotating_bytes)} holding {plan.num_blocks} consecutive blocks"
              if plan.arena_offsets else f"{plan.num_blocks} device blocks x {format_bytes(plan.block_bytes)}")
    footer = [
        f"strategy {plan.strategy}: {blocks}, offloaded "
        f"{format_bytes(plan.offloaded_bytes)}, resident {format_bytes(plan.resident_bytes)}, peak "
        f"{format_bytes(plan.peak_device_bytes)}, estimated overhead {plan.estimated_overhead_s * 1e3:.3f} ms, "
        f"fits budget: {'yes' if plan.fits_budget else 'no'}"
    ]
    return format_table("Block Assignment",
                        ["Trap", "Compute (ms)", "Offloaded", "Offloaded bytes", "Resident bytes", "Block",
                         "Offloaded tensors"], rows, footer, align="lrrrrrl")


def format_candidates(plan: Plan) -> str:
    """The candidates an AdaptiveStrategy compared (falls back to the plan itself for other strategies)."""
    rows = [[c.strategy, f"{c.estimated_overhead_s * 1e3:.3f}", format_bytes(c.offloaded_bytes),
             format_bytes(c.peak_device_bytes), "yes" if c.fits_budget else "no", "*" if c.chosen else ""]
            for c in plan.candidates]
    if not rows:
        rows = [[plan.strategy, f"{plan.estimated_overhead_s * 1e3:.3f}", format_bytes(plan.offloaded_bytes),
                 format_bytes(plan.peak_device_bytes), "yes" if plan.fits_budget else "no", "*"]]
    return format_table("Strategy Candidates", ["Strategy", "Overhead (ms)", "Offloaded", "Peak", "Fits", "Chosen"],
                        rows)

