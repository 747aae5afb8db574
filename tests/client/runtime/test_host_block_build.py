"""The hand-over of a trap's tensors from their originals to their filled host block (``SourceHandover``): it
waits for a call of that trap in flight, and gives up instead of waiting for a caller that waits for the build."""

from __future__ import annotations

import threading

from flextensor.runtime.host_block_build import SourceHandover


def _hand_over_on_a_thread(handover: SourceHandover, label: str, moved: list[str]) -> tuple[threading.Thread, list]:
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(handover.hand_over(label, lambda: moved.append(label))))
    thread.start()
    return thread, result


def test_a_hand_over_runs_at_once_when_no_call_of_its_trap_is_in_flight():
    handover, moved = SourceHandover(), []
    handover.using("b")  # another trap's call does not matter
    assert handover.hand_over("a", lambda: moved.append("a")) is True and moved == ["a"]


def test_a_hand_over_waits_until_every_call_of_its_trap_ended():
    handover, moved = SourceHandover(), []
    handover.using("a")
    handover.using("a")  # a trap called again inside itself
    thread, result = _hand_over_on_a_thread(handover, "a", moved)
    thread.join(0.1)
    assert thread.is_alive() and moved == []
    handover.done("a")
    thread.join(0.1)
    assert thread.is_alive() and moved == []
    handover.done("a")
    thread.join(10)
    assert not thread.is_alive() and result == [True] and moved == ["a"]


def test_a_hand_over_gives_up_when_the_caller_stops_waiting_for_it():
    handover, moved = SourceHandover(), []
    handover.using("a")
    thread, result = _hand_over_on_a_thread(handover, "a", moved)
    thread.join(0.1)
    assert thread.is_alive()
    handover.stop_waiting()  # the caller's thread waits for the build, from inside a call of "a"
    thread.join(10)
    assert not thread.is_alive() and result == [False] and moved == []
    handover.done("a")
    assert handover.hand_over("a", lambda: moved.append("a")) is True and moved == ["a"]
