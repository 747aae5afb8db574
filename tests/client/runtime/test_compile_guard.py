"""The loader's host-side steps stay out of compiled graphs, and ``ft.offload`` imports no ``torch._dynamo``
(Note [compile-disabled on dynamo's import] in ``flextensor.runtime.compile_guard``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import flextensor as ft
from tests.helpers.models import (
    ALL,
    DEVICE,
    cpu_config,
    reference,
    tiny_transformer,
    token_ids,
)

REPO_ROOT = __file__.rsplit("/tests/", 1)[0]


def test_offload_and_inference_import_no_dynamo():
    """A fresh process offloads, profiles and streams a model without importing torch._dynamo or sympy; the
    loaders' enter/exit (compiled never) and the patched forwards (frames run as Python) are marked for dynamo
    the moment something imports it; outside compiled code no compiled region is seen as running."""
    code = textwrap.dedent("""
        import sys
        import torch
        import flextensor as ft
        from flextensor.engine.policy import EnginePolicy, set_default_engine_policy
        from tests.helpers.models import ALL, DEVICE, cpu_config, tiny_transformer, token_ids

        set_default_engine_policy(EnginePolicy(stream_on_cpu=True))  # the loader exists on the CPU too
        model = tiny_transformer()
        ft.offload(model, cpu_config(include_patterns=["blocks.*"], load_strategy=ALL, profiling_iters=2))
        with torch.no_grad():
            for _ in range(ft.get_offload_manager().iters_before_inference + 2):
                model(token_ids().to(DEVICE))
        assert ft.get_offload_manager().loader is not None
        heavy = [m for m in ("torch._dynamo", "sympy") if m in sys.modules]
        from flextensor.runtime.loaders.arena_loader import ArenaLoader
        from flextensor.runtime.compile_guard import dynamo_active
        from flextensor.runtime.loaders.block_loader import BlockLoader
        patched = (BlockLoader.enter, model.forward, model.blocks[0].forward)  # the root's and a trap's forward
        before = [getattr(f, "_torchdynamo_disable", False) for f in patched] + [dynamo_active()]
        import torch._dynamo
        patched = (BlockLoader.enter, BlockLoader.exit, ArenaLoader.enter, ArenaLoader.exit, model.forward,
                   model.blocks[0].forward)
        after = [getattr(f, "_torchdynamo_disable", False) for f in patched] + [dynamo_active()]
        print(heavy, before, after)
        ft.release()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last == "[] [False, False, False, False] [True, True, True, True, True, True, False]"


def test_a_compiled_streamed_model_equals_eager():
    """torch.compile over a model whose traps stream through the loader: dynamo runs enter/exit eagerly."""
    import torch._dynamo  # noqa: F401 - what torch.compile imports first; the guard marks the loader then

    model = tiny_transformer()
    ids = token_ids().to(DEVICE)
    ref = reference(model, ids)
    ft.offload(model, cpu_config(include_patterns=["blocks.*"], load_strategy=ALL, profiling_iters=2))
    om = ft.get_offload_manager()
    with torch.no_grad():
        for _ in range(om.iters_before_inference):
            model(ids)
        om.wait_for_host_blocks()  # stream from now on: the switch itself is not made under a compiled pass
        compiled = torch.compile(model, backend="eager")
        outs = [compiled(ids) for _ in range(3)]
    assert om.loader is not None and om.offloaded_tensors
    assert all(torch.allclose(out.float(), ref.float(), atol=1e-4, rtol=1e-4) for out in outs)
    torch._dynamo.reset()
