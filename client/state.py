"""The engine's exported state (``TensorManagerState``) and the model tensor registry it is checked against.

``TensorManagerState`` is what a profile file holds and what a shared session publishes: enough for a process
that holds only a *meta* model to rebuild the INFERENCE loader without discovery or profiling. It crosses
process boundaries, so it is a msgspec Struct (JSON for profiles; msgpack is fine too), never pickle.

Contents (schema version :data:`SCHEMA_VERSION`):

- ``fingerprint``: sha256 over the sorted ``name|kind|dtype|shape|aliases`` lines of every parameter and
  buffer; a mismatch is reported by naming the first differing tensor (see :func:`describe_mismatch`).
- ``transfer_mode``, ``num_blocks``: config essentials (the transfer mode must match on adoption);
  ``small_slot_bytes``: the loader's small last slot under a memory budget (0: slots of one size).
- ``traps``: trap labels with their kind (``module``: a module path; ``block``: a manual ``offload_block``),
  in first-execution order; ``schedule``: the offloaded trap invocations of one pass, in order.
- ``tensors``: every parameter and buffer by canonical name with dtype, shape, stride, storage offset, nbytes,
  kind, persistence, aliases, owning trap, and placement (resident or offloaded with block index + byte offset).
- ``blocks``: host block sizes and trap labels; ``name`` is the SHM segment name when the block is shared.
- ``timings``: per-trap compute seconds and the transfer samples the transfer model was fitted on.
- ``strategy`` and ``explanation``: which planner chose this and why.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec
import torch
from torch import nn

__all__ = [
    "SCHEMA_VERSION",
    "TensorState",
    "BlockState",
    "TrapState",
    "TimingState",
    "TensorManagerState",
    "ModelTensor",
    "model_tensors",
    "tensor_nbytes",
    "model_fingerprint",
    "describe_mismatch",
    "dtype_name",
    "dtype_from_name",
]

SCHEMA_VERSION = 1


class TensorState(msgspec.Struct, kw_only=True):
    name: str
    kind: str  # "parameter" | "buffer"
    dtype: str
    shape: list[int]
    stride: list[int]
    storage_offset: int = 0
    nbytes: int
    persistent: bool = True
    aliases: list[str] = []
    trap: str = ""  # owning trap label ('' when none)
    offloaded: bool = False
    block: int = -1
    byte_offset: int = 0


class BlockState(msgspec.Struct, kw_only=True):
    index: int
    label: str
    nbytes: int
    name: str = ""  # SHM segment name when the block is shared


class TrapState(msgspec.Struct, kw_only=True):
    label: str
    kind: str = "module"  # "module" | "block"


class TimingState(msgspec.Struct, kw_only=True):
    compute_s: dict[str, float] = {}
    transfer_samples: list[tuple[int, float]] = []


class TensorManagerState(msgspec.Struct, kw_only=True):
    schema_version: int = SCHEMA_VERSION
    library_version: str = ""
    fingerprint: str
    transfer_mode: str
    num_blocks: int
    traps: list[TrapState]
    schedule: list[str]
    tensors: list[TensorState]
    blocks: list[BlockState]
    timings: TimingState = msgspec.field(default_factory=TimingState)
    strategy: str = ""
    explanation: list[str] = []
    small_slot_bytes: int = 0

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=1)

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "profile") -> "TensorManagerState":
        """Decode and check the schema version first, so an old/new file is refused with a clear reason."""
        try:
            raw = msgspec.json.decode(data)
        except msgspec.DecodeError as exc:
            raise ValueError(f"{source} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict) or "schema_version" not in raw:
            raise ValueError(f"{source} has no schema_version: it is not a flextensor profile")
        version = raw["schema_version"]
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"{source} has schema_version {version!r} but this flextensor reads schema {SCHEMA_VERSION}; "
                "re-create the profile with this version (run discovery/profiling again and save_profile)"
            )
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{source} is malformed: {exc}") from exc

    def tensor_map(self) -> dict[str, TensorState]:
        return {t.name: t for t in self.tensors}

    def blocks_in_order(self) -> list[BlockState]:
        """The host blocks by index: the order of the arena that holds them (``flextensor.shm.blocks``)."""
        return sorted(self.blocks, key=lambda b: b.index)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in state")
    return dtype


# ----------------------------------------------------------------------------------------------------------------
# The model's tensors
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ModelTensor:
    """A parameter or buffer of the model under its canonical (first) name."""

    name: str
    kind: str
    tensor: torch.Tensor  # the Parameter object, or the buffer tensor (its identity is preserved by .data swaps)
    persistent: bool
    aliases: list[str]

    def signature(self) -> str:
        t = self.tensor
        return f"{self.name}|{self.kind}|{dtype_name(t.dtype)}|{list(t.shape)}|{','.join(self.aliases)}"


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (not of its whole storage): what offloading the tensor moves."""
    return t.numel() * t.element_size()


def model_tensors(model: nn.Module) -> dict[str, ModelTensor]:
    """Every parameter and buffer once, by canonical name (``named_parameters`` order first), with aliases.

    One walk of the module tree collects both kinds (``named_parameters`` and ``named_buffers`` would walk it
    twice, in the same module order): a follower's adoption calls this on its critical path."""
    out: dict[str, ModelTensor] = {}
    by_id: dict[int, ModelTensor] = {}
    registered: list[tuple[str, str, torch.Tensor, bool]] = []
    buffers: list[tuple[str, str, torch.Tensor, bool]] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for attr, param in module._parameters.items():
            if param is not None:
                registered.append(("parameter", prefix + attr, param, True))
        for attr, buf in module._buffers.items():
            if buf is not None:
                buffers.append(("buffer", prefix + attr, buf, attr not in module._non_persistent_buffers_set))
    registered += buffers
    for kind, name, tensor, persistent in registered:
        entry = by_id.get(id(tensor))
        if entry is not None:
            if name != entry.name and name not in entry.aliases:
                entry.aliases.append(name)
            continue
        entry = ModelTensor(name, kind, tensor, persistent, [])
        by_id[id(tensor)] = entry
        out[name] = entry
    return out


def model_fingerprint(tensors: dict[str, ModelTensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(tensors[name].signature().encode())
        digest.update(b"\n")
    return digest.hexdigest()


def describe_mismatch(tensors: dict[str, ModelTensor], state: TensorManagerState) -> str:
    """Name the first tensor (sorted by name) where the model and the state disagree."""
    saved = state.tensor_map()
    for name in sorted(set(tensors) | set(saved)):
        mine, theirs = tensors.get(name), saved.get(name)
        if mine is None:
            return f"tensor {name!r} is in the profile but not in the model"
        if theirs is None:
            return f"tensor {name!r} is in the model but not in the profile"
        t = mine.tensor
        if mine.kind != theirs.kind:
            return f"tensor {name!r} is a {mine.kind} in the model but a {theirs.kind} in the profile"
        if dtype_name(t.dtype) != theirs.dtype:
            return f"tensor {name!r} has dtype {dtype_name(t.dtype)} in the model but {theirs.dtype} in the profile"
        if list(t.shape) != list(theirs.shape):
            return f"tensor {name!r} has shape {list(t.shape)} in the model but {theirs.shape} in the profile"
        if sorted(mine.aliases) != sorted(theirs.aliases):
            return f"tensor {name!r} is tied to {mine.aliases} in the model but to {theirs.aliases} in the profile"
    return "the fingerprints differ but no tensor differs (the profile file was edited by hand?)"
