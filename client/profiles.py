"""Profile files: a ``TensorManagerState`` as schema-versioned JSON in ``<dir>/profile.json``.

Why a directory and not a file: ``profile_storage_dir`` names a directory, and a profile may later
grow companion files (instrumentation, per-device timings) without changing its address.

Writes are atomic (temporary file in the same directory, then ``os.replace``), so a reader never sees a
half-written profile and a crash leaves the previous profile intact. Reading refuses other schema versions and
malformed files with a ``ValueError`` that says why (see ``TensorManagerState.from_json``); whether the profile
fits a model is checked on adoption (fingerprint, naming the first differing tensor).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from flextensor.state import TensorManagerState

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.configuration.config import OffloadConfig
    from flextensor.engine.context import EngineContext

__all__ = ["PROFILE_FILE", "profile_path", "write_profile", "read_profile", "load_weights"]

PROFILE_FILE = "profile.json"


def profile_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / PROFILE_FILE


def write_profile(directory: str | os.PathLike[str], state: TensorManagerState) -> Path:
    """Write ``state`` to ``<directory>/profile.json`` atomically; returns the path."""
    path = profile_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".json.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(state.to_json())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def read_profile(directory: str | os.PathLike[str]) -> TensorManagerState:
    """Read and decode ``<directory>/profile.json`` (``FileNotFoundError`` / ``ValueError`` with the reason)."""
    path = profile_path(directory)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no profile at {path}: save one first (run the warm-up passes, then save_profile({str(directory)!r}))"
        ) from None
    return TensorManagerState.from_json(data, source=f"profile {path}")


def load_weights(path: str | os.PathLike[str]) -> Mapping[str, torch.Tensor]:
    """Host weights from a safetensors file, for adopting a profile on a meta model (``weights=``)."""
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def write_instrumentation(name: str, cfg: OffloadConfig, ctx: EngineContext) -> None:
    """``enable_instrumentation``: the manager's config, device and traps as JSON in ``instrumentation_output_dir``."""
    if not cfg.enable_instrumentation:
        return
    out = Path(cfg.instrumentation_output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"manager": name, "config": cfg.to_dict(), "device": str(ctx.device),
              "traps": {label: t.candidates for label, t in ctx.traps.items()}}
    (out / f"{name}.offload_manager.json").write_text(json.dumps(record, indent=1, default=str))
