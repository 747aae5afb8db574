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
:func:`skip_frames` defers the same way.

Note [engine steps outside compiled graphs]
-------------------------------------------
The patched forwards (``flextensor.engine.hooks``) call the engine at every pass start and end and at every
trap entry and exit: a thread check, phase bookkeeping, the loader's parameter swaps and stream orderings,
the install of host blocks built on a thread. None of it is tensor math, and traced by dynamo it breaks graphs
(``threading.get_ident`` is not traceable), recompiles (``tensor.data = view`` per parameter) or, when a copy
into a rotating device block lands in a graph whose inputs are parameters viewing that block with other dtypes,
fails in aot_autograd ("input mutations on views with different dtypes"). So dynamo never compiles those
forwards (:func:`skip_frames`: their frames run as plain Python, the frames they call are still compiled): under ``torch.compile(model)`` the root forward runs the engine's pass start, then the
model's own ``forward`` is compiled as the top frame, with no graph break for the engine's per-pass work. A
trap module's call is where dynamo stops a graph (it cannot inline a skipped function): the trap's body is then
compiled as a frame of its own, one graph per unit, which identical layers share. A skipped frame that calls
into the engine while a compiled region is running (:func:`dynamo_active`) calls it through
:func:`call_eagerly`, so dynamo does not try to compile the engine's frames either; outside compiled code the
engine is called directly (a ``torch.compiler.disable`` wrapper costs microseconds per call).

Note [no compiled code under the usage recorder]
------------------------------------------------
A DISCOVERY pass runs with the usage recorder, a ``TorchFunctionMode`` whose state changes with every
parameter it sees (``flextensor.runtime.usage_recorder``). Dynamo traces a frame run under a mode into the mode,
and guards on the mode's state; some torch releases (2.11 among them) also build those guards with the mode
active, so the recorder updates its usage map while dynamo reads it and the frame fails its own guard check
("Guard failed on the same frame it was created ... ``___get_torch_function_mode_stack_at(0).usage``"). A graph traced
there would not be reused anyway: it guards on the recorder and on the trap it was recording for. So an
*eager region* (:func:`begin_eager_region`, held by the DISCOVERY handler from the start of its pass to its
end, per thread) has the patched forwards run the model's own code, never compiled code: a ``torch.compile``'d
model's forward runs through :func:`call_eagerly`, and a trap compiled by ``compile_fn`` calls its original
forward. Compilation starts at the first PROFILING pass. What a model compiled itself inside a trap, or a
model outside any trap, is not covered: nothing compiled by the user may run during DISCOVERY on such torch
releases.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import weakref
from types import ModuleType
from typing import Any, Callable, Sequence

__all__ = ["disable_compile", "skip_frames", "dynamo_active", "call_eagerly", "begin_eager_region",
           "end_eager_region", "in_eager_region"]

_DYNAMO = "torch._dynamo"
_lock = threading.RLock()
_pending: list[tuple[Any, str]] = []  # (owner, attribute name) still to wrap
_pending_skips: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()  # functions whose frames dynamo must skip
_callback: Callable[[], Any] | None = None  # torch._C._dynamo.eval_frame.get_eval_frame_callback, once imported
_disabled_call: Callable[..., Any] | None = None  # torch.compiler.disable(_call), once imported
# .depth: the eager regions open on this thread (Note [no compiled code under the usage recorder])
_eager = threading.local()


def disable_compile(owner: Any, names: Sequence[str]) -> None:
    """Wrap ``owner.<name>`` for each of ``names`` with ``torch.compiler.disable``, now or once dynamo is imported."""
    with _lock:
        _pending.extend((owner, name) for name in names)
        _schedule()


def skip_frames(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Have dynamo run ``fn``'s own frames as plain Python, still compiling what ``fn`` calls (Note [engine steps
    outside compiled graphs]); now or once dynamo is imported. Returns ``fn`` (usable as a decorator)."""
    with _lock:
        _pending_skips.add(fn)  # held weakly: a model released before dynamo is imported leaves nothing behind
        _schedule()
    return fn


def dynamo_active() -> bool:
    """Whether a ``torch.compile``'d region is running on this thread (dynamo's frame callback is set).

    Called from a skipped frame (:func:`skip_frames`), where it answers for the code around it. False until
    ``torch._dynamo`` is imported: nothing can be compiled before."""
    callback = _callback
    if callback is None:
        return False
    current = callback()
    return current is not None and current is not False


def call_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with dynamo off for everything it calls (``torch.compiler.disable``; a function
    compiled on its own still compiles); call it only when :func:`dynamo_active`, since the wrapper costs
    microseconds."""
    disabled = _disabled_call
    if disabled is None:
        return fn(*args, **kwargs)
    return disabled(fn, *args, **kwargs)


def begin_eager_region() -> None:
    """From now until the matching :func:`end_eager_region`, this thread's patched forwards run no compiled code
    (Note [no compiled code under the usage recorder]). Regions nest."""
    _eager.depth = getattr(_eager, "depth", 0) + 1


def end_eager_region() -> None:
    """Close the innermost :func:`begin_eager_region` of this thread."""
    depth = getattr(_eager, "depth", 0)
    if depth <= 0:
        raise RuntimeError("end_eager_region() without a matching begin_eager_region() on this thread")
    _eager.depth = depth - 1


def in_eager_region() -> bool:
    """Whether an eager region is open on this thread."""
    return getattr(_eager, "depth", 0) > 0


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _schedule() -> None:
    if _DYNAMO in sys.modules:
        _apply()
    elif not any(isinstance(finder, _DynamoImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DynamoImportHook())


def _apply() -> None:
    global _callback, _disabled_call
    import torch
    from torch._dynamo.decorators import skip

    with _lock:
        if _disabled_call is None:
            _disabled_call = torch.compiler.disable(_call)
            try:
                from torch._C._dynamo.eval_frame import get_eval_frame_callback
            except ImportError:  # an older binding without the getter: assume a compiled region may be running
                _callback = lambda: True  # noqa: E731
            else:
                _callback = get_eval_frame_callback
        while _pending:
            owner, name = _pending.pop()
            setattr(owner, name, torch.compiler.disable(getattr(owner, name)))
        for fn in list(_pending_skips):
            skip(fn)
        _pending_skips.clear()


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
