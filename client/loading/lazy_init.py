"""Lazy initialisation: a model built on ``meta``, its weights read once from a safetensors checkpoint straight
into their final place (a host block, or the compute device for resident tensors), with a saved profile's plan.

Why: building a model in RAM and then copying it into host blocks holds two copies at the peak. Here the
parameters never exist outside their final place; the host memory that grows is the host blocks themselves (plus
one resident tensor at a time on its way to the device).

What is read from where (see :func:`prepare_checkpoint`):

- every parameter and persistent buffer whose name (or a tied alias) the checkpoint holds is read from it, also
  when the constructor made it real (a buffer computed in ``__init__`` is replaced by the saved value);
- a non-persistent buffer is never in a checkpoint: it keeps the value the constructor computed, so build the
  model with :func:`init_empty_weights` (parameters on ``meta``, buffers real), not under ``torch.device("meta")``;
- a tensor the checkpoint lacks: ``strict=True`` raises ``KeyError`` naming every missing key; otherwise a real
  one keeps its constructed value and a ``meta`` one is zero-filled, with a WARNING naming them.

A dtype or shape that differs from the model is a ``ValueError`` naming the tensor. All of it is checked before
any host block exists, so a refused checkpoint leaves nothing behind.

Initialisers on ``meta`` (:func:`skip_init_on_meta`): a model built on ``meta`` still runs its modules'
initialisers (``nn.Linear.reset_parameters`` calls ``kaiming_uniform_`` and ``uniform_``); on a meta tensor they
compute nothing, yet each call goes through PyTorch's dispatch and decompositions: a third of the time to build
a large model on ``meta`` or more, whether the bench's or a ``transformers`` configuration
(``AutoModelForCausalLM.from_config``), which then builds as fast as with ``transformers``' own
``no_init_weights`` (``docs/benchmarks.md``, "Building a model on meta"). A follower builds its model
beside its resident copy, whose workers share its GIL, so that time counts twice there. While a model is built
for sharing (a follower's factory, :func:`init_empty_weights`), the ``torch.nn.init`` initialisers return a
``meta`` tensor untouched and do their usual work on any other tensor: a meta tensor has no values, so nothing
observable changes, for this thread or any other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from flextensor.loading.checkpoint import CheckpointWeights, SafetensorsCheckpoint
from flextensor.engine.hooks import assign_data
from flextensor.state import model_tensors

__all__ = ["init_empty_weights", "skip_init_on_meta", "prepare_checkpoint", "CheckpointMatch",
           "load_model_from_profile"]

logger = logging.getLogger(__name__)


#: The ``torch.nn.init`` initialisers that :func:`skip_init_on_meta` passes over for a meta tensor.
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_skip_lock = threading.Lock()
_skip_depth = 0  # contexts open in this process (several threads may build models at once)
_skip_originals: dict[str, Callable[..., Any]] = {}


def _passing_over_meta(initialiser: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(initialiser)
    def initialise(*args: Any, **kwargs: Any) -> Any:
        tensor = args[0] if args else kwargs.get("tensor")
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return initialiser(*args, **kwargs)

    initialise.__flextensor_skips_meta__ = True  # type: ignore[attr-defined]
    return initialise


@contextlib.contextmanager
def skip_init_on_meta() -> Iterator[None]:
    """While inside, every ``torch.nn.init`` initialiser returns a ``meta`` tensor untouched (see the module
    docstring). Contexts nest and may be open in several threads: the first one in installs the wrappers, the last
    one out restores each original, unless something else replaced the wrapper meanwhile (that patch is left)."""
    global _skip_depth
    init = torch.nn.init
    with _skip_lock:
        if _skip_depth == 0:
            for name in _INITIALISERS:
                original = getattr(init, name, None)
                if original is not None:
                    _skip_originals[name] = original
                    setattr(init, name, _passing_over_meta(original))
        _skip_depth += 1
    try:
        yield
    finally:
        with _skip_lock:
            _skip_depth -= 1
            if _skip_depth == 0:
                for name, original in _skip_originals.items():
                    if getattr(getattr(init, name, None), "__flextensor_skips_meta__", False):
                        setattr(init, name, original)
                _skip_originals.clear()


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with every parameter on ``meta`` while buffers stay real (computed by the constructor).

    A parameter becomes ``meta`` as it is registered, so ``reset_parameters`` and friends run on ``meta`` (no
    memory; and no time either, under :func:`skip_init_on_meta`, which this enters too); a parameter that is
    already ``meta`` keeps its identity (tied weights stay tied)."""
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        current = self._parameters.get(name)
        if current is not None and not current.is_meta:
            meta = current.to("meta")
            self._parameters[name] = type(current)(meta, requires_grad=current.requires_grad)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        with skip_init_on_meta():
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass
class CheckpointMatch:
    """Which checkpoint key feeds which model tensor, and what the checkpoint lacks or has in excess."""

    keys: dict[str, str] = field(default_factory=dict)  # model tensor (canonical name) -> checkpoint key
    missing: list[str] = field(default_factory=list)  # model tensors (persistent) the checkpoint lacks
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys no model tensor has
    nbytes: int = 0  # bytes to read


def prepare_checkpoint(model: nn.Module, checkpoint: SafetensorsCheckpoint, *, strict: bool = False,
                       diagnose: bool = False, label: str = "checkpoint") -> CheckpointWeights:
    """Check ``checkpoint`` against ``model`` and make the model ready for adoption with the returned
    ``weights`` (see the module docstring): tensors read from the checkpoint go to ``meta``, missing ``meta``
    ones are zero-filled (``strict=False``). Raises before touching the model."""
    tensors = model_tensors(model)
    match = CheckpointMatch()
    used: set[str] = set()
    meta_non_persistent = []
    for name, entry in tensors.items():
        key = next((k for k in (name, *entry.aliases) if k in checkpoint), None)
        if key is None:
            if not entry.persistent:
                if entry.tensor.is_meta:
                    meta_non_persistent.append(name)
                continue
            match.missing.append(name)
            continue
        saved = checkpoint.entries[key]
        t = entry.tensor
        if saved.dtype != t.dtype or saved.shape != tuple(t.shape):
            raise ValueError(
                f"checkpoint tensor {key!r} is {str(saved.dtype).removeprefix('torch.')}{list(saved.shape)} but the "
                f"model's {name!r} is {str(t.dtype).removeprefix('torch.')}{list(t.shape)}: the checkpoint belongs "
                "to another model or configuration (convert it, or build the model with the checkpoint's config)"
            )
        match.keys[name] = key
        match.nbytes += saved.nbytes
        used.add(key)
    match.unexpected = sorted(set(checkpoint.entries) - used)
    if meta_non_persistent:
        raise ValueError(
            f"non-persistent buffer(s) {meta_non_persistent} are on the meta device and no checkpoint holds them: "
            "build the model with flextensor.loading.lazy_init.init_empty_weights() (parameters on meta, buffers computed "
            "by the constructor) instead of under torch.device('meta')"
        )
    if match.missing and strict:
        raise KeyError(f"checkpoint {str(checkpoint.path)!r} lacks {len(match.missing)} tensor(s) of the model: "
                       f"{match.missing}; pass the matching checkpoint, or strict=False to zero-fill them")
    zero_filled = [n for n in match.missing if tensors[n].tensor.is_meta]
    if zero_filled:
        logger.warning("%s lacks %d tensor(s) of the model, zero-filled: %s", label, len(zero_filled), zero_filled)
    if match.unexpected:
        logger.info("%s holds %d tensor(s) the model does not have (ignored): %s", label, len(match.unexpected),
                    match.unexpected[:20])
    if diagnose:
        _log_diagnosis(tensors, match, checkpoint)
    for name in zero_filled:
        t = tensors[name].tensor
        assign_data(t, torch.zeros(t.shape, dtype=t.dtype))
    for name in match.keys:  # read from the checkpoint: a value the constructor computed is replaced
        t = tensors[name].tensor
        if not t.is_meta:
            assign_data(t, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))
    return CheckpointWeights(checkpoint, match.keys, label=label)


def _log_diagnosis(tensors: dict, match: CheckpointMatch, checkpoint: SafetensorsCheckpoint) -> None:
    """One line per model tensor: where its value comes from (``diagnose=True``)."""
    lines = []
    for name, entry in tensors.items():
        key = match.keys.get(name)
        if key is not None:
            source = f"checkpoint {key!r}" + (" (tied alias)" if key != name else "")
        elif not entry.persistent:
            source = "constructor (non-persistent buffer)"
        else:
            source = "missing: zero-filled" if entry.tensor.is_meta else "missing: constructor value kept"
        aliases = f" aliases {entry.aliases}" if entry.aliases else ""
        lines.append(f"  {name} [{entry.kind}{aliases}] <- {source}")
    logger.info("checkpoint %s: %d tensors, %.1f MiB to read, %d missing, %d unexpected\n%s", checkpoint.path,
                len(checkpoint), match.nbytes / 2**20, len(match.missing), len(match.unexpected), "\n".join(lines))


def load_model_from_profile(
    manager: Any,
    profile_directory: str | os.PathLike[str],
    model_class: Callable[..., nn.Module],
    model_args: tuple = (),
    safetensor_path: str | os.PathLike[str] | None = None,
    model_kwargs: dict | None = None,
    buffer_device: str | torch.device | None = None,
    diagnose: bool = False,
    strict: bool = False,
) -> nn.Module:
    """Build ``model_class(*model_args, **model_kwargs)`` with its parameters on ``meta``, read every tensor from
    ``safetensor_path`` (a file, a directory of shards, or an index JSON) once into its final place, and adopt
    the profile in ``profile_directory`` on ``manager`` (an ``OffloadManager``). Returns the model in eval mode,
    ready for inference with the profile's plan.

    ``buffer_device`` puts the buffers the constructor computed there (default: where the engine puts them).
    ``strict=True``: ``KeyError`` naming the tensors the checkpoint lacks; a dtype or shape mismatch is always a
    ``ValueError`` naming the tensor. ``diagnose=True`` logs where every tensor comes from.
    """
    from flextensor.manager import OffloadManager
    from flextensor.profiles import read_profile

    if not isinstance(manager, OffloadManager):
        raise TypeError(f"load_model_from_profile needs an OffloadManager (ft.get_offload_manager(name)), got "
                        f"{type(manager).__name__}")
    if safetensor_path is None:
        raise ValueError("load_model_from_profile needs safetensor_path: a .safetensors file, a directory of shards "
                         "with model.safetensors.index.json, or that index file")
    start = time.monotonic()
    state = read_profile(profile_directory)
    checkpoint = SafetensorsCheckpoint(safetensor_path)
    with init_empty_weights():
        model = model_class(*model_args, **(model_kwargs or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_class returned {type(model).__name__}, not an nn.Module")
    if buffer_device is not None:
        for buffer in model.buffers():
            if not buffer.is_meta:
                buffer.data = buffer.data.to(buffer_device)
    weights = prepare_checkpoint(model, checkpoint, strict=strict, diagnose=diagnose,
                                 label=f"checkpoint {str(safetensor_path)!r}")
    prepared = time.monotonic()
    try:
        manager.offload_from_state(model, state, weights=weights)
    finally:
        weights.close()
    end = time.monotonic()
    stats = weights.stats
    # Where the time went: reading (pages populated ahead of it on a thread), and the adoption around it (host
    # blocks, their registration on CUDA, the resident tensors to the device).
    logger.info("manager %r: %.1f MiB read from %s in %.2f s: model and matching %.2f s, adoption %.2f s, of which "
                "reading %.2f s (%.1f MiB of pages populated ahead in %.2f s)", manager.name,
                weights.bytes_read / 2**20, safetensor_path, end - start, prepared - start, end - prepared,
                stats.read_s, stats.populated_bytes / 2**20, stats.populate_s)
    return model.eval()
