"""bench_scale's models larger than the device: built in host RAM one piece at a time on the device
(``models.build_model_in_host_ram``) with the weights the whole build gives, their reference computed one piece
on the device at a time (``models.layerwise_forward``) equal to the whole forward; and a ``--quick --host-build``
run of the bench, whose set-up and group use that build and report their peak host RSS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import models  # noqa: E402
import scale_report  # noqa: E402

TINY = models.ModelSpec(hidden=64, layers=3, vocab=96, head_dim=16)


def _assert_same_weights(built: torch.nn.Module, expected: torch.nn.Module) -> None:
    got, want = built.state_dict(), expected.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].device.type == "cpu", name
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor.cpu()), name


def test_pieces_are_the_forward_order_and_cover_every_parameter_once() -> None:
    model = models.build_meta_model(TINY, torch.float32)
    names = [name for prefix, piece in models.model_pieces(model) for name, _ in piece.named_parameters(prefix=prefix)]
    assert names == [name for name, _ in model.named_parameters()]
    assert [prefix for prefix, _ in models.model_pieces(model)] == ["embed", "layers.0", "layers.1", "layers.2",
                                                                    "norm", "head"]


def test_the_host_ram_build_gives_the_whole_builds_weights_and_seed_matters() -> None:
    built = models.build_model_in_host_ram(TINY, "cpu", torch.float32, seed=3)
    _assert_same_weights(built, models.build_model(TINY, "cpu", torch.float32, seed=3))
    assert not built.training and not any(p.requires_grad for p in built.parameters())
    other = models.build_model_in_host_ram(TINY, "cpu", torch.float32, seed=4)
    assert not torch.equal(other.layers[1].mlp.up.weight, built.layers[1].mlp.up.weight)


def test_the_layerwise_reference_equals_the_whole_forward_and_leaves_the_weights_in_place() -> None:
    model = models.build_model_in_host_ram(TINY, "cpu", torch.float32, seed=0)
    tokens = models.make_tokens(TINY, 2, 12, "cpu")
    pointers = [p.data_ptr() for p in model.parameters()]
    layerwise = models.layerwise_forward(model, tokens, "cpu")
    with torch.no_grad():
        whole = model(tokens)
    assert layerwise.shape == (2, TINY.vocab) and torch.equal(layerwise, whole)
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_fits_on_device_on_the_cpu_is_always_true() -> None:
    assert models.fits_on_device(1 << 50, "cpu")


def test_the_report_gives_the_build_and_each_processs_peak_over_the_model() -> None:
    gib = 1 << 30
    r = {"gib": 96, "model_bytes": 96 * gib,
         "setup": {"host_build": True, "build_s": 20.0, "reference_s": 9.5, "rss_start": gib, "vmhwm": 98 * gib},
         "group": {"creator": {"rss_start": 2 * gib, "vmhwm": 98 * gib + gib // 2}}}
    assert scale_report.host_memory_line(r, "setup") == \
        "host RAM, set-up process: VmHWM 98.00 GiB (from 1.00 GiB: 1.010x) the model's 96.00 GiB"
    assert scale_report.host_memory_line(r, "creator") == \
        "host RAM, group's creator: VmHWM 98.50 GiB (from 2.00 GiB: 1.005x) the model's 96.00 GiB"
    col = scale_report.size_row_values({**r, "group": {}})
    assert col["model built (set-up: build / reference)"] == \
        "host RAM, one block at a time on the device; reference layer by layer (20.0 / 9.5 s)"
    assert col["host RAM, set-up process: VmHWM (from its start: growth / model)"] == \
        "98.00 GiB (from 1.00 GiB: 1.010x)"
    assert scale_report.peak_rss({"model_bytes": gib, "group": {}}, "creator") is None


@pytest.mark.cuda
def test_on_the_device_one_piece_at_a_time_and_the_same_weights_and_output() -> None:
    spec = models.ModelSpec(hidden=256, layers=4, vocab=512, head_dim=64)
    device = torch.device("cuda", 0)
    whole = models.build_model(spec, device, seed=0)
    tokens = models.make_tokens(spec, 1, 32, device)
    with torch.no_grad():
        expected = whole(tokens)
    whole = whole.to("cpu")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    built = models.build_model_in_host_ram(spec, device, seed=0)
    largest = max(sum(p.numel() * p.element_size() for p in piece.parameters())
                  for _, piece in models.model_pieces(built))
    assert torch.cuda.max_memory_allocated(device) - base <= largest
    assert torch.cuda.memory_allocated(device) == base
    _assert_same_weights(built, whole)
    assert torch.equal(models.layerwise_forward(built, tokens, device), expected)
    free, _total = torch.cuda.mem_get_info(device)  # the margin is left free: a size of all that is free is not
    assert models.fits_on_device(free // 2 - models.DEVICE_MARGIN_BYTES, device)
    assert not models.fits_on_device(free, device)


@pytest.mark.slow
def test_quick_run_with_the_host_build(tmp_path: Path) -> None:
    env = {**os.environ, "FLEXTENSOR_BENCH_OUT": str(tmp_path)}
    argv = [sys.executable, str(BENCH / "bench_scale.py"), "--quick", "--host-build", "--no-docs", "--no-cprofile",
            "--sizes", "0.02", "--workers", "2", "--tmpfs-gib", "0", "--reads-gib", "0", "--profiling-iters", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (size,) = json.loads((tmp_path / "bench_scale.json").read_text())["sizes"]
    assert "error" not in size, size["error"]
    setup, group = size["setup"], size["group"]
    assert setup["host_build"] is True and setup["max_abs_diff"] == 0.0
    workers = [group["creator"], group["early"], *group["followers"], group["alone"]]
    assert [w["role"] for w in workers] == ["creator", "follower", "follower", "follower"]
    assert all(w["max_abs_diff"] == 0.0 for w in workers)
    assert group["leftovers"] == []
    for who in ("setup", "creator"):
        peak = scale_report.peak_rss(size, who)
        assert peak is not None and peak["vmhwm"] >= peak["rss_start"] > 0
    assert "host RAM, set-up process: VmHWM" in proc.stdout and "host RAM, group's creator: VmHWM" in proc.stdout
