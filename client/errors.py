"""Named exceptions of the offload engine (those of shared memory are in ``flextensor.shm.errors``).

Each subclasses the builtin a caller would catch and names the fix in its message.
"""

from __future__ import annotations

__all__ = ["ModelAsleepError"]


class ModelAsleepError(RuntimeError):
    """A forward pass (or a call that needs the model's device memory) reached a model that is asleep
    (``ft.sleep(name)``): its device memory is freed; ``ft.wake(name)`` brings it back."""
