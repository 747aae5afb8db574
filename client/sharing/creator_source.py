"""Where a shared session's creator gets its weights: a factory that builds the model in RAM, or a checkpoint read
straight into the shared blocks.

Why it matters for host RAM: the point of one host copy is that the host holds the weights once.

- In RAM (``creator_model_factory``): the model exists in private memory before the shared blocks do. The blocks'
  pages are taken a window ahead of the copy, and each private tensor gives its pages back as its copy advances
  (``flextensor.sharing.publish``), so the creator holds one copy plus the window and a piece, never two.
- From a checkpoint (``checkpoint=``): the model is built with its parameters on ``meta`` (the follower's factory,
  under :func:`flextensor.loading.lazy_init.init_empty_weights`, so buffers the constructor computes stay real) and every
  tensor is read once from the safetensors files into its shared block (or into the resident copy), while the
  next blocks' pages are allocated: nothing else is in RAM.
"""

from __future__ import annotations

import os
import time
import logging
from typing import Callable

from torch import nn

from flextensor.loading.checkpoint import CheckpointWeights, SafetensorsCheckpoint
from flextensor.loading.lazy_init import init_empty_weights, prepare_checkpoint

__all__ = ["CreatorSource"]

logger = logging.getLogger(__name__)


class CreatorSource:
    """The creator's model and its weights (see the module docstring); :meth:`close` after the publish."""

    def __init__(self, factory: Callable[[], nn.Module], checkpoint: str | os.PathLike[str] | None = None, *,
                 strict: bool = True) -> None:
        self.factory = factory
        self.checkpoint = checkpoint
        self.strict = strict
        self.weights: CheckpointWeights | None = None

    @property
    def in_ram(self) -> bool:
        """True when the factory loads the weights into private memory (the arena's pages come as it fills)."""
        return self.checkpoint is None

    def build(self) -> nn.Module:
        if self.checkpoint is None:
            model = self.factory()
            _check_module(model, "creator_model_factory")
            return model
        t0 = time.monotonic()
        checkpoint = SafetensorsCheckpoint(self.checkpoint)  # headers only; a truncated file is refused here
        with init_empty_weights():
            model = self.factory()
        _check_module(model, "the model factory")
        self.weights = prepare_checkpoint(model, checkpoint, strict=self.strict,
                                          label=f"checkpoint {str(self.checkpoint)!r}")
        logger.info("checkpoint %s: %d tensors (%.1f MiB) matched to the model in %.2f s; reading them into the "
                    "shared blocks", self.checkpoint, len(self.weights), checkpoint.nbytes / 2**20,
                    time.monotonic() - t0)
        return model

    def close(self) -> None:
        if self.weights is not None:
            self.weights.close()


def _check_module(model: object, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} returned {type(model).__name__}, not an nn.Module")
