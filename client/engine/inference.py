"""The INFERENCE phase: the block loader makes each trap's block resident and prefetches the next.

At a trap's entry the loader waits for that trap's block (issued at the previous trap's entry) and issues the
copy of the next block in the schedule on its side stream; at the exit it lets the block's slot be reused once
the compute that read it has run (``flextensor.runtime.loaders.block_loader``). A trap that streams nothing and is not timed
calls its module's forward directly (``Trap.bypass``), without this handler.

The host blocks may still be being built on a thread when INFERENCE starts (``flextensor.engine.build``): the
first inference pass starts that thread, and the first pass that begins after it finished installs its blocks
and the loader. Until then the model runs resident (after a resident warm-up) or the warm loader copies each
streamed trap's weights per call, as in PROFILING (after a stream-mode one), and offload timing records nothing.

Between passes the plan may change (Note [replanning] in ``flextensor.engine.replan``): a replan measures a few
passes with every trap timed, plans on a thread and installs the new streaming set at a pass's start.

A pass captured into a CUDA graph takes no replan step, and needs its host blocks built (Note [loader under
CUDA-graph capture] in ``flextensor.runtime.loaders.block_loader``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flextensor.engine import replan
from flextensor.engine.build import install_deferred
from flextensor.engine.phase import Phase, PhaseHandler
from flextensor.runtime.graph_timing import is_capturing

if TYPE_CHECKING:  # pragma: no cover
    from flextensor.engine.hooks import Trap

__all__ = ["InferenceHandler"]


class InferenceHandler(PhaseHandler):
    """Streams offloaded traps' blocks through the loader (see the module docstring)."""

    phase = Phase.INFERENCE
    _captured = False  # this pass is being captured into a CUDA graph (Note [loader under CUDA-graph capture])

    def begin_pass(self) -> None:
        ctx = self.ctx
        self._captured = capturing = is_capturing(ctx.device)
        build = ctx.inference.deferred
        if build is not None:
            if capturing:
                raise RuntimeError(
                    f"manager {ctx.name!r}: a CUDA graph capture began while the host blocks are still being built "
                    "behind resident inference (the graph would read device copies the build then frees); call "
                    "wait_for_host_blocks() on the manager before capturing"
                )
            if not build.started:  # the first inference pass: host blocks build behind it from now
                build.start()
            elif build.done:  # host blocks ready: stream from this pass on
                install_deferred(ctx)
        if ctx.inference.deferred is not None:  # passes before the switch stream nothing: no timing, no replan
            return
        if capturing:  # no replan step: it reads events and may rebuild the loader (flextensor.runtime.loaders.block_loader)
            replanning = ctx.inference.replan
            if replanning.state == "in_progress" and not replanning.manual:
                raise RuntimeError(
                    f"manager {ctx.name!r}: a CUDA graph capture began while a strategy replan is in progress (it "
                    "installs a new plan at a coming pass, and a captured graph would keep reading the old one); "
                    "run eager passes until strategy_replan_status's state is 'done', or set the manager's "
                    "allow_strategy_replan = False before the warm-up, then capture"
                )
            if ctx.inference.loader is not None:
                ctx.inference.loader.begin_pass(capturing=True)
            if ctx.timing is not None:
                ctx.timing.begin_pass()
            return
        replan.begin_pass(ctx)
        if ctx.inference.loader is not None:
            ctx.inference.loader.begin_pass()
        timing = replan.measuring_timing(ctx)
        if timing is not None and not ctx.inference.replan.measuring:  # a measured pass began in begin_pass
            timing.begin_pass()

    def end_pass(self, ok: bool) -> PhaseHandler:
        ctx = self.ctx
        if ctx.inference.deferred is not None:
            return self
        if ctx.inference.loader is not None:
            ctx.inference.loader.end_pass()
        if ctx.timing is not None and not ctx.inference.replan.measuring:
            ctx.timing.end_pass()
        if not self._captured:
            replan.end_pass(ctx)
        return self

    def enter(self, trap: Trap) -> None:
        ctx = self.ctx
        inference = ctx.inference
        plan = inference.deferred_plan
        if plan is not None and plan.copied:  # no host blocks yet, after a stream-mode warm-up: copy per call
            tensors = plan.copied.get(trap.label)
            if tensors:
                assert plan.handover is not None
                plan.handover.using(trap.label)  # the build leaves these tensors alone until exit()
                try:
                    ctx.warm.loader.load(tensors)
                except BaseException:
                    ctx.warm.loader.unload()
                    plan.handover.done(trap.label)
                    raise
            return
        timing = replan.measuring_timing(ctx) if inference.deferred is None else None
        if timing is not None:
            timing.begin_trap(trap.label)
        block = inference.block_of.get(trap.label)
        if block is not None:
            assert inference.loader is not None
            inference.loader.enter(block)
        if timing is not None:
            timing.start_compute()

    def exit(self, trap: Trap) -> None:
        ctx = self.ctx
        inference = ctx.inference
        plan = inference.deferred_plan
        if plan is not None and plan.copied:
            ctx.warm.loader.unload()  # the copies enter() made, if any
            if plan.handover is not None and plan.copied.get(trap.label):
                plan.handover.done(trap.label)
            return
        timing = replan.measuring_timing(ctx) if inference.deferred is None else None
        if timing is not None:
            timing.end_trap()
        block = inference.block_of.get(trap.label)
        if block is not None and inference.loader is not None:
            inference.loader.exit(block)
