"""Two independent jobs on one host, same model, different namespaces: they never meet, and one job's crash
(SIGKILL of all its workers) and cleanup (``cleanup_namespace``) leave the other serving correct outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.shm import manager_namespace
from tests.examples.conftest import plain_tokens, tiny_args

pytest.importorskip("transformers")

from shared_generate import MANAGER, make_profile  # noqa: E402


def shm_entries(namespace: str) -> list[str]:
    compact = manager_namespace(namespace, MANAGER)
    return sorted(n for n in os.listdir("/dev/shm") if compact in n)


@pytest.mark.slow
def test_two_jobs_isolated_crash_and_cleanup_of_one_leaves_the_other(namespace: str, tmp_path: Path, jobs) -> None:
    profile = tmp_path / "profile"
    args = tiny_args(8, profile=profile)
    make_profile(args, torch.device("cpu"), profile)
    expected = plain_tokens(args, [0, 1])
    argv = ["--tiny-llama", "8", "--profile", str(profile)]
    job_a, job_b = f"{namespace}-a", f"{namespace}-b"

    a = [jobs.start(job_a, i, argv) for i in range(2)]
    b = [jobs.start(job_b, i, argv) for i in range(2)]
    ready = {(job, w.index): w.read(timeout=90) for job, ws in ((job_a, a), (job_b, b)) for w in ws}

    # Same model, same manager name: were the jobs to see each other, there would be one creator in all.
    for job in (job_a, job_b):
        roles = sorted(ready[(job, i)]["role"] for i in range(2))
        assert roles == ["creator", "follower"], f"{job}: {roles}"
        assert ready[(job, 0)]["generation"] == ready[(job, 1)]["generation"]
        for i in range(2):
            assert ready[(job, i)]["tokens"] == expected[i]
    names_a, names_b = shm_entries(job_a), shm_entries(job_b)
    assert names_a and names_b and not set(names_a) & set(names_b)
    assert manager_namespace(job_b, MANAGER) not in " ".join(names_a)

    # Job A crashes: every worker SIGKILLed, nothing closed. Its supervisor (here, the test) reclaims it.
    for w in a:
        w.kill()
    assert shm_entries(job_a) == names_a, "a SIGKILL closes nothing: A's segments stay until reclaimed"
    reports = ft.SharedOffloadSession.cleanup_namespace(job_a, manager_names=[MANAGER], timeout=30)
    assert reports[0].removed and reports[0].generation == ready[(job_a, 0)]["generation"]
    assert shm_entries(job_a) == []
    assert shm_entries(job_b) == names_b, "cleaning up job A touched job B"

    # Job B still serves, from the same shared copy, with correct outputs; then it closes cleanly.
    for w in b:
        w.send("generate")
    for w in b:
        assert w.read(timeout=60)["tokens"] == expected[w.index]
    assert [w.close() for w in b] == [0, 0]
    assert shm_entries(job_b) == []
