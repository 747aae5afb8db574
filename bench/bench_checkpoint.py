"""Benchmark of loading real checkpoints at bounded host RAM: the peak RSS each way of loading, and the time
from a safetensors checkpoint to READY.

What is measured, and why: the point of one host copy is host RAM, and a creator that held the model twice while
loading would need a host that holds two copies anyway. Each way of loading runs in a fresh process, which
resets its peak (``/proc/self/clear_refs``), reads ``VmRSS`` just before the call and ``VmHWM`` just after it
(flextensor's modules are imported before: importing them costs ~70 MiB once per process, not per model); the
growth is reported as a ratio of the model's bytes:

- ``lazy``: ``ft.load_model_from_profile`` (meta model, every tensor read once into its host block). Goal <= 1.10x.
- ``session creator (checkpoint)``: the creator of an N-worker ``SharedOffloadSession`` with ``checkpoint=``
  (reads into the shared blocks). Goal <= 1.10x. Its time is the checkpoint-to-READY time; the followers' time
  to ready (they start once the creator is READY) is shown beside it.
- ``session creator (in RAM)``: the creator's factory first loads the checkpoint into private tensors (the
  same reader, so the load itself costs no extra), then the session copies them into the shared blocks and frees
  each as it goes. Goal <= 1.25x (the model itself is 1x of it).
- ``offload (model in RAM)``: a single process offloading a model already in RAM from the profile; the growth
  is what offloading adds on top of the model (goal: well under one copy).

Set-up, in a separate process: an MLP stack (``--layers`` blocks of ``d x h`` and ``h x d`` weights, float32 on
a CPU host and bfloat16 on CUDA by default), saved as sharded safetensors with an index (``--shards``), profiled
with every block streamed, profile saved. Every output is checked against the plain model's.

Usage: ``python bench/bench_checkpoint.py [--layers 8 --d 1024 --h 8192] [--workers 2] [--no-docs]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import flextensor as ft  # noqa: E402

NAME = "bench_checkpoint"


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Sequential):
    def __init__(self, layers: int, d: int, h: int, dtype: torch.dtype) -> None:
        super().__init__(*[Block(d, h) for _ in range(layers)])
        self.to(dtype)


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return getattr(torch, args.dtype)


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _input(args: argparse.Namespace) -> torch.Tensor:
    return torch.randn(4, args.d, generator=torch.Generator().manual_seed(1)).to(_dtype(args))


def _config() -> ft.OffloadConfig:
    return ft.OffloadConfig(pinned_memory=torch.cuda.is_available(), num_blocks=2, min_blocks=2)


# ------------------------------------------------------------------------------------------------ set-up
def setup(args: argparse.Namespace, root: Path) -> None:
    """Model -> sharded checkpoint + profile + reference output (run in its own process)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Stack(args.layers, args.d, args.h, _dtype(args)).eval()
    device = _device()
    with torch.no_grad():
        ref = model.to(device)(_input(args).to(device)).float().cpu()
    model.to("cpu")
    torch.save(ref, root / "ref.pt")
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = list(tensors)
    per = -(-len(keys) // args.shards)
    weight_map = {}
    ckpt = root / "ckpt"
    ckpt.mkdir()
    for i in range(args.shards):
        name = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(ckpt / name))
        weight_map.update({k: name for k in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    del tensors
    cfg = ft.OffloadConfig(pinned_memory=torch.cuda.is_available(), include_patterns=["class:Block"],
                           load_strategy=ft.NthLayerStrategy(1), num_blocks=2, min_blocks=2)
    ft.offload(model, cfg, name="profiler")
    manager = ft.get_offload_manager("profiler")
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(_input(args).to(manager.device))
    ft.save_profile(str(root / "profile"), name="profiler")
    ft.release("profiler")


# ------------------------------------------------------------------------------------------------ worker
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _in_ram_factory(args: argparse.Namespace, ckpt: Path):
    def factory() -> nn.Module:
        from flextensor.checkpoint import SafetensorsCheckpoint

        checkpoint = SafetensorsCheckpoint(ckpt)
        with ft.init_empty_weights():
            model = Stack(args.layers, args.d, args.h, _dtype(args))
        model.load_state_dict({k: checkpoint.read(k) for k in checkpoint.entries}, assign=True)
        return model.eval()

    return factory


def worker(args: argparse.Namespace, root: Path) -> None:
    """One way of loading (``args.worker``); prints one JSON line; with --hold waits for a line on stdin."""
    meta = lambda: _meta_model(args)  # noqa: E731
    ckpt = root / "ckpt"
    model_in_ram = _in_ram_factory(args, ckpt)() if args.worker == "offload" else None
    size = sum(t.numel() * t.element_size() for t in meta().parameters())
    # The engine's modules are imported before the measurement: importing them costs ~70 MiB of anonymous memory
    # once per process (measured on the CPU VM), which is not memory the model's load needs.
    import flextensor.lazy_init  # noqa: F401
    import flextensor.session  # noqa: F401

    ft.init(_config(), name="model")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _status("VmRSS")
    start = time.monotonic()
    session = None
    role = "single"
    if args.worker == "lazy":
        model = ft.load_model_from_profile(ft.get_offload_manager("model"), str(root / "profile"), Stack,
                                           model_args=(args.layers, args.d, args.h, _dtype(args)),
                                           safetensor_path=str(ckpt), strict=True)
    elif args.worker == "offload":
        model = ft.offload_from_profile(model_in_ram, str(root / "profile"), _config(), name="model")
        del model_in_ram
    else:
        session = ft.SharedOffloadSession(args.ns, wait_timeout=600)
        kwargs = {"checkpoint": str(ckpt)} if args.worker == "session" else \
            {"creator_model_factory": _in_ram_factory(args, ckpt)}
        model = session.offload_from_profile(str(root / "profile"), config=_config(), name="model",
                                             follower_model_factory=meta, **kwargs)
        role = session.role("model")
    ready_s = time.monotonic() - start
    growth = _status("VmHWM") - before
    device = ft.get_offload_manager("model").device
    with torch.no_grad():
        out = model(_input(args).to(device)).float().cpu()
    ref = torch.load(root / "ref.pt")
    equal = torch.equal(out, ref) if device.type == "cpu" else bool(torch.allclose(out, ref, atol=2e-2, rtol=2e-2))
    print(json.dumps({"role": role, "growth": growth, "model_bytes": size, "ready_s": ready_s, "equal": equal}),
          flush=True)
    if args.hold:
        sys.stdin.readline()
    if session is not None:
        session.close()


def _meta_model(args: argparse.Namespace) -> nn.Module:
    with ft.init_empty_weights():
        return Stack(args.layers, args.d, args.h, _dtype(args)).eval()


# ------------------------------------------------------------------------------------------------ parent
def _spawn(args: argparse.Namespace, root: Path, mode: str, ns: str = "", hold: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", mode, "--root", str(root), "--ns", ns or "unused",
           "--layers", str(args.layers), "--d", str(args.d), "--h", str(args.h), "--dtype", args.dtype]
    if hold:
        cmd.append("--hold")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"worker exited {proc.returncode} without a result")
    return json.loads(line)


def _release(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.stdin.write("\n")
            proc.stdin.flush()
    for proc in procs:
        proc.wait()


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="ft-bench-ckpt-", dir=args.tmp) as tmp:
        root = Path(tmp)
        t0 = time.monotonic()
        subprocess.run([sys.executable, __file__, "--setup", "--root", str(root), "--layers", str(args.layers),
                        "--d", str(args.d), "--h", str(args.h), "--dtype", args.dtype, "--shards", str(args.shards)],
                       check=True)
        print(f"set-up (model, checkpoint, profile) took {time.monotonic() - t0:.1f} s", flush=True)
        rows, data = [], {"args": vars(args), "runs": []}
        goals = {"lazy": 1.10, "session": 1.10, "inram": 1.25, "offload": None}
        labels = {"lazy": "load_model_from_profile", "session": "session creator (checkpoint)",
                  "inram": "session creator (in RAM)", "offload": "offload (model in RAM), added"}
        for mode in ("lazy", "session", "inram", "offload"):
            ns = f"bench-ckpt-{uuid.uuid4().hex[:8]}"
            if mode == "session":
                creator = _spawn(args, root, mode, ns, hold=True)
                first = _result(creator)
                followers = [_spawn(args, root, mode, ns, hold=True) for _ in range(args.workers - 1)]
                others = [_result(p) for p in followers]
                _release(*followers, creator)
                result = first
                result["followers_ready_s"] = [o["ready_s"] for o in others]
                result["equal"] = first["equal"] and all(o["equal"] for o in others)
            else:
                proc = _spawn(args, root, mode, ns, hold=False)
                result = _result(proc)
                proc.wait()
            ratio = result["growth"] / result["model_bytes"]
            goal = goals[mode]
            verdict = "" if goal is None else ("met" if ratio <= goal else "MISSED")
            followers_s = ", ".join(f"{s:.2f}" for s in result.get("followers_ready_s", [])) or "-"
            rows.append([labels[mode], f"{ratio:.3f}x", f"<= {goal:.2f}x {verdict}" if goal else "-",
                         f"{result['ready_s']:.2f} s", followers_s, "yes" if result["equal"] else "NO"])
            data["runs"].append({"mode": mode, "ratio": ratio, **result})
        model_bytes = data["runs"][0]["model_bytes"]
        text = common.table(["way of loading", "peak RSS growth / model", "goal", "call to ready",
                             "followers ready (s)", "output equal"], rows)
        text += (f"\n\nModel: {args.layers} blocks of {args.d}x{args.h} {args.dtype}, {common.gib(model_bytes)}, "
                 f"{args.shards} shards; {args.workers} session workers.")
        common.report(NAME, "Checkpoints at bounded host RAM", [("Peak RSS and checkpoint-to-READY time", text)],
                      data, docs=not args.no_docs)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--h", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tmp", default=None, help="where the checkpoint is written (default: the system's temp dir)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--ns", help=argparse.SUPPRESS)
    p.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.setup:
        setup(args, Path(args.root))
    elif args.worker:
        worker(args, Path(args.root))
    else:
        run(args)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
