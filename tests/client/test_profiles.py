"""Profiles and state adoption: round trips (in-process and into a fresh process holding a meta model), refusals."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.api import offload_from_state  # not (yet) exported lazily by flextensor/__init__
from flextensor.manager import Phase
from flextensor.profiles import profile_path, read_profile
from flextensor.state import SCHEMA_VERSION, model_tensors
from tests.helpers.forkserver import run_code
from tests.helpers.models import (
    ALL,
    DEVICE,
    reference,
    same,
    TinyTransformer,
    cpu_config,
    mlp_stack,
    tiny_transformer,
    token_ids,
)

REPO = Path(__file__).resolve().parents[2]


def _profiled(model, x, cfg, name="default"):
    ft.offload(model, cfg, name=name)
    om = ft.get_offload_manager(name)
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(x)
    assert om.phase is Phase.INFERENCE
    return om


def _transformer_cfg(**kw):
    return cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ALL, **kw)


def test_round_trip_in_process(tmp_path):
    ids = token_ids().to(DEVICE)
    src = tiny_transformer()
    ref = reference(src, ids)
    om = _profiled(src, ids, _transformer_cfg())
    ft.save_profile(str(tmp_path))
    saved = json.loads(profile_path(tmp_path).read_text())
    assert saved["schema_version"] == SCHEMA_VERSION
    assert [t["label"] for t in saved["traps"]] == [f"blocks.{i}" for i in range(4)]
    offloaded = om.offloaded_tensors
    ft.release()

    dst = tiny_transformer()  # same weights, fresh objects
    model = ft.offload_from_profile(dst, str(tmp_path), _transformer_cfg(), name="restored")
    om2 = ft.get_offload_manager("restored")
    assert model is dst and om2.phase is Phase.INFERENCE and om2.iters_before_inference == 0
    assert om2.offloaded_tensors == offloaded
    with torch.no_grad():
        for _ in range(3):
            assert same(dst(ids), ref)
    again = om2.export_state()
    first = read_profile(tmp_path)
    assert again.fingerprint == first.fingerprint and again.blocks == first.blocks
    assert [t for t in again.tensors if t.offloaded] == [t for t in first.tensors if t.offloaded]


@pytest.mark.usefixtures("stream_on_cpu")
def test_a_profile_adopted_with_resident_traps_calls_them_directly(tmp_path):
    """Adoption installs the traps after the build; the ones the profile keeps resident are bypassed then too."""
    x = torch.randn(3, 16, device=DEVICE)
    src = mlp_stack()
    ref = reference(src, x)
    _profiled(src, x, cpu_config(load_strategy=ft.NthLayerStrategy(2)))
    ft.save_profile(str(tmp_path))
    ft.release()
    dst = mlp_stack()
    ft.offload_from_profile(dst, str(tmp_path), cpu_config(), name="restored")
    om = ft.get_offload_manager("restored")
    assert [om.engine.traps[str(i)].bypassed for i in range(4)] == [False, True, False, True]
    assert all(dst[i].__dict__["forward"].__flextensor_trap__ == str(i) for i in range(4))
    with torch.no_grad():
        for _ in range(2):
            assert same(dst(x), ref)
    ft.release("restored")
    assert all("forward" not in dst[i].__dict__ for i in range(4))


def test_storage_dir_and_manager_methods(tmp_path):
    x = torch.randn(2, 16, device=DEVICE)
    model = mlp_stack()
    ref = reference(model, x)
    cfg = cpu_config(load_strategy=ALL, profile_storage_dir=str(tmp_path / "p"))
    om = _profiled(model, x, cfg)
    om.save_profile()
    ft.release()
    # spec flow: set_config, then load_profile(model=...) adopts right away
    om = ft.get_offload_manager()
    om.set_config(cfg)
    fresh = mlp_stack()
    om.load_profile(model=fresh)
    assert om.phase is Phase.INFERENCE
    with torch.no_grad():
        assert same(fresh(x), ref)
    ft.release()
    # load first (pending), offload later
    ft.init(cfg, name="late")
    ft.load_profile(name="late")
    other = mlp_stack()
    ft.offload(other, name="late")
    assert ft.get_offload_manager("late").phase is Phase.INFERENCE
    with torch.no_grad():
        assert same(other(x), ref)


def test_refusals(tmp_path):
    x = torch.randn(2, 16, device=DEVICE)
    cfg = cpu_config(load_strategy=ALL)
    _profiled(mlp_stack(), x, cfg)
    ft.save_profile(str(tmp_path))
    ft.release()

    with pytest.raises(ValueError, match=r"another model: tensor '0\.fc1\.bias' has shape \[40\]"):
        ft.offload_from_profile(mlp_stack(h=40), str(tmp_path), cfg)
    with pytest.raises(ValueError, match="transfer_mode"):
        ft.offload_from_profile(mlp_stack(), str(tmp_path), cpu_config(transfer_mode="strategy"), name="tm")
    with pytest.raises(FileNotFoundError, match="no profile"):
        ft.offload_from_profile(mlp_stack(), str(tmp_path / "nope"), cfg, name="nf")

    data = json.loads(profile_path(tmp_path).read_text())
    data["schema_version"] = SCHEMA_VERSION + 98
    bad = tmp_path / "schema"
    bad.mkdir()
    profile_path(bad).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"schema_version {SCHEMA_VERSION + 98}"):
        ft.offload_from_profile(mlp_stack(), str(bad), cfg, name="sv")
    profile_path(bad).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_profile(bad)
    data["schema_version"] = SCHEMA_VERSION
    data["tensors"][0]["byte_offset"] = 10**9
    profile_path(bad).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="do not fit"):
        ft.offload_from_profile(mlp_stack(), str(bad), cfg, name="bo")
    # the refused model was never patched
    untouched = mlp_stack()
    with pytest.raises(ValueError):
        ft.offload_from_profile(untouched, str(bad), cfg, name="bo2")
    assert "forward" not in untouched.__dict__


def test_profile_read_only_refuses_save(tmp_path):
    x = torch.randn(2, 16, device=DEVICE)
    _profiled(mlp_stack(), x, cpu_config(profile_read_only=True))
    with pytest.raises(PermissionError, match="profile_read_only"):
        ft.save_profile(str(tmp_path))
    assert not profile_path(tmp_path).exists()


def test_adopt_state_with_supplied_host_blocks_on_meta_model():
    """What a shared-session follower does: host blocks come from elsewhere (SHM) and are used as-is."""
    ids = token_ids().to(DEVICE)
    src = tiny_transformer()
    ref = reference(src, ids)
    om = _profiled(src, ids, _transformer_cfg(), name="creator")
    state = om.export_state()
    blocks = [b.tensor.clone() for b in om.engine.inference.host_blocks]  # stand-ins for attached SHM segments
    residents = {t.name: model_tensors(src)[t.name].tensor.detach().clone() for t in state.tensors if not t.offloaded}
    with torch.device("meta"):
        follower = TinyTransformer().eval()
    with pytest.raises(ValueError, match="meta device"):
        offload_from_state(follower, state, _transformer_cfg(), name="no-weights", host_blocks=blocks)
    assert ft.get_offload_manager("no-weights").phase is None
    offload_from_state(follower, state, _transformer_cfg(), name="follower", host_blocks=blocks, weights=residents)
    fom = ft.get_offload_manager("follower")
    assert [b.tensor.data_ptr() for b in fom.engine.inference.host_blocks] == [b.data_ptr() for b in blocks]  # no copy
    with torch.no_grad():
        for _ in range(2):
            assert same(follower(ids), ref)
    with pytest.raises(ValueError, match="host blocks supplied"):
        offload_from_state(tiny_transformer(), state, _transformer_cfg(), name="few", host_blocks=blocks[:1])


CHILD = textwrap.dedent(
    """
    import sys, torch
    import flextensor as ft
    from flextensor.profiles import load_weights
    from safetensors.torch import save_file
    from tests.helpers.models import DEVICE, TinyTransformer, cpu_config, token_ids

    with torch.device("meta"):
        model = TinyTransformer().eval()
    assert all(p.is_meta for p in model.parameters())
    cfg = cpu_config(include_patterns=["class:DecoderBlock"], load_strategy=ft.NthLayerStrategy(1))
    ft.offload_from_profile(model, sys.argv[1], cfg, weights=load_weights(sys.argv[2]))
    assert ft.get_offload_manager().phase.value == "inference"
    with torch.no_grad():
        out = model(token_ids().to(DEVICE)).cpu()
    ft.release()
    save_file({"out": out.contiguous()}, sys.argv[3])
    """
)


def test_round_trip_into_fresh_process_with_meta_model(tmp_path):
    from safetensors.torch import load_file, save_file

    ids = token_ids().to(DEVICE)
    src = tiny_transformer()
    ref = reference(src, ids)
    weights = {n: e.tensor.detach().contiguous().clone() for n, e in model_tensors(src).items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    _profiled(src, ids, _transformer_cfg())
    ft.save_profile(str(tmp_path / "profile"))
    ft.release()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # A new process (forked with torch imported, flextensor not: tests/helpers/forkserver.py).
    proc = run_code(CHILD, [str(tmp_path / "profile"), str(tmp_path / "model.safetensors"),
                            str(tmp_path / "out.safetensors")], cwd=REPO, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same(load_file(str(tmp_path / "out.safetensors"))["out"].to(DEVICE), ref)


def test_load_profile_for_the_model_in_warm_up(tmp_path):
    x = torch.randn(2, 16, device=DEVICE)
    src = mlp_stack()
    ref = reference(src, x)
    _profiled(src, x, cpu_config(load_strategy=ALL))
    ft.save_profile(str(tmp_path))
    ft.release()
    model = mlp_stack()
    ft.offload(model, cpu_config(load_strategy=ALL), name="warm")
    om = ft.get_offload_manager("warm")
    assert om.phase is Phase.DISCOVERY
    ft.load_profile(str(tmp_path), name="warm")  # no model given: the one being warmed up
    assert om.phase is Phase.INFERENCE and om.model is model
    with torch.no_grad():
        assert same(model(x), ref)
