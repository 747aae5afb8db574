"""N ranks per host generate with ONE host copy of the model's weights (torchrun).

Run (every rank of the host shares one copy; rank r uses GPU ``LOCAL_RANK``, or the CPU on a CPU host)::

    # optional, ahead of the job (otherwise the first rank of each host profiles, under a file lock):
    python examples/torchrun_generate.py --make-profile --model /ckpt/llama --profile /var/cache/ft/llama
    torchrun --nproc-per-node 4 examples/torchrun_generate.py --model /ckpt/llama --profile /var/cache/ft/llama

    # no checkpoint at hand: a small Llama built from a config
    torchrun --nproc-per-node 3 examples/torchrun_generate.py --tiny-llama 8 --profile /tmp/tiny-profile

Each rank opens ``ft.SharedOffloadSession`` in the job's namespace (``--namespace``, else derived from the
rendezvous id or the master address and port, plus the model's identity), so the ranks of one job on one host
share one generation: one creator loads the checkpoint, the others attach. Each rank then generates greedily
from its own prompt; rank 0 prints every rank's tokens. ``--out DIR`` writes ``rank<r>.json`` per rank;
``--report-memory`` prints the sum of the ranks' PSS growth (``/proc/<pid>/smaps_rollup``, read while every
rank is attached) beside the model's size. Every rank closes its session, also on failure; the last one to
leave removes the shared memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flextensor as ft  # noqa: E402
from shared_generate import (  # noqa: E402
    add_model_args, compute_device, ensure_profile, generate, job_namespace, make_profile, model_bytes,
    open_shared_model, prompt_ids, pss_bytes, warm_up_process,
)


#: Below this, a rank's own fixed allocations outweigh the model in ``--report-memory``'s ratio.
SMALL_MODEL_BYTES = 64 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--make-profile", action="store_true",
                        help="profile once into --profile and exit (a plain python process, no torchrun)")
    parser.add_argument("--namespace", help="shared-memory namespace of the job (default: derived from the job)")
    parser.add_argument("--out", metavar="DIR", help="write rank<r>.json (role, prompt, tokens, memory) here")
    parser.add_argument("--report-memory", action="store_true",
                        help="read every rank's PSS before loading and while all are attached; rank 0 prints it")
    return parser.parse_args(argv)


def default_namespace(args: argparse.Namespace) -> str:
    """One namespace per job and model. torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``) names a job; without
    it (the id is then "none") the master address and port do, which no two live jobs share."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = f"{os.environ.get('MASTER_ADDR', 'localhost')}:{os.environ.get('MASTER_PORT', '0')}"
    return job_namespace("torchrun", run_id, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_profile:
        make_profile(args, compute_device(0), Path(args.profile))
        print(f"profile written to {args.profile}")
        return 0

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = compute_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    namespace = args.namespace or default_namespace(args)

    baseline = 0
    if args.report_memory:
        warm_up_process(args, device)
        dist.barrier()
        baseline = pss_bytes()

    made_profile = ensure_profile(args, device)  # the first rank of the host to get here profiles, if needed
    session = ft.SharedOffloadSession(namespace, wait_timeout=args.wait_timeout)
    try:
        start = time.monotonic()
        model = open_shared_model(session, args, device)
        ready_s = time.monotonic() - start
        share = session.report()[0]
        prompt = prompt_ids(args, rank, model.config.vocab_size)
        tokens = generate(model, prompt, args.max_new_tokens, device)
        dist.barrier()  # every rank attached (and done): the host holds one copy now
        attached = pss_bytes() if args.report_memory else 0
        result = {"rank": rank, "local_rank": local_rank, "pid": os.getpid(), "device": str(device),
                  "namespace": namespace, "role": share["role"], "generation": share["generation"],
                  "made_profile": made_profile, "ready_s": round(ready_s, 3), "prompt": prompt[0].tolist(),
                  "tokens": tokens, "pss_baseline": baseline, "pss_attached": attached}
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
        results: list[dict] = [{}] * world
        dist.all_gather_object(results, result)
        if rank == 0:
            print_summary(args, namespace, results)
        dist.barrier()  # nobody leaves (unmapping its view) before rank 0 has read the numbers
    finally:
        session.close()
        dist.destroy_process_group()
    return 0


def print_summary(args: argparse.Namespace, namespace: str, results: list[dict]) -> None:
    print(f"namespace {namespace}: {sum(r['role'] == 'creator' for r in results)} creator(s), "
          f"{sum(r['role'] == 'follower' for r in results)} follower(s)")
    for r in results:
        print(f"rank {r['rank']} ({r['device']}, {r['role']}, generation {r['generation']}, ready in "
              f"{r['ready_s']:.2f} s): {r['tokens']}")
    if args.report_memory:
        nbytes = model_bytes(args)
        growth = [r["pss_attached"] - r["pss_baseline"] for r in results]
        n = len(results)
        print(f"PSS growth per rank (MiB): {', '.join(f'{g / 2**20:.1f}' for g in growth)}")
        beyond = (sum(growth) - nbytes) / n
        print(f"PSS growth, sum over {n} ranks: {sum(growth) / 2**20:.1f} MiB; model {nbytes / 2**20:.1f} MiB; "
              f"ratio {sum(growth) / nbytes:.2f} model copies (goal: 1 + 0.1 x {n} = {1 + 0.1 * n:.1f}; "
              f"{n} private copies: {n:.1f}); beyond one copy, {beyond / 2**20:.1f} MiB per rank")
        if nbytes < SMALL_MODEL_BYTES:
            print(f"note: a {nbytes / 2**20:.1f} MiB model is smaller than what each rank allocates for itself anyway "
                  "(allocator arenas, the model's Python objects, the generation's buffers: a few MiB), so the "
                  "ratio says little; judge it with a real checkpoint or --tiny-llama 8 --hidden 512 --vocab 1024 "
                  "(about 80 MiB)")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
