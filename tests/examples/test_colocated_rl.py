"""examples/colocated_rl.py on the CPU: a trainer and two workers of one host copy, sleeping, updated, woken."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES, record, run, tiny_args

pytest.importorskip("transformers")

from shared_generate import model_bytes  # noqa: E402

STEPS = 2


def test_workers_generate_what_a_plain_model_with_the_updated_weights_generates(
        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    proc = run([sys.executable, str(EXAMPLES / "colocated_rl.py"), "--tiny-llama", "4", "--profile",
                str(tmp_path / "profile"), "--workers", "2", "--steps", str(STEPS), "--max-new-tokens", "8",
                "--lease", "5"], timeout=240)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_kind: dict[str, list[dict]] = {}
    for event in events:
        by_kind.setdefault(event["event"], []).append(event)
    assert [w["role"] for w in by_kind["worker"]] == ["follower", "follower"]  # the trainer published the copy
    rollouts = by_kind["rollout"]
    assert [r["versions"] for r in rollouts] == [[step, step] for step in range(STEPS + 1)]
    assert all(r["equal"] == [True, True] for r in rollouts)  # each worker's tokens are the plain model's
    assert rollouts[0]["tokens"] != rollouts[1]["tokens"]  # and the update changed them
    updates = by_kind["update"]
    assert [u["version"] for u in updates] == list(range(1, STEPS + 1))
    assert all(u["complete"] and u["bytes"] == model_bytes(tiny_args(4)) - _computed_buffers() for u in updates)
    assert [w["versions"] for w in by_kind["wake"]] == [[step, step] for step in range(1, STEPS + 1)]
    assert by_kind["done"] == [{"event": "done", "mismatches": 0, "worker_exit_codes": [0, 0]}]
    record(request, "sleep / wake of a CPU worker, slowest (s): "
                    f"{max(s for e in by_kind['sleep'] for s in e['seconds']):.4f} / "
                    f"{max(s for e in by_kind['wake'] for s in e['seconds']):.4f}")


def _computed_buffers() -> int:
    """Bytes of the buffers a Llama computes itself (rotary inv_freq): not in its state_dict, never updated."""
    from shared_generate import build_meta_model

    model = build_meta_model(tiny_args(4))
    keys = set(model.state_dict())
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name not in keys)
