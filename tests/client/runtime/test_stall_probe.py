"""The stall probe: which passes it samples, and what a sampled pass reports (CPU clock)."""

from __future__ import annotations

import time

from flextensor.runtime.stall_probe import FIRST_SAMPLED, SAMPLE_EVERY, StallProbe


def test_samples_the_first_passes_then_one_in_every_few():
    probe = StallProbe(use_cuda=False)
    sampled = []
    for i in range(1, 3 * SAMPLE_EVERY + 1):
        probe.begin_pass()
        if probe.sampling:
            sampled.append(i)
    assert sampled == [*range(1, FIRST_SAMPLED + 1), SAMPLE_EVERY, 2 * SAMPLE_EVERY, 3 * SAMPLE_EVERY]


def test_a_sampled_pass_reports_its_synchronous_copies_against_its_span():
    probe = StallProbe(use_cuda=False)
    probe.begin_pass()
    probe.add_cpu_wait(0.004)
    time.sleep(0.01)
    probe.end_pass(None)
    (stall,) = probe.poll()
    assert stall.wait_ms == 4.0
    assert stall.span_ms >= 14.0  # from the first copy's start to the pass's end
    assert probe.poll() == []  # read once


def test_quiet_samples_nothing_for_that_many_passes_and_forgets_pending_ones():
    probe = StallProbe(use_cuda=False)
    probe.begin_pass()
    probe.add_cpu_wait(0.001)
    probe.end_pass(None)
    probe.quiet(5)
    assert probe.poll() == []
    seen = []
    for _ in range(5 + FIRST_SAMPLED):
        probe.begin_pass()
        seen.append(probe.sampling)
    assert seen == [False] * 5 + [True] * FIRST_SAMPLED


def test_an_unsampled_pass_records_nothing():
    probe = StallProbe(use_cuda=False)
    for _ in range(FIRST_SAMPLED):
        probe.begin_pass()
        probe.end_pass(None)
    probe.poll()
    probe.begin_pass()  # pass FIRST_SAMPLED + 1: not sampled
    assert not probe.sampling
    probe.add_cpu_wait(1.0)
    probe.end_pass(None)
    assert probe.poll() == []
