"""Which modules become offload traps, and which of their parameters may be offloaded.

A *trap* is a module whose ``forward`` the engine wraps: before it runs, the trap's offloaded weights are made
available on the compute device; after it, the block that held them may be reused. This module turns the
config's ``include_patterns`` / ``exclude_patterns`` into an ordered list of :class:`TrapSpec`.

Pattern forms (same for include and exclude):

- ``<glob>`` or ``name:<glob>``: fnmatch-style glob (``*`` any sequence, dots included; ``?`` one character;
  ``[...]`` sets) tested against module paths (``layers.3.mlp``) and parameter paths (``layers.3.mlp.weight``).
- ``class:<glob>``: tested against ``type(module).__name__`` and ``f"{cls.__module__}.{cls.__qualname__}"``;
  a match on either wins. Class patterns are module-level only.

Selection rules (why each one exists):

1. The root module is never a trap: it is what the user calls, and it drives the phase counter.
2. Walking the module tree from the root, the first (outermost) module matched by an include pattern and not by
   an exclude pattern becomes a trap; its subtree is not searched further. Traps therefore never nest, which
   keeps the loader's rule simple: one trap's weights are needed at a time. ``["*"]`` hence selects the
   top-level children.
3. An excluded module removes its whole subtree from consideration (no trap inside it, none of its parameters
   offloaded): ``exclude_patterns=["head"]`` must not let ``head.proj`` sneak back in through ``"*"``.
4. Inside a trap, every parameter is offloadable except those whose path matches an exclude pattern or that
   belong to an excluded (by name or class) submodule.
5. Parameter-level patterns: a name glob that matches a *parameter* path (but not its module's path) makes the
   module that directly owns that parameter a trap — unless an outer trap already covers it — and only the
   parameters of that subtree matched by a name include pattern are offloadable (``["*.weight"]`` offloads
   weights and keeps biases resident).
6. Parameters owned directly by the root are never offloaded (there is no trap around them).

A module reachable under several paths (a shared submodule) is visited once, under its first path in
``named_modules`` order; a parameter reachable from several traps is decided later (used by more than one trap
means it stays resident).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

__all__ = ["Pattern", "PatternSet", "TrapSpec", "parse_pattern", "select_traps", "class_names"]


@dataclass(frozen=True)
class Pattern:
    """One parsed pattern entry: ``kind`` is ``"name"`` or ``"class"``; ``glob`` the fnmatch glob."""

    kind: str
    glob: str
    regex: re.Pattern[str] = field(compare=False, repr=False)

    def matches_name(self, path: str) -> bool:
        return self.kind == "name" and self.regex.fullmatch(path) is not None

    def matches_class(self, module: nn.Module) -> bool:
        if self.kind != "class":
            return False
        return any(self.regex.fullmatch(n) is not None for n in class_names(module))


def class_names(module: nn.Module) -> tuple[str, str]:
    """The two names a ``class:`` pattern is tested against: short and fully qualified."""
    cls = type(module)
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def parse_pattern(entry: str) -> Pattern:
    """Parse ``"<glob>"``, ``"name:<glob>"`` or ``"class:<glob>"``; other prefixes are a ``ValueError``."""
    if not isinstance(entry, str) or not entry:
        raise ValueError(f"pattern {entry!r} must be a non-empty string ('<glob>', 'name:<glob>' or 'class:<glob>')")
    kind, sep, glob = entry.partition(":")
    if not sep:
        kind, glob = "name", entry
    elif kind not in ("name", "class"):
        raise ValueError(f"pattern {entry!r} has unknown prefix {kind + ':'!r}; use 'name:', 'class:' or none")
    if not glob:
        raise ValueError(f"pattern {entry!r} has an empty glob")
    # fnmatch.translate gives "any sequence" semantics for '*' across dots, which is what the pattern syntax documents.
    return Pattern(kind, glob, re.compile(fnmatch.translate(glob)))


@dataclass
class TrapSpec:
    """A selected trap: its label (module path, or a manual block name), the module (None for a manual
    ``offload_block``), and the parameters it may offload as ``(full parameter path, Parameter)``."""

    label: str
    module: nn.Module | None
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return [name for name, _ in self.params]


class PatternSet:
    """Parsed include/exclude lists with the selection rules of the module docstring."""

    def __init__(self, include: Sequence[str] = ("*",), exclude: Sequence[str] = ()) -> None:
        self.include = [parse_pattern(p) for p in include]
        self.exclude = [parse_pattern(p) for p in exclude]

    # -- single tests ------------------------------------------------------------------------------------------
    def _module_included(self, path: str, module: nn.Module) -> bool:
        return any(p.matches_name(path) or p.matches_class(module) for p in self.include)

    def _module_excluded(self, path: str, module: nn.Module) -> bool:
        return any(p.matches_name(path) or p.matches_class(module) for p in self.exclude)

    def _param_name_included(self, path: str) -> bool:
        return any(p.matches_name(path) for p in self.include)

    def _param_excluded(self, path: str) -> bool:
        return any(p.matches_name(path) for p in self.exclude)

    # -- selection ---------------------------------------------------------------------------------------------
    def select_traps(self, model: nn.Module) -> list[TrapSpec]:
        """Ordered traps (module tree order) for ``model``; see the module docstring for the rules."""
        traps: list[TrapSpec] = []
        visited: set[int] = {id(model)}
        # Trap parameter lists carry each parameter's canonical (first) model-wide name, so a tied weight has
        # one identity everywhere (state files, residency decisions), whatever path matched it.
        self._canon = canonical_param_names(model)
        for child_name, child in model.named_children():
            self._walk(child, child_name, visited, traps)
        return traps

    def _walk(self, module: nn.Module, path: str, visited: set[int], traps: list[TrapSpec]) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
        if self._module_excluded(path, module):
            return  # rule 3: the whole subtree is out
        if self._module_included(path, module):
            traps.append(TrapSpec(path, module, self._subtree_params(module, path, name_filter=False)))
            return
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if any(self._param_name_included(f"{path}.{n}") and not self._param_excluded(f"{path}.{n}") for n in own):
            params = self._subtree_params(module, path, name_filter=True)
            if params:
                traps.append(TrapSpec(path, module, params))
                return
        for child_name, child in module.named_children():
            self._walk(child, f"{path}.{child_name}", visited, traps)

    def _subtree_params(self, module: nn.Module, path: str, *, name_filter: bool) -> list[tuple[str, nn.Parameter]]:
        """Offloadable parameters of a trap's subtree (rule 4; rule 5 when ``name_filter``)."""
        excluded_prefixes: list[str] = []
        for sub_name, sub in module.named_modules(remove_duplicate=False):
            if sub_name and self._module_excluded(f"{path}.{sub_name}", sub):
                excluded_prefixes.append(sub_name + ".")
        result: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for rel, param in module.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            if any(rel.startswith(prefix) for prefix in excluded_prefixes):
                continue
            full = f"{path}.{rel}"
            if self._param_excluded(full):
                continue
            if name_filter and not self._param_name_included(full):
                continue
            seen.add(id(param))
            result.append((self._canon.get(id(param), full), param))
        return result


def select_traps(model: nn.Module, include: Iterable[str] = ("*",), exclude: Iterable[str] = ()) -> list[TrapSpec]:
    """Convenience wrapper: ``PatternSet(include, exclude).select_traps(model)``."""
    return PatternSet(list(include), list(exclude)).select_traps(model)


def canonical_param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its first name`` in ``named_parameters`` order (the name state files use)."""
    return {id(p): n for n, p in model.named_parameters()}


def is_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"
