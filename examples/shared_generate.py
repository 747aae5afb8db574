"""What the launcher examples share: a causal LM served by N workers on one host from ONE host copy.

``torchrun_generate.py``, ``ray_replicas.py`` and ``supervisor.py`` import this file (copy it beside them). It
holds the parts that do not depend on the launcher:

- the model: a ``transformers`` checkpoint directory (``--model DIR``, what ``save_pretrained`` wrote) or a small
  Llama built from a config (``--tiny-llama LAYERS``, seeded, no download);
- the two factories of ``SharedOffloadSession.offload_from_profile``: the elected creator loads the weights, every
  other worker builds the same model on the ``meta`` device and maps the creator's shared blocks;
- the profile: made once, either ahead (``--make-profile`` of a launcher) or by the first worker of the host
  that finds none (under a file lock, written to a temporary directory and renamed, so no worker ever reads a
  half-written profile);
- greedy ``generate`` and the memory numbers (PSS from ``/proc/<pid>/smaps_rollup``).

The config is the same for profiling and for every worker: every ``*DecoderLayer`` is a trap; on a GPU host the
weights are pinned and streamed to ``cuda:<local rank>``; on a CPU host (``pinned_memory=False``) the CPU is the
compute device.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import flextensor as ft

#: The engine's trap pattern: one trap per decoder layer of any ``transformers`` decoder-only model.
DECODER_PATTERN = "class:*DecoderLayer"
#: The manager name every worker uses (the per-manager shared-memory names derive from it and the namespace).
MANAGER = "llm"


# ------------------------------------------------------------------------------------------------ arguments
def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The options every launcher takes: which model, which profile, how to generate."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="a transformers checkpoint directory (save_pretrained output)")
    src.add_argument("--tiny-llama", metavar="LAYERS", type=int,
                     help="build a small Llama with this many layers from a config (seed 0, no download)")
    parser.add_argument("--hidden", type=int, default=64, help="--tiny-llama: hidden size (default 64)")
    parser.add_argument("--vocab", type=int, default=128, help="--tiny-llama: vocabulary size (default 128)")
    parser.add_argument("--profile", metavar="DIR", required=True,
                        help="profile directory; made by the first worker of the host when it does not exist")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights dtype (default: bfloat16 with CUDA, float32 on a CPU host)")
    parser.add_argument("--stream-every", type=int, default=1, metavar="N",
                        help="stream every N-th decoder layer from the shared host copy (default 1: all of them)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt length in tokens (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32)")
    parser.add_argument("--wait-timeout", type=float, default=600.0,
                        help="seconds a follower waits for the creator (default 600)")


def compute_device(local_rank: int) -> torch.device:
    """``cuda:<local rank>`` on a GPU host (ranks beyond the GPU count wrap around), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def weights_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def model_id(args: argparse.Namespace) -> str:
    """A stable description of the model, for namespaces: the same weights must mean the same id."""
    if args.model:
        return f"ckpt:{Path(args.model).resolve()}:{weights_dtype(args)}"
    return f"tiny-llama:{args.tiny_llama}x{args.hidden}:v{args.vocab}:{weights_dtype(args)}"


def job_namespace(prefix: str, job_id: str, args: argparse.Namespace) -> str:
    """``<prefix>-<16 hex>``: one namespace per (job, model). Two jobs, or one job serving two models, never meet;
    every worker of one job on one host derives the same name."""
    digest = hashlib.sha256(f"{job_id}|{model_id(args)}".encode()).hexdigest()[:16]
    return f"{re.sub(r'[^a-z0-9-]', '-', prefix.lower())}-{digest}"


# ------------------------------------------------------------------------------------------------ the model
def _tiny_llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.tiny_llama, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512)


def model_config(args: argparse.Namespace):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(args.model) if args.model else _tiny_llama_config(args)


def load_model(args: argparse.Namespace) -> nn.Module:
    """The real weights, on the CPU (the creator's factory, and the profiler's model)."""
    from transformers import AutoModelForCausalLM

    dtype = weights_dtype(args)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_llama_config(args), dtype=dtype)
    return model.eval()


def build_meta_model(args: argparse.Namespace) -> nn.Module:
    """The same architecture on ``meta``: no weights, no memory (every follower's factory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(args), dtype=weights_dtype(args))
    return model.eval()


def offload_config(args: argparse.Namespace, device: torch.device) -> ft.OffloadConfig:
    """One config for profiling and for every worker (the profile is only valid for the config it was made with)."""
    common = dict(include_patterns=[DECODER_PATTERN], profiling_iters=2,
                  load_strategy=ft.NthLayerStrategy(args.stream_every))
    if device.type == "cuda":
        return ft.OffloadConfig(pinned_memory=True, gpu_device=device.index, **common)
    return ft.OffloadConfig(pinned_memory=False, num_blocks=2, min_blocks=2, **common)


def prompt_ids(args: argparse.Namespace, index: int, vocab: int) -> torch.Tensor:
    """A deterministic prompt per replica (``index``): token ids, batch of one."""
    gen = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, vocab, (1, args.prompt_len), generator=gen)


# ------------------------------------------------------------------------------------------------ the profile
def ensure_profile(args: argparse.Namespace, device: torch.device) -> bool:
    """Make ``args.profile`` unless it exists; True when this process made it.

    Workers of one host race here: the first takes the file lock and profiles, the others wait on the lock and
    then find the directory. The profile is written to a temporary sibling and renamed into place.
    """
    target = Path(args.profile)
    if target.is_dir():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return False
        make_profile(args, device, target)
        return True


def make_profile(args: argparse.Namespace, device: torch.device, target: Path) -> None:
    """Offload privately, run the warm-up forwards (discovery, profiling), save, release."""
    model = load_model(args)
    config = offload_config(args, device)
    ft.offload(model, config, name="profiler")
    ids = prompt_ids(args, 0, model.config.vocab_size).to(device)
    with torch.no_grad():
        for _ in range(ft.get_offload_manager("profiler").iters_before_inference):
            model(ids)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        ft.save_profile(str(tmp), name="profiler")
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ft.release("profiler", preserve_model=False)


# ------------------------------------------------------------------------------------------------ serving
def open_shared_model(session: ft.SharedOffloadSession, args: argparse.Namespace, device: torch.device,
                      *, creator_hook: Callable[[], None] | None = None) -> nn.Module:
    """The offloaded model of this worker: the creator loads the weights, everyone else attaches to them."""

    def creator() -> nn.Module:
        if creator_hook is not None:
            creator_hook()
        return load_model(args)

    return session.offload_from_profile(
        args.profile, config=offload_config(args, device), name=MANAGER,
        creator_model_factory=creator, follower_model_factory=lambda: build_meta_model(args),
    )


def generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, device: torch.device) -> list[int]:
    """Greedy decoding with the KV cache on ``device`` (the compute device); the new token ids."""
    with torch.no_grad():
        out = model.generate(ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


# ------------------------------------------------------------------------------------------------ memory
def pss_bytes(pid: int | str = "self") -> int:
    """Proportional set size of a process (shared pages split among their users), in bytes."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


def model_bytes(args: argparse.Namespace) -> int:
    """Bytes of the model's weights (tied tensors once), from a ``meta`` build: nothing is allocated."""
    model = build_meta_model(args)  # parameters() yields a tied parameter once
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def warm_up_process(args: argparse.Namespace, device: torch.device) -> None:
    """What every worker pays before it holds any weights (torch's thread pools, the math libraries a first
    forward loads): a 1-layer model of the same kind, generated through once, then dropped. Taking the memory
    baseline after this leaves only the model's own cost in the growth."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).to(device)
    with torch.no_grad():
        tiny.generate(torch.zeros(1, 2, dtype=torch.long, device=device), max_new_tokens=2, do_sample=False,
                      pad_token_id=0)
    del tiny
