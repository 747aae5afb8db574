"""A torchrun job of 2 nodes x 2 ranks, each node a host of its own: one creator per node, nothing shared across.

The two "hosts" are two mount namespaces on this machine (``unshare -m``), each with a private tmpfs on
``/dev/shm`` and its own ``TMPDIR`` (so its own lock directory), rendezvousing over loopback as two machines on one
network would. Both nodes derive the same namespace from the job (the master address and port), so the only thing
that keeps them apart is what keeps two hosts apart: their ``/dev/shm`` and lock directories.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES, VENV_BIN, free_port, plain_tokens, tiny_args

pytest.importorskip("transformers")

NODES, RANKS_PER_NODE = 2, 2


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _can_unshare(), reason="needs root to give each node a mount namespace")]


def _node(index: int, port: int, root: Path, profile: Path, out: Path, env: dict[str, str]) -> subprocess.Popen:
    """One node: a private /dev/shm and TMPDIR, torchrun with 2 ranks; after it, what its /dev/shm still holds."""
    tmpdir = root / f"node{index}-tmp"
    tmpdir.mkdir()
    leftovers = root / f"node{index}-leftovers.txt"
    torchrun = [str(VENV_BIN / "torchrun"), "--nnodes", str(NODES), "--node-rank", str(index),
                "--nproc-per-node", str(RANKS_PER_NODE), "--master-addr", "127.0.0.1", "--master-port", str(port),
                str(EXAMPLES / "torchrun_generate.py"), "--tiny-llama", "4", "--profile", str(profile),
                "--out", str(out), "--max-new-tokens", "8"]
    script = ('mount -t tmpfs -o size=512m tmpfs /dev/shm || exit 97; "$@"; rc=$?; '
              f'ls -A /dev/shm > {leftovers}; exit $rc')
    node_env = dict(env, TMPDIR=str(tmpdir))
    return subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "node", *torchrun],
                            env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_elect_a_creator_each_and_share_nothing_across(tmp_path: Path, env: dict[str, str]) -> None:
    profile, out = tmp_path / "profile", tmp_path / "out"
    port = free_port()
    nodes = [_node(i, port, tmp_path, profile, out, env) for i in range(NODES)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            pytest.fail("a node ran past 240 s:\n" + "\n".join(n.communicate()[0] for n in nodes))
    for i, node in enumerate(nodes):
        assert node.returncode == 0, f"node {i} exited {node.returncode}:\n{outputs[i][-6000:]}"

    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(NODES * RANKS_PER_NODE)]
    per_node = [results[n * RANKS_PER_NODE:(n + 1) * RANKS_PER_NODE] for n in range(NODES)]
    for n, ranks in enumerate(per_node):
        assert sorted(r["role"] for r in ranks) == ["creator", "follower"], (n, ranks)
        assert len({r["generation"] for r in ranks}) == 1
    assert len({r["namespace"] for r in results}) == 1, "both nodes derive the job's one namespace"
    expected = plain_tokens(tiny_args(4, max_new_tokens=8), list(range(NODES * RANKS_PER_NODE)))
    for r in results:
        assert r["tokens"] == expected[r["rank"]], f"rank {r['rank']} ({r['role']}) differs from the plain model"
    for n in range(NODES):
        assert (tmp_path / f"node{n}-leftovers.txt").read_text().split() == [], f"node {n} left /dev/shm entries"
