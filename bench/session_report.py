"""The tables of ``bench_session.py`` from its raw results: the model, host RAM per group against its goal, time
to ready per group and over every follower, shared against private host copies, and the forward pass of each
worker against a single process (on a CPU host also against a plain twin in the same process).

Kept apart from the measuring so that the goals and what each row excludes (the resident copy a follower makes
on its attach thread, the device blocks a CPU worker holds in host memory) live in one place, and a saved
``bench_session.json`` can be turned into the same tables again.
"""

from __future__ import annotations

from common import gib, median, percentile, table

GOAL_PSS_RATIO = 1.05
GOAL_FORWARD_RATIO = 1.02
GOAL_CPU_PLAIN_RATIO = 1.05  # a CPU worker computing from shared blocks in place vs the plain model


def device_block_allowance(group: dict, device: str) -> int:
    """Host bytes the workers legitimately hold beside the shared copy: on a CPU host each worker's rotating
    device blocks are host memory (as reported by ``get_gpu_memory_usage().block_bytes``); on a GPU host they
    live on the device, so nothing is allowed."""
    if device.startswith("cuda"):
        return 0
    return sum(w["device_block_bytes"] for w in group["workers"])


def resident_copy_on_critical_path(worker: dict) -> float:
    """What the goal excludes: the part of the follower's wall time spent on resident copies to the GPU.

    The follower copies them on its attach thread while the model factory runs (``flextensor.sharing.attach_prefetch``),
    as the thread's last step. So of the time the session waited for the thread after the factory, no more than
    the copy took is copy time on the critical path."""
    steps = worker["steps"]
    return min(steps["prefetch_wait"], steps.get("prefetch_resident", 0.0))


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _ms_median(samples: list[float]) -> str:
    return ms(median(samples)) if samples else "-"


def build_sections(r: dict) -> list[tuple[str, str]]:
    model_bytes, tensors = r["model_bytes"], r["tensors"]
    goal_ready = 0.050 + 10e-6 * tensors
    pss_rows, ready_rows, all_follow, all_first, all_factory = [], [], [], [], []
    for g in r["groups"]:
        n = g["n"]
        allowance = GOAL_PSS_RATIO + device_block_allowance(g, r["device"]) / model_bytes
        ratio = g["pss_growth_sum"] / model_bytes
        joined = [w for w in g["workers"] + [w for wave in g.get("waves", []) for w in wave] if w["role"] == "follower"]
        follow = [w["ready_s"] - resident_copy_on_critical_path(w) for w in joined]
        all_factory += [w["steps"].get("factory", 0.0) for w in joined]
        first = [w["first_forward_s"] for w in joined]
        all_follow += follow
        all_first += first
        creator = next(w for w in g["workers"] if w["role"] == "creator")
        roles = sorted(w["role"] for w in g["workers"])
        pss_rows.append([n, f"{roles.count('creator')} / {roles.count('follower')}", gib(g["pss_growth_sum"]),
                         f"{ratio:.3f}x", f"<= {allowance:.3f}x", "met" if ratio <= allowance else "MISSED",
                         f"{max(w['max_abs_diff'] for w in g['workers']):.3g}"])
        register = [w.get("register_s", 0.0) for w in joined]
        synced = [w.get("ready_synced_s", w["ready_s"]) - resident_copy_on_critical_path(w) for w in joined]
        ready_rows.append([n, len(follow), _ms_median(follow), ms(percentile(follow, 95)) if follow else "-",
                           ms(percentile(synced, 95)) if synced else "-",
                           _ms_median(register), _ms_median(first), ms(creator["first_forward_s"]),
                           ms(creator["factory_s"]),
                           ms(creator["publish_s"]), ms(creator["ready_s"])])
    private = r["private"]
    summary_rows = [
        ["follower time to ready, all N (excl. resident copy)", _ms_median(all_follow),
         ms(percentile(all_follow, 95)) if all_follow else "-", f"< {goal_ready * 1e3:.1f} ms (p95)",
         "n/a" if not all_follow else ("met" if percentile(all_follow, 95) < goal_ready else "MISSED")],
        ["of which the user's model factory (runs beside the attach thread)", _ms_median(all_factory),
         ms(percentile(all_factory, 95)) if all_factory else "-", "-", "-"],
        ["follower's first forward (waits for blocks not yet registered)", _ms_median(all_first),
         ms(percentile(all_first, 95)) if all_first else "-", "-", "-"],
        [f"private load from safetensors ({private['n']} concurrent workers)", ms(median(private["ready_s"])),
         ms(percentile(private["ready_s"], 95)), "-", "-"],
    ]
    host_rows = [[f"{private['n']} private copies", gib(private["pss_growth_sum"]),
                  f"{private['pss_growth_sum'] / model_bytes:.3f}x"]]
    host_rows += [[f"{g['n']} shared workers", gib(g["pss_growth_sum"]), f"{g['pss_growth_sum'] / model_bytes:.3f}x"]
                  for g in r["groups"] if g["n"] == private["n"]]
    sections = [
        ("Model", table(["model", "dtype / device", "weights", "tensors", "resident (not streamed)"], [[
            f"hidden {r['spec']['hidden']}, {r['spec']['layers']} layers, vocab {r['spec']['vocab']}",
            f"{r['dtype']} on {r['device']}", gib(model_bytes), tensors, gib(r["resident_bytes"])]])),
        ("Host RAM: sum of PSS growth over an idle worker", table(
            ["N", "creator / followers", "sum of PSS growth", "x model bytes", "goal", "status",
             "max |out - reference|"], pss_rows)),
        ("Time to ready per N", table(
            ["N", "follower samples", "follower median (excl. resident copy)", "follower p95",
             "p95 with a device synchronize", "background cudaHostRegister (median)",
             "follower first forward (median)", "creator first forward", "creator checkpoint factory",
             "creator publish", "creator total"], ready_rows)),
        ("Follower attach vs private load", table(["measure", "median", "p95", "goal", "status"], summary_rows)),
        ("Shared vs private host copies", table(["layout", "sum of PSS growth", "x model bytes"], host_rows)),
    ]
    fwd = next((g for g in r["groups"] if any("forward_s" in w for w in g["workers"])), None)
    if fwd:
        single = fwd["single"]["forward_s"]
        rows = [[w["role"], "in publish" if w["role"] == "creator" else ms(w.get("register_s")), ms(w["ready_s"]),
                 ms(w["forward_s"]),
                 f"{w['forward_s'] / single:.3f}x",
                 "met" if w["forward_s"] / single <= GOAL_FORWARD_RATIO else "MISSED"] for w in fwd["workers"]]
        rows.append(["single process, private offload (same profile)", "-", "-", ms(single), "1.000x", "-"])
        paired = all("plain_s" in w for w in fwd["workers"])
        if paired:  # CPU: each worker's in-place forward against a plain twin in the same process
            rows = [row + [f"{w['paired_s'] * 1e3:.1f} / {w['plain_s'] * 1e3:.1f} ms",
                           f"{w['paired_s'] / w['plain_s']:.3f}x",
                           "met" if w["paired_s"] / w["plain_s"] <= GOAL_CPU_PLAIN_RATIO else "MISSED"]
                    for row, w in zip(rows, fwd["workers"])] + [rows[-1] + ["-", "-", "-"]]
        sections.append((f"Forward, {fwd['n']} workers one at a time vs single-process offload "
                         f"(B={r['batch']}, S={r['seq']})", table(
                             ["worker", "cudaHostRegister of the blocks", "time to ready", "forward (median)",
                              "x single process", f"goal <= {GOAL_FORWARD_RATIO}x"]
                             + (["paired with a plain twin (median)", "x plain twin",
                                 f"goal <= {GOAL_CPU_PLAIN_RATIO}x"] if paired else []),
                             rows)))
    return sections
