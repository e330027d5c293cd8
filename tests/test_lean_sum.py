"""LeanSum: which results a lean local-mode worker's .grad sum counts (hand-written sequences)."""

from __future__ import annotations

import pytest

from shoal.runtime.sync.lean import LeanSum

pytestmark = pytest.mark.timeout(30)


def test_a_step_counts_its_accepted_results_and_clears_once():
    s = LeanSum()
    clear, a = s.begin(0, 5)
    assert clear  # nothing held yet: start from zero
    clear2, b = s.begin(0, 5)
    assert not clear2  # same step, same sum: backward adds into it
    assert s.settle(a, True) and s.settle(b, True)
    assert a.settled and b.settled
    assert s.holds(0, 5)


def test_a_refused_result_spoils_the_step_until_released():
    s = LeanSum()
    _, a = s.begin(0, 5)
    _, b = s.begin(0, 5)
    assert s.settle(a, True)
    assert not s.settle(b, False)  # refused: its gradient is in the sum
    assert not s.holds(0, 5)  # the sum may not be reported
    # a task begun after the spoil starts a fresh sum, but counts nothing of the step yet
    clear, c = s.begin(0, 5)
    assert clear
    assert not s.settle(c, True)
    s.released(0, 5)  # the flush released what the server holds of step 5: redone tasks count
    clear, d = s.begin(0, 5)
    assert clear
    assert s.settle(d, True) and s.holds(0, 5)


def test_a_task_begun_before_a_spoil_does_not_count_after_it():
    s = LeanSum()
    _, a = s.begin(0, 1)
    s.spoil(0, 1)
    s.released(0, 1)
    assert not s.settle(a, True)  # its gradient went into the dropped sum
    assert not s.holds(0, 1)


def test_a_reported_sum_is_not_reported_again_and_the_next_task_clears():
    s = LeanSum()
    _, a = s.begin(0, 2)
    assert s.settle(a, True)
    s.drop()  # reported (pending for the inner step): a new sum starts
    assert not s.holds(0, 2)
    clear, b = s.begin(0, 2)  # a second report of the same step holds only what came after
    assert clear
    assert s.settle(b, True) and s.holds(0, 2)


def test_a_new_step_clears_and_an_old_steps_late_answer_does_not_count():
    s = LeanSum()
    _, a = s.begin(0, 3)
    clear, b = s.begin(0, 4)  # the next step's first backward: the gradients now hold step 4
    assert clear
    assert not s.settle(a, True)  # step 3's gradient was cleared with the sum
    assert s.settle(b, True) and s.holds(0, 4)
