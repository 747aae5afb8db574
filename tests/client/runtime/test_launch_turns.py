"""Registration calls and a launching thread take turns (flextensor.runtime.launch_turns): real threads, with
each side's progress observed through events."""

from __future__ import annotations

import threading

from flextensor.runtime.launch_turns import LaunchTurns


def _register_on_a_thread(turns: LaunchTurns, inside: threading.Event, leave: threading.Event) -> threading.Thread:
    def run() -> None:
        with turns.registration():
            inside.set()
            assert leave.wait(10)

    thread = threading.Thread(target=run, name="test-register")
    thread.start()
    return thread


def test_no_registration_starts_while_the_turn_is_held_and_one_starts_once_it_is_given_back():
    turns = LaunchTurns()
    turns.open()
    turns.take()
    turns.take()  # held already: returns at once
    inside, leave = threading.Event(), threading.Event()
    leave.set()
    thread = _register_on_a_thread(turns, inside, leave)
    assert not inside.wait(0.2) and turns.held
    turns.give()
    assert inside.wait(10)
    thread.join(10)
    assert not thread.is_alive() and not turns.held


def test_taking_the_turn_waits_for_the_registration_in_flight():
    turns = LaunchTurns()
    turns.open()
    inside, leave = threading.Event(), threading.Event()
    thread = _register_on_a_thread(turns, inside, leave)
    assert inside.wait(10)
    taken = threading.Event()
    taker = threading.Thread(target=lambda: (turns.take(), taken.set()), name="test-launch")
    taker.start()
    assert not taken.wait(0.2)  # the registration in flight ends first
    leave.set()
    assert taken.wait(10)
    taker.join(10)
    thread.join(10)
    # Held by the launching side now: the next registration waits for it.
    inside2, leave2 = threading.Event(), threading.Event()
    leave2.set()
    second = _register_on_a_thread(turns, inside2, leave2)
    assert not inside2.wait(0.2)
    turns.give()
    assert inside2.wait(10)
    second.join(10)


def test_closing_frees_every_waiter_and_makes_both_sides_free():
    turns = LaunchTurns()
    assert turns.closed  # nothing to take turns with yet: taking costs nothing
    turns.take()
    assert not turns.held
    turns.open()
    turns.take()
    inside, leave = threading.Event(), threading.Event()
    leave.set()
    thread = _register_on_a_thread(turns, inside, leave)
    assert not inside.wait(0.2)
    turns.close()  # e.g. the staging thread was cancelled while a launch held the turn
    assert inside.wait(10)
    thread.join(10)
    turns.take()
    assert turns.closed and not turns.held
    turns.give()  # not held: nothing to do


def test_the_warm_loader_holds_the_turn_from_a_trap_s_copy_to_its_exit_and_not_past_a_preload():
    """A stream-mode copy takes the turn and the trap's exit (unload) gives it back; a resident preload, which no
    trap's exit follows, gives it back itself."""
    import torch

    from flextensor.runtime.warm_loader import WarmLoader

    turns = LaunchTurns()
    turns.open()
    weights = [torch.randn(4), torch.randn(4)]
    loader = WarmLoader(torch.device("cpu"), same_device_copies=weights)
    loader.turns = turns
    loader.load(weights)
    assert turns.held and loader.copies == 2
    loader.unload()
    assert not turns.held
    resident = WarmLoader(torch.device("cpu"), keep=True, same_device_copies=weights)
    resident.turns = turns
    assert resident.preload(weights) and resident.copies == 2
    assert not turns.held
    turns.close()
