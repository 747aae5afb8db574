"""One process that loads the 512 MiB test model one way and reports its peak RSS growth, for the checkpoint
memory tests.

Run as ``python -m tests.helpers.ckpt_worker --mode MODE --profile DIR [--checkpoint PATH] [--ns NS]
[--shape N,D,H]`` (``--shape``: ``BigMLP``'s block count and widths, default ``BIG``; the CUDA warm-up runs a block
of ``BIG``'s whatever it says). Prints one JSON line: ``role``, ``growth`` (bytes: the process's peak RSS during
the call, ``VmHWM``, minus its ``VmRSS`` just before it; the peak is reset first through ``/proc/self/clear_refs``
so only the call counts),
``by_kind`` (``RssAnon``/``RssFile``/``RssShmem`` after the call minus before: where the growth stayed),
``cuda_init_bytes`` (the RSS that starting CUDA took before the baseline), ``kernels_init_bytes`` (the RSS that
the first forward of one of the model's blocks on the device took before the baseline: see :func:`start_cuda`),
``build_growth`` and ``build_by_kind`` (mode ``profile``: the peak while the host blocks are built, from the RSS
when the build starts, and where it stayed), ``model_bytes``, ``ready_s``,
``device_block_bytes`` (the loader's rotating blocks when the compute device is the CPU: host memory, touched by
forwards) and ``out`` (hex of the output), or ``{"error", "message"}`` with exit status 3.

Host blocks filled from a checkpoint (and shared ones) are always registered in place at their exact size. A
model already in RAM (``offload``, ``profile``) is pinned on CUDA with ``pinned_memory_mode="host_register"``:
the default ``"torch"`` takes its blocks from PyTorch's pinned allocator, which rounds each arena up to a power
of two (documented in the configuration guide): for this model 640 MiB of arenas, 1.25x its bytes.

Modes: ``lazy`` (``ft.load_model_from_profile``), ``session`` (a ``SharedOffloadSession`` creator or follower
reading ``--checkpoint``), ``inram`` (a session whose creator factory builds the model in RAM), ``offload`` (a
single-process ``ft.offload_from_profile`` of a model already in RAM: the growth is what it adds), ``profile``
(``ft.offload`` of a model in RAM through discovery, profiling and the switch to INFERENCE: what it adds).

``--stream-on-cpu`` (mode ``profile``, on a host without CUDA): the CPU streams through the loader as a GPU does,
the warm-up is resident (``--warmup stream``: copied per call) and the offload candidates are staged with
recorded registrations (``tests.helpers.fake_cudart``), so INFERENCE's host blocks are built on their thread from
the staged originals as after that warm-up on a GPU. The warm-up's "device" copies are then host memory: only
``build_growth`` and ``build_by_kind`` measure the build.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time

import torch

import flextensor as ft
from tests.helpers.checkpoints import BIG, BigMLP, big_input, big_mlp, big_mlp_meta, model_bytes
from tests.helpers.models import MLPBlock
from tests.helpers.process_memory import reset_peak, status_bytes


RSS_KINDS = ("RssAnon", "RssFile", "RssShmem")


def start_cuda() -> tuple[int, int]:
    """Create the CUDA context (and the copy path to and from the device), then run one of the model's blocks on
    the device, before the baseline; returns the RSS each took.

    Why: both are per-process constants, not costs of loading a model. The context is the driver's and runtime's
    host memory, on the order of 100 MiB of RSS or more. The first forward loads the math libraries and the
    kernels a forward needs (cuBLAS's handle and its kernel images, decompressed into host memory: tens of MiB
    more of anonymous RSS, plus the libraries' file pages), which the plain model pays at its first forward too.
    Left to the first CUDA call inside the measured load, either would count as growth of the load (a fifth of
    this model's bytes each); the profiling mode runs forwards inside it."""
    if not torch.cuda.is_available():
        return 0, 0
    before = status_bytes("VmRSS")
    torch.ones(1024, dtype=torch.uint8).to("cuda").cpu()
    torch.cuda.synchronize()
    context = status_bytes("VmRSS") - before
    before = status_bytes("VmRSS")
    x = big_input().to("cuda")  # drawn on the host's generator, outside the device default below
    with torch.device("cuda"), torch.no_grad():  # made on the device: no host copy of its weights
        block = MLPBlock(BIG["d"], BIG["h"]).eval()
        block(x).cpu()
    torch.cuda.synchronize()
    del block
    torch.cuda.empty_cache()
    return context, status_bytes("VmRSS") - before


def stream_on_cpu(warmup: str) -> None:
    """``--stream-on-cpu``: the next offload builds its host blocks on their thread, as after a ``warmup``
    (resident or stream) warm-up on a GPU (see the module docstring)."""
    from flextensor.engine.policy import EnginePolicy
    from tests.helpers.fake_cudart import FakeCudart, inject_staging

    class _Patch:  # inject_staging's monkeypatch, for the life of this process
        @staticmethod
        def setattr(target, name, value) -> None:
            setattr(target, name, value)

    ft.get_offload_manager("model").set_engine_policy(EnginePolicy(warmup=warmup, stream_on_cpu=True))
    inject_staging(_Patch(), FakeCudart().staging(policy=lambda config, device: True))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["lazy", "session", "inram", "offload", "profile"])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--ns")
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--hold", action="store_true", help="keep the session open until a line arrives on stdin")
    parser.add_argument("--log", action="store_true")
    parser.add_argument("--shape", help="N,D,H of the test model (default: BIG's)")
    parser.add_argument("--stream-on-cpu", action="store_true", help="mode profile without CUDA: see the docstring")
    parser.add_argument("--warmup", choices=["resident", "stream"], default="resident",
                        help="with --stream-on-cpu: the warm-up the build follows")
    args = parser.parse_args()
    if args.log:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    cuda = torch.cuda.is_available()
    in_ram = args.mode in ("offload", "profile")
    pinning = dict(pinned_memory=cuda, pinned_memory_mode="host_register" if cuda and in_ram else "torch")
    config = ft.OffloadConfig(**pinning, num_blocks=2, min_blocks=2)
    shape = dict(zip(("n", "d", "h"), map(int, args.shape.split(",")))) if args.shape else dict(BIG)
    x = big_input(d=shape["d"])
    session = None
    try:
        model_in_ram = big_mlp(**shape) if args.mode in ("offload", "profile") else None
        size = model_bytes(big_mlp_meta(**shape))
        for module in ("flextensor.loading.lazy_init", "flextensor.sharing.session"):  # a one-time cost per process: not measured
            importlib.import_module(module)

        cuda_init, kernels_init = start_cuda()
        if args.stream_on_cpu:
            stream_on_cpu(args.warmup)
        reset_peak()
        before = status_bytes("VmRSS")
        kinds_before = {k: status_bytes(k) for k in RSS_KINDS}
        start = time.monotonic()
        role = "single"
        build_growth, build_by_kind = 0, {}
        passes_peak = 0
        if args.mode == "lazy":
            ft.init(config, name="model")
            model = ft.load_model_from_profile(ft.get_offload_manager("model"), args.profile, BigMLP,
                                               safetensor_path=args.checkpoint, strict=True)
        elif args.mode == "profile":  # discovery, profiling and the switch to INFERENCE, all on this model
            # Two profiling passes, as the tests' cpu_config: every pass peaks alike, the first ones included.
            cfg = ft.OffloadConfig(**pinning, num_blocks=2, min_blocks=2, profiling_iters=2,
                                   include_patterns=["class:MLPBlock"], load_strategy=ft.NthLayerStrategy(1))
            model = ft.offload(model_in_ram, cfg, name="model")
            del model_in_ram
            manager = ft.get_offload_manager("model")
            with torch.no_grad():
                for _ in range(manager.iters_before_inference):
                    model(x.to(manager.device))
            # The build starts here at the latest (with the first INFERENCE pass, or when waited for): its own
            # peak is measured from here, the call's peak is the higher of the two windows.
            passes_peak = status_bytes("VmHWM")
            reset_peak()
            build_before = status_bytes("VmRSS")
            build_kinds = {k: status_bytes(k) for k in RSS_KINDS}
            manager.wait_for_host_blocks()
            build_growth = status_bytes("VmHWM") - build_before
            build_by_kind = {k: status_bytes(k) - build_kinds[k] for k in RSS_KINDS}
        elif args.mode == "offload":
            model = ft.offload_from_profile(model_in_ram, args.profile, config, name="model")
            del model_in_ram
        else:
            session = ft.SharedOffloadSession(args.ns, wait_timeout=120, lease_seconds=args.lease)
            if args.mode == "session":
                model = session.offload_from_profile(args.profile, config=config, name="model",
                                                     follower_model_factory=big_mlp_meta, checkpoint=args.checkpoint)
            else:
                model = session.offload_from_profile(args.profile, config=config, name="model",
                                                     creator_model_factory=lambda: big_mlp(**shape),
                                                     follower_model_factory=lambda: big_mlp_meta(**shape))
            role = session.role("model")
        ready_s = time.monotonic() - start
        growth = max(passes_peak, status_bytes("VmHWM")) - before
        by_kind = {k: status_bytes(k) - kinds_before[k] for k in RSS_KINDS}
        manager = ft.get_offload_manager("model")
        # On a CPU compute device the loader's rotating "device" blocks are host memory too (touched by forwards).
        device_blocks = manager.get_gpu_memory_usage().block_bytes if manager.device.type == "cpu" else 0
        with torch.no_grad():
            out = model(x.to(manager.device)).cpu()
        print(json.dumps({"role": role, "growth": growth, "by_kind": by_kind, "cuda_init_bytes": cuda_init,
                          "kernels_init_bytes": kernels_init, "build_growth": build_growth,
                          "build_by_kind": build_by_kind, "model_bytes": size, "ready_s": ready_s,
                          "device_block_bytes": device_blocks, "out": out.numpy().tobytes().hex()}), flush=True)
        if args.hold:
            sys.stdin.readline()
        if session is not None:
            session.close()
        return 0
    except Exception as exc:  # noqa: BLE001 - the test reads the class and message
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        if session is not None:
            session.close()
        return 3


if __name__ == "__main__":
    assert BIG  # the model the growth is measured on
    sys.exit(main())
