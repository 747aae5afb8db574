"""N Ray actors on one node serve one model from ONE host copy of its weights; a restarted actor re-attaches.

Run (a local Ray, or ``--address auto`` to join a running cluster; the replicas must land on one node)::

    python examples/ray_replicas.py --replicas 4 --gpus-per-replica 1 --model /ckpt/llama --profile /var/cache/ft/llama
    python examples/ray_replicas.py --replicas 2 --num-cpus 2 --tiny-llama 8 --profile /tmp/tiny-profile --restart-one

Each replica is an actor that opens ``ft.SharedOffloadSession`` in the job's namespace (derived from the Ray job id
and the model): the first actor to arrive loads the checkpoint, the others attach. ``max_restarts`` lets Ray start
a dead actor again; its ``__init__`` then joins the live generation as a follower (the dead process's lease runs
out after ``--lease`` seconds, or at once with ``ftd``). ``--restart-one`` shows it: after the first round, one
actor is killed (``ray.kill(..., no_restart=False)``) and asked to generate again.

On the way out the driver closes every replica's session and then calls ``cleanup_namespace`` for what a crashed
actor may have left. That call runs in the driver, so it reclaims the driver's node: with replicas on other nodes
run ``ftd`` there (see docs/launchers.md). The driver prints one JSON object per line (``ready``, ``tokens``,
``restarted``, ``cleanup``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_generate import MANAGER, add_model_args, job_namespace  # noqa: E402

EXAMPLES = str(Path(__file__).resolve().parent)


class Replica:
    """One serving replica: its own process, one share of the job's host copy."""

    def __init__(self, args: argparse.Namespace, namespace: str, index: int) -> None:
        import torch

        import flextensor as ft
        from shared_generate import build_meta_model, compute_device, ensure_profile, open_shared_model, prompt_ids

        self.args, self.index = args, index
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU(s): it is cuda:0 in here.
        self.device = compute_device(0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        ensure_profile(args, self.device)
        # The model classes' first import takes seconds: done here, a restarted actor's join is the attach alone.
        build_meta_model(args)
        self.session = ft.SharedOffloadSession(namespace, wait_timeout=args.wait_timeout, lease_seconds=args.lease)
        self.model = open_shared_model(self.session, args, self.device)
        self.prompt = prompt_ids(args, index, self.model.config.vocab_size)

    def info(self) -> dict[str, Any]:
        share = self.session.report()[0]
        return {"replica": self.index, "pid": os.getpid(), "role": share["role"], "generation": share["generation"],
                "ready_s": round(share["ready_s"], 3), "wait_s": round(share["wait_s"], 3),
                "steps": {k: round(v, 3) for k, v in share["steps"].items()}}

    def generate(self) -> list[int]:
        from shared_generate import generate

        return generate(self.model, self.prompt, self.args.max_new_tokens, self.device)

    def close(self) -> None:
        self.session.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--replicas", type=int, default=2, help="actors (default 2)")
    parser.add_argument("--address", default=None, help="Ray address (default: start a local Ray)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--gpus-per-replica", type=float, default=0.0)
    parser.add_argument("--lease", type=float, default=30.0, help="heartbeat lease of each replica, in seconds")
    parser.add_argument("--restart-one", action="store_true", help="kill replica 0 once; Ray restarts it")
    return parser.parse_args(argv)


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The actors import shared_generate from this directory (no packaging needed on one node).
    ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [EXAMPLES,
                                                                                  os.environ.get("PYTHONPATH")]))}})
    namespace = job_namespace("ray", ray.get_runtime_context().get_job_id(), args)
    actor = ray.remote(num_cpus=args.cpus_per_replica, num_gpus=args.gpus_per_replica,
                       max_restarts=3, max_task_retries=3)(Replica)
    replicas = [actor.remote(args, namespace, i) for i in range(args.replicas)]
    try:
        for info in ray.get([r.info.remote() for r in replicas]):
            emit("ready", namespace=namespace, **info)
        for i, tokens in enumerate(ray.get([r.generate.remote() for r in replicas])):
            emit("tokens", replica=i, tokens=tokens)
        if args.restart_one:
            old = ray.get(replicas[0].info.remote())
            start = time.monotonic()
            ray.kill(replicas[0], no_restart=False)  # the process dies as in a crash; Ray starts it again
            tokens = ray.get(replicas[0].generate.remote())  # retried on the restarted actor
            emit("restarted", replica=0, old_pid=old["pid"], restart_s=round(time.monotonic() - start, 3),
                 tokens=tokens, **{k: v for k, v in ray.get(replicas[0].info.remote()).items() if k != "replica"})
    finally:
        for r in replicas:
            try:
                ray.get(r.close.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - a dead replica: cleanup_namespace below reclaims its share
                emit("close-failed", error=type(exc).__name__)
        for r in replicas:
            ray.kill(r, no_restart=True)
        import flextensor as ft

        reports = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=[MANAGER],
                                                            timeout=args.lease + 5)
        emit("cleanup", namespace=namespace, removed=sum(len(r.removed) for r in reports))
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
