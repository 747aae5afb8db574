"""Peak host RAM of loading a 512 MiB model, each way, measured in a worker process of its own
(``tests.helpers.ckpt_worker``, forked with torch imported on a host without CUDA: ``VmHWM``, reset just before the
call, minus ``VmRSS`` then): the goals are the point of one host copy.

- a creator or a single process reading a safetensors checkpoint: <= 1.10x the model's bytes;
- a creator whose factory builds the model in RAM: <= 1.25x (one copy, plus the pages ahead of its copy;
  ``tests/client/sharing/test_creator_memory.py`` holds it to 1.05x with blocks and tensors of 128 MiB);
- a single process offloading a model already in RAM adds < 0.25x (the host copy replaces the original as it
  is made), from a profile or through profiling (then, on a CPU compute device, beside the loader's rotating
  blocks, which are host memory there); the host blocks built on their thread behind resident inference hold
  about one block beside the staged originals (< 0.25x), and every original is freed by the end of the build.
Outputs must equal the plain model's, from one file and from shards. On CUDA the worker creates the CUDA context
before its baseline, and runs one of the model's blocks there once (the math libraries and kernels a first
forward loads: per-process constants, not per-model costs, reported apart), and pins the blocks in place, at their exact
size (``pinned_memory_mode="host_register"``; PyTorch's pinned allocator would round them up to powers of two).
"""

from __future__ import annotations

import subprocess
import weakref
from pathlib import Path

import pytest
import torch

from flextensor.runtime.host_block_build import HostBlockBuild
from flextensor.runtime.host_memory import PageableProvider, block_views, pack_block
from flextensor.shm.names import manager_namespace
from tests.client.sharing.test_session import finish, read_result
from tests.helpers.checkpoints import big_input, big_mlp, make_profile, save_checkpoint
from tests.helpers.forkserver import ForkedProcess, spawn_module
from tests.helpers.models import DEVICE
from tests.leftovers import shm_names

REPO = Path(__file__).resolve().parents[3]
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


def _spawn(mode: str, big: dict, *args: str) -> subprocess.Popen | ForkedProcess:
    """A ckpt_worker process, forked with torch already imported (tests/helpers/forkserver.py): its peak is reset
    just before the call it measures, so what the server imported is part of its baseline, never of its growth."""
    return spawn_module("tests.helpers.ckpt_worker", ["--mode", mode, "--profile", big["profile"], *args], cwd=REPO)


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


def _kinds(by_kind: dict) -> str:
    return ", ".join(f"{k} {v / 2**20:+.1f} MiB" for k, v in by_kind.items())


def _where(result: dict) -> str:
    """Where the growth stayed, for a failure message."""
    build = ""
    if result.get("build_growth"):
        build = (f"; the host-block build peaked {result['build_growth'] / 2**20:.1f} MiB above its start "
                 f"({_kinds(result.get('build_by_kind', {}))} after it)")
    return (f"({_kinds(result.get('by_kind', {}))}{build}; before the baseline, starting CUDA took "
            f"{result.get('cuda_init_bytes', 0) / 2**20:.1f} MiB and a first forward of one block "
            f"{result.get('kernels_init_bytes', 0) / 2**20:.1f} MiB)")


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



@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CUDA run of the build is the profiling test above")
@pytest.mark.parametrize("warmup", ["resident", "stream"])
def test_the_background_build_frees_each_block_of_staged_originals_as_it_fills_it(big: dict, warmup: str) -> None:
    """The host blocks built on their thread after a warm-up (a CPU streaming as a GPU does, with the originals
    staged as on CUDA): the build holds one block beside the originals it has not copied yet, and the originals
    are all freed by its end (the staging and the build's lists let go of each block's sources). After a
    stream-mode warm-up the passes still copy each trap's weights per call while the build runs, so each trap's
    tensors move onto their block before its originals go."""
    result = _run("profile", big, "--stream-on-cpu", "--warmup", warmup)
    _check(result, big)
    size = result["model_bytes"]
    assert result["build_growth"] / size < OFFLOAD_EXTRA_GOAL, \
        f"the build peaked {result['build_growth'] / size:.3f}x the model above its start {_where(result)}"
    if warmup == "resident":  # the passes ran on "device" copies (host memory here): the originals are extra
        freed = -result["build_by_kind"]["RssAnon"]
        assert freed > 0.95 * size, f"the build freed {freed / size:.3f}x the model of originals {_where(result)}"
    else:  # the passes copied from the originals: each block replaced them
        kept = result["build_by_kind"]["RssAnon"]
        assert abs(kept) < OFFLOAD_EXTRA_GOAL * size, \
            f"the build left {kept / size:+.3f}x the model beside the blocks {_where(result)}"


def test_the_build_thread_keeps_no_source_of_a_block_it_released() -> None:
    """When block k+1 is allocated, nothing of the build holds a source of blocks 0..k any more (not even the last
    tensor of block k), so releasing them freed their memory before the next block's pages are touched."""
    layouts = [pack_block(i, f"t{i}", [(f"t{i}.{j}", torch.float32, (64,), (1,)) for j in range(3)]) for i in range(3)]
    sources = [[torch.full((64,), float(i * 3 + j)) for j in range(3)] for i in range(3)]
    alive = [[weakref.ref(t) for t in tensors] for tensors in sources]
    seen: list[list[int]] = []

    class Recording(PageableProvider):
        def allocate(self, index: int, nbytes: int):
            seen.append([i for i in range(index) if any(ref() is not None for ref in alive[i])])
            return super().allocate(index, nbytes)

    released: list[list[str]] = []
    build = HostBlockBuild("m", layouts, sources, Recording(), lambda names, between: released.append(list(names)),
                           torch.device("cpu"))
    del sources
    build.wait()
    assert build.error is None and build.finished
    assert seen == [[], [], []]  # blocks allocated so far whose sources are still alive
    assert all(ref() is None for refs in alive for ref in refs)
    assert released == [[p.name for p in layout.tensors] for layout in layouts] + [[]]
    for layout, block in zip(layouts, build.blocks):
        expected = torch.arange(layout.index * 3, layout.index * 3 + 3, dtype=torch.float32).repeat_interleave(64)
        values = torch.cat([v for v in block_views(block.tensor, layout.tensors)])
        assert torch.equal(values, expected)
