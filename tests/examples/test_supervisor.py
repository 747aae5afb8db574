"""``examples/supervisor.py``: a crashed worker is restarted and re-attaches to the live copy; when all workers
die, the supervisor reclaims the namespace and starts a new generation; SIGTERM stops everything cleanly."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from flextensor.shm import manager_namespace
from tests.examples.conftest import EXAMPLES, REPO, plain_tokens, record, tiny_args

pytest.importorskip("transformers")

from shared_generate import MANAGER, job_namespace, make_profile  # noqa: E402


class Events:
    """The supervisor's stdout, one JSON object per line, read on a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: queue.Queue[dict] = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                self.lines.put({"event": "unparsed", "line": line})

    def wait(self, predicate, count: int = 1, timeout: float = 60) -> list[dict]:
        """The next ``count`` events that match ``predicate`` (others are kept in ``seen``)."""
        got: list[dict] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            try:
                event = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"waited {timeout} s for {count} matching events; seen: {self.seen[-20:]}")
            self.seen.append(event)
            if predicate(event):
                got.append(event)
        return got


def is_ready(e: dict) -> bool:
    return e.get("event") == "ready"


@pytest.mark.slow
def test_supervisor_restarts_crashed_workers_and_stops_clean(namespace: str, tmp_path: Path, env, request) -> None:
    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    make_profile(args, torch.device("cpu"), profile)
    expected = plain_tokens(args, [0, 1])
    lease = 1.0
    argv = ["--workers", "2", "--tiny-llama", "8", "--profile", str(profile), "--job-id", namespace,
            "--lease", str(lease), "--grace", "30", "--restart-delay", "0.5"]
    compact = manager_namespace(job_namespace("sup", namespace, args), MANAGER)
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "supervisor.py"), *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "supervisor.log", "wb"), text=True,
                            start_new_session=True)
    events = Events(proc)
    try:
        first = {e["worker"]: e for e in events.wait(is_ready, count=2, timeout=90)}
        assert sorted(e["role"] for e in first.values()) == ["creator", "follower"]
        assert all(first[i]["tokens"] == expected[i] for i in (0, 1))
        generation = first[0]["generation"]

        # One worker crashes (the creator, even): it is restarted and re-attaches to the live generation.
        creator = next(i for i, e in first.items() if e["role"] == "creator")
        t0 = time.monotonic()
        os.kill(first[creator]["pid"], signal.SIGKILL)
        again = events.wait(is_ready, timeout=90)[0]
        restart_s = time.monotonic() - t0
        assert again["worker"] == creator and again["role"] == "follower" and again["generation"] == generation
        assert again["tokens"] == expected[creator]
        assert any(e.get("event") == "exited" and e["worker"] == creator and e["status"] == -signal.SIGKILL
                   for e in events.seen)

        # Every worker crashes: the supervisor reclaims the namespace, then a new generation starts.
        pids = [again["pid"], first[1 - creator]["pid"]]
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        cleanup = events.wait(lambda e: e.get("event") == "cleanup", timeout=60)[0]
        assert cleanup["removed"] > 0
        fresh = {e["worker"]: e for e in events.wait(is_ready, count=2, timeout=90)}
        all_dead_s = time.monotonic() - t0
        assert sorted(e["role"] for e in fresh.values()) == ["creator", "follower"]
        assert all(fresh[i]["tokens"] == expected[i] for i in (0, 1))
        assert any(compact in n for n in os.listdir("/dev/shm"))

        # SIGTERM (Kubernetes' pod deletion): workers close, nothing is left, exit status 0.
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        stop_s = time.monotonic() - t0
        stopped = events.wait(lambda e: e.get("event") == "stopped", timeout=10)[0]
        assert set(stopped["statuses"].values()) == {0}, stopped
        assert not [n for n in os.listdir("/dev/shm") if compact in n]
        record(request, f"supervisor (lease {lease:.0f} s): one worker SIGKILLed -> restarted and re-attached in "
                        f"{restart_s:.1f} s; all SIGKILLed -> reclaimed and serving again in {all_dead_s:.1f} s; "
                        f"SIGTERM -> stopped clean in {stop_s:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in [e["pid"] for e in events.seen if e.get("event") == "started"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        import flextensor as ft

        ft.SharedOffloadSession.cleanup_namespace(job_namespace("sup", namespace, args), manager_names=[MANAGER],
                                                  timeout=lease + 10)


@pytest.mark.slow
def test_a_held_job_restarted_whole_reattaches_without_a_creator(namespace: str, tmp_path: Path, env,
                                                                 isolated_host: Path) -> None:
    """``ftd hold`` on the job's namespace, SIGKILL of every worker of the job, a new supervisor: it does not wait
    for the hold (which never ends by itself) but says so and starts the workers, which attach to the held weights
    as followers of the same generation. Leases are 30 s: nothing may come from one running out. The job's first
    run is its two workers alone (``supervisor.py --worker`` with the job's namespace, as its supervisor starts
    them, forked with transformers imported): the supervisor under test is the one that restarts the job."""
    from tests.daemon.helpers import Daemon
    from tests.examples.workers import ExampleWorker

    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    make_profile(args, torch.device("cpu"), profile)
    expected = plain_tokens(args, [0, 1])
    base = job_namespace("sup", namespace, args)
    compact = manager_namespace(base, MANAGER)
    socket = tmp_path / "run" / "ftd.sock"
    daemon = Daemon(socket, isolated_host / f"flextensor-{os.getuid()}").start()
    env = {**env, "FT_DAEMON_SOCKET": str(socket)}
    argv = ["--workers", "2", "--tiny-llama", "8", "--profile", str(profile), "--job-id", namespace, "--lease", "30",
            "--grace", "30", "--restart-delay", "0.5"]
    procs: list[subprocess.Popen] = []
    seen: list[dict] = []

    def supervise() -> Events:
        proc = subprocess.Popen([sys.executable, str(EXAMPLES / "supervisor.py"), *argv], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=open(tmp_path / f"supervisor-{len(procs)}.log", "wb"),
                                text=True, start_new_session=True)
        procs.append(proc)
        events = Events(proc)
        seen.append(events.seen)  # type: ignore[arg-type]
        return events

    first: list[ExampleWorker] = []
    try:
        first += [ExampleWorker(base, i, ["--tiny-llama", "8", "--profile", str(profile)], env,
                                tmp_path / f"first-{i}.log", lease=30.0) for i in range(2)]
        before = [w.read(timeout=90) for w in first]
        assert sorted(e["role"] for e in before) == ["creator", "follower"]
        generation = before[0]["generation"]
        assert before[1]["generation"] == generation
        daemon.cli("hold", base, "--manager", MANAGER)
        for w in first:  # the whole job
            w.kill()

        second = supervise()
        (held,) = second.wait(lambda e: e.get("event") in ("held", "cleanup", "refused"), timeout=60)
        assert held["event"] == "held" and held["holder_pids"] == [daemon.proc.pid], held
        assert "ftd release" in held["message"]
        after = {e["worker"]: e for e in second.wait(is_ready, count=2, timeout=90)}
        assert [after[i]["role"] for i in (0, 1)] == ["follower", "follower"]  # no creator: nothing was reloaded
        assert {after[i]["generation"] for i in (0, 1)} == {generation}
        assert all(after[i]["tokens"] == expected[i] for i in (0, 1))

        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0
        stopped = second.wait(lambda e: e.get("event") == "stopped", timeout=10)[0]
        assert set(stopped["statuses"].values()) == {0}, stopped
        assert any(compact in n for n in os.listdir("/dev/shm"))  # the hold keeps it warm
        daemon.cli("release", base, "--manager", MANAGER)  # the last participant: reclaimed at once
        assert not [n for n in os.listdir("/dev/shm") if compact in n]
    finally:
        for w in first:
            w.kill()
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in [e["pid"] for events in seen for e in events if e.get("event") == "started"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        daemon.stop()
        import flextensor as ft

        ft.SharedOffloadSession.cleanup_namespace(base, manager_names=[MANAGER], timeout=10)
