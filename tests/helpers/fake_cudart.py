"""A recording stand-in for the cudart calls of ``flextensor.runtime.pinned.in_place``, so its bookkeeping runs without CUDA."""

from __future__ import annotations

from flextensor.runtime.pinned.in_place import PinnedStaging


class FakeCudart:
    """Records register/unregister/synchronize calls in order; optionally fails the n-th call of a kind."""

    def __init__(self, fail_register_at: int | None = None, fail_unregister: set[int] | None = None) -> None:
        self.calls: list[tuple] = []
        self.live: dict[int, int] = {}
        self.fail_register_at = fail_register_at
        self.fail_unregister = fail_unregister or set()

    def register(self, ptr: int, nbytes: int) -> None:
        if self.fail_register_at is not None and len(self.registers) + 1 == self.fail_register_at:
            raise RuntimeError("cudaHostRegister failed: cudaErrorMemoryAllocation (2)")
        assert ptr not in self.live, "registered twice"
        self.calls.append(("register", ptr, nbytes))
        self.live[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, f"unregister of {ptr:#x}, which is not registered (twice?)"
        del self.live[ptr]
        self.calls.append(("unregister", ptr))
        if ptr in self.fail_unregister:
            raise RuntimeError("cudaHostUnregister failed")

    def synchronize(self) -> None:
        self.calls.append(("sync",))

    @property
    def registers(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "register"]

    @property
    def unregisters(self) -> list[int]:
        return [c[1] for c in self.calls if c[0] == "unregister"]

    def staging(self, **kwargs) -> PinnedStaging:
        return PinnedStaging(register=self.register, unregister=self.unregister, synchronize=self.synchronize,
                             is_pinned=lambda s: False, **kwargs)


def inject_staging(monkeypatch, staging) -> None:
    """The next offload's engine uses ``staging`` (a recorded PinnedStaging) for its warm-up registrations."""
    import flextensor.engine.context as context_mod

    monkeypatch.setattr(context_mod, "PinnedStaging", lambda: staging)
