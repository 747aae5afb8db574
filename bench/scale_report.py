"""The tables of ``bench_scale.py`` from its raw results: the models, each cost per size and per GiB, the goals,
where the fresh profile's time goes (cProfile) and the host-side rates; also a follower's steps to ready on one
line, printed as each size ends, and the partial results written after every size.

Kept apart from the measuring so that a size's numbers become rows the same way during the run (the partial
``bench_scale.md``), at its end and from a saved ``bench_scale.partial.json``.
"""

from __future__ import annotations

import json

from common import RESULTS_DIR, docs_body, gib, median, table
from shm_rates import READ_HEADERS, read_rows

#: A follower is ready after READY within its resident bytes at this rate, plus GOAL_FOLLOWER_FIXED_S.
GOAL_FOLLOWER_GBPS = 40.0
GOAL_FOLLOWER_FIXED_S = 0.1
GOAL_PUBLISH_GBPS = 16.0
GOAL_CLOSE_S = 0.5
GOAL_SIZE_GIB = 24


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s"


def _per_gib(seconds: float | None, size_gib: float) -> str:
    return "-" if seconds is None else f"{seconds:.3f} s ({seconds / size_gib * 1e3:.0f} ms/GiB)"


def _rate(nbytes: float, seconds: float | None) -> str:
    return "-" if not seconds else f"{nbytes / seconds / 1e9:.2f} GB/s"


#: A follower's steps as reported (``session.report()``), by the name the tables give them: the sweep of dead
#: jobs, the join (election, daemon, plan), then the attach thread's (map the store, then the resident copy with
#: the arena and the device blocks beside it on a CUDA device), then the caller's after the factory (validate,
#: install the resident tensors, the block views and their registration's set-up, adopt the plan, start the
#: registration, the host copy a sleep wakes from).
PHASES = {"sweep": "sweep", "join": "join", "daemon": "daemon", "wait": "wait", "plan": "plan",
          "map store": "prefetch_store", "map arena": "prefetch_blocks", "device blocks": "prefetch_slots",
          "copy": "prefetch_resident", "factory": "factory", "validate": "validate", "install": "resident",
          "block views": "block_views", "adopt": "adopt", "pin start": "pin_start", "host copy": "host_copy"}
#: The resident copy's ring parts (``CopyReport``), which run on a thread of their own.
RING_PARTS = ("ring_populate_s", "ring_register_s", "ring_wait_s")


#: The follower started once the creator is elected (its model built while the creator publishes).
EARLY = "follower started before READY"


def follower_groups(group: dict) -> list[tuple[str, list[dict]]]:
    """The followers of a sharing group by how they started: together after READY, alone, before READY."""
    return [("followers together", group.get("followers") or []),
            ("follower alone", [group["alone"]] if group.get("alone") else []),
            (EARLY, [group["early"]] if group.get("early") else [])]


def after_ready(label: str, w: dict) -> float:
    """Seconds from READY to ready: the whole time of a follower started after READY, else what its wait for
    READY did not hide."""
    return w.get("after_ready_s", w["ready_s"]) if label == EARLY else w["ready_s"]


#: Where a size's model was built (``setup["host_build"]``), as the tables say it.
BUILDS = {True: "host RAM, one block at a time on the device; reference layer by layer",
          False: "whole on the device, then moved to host RAM; reference resident"}


def peak_rss(r: dict, who: str) -> dict | None:
    """The set-up process's (``who="setup"``) or the group creator's (``"creator"``) host RSS: its VmHWM, its RSS
    when it started (``rss_start``: the interpreter, torch, the device context) and what it grew by over the
    model's bytes (1.0 is one copy of the model); None when not measured."""
    report_ = (r.get("setup") if who == "setup" else (r.get("group") or {}).get("creator")) or {}
    if "vmhwm" not in report_:
        return None
    growth = (report_["vmhwm"] - report_["rss_start"]) / r["model_bytes"]
    return {"vmhwm": report_["vmhwm"], "rss_start": report_["rss_start"], "growth": growth}


def _peak_text(peak: dict | None) -> str:
    return "-" if peak is None else f"{gib(peak['vmhwm'])} (from {gib(peak['rss_start'])}: {peak['growth']:.3f}x)"


def host_memory_line(r: dict, who: str) -> str:
    """One line for the run's log: the set-up's or the creator's peak host RSS against the model."""
    name = "set-up process" if who == "setup" else "group's creator"
    return f"host RAM, {name}: VmHWM {_peak_text(peak_rss(r, who))} the model's {gib(r['model_bytes'])}"


def size_row_values(r: dict) -> dict[str, str]:
    """One column of the costs table (see build_sections)."""
    g, setup, group = r["gib"], r.get("setup") or {}, r.get("group") or {}
    col: dict[str, str] = {}
    if "group_wall_s" in r:
        col["wall: set-up process / sharing group"] = f"{r['setup_wall_s']:.0f} / {r['group_wall_s']:.0f} s"
    if "host_build" in setup:
        col["model built (set-up: build / reference)"] = f"{BUILDS[setup['host_build']]} " \
                                                         f"({setup['build_s']:.1f} / {setup['reference_s']:.1f} s)"
    for who in ("setup", "creator"):
        peak = peak_rss(r, who)
        if peak is not None:
            col[f"host RAM, {'set-up process' if who == 'setup' else 'creator'}: VmHWM (from its start: growth "
                "/ model)"] = _peak_text(peak)
    passes = setup.get("passes_s") or []
    if passes:
        mid = median(passes)
        col["ft.offload()"] = _per_gib(setup["offload_s"], g)
        col["profile passes (sum)"] = f"{_per_gib(sum(passes), g)}; {len(passes)} passes, median {mid:.3f} s, last " \
                                      f"{passes[-1]:.3f} s"
        col["profile-phase overhead: offload() + passes - n x median pass"] = _per_gib(
            setup["offload_s"] + sum(passes) - len(passes) * mid, g)
    creator = group.get("creator")
    if creator:
        col["creator factory (the set-up's build)"] = _per_gib(creator["factory_s"], g)
        col["creator publish (ready - factory)"] = f"{_per_gib(creator['publish_s'], g)}, " \
                                                   f"{_rate(creator['shared_bytes'], creator['publish_s'])}"
        pub = creator.get("publish") or {}
        steps = creator.get("steps", {})
        col["of which: store / blocks / adopt / plan"] = " / ".join(
            f"{steps.get(k, 0.0):.3f}" for k in ("store", "blocks", "adopt", "plan")) + " s"
        col["of which: waiting for pages (populate thread's time)"] = \
            f"{pub.get('populate_wait_s', 0.0):.3f} s ({pub.get('populate_s', 0.0):.3f} s)"
        col["creator close() / exit after it"] = f"{_s(creator.get('close_s'))} / {_s(creator.get('exit_s'))}"
    followers = group.get("followers") or []
    resident = (r.get("setup") or {}).get("resident_bytes", 0)
    for label, workers in follower_groups(group):
        if not workers:
            continue
        ready = [after_ready(label, w) for w in workers]
        copy = [w["steps"].get("prefetch_resident", 0.0) for w in workers]
        col[f"{label}: ready after READY (median, max)"] = f"{median(ready):.3f} / {max(ready):.3f} s " \
                                                          f"({median(ready) / g * 1e3:.0f} ms/GiB)"
        col[f"{label}: resident copy ({gib(resident)}), median"] = f"{median(copy):.3f} s, " \
                                                                   f"{_rate(resident, median(copy))}"
        col[f"{label}: phases, median ms ({' / '.join(PHASES)})"] = " / ".join(
            f"{median([w['steps'].get(step, 0.0) for w in workers]) * 1e3:.0f}" for step in PHASES.values())
        rings = [w["resident_copy"] for w in workers if w.get("resident_copy")]
        if rings:
            col[f"{label}: resident copy's ring, median ms (pages / registration / copy waited)"] = " / ".join(
                f"{median([c[k] for c in rings]) * 1e3:.0f}" for k in RING_PARTS) + \
                f"; read: {rings[0]['source']}, {rings[0]['threads']} workers"
        col[f"{label}: first forward (median)"] = _s(median([w["first_forward_s"] for w in workers]))
        col[f"{label}: background registration (median)"] = _s(median([w["register_s"] for w in workers]))
        col[f"{label}: close() max / exit after it max"] = \
            f"{max(w['close_s'] for w in workers):.3f} / {max(w['exit_s'] for w in workers):.3f} s"
    if "leftovers" in group:
        col["/dev/shm entries left after every process exited"] = str(len(group["leftovers"]))
    diffs = [w.get("max_abs_diff") for w in [creator, *followers, group.get("alone"), group.get("early")] if w]
    if diffs:
        col["max |out - reference| (every worker)"] = f"{max(diffs):.3g}"
    if r.get("error"):
        col["error"] = r["error"]
    return col


def follower_goal_rows(r: dict) -> list[list[str]]:
    """Per size: a follower ready after READY within its resident bytes at GOAL_FOLLOWER_GBPS plus
    GOAL_FOLLOWER_FIXED_S (alone, and the worst of those started together), and its close()."""
    group, resident = r["group"], (r.get("setup") or {}).get("resident_bytes", 0)
    goal = resident / (GOAL_FOLLOWER_GBPS * 1e9) + GOAL_FOLLOWER_FIXED_S
    rows = []
    for label, workers in follower_groups(group):
        if workers:
            worst = max(after_ready(label, w) for w in workers)
            shown = f"{len(workers)} followers together (worst)" if label == "followers together" else label
            rows.append([f"{shown} ready after READY, {r['gib']:g} GiB ({gib(resident)} resident)", f"{worst:.3f} s",
                         f"<= {goal:.3f} s", "met" if worst <= goal else "MISSED"])
    followers = [w for _label, workers in follower_groups(group) for w in workers]
    if followers:
        worst_close = max(w["close_s"] for w in followers)
        rows.append([f"follower close(), {r['gib']:g} GiB (worst)", f"{worst_close:.3f} s", f"<= {GOAL_CLOSE_S} s",
                     "met" if worst_close <= GOAL_CLOSE_S else "MISSED"])
    return rows


def goal_rows(results: list[dict]) -> list[list[str]]:
    rows = [row for x in results if x.get("group") for row in follower_goal_rows(x)]
    r = next((x for x in results if abs(x["gib"] - GOAL_SIZE_GIB) < 1e-9 and x.get("group")), None)
    if r is None:
        return rows
    group = r["group"]
    creator = group.get("creator")
    if creator:
        gbps = creator["shared_bytes"] / max(creator["publish_s"], 1e-9) / 1e9
        rows.append([f"creator publish, {GOAL_SIZE_GIB} GiB", f"{gbps:.1f} GB/s", f">= {GOAL_PUBLISH_GBPS} GB/s",
                     "met" if gbps >= GOAL_PUBLISH_GBPS else "MISSED"])
    if "leftovers" in group:
        rows.append(["/dev/shm after every process closed and exited", f"{len(group['leftovers'])} entries", "0",
                     "met" if not group["leftovers"] else "MISSED"])
    return rows


def build_sections(data: dict) -> list[tuple[str, str]]:
    results = data["sizes"]
    headers = ["measure"] + [f"{r['gib']:g} GiB" for r in results]
    columns = [size_row_values(r) for r in results]
    measures = list(dict.fromkeys(k for col in columns for k in col))
    rows = [[m] + [col.get(m, "-") for col in columns] for m in measures]
    model_rows = []
    for r in results:
        s = r.get("setup") or {}
        model_rows.append([f"{r['gib']:g} GiB", f"hidden {r['spec']['hidden']}, {r['spec']['layers']} layers",
                           gib(r["model_bytes"]), s.get("tensors", "-"), gib(s["resident_bytes"]) if s else "-",
                           gib(s["streamed_bytes"]) if s else "-", s.get("blocks", "-"), s.get("strategy", "-")])
    sections = [
        ("Models", table(["size", "model", "weights", "tensors", "resident (plan)", "streamed", "host blocks",
                          "strategy"], model_rows)),
        (f"Costs per size (and per GiB), {data['workers']} workers, {data['dtype']} on {data['device']}, "
         f"max_gpu_mem_fraction={data['fraction']}", table(headers, rows)),
    ]
    goals = goal_rows(results)
    if goals:
        sections.append(("Goals", table(["measure", "measured", "goal", "status"], goals)))
    for r in results:
        top = (r.get("setup") or {}).get("cprofile_top")
        if top:
            sections.append((f"Where the fresh profile's offload() and passes go, {r['gib']:g} GiB (cProfile: "
                             "flextensor's functions by cumulative time, then any by own time; "
                             f"cprofile-setup-{r['gib']:g}.txt has more)",
                             table(["function", "calls", "cumulative", "own"],
                                   [[f, n, f"{cum:.3f} s", f"{own:.3f} s"] for f, n, cum, own in top])))
    reads = data.get("reads")
    if reads:
        sections.append((f"A follower's reads of a {gib(reads['bytes'])} segment into the staging ring, host side "
                         f"only ({reads['threads']} worker{'s' if reads['threads'] != 1 else ''} each, fresh processes; see "
                         "bench/shm_rates.py)",
                         table(READ_HEADERS, read_rows(reads))))
    rates = data.get("tmpfs")
    if rates:
        sections.append((f"Shared-memory pages on this host ({gib(rates['bytes'])}, {rates['torch_threads']} torch "
                         "threads)", table(["way", "rate"], [[k, f"{v:.1f} GB/s" if isinstance(v, float) else v]
                                                             for k, v in rates.items()
                                                             if k not in ("bytes", "torch_threads")])))
    return sections


def phase_line(w: dict) -> str:
    """One follower's time to ready, step by step, on one line (ms)."""
    steps, ring = w.get("steps", {}), w.get("resident_copy") or {}
    parts = " ".join(f"{name} {steps[step] * 1e3:.0f}" for name, step in PHASES.items() if step in steps)
    line = f"ready {w['ready_s'] * 1e3:.0f} ms (after READY {w.get('after_ready_s', w['ready_s']) * 1e3:.0f}): {parts}"
    if ring:
        line += (f" | ring pages {ring['ring_populate_s'] * 1e3:.0f} register {ring['ring_register_s'] * 1e3:.0f} "
                 f"waited {ring['ring_wait_s'] * 1e3:.0f}; read {ring['source']} x{ring['threads']} "
                 f"{ring['gbps']:.1f} GB/s")
    return line + (f" | blocks registered in {w['register_s'] * 1e3:.0f}; close {w.get('close_s', 0) * 1e3:.0f}, "
                   f"exit {w.get('exit_s', 0) * 1e3:.0f}")


def print_phases(r: dict) -> None:
    group = r.get("group") or {}
    for label, workers in follower_groups(group):
        for w in workers:
            print(f"[{r['gib']:g} GiB] {label}: {phase_line(w)}", flush=True)


def save_partial(data: dict) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "bench_scale.partial.json").write_text(json.dumps(data, indent=2, default=str))
    (RESULTS_DIR / "bench_scale.md").write_text(docs_body(build_sections(data)))
