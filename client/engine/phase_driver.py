"""``PhaseDriver``: the current phase handler of one offloaded model, and the calls its patched forwards make.

The manager holds one driver per offloaded model and is the only one that hands it a handler (the first phase
at ``offload()``, SLEEPING at ``sleep()`` and back at ``wake()``); the driver swaps in what ``end_pass``
returns, which is the only phase change during passes (Note [phases and handlers] in ``flextensor.engine.phase``).
It installs the root forward that frames each pass and receives every trap's entry and exit, keeping the one rule
that binds them: traps do not nest, and an exit goes to the handler that received its entry. Kept apart from the
manager so that the manager holds its public methods and their checks, and this dispatch lives in one place.

After :meth:`uninstall` (the manager's teardown) a forward still running finds no handler, as the manager
without a model would: nothing reaches a torn-down context.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn

from flextensor.engine.context import EngineContext
from flextensor.engine.hooks import RootForward, Trap
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.runtime.graph_timing import is_capturing

__all__ = ["PhaseDriver"]


class PhaseDriver:
    """Dispatches one model's passes and trap calls to its current phase handler (see the module docstring)."""

    def __init__(self, ctx: EngineContext, model: nn.Module, check_thread: Callable[[], None]) -> None:
        """Install the root forward of ``model``; ``check_thread`` raises unless a pass runs on the owner's thread."""
        self._ctx: EngineContext | None = ctx
        self._check_thread = check_thread
        self._handler: PhaseHandler | None = None
        self._active: Trap | None = None  # the trap running now, and the handler that received its entry
        self._active_handler: PhaseHandler | None = None
        self._root = RootForward(model, self.begin_pass, self.end_pass)

    @property
    def handler(self) -> PhaseHandler | None:
        """The current phase's handler; ``None`` before the first is handed in and after :meth:`uninstall`."""
        return self._handler

    def switch_to(self, handler: PhaseHandler) -> None:
        """Make ``handler`` the current phase's, between passes (the first phase, sleep, wake)."""
        self._handler = handler

    @property
    def in_pass(self) -> bool:
        """A forward pass of the model is running (the root forward's outermost call)."""
        return bool(self._root.depth)

    def uninstall(self) -> None:
        """Restore the model's own forward and let go of the context and the handler."""
        self._root.uninstall()
        self._ctx = None
        self._handler = self._active = self._active_handler = None

    # ------------------------------------------------------------------------------------------------ passes
    def begin_pass(self) -> None:
        """The root forward, before the model's forward runs."""
        self._check_thread()
        ctx, handler = self._ctx, self._handler
        assert handler is not None and ctx is not None
        if handler.phase is not Phase.INFERENCE and is_capturing(ctx.device):
            raise RuntimeError(
                f"manager {ctx.name!r}: a CUDA graph capture began in phase {handler.phase.value}, whose passes "
                f"synchronize and read events; capture after INFERENCE starts ({ctx.iters_before_inference} eager "
                "forward passes after offload(), then wait_for_host_blocks())"
            )
        handler.begin_pass()

    def end_pass(self, ok: bool) -> None:
        """The root forward, after the model's forward (``ok``: it returned): swaps in the next pass's handler."""
        ctx, handler = self._ctx, self._handler
        assert handler is not None and ctx is not None
        if self._active is not None:  # an exception escaped a trap without its exit (should not happen)
            self._active = self._active_handler = None
            ctx.warm.loader.unload()
        ctx.warm.loader.pass_ended()
        self._handler = handler.end_pass(ok)

    # ------------------------------------------------------------------------------------------------ traps
    def trap_enter(self, trap: Trap) -> None:
        """A trap's forward is about to run: refuse a nested trap, else hand the entry to the current handler."""
        if self._active is not None:
            raise RuntimeError(
                f"trap {trap.label!r} entered while trap {self._active.label!r} is running: traps cannot nest (an "
                "offload_block around a patched module, or a trap module called from inside another trap); change "
                "include_patterns or where offload_block is used"
            )
        ctx, handler = self._ctx, self._handler
        assert handler is not None and ctx is not None
        self._active, self._active_handler = trap, handler
        try:
            handler.enter(trap)
        except BaseException:
            ctx.warm.loader.unload()
            self._active = self._active_handler = None
            self._end_of_a_trap_outside_a_pass()
            raise

    def trap_exit(self, trap: Trap) -> None:
        """A trap's forward returned or raised: the exit goes to the handler that received the entry."""
        if self._active is not trap:
            return
        handler = self._active_handler
        try:
            assert handler is not None
            handler.exit(trap)
        finally:
            self._active = self._active_handler = None
            self._end_of_a_trap_outside_a_pass()

    def _end_of_a_trap_outside_a_pass(self) -> None:
        """A trap called outside the model's forward (a submodule called directly, as ``generate`` calls an
        encoder) has no pass end to give the launches' turn back: its exit does."""
        if self._ctx is not None and not self._root.depth:
            self._ctx.warm.loader.pass_ended()

    @contextmanager
    def block(self, block_name: str) -> Iterator[None]:
        """A manual trap labelled ``block_name`` around the caller's code (``OffloadManager.offload_block``): made
        at its first use, its tensors found during DISCOVERY like a module trap's."""
        if not isinstance(block_name, str) or not block_name:
            raise ValueError(f"offload_block needs a non-empty block name, got {block_name!r}")
        ctx = self._ctx
        assert ctx is not None
        trap = ctx.traps.get(block_name)
        if trap is None:
            trap = Trap(block_name, None, [], kind="block")
            ctx.traps[block_name] = trap
        elif trap.kind != "block":
            raise ValueError(f"offload_block({block_name!r}) clashes with the module trap of the same label; "
                             "rename the block")
        self.trap_enter(trap)
        try:
            yield
        finally:
            self.trap_exit(trap)
