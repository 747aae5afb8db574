"""What a vLLM worker offloads, and how: an ``OffloadConfig`` with vLLM-oriented default patterns.

Sources, highest first: ``FT_*`` environment variables, then the config file named in vLLM's
``additional_config={"flextensor": {"config_file": ...}}`` (INI, YAML or JSON, as ``ft.load_config_from_file``
reads), then the defaults below. vLLM passes the environment and ``additional_config`` on to every engine and
worker process it spawns, so one setting reaches all of them. Choosing the worker class switches offloading on:
``enabled`` defaults to ``True`` here (``FT_ENABLED=0`` turns it off and vLLM runs as if the worker were its own).

Default patterns. ``include_patterns`` and ``exclude_patterns`` that nobody set (no ``FT_INCLUDE_PATTERNS`` /
``FT_EXCLUDE_PATTERNS`` variable, and the file leaves the engine's default) are replaced by
``VLLM_DEFAULT_INCLUDE_PATTERNS`` / ``VLLM_DEFAULT_EXCLUDE_PATTERNS``, each on its own:

- includes: decoder-layer classes, so that every transformer layer is a trap of its own whatever its path
  (``model.layers.N`` in most vLLM models, ``transformer.h.N`` in others): per-layer traps are what lets a copy
  for layer N+1 overlap layer N's compute;
- excludes: the common embedding, final-norm and head paths, and the MoE sidecars and tiny router / gating
  modules, which stay resident. The head is the reason the first group is excluded rather than trapped: vLLM
  computes logits outside the model's forward (its ``LogitsProcessor`` reads ``lm_head.weight`` directly, after
  the pass), and many models tie that weight to the embedding, so a streamed copy would be read outside any trap.
  Routers and gates are read by every token, are a few KiB each, and a copy of one would cost more than it saves.

With an include list that does not match the model (a layout none of the defaults know), ``ft.offload`` logs a
warning naming the patterns and offloads nothing: list ``model.named_modules()`` and set ``FT_INCLUDE_PATTERNS``.

On a host without CUDA the CPU is the compute device, so ``pinned_memory`` defaults to ``False`` there (pinned
memory needs CUDA); an explicit ``FT_PINNED_MEMORY=1`` still gets the engine's named error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

from flextensor.configuration.config import OffloadConfig
from flextensor.configuration.config_loading import ENV_PREFIX, load_config
from flextensor.shm.names import validate_manager_name

__all__ = ["VLLM_DEFAULT_INCLUDE_PATTERNS", "VLLM_DEFAULT_EXCLUDE_PATTERNS", "OPTIONS_KEY", "WORKER_OPTIONS",
           "DEFAULT_MANAGER", "WorkerSettings", "resolve_settings"]

#: One trap per transformer layer, by class (vLLM's model classes keep the Hugging Face names).
VLLM_DEFAULT_INCLUDE_PATTERNS: tuple[str, ...] = (
    "class:*DecoderLayer",    # Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral, DeepSeek, OPT, Falcon, ...
    "class:*DecoderBlock",
    "class:GPT2Block",
    "class:GPTJBlock",
    "class:GPTBigCodeBlock",
    "class:GPTNeoXLayer",
    "class:BloomBlock",
)

#: Kept resident: embedding / final norm / head paths, then MoE routers, gates and their sidecar tensors.
VLLM_DEFAULT_EXCLUDE_PATTERNS: tuple[str, ...] = (
    "*embed_tokens", "*.wte", "*.wpe", "*embed_in", "*word_embeddings",
    "*.norm", "*.ln_f", "*final_layer_norm", "*final_layernorm",
    "lm_head", "*embed_out", "logits_processor",
    "*.gate", "*.router", "*.shared_expert_gate", "*e_score_correction_bias",
    "*expert_map", "*expert_load_view", "*logical_to_physical_map", "*logical_replica_count",
)

#: The key of vLLM's ``additional_config`` that holds this worker's options.
OPTIONS_KEY = "flextensor"
#: The manager name when none is given (also part of the shared-memory names of the v2 worker).
DEFAULT_MANAGER = "vllm"
#: The options ``additional_config["flextensor"]`` accepts, and what each one is.
WORKER_OPTIONS: dict[str, str] = {
    "config_file": "an OffloadConfig file (INI with a [flextensor] section, YAML or JSON)",
    "manager": f"the offload manager's name (default {DEFAULT_MANAGER!r})",
    "warmup_tokens": "tokens per warm-up pass (default: max_num_seqs, one decode step of a full batch)",
    "namespace": "the v2 worker's base namespace (default: FT_SHM_NAMESPACE, or one derived for vLLM's DP)",
    "memory_budget_bytes": "the engine's device budget in bytes (OffloadManager.set_memory_budget: memory mode "
                           "with an absolute budget; on a CPU host, the bytes kept outside the host blocks)",
}

_DEFAULTS = OffloadConfig()


@dataclass(frozen=True)
class WorkerSettings:
    """A worker's resolved settings: the engine's config and the worker's own options."""

    config: OffloadConfig
    manager: str = DEFAULT_MANAGER
    warmup_tokens: int | None = None
    namespace: str | None = None
    memory_budget_bytes: int | None = None
    #: Which defaults this module installed (``include_patterns``, ``exclude_patterns``, ``pinned_memory``),
    #: for the worker's log line.
    defaults_applied: tuple[str, ...] = ()


def _options(additional_config: Mapping[str, Any] | None) -> dict[str, Any]:
    raw = (additional_config or {}).get(OPTIONS_KEY, {})
    if not isinstance(raw, Mapping):
        raise ValueError(f"vLLM additional_config[{OPTIONS_KEY!r}] must be a mapping of options, got "
                         f"{type(raw).__name__}; valid options: {', '.join(WORKER_OPTIONS)}")
    unknown = sorted(set(raw) - set(WORKER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r} in vLLM additional_config[{OPTIONS_KEY!r}]; valid options: "
                         + "; ".join(f"{k} ({v})" for k, v in WORKER_OPTIONS.items()))
    return dict(raw)


def _int_at_least(value: Any, minimum: int, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def resolve_settings(additional_config: Mapping[str, Any] | None, *, cuda: bool) -> WorkerSettings:
    """The settings of one worker from vLLM's ``additional_config``, the ``FT_*`` environment and the defaults.

    ``cuda``: whether the worker computes on a CUDA device (else on the CPU). Config errors are the loader's
    ``ValueError`` naming the option and its source."""
    env = os.environ
    options = _options(additional_config)
    config_file = options.get("config_file")
    if config_file is not None and not isinstance(config_file, (str, os.PathLike)):
        raise ValueError(f"additional_config[{OPTIONS_KEY!r}]['config_file'] must be a path, got {config_file!r}")
    config = load_config(config_file, use_env=True)
    changes: dict[str, Any] = {}
    if config_file is None and f"{ENV_PREFIX}ENABLED" not in env:
        changes["enabled"] = True  # environment-only loading defaults to off; choosing the worker means on
    if f"{ENV_PREFIX}INCLUDE_PATTERNS" not in env and config.include_patterns == _DEFAULTS.include_patterns:
        changes["include_patterns"] = list(VLLM_DEFAULT_INCLUDE_PATTERNS)
    if f"{ENV_PREFIX}EXCLUDE_PATTERNS" not in env and config.exclude_patterns == _DEFAULTS.exclude_patterns:
        changes["exclude_patterns"] = list(VLLM_DEFAULT_EXCLUDE_PATTERNS)
    if not cuda and f"{ENV_PREFIX}PINNED_MEMORY" not in env and config.pinned_memory == _DEFAULTS.pinned_memory:
        changes["pinned_memory"] = False
    if changes:
        config = replace(config, **changes)
    manager = options.get("manager", DEFAULT_MANAGER)
    if not isinstance(manager, str):
        raise ValueError(f"additional_config[{OPTIONS_KEY!r}]['manager'] must be a string, got {manager!r}")
    validate_manager_name(manager)
    namespace = options.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not namespace):
        raise ValueError(f"additional_config[{OPTIONS_KEY!r}]['namespace'] must be a non-empty string, got "
                         f"{namespace!r}")
    return WorkerSettings(
        config=config, manager=manager,
        warmup_tokens=_int_at_least(options.get("warmup_tokens"), 1, f"additional_config[{OPTIONS_KEY!r}]['warmup_tokens']"),
        namespace=namespace, memory_budget_bytes=_int_at_least(options.get("memory_budget_bytes"), 0,
                                          f"additional_config[{OPTIONS_KEY!r}]['memory_budget_bytes']"),
        defaults_applied=tuple(k for k in changes if k != "enabled"))
