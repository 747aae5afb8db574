"""Colocated training and serving on one host copy: a trainer changes the weights, the workers sleep and wake.

Run::

    python examples/colocated_rl.py --tiny-llama 4 --profile /tmp/rl-profile --workers 2 --steps 3

The shape of reinforcement-learning post-training (PPO, GRPO) with generation and training on the same devices:

1. every worker generates greedy tokens for its prompt with the weights it holds (the rollout);
2. the trainer tells the workers to sleep: each calls ``ft.sleep(name)``, which frees its device memory and
   keeps its plan; the host copy of the weights stays, shared by all of them;
3. the trainer takes a training step on its own (plain) model: it raises the likelihood of the tokens the
   workers generated, a few SGD steps, so the weights really change;
4. it writes the new weights into the shared host copy once, in place (``session.update_weights``), which is
   allowed only while every worker of the host sleeps, and publishes a version number with them;
5. the workers wake (``ft.wake(name)``): their resident tensors come back from the host copy, their streamed
   layers stream from it, and the next rollout uses the new weights. Each worker reports which version it
   holds, and the trainer checks that its tokens equal those of its plain model holding the same weights.

The trainer is itself a participant of the namespace (it publishes the first weights, as the creator, and then
sleeps for good), so the workers attach to its copy. Workers are this file with ``--worker``; they read one
JSON command per line on stdin and answer one JSON line on stdout, and die with the trainer (EOF). The trainer
prints one JSON object per line: ``rollout`` (per worker: version, tokens, equal), ``update`` (version, bytes,
seconds), ``sleep``/``wake`` (seconds per worker), and exits 1 if any tokens differed from its plain model's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_generate import (  # noqa: E402
    MANAGER, add_model_args, compute_device, ensure_profile, generate, job_namespace, load_model, open_shared_model,
    prompt_ids,
)

import flextensor as ft  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps, each followed by an update (default 3)")
    parser.add_argument("--lr", type=float, default=0.02, help="the trainer's SGD learning rate (default 0.02)")
    parser.add_argument("--job-id", default="colocated-rl", help="names the job's shared memory")
    parser.add_argument("--lease", type=float, default=30.0, help="seconds a dead participant keeps its lease")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


# ------------------------------------------------------------------------------------------------ a worker
def worker_main(args: argparse.Namespace) -> int:
    """Serve: generate on ``rollout``, free the device on ``sleep``, take it back on ``wake``."""
    device = compute_device(args.worker)
    namespace = job_namespace(args.job_id, args.job_id, args)
    with ft.SharedOffloadSession(namespace, wait_timeout=args.wait_timeout, lease_seconds=args.lease) as session:
        model = open_shared_model(session, args, device)
        ids = prompt_ids(args, args.worker, model.config.vocab_size)
        emit(event="ready", role=session.role(MANAGER), pid=os.getpid())
        for line in sys.stdin:
            command = json.loads(line)["op"]
            if command == "rollout":
                tokens = generate(model, ids, args.max_new_tokens, device)
                emit(event="rollout", tokens=tokens, version=session.weights_version(MANAGER))
            elif command == "sleep":
                held = ft.get_gpu_memory_usage(MANAGER).total_bytes
                start = time.perf_counter()
                ft.sleep(MANAGER)
                emit(event="asleep", seconds=time.perf_counter() - start, freed=held)
            elif command == "wake":
                seconds = ft.wake(MANAGER)
                emit(event="awake", seconds=seconds, version=session.weights_version(MANAGER))
            elif command == "exit":
                break
    return 0


class Worker:
    """A worker process, driven over its pipes (JSON lines)."""

    def __init__(self, index: int, argv: list[str]) -> None:
        self.index = index
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(index)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, op: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.index} exited (rc {self.proc.wait()})")
        return json.loads(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            self.proc.stdin.close()
        return self.proc.wait(60)


# ------------------------------------------------------------------------------------------------ the trainer
def train_step(model: torch.nn.Module, prompts: list[torch.Tensor], rollouts: list[list[int]], lr: float,
               device: torch.device) -> float:
    """A few SGD steps that raise the likelihood of the generated tokens (a stand-in for a policy update)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    loss_value = 0.0
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.zeros((), device=device)
        for ids, tokens in zip(prompts, rollouts):
            sequence = torch.cat([ids.to(device), torch.tensor([tokens], device=device)], dim=1)
            logits = model(sequence).logits[:, ids.shape[1] - 1:-1].float()
            loss = loss + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                            sequence[:, ids.shape[1]:].reshape(-1))
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    return loss_value


def trainer_main(args: argparse.Namespace, argv: list[str]) -> int:
    device = compute_device(0)
    ensure_profile(args, device)
    namespace = job_namespace(args.job_id, args.job_id, args)
    policy = load_model(args).to(device)  # the trainer's own model: trained, never offloaded
    prompts = [prompt_ids(args, index, policy.config.vocab_size) for index in range(args.workers)]
    mismatches = 0
    with ft.SharedOffloadSession(namespace, wait_timeout=args.wait_timeout, lease_seconds=args.lease) as session:
        open_shared_model(session, args, device)  # first to arrive: it publishes the weights for everyone
        ft.sleep(MANAGER)  # its own copy never serves: it sleeps, so that updates are allowed
        workers = [Worker(index, argv) for index in range(args.workers)]
        try:
            for worker in workers:
                ready = worker.answer()
                emit(event="worker", index=worker.index, role=ready["role"], pid=ready["pid"])
            for step in range(args.steps + 1):
                answers = [worker.ask("rollout") for worker in workers]
                rollouts = [a["tokens"] for a in answers]
                expected = [generate(policy, ids, args.max_new_tokens, device) for ids in prompts]
                equal = [got == want for got, want in zip(rollouts, expected)]
                mismatches += equal.count(False)
                emit(event="rollout", step=step, versions=[a["version"] for a in answers], equal=equal,
                     tokens=rollouts)
                if step == args.steps:
                    break
                asleep = [worker.ask("sleep") for worker in workers]
                emit(event="sleep", seconds=[a["seconds"] for a in asleep], freed=[a["freed"] for a in asleep])
                loss = train_step(policy, prompts, rollouts, args.lr, device)
                report = session.update_weights(policy.state_dict(), name=MANAGER)
                emit(event="update", step=step, loss=loss, version=report.version, tensors=report.tensors,
                     bytes=report.nbytes, seconds=report.seconds, gbps=report.gbps, complete=report.complete)
                awake = [worker.ask("wake") for worker in workers]
                emit(event="wake", seconds=[a["seconds"] for a in awake], versions=[a["version"] for a in awake])
        finally:
            codes = [worker.stop() for worker in workers]
    emit(event="done", mismatches=mismatches, worker_exit_codes=codes)
    return 1 if mismatches or any(codes) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker is not None:
        return worker_main(args)
    return trainer_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
