"""The phases of an offload and the handler protocol that runs each one.

Note [phases and handlers]
--------------------------
An offloaded model goes DISCOVERY -> PROFILING -> INFERENCE (adoption of a profile or state starts in
INFERENCE; ``skip_discovery`` starts in PROFILING); from INFERENCE, ``sleep()`` and ``wake()`` go to SLEEPING
and back, between passes. Each phase is a :class:`PhaseHandler` holding the
:class:`~flextensor.engine.context.EngineContext`. The manager is the one owner of the current handler, which
its :class:`~flextensor.engine.phase_driver.PhaseDriver` holds and the manager alone replaces between passes:

- the patched root forward calls ``begin_pass()`` before a pass and ``end_pass(ok)`` after it; ``end_pass``
  returns the handler for the next pass (itself, or the next phase's), and the driver swaps it in. That is
  the only place a phase changes during passes;
- each trap's patched forward calls ``enter(trap)`` / ``exit(trap)``; the driver sends ``exit`` to the handler
  that received the matching ``enter``, even if the phase changed in between (it never does inside a pass).

A handler is a plain object with no hold on the manager: it receives the context (or an immutable plan) and
returns the next handler, so each phase's code lives in one module and imports only the phases after it.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.context import EngineContext
    from flextensor.engine.hooks import Trap

__all__ = ["Phase", "PhaseHandler"]


class Phase(enum.Enum):
    DISCOVERY = "discovery"
    PROFILING = "profiling"
    INFERENCE = "inference"
    SLEEPING = "sleeping"  # INFERENCE with the device memory freed (Note [sleep and wake] in flextensor.engine.sleep)


class PhaseHandler:
    """One phase's behaviour at pass and trap boundaries (see Note [phases and handlers])."""

    phase: Phase

    def __init__(self, ctx: EngineContext) -> None:
        self.ctx = ctx

    def begin_pass(self) -> None:
        """Before the model's forward runs."""

    def end_pass(self, ok: bool) -> PhaseHandler:
        """After the forward (``ok``: it returned without raising); returns the handler for the next pass."""
        return self

    def enter(self, trap: Trap) -> None:
        """Before a trap's forward (raising refuses the call; ``exit`` then does not run)."""

    def exit(self, trap: Trap) -> None:
        """After a trap's forward, also when it raised."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.ctx.name!r})"
