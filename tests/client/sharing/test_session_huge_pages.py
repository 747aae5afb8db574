"""A shared session whose segments live on a tmpfs mounted ``huge=always`` (``FT_SHM_DIR``).

Each test runs its workers in a private mount namespace (``tests/helpers/huge_mount.py``, root only; skipped
elsewhere with the reason): names, leases, the journal, ``ftd ls``, crash cleanup and the directory check work
there as in ``/dev/shm``, and nothing is left in the directory, in ``/dev/shm`` or in the lock directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flextensor.shm.names import manager_namespace

from tests.client.sharing.test_session import make_profile
from tests.helpers.models import DEVICE
from tests.helpers.huge_mount import run_mounted

NOTHING = {"dir": [], "dev_shm": [], "lock_dir": []}


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_profile(tmp_path_factory.mktemp("huge") / "profile")


def test_creator_and_follower_share_one_copy_on_huge_pages(tmp_path: Path, profile: str,
                                                           request: pytest.FixtureRequest) -> None:
    token = request.node.ft_token
    directory = str(tmp_path / "huge")
    report = run_mounted("tmpfs", tmp_path / "huge", "session", token, profile)
    assert report["errors"] == [] and report["roles"] == ["creator", "follower"] and report["same_output"]
    tensors = report["tensors"]
    assert tensors["offloaded"] > 0 and tensors["loader"] is (DEVICE.type == "cuda")
    if DEVICE.type == "cpu":  # computed in place: every offloaded tensor views the shared blocks
        assert tensors["offloaded_in_shm"] == tensors["offloaded"]
    # (on CUDA they stream from those blocks: the arena's segments in the directory, below)
    ns = manager_namespace(f"t-{token}", "model")
    held = report["held"]
    assert f"{ns}.c" in held["dir"] and any(name.startswith(f"{ns}.g1.h") for name in held["dir"])
    assert held["dev_shm"] == []  # every segment in the directory asked for, none in /dev/shm
    assert report["journal_dirs"] == [directory]
    (row,) = report["ls"]
    assert (row["shm_dir"], row["page_size"], row["pages"]) == (directory, 2 << 20, "2 MiB pages (tmpfs huge=always)")
    assert row["participants"] == 2 and row["state"] == "READY"
    assert f"segments in {directory}, 2 MiB pages (tmpfs huge=always)" in report["creator_log"]  # INFO, at the join
    assert "WARNING" not in report["creator_log"]
    assert report["codes"] == [0, 0] and report["left"] == NOTHING


def test_a_killed_job_on_huge_pages_is_reclaimed_by_ftd_cleanup_dead_from_its_journal(
        tmp_path: Path, profile: str, request: pytest.FixtureRequest) -> None:
    token = request.node.ft_token
    report = run_mounted("tmpfs", tmp_path / "huge", "crash", token, profile)
    ns = manager_namespace(f"t-{token}", "model")
    assert report["roles"] == ["creator", "follower"]
    assert report["after_kill"]["dir"] == report["held"]["dir"] and f"{ns}.c" in report["after_kill"]["dir"]
    assert report["cleanup_code"] == 0, report["cleanup_stderr"]
    (reclaimed,) = report["cleanup"]["reclaimed"]
    assert reclaimed["namespace"] == ns
    # every segment the killed job held in the directory, found from the journal alone (no FT_SHM_DIR given)
    assert {name[1:] for name in reclaimed["removed"] if "/" not in name[1:]} == set(report["held"]["dir"])
    assert reclaimed["shm_bytes"] > 0 and reclaimed["shm_bytes"] % (2 << 20) == 0  # whole huge pages
    assert report["left"] == NOTHING


def test_a_worker_configured_for_another_directory_is_refused_naming_both(
        tmp_path: Path, profile: str, request: pytest.FixtureRequest) -> None:
    token = request.node.ft_token
    directory = str(tmp_path / "huge")
    report = run_mounted("tmpfs", tmp_path / "huge", "mismatch", token, profile)
    assert report["creator"] == "creator" and report["creator_code"] == 0
    refused = report["refused"]
    assert refused["error"] == "ValueError"
    assert f"served from segments in {directory}" in refused["message"] and "/dev/shm" in refused["message"]
    assert "FT_SHM_DIR" in refused["message"]
    assert report["left"] == NOTHING
