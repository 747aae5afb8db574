"""``examples/torchrun_generate.py`` under torchrun: 2 CPU ranks (gloo) of one job share one host copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES, VENV_BIN, free_port, plain_tokens, record, run, tiny_args

pytest.importorskip("transformers")

RANKS = 2


@pytest.mark.slow
def test_torchrun_ranks_one_creator_outputs_equal(tmp_path: Path, env: dict[str, str], request) -> None:
    # A checkpoint directory as a user has one (save_pretrained), big enough for the memory numbers to mean
    # something (8 layers, hidden 512: about 80 MiB of float32), small enough for a 2-core machine.
    from shared_generate import load_model, model_bytes

    args = tiny_args(8, hidden=512, vocab=1024)
    ckpt = tmp_path / "ckpt"
    load_model(args).save_pretrained(ckpt)
    expected = plain_tokens(args, list(range(RANKS)))

    profile, out = tmp_path / "profile", tmp_path / "out"
    proc = run([str(VENV_BIN / "torchrun"), "--nproc-per-node", str(RANKS), "--master-port", str(free_port()),
                str(EXAMPLES / "torchrun_generate.py"), "--model", str(ckpt), "--profile", str(profile),
                "--out", str(out), "--report-memory"], timeout=150, env=env)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]

    assert [r["role"] for r in results].count("creator") == 1, results
    assert len({r["generation"] for r in results}) == 1 and len({r["namespace"] for r in results}) == 1
    assert sum(r["made_profile"] for r in results) == 1, "exactly one rank profiles (under the file lock)"
    assert (profile / "profile.json").is_file()
    leftover = [p.name for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith(".profile.")]
    assert not leftover, f"a temporary profile directory was left: {leftover}"
    for r in results:
        assert r["tokens"] == expected[r["rank"]], f"rank {r['rank']} ({r['role']}) differs from the plain model"
        assert len(r["tokens"]) == args.max_new_tokens

    growth = [r["pss_attached"] - r["pss_baseline"] for r in results]
    nbytes = model_bytes(tiny_args(8, hidden=512, vocab=1024))
    record(request, f"torchrun {RANKS} ranks, model {nbytes / 2**20:.1f} MiB: PSS growth per rank (MiB) "
                    + ", ".join(f"{g / 2**20:.1f} ({r['role']}{', profiled' if r['made_profile'] else ''})"
                                for g, r in zip(growth, results))
                    + f"; sum {sum(growth) / 2**20:.1f} MiB = {sum(growth) / nbytes:.2f} model copies "
                      f"(goal 1 + 0.1 x {RANKS} = {1 + 0.1 * RANKS:.1f})")
    record(request, "torchrun ready_s per rank: " + ", ".join(f"{r['ready_s']:.2f}" for r in results))
    assert f"1 creator(s), {RANKS - 1} follower(s)" in proc.stdout
