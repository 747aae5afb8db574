"""A session's join reclaims what crashed jobs of its user left on the host (``flextensor.shm.dead_sweep``):
no daemon, nobody restarted the crashed job, and the next job of any namespace frees it as it starts."""

from __future__ import annotations

import logging

import pytest
import torch

import flextensor as ft
from flextensor.shm.names import lock_directory, manager_namespace
from tests.client.sharing.test_session import expected_output, make_profile, matches
from tests.daemon.helpers import Worker
from tests.helpers.models import DEVICE, TinyTransformer, cpu_config, tiny_transformer, token_ids
from tests.leftovers import shm_names


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_profile(tmp_path_factory.mktemp("session-sweep") / "profile")


def _crashed_job(base: str, manager: str, *extra: str) -> Worker:
    """A job's only worker (a bare coordinator: tests/daemon/worker.py) that published, then was SIGKILLed."""
    worker = Worker(base, manager, "--lease", "30", "--no-register", *extra)
    worker.wait_event("published")
    worker.kill()
    return worker


def test_the_next_session_of_another_job_reclaims_a_crashed_job(namespace, profile, caplog):
    crashed = manager_namespace(f"{namespace}-old", "llm")
    _crashed_job(f"{namespace}-old", "llm", "--size", str(2 << 20))
    live = Worker(f"{namespace}-live", "llm", "--lease", "30", "--no-register")  # another job, still serving
    live.wait_event("published")
    live_names = shm_names(manager_namespace(f"{namespace}-live", "llm"))
    assert len(shm_names(crashed)) == 2

    def creator():
        return tiny_transformer(seed=0)

    def follower():
        with torch.device("meta"):
            return TinyTransformer()

    with caplog.at_level(logging.WARNING, logger="flextensor.shm.dead_sweep"):
        with ft.SharedOffloadSession(namespace, lease_seconds=1.0) as session:
            model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                                 creator_model_factory=creator, follower_model_factory=follower)
            assert shm_names(crashed) == [] and not (lock_directory() / f"{crashed}.journal").exists()
            with torch.no_grad():
                assert matches(model(token_ids().to(DEVICE)).cpu(), expected_output())
    (record,) = [r for r in caplog.records if crashed in r.getMessage()]
    assert "reclaimed dead namespace" in record.getMessage() and f"{namespace}-old / llm" in record.getMessage()
    assert "2.0 MiB of /dev/shm" in record.getMessage()  # the 2 MiB segment (its 20 KiB coordinator rounds away)
    assert shm_names(manager_namespace(f"{namespace}-live", "llm")) == live_names  # a live job is never swept
    live.close()
    assert shm_names(manager_namespace(namespace, "model")) == []
