"""Keeping the engine's host-side steps out of compiled graphs, without importing ``torch._dynamo`` up front.

Note [compile-disabled on dynamo's import]
------------------------------------------
Some engine methods must never be traced by ``torch.compile``: the block loader's ``enter``/``exit`` swap
parameter data and order streams with CUDA events, host-side bookkeeping a compiled graph must not capture
(dynamo breaks the graph there and runs them eagerly). ``torch.compiler.disable`` marks them, but applying it
imports ``torch._dynamo`` (and sympy): seconds at the first ``ft.offload()`` of a process that never compiles.

Nothing can be compiled before ``torch._dynamo`` is imported, and ``torch.compile`` imports it before it traces
anything. So :func:`disable_compile` applies ``torch.compiler.disable`` at once when ``torch._dynamo`` is
already imported, and otherwise the moment its import finishes: a one-shot import hook (a finder on
``sys.meta_path`` that answers for that one module, wraps its loader's ``exec_module`` and removes itself).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Sequence

__all__ = ["disable_compile"]

_DYNAMO = "torch._dynamo"
_lock = threading.RLock()
_pending: list[tuple[Any, str]] = []  # (owner, attribute name) still to wrap


def disable_compile(owner: Any, names: Sequence[str]) -> None:
    """Wrap ``owner.<name>`` for each of ``names`` with ``torch.compiler.disable``, now or once dynamo is imported."""
    with _lock:
        _pending.extend((owner, name) for name in names)
        if _DYNAMO in sys.modules:
            _apply()
        elif not any(isinstance(finder, _DynamoImportHook) for finder in sys.meta_path):
            sys.meta_path.insert(0, _DynamoImportHook())


def _apply() -> None:
    import torch

    with _lock:
        while _pending:
            owner, name = _pending.pop()
            setattr(owner, name, torch.compiler.disable(getattr(owner, name)))


class _DynamoImportHook(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` like the path finder does, and applies the pending wraps after it executed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _DYNAMO:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _apply()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
