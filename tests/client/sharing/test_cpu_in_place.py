"""On a CPU compute device the engine computes from the host blocks in place (Note [CPU in place] in
``flextensor.engine.build``): no loader, no rotating blocks; a session's workers all read the shared arena."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flextensor as ft
from tests.client.sharing.test_session import expected_output, finish_all, make_profile, matches, output_of, read_result, \
    spawn
from tests.helpers.models import cpu_config, reference, tiny_transformer, token_ids

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compute device only")


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def test_a_single_process_computes_from_its_host_blocks_with_no_copy_per_pass():
    model = tiny_transformer(seed=0)
    ids = token_ids()
    ref = reference(model, ids)
    ft.offload(model, cpu_config(include_patterns=["blocks.*"], load_strategy=ft.NthLayerStrategy(1)))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(ids)
        outs = [model(ids) for _ in range(3)]
    assert all(torch.equal(out, ref) for out in outs)
    engine = om.engine
    assert om.loader is None and engine.inference.block_of == {}
    assert ft.get_gpu_memory_usage().block_bytes == 0
    blocks = [_storage_range(b.tensor) for b in engine.inference.host_blocks]
    offloaded = [n for names in om.offloaded_tensors.values() for n in names]
    assert offloaded and len(blocks) == len(om.offloaded_tensors)
    params = dict(model.named_parameters())
    for name in offloaded:  # each offloaded parameter is a view of its host block, nothing else holds it
        start = params[name].data_ptr()
        assert any(lo <= start < hi for lo, hi in blocks), name
    ft.release()
    with torch.no_grad():
        assert torch.equal(model(ids), ref)


def test_every_worker_of_a_session_reads_the_shared_blocks_in_place(namespace: str, tmp_path: Path):
    """The workers are fresh interpreters (not forked with torch imported, as in the other session tests), so
    this path stays covered end to end: imports, the election, compute and the interpreter's shutdown."""
    profile = make_profile(tmp_path / "profile")
    ref = expected_output()
    procs = [spawn(namespace, profile, "--hold", fresh=True) for _ in range(2)]
    try:
        results = [read_result(p) for p in procs]
    finally:
        codes = finish_all(procs)
    assert codes == [0, 0]
    assert sorted(r["role"] for r in results) == ["creator", "follower"]
    for result in results:
        assert matches(output_of(result), ref)
        where = result["tensors"]
        assert where["loader"] is False
        assert where["offloaded"] > 0 and where["offloaded_in_shm"] == where["offloaded"]
    follower = next(r for r in results if r["role"] == "follower")["tensors"]
    assert follower["resident_in_shm"] == follower["resident"]  # resident tensors stay shared views too
