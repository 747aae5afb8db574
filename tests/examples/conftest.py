"""Helpers of the launcher-example tests: free ports, the examples' command lines, plain-model references, and a
summary of the numbers the tests measure (printed at the end of the run; nothing timed is asserted)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.measured import MeasuredLines

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VENV_BIN = Path(sys.executable).parent
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

MEASURED = MeasuredLines("launcher examples: measured")
record = MEASURED.record


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    MEASURED.write(terminalreporter)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], *, timeout: float, cwd: Path = REPO, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, fail the test with its output when it fails (or runs past ``timeout``)."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\nstdout:\n{proc.stdout}\n" \
                                 f"stderr:\n{proc.stderr[-6000:]}"
    return proc


def tiny_args(layers: int = 8, **kw):
    """The examples' argparse namespace for ``--tiny-llama LAYERS`` (for building references in-process)."""
    import argparse

    from shared_generate import add_model_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    argv = ["--tiny-llama", str(layers), "--profile", str(kw.pop("profile", "unused"))]
    for key, value in kw.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return parser.parse_args(argv)


def plain_tokens(args, indices: list[int]) -> dict[int, list[int]]:
    """The plain (not offloaded) model's greedy tokens for each replica's prompt."""
    import torch

    from shared_generate import generate, load_model, prompt_ids

    model = load_model(args)
    return {i: generate(model, prompt_ids(args, i, model.config.vocab_size), args.max_new_tokens,
                        torch.device("cpu")) for i in indices}


@pytest.fixture
def env() -> dict[str, str]:
    """The environment for example processes: this test's TMPDIR (hence lock directory), one thread each."""
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(EXAMPLES), e.get("PYTHONPATH", "")])
    return e


@pytest.fixture
def jobs(env: dict[str, str], tmp_path: Path):
    """Start example workers (``jobs.start(namespace, index, model_argv)``); all reclaimed after the test."""
    from tests.examples.workers import Jobs

    logs = tmp_path / "logs"
    logs.mkdir()
    started = Jobs(env, logs)
    yield started
    started.teardown()


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread in this process while an example test runs: the tests' processes share two cores, and
    torch's default of one thread per core makes each tiny forward wait on the others (about 8x slower here)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items) -> None:
    """These tests compare with the plain model exactly on the CPU (float32, the CPU as compute device); on a CUDA
    host the engine computes on the GPU, so they are skipped there: run the examples themselves on a GPU host."""
    import torch

    if not torch.cuda.is_available():
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="CPU-exact launcher tests; on a GPU host run examples/*.py directly")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)
