"""The tables of ``bench_checkpoint.py`` from its runs: peak RSS per way of loading, checkpoint-to-READY time from a
warm and a cold page cache against ``cat`` and the reader alone, and where each load's time went.

Kept apart from the measuring (``bench_checkpoint.Runner``) so that the goals and the wording of the rows live in
one place and a saved ``bench_checkpoint.json`` (its ``runs``) can be turned into the same tables again. A run is
one dict as ``Runner`` keeps it: ``mode``, ``cache`` (``warm``, ``cold`` or ``-``), ``ready_s``, and for the loads
``cached_before``, ``growth``, ``model_bytes``, ``read_s``, ``phases``, ``equal``.
"""

from __future__ import annotations

import statistics
from typing import Callable

from common import gib, table

WARM_GOAL_S, WARM_GOAL_BYTES = 2.5, 6 << 30  # <= 2.5 s per 6 GiB from a warm page cache (H200 host)
COLD_GOAL = 1.2  # from disk: within 1.2x of `cat FILES > /dev/null`
MEMORY_GOALS = {"lazy": 1.10, "lazy-torch": None, "session": 1.10, "inram": 1.25, "offload": None}
LABELS = {"lazy": "load_model_from_profile", "lazy-torch": "load_model_from_profile, pinned_memory_mode='torch'",
          "session": "session creator (checkpoint)", "inram": "session creator (in RAM)",
          "offload": "offload (model in RAM), added"}
#: The session creator's steps shown (``session.report()``): model, store, queueing the block reads (they run on a
#: thread from there), adoption and plan beside the reads, then the wait for the reads' end.
SESSION_STEPS = ("factory", "store", "blocks", "adopt", "plan", "blocks_wait")
EVICTED_BELOW = 0.01  # a "cold" run needs less than 1% of the checkpoint's bytes in the page cache


def samples(runs: list[dict], mode: str, cache: str) -> list[dict]:
    """The runs of one way of loading (or reference) from one page-cache state, in run order."""
    return [r for r in runs if r["mode"] == mode and r["cache"] == cache]


def memory_table(modes: list[str], results: list[dict]) -> str:
    """Peak RSS growth over the model's bytes of each way of loading (``results[i]`` is ``modes[i]``'s warm run),
    against its goal, with the followers' time to ready beside the session creator's."""
    rows = []
    for mode, result in zip(modes, results):
        ratio = result["growth"] / result["model_bytes"]
        goal = MEMORY_GOALS[mode]
        verdict = "-" if goal is None else f"<= {goal:.2f}x " + ("met" if ratio <= goal else "MISSED")
        followers_s = ", ".join(f"{s:.2f}" for s in result.get("followers_ready_s", [])) or "-"
        rows.append([LABELS[mode], f"{ratio:.3f}x", verdict, f"{result['ready_s']:.2f} s", followers_s,
                     "yes" if result["equal"] else "NO"])
    return table(["way of loading", "peak RSS growth / model", "goal", "call to ready",
                  "followers ready (s)", "output equal"], rows)


def _seconds(runs: list[dict]) -> tuple[float, str]:
    values = [r["ready_s"] for r in runs]
    med = statistics.median(values)
    spread = f" ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
    return med, f"{med:.2f} s{spread}"


def timing_table(runs: list[dict], modes: list[str], file_bytes: int, repeat: int) -> str:
    """Checkpoint to READY of each timed way of loading, warm and cold, beside the references (``cat``, the reader
    alone, writing fresh memory): the cold rows held to cold ``cat``, the warm rows to the H200 goal scaled to
    6 GiB. Without a real eviction the cold rows get no verdict."""
    cat_s, _ = _seconds(samples(runs, "cat", "cold"))
    evicted = all(r["cached_before"] < EVICTED_BELOW for r in runs if r["cache"] == "cold")
    model_bytes = next(r["model_bytes"] for r in runs if "model_bytes" in r)
    scale = WARM_GOAL_BYTES / model_bytes
    references = {("cat", "cold"): "`cat` the files", ("cat", "warm"): "`cat` the files",
                  ("reader", "cold"): "checkpoint reader alone", ("reader", "warm"): "checkpoint reader alone",
                  ("fresh", "-"): "write as many bytes of fresh memory"}
    rows = []
    for mode, cache in [*references, *[(m, c) for m in modes for c in ("warm", "cold")]]:
        chosen = samples(runs, mode, cache)
        seconds, text = _seconds(chosen)
        rate = f"{file_bytes / seconds / 1e9:.2f} GB/s"
        if (mode, cache) in references:
            cached = "-" if cache == "-" else f"{100 * max(r['cached_before'] for r in chosen):.0f}%"
            vs_cat = f"{seconds / cat_s:.2f}x" if evicted and cache != "warm" else "-"
            rows.append([references[mode, cache], cache, cached, text, "-", rate, vs_cat, "-"])
            continue
        cached = f"{100 * max(r['cached_before'] for r in chosen):.0f}%"
        reading = f"{statistics.median(r['read_s'] for r in chosen):.2f} s"
        if cache == "cold" and not evicted:
            vs_cat, goal = "-", "not measured: the page cache kept the files"
        elif cache == "cold":
            ratio = seconds / cat_s
            vs_cat, goal = f"{ratio:.2f}x", f"<= {COLD_GOAL:.1f}x " + ("met" if ratio <= COLD_GOAL else "MISSED")
        else:
            per_goal = seconds * scale
            vs_cat = "-"
            goal = (f"{per_goal:.2f} s per 6 GiB; H200 goal <= {WARM_GOAL_S} s: "
                    + ("met" if per_goal <= WARM_GOAL_S else "MISSED"))
        rows.append([LABELS[mode], cache, cached, text, reading, rate, vs_cat, goal])
    text = table(["way of loading", "page cache", "cached before", "checkpoint to READY", "of which reading",
                  "rate", "vs cold `cat`", "goal"], rows)
    text += (f"\n\n{repeat} run(s) per row: the median (and the range); the rate is the checkpoint's bytes over "
             "the median.")
    if not evicted:
        text += ("\n\nThe page cache could not be dropped for these files (tmpfs, or pages kept by someone): the "
                 "\"cold\" rows read cached pages and say nothing about the disk.")
    return text


def _median(runs: list[dict], get: Callable[[dict], float]) -> float:
    return statistics.median(get(r) for r in runs)


def phases_table(runs: list[dict], modes: list[str], cuda: bool) -> str:
    """Where each load's time went (medians of the timed runs): the reader's seconds, the pages its thread
    populated ahead and its seconds doing so, the registration of private host blocks inside the call (CUDA), and
    the call's steps (``load_model_from_profile``: the adoption holds reading and registering; the session
    creator: its ``report()`` steps, the reads inside ``blocks``)."""
    rows = []
    for mode in modes:
        for cache in ("warm", "cold"):
            chosen = [r for r in samples(runs, mode, cache) if "phases" in r]
            if not chosen:
                continue
            ready = _median(chosen, lambda r: r["ready_s"])
            read = _median(chosen, lambda r: r["phases"]["read_s"])
            populated = _median(chosen, lambda r: r["phases"]["populated_bytes"])
            populate_s = _median(chosen, lambda r: r["phases"]["populate_s"])
            if mode == "session":
                register = "after READY, in the background"
                names = [n for n in SESSION_STEPS if n in chosen[0]["phases"]["steps"]]
                steps = ", ".join(f"{n} {_median(chosen, lambda r, n=n: r['phases']['steps'].get(n, 0.0)):.2f}"
                                  for n in names)
            else:
                register_s = _median(chosen, lambda r: r["phases"]["register_s"])
                register = f"{register_s:.2f} s" if cuda else "- (no CUDA)"
                adopt = _median(chosen, lambda r: r["phases"]["adopt_s"])
                steps = f"model and matching {ready - adopt:.2f}, adoption {adopt:.2f} (reading, registering in it)"
            rows.append([LABELS[mode], cache, f"{ready:.2f} s", f"{read:.2f} s",
                         f"{gib(populated)} in {populate_s:.2f} s", register, steps])
    return table(["way of loading", "page cache", "checkpoint to READY", "reading",
                  "pages populated ahead of the reads (thread)", "registering", "steps (s)"], rows)


def summary_line(r: dict) -> str | None:
    """One line for a load run as it comes: READY and its phases (None for a reference run, which has none)."""
    if "phases" not in r:
        return None
    p = r["phases"]
    steps = " ".join(f"{k}={v:.2f}" for k, v in p.get("steps", {}).items()
                     if k in SESSION_STEPS)
    return (f"[{r['mode']} {r['cache']}] READY {r['ready_s']:.2f} s: read {p['read_s']:.2f} s, populated "
            f"{gib(p['populated_bytes'])} ahead in {p['populate_s']:.2f} s, register {p['register_s']:.2f} s, "
            f"adopt {p['adopt_s']:.2f} s{'; ' + steps if steps else ''}")
