"""The worker side of the demo (``examples/demo.py`` starts N of these per layout, one layout at a time).

Why a separate script: the parent measures each worker's memory from outside (``/proc/<pid>/smaps_rollup``),
so a worker must be its own process holding its weights until the parent has read it; and the three layouts
the demo compares must run the same start-up, the same forward and the same protocol, so that the only
difference the parent measures is how the weights are held:

- ``flextensor`` (the default): ``ft.SharedOffloadSession(namespace).offload_from_profile(...)``; the elected
  creator loads the checkpoint and publishes it into ``/dev/shm``, the followers attach to the same pages;
- ``--baseline mmap``: ``safetensors.torch.load_file`` as usual. It maps the file, so on a CPU host the pages
  are the page cache's and every worker maps the same ones (what a CPU host already shares without flextensor);
- ``--baseline copy``: ``load_file`` followed by a ``.clone()`` of every tensor, the mapping dropped: a private
  copy per worker, in private anonymous memory. This is what a GPU host pays per worker without flextensor (a
  pinned copy cannot be page cache); on a GPU host the copy is pinned (``.pin_memory()``), as it would be there.

Protocol (one line each on the worker's stdout; the parent answers on its stdin):

    worker -> {"stage": "loaded", ...}    imports and device set-up done (the parent reads the idle memory)
    parent -> go
    worker -> {"stage": "result", ...}    role, time to ready, output checksum (the output itself in a file)
    worker -> ready                       holding the weights until told otherwise
    parent -> exit                        (EOF means the same: a dead parent never strands a worker)
    worker -> {"stage": "error", ...}     instead of "result" when loading or the forward failed (exit status 3)

Usage (the parent builds the JSON): ``demo_worker.py [--baseline mmap|copy] PARAMS_JSON``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

#: The session's name for the model (the demo's one manager); the parent uses it to reclaim a namespace.
MANAGER = "model"
#: The layouts a worker can hold its weights in; the parent runs one group of workers per layout.
LAYOUTS = ("flextensor", "copy", "mmap")
BASELINES = ("mmap", "copy")


def emit(payload: dict[str, Any] | str) -> None:
    """One protocol line on stdout, flushed at once (the parent waits for it)."""
    print(payload if isinstance(payload, str) else json.dumps(payload), flush=True)


def _checksum_and_save(out: Any, out_path: str) -> dict[str, Any]:
    """Write the output where the parent reads it; return what the result line says about it."""
    data = out.float().cpu().contiguous().numpy().tobytes()
    Path(out_path).write_bytes(data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data), "shape": list(out.shape)}


def _warm_up(params: dict[str, Any]) -> Any:
    """Set up the device and pay every cost that is not the weights, before the idle reading.

    What any worker pays before it holds weights belongs to the idle baseline, not to the model: the first meta
    model's one-off torch set-up, and the math libraries a first forward loads (cuBLAS, attention kernels:
    hundreds of MiB of host memory with CUDA). A tiny model of the same dtype on the same device does both.
    Returns the device.
    """
    import torch

    from demo_model import DemoSpec, build_random, demo_tokens, quick_spec

    spec = DemoSpec(**params["spec"])
    device = torch.device(params["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context belongs to the idle baseline, not to the weights
    warm = quick_spec(spec.torch_dtype, layers=1)
    with torch.no_grad():
        build_random(warm, device=device)(demo_tokens(warm, seq=params["seq"]).to(device))
    return device


def _hold() -> None:
    """Say "ready" and keep the weights until the parent says "exit" (or goes away)."""
    emit("ready")
    sys.stdin.readline()


def run_flextensor(params: dict[str, Any], device: Any, tokens: Any) -> None:
    """Join the shared session, run the forward, report, hold, close (the session is closed even on failure)."""
    import torch

    import flextensor as ft

    from demo_model import DemoSpec, build_meta, load_checkpoint

    spec = DemoSpec(**params["spec"])
    if device.type == "cuda":
        config = ft.OffloadConfig(include_patterns=[params["pattern"]], pinned_memory=True, gpu_device=device.index)
    else:
        config = ft.OffloadConfig(include_patterns=[params["pattern"]], pinned_memory=False,
                                  num_blocks=params["num_blocks"], min_blocks=params["num_blocks"])
    session = ft.SharedOffloadSession(params["namespace"], wait_timeout=params["wait_timeout"],
                                      lease_seconds=params["lease"])
    try:
        model = session.offload_from_profile(
            params["profile_dir"], config=config, name=MANAGER,
            creator_model_factory=lambda: load_checkpoint(spec, params["checkpoint"]),
            follower_model_factory=lambda: build_meta(spec),
        )
        with torch.no_grad():
            out = model(tokens)
        share = next(s for s in session.report() if s["manager"] == MANAGER)
        emit({"stage": "result", "role": share["role"], "generation": share["generation"],
              "ready_s": share["ready_s"], "wait_s": share["wait_s"], "shared_bytes": share["shared_bytes"],
              "block_bytes": ft.get_gpu_memory_usage(MANAGER).block_bytes,
              **_checksum_and_save(out, params["out_path"])})
        _hold()
    finally:
        session.close()


def _private_copy(state: dict[str, Any], pinned: bool) -> dict[str, Any]:
    """Every tensor copied out of the file's mapping: pinned on a GPU host (what a worker there holds), a plain
    ``.clone()`` (private anonymous memory) on a CPU host."""
    return {name: (t.pin_memory() if pinned else t.clone()) for name, t in state.items()}


def run_baseline(layout: str, params: dict[str, Any], device: Any, tokens: Any) -> None:
    """Load the checkpoint without flextensor (``mmap`` or ``copy``), run the same forward, report, hold.

    The forward runs ``torch.func.functional_call`` over the weights moved to the compute device: on a CPU host
    ``.to("cpu")`` returns the host tensors themselves (the forward reads the mapping or the copy in place, as
    flextensor's workers read ``/dev/shm``); on a GPU host the host copy stays where it was loaded.
    """
    import torch
    from safetensors.torch import load_file
    from torch.func import functional_call

    from demo_model import DemoSpec, build_meta

    spec = DemoSpec(**params["spec"])
    start = time.monotonic()
    state = load_file(params["checkpoint"], device="cpu")  # maps the file: its pages are the page cache's
    if layout == "copy":
        state = _private_copy(state, pinned=device.type == "cuda")
        gc.collect()  # the mapping's last references went with the loaded dict: unmapped now
    model = build_meta(spec)
    model.load_state_dict(state, assign=True, strict=True)
    ready_s = time.monotonic() - start
    with torch.no_grad():
        weights = {name: t.to(device) for name, t in model.state_dict().items()}
        out = functional_call(model, weights, (tokens,))
        del weights
    emit({"stage": "result", "role": layout, "generation": "-", "ready_s": ready_s, "wait_s": 0.0,
          **_checksum_and_save(out, params["out_path"])})
    _hold()


def worker_main(layout: str, params: dict[str, Any]) -> int:
    """One worker of ``layout``: warm up, report idle, load on "go", forward, report, hold, exit 0 (3 on error)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(process)d %(name)s: %(message)s", datefmt="%H:%M:%S")
    import flextensor as ft  # noqa: F401 - imported before the idle reading, like a real worker would have it
    import flextensor.api  # noqa: F401
    import flextensor.profiles  # noqa: F401
    import safetensors.torch  # noqa: F401

    from demo_model import DemoSpec, demo_tokens

    device = _warm_up(params)
    tokens = demo_tokens(DemoSpec(**params["spec"]), seq=params["seq"]).to(device)
    emit({"stage": "loaded", "pid": os.getpid(), "layout": layout})
    if sys.stdin.readline().strip() != "go":
        return 1  # the parent went away before the start
    run: Callable[[], None] = (lambda: run_flextensor(params, device, tokens)) if layout == "flextensor" else \
        (lambda: run_baseline(layout, params, device, tokens))
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        logging.getLogger("demo.worker").exception("worker failed")
        try:
            emit({"stage": "error", "error": type(exc).__name__, "message": str(exc)})
        except BrokenPipeError:
            pass
        return 3
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", choices=BASELINES, help="load without flextensor: mmap or a private copy")
    parser.add_argument("params", metavar="PARAMS_JSON", help="the run's parameters, as the parent writes them")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return worker_main(args.baseline or "flextensor", json.loads(args.params))


if __name__ == "__main__":
    sys.exit(main())
