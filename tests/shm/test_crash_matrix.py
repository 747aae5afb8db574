"""The crash matrix without a daemon: creator, follower or everyone SIGKILLed before, during and after publish,
and jobs restarted right after (well within the lease). Same host and pid namespace: a dead process is seen
dead at once, so nothing is left behind, followers learn of a dead creator within 2 s, and a restart works
the first time. Leases are 30 s on purpose: nothing here may wait for one to run out."""

from __future__ import annotations

import time

import pytest

from flextensor.shm.cleanup import cleanup_manager_namespace
from flextensor.shm.coordinator import ShmCoordinator
from flextensor.shm.names import lock_directory, manager_namespace
from tests.leftovers import shm_names

LONG = 30.0  # nothing in these tests may wait for a lease


@pytest.fixture
def ns(namespace: str) -> str:
    return manager_namespace(namespace, "crash")


def lock_files() -> list[str]:
    return sorted(p.name for p in lock_directory().iterdir())


def assert_nothing_left(ns: str) -> None:
    assert shm_names(ns) == [] and lock_files() == []


def _publish(creator, ns: str) -> None:
    creator.ok("segment", kind="sd", size=1 << 16)
    creator.ok("write_blob", kind="sm", data=b"manifest".hex())
    creator.ok("lock", kind="b0", backend="semaphore")
    creator.ok("lock", kind="b0", backend="file")
    creator.ok("ready")


def test_creator_killed_after_ready_survivors_close_and_remove_everything(ns, children):
    creator, *followers = children(3)
    assert creator.ok("open", ns=ns, lease=LONG)["is_creator"]
    _publish(creator, ns)
    for f in followers:
        f.ok("open", ns=ns, lease=LONG)
        f.ok("wait", timeout=5)
    creator.kill()
    for f in followers:
        f.ok("close", timeout=5)
    assert_nothing_left(ns)  # the last survivor did not count the dead creator's unexpired lease


def test_follower_killed_mid_attach_others_close_and_remove_everything(ns, children):
    creator, victim, other = children(3)
    creator.ok("open", ns=ns, lease=LONG)
    victim.ok("open", ns=ns, lease=LONG)  # joined, never attached
    _publish(creator, ns)
    other.ok("open", ns=ns, lease=LONG)
    other.ok("wait", timeout=5)
    victim.kill()
    creator.ok("close", timeout=5)
    other.ok("close", timeout=5)
    assert_nothing_left(ns)


@pytest.mark.parametrize("when", ["before_publish", "during_publish", "after_publish"])
def test_everyone_killed_then_restarted_within_the_lease(ns, children, when):
    first = children(3)
    creator, *followers = first
    assert creator.ok("open", ns=ns, lease=LONG)["is_creator"]
    for f in followers:
        f.ok("open", ns=ns, lease=LONG)
    if when == "during_publish":
        creator.ok("segment", kind="sd", size=1 << 16)
        creator.ok("lock", kind="b0", backend="file")
    elif when == "after_publish":
        _publish(creator, ns)
    for p in first:
        p.kill()
    start = time.monotonic()
    second = children(3)
    roles = [p.ok("open", ns=ns, lease=LONG, timeout=10) for p in second]
    assert time.monotonic() - start < 2 + 10  # no lease wait (10 s is the children's start-up budget)
    assert sorted(r["is_creator"] for r in roles) == [False, False, True]
    assert {r["generation"] for r in roles} == {2}  # generation 1 was reclaimed, not joined
    new_creator = second[[r["is_creator"] for r in roles].index(True)]
    _publish(new_creator, ns)
    for p in second:
        if p is not new_creator:
            p.ok("wait", timeout=5)
    for p in second:
        p.ok("close", timeout=5)
    assert_nothing_left(ns)


def test_followers_learn_of_a_dead_creator_within_2s(ns, children):
    creator, *followers = children(3)
    creator.ok("open", ns=ns, lease=LONG)
    for f in followers:
        f.ok("open", ns=ns, lease=LONG)
        f.send("wait", timeout=20)
    time.sleep(0.2)  # inside wait_for_ready()
    creator.kill()
    for f in followers:
        reply = f.recv(10)
        assert reply["error"] == "ShmCreatorDiedError", reply
        assert reply["elapsed"] < 0.2 + 2.0
        assert "start the workers again" in reply["message"]
        f.ok("close", timeout=5)
    assert_nothing_left(ns)


def test_restart_while_followers_of_a_dead_creator_are_still_there_creates_a_new_generation(ns, children):
    """A job restarted at once after its creator died while loading: the restarted worker does not join the
    doomed INITIALIZING generation (which would fail it), it waits for the old followers to leave."""
    creator, old = children(2)
    creator.ok("open", ns=ns, lease=LONG)
    old.ok("open", ns=ns, lease=LONG)
    creator.kill()
    (new,) = children(1)
    new.send("open", ns=ns, lease=LONG, timeout=10)  # the old follower still holds a live lease
    time.sleep(0.3)
    old.send("wait_close", timeout=20)  # like a session: wait, fail, leave
    reply = old.recv(10)
    assert reply["error"] == "ShmCreatorDiedError" and reply["elapsed"] < 2.0, reply
    opened = new.recv(10)
    assert opened["ok"] and opened["is_creator"], opened  # not a follower of the doomed generation
    new.ok("close", timeout=5)
    assert_nothing_left(ns)


def test_cleanup_with_timeout_zero_right_after_sigkill_of_every_worker(ns, children):
    creator, *followers = children(3)
    creator.ok("open", ns=ns, lease=LONG)
    _publish(creator, ns)
    for f in followers:
        f.ok("open", ns=ns, lease=LONG)
        f.ok("wait", timeout=5)
    for p in (creator, *followers):
        p.kill()
    report = cleanup_manager_namespace(ns, timeout=0)
    assert report.generation == 1 and report.waited_s < 0.5
    assert_nothing_left(ns)


def test_a_live_participant_still_keeps_the_generation(ns, children):
    """The other side of the rule: a running process keeps counting however its lease is set."""
    (alive,) = children(1)
    alive.ok("open", ns=ns, lease=LONG)
    with ShmCoordinator(ns, lease_seconds=LONG) as me:
        assert not me.is_creator
    assert shm_names(ns) == [f"{ns}.c"]
    with pytest.raises(TimeoutError, match="still hold live leases"):
        cleanup_manager_namespace(ns, timeout=0)
    alive.ok("close", timeout=5)
    assert_nothing_left(ns)
