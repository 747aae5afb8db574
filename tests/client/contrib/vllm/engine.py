"""One vLLM engine in one process, driven by JSON lines on stdin, answering JSON lines on stdout.

Started by the vLLM tests with the vLLM venv's python and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core
and its worker in this process, so a SIGKILL of this pid kills the whole engine), or with it on (vLLM's default:
the engine core and the worker in processes of their own). Prints ``{"event": "ready", ...}`` once ``LLM(...)``
returned, then answers each command (each answer is one line starting with ``MARK``; vLLM logs to stdout too):

- ``{"cmd": "generate", "prompts": [...], "max_tokens": N}`` -> ``{"event": "tokens", "tokens": [[...], ...]}``
  (greedy);
- ``{"cmd": "refusals"}`` -> ``{"event": "refusals", "cases": {...}}``: the refusal checks of ``refusals.py``, with
  vLLM's own config objects (this process has vLLM imported already);
- ``{"cmd": "exit"}`` -> shuts the engine down and exits 0.

Any failure prints ``{"event": "error", "error": ...}`` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback


#: Marks this script's lines on stdout, which vLLM's own log lines share.
MARK = "@engine "


def say(**message: object) -> None:
    print(MARK + json.dumps(message), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--worker-cls", default="auto")
    parser.add_argument("--additional-config", default="{}", help="JSON for vLLM's additional_config")
    parser.add_argument("--kv-cache-mib", type=int, default=12)
    parser.add_argument("--compile", action="store_true", help="let vLLM compile (default: enforce_eager)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", enforce_eager=not args.compile, max_model_len=128, max_num_seqs=4,
              kv_cache_memory_bytes=args.kv_cache_mib << 20, seed=0, worker_cls=args.worker_cls,
              additional_config=json.loads(args.additional_config))
    reports: dict[str, object] = {}
    for method in ("pss_before_load_kib", "flextensor_report"):
        try:
            reports[method] = llm.collective_rpc(method)[0]
        except Exception:  # noqa: BLE001 - vLLM's own worker has no flextensor_report
            reports[method] = None
    say(event="ready", **reports)
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "generate":
            outputs = llm.generate(command["prompts"], SamplingParams(temperature=0.0, max_tokens=command["max_tokens"]),
                                   use_tqdm=False)
            say(event="tokens", tokens=[list(o.outputs[0].token_ids) for o in outputs])
        elif command["cmd"] == "refusals":
            from tests.client.contrib.vllm.refusals import cases

            say(event="refusals", cases=cases())
        elif command["cmd"] == "exit":
            break
    llm.llm_engine.engine_core.shutdown()
    say(event="exited")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BaseException as exc:  # noqa: BLE001 - reported to the test, then a failing exit
        if isinstance(exc, SystemExit):
            raise
        say(event="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        sys.exit(1)
