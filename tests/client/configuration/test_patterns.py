"""Pattern matching: which modules become traps and which parameters they may offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flextensor.configuration.patterns import PatternSet, parse_pattern, select_traps
from tests.helpers.models import SharedSubmoduleModel, tiny_transformer


def _traps(model, include, exclude=()):
    return {t.label: t.param_names for t in select_traps(model, include, exclude)}


@pytest.fixture(scope="module")
def model():
    return tiny_transformer()


def test_default_star_selects_top_level_children(model):
    traps = _traps(model, ["*"])
    assert list(traps) == ["embed", "blocks", "norm", "head"]
    # tied head/embedding weight: both traps list it under its canonical name
    assert traps["embed"] == ["embed.weight"]
    assert traps["head"] == ["embed.weight"]
    assert "blocks.0.up_t" in traps["blocks"]


def test_name_glob_outermost_match_wins(model):
    traps = _traps(model, ["blocks.*"])
    assert list(traps) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert set(traps["blocks.2"]) == {n for n, _ in model.named_parameters() if n.startswith("blocks.2.")}


def test_explicit_name_prefix_equals_bare(model):
    assert _traps(model, ["name:blocks.?"]) == _traps(model, ["blocks.?"])
    assert list(_traps(model, ["blocks.[13]"])) == ["blocks.1", "blocks.3"]


def test_class_short_and_fully_qualified(model):
    short = _traps(model, ["class:DecoderBlock"])
    fq = _traps(model, ["class:tests.helpers.models.DecoderBlock"])
    glob = _traps(model, ["class:*Block"])
    assert list(short) == list(fq) == list(glob) == [f"blocks.{i}" for i in range(4)]
    assert list(_traps(model, ["class:torch.nn.*.Linear"])) == [
        *(f"blocks.{i}.{n}" for i in range(4) for n in ("attn.qkv", "attn.out", "down")), "head"]


def test_exclude_module_subtree_and_class(model):
    traps = _traps(model, ["blocks.*"], ["blocks.1", "*.norm2", "class:Attention"])
    assert list(traps) == ["blocks.0", "blocks.2", "blocks.3"]
    names = traps["blocks.0"]
    assert "blocks.0.norm2.weight" not in names and "blocks.0.attn.qkv.weight" not in names
    assert "blocks.0.norm1.weight" in names and "blocks.0.up_t" in names


def test_exclude_removes_subtree_from_star():
    m = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2))
    assert list(_traps(m, ["*"], ["0"])) == ["1"]


def test_parameter_level_patterns(model):
    traps = _traps(model, ["*.weight"], ["embed.*", "head.*"])
    # every module that owns a weight becomes a trap offloading only its weights; biases stay resident
    assert traps["blocks.0.attn.out"] == ["blocks.0.attn.out.weight"]
    assert traps["blocks.0.norm2"] == ["blocks.0.norm2.weight"]
    assert all(n.endswith(".weight") for names in traps.values() for n in names)
    scoped = _traps(model, ["blocks.1.*.weight"])
    assert list(scoped) == ["blocks.1.norm1", "blocks.1.attn.qkv", "blocks.1.attn.out", "blocks.1.norm2", "blocks.1.down"]


def test_parameter_exclude_inside_trap(model):
    traps = _traps(model, ["blocks.*"], ["*.bias"])
    assert traps["blocks.0"] and not any(n.endswith(".bias") for n in traps["blocks.0"])


def test_root_is_never_a_trap_and_root_params_stay():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.lin = nn.Linear(2, 2)

    traps = _traps(Root(), ["*"])
    assert traps == {"lin": ["lin.weight", "lin.bias"]}


def test_shared_submodule_listed_in_both_traps():
    m = SharedSubmoduleModel()
    traps = _traps(m, ["blocks.*"])
    assert "blocks.0.shared.weight" in traps["blocks.0"] and "blocks.0.shared.weight" in traps["blocks.1"]


def test_bad_patterns_rejected():
    with pytest.raises(ValueError, match="unknown prefix"):
        parse_pattern("regex:foo")
    with pytest.raises(ValueError, match="empty glob"):
        parse_pattern("class:")
    with pytest.raises(ValueError):
        PatternSet([""])


def test_no_match_gives_no_traps(model):
    assert select_traps(model, ["nothing.here"]) == []
