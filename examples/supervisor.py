"""A supervisor for N workers on one host that share one host copy: start, watch, restart, reclaim.

Run::

    python examples/supervisor.py --workers 4 --model /ckpt/llama --profile /var/cache/ft/llama --job-id chat-a
    python examples/supervisor.py --workers 2 --tiny-llama 8 --profile /tmp/tiny-profile --lease 5

What it does:

- on start, reclaims what an earlier run of the same job left (``SharedOffloadSession.cleanup_namespace``; if a
  live worker of the job still holds a lease, it refuses to start instead of running a second copy of the job);
- starts ``--workers`` worker processes (this file with ``--worker``), all in the job's namespace; the first to
  arrive loads the checkpoint, the others attach to it;
- a worker that exits unexpectedly (a crash, SIGKILL, the OOM killer) is restarted after ``--restart-delay``
  (deaths within that delay count as one event) while the others keep serving: the new process joins the live
  generation as a follower (the dead one's lease runs out after ``--lease`` seconds, or at once when ``ftd``
  runs). After ``--max-restarts`` restarts of one worker the supervisor gives up;
- when every worker is dead at once, it calls ``cleanup_namespace`` (waiting for the dead leases to expire)
  before it starts them again, so nothing of the dead generation stays in ``/dev/shm``;
- a job whose namespace ``ftd hold`` keeps warm (``ftd hold <namespace> --manager llm``) is never cleaned up: the
  cleanup refuses at once (``ShmNamespaceHeldError``), the supervisor says so (``held``) and starts the workers,
  which attach to the held weights as followers: no creator, no checkpoint read. That is also what a restart of
  the whole job (supervisor included) does;
- SIGTERM or SIGINT (Kubernetes sends SIGTERM at pod deletion): SIGTERM to every worker, which closes its session
  (the last one out unlinks the shared memory); after ``--grace`` seconds the stragglers get SIGKILL; finally
  ``cleanup_namespace`` reclaims anything left. Exit status 0.

Workers read commands on stdin and die with the supervisor (EOF): no orphan keeps the shared memory alive. A worker
writes JSON lines on stdout (``ready`` with its role and its first generated tokens; ``tokens`` after each
``generate`` command); the supervisor prints them, tagged with the worker's index, beside its own events
(``started``, ``exited``, ``restarting``, ``cleanup``, ``held``, ``stopped``), one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shared_generate import add_model_args, job_namespace  # noqa: E402

MANAGER_NAMES = ["llm"]  # shared_generate.MANAGER: what cleanup_namespace must reclaim


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--job-id", default="default", help="names the job's shared memory (default 'default')")
    parser.add_argument("--namespace", help=argparse.SUPPRESS)  # set by the supervisor for its workers
    parser.add_argument("--lease", type=float, default=30.0,
                        help="heartbeat lease in seconds: how long a dead worker's share outlives it without ftd")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds workers get to close on SIGTERM")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="seconds before a restart (default 1)")
    parser.add_argument("--max-restarts", type=int, default=5, help="restarts of one worker before giving up")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "time": round(time.time(), 3), **fields}), flush=True)


# ================================================================================================ worker
class _Terminate(Exception):
    """SIGTERM, raised in the main thread so the session closes on the way out."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminate()


def worker_main(args: argparse.Namespace) -> int:
    """One worker: join the job's session, generate once (``ready``), then one generation per ``generate`` line."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    import flextensor as ft
    from shared_generate import compute_device, ensure_profile, generate, open_shared_model, prompt_ids

    device = compute_device(args.index)
    session = None
    try:
        ensure_profile(args, device)
        session = ft.SharedOffloadSession(args.namespace, wait_timeout=args.wait_timeout, lease_seconds=args.lease)
        model = open_shared_model(session, args, device)
        share = session.report()[0]
        prompt = prompt_ids(args, args.index, model.config.vocab_size)
        print(json.dumps({"event": "ready", "pid": os.getpid(), "role": share["role"],
                          "generation": share["generation"], "ready_s": round(share["ready_s"], 3),
                          "tokens": generate(model, prompt, args.max_new_tokens, device)}), flush=True)
        for line in sys.stdin:  # EOF: the supervisor is gone
            command = line.strip()
            if command == "exit":
                break
            if command == "generate":
                print(json.dumps({"event": "tokens", "pid": os.getpid(),
                                  "tokens": generate(model, prompt, args.max_new_tokens, device)}), flush=True)
    except _Terminate:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the close
        if session is not None:
            session.close()
    return 0


# ================================================================================================ supervisor
@dataclass
class Worker:
    index: int
    proc: subprocess.Popen
    restarts: int = 0


class Supervisor:
    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        self.namespace = job_namespace("sup", args.job_id, args)
        self.lines: queue.Queue[tuple[int, str]] = queue.Queue()
        self.workers: dict[int, Worker] = {}
        self.stopping = False

    def start_worker(self, index: int, restarts: int = 0) -> None:
        cmd = [sys.executable, str(Path(__file__).resolve()), *self.argv, "--worker", "--index", str(index),
               "--namespace", self.namespace]
        if index in self.workers:  # the dead worker's pipe
            try:
                self.workers[index].proc.stdin.close()
            except OSError:
                pass
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.workers[index] = Worker(index, proc, restarts)
        threading.Thread(target=self._pump, args=(index, proc), daemon=True).start()
        emit("started", worker=index, pid=proc.pid, restarts=restarts)

    def _pump(self, index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put((index, line))

    def send(self, index: int, command: str) -> None:
        try:
            self.workers[index].proc.stdin.write(command + "\n")
            self.workers[index].proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: the watch loop sees it

    def cleanup(self, timeout: float) -> None:
        """Reclaim the job's namespace; an ``ftd hold`` on it is left alone (the workers attach to its weights)."""
        import flextensor as ft
        from flextensor.shm.errors import ShmNamespaceHeldError

        try:
            reports = ft.SharedOffloadSession.cleanup_namespace(self.namespace, manager_names=MANAGER_NAMES,
                                                                timeout=timeout)
        except ShmNamespaceHeldError as exc:
            emit("held", namespace=self.namespace, holder_pids=list(exc.holder_pids), message=str(exc))
            return
        emit("cleanup", namespace=self.namespace, removed=sum(len(r.removed) for r in reports),
             waited_s=round(sum(r.waited_s for r in reports), 3))

    def run(self) -> int:
        emit("supervisor", pid=os.getpid(), namespace=self.namespace, workers=self.args.workers)
        try:
            self.cleanup(timeout=self.args.lease + 5)  # what an earlier run of this job left
        except TimeoutError as exc:
            emit("refused", reason=f"the job's namespace is in use by live workers: {exc}")
            return 1
        for i in range(self.args.workers):
            self.start_worker(i)
        status = 0
        while not self.stopping:
            self._forward_lines(timeout=0.2)
            if self.stopping or all(w.proc.poll() is None for w in self.workers.values()):
                continue
            time.sleep(self.args.restart_delay)  # deaths that come together (a node-wide kill) are seen together
            dead = [w for w in self.workers.values() if w.proc.poll() is not None]
            for w in dead:
                emit("exited", worker=w.index, pid=w.proc.pid, status=w.proc.returncode)
            if len(dead) == len(self.workers):  # nobody holds the generation: reclaim it before starting again
                self.cleanup(timeout=self.args.lease + 5)
            if any(w.restarts >= self.args.max_restarts for w in dead):
                emit("giving-up", workers=[w.index for w in dead])
                status = 1
                break
            for w in dead:
                emit("restarting", worker=w.index)
                self.start_worker(w.index, w.restarts + 1)
        self.shutdown()
        return status

    def _forward_lines(self, timeout: float) -> None:
        try:
            index, line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            try:
                payload = json.loads(line)
            except json.JSONDecodeError:
                payload = {"event": "output", "line": line.rstrip()}
            print(json.dumps({"worker": index, **payload}), flush=True)
            try:
                index, line = self.lines.get_nowait()
            except queue.Empty:
                return

    def shutdown(self) -> None:
        """SIGTERM every worker, SIGKILL after the grace period, then reclaim whatever is left."""
        self.stopping = True
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace
        killed = False
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
                killed = True
        self._forward_lines(timeout=0)
        # Nothing is left after clean closes (the call returns at once); after a SIGKILL, the leases must expire.
        self.cleanup(timeout=self.args.lease + 5 if killed else 5)
        emit("stopped", statuses={w.index: w.proc.returncode for w in self.workers.values()})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    supervisor = Supervisor(args, argv)

    def stop(signum: int, frame: Any) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
