"""Peak host RAM of loading a 512 MiB model, each way, measured in a fresh process (``tests.helpers.ckpt_worker``:
``VmHWM`` minus ``VmRSS`` just before the call): the goals are the point of one host copy.

- a creator or a single process reading a safetensors checkpoint: <= 1.10x the model's bytes;
- a creator whose factory builds the model in RAM: <= 1.25x (one copy, plus the block being filled);
- a single process offloading a model already in RAM adds < 0.25x (the host copy replaces the original as it
  is made), from a profile or through profiling (then, on a CPU compute device, beside the loader's rotating
  blocks, which are host memory there).
Outputs must equal the plain model's, from one file and from shards. On CUDA the worker creates the CUDA context
before its baseline (a per-process constant, not a per-model cost) and pins the blocks in place, at their exact
size (``pinned_memory_mode="host_register"``; PyTorch's pinned allocator would round them up to powers of two).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flextensor.shm.names import manager_namespace
from tests.client.test_session import finish, read_result
from tests.helpers.checkpoints import big_input, big_mlp, make_profile, save_checkpoint
from tests.helpers.models import DEVICE, release_managers  # noqa: F401
from tests.leftovers import shm_names

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_GOAL = 1.10
IN_RAM_GOAL = 1.25
OFFLOAD_EXTRA_GOAL = 0.25

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict:
    """The 512 MiB model saved as one file and as 3 shards with an index, its profile, its output."""
    root = tmp_path_factory.mktemp("big")
    model = big_mlp()
    with torch.no_grad():
        expected = model.to(DEVICE)(big_input().to(DEVICE)).cpu()
    model.to("cpu")
    paths = {"file": save_checkpoint(model, root / "file"),
             "sharded": save_checkpoint(model, root / "sharded", shards=3)}
    profile = make_profile(model, big_input(), root / "profile", include=["class:MLPBlock"])
    del model
    return {"profile": profile, "expected": expected, **paths}


def _spawn(mode: str, big: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.ckpt_worker", "--mode", mode, "--profile",
                             big["profile"], *args], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(mode: str, big: dict, *args: str) -> dict:
    proc = _spawn(mode, big, *args)
    result = read_result(proc, timeout=300)
    assert finish(proc) == 0, result
    return result


def _check(result: dict, big: dict) -> float:
    assert "error" not in result, result
    out = torch.frombuffer(bytearray.fromhex(result["out"]), dtype=torch.float32).reshape(big["expected"].shape)
    if DEVICE.type == "cpu":
        assert torch.equal(out, big["expected"])
    else:
        assert torch.allclose(out, big["expected"], atol=1e-4, rtol=1e-4)
    return result["growth"] / result["model_bytes"]


def _where(result: dict) -> str:
    """Where the growth stayed, for a failure message."""
    kinds = ", ".join(f"{k} {v / 2**20:+.1f} MiB" for k, v in result.get("by_kind", {}).items())
    return f"({kinds}; starting CUDA took {result.get('cuda_init_bytes', 0) / 2**20:.1f} MiB before the baseline)"


@pytest.mark.parametrize("kind", ["file", "sharded"])
def test_load_model_from_profile_peaks_near_one_copy(big: dict, kind: str) -> None:
    result = _run("lazy", big, "--checkpoint", str(big[kind]))
    ratio = _check(result, big)
    assert ratio <= CHECKPOINT_GOAL, f"peak RSS growth {ratio:.3f}x the model {_where(result)}"


def test_two_workers_share_a_checkpoint_read_by_the_creator_once(big: dict, namespace: str) -> None:
    creator = _spawn("session", big, "--checkpoint", str(big["sharded"]), "--ns", namespace, "--hold")
    first = read_result(creator, timeout=300)
    follower = _spawn("session", big, "--checkpoint", str(big["sharded"]), "--ns", namespace)
    second = read_result(follower, timeout=300)
    assert finish(follower) == 0 and finish(creator) == 0
    assert (first.get("role"), second.get("role")) == ("creator", "follower"), (first, second)
    ratio = _check(first, big)
    _check(second, big)
    assert ratio <= CHECKPOINT_GOAL, f"creator's peak RSS growth {ratio:.3f}x the model {_where(first)}"
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_a_creator_with_an_in_ram_factory_frees_each_tensor_into_its_block(big: dict, namespace: str) -> None:
    result = _run("inram", big, "--ns", namespace)
    assert result.get("role") == "creator", result
    ratio = _check(result, big)
    assert ratio <= IN_RAM_GOAL, \
        f"creator's peak RSS growth {ratio:.3f}x the model (the model itself is 1x) {_where(result)}"


def test_single_process_offload_of_a_model_in_ram_never_holds_two_copies(big: dict) -> None:
    result = _run("offload", big)
    ratio = _check(result, big)
    assert ratio < OFFLOAD_EXTRA_GOAL, f"offloading added {ratio:.3f}x the model's bytes at the peak {_where(result)}"


def test_profiling_a_model_in_ram_never_holds_two_copies(big: dict) -> None:
    """ft.offload through discovery, profiling and the switch: the host blocks replace the model's storage as
    they are filled. On a CPU compute device the loader's rotating blocks (host memory there) come on top."""
    result = _run("profile", big)
    _check(result, big)
    extra = (result["growth"] - result["device_block_bytes"]) / result["model_bytes"]
    assert extra < OFFLOAD_EXTRA_GOAL, \
        f"profiling and the switch added {extra:.3f}x the model's bytes at the peak {_where(result)}"

