"""Which trap uses which parameter: the DISCOVERY pass's ``TorchFunctionMode``.

Active for a whole root forward during DISCOVERY, it records ``tensor name -> {trap labels}`` for every model
parameter passed to a torch function (``OUTSIDE`` for code between traps). It also keeps warm-up robust on a
GPU: a parameter still on the host when some code uses it (another trap's weight, a weight used outside traps) is
swapped for a cached device copy in the call's arguments. The engine makes tensors used by more than one trap,
or outside traps, resident.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

__all__ = ["OUTSIDE", "UsageRecorder"]

OUTSIDE = "<outside traps>"


class UsageRecorder(TorchFunctionMode):
    """Records ``tensor name -> {trap labels}`` for model parameters passed to torch functions.

    ``enabled`` is switched off while the engine itself touches parameters (``.data`` swaps), so engine work is
    neither recorded nor rewritten.
    """

    def __init__(self, names_by_id: dict[int, str], device: torch.device, *, non_blocking: bool = False) -> None:
        super().__init__()
        self.names_by_id = names_by_id
        self.device = device
        self.non_blocking = non_blocking
        self.current = OUTSIDE
        self.enabled = True
        self.usage: dict[str, set[str]] = {}
        self._copies: dict[int, torch.Tensor] = {}

    def clear_copies(self) -> None:
        self._copies.clear()

    def _visit(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        name = self.names_by_id.get(id(value))
        if name is None:
            return value
        self.usage.setdefault(name, set()).add(self.current)
        if value.device != self.device and value.device.type != "meta":
            copy = self._copies.get(id(value))
            if copy is None:
                copy = value.detach().to(self.device, non_blocking=self.non_blocking)
                self._copies[id(value)] = copy
            return copy
        return value

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.enabled and self.names_by_id:
            args, kwargs = tree_map(self._visit, (args, kwargs))
        return func(*args, **kwargs)
