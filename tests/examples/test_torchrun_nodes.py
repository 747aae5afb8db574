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
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES, REPO, VENV_BIN, free_port, plain_tokens, tiny_args

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


def _node(index: int, port: int, root: Path, program: list[str], env: dict[str, str], *,
          sweep: bool = False) -> subprocess.Popen:
    """One node: a private /dev/shm and TMPDIR, torchrun with 2 ranks of ``program``; after it (and, with
    ``sweep``, after ``ftd cleanup --dead``, as the deploy timer runs it on a host without ftd), what its /dev/shm
    still holds goes to ``node<index>-leftovers.txt``."""
    tmpdir = root / f"node{index}-tmp"
    tmpdir.mkdir()
    leftovers = root / f"node{index}-leftovers.txt"
    torchrun = [str(VENV_BIN / "torchrun"), "--nnodes", str(NODES), "--node-rank", str(index),
                "--nproc-per-node", str(RANKS_PER_NODE), "--master-addr", "127.0.0.1", "--master-port", str(port),
                *program]
    cleanup = f"{VENV_BIN / 'python'} -m flextensor.daemon.cli cleanup --dead; " if sweep else ""
    script = ('mount -t tmpfs -o size=512m tmpfs /dev/shm || exit 97; "$@"; rc=$?; '
              f'{cleanup}ls -A /dev/shm > {leftovers}; exit $rc')
    node_env = dict(env, TMPDIR=str(tmpdir))
    return subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "node", *torchrun],
                            env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, start_new_session=True)


def test_two_nodes_elect_a_creator_each_and_share_nothing_across(tmp_path: Path, env: dict[str, str]) -> None:
    profile, out = tmp_path / "profile", tmp_path / "out"
    port = free_port()
    program = [str(EXAMPLES / "torchrun_generate.py"), "--tiny-llama", "4", "--profile", str(profile),
               "--out", str(out), "--max-new-tokens", "8"]
    nodes = [_node(i, port, tmp_path, program, env) for i in range(NODES)]
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


def _wait_for(predicate, timeout: float, what: str, nodes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(n.poll() not in (None, 0) for n in nodes[:1]):
            for n in nodes:
                n.kill()
            pytest.fail(f"{what} within {timeout:.0f} s:\n" + "\n".join((n.communicate()[0] or "")[-3000:]
                                                                        for n in nodes))
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_node_whose_ranks_are_killed_leaves_the_other_serving(tmp_path: Path, env: dict[str, str]) -> None:
    from tests.client.sharing.test_session import make_profile

    profile = make_profile(tmp_path / "profile")
    out = tmp_path / "out"
    out.mkdir()
    program = ["-m", "tests.helpers.node_server", "--profile", profile, "--out", str(out)]
    port = free_port()
    nodes = [_node(i, port, tmp_path, program, env, sweep=True) for i in range(NODES)]
    ranks = NODES * RANKS_PER_NODE
    _wait_for(lambda: all((out / f"ready-{r}.json").exists() for r in range(ranks)), 180, "not every rank ready",
              nodes)
    ready = [json.loads((out / f"ready-{r}.json").read_text()) for r in range(ranks)]
    for n in range(NODES):
        roles = sorted(r["role"] for r in ready[n * RANKS_PER_NODE:(n + 1) * RANKS_PER_NODE])
        assert roles == ["creator", "follower"], (n, ready)
    assert len({r["sum"] for r in ready}) == 1, "every rank's first output is the same"

    def passes(rank: int) -> int:
        try:
            return int((out / f"passes-{rank}").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    for r in ready[RANKS_PER_NODE:]:  # node 1's ranks, SIGKILLed as a node's crash kills them
        os.kill(r["pid"], signal.SIGKILL)
    node1_out = nodes[1].communicate(timeout=120)[0]
    assert nodes[1].returncode != 0, "torchrun reports the killed ranks"
    before = [passes(r) for r in range(RANKS_PER_NODE)]
    _wait_for(lambda: all(passes(r) >= before[r] + 20 for r in range(RANKS_PER_NODE)), 60,
              "node 0 stopped serving after node 1's ranks died", nodes[:1])
    (out / "stop").touch()
    _wait_for(lambda: not any(_alive(r["pid"]) for r in ready[:RANKS_PER_NODE]), 60, "node 0's ranks did not stop",
              nodes[:1])
    # Node 0's ranks closed their sessions and exited; torchrun itself now waits at its exit barrier for node 1's
    # agent, which is gone (a launcher's matter, not sharing's): read node 0's /dev/shm through its mount
    # namespace, then stop its torchrun.
    left = os.listdir(f"/proc/{nodes[0].pid}/root/dev/shm")
    os.killpg(nodes[0].pid, signal.SIGKILL)
    nodes[0].communicate(timeout=60)
    assert left == [], f"node 0 left /dev/shm entries {left}"
    # node 1: its dead ranks' namespace went to the sweep a host without ftd runs (deploy/'s timer)
    left = (tmp_path / "node1-leftovers.txt").read_text().split()
    assert left == [], f"node 1 kept /dev/shm entries {left}:\n{node1_out[-3000:]}"
