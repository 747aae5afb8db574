"""The package's house rules that a grep can check, kept true by the suite.

- A private name (one leading underscore) is private to its module: no module imports another's, and none
  reaches into another module's objects for one (``obj._x`` where ``_x`` is defined only elsewhere in the
  package). A helper two modules need is public in the module that owns its idea, or lives next to its caller.
- Docstrings and comments give the timeless reason; dated measurements, machine names and rates measured on a
  machine belong in ``docs/benchmarks.md``, with the date and the machine.
- The layers of ``docs/design.md``: ``flextensor.shm`` imports nothing of the client or the daemon, and the
  daemon imports ``flextensor.shm`` and itself only.

The scan reads the source of every module under ``client/``, ``shm/`` and ``daemon/`` (the three source folders of
``flextensor``); nothing is imported.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("client", "shm", "daemon")

#: What belongs to a machine and a day, not to the code: a date, a GPU or host name, a rate measured somewhere.
FIGURE = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\b(?:H100|H200|A100|B200|L40S?)\b"  # a GPU
    r"|\bCPU VM\b|\bthe VM\b|\b\d+-core\b|\bgVisor\b"  # a host
    r"|\d\s?(?:GB/s|GiB/s|MB/s|ms/GiB)"  # a rate
)

#: Modules whose docstrings or comments still quote figures inline: their figures move to docs/benchmarks.md
#: with the date and the machine. Each entry must still match (``test_figure_exemptions_still_apply``), so the
#: list only shrinks.
FIGURES_NOT_YET_MOVED: frozenset[str] = frozenset()

#: ``obj._x`` reaches that stay until their owner offers a public name for them; each must still occur, so the
#: list only shrinks.
REACHES_NOT_YET_PUBLIC: frozenset[tuple[str, str]] = frozenset()


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text(), filename=str(path))
            for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, module or class variables, attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if _private(name)}


def private_imports() -> list[str]:
    """``from <a flextensor module> import _name`` anywhere in the package, as 'path:line: statement'."""
    found = []
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("flextensor")):
                for alias in node.names:
                    if _private(alias.name):
                        found.append(f"{path}:{node.lineno}: from {'.' * node.level}{node.module or ''} import "
                                     f"{alias.name}")
    return found


def private_reaches() -> set[tuple[str, str]]:
    """``(path, 'obj._x')`` for each reach into a private name that another module of the package defines.

    ``self``, ``cls`` and ``super()`` are the module's own objects; a name the module defines itself is its own.
    Private names of torch's tensors and modules (``tensor._base``, ``module._parameters``) are torch's API to
    its subclasses and hooks, not another module's of ours, so they are left out."""
    defined = {path: _defined_private_names(tree) for path, tree in MODULES.items()}
    ours = set().union(*defined.values()) - {name for name in dir(torch.Tensor) + dir(torch.nn.Module)}
    found = set()
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if node.attr in ours and node.attr not in defined[path]:
                found.add((path, ast.unparse(node)))
    return found


def _docs_and_comments(path: str) -> list[tuple[int, str]]:
    """(line, text) of every string statement (module, class, function and attribute docstrings) and comment."""
    source = (ROOT / path).read_text()
    out = [(node.lineno, node.value.value) for node in ast.walk(MODULES[path])
           if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    out += [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT]
    return out


def figures(path: str) -> list[str]:
    """Figures tied to a machine or a day in a module's docstrings and comments, as 'path:line: match'."""
    found = []
    for line, text in _docs_and_comments(path):
        for offset, text_line in enumerate(text.splitlines()):
            for match in FIGURE.finditer(text_line):
                found.append(f"{path}:{line + offset}: {match.group(0)!r} in {text_line.strip()!r}")
    return found


#: What each source folder may import of the package, by module name prefix.
LAYERS = {"shm": ("flextensor.shm",), "daemon": ("flextensor.shm", "flextensor.daemon")}


def imports_across_layers(modules: dict[str, ast.Module] = MODULES) -> list[str]:
    """Imports of a package module that the importing module's layer may not use, as 'path:line: module'."""
    found = []
    for path, tree in modules.items():
        allowed = LAYERS.get(path.split("/")[0])
        if allowed is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if (name == "flextensor" or name.startswith("flextensor.")) and not any(
                        name == prefix or name.startswith(prefix + ".") for prefix in allowed):
                    found.append(f"{path}:{node.lineno}: {name}")
    return found


def test_shm_and_the_daemon_import_only_their_layers() -> None:
    assert imports_across_layers() == []


def test_no_module_imports_another_modules_private_name() -> None:
    assert private_imports() == []


def test_no_module_reaches_into_another_modules_private_name() -> None:
    assert private_reaches() - REACHES_NOT_YET_PUBLIC == set()


def test_reach_exemptions_still_apply() -> None:
    assert REACHES_NOT_YET_PUBLIC - private_reaches() == set(), "remove these from REACHES_NOT_YET_PUBLIC"


@pytest.mark.parametrize("path", sorted(set(MODULES) - FIGURES_NOT_YET_MOVED))
def test_docstrings_and_comments_carry_no_dated_figures(path: str) -> None:
    assert figures(path) == []


def test_figure_exemptions_still_apply() -> None:
    assert [path for path in sorted(FIGURES_NOT_YET_MOVED) if not figures(path)] == [], \
        "these modules carry no figures any more: remove them from FIGURES_NOT_YET_MOVED"


def test_the_scan_finds_what_it_looks_for() -> None:
    """The patterns and the walk themselves, on text made to match (the real modules should match nothing)."""
    assert FIGURE.findall("8.7 GB/s on the H200 host, 2026-11-30; 63 ms/GiB on the 2-core CPU VM") == [
        "7 GB/s", "H200", "2026-11-30", "3 ms/GiB", "2-core", "CPU VM"]
    assert not FIGURE.search("a copy at the link's rate; GB/s in a log format: %.2f GB/s; 2 GiB; H2D")
    tree = ast.parse("from flextensor.x import _y, z\nfrom .w import _v\nimport flextensor.q as q\nq._r\nself._s")
    assert [_private(a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names] == [
        True, False, True]
    assert _defined_private_names(ast.parse("class _A:\n    _b = 1\n    def _c(self):\n        self._d = 2")) == {
        "_A", "_b", "_c", "_d"}
    layered = {"shm/a.py": ast.parse("from flextensor.shm.b import c\nfrom . import d\nimport flextensor.runtime.heap"),
               "daemon/e.py": ast.parse("from flextensor.daemon.f import g\nfrom flextensor import offload"),
               "client/h.py": ast.parse("from flextensor.daemon import i")}
    assert imports_across_layers(layered) == ["shm/a.py:3: flextensor.runtime.heap", "daemon/e.py:2: flextensor"]
