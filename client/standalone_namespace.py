"""A manager's own shared-memory membership: ``shm_enabled`` without a ``SharedOffloadSession``.

The engine asks for its host-block provider through a factory, and shared-memory blocks need a member of the
namespace to own them. A session owns the membership of its workers and hands that owner down (``shm_owner``).
A caller that sets ``OffloadConfig(shm_enabled=True)`` and coordinates the roles itself gets the manager's own
membership instead: the manager's namespace, joined when the engine asks for its first provider and left at
``release()``. Kept apart from the manager, which holds one of these and never a coordinator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from flextensor.configuration.config import OffloadConfig
from flextensor.runtime.host_memory import HostBlockProvider, make_provider

if TYPE_CHECKING:  # pragma: no cover - the shm modules load at the first shared offload, not at import
    from flextensor.shm.coordinator import ShmCoordinator
    from flextensor.shm.owner import ShmOwner

__all__ = ["StandaloneNamespace"]


class StandaloneNamespace:
    """The namespace membership of one manager that shares without a session (see the module docstring)."""

    def __init__(self) -> None:
        self._coordinator: ShmCoordinator | None = None

    def provider_factory(self, manager_name: str, cfg: OffloadConfig, device: torch.device,
                         shm_owner: ShmOwner | None) -> Callable[..., HostBlockProvider]:
        """What the engine calls for its host-block provider: with ``shm_enabled``, the session's owner
        (``shm_owner``) or else this membership's, joined at the first call."""
        def factory(*, register_in_place: bool = False) -> HostBlockProvider:
            owner = shm_owner
            if cfg.shm_enabled and owner is None:
                owner = self.join(manager_name, cfg)
            return make_provider(cfg, device, shm_owner=owner, register_in_place=register_in_place)

        return factory

    def join(self, manager_name: str, cfg: OffloadConfig) -> ShmOwner:
        """The owner of this manager's blocks in ``cfg.shm_namespace``, joining it first unless a member."""
        if self._coordinator is None:
            from flextensor.shm.coordinator import ShmCoordinator
            from flextensor.shm.names import manager_namespace

            assert cfg.shm_namespace is not None
            self._coordinator = ShmCoordinator(manager_namespace(cfg.shm_namespace, manager_name),
                                               timeout=cfg.shm_wait_timeout or None, shm_dir=cfg.shm_dir)
        return self._coordinator.memory_owner

    def leave(self) -> None:
        """Leave the namespace, if a member (the last participant unlinks its names); a no-op otherwise."""
        if self._coordinator is not None:
            try:
                self._coordinator.close()
            finally:
                self._coordinator = None
