"""``examples/ray_replicas.py`` on a local Ray with 2 CPUs: 2 actors share one copy, a killed actor is restarted by
Ray and re-attaches to the live generation, and the driver leaves nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES, REPO, plain_tokens, record, tiny_args

pytest.importorskip("ray")
pytest.importorskip("transformers")


@pytest.mark.slow
def test_ray_replicas_share_one_copy_and_restart_reattaches(tmp_path: Path, env: dict[str, str], request) -> None:
    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    expected = plain_tokens(args, [0, 1])
    # Ray's sockets must fit in sun_path (108 bytes): a short directory, not the test's deep TMPDIR.
    ray_tmp = tempfile.mkdtemp(prefix="ftray-", dir="/tmp")
    env = {**env, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "ray_replicas.py"), "--replicas", "2", "--num-cpus", "2",
         "--tiny-llama", "8", "--profile", str(profile), "--restart-one", "--lease", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"ray_replicas.py ran past 150 s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err[-4000:]}"
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ready = {e["replica"]: e for e in events if e["event"] == "ready"}
    tokens = {e["replica"]: e["tokens"] for e in events if e["event"] == "tokens"}
    restarted = next(e for e in events if e["event"] == "restarted")

    assert sorted(e["role"] for e in ready.values()) == ["creator", "follower"], events
    assert ready[0]["generation"] == ready[1]["generation"] and ready[0]["namespace"] == ready[1]["namespace"]
    assert tokens == expected
    assert restarted["pid"] != restarted["old_pid"], "Ray restarts the actor in a new process"
    assert restarted["role"] == "follower" and restarted["generation"] == ready[0]["generation"]
    assert restarted["tokens"] == expected[0]
    assert any(e["event"] == "cleanup" for e in events)
    record(request, f"ray: 2 actors ready in {ready[0]['ready_s']:.2f} / {ready[1]['ready_s']:.2f} s; a killed "
                    f"actor restarted and re-attached (its session ready in {restarted['ready_s']:.2f} s, no "
                    f"checkpoint read), answering again after {restarted['restart_s']:.1f} s; its steps "
                    f"{restarted.get('steps')}, waited {restarted.get('wait_s')} s")
