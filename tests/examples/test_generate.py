"""``generate`` through an offloaded (``ft.offload``) and a shared (``SharedOffloadSession``) 8-layer Llama: greedy
tokens, the KV cache, and what ``transformers`` reads from the model (config, device, dtype, state dict)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor as ft
from tests.examples.conftest import tiny_args
from tests.helpers.session_worker import shm_ranges

pytest.importorskip("transformers")

from shared_generate import (  # noqa: E402
    MANAGER, generate, load_model, make_profile, offload_config, open_shared_model, prompt_ids,
)

CPU = torch.device("cpu")
NEW_TOKENS = 32


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every key and value tensor of a ``transformers`` cache object."""
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [*cache.key_cache, *cache.value_cache]


def in_shared_memory(t: torch.Tensor) -> bool:
    return any(start <= t.data_ptr() < end for start, end in shm_ranges())


def plain_run(args, ids: torch.Tensor):
    """The plain model: generated tokens, a prefill's cache, one decode step's logits and cache after it."""
    model = load_model(args)
    tokens = generate(model, ids, NEW_TOKENS, CPU)
    with torch.no_grad():
        pre = model(ids, use_cache=True)
        step = model(pre.logits[:, -1:].argmax(-1), past_key_values=pre.past_key_values, use_cache=True)
    return model, tokens, step.logits, [t.clone() for t in cache_tensors(step.past_key_values)]


def check_like_plain(model, plain, args, ids: torch.Tensor, ref_tokens, ref_logits, ref_cache) -> None:
    """Tokens, the cache (contents, and it is the caller's memory, not the engine's), config, device, dtype."""
    assert generate(model, ids, NEW_TOKENS, CPU) == ref_tokens
    with torch.no_grad():
        pre = model(ids, use_cache=True)
        cache = pre.past_key_values
        before = [t.clone() for t in cache_tensors(cache)]
        step = model(pre.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert step.past_key_values is cache  # the caller's cache object, grown in place by transformers
    after = cache_tensors(cache)
    assert torch.equal(step.logits, ref_logits)
    assert len(after) == len(ref_cache) and all(torch.equal(a, b) for a, b in zip(after, ref_cache))
    for old, new in zip(before, after):  # the step appended one position and left the prefix as it was
        assert torch.equal(new[..., : old.shape[-2], :], old)
    params = {t.untyped_storage().data_ptr() for t in model.parameters()}
    assert not any(in_shared_memory(t) or t.untyped_storage().data_ptr() in params for t in after)
    assert model.config.to_dict() == plain.config.to_dict()
    assert model.device == CPU and model.dtype == torch.float32
    assert model.num_parameters() == plain.num_parameters()


# ------------------------------------------------------------------------------------------------ single process
def test_offloaded_generate_equals_plain_and_cache_untouched() -> None:
    args = tiny_args(8)
    ids = prompt_ids(args, 0, args.vocab)
    plain, ref_tokens, ref_logits, ref_cache = plain_run(args, ids)
    model = load_model(args)
    config = model.config
    ft.offload(model, offload_config(args, CPU), name=MANAGER)
    assert ft.get_offload_manager(MANAGER).phase is not ft.Phase.INFERENCE
    check_like_plain(model, plain, args, ids, ref_tokens, ref_logits, ref_cache)
    assert ft.get_offload_manager(MANAGER).phase is ft.Phase.INFERENCE
    assert model.config is config
    assert list(model.state_dict()) == list(plain.state_dict())
    ft.release(MANAGER, preserve_model=True)  # afterwards the model is the plain model again
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))


def _streamed_model(args) -> torch.nn.Module:
    model = load_model(args)
    ft.offload(model, offload_config(args, CPU), name=MANAGER)
    generate(model, prompt_ids(args, 0, args.vocab), 4, CPU)  # through discovery and profiling into INFERENCE
    assert ft.get_offload_manager(MANAGER).phase is ft.Phase.INFERENCE
    return model


def test_offloaded_state_dict_equals_plain() -> None:
    args = tiny_args(8)
    plain = load_model(args).state_dict()
    state = _streamed_model(args).state_dict()
    differ = [k for k in plain if not torch.equal(state[k], plain[k])]
    assert not differ, f"{len(differ)} of {len(plain)} state_dict tensors differ from the plain model's: {differ[:4]}"


def test_offloaded_save_pretrained_round_trips(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    args = tiny_args(8)
    plain = load_model(args).state_dict()
    _streamed_model(args).save_pretrained(tmp_path / "saved")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(back[k], plain[k]) for k in plain)


def test_offloaded_save_pretrained_after_release_round_trips(tmp_path: Path) -> None:
    """The way that works today: release with preserve_model=True, then save."""
    from transformers import AutoModelForCausalLM

    args = tiny_args(8)
    plain = load_model(args).state_dict()
    model = _streamed_model(args)
    ft.release(MANAGER, preserve_model=True)
    model.save_pretrained(tmp_path / "saved")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(back[k], plain[k]) for k in plain)


# ------------------------------------------------------------------------------------------------ shared
def test_shared_follower_generate_equals_plain(namespace: str, tmp_path: Path, jobs) -> None:
    """A creator in another process loads the weights; this process attaches as a follower (its model built on
    ``meta``) and must behave like the plain model."""
    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    make_profile(args, CPU, profile)
    ids = prompt_ids(args, 0, args.vocab)
    plain, ref_tokens, ref_logits, ref_cache = plain_run(args, ids)

    creator = jobs.start(namespace, 1, ["--tiny-llama", "8", "--profile", str(profile)])
    ready = creator.read(timeout=60)
    assert ready["role"] == "creator"
    session = ft.SharedOffloadSession(namespace, wait_timeout=60, lease_seconds=2)
    try:
        model = open_shared_model(session, args, CPU)
        assert session.role(MANAGER) == "follower"
        assert session.report()[0]["generation"] == ready["generation"]
        assert any(in_shared_memory(p) for p in model.parameters())  # attached, not a private copy
        check_like_plain(model, plain, args, ids, ref_tokens, ref_logits, ref_cache)
        assert list(model.state_dict()) == list(plain.state_dict())
    finally:
        session.close()
    creator.send("generate")
    assert creator.read(timeout=30)["tokens"] == generate(plain, prompt_ids(args, 1, args.vocab), NEW_TOKENS, CPU)
    assert creator.close() == 0


def test_shared_close_preserve_models_keeps_a_plain_model(namespace: str, tmp_path: Path) -> None:
    """``close(preserve_models=True)``: the model leaves shared memory and its state dict is the plain model's."""
    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    make_profile(args, CPU, profile)
    ids = prompt_ids(args, 0, args.vocab)
    plain = load_model(args)
    session = ft.SharedOffloadSession(namespace, wait_timeout=60, lease_seconds=2)
    try:
        model = open_shared_model(session, args, CPU)
        assert generate(model, ids, NEW_TOKENS, CPU) == generate(plain, ids, NEW_TOKENS, CPU)
    finally:
        session.close(preserve_models=True)
    assert not any(in_shared_memory(t) for t in model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    assert generate(model, ids, NEW_TOKENS, CPU) == generate(plain, ids, NEW_TOKENS, CPU)


def test_shared_state_dict_equals_plain(namespace: str, tmp_path: Path) -> None:
    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    make_profile(args, CPU, profile)
    plain = load_model(args).state_dict()
    session = ft.SharedOffloadSession(namespace, wait_timeout=60, lease_seconds=2)
    try:
        model = open_shared_model(session, args, CPU)
        generate(model, prompt_ids(args, 0, args.vocab), 4, CPU)
        state = model.state_dict()
        differ = [k for k in plain if not torch.equal(state[k], plain[k])]
    finally:
        session.close()
    assert not differ, f"{len(differ)} of {len(plain)} state_dict tensors differ from the plain model's: {differ[:4]}"
