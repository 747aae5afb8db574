"""SharedOffloadSession: real worker processes, SIGKILL, and nothing left in /dev/shm or the lock directory."""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import flextensor as ft
from flextensor.shm.errors import ShmProtocolError
from flextensor.shm.names import journal_path, manager_namespace
from tests.helpers.forkserver import ForkedProcess, spawn_module
from tests.leftovers import shm_names
from tests.helpers.models import (
    DEVICE,
    cpu_config,
    reference,
    tiny_transformer,
    token_ids,
    TinyTransformer,
    errors_on_another_thread,
)

REPO = Path(__file__).resolve().parents[3]
LEASE = 1.0


# ------------------------------------------------------------------------------------------------ helpers
def make_profile(directory: Path) -> str:
    """Profile the tiny transformer once (every block streams) and save it: what a deployment ships."""
    model = tiny_transformer(seed=0)
    cfg = cpu_config(include_patterns=["blocks.*"], load_strategy=ft.NthLayerStrategy(1))
    ft.offload(model, cfg, name="profiler")
    manager = ft.get_offload_manager("profiler")
    with torch.no_grad():
        for _ in range(manager.iters_before_inference):
            model(token_ids().to(DEVICE))
    ft.save_profile(str(directory), name="profiler")
    ft.release("profiler")
    return str(directory)


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One saved profile per module (profiling is in-process and touches no shared memory; no test changes it)."""
    return make_profile(tmp_path_factory.mktemp("session") / "profile")


@functools.cache
def _plain_output() -> torch.Tensor:
    return reference(tiny_transformer(seed=0), token_ids()).cpu()


def expected_output() -> torch.Tensor:
    """The plain model's output for ``token_ids()`` (computed once per run; each caller gets its own copy)."""
    return _plain_output().clone()


def spawn(ns: str, profile: str, *args: str, fresh: bool = False) -> subprocess.Popen | ForkedProcess:
    """A session worker (tests/helpers/session_worker.py) with text pipes: forked with torch already imported
    (tests/helpers/forkserver.py), or a fresh interpreter with ``fresh``."""
    return spawn_module("tests.helpers.session_worker", ["--ns", ns, "--profile", profile, "--lease", str(LEASE),
                                                         *args], cwd=REPO, fresh=fresh)


def read_result(proc: subprocess.Popen, timeout: float = 90.0) -> dict:
    """The worker's JSON line (it may still be running when --hold was given)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"worker {proc.pid} printed nothing within {timeout} s"
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise AssertionError(f"worker {proc.pid} exited {proc.returncode} without a result:\n{proc.stderr.read()}")
    return json.loads(line)


def release(proc: subprocess.Popen | ForkedProcess) -> None:
    """Send the line a ``--hold`` worker waits for (a worker that already exited is left alone)."""
    if proc.poll() is None:
        try:
            proc.stdin.write("\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass


def finish(proc: subprocess.Popen | ForkedProcess, timeout: float = 60.0) -> int:
    release(proc)
    proc.wait(timeout=timeout)
    proc.stdout.close()
    proc.stderr.close()
    try:
        proc.stdin.close()  # flushes the "\n" above, which a worker killed meanwhile never reads
    except BrokenPipeError:
        pass
    return proc.returncode


def finish_all(procs: list[subprocess.Popen | ForkedProcess], timeout: float = 60.0) -> list[int]:
    """``finish`` for every worker, released together so that they close (and exit) side by side."""
    for proc in procs:
        release(proc)
    return [finish(proc, timeout) for proc in procs]


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear within {timeout} s"
        time.sleep(0.02)


def wait_for_joined(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Block until the worker logged that it joined as a follower (read from its stderr)."""
    end = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if ready:
            line = proc.stderr.readline()
            seen += line
            if "as follower" in line or "waiting for the creator" in line:
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"worker {proc.pid} never reported joining as a follower:\n{seen}")


def output_of(result: dict) -> torch.Tensor:
    assert "error" not in result, result
    return torch.frombuffer(bytearray.fromhex(result["out"]), dtype=torch.float32).reshape(expected_output().shape)


def matches(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return torch.equal(out, ref) if DEVICE.type == "cpu" else torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ workers
@pytest.mark.parametrize("workers, rounds", [(4, 2)])  # 4 at once; the second round reuses the namespace
def test_workers_share_one_copy_with_exactly_one_creator_and_equal_outputs(namespace: str, profile: str,
                                                                             workers: int, rounds: int) -> None:
    """All start at once; each round ends with every worker closed, so the next round reuses the namespace."""
    ref = expected_output()
    for _ in range(rounds):
        procs = [spawn(namespace, profile, "--hold") for _ in range(workers)]
        try:
            results = [read_result(p) for p in procs]
        finally:
            codes = finish_all(procs)
        assert codes == [0] * workers, results
        roles = sorted(r["role"] for r in results)
        assert roles == ["creator"] + ["follower"] * (workers - 1)
        assert len({r["generation"] for r in results}) == 1
        for r in results:
            assert matches(output_of(r), ref)
            # a CUDA worker (creator or follower) registers its block mappings in the background; its first
            # forward waited for them
            assert r["registered"] is (True if DEVICE.type == "cuda" else None)
        assert shm_names(manager_namespace(namespace, "model")) == []  # the last one out removed it all


def test_creator_factory_failure_reaches_every_follower(namespace: str, profile: str, tmp_path: Path) -> None:
    marker = tmp_path / "creator-started"
    go = tmp_path / "fail-now"
    creator = spawn(namespace, profile, "--mode", "fail", "--marker", str(marker), "--go", str(go))
    wait_for_file(marker)
    followers = [spawn(namespace, profile, "--log") for _ in range(2)]
    for follower in followers:
        wait_for_joined(follower)
    go.write_text("go")
    results = [read_result(p) for p in [creator, *followers]]
    for p in [creator, *followers]:
        finish(p)
    assert results[0]["error"] == "RuntimeError" and "shard 3 is truncated" in results[0]["message"]
    for r in results[1:]:
        assert r["error"] == "ShmCreatorFailedError", r
        assert "shard 3 is truncated" in r["message"]


def finish_after_creator_kill(namespace: str, creator: subprocess.Popen, follower: subprocess.Popen | None) -> None:
    """Reap a hanging creator (killed here when the test failed before its kill: its factory would sleep for an
    hour) and its follower, and reclaim the dead creator's generation, which stays on the host until someone
    does."""
    if creator.poll() is None:
        creator.kill()
    for proc in [follower, creator]:
        if proc is not None:
            finish(proc)
    ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=10)


def test_creator_killed_before_publishing_is_seen_as_dead_within_the_lease(namespace: str, profile: str,
                                                                          tmp_path: Path) -> None:
    """Killed once the follower waits with its model built: its error comes within the lease. (While the
    follower's factory still runs, the death is raised when the factory returns: the caller's code is never
    interrupted, and a first model built on ``meta`` imports torch._dynamo, seconds on a GPU host.)"""
    marker, built = tmp_path / "creator-started", tmp_path / "follower-built"
    creator = spawn(namespace, profile, "--mode", "hang", "--marker", str(marker))
    stacks = tmp_path / "follower-stacks.txt"  # its threads' stacks, 5 times a second: where a slow wait spent its time
    follower = None
    try:
        wait_for_file(marker)
        follower = spawn(namespace, profile, "--log", "--stacks-file", str(stacks), "--built-marker", str(built))
        wait_for_joined(follower)
        wait_for_file(built)
        creator.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        result = read_result(follower)
        elapsed = time.monotonic() - killed
        follower.wait(timeout=60)
        log = follower.stderr.read()  # its log lines, each with the ms since it started
    finally:
        finish_after_creator_kill(namespace, creator, follower)
    assert result["error"] == "ShmCreatorDiedError", result
    assert elapsed < LEASE + 2.0, \
        f"follower noticed the dead creator after {elapsed:.2f} s (lease {LEASE} s); its log:\n{log}\n" \
        f"its threads' stacks are in {stacks}"


def test_a_creator_killed_while_the_follower_builds_is_reported_once_its_factory_returns(
        namespace: str, profile: str, tmp_path: Path) -> None:
    """The follower's factory (the caller's code) is never interrupted: the death its thread saw meanwhile is
    raised as ShmCreatorDiedError once the factory has returned."""
    marker, building, built = tmp_path / "creator-started", tmp_path / "follower-building", tmp_path / "built"
    go = tmp_path / "factory-may-return"
    creator = spawn(namespace, profile, "--mode", "hang", "--marker", str(marker))
    follower = None
    try:
        wait_for_file(marker)
        follower = spawn(namespace, profile, "--factory-marker", str(building), "--built-marker", str(built),
                         "--follower-sleep", "60", "--follower-go", str(go))
        wait_for_file(building)
        creator.send_signal(signal.SIGKILL)
        creator.wait(timeout=30)
        time.sleep(0.2)  # the follower's thread polls READY every 10 ms: it sees the death while the factory runs
        go.write_text("go")
        result = read_result(follower)
        assert built.exists()  # the model was built before the error came
    finally:
        finish_after_creator_kill(namespace, creator, follower)
    assert result["error"] == "ShmCreatorDiedError", result


def test_a_follower_that_arrives_before_ready_builds_its_model_while_the_creator_publishes(
        namespace: str, profile: str, tmp_path: Path) -> None:
    """The follower's factory runs while a thread waits for READY, not after it: its model is built before the
    creator (held in its factory until then, 60 s at most) has published, and it attaches with equal outputs once
    READY comes."""
    from flextensor.shm.coordinator import peek_ready

    started, built, go = tmp_path / "creator-started", tmp_path / "follower-built", tmp_path / "publish-now"
    creator = spawn(namespace, profile, "--mode", "slow", "--slow-seconds", "60", "--go", str(go), "--marker",
                    str(started), "--hold")
    procs = [creator]
    try:
        wait_for_file(started)
        procs.append(spawn(namespace, profile, "--built-marker", str(built)))
        wait_for_file(built)  # the follower's factory returned
        assert not peek_ready(manager_namespace(namespace, "model"))  # built while the creator still publishes
        go.write_text("go")
        results = [read_result(p) for p in procs]
    finally:
        codes = finish_all(procs)
    assert codes == [0, 0] and [r["role"] for r in results] == ["creator", "follower"], results
    assert all(matches(output_of(r), expected_output()) for r in results)
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_a_follower_whose_factory_fails_before_ready_stops_waiting_at_once(namespace: str, profile: str,
                                                                          tmp_path: Path) -> None:
    """A follower factory that fails while the thread waits for READY (the creator hangs; the wait timeout is
    60 s) ends the wait: the follower raises the factory's error within seconds, with no thread left behind."""
    started = tmp_path / "creator-started"
    creator = spawn(namespace, profile, "--mode", "hang", "--marker", str(started))
    try:
        wait_for_file(started)
        begin = time.monotonic()
        follower = spawn(namespace, profile, "--follower-fails")
        result = read_result(follower, timeout=30)
        elapsed = time.monotonic() - begin
        assert finish(follower) == 3
    finally:
        creator.send_signal(signal.SIGKILL)
        finish(creator)
    assert result["error"] == "RuntimeError" and "config.json is missing" in result["message"], result
    assert elapsed < 15.0, f"the follower gave up after {elapsed:.1f} s"
    ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=10)
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_late_follower_attaches_after_the_creator_closed(namespace: str, profile: str) -> None:
    creator = spawn(namespace, profile, "--hold")
    first = read_result(creator)
    follower = spawn(namespace, profile, "--hold")
    second = read_result(follower)
    assert finish(creator) == 0
    late = spawn(namespace, profile)
    third = read_result(late)
    assert finish(late) == 0
    assert finish(follower) == 0
    assert [first["role"], second["role"], third["role"]] == ["creator", "follower", "follower"]
    assert first["generation"] == second["generation"] == third["generation"]
    ref = expected_output()
    assert all(matches(output_of(r), ref) for r in (first, second, third))


def test_mismatched_follower_is_refused_by_tensor_name_and_others_are_unaffected(namespace: str,
                                                                                 profile: str) -> None:
    creator = spawn(namespace, profile, "--hold")
    good = read_result(creator)
    bad = spawn(namespace, profile, "--mode", "mismatch")
    refused = read_result(bad)
    finish(bad)
    other = spawn(namespace, profile)
    fine = read_result(other)
    finish(other)
    finish(creator)
    assert refused["error"] == "ValueError"
    assert "embed.weight" in refused["message"] and "follower" in refused["message"]
    assert good["role"] == "creator" and fine["role"] == "follower"
    assert matches(output_of(fine), expected_output())


def test_wait_timeout_expiry_raises_timeout_error(namespace: str, profile: str, tmp_path: Path) -> None:
    marker = tmp_path / "creator-started"
    creator = spawn(namespace, profile, "--mode", "hang", "--marker", str(marker))
    wait_for_file(marker)
    follower = spawn(namespace, profile, "--wait-timeout", "0.3")
    result = read_result(follower)
    finish(follower)
    creator.send_signal(signal.SIGKILL)
    finish(creator)
    assert result["error"] == "TimeoutError", result
    ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=10)


def test_cleanup_after_sigkill_refuses_malformed_state_then_leaves_nothing_and_repeats_as_a_no_op(
        namespace: str, profile: str, caplog: pytest.LogCaptureFixture) -> None:
    """The workers of a generation are SIGKILLed. Cleanup refuses a malformed journal or coordinator header and
    deletes nothing; once both are intact it reclaims everything at once, and a second cleanup is a no-op."""
    procs = [spawn(namespace, profile, "--hold") for _ in range(3)]
    for p in procs:
        read_result(p)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        finish(p)
    ns = manager_namespace(namespace, "model")
    before = shm_names(ns)
    assert before, "the killed workers' segments should still be there"

    journal = journal_path(ns)
    original = journal.read_bytes()
    journal.write_bytes(original + b"{not json\n")
    with pytest.raises(ShmProtocolError):
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=5)
    assert shm_names(ns) == before
    journal.write_bytes(original)
    header = Path("/dev/shm") / f"{ns}.c"
    good_header = header.read_bytes()[:8]
    with open(header, "r+b") as f:
        f.write(b"NOTMAGIC")
    with pytest.raises(ShmProtocolError):
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=5)
    assert shm_names(ns) == before
    with open(header, "r+b") as f:
        f.write(good_header)

    # A wrong manager name finds nothing: a no-op, with a WARNING that says what was looked for.
    with caplog.at_level("WARNING"):
        wrong = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["default"], timeout=0)
    assert wrong[0].generation is None and shm_names(ns) == before
    assert "found nothing to reclaim" in caplog.text and "manager_names=['default']" in caplog.text

    # Killed on this host: their leases are dead at once, so timeout=0 reclaims right away.
    reports = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=0)
    assert reports[0].removed and not shm_names(ns) and reports[0].waited_s < 1
    assert not journal_path(ns).exists()
    again = ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["model"], timeout=0)
    assert again[0].removed == []


# ------------------------------------------------------------------------------------------------ in process
def _factories():
    def creator():
        return tiny_transformer(seed=0)

    def follower():
        with torch.device("meta"):
            return TinyTransformer()

    return creator, follower


def test_in_process_creator_keeps_config_and_closes_clean(namespace: str, profile: str) -> None:
    config = cpu_config()
    before = config.to_dict()
    creator, follower = _factories()
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=config, name="model",
                                             creator_model_factory=creator, follower_model_factory=follower)
        with torch.no_grad():
            out = model(token_ids().to(DEVICE)).cpu()
        assert session.role("model") == "creator"
        assert matches(out, expected_output())
        with pytest.raises(RuntimeError, match="reserved"):
            ft.SharedOffloadSession(namespace, lease_seconds=LEASE).offload_from_profile(
                profile, config=config, name="model", creator_model_factory=creator, follower_model_factory=follower)
    assert config.to_dict() == before and config.shm_enabled is False
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_close_with_preserve_models_keeps_the_model_usable(namespace: str, profile: str) -> None:
    creator, follower = _factories()
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                         creator_model_factory=creator, follower_model_factory=follower)
    session.close(preserve_models=True)
    assert shm_names(manager_namespace(namespace, "model")) == []
    with torch.no_grad():
        out = model.to(DEVICE)(token_ids().to(DEVICE)).cpu()
    assert matches(out, expected_output())


def test_session_used_from_another_thread_raises(namespace: str, profile: str) -> None:
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    creator, follower = _factories()
    errors = errors_on_another_thread(lambda: session.offload_from_profile(
        profile, name="model", creator_model_factory=creator, follower_model_factory=follower))
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError) and "thread" in str(errors[0])
    session.close()


@pytest.mark.parametrize("bad", ["", "a/b", "x\x00y", "..", "a" * 500])
def test_validate_options_rejects_bad_namespaces(bad: str) -> None:
    with pytest.raises(ValueError):
        ft.SharedOffloadSession.validate_options(bad)


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf"), "10"])
def test_validate_options_rejects_bad_timeouts(timeout) -> None:
    with pytest.raises(ValueError, match="wait_timeout"):
        ft.SharedOffloadSession.validate_options("run", wait_timeout=timeout)


def test_cleanup_namespace_validates_its_input(namespace: str) -> None:
    with pytest.raises(ValueError, match="list of names"):
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names="model")
    with pytest.raises(ValueError, match="empty"):
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=[])
    with pytest.raises(ValueError):
        ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["a/b"])
    assert ft.SharedOffloadSession.cleanup_namespace(namespace, manager_names=["never-ran"], timeout=0)[0].removed == []


def test_preflight_refuses_a_publish_that_does_not_fit_in_dev_shm(namespace: str, profile: str,
                                                                  tmp_path: Path) -> None:
    """The creator checks /dev/shm before loading anything and publishes the remedy to the followers."""
    data = json.loads((Path(profile) / "profile.json").read_text())
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    data["blocks"][0]["nbytes"] = free + 2**30  # a profile whose first block alone exceeds /dev/shm
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "profile.json").write_text(json.dumps(data))
    loaded: list[bool] = []

    def creator():
        loaded.append(True)
        return tiny_transformer(seed=0)

    _, follower = _factories()
    session = ft.SharedOffloadSession(namespace, lease_seconds=LEASE)
    with pytest.raises(OSError, match=r"--shm-size=\d+g") as err:
        session.offload_from_profile(str(forged), config=cpu_config(), name="model",
                                     creator_model_factory=creator, follower_model_factory=follower)
    assert "hostIPC" in str(err.value) and not loaded, "the checkpoint must not be loaded when it cannot fit"
    session.close()
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_compiled_forward_of_a_shared_model_matches_and_closes_clean(namespace: str, profile: str) -> None:
    """torch.compile over the shared model (dynamo tracing through the traps and the rotating block views)."""
    creator, follower = _factories()
    with ft.SharedOffloadSession(namespace, lease_seconds=LEASE) as session:
        model = session.offload_from_profile(profile, config=cpu_config(), name="model",
                                             creator_model_factory=creator, follower_model_factory=follower)
        compiled = torch.compile(model, backend="eager")
        with torch.no_grad():
            outs = [compiled(token_ids().to(DEVICE)).cpu() for _ in range(3)]
        assert all(matches(out, expected_output()) for out in outs)
    # dynamo keeps weakrefs to the parameters; discarding the model must still release everything
    assert shm_names(manager_namespace(namespace, "model")) == []


def test_follower_close_with_preserve_models_keeps_a_private_working_model(namespace: str, profile: str) -> None:
    creator = spawn(namespace, profile, "--hold")
    assert read_result(creator)["role"] == "creator"
    follower = spawn(namespace, profile, "--preserve")
    first = read_result(follower)
    after = read_result(follower)
    assert finish(follower) == 0
    assert finish(creator) == 0
    assert first["role"] == "follower"
    assert after["views_shared_memory"] is False  # every weight was copied into private storage
    out = torch.frombuffer(bytearray.fromhex(after["out_after_close"]), dtype=torch.float32)
    assert matches(out.reshape(expected_output().shape), expected_output())
