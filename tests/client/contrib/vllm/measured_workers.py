"""Worker classes for the vLLM tests' engines: vLLM's own and flextensor's, each recording the process's PSS at
the start of ``load_model`` so that a test can sum what loading the model added (``pss_before_load_kib``).

Imported by vLLM inside an engine process (``worker_cls="tests.client.contrib.vllm.measured_workers.X"``), never
by pytest: it imports vLLM, which lives in the vLLM venv only.
"""

from __future__ import annotations

import os
from typing import Any

from flextensor.contrib.vllm.worker import FlexTensorOffloadWorker, PlatformWorker
from flextensor.contrib.vllm.worker_v2 import FlexTensorOffloadWorkerV2


def pss_kib(pid: int | str = "self") -> int:
    """Proportional set size of a process (kB, from ``/proc/<pid>/smaps_rollup``)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


class PssBeforeLoad:
    """Records the PSS at the start of ``load_model``."""

    pss_before_load: int | None = None

    def load_model(self, **kwargs: Any) -> None:
        self.pss_before_load = pss_kib()
        super().load_model(**kwargs)  # type: ignore[misc]

    def pss_before_load_kib(self) -> dict[str, int | None]:
        return {"pid": os.getpid(), "pss_before_load_kib": self.pss_before_load}


class MeasuredPlainWorker(PssBeforeLoad, PlatformWorker):  # type: ignore[misc, valid-type]
    """vLLM's own worker for this platform."""


class MeasuredFlexWorker(PssBeforeLoad, FlexTensorOffloadWorker):
    """flextensor's worker, one private copy."""


class MeasuredFlexWorkerV2(PssBeforeLoad, FlexTensorOffloadWorkerV2):
    """flextensor's sharing worker."""
