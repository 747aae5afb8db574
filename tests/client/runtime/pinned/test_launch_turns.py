"""Registration calls and a launching thread take turns (flextensor.runtime.pinned.launch_turns): real threads, with
each side's progress observed through events. Every helper thread is a daemon and every wait is bounded, so a
broken turn fails the test instead of hanging it."""

from __future__ import annotations

import threading
import time

import torch

from flextensor.runtime.pinned.launch_turns import LaunchTurns
from flextensor.runtime.loaders.warm_loader import WarmLoader


def _on_a_thread(target, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _register_on_a_thread(turns: LaunchTurns, inside: threading.Event, leave: threading.Event,
                          outcome: list[str]) -> threading.Thread:
    def run() -> None:
        with turns.registration():
            inside.set()
            outcome.append("left" if leave.wait(10) else "never told to leave")

    return _on_a_thread(run, "test-register")


def _take_on_a_thread(turns: LaunchTurns) -> threading.Event:
    """take() on a launching thread of its own; the event is set once it returned."""
    taken = threading.Event()
    _on_a_thread(lambda: (turns.take(), taken.set()), "test-launch")
    return taken


def _a_registration_waits_for_the_turn_given_back(turns: LaunchTurns) -> None:
    """With the turn held: a registration does not start until the turn is given back, then it runs through."""
    inside, leave, outcome = threading.Event(), threading.Event(), []
    leave.set()
    thread = _register_on_a_thread(turns, inside, leave, outcome)
    assert not inside.wait(0.2) and turns.held
    turns.give()
    assert inside.wait(10)
    thread.join(10)
    assert not thread.is_alive() and outcome == ["left"] and not turns.held


def test_no_registration_starts_while_the_turn_is_held_and_one_starts_once_it_is_given_back():
    turns = LaunchTurns()
    turns.open()
    turns.take()
    turns.take()  # held already: returns at once
    try:
        _a_registration_waits_for_the_turn_given_back(turns)
    finally:
        turns.close()


def test_taking_the_turn_waits_for_the_registration_in_flight_and_then_holds_it():
    turns = LaunchTurns()
    turns.open()
    inside, leave, outcome = threading.Event(), threading.Event(), []
    thread = _register_on_a_thread(turns, inside, leave, outcome)
    try:
        assert inside.wait(10)
        taken = _take_on_a_thread(turns)
        assert not taken.wait(0.2)  # the registration in flight ends first
        leave.set()
        assert taken.wait(10) and turns.held
        thread.join(10)
        assert outcome == ["left"]
        _a_registration_waits_for_the_turn_given_back(turns)  # held by the launching side now
    finally:
        turns.close()


def test_a_turn_given_back_by_another_thread_while_it_is_taken_is_asked_for_again():
    """A thread that waits for the registration gives the turn back, possibly while the launching thread is
    still waiting in take(): take() asks again, so it returns once the call in flight ends, holding the turn
    (had it not, registrations starting back to back could keep it waiting to the end)."""
    turns = LaunchTurns()
    turns.open()
    inside, leave, outcome = threading.Event(), threading.Event(), []
    first = _register_on_a_thread(turns, inside, leave, outcome)
    try:
        assert inside.wait(10)
        taken = _take_on_a_thread(turns)
        assert not taken.wait(0.1)
        turns.give()  # e.g. the host-block build joining the staging thread
        assert not taken.wait(0.1)  # the call in flight still runs
        leave.set()
        assert taken.wait(10) and turns.held
        first.join(10)
        assert outcome == ["left"]
        _a_registration_waits_for_the_turn_given_back(turns)  # held: no registration starts
    finally:
        turns.close()


def test_closing_frees_every_waiter_and_makes_both_sides_free():
    turns = LaunchTurns()
    assert turns.closed  # nothing to take turns with yet: taking costs nothing
    turns.take()
    assert not turns.held
    turns.open()
    turns.take()
    inside, leave, outcome = threading.Event(), threading.Event(), []
    leave.set()
    thread = _register_on_a_thread(turns, inside, leave, outcome)
    assert not inside.wait(0.2)
    turns.close()  # e.g. the staging thread was cancelled while a launch held the turn
    assert inside.wait(10)
    thread.join(10)
    assert outcome == ["left"]
    turns.take()
    assert turns.closed and not turns.held
    turns.give()  # not held: nothing to do


def test_the_warm_loader_holds_the_turn_from_a_trap_s_copy_past_its_exit_for_a_slice(monkeypatch):
    """A stream-mode copy takes the turn; the trap's exit (unload) keeps it for the next trap's launches until it
    was held for LAUNCH_SLICE_S, then gives it back; the end of the pass gives it back whatever the time. A
    preload takes it too and leaves it to its caller, which gives it back after the events that time the
    copies."""
    import flextensor.runtime.pinned.launch_turns as launch_turns

    monkeypatch.setattr(launch_turns, "LAUNCH_SLICE_S", 0.05)
    turns = LaunchTurns()
    turns.open()
    weights = [torch.randn(4), torch.randn(4)]
    loader = WarmLoader(torch.device("cpu"), same_device_copies=weights)
    loader.turns = turns
    loader.load(weights)
    assert turns.held and loader.copies == 2
    loader.unload()
    assert turns.held  # within the slice: the next trap launches in the same turn
    loader.load(weights)
    loader.unload()
    loader.pass_ended()
    assert not turns.held
    loader.load(weights)
    time.sleep(0.06)
    loader.unload()
    assert not turns.held  # held past the slice: given back at the trap's exit
    resident = WarmLoader(torch.device("cpu"), keep=True, same_device_copies=weights)
    resident.turns = turns
    assert resident.preload(weights) and resident.copies == 2 and turns.held
    turns.give()
    turns.close()


def test_traps_launch_in_one_turn_while_a_registration_waits_and_it_runs_once_the_turn_is_given(monkeypatch):
    """A registration waiting for the turn does not start between two traps inside the slice; it starts once the
    slice is over at a trap's exit, or at the end of the pass."""
    import flextensor.runtime.pinned.launch_turns as launch_turns

    weights = [torch.randn(4)]
    for end in ("slice", "pass"):
        turns = LaunchTurns()
        turns.open()
        loader = WarmLoader(torch.device("cpu"), same_device_copies=weights)
        loader.turns = turns
        monkeypatch.setattr(launch_turns, "LAUNCH_SLICE_S", 0.3 if end == "slice" else 60.0)
        try:
            loader.load(weights)
            inside, leave, outcome = threading.Event(), threading.Event(), []
            leave.set()
            thread = _register_on_a_thread(turns, inside, leave, outcome)
            loader.unload()
            loader.load(weights)  # the next trap: the turn is still held, no drain
            assert not inside.wait(0.1) and turns.held
            if end == "slice":
                time.sleep(0.3)
                loader.unload()
            else:
                loader.unload()
                assert not inside.wait(0.1)
                loader.pass_ended()
            assert inside.wait(10)
            thread.join(10)
            assert not thread.is_alive() and outcome == ["left"] and not turns.held
        finally:
            turns.close()  # a failed assert above leaves no thread waiting for the turn
