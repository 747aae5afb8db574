"""A rank that keeps serving from its host's shared copy until told to stop, for the multi-node tests (torchrun).

Run by torchrun as ``python -m tests.helpers.node_server --profile DIR --out DIR``: the rank opens a
``SharedOffloadSession`` in a namespace derived from the job (``MASTER_ADDR``/``MASTER_PORT``: the same on every
node), writes ``ready-<rank>.json`` (role, generation, output checksum), then runs a forward pass every 20 ms,
counting them in ``passes-<rank>`` and checking each output against its first, until ``<out>/stop`` exists. It
uses no process group: nodes share nothing after the rendezvous, as serving replicas do.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import flextensor as ft
from tests.helpers.models import TinyTransformer, tiny_transformer, token_ids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    namespace = f"node-test-{os.environ['MASTER_PORT']}"

    def meta_model() -> torch.nn.Module:
        with torch.device("meta"):
            return TinyTransformer()

    config = ft.OffloadConfig(pinned_memory=False, num_blocks=2, min_blocks=2)
    with ft.SharedOffloadSession(namespace, wait_timeout=120) as session:
        model = session.offload_from_profile(args.profile, config=config, name="model",
                                             creator_model_factory=lambda: tiny_transformer(seed=0),
                                             follower_model_factory=meta_model)
        ids = token_ids()
        with torch.no_grad():
            first = model(ids)
        report = {"rank": rank, "role": session.role("model"), "pid": os.getpid(),
                  "generation": session.report()[0]["generation"], "sum": float(first.double().sum())}
        (out / f"ready-{rank}.json").write_text(json.dumps(report))
        passes = 0
        while not (out / "stop").exists():
            with torch.no_grad():
                if not torch.equal(model(ids), first):
                    raise RuntimeError(f"rank {rank}: pass {passes} differs from the first")
            passes += 1
            (out / f"passes-{rank}").write_text(str(passes))
            time.sleep(0.02)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
