"""A profile phase on one GPU never touches another: no CUDA context on cuda:0 for a model profiled on cuda:1.

A rank that runs with ``gpu_device=LOCAL_RANK`` and never calls ``torch.cuda.set_device`` has cuda:0 as its
current device. Code that switches streams with ``torch.cuda.stream(...)`` alone restores the current device's
stream on exit, which sets cuda:0 and creates a context there (hundreds of MiB on every rank's GPU 0). The
warm-up's side-stream copies and the transfer sweep switch streams inside the engine's own device scope.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

SCRIPT = textwrap.dedent("""
    import torch
    import flextensor as ft
    from tests.helpers.models import ALL, tiny_transformer, token_ids

    for warmup, skip in (("resident", True), ("stream", False)):
        model = tiny_transformer()
        om = ft.get_offload_manager(warmup)
        om.set_engine_policy(warmup=warmup)  # resident: the overlapped preload; stream: the transfer sweep
        cfg = ft.OffloadConfig(include_patterns=["class:DecoderBlock"], gpu_device=1, pinned_memory=True,
                               load_strategy=ALL, profiling_iters=2, skip_discovery=skip)
        ft.offload(model, cfg, name=warmup)
        ids = token_ids().to("cuda:1")
        with torch.no_grad():
            for _ in range(om.iters_before_inference):  # the last one plans (the sweep) and switches
                model(ids)
        torch.cuda.synchronize("cuda:1")
        ft.release(warmup)
    print("context on cuda:0:", torch._C._cuda_hasPrimaryContext(0))
""")


def test_profiling_on_cuda_1_creates_no_context_on_cuda_0():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "context on cuda:0: False" in out.stdout, out.stdout + out.stderr
