"""A session creator whose factory builds the model in RAM holds it once: its growth over its RSS when the session
starts stays within 1.05x the model (plus a small fixed allowance for the runtime), however large its blocks and
tensors, whether they are streamed (the arena) or resident (the store), and a tensor something else still reads
is never given back early.

The model of the bound has 2 blocks of 2 x 128 MiB, so a creator that held a block, or a whole tensor, beside
the shared pages being filled would break it (1.5x and 1.25x); the pages allocated ahead of the copy and the piece
being copied are what it may hold beyond the model (``flextensor.sharing.publish``). Measured in a worker process
of its own (``tests.helpers.ckpt_worker``: ``VmHWM``, reset just before the call, over ``VmRSS`` then).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.shm.names import manager_namespace
from tests.client.sharing.test_session import LEASE, finish, read_result
from tests.helpers.checkpoints import big_input, big_mlp, make_profile
from tests.helpers.forkserver import spawn_module
from tests.helpers.models import DEVICE, TinyTransformer, cpu_config, reference, same, tiny_transformer, token_ids
from tests.leftovers import shm_names

REPO = Path(__file__).resolve().parents[3]
SHAPE = dict(n=2, d=2048, h=16384)
GOAL = 1.05
#: The process's own growth beside the weights (the session's threads, the plan, the profile's JSON).
ALLOWANCE = 32 << 20
MIB = 1 << 20


@pytest.fixture(scope="module")
def large_blocks(tmp_path_factory) -> dict:
    """The model's profiles (every block streamed; nothing streamed, every tensor in the store) and its output."""
    model = big_mlp(**SHAPE)
    x = big_input(d=SHAPE["d"])
    with torch.no_grad():
        expected = model.to(DEVICE)(x.to(DEVICE)).cpu()
    model.to("cpu")
    root = tmp_path_factory.mktemp("creator")
    streamed = make_profile(model, x, root / "streamed", include=["class:MLPBlock"])
    resident = make_profile(model, x, root / "resident", include=["class:NoSuchModule"])
    return {"streamed": streamed, "resident": resident, "expected": expected}


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["streamed", "resident"])
def test_a_creator_in_ram_grows_by_the_model_once_however_large_its_blocks(large_blocks: dict, plan: str,
                                                                          namespace: str) -> None:
    shape = ",".join(str(SHAPE[k]) for k in ("n", "d", "h"))
    proc = spawn_module("tests.helpers.ckpt_worker", ["--mode", "inram", "--profile", large_blocks[plan], "--ns",
                                                      namespace, "--shape", shape], cwd=REPO)
    result = read_result(proc, timeout=300)
    assert finish(proc) == 0, result
    assert result.get("role") == "creator", result
    out = torch.frombuffer(bytearray.fromhex(result["out"]), dtype=torch.float32)
    expected = large_blocks["expected"]
    assert same(out.reshape(expected.shape).to(DEVICE), expected.to(DEVICE))
    model = result["model_bytes"]
    bound = GOAL * model + ALLOWANCE
    assert result["growth"] <= bound, (
        f"the creator grew {result['growth'] / MIB:.1f} MiB for a {model / MIB:.0f} MiB model "
        f"({result['growth'] / model:.3f}x; bound {bound / MIB:.1f} MiB); after the call: "
        + ", ".join(f"{k} {v / MIB:+.1f} MiB" for k, v in result["by_kind"].items()))
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_a_tensor_the_factory_still_reads_keeps_its_bytes_while_the_others_go_back_early(namespace: str,
                                                                                       tmp_path: Path) -> None:
    """The creator gives a tensor's private pages back behind its copy only when nothing else reads them: an
    alias the factory kept (a detached view of one weight) still holds the weight's values after the publish,
    every published byte is the model's, and the other tensors did go back early."""
    shape = dict(d=256, layers=2)
    plain = tiny_transformer(seed=0, **shape)
    model = tiny_transformer(seed=0, **shape)
    cfg = cpu_config(include_patterns=["blocks.*"], load_strategy=ft.NthLayerStrategy(1))
    ft.offload(model, cfg, name="profiler")
    with torch.no_grad():
        for _ in range(ft.get_offload_manager("profiler").iters_before_inference):
            model(token_ids().to(DEVICE))
    ft.save_profile(str(tmp_path / "profile"), name="profiler")
    ft.release("profiler")
    del model
    kept: list[torch.Tensor] = []

    def factory() -> TinyTransformer:
        built = tiny_transformer(seed=0, **shape)
        kept.append(built.blocks[0].down.weight.detach())  # still read after the publish
        return built

    def meta() -> TinyTransformer:
        with torch.device("meta"):
            return TinyTransformer(**shape)

    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        offloaded = session.offload_from_profile(str(tmp_path / "profile"), config=cpu_config(), name="model",
                                                 creator_model_factory=factory, follower_model_factory=meta)
        assert session.role("model") == "creator"
        assert torch.equal(kept[0], plain.blocks[0].down.weight.detach())
        state = dict(offloaded.state_dict())
        for name, value in plain.state_dict().items():
            assert torch.equal(state[name].cpu(), value), name
        with torch.no_grad():
            assert same(offloaded(token_ids().to(DEVICE)), reference(plain, token_ids()))
        released = session.report()[0]["publish"]["released_early_bytes"]
        assert released > 0, "no tensor's pages went back behind its copy"
        del offloaded, state
    assert shm_names(manager_namespace(namespace, "model")) == []
