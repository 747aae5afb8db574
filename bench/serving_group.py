"""The serving benchmark's sharing group: ``workers`` processes of one ``SharedOffloadSession`` serve the trace.

Why: a worker of a sharing group adopts the plan that was published (a profile made at one batch) and never
replans, so whatever batch it is given must be served within the bound from its first pass. Each worker adopts
``bench_serving``'s saved profile (the creator builds the model in host RAM, the others on ``meta``), keeps a
resident twin of its own, and then, in turns (one worker's timings never share the GPU with another's), serves
``repeat`` passes at batch 1 and the trace; every worker then closes, and nothing of the namespace may remain.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    JsonLineWorker, cleanup_namespace, close_together, json_worker_main, loaded_then_wait, namespace_leftovers,
    report_close, start_together,
)

MANAGER = "serving"


@dataclass
class GroupParams:
    """Everything a worker needs, as one JSON argument."""

    layers: int
    d: int
    h: int
    profile: str
    namespace: str
    batches: list[int] = field(default_factory=list)
    repeat: int = 10
    wait_timeout: float = 600.0


def serving_config(cuda: bool):
    """The configuration served with: latency mode (the default), the layers named."""
    import flextensor as ft

    return ft.OffloadConfig(include_patterns=["layers.*"], pinned_memory=cuda)


# ================================================================================================================
# Worker side (``serving_group.py --worker session PARAMS_JSON``)
# ================================================================================================================


def worker_session(p: GroupParams) -> None:
    import torch

    import flextensor as ft
    from serving_trace import Inputs, Timer, build, build_meta, repeated, serve

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    twin = build(p.layers, p.d, p.h, dtype, device, draw_on=device)
    loaded_then_wait()
    role = {"role": "follower"}

    def creator_factory():
        role["role"] = "creator"
        return build(p.layers, p.d, p.h, dtype, torch.device("cpu"), draw_on=device)

    session = ft.SharedOffloadSession(p.namespace, wait_timeout=p.wait_timeout)
    try:
        model = session.offload_from_profile(p.profile, config=serving_config(cuda), name=MANAGER,
                                             creator_model_factory=creator_factory,
                                             follower_model_factory=lambda: build_meta(p.layers, p.d, p.h, dtype))
        print(json.dumps({"pid": os.getpid(), **role}), flush=True)
        command = sys.stdin.readline().strip()
        if command == "serve":
            inputs, timer = Inputs(p.d, dtype, device), Timer(cuda)
            at_one = repeated(model, twin, inputs(1), p.repeat, timer)
            records = serve(model, twin, p.batches, inputs, timer)
            usage = ft.get_offload_manager(MANAGER).get_gpu_memory_usage()
            print(json.dumps({"batch1": at_one, "records": records, "block_bytes": usage.block_bytes,
                              "resident_bytes": usage.resident_bytes}), flush=True)
            command = sys.stdin.readline().strip()
        if command == "close":
            report_close(session)
    finally:
        session.close()


def worker_main(raw: str) -> None:
    json_worker_main("serving", lambda: worker_session(GroupParams(**json.loads(raw))))


# ================================================================================================================
# Parent side
# ================================================================================================================


def leftovers(namespace: str) -> list[str]:
    return namespace_leftovers(namespace, MANAGER)


def run_group(params: GroupParams, workers: int, timeout: float = 900.0) -> dict:
    """Start ``workers`` at once, let each serve in turn, close them together; per worker its report, and what the
    namespace left in ``/dev/shm`` afterwards."""
    params.namespace = params.namespace or f"bench-serving-{uuid.uuid4().hex[:8]}"
    group = [JsonLineWorker(__file__, "session", asdict(params)) for _ in range(workers)]
    try:
        ready = start_together(group, timeout)
        served = []
        for w in group:
            w.send("serve")
            served.append(w.read(timeout))
        close_together(group, timeout)
        for w in group:
            w.proc.wait(timeout)
    finally:
        for w in group:
            w.kill()
        left = leftovers(params.namespace)
        if left:  # a worker failed: reclaim what it left, after the count above
            cleanup_namespace(params.namespace, MANAGER, timeout=30)
    return {"ready": ready, "served": served, "left": left}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[3])
    else:
        sys.exit("serving_group.py is run by bench_serving.py")
