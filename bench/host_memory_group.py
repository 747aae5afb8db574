"""Host RAM and shut-down of a sharing group: ``--workers`` processes of one ``SharedOffloadSession``.

Why: one pinned copy per host is what sharing promises, and a worker's shut-down is what a supervisor restarting a
job waits for. Before the group starts, a process of its own computes the layer-by-layer reference output from
the model's recipe (``mlp_stack.recipe_reference``: no model in host RAM), and reports what its first forward's
math libraries took (RSS). Each worker (``bench_host_memory``'s model and memory-mode configuration, adopting
that size's saved profile) creates its CUDA context, then all start at once as a server's workers do: one is
elected and its factory builds the model in host RAM, as a user's factory does (nothing else: the reference is
not computed there, so the creator does not load the math libraries inside its session), the others build on
``meta`` and attach. Measured:

- the creator's ``VmHWM`` over its RSS at the session's start: growth over the model's bytes (the factory's model
  is one copy; the blocks replace it as they are published), and its two parts: the factory's own peak, and the
  publish's peak over the RSS the factory ended at (the pages ahead of the copy, the piece being copied, the
  session's runtime); the publish's rate (``session.report()``);
- every worker's PSS once all are ready and again after serving, summed, over the model's bytes;
- serving: a checked forward, then ``serve_passes`` passes alternating through ``serve_batches``, all workers at
  once (the pinned staging, the resident copies and the registrations are all in use when they close);
- shut-down: every worker ``close()``s at once and exits right after; ``close()`` and the exit after it, then
  what the namespace left in ``/dev/shm``;
- or, with ``kill``: ``ftd`` serves the lock directory, every worker is SIGKILLed once it has served, and the time
  until ``/dev/shm`` holds nothing of the namespace, beside the time until every killed process has exited (both
  watched from the kill on).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    JsonLineWorker, cleanup_namespace, close_together, json_worker_main, loaded_then_wait, namespace_leftovers,
    proc_status, pss_bytes, report_close, reset_peak_rss, start_together,
)

MANAGER = "hostmem"


@dataclass
class GroupParams:
    """Everything a worker needs, passed as one JSON argument."""

    layers: int
    profile: str
    reference: str  # the checked output, written before the workers start (``write_reference``)
    namespace: str = ""
    batch: int = 16
    serve_batches: list[int] = field(default_factory=lambda: [1, 4096])
    serve_passes: int = 8
    wait_timeout: float = 600.0


def memory_mode_config():
    """The configuration every host-memory path runs with in memory mode: the defaults, the traps named."""
    import flextensor as ft

    return ft.OffloadConfig(max_gpu_mem_fraction=0.015, include_patterns=["class:Block"])


# ================================================================================================================
# Worker side (``host_memory_group.py --worker session PARAMS_JSON``)
# ================================================================================================================


def _serve(p: GroupParams, proxy) -> dict:
    import torch
    from safetensors.torch import load_file

    from mlp_stack import close_to, inputs

    with torch.no_grad():
        out = proxy(inputs(p.batch).cuda())
        equal = close_to(out, load_file(p.reference)["out"])
        batches = {b: inputs(b, seed=2).cuda() for b in p.serve_batches}
        times: dict[str, list[float]] = {str(b): [] for b in p.serve_batches}
        for i in range(p.serve_passes):
            b = p.serve_batches[i % len(p.serve_batches)]
            torch.cuda.synchronize()
            begin = time.perf_counter()
            proxy(batches[b])
            torch.cuda.synchronize()
            times[str(b)].append(time.perf_counter() - begin)
    return {"equal": equal, "passes_s": times}


def worker_session(p: GroupParams) -> None:
    import torch

    import flextensor as ft
    from mlp_stack import build, build_meta

    torch.ones(1, device="cuda").sum().item()  # the CUDA context: a per-process constant, before the baseline
    ft.SharedOffloadSession  # resolve the lazy import before the clock starts
    loaded_then_wait()
    reset_peak_rss()
    info: dict = {"role": "follower", "pid": os.getpid(), "before": proc_status("VmRSS")}

    def creator_factory():
        info["role"] = "creator"
        model = build(p.layers, "cpu")
        # The factory's own peak, then the publish's from here (the call's peak is the higher of the two).
        info.update(factory_peak=proc_status("VmHWM"), factory_rss=proc_status("VmRSS"))
        reset_peak_rss()
        return model

    session = ft.SharedOffloadSession(p.namespace, wait_timeout=p.wait_timeout)
    try:
        start = time.monotonic()
        proxy = session.offload_from_profile(p.profile, config=memory_mode_config(), name=MANAGER,
                                             creator_model_factory=creator_factory,
                                             follower_model_factory=lambda: build_meta(p.layers))
        torch.cuda.synchronize()
        info.update(ready_s=time.monotonic() - start, peak=proc_status("VmHWM"), rss=proc_status("VmRSS"))
        if info["role"] == "creator":
            info.update(publish_peak=info["peak"], peak=max(info["peak"], info["factory_peak"]),
                        publish=session.report()[0].get("publish", {}))
        print(json.dumps(info), flush=True)
        command = sys.stdin.readline().strip()
        if command == "serve":
            print(json.dumps(_serve(p, proxy)), flush=True)
            command = sys.stdin.readline().strip()
        if command == "close":
            report_close(session)
    finally:
        session.close()  # idempotent; the process exits right after, as a worker that shuts down would


def reference_main(raw: str) -> None:
    """``--reference PARAMS_JSON``: write the checked output from the recipe; print the RSS that starting CUDA and
    the first forward (the math libraries' kernels and handles) took in this process."""
    import torch
    from safetensors.torch import save_file

    from mlp_stack import D, DTYPE, inputs, recipe_reference

    p = GroupParams(**json.loads(raw))
    before = proc_status("VmRSS")
    torch.ones(1, device="cuda").sum().item()
    context = proc_status("VmRSS") - before
    before = proc_status("VmRSS")
    x = torch.ones(p.batch, D, dtype=DTYPE, device="cuda")
    (x @ torch.ones(D, D, dtype=DTYPE, device="cuda")).sum().item()
    kernels = proc_status("VmRSS") - before
    tmp = p.reference + ".tmp"
    save_file({"out": recipe_reference(p.layers, inputs(p.batch)).contiguous()}, tmp)
    os.replace(tmp, p.reference)
    print(json.dumps({"context_rss": context, "first_forward_rss": kernels}), flush=True)


def write_reference(p: GroupParams, timeout: float) -> dict:
    """The reference output of ``p``'s model, written to ``p.reference`` by a process of its own; what that
    process's CUDA start and first forward took in RSS (a creator that computed the reference in its factory would
    count them as growth of its session)."""
    import subprocess

    proc = subprocess.run([sys.executable, __file__, "--reference", json.dumps(asdict(p))], capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the reference process failed (exit status {proc.returncode}): "
                           + (proc.stderr or proc.stdout)[-2000:])
    return json.loads(lines[-1])


def worker_main(raw: str) -> None:
    json_worker_main("group", lambda: worker_session(GroupParams(**json.loads(raw))))


# ================================================================================================================
# Parent side
# ================================================================================================================


class Worker(JsonLineWorker):
    def __init__(self, params: GroupParams) -> None:
        super().__init__(__file__, "session", asdict(params))


def leftovers(namespace: str) -> list[str]:
    return namespace_leftovers(namespace, MANAGER)


def _pss_sum(workers: list[Worker]) -> int:
    return sum(pss_bytes(w.proc.pid) for w in workers)


def _start_daemon(tmp: Path):
    """``ftd serve`` on this user's lock directory, its socket in ``tmp``; workers started after this find it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.daemon.helpers import Daemon

    from flextensor.shm.names import lock_directory

    sock_dir = tmp / "ftd"
    sock_dir.mkdir(mode=0o700)
    daemon = Daemon(sock_dir / "ftd.sock", lock_directory()).start()
    os.environ["FT_DAEMON_SOCKET"] = str(daemon.socket)
    return daemon


def run_group(params: GroupParams, workers: int, kill: bool, timeout: float) -> dict:
    """One sharing group of ``workers``; see the module docstring. Returns the raw measures."""
    params = GroupParams(**{**asdict(params), "namespace": f"hostmem{uuid.uuid4().hex[:10]}"})
    out: dict = {"workers": workers, "kill": kill}
    tmp = Path(tempfile.mkdtemp(prefix="ft-hostmem-group-"))
    daemon = _start_daemon(tmp) if kill else None
    started: list[Worker] = []
    try:
        out["reference_process"] = write_reference(params, timeout)
        started = [Worker(params) for _ in range(workers)]
        out["ready"] = start_together(started, timeout)
        out["pss_ready"] = _pss_sum(started)
        for w in started:
            w.send("serve")
        out["served"] = [w.read(timeout) for w in started]
        out["pss_served"] = _pss_sum(started)
        if kill:
            for w in started:
                os.kill(w.proc.pid, signal.SIGKILL)
            begin = time.monotonic()
            # Both watched at once: the names may go before the killed processes finish dying (their teardown
            # frees their mappings, which no cleanup can hurry), and each is timed on its own.
            while time.monotonic() - begin < 60.0 and ("reclaim_s" not in out or "exited_s" not in out):
                now = time.monotonic() - begin
                if "reclaim_s" not in out and not leftovers(params.namespace):
                    out["reclaim_s"] = now
                if "exited_s" not in out and all(w.proc.poll() is not None for w in started):
                    out["exited_s"] = now
                time.sleep(0.005)
            out.setdefault("reclaim_s", float("inf"))
        else:
            out["closed"] = close_together(started, timeout)
        out["leftovers"] = leftovers(params.namespace)
    finally:
        for w in started:
            w.kill()
        if daemon is not None:
            daemon.stop()
            os.environ.pop("FT_DAEMON_SOCKET", None)
        if any(w.proc.returncode not in (0, None) for w in started) or out.get("leftovers"):
            cleanup_namespace(params.namespace, MANAGER, timeout=45.0)
    return out


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "--reference":
        reference_main(sys.argv[2])
    else:
        sys.exit("host_memory_group.py is run by bench_host_memory.py")
