"""bench_runtime's zero-overhead bound: the pipeline schedule it times the swarm against,
checked on hand-worked cases (one worker per stage, free transfers, forwards first)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_runtime import pipeline_schedule  # noqa: E402


def test_one_stage_runs_its_tasks_back_to_back():
    assert pipeline_schedule([0.0], [2.0], 4) == 8.0


def test_two_stages_by_hand():
    # stage 0: F0 [0,1], F1 [1,2]; stage 1 (forward+backward): mb0 [1,4], mb1 [4,7];
    # stage 0 backward: mb0 [4,6], mb1 [7,9]
    assert pipeline_schedule([1.0, 0.0], [2.0, 3.0], 2) == 9.0


@pytest.mark.parametrize("m, span", [(1, 5.0), (3, 8.0)])
def test_three_stages_forwards_first_by_hand(m, span):
    # m = 3: stage 1 runs F2 at t=3 before B0 (forwards first), then B0-B2 at 4-7, stage 0's
    # backwards follow each at 5-6, 6-7, 7-8.
    assert pipeline_schedule([1.0, 1.0, 0.0], [1.0, 1.0, 1.0], m) == span


def test_bounds_of_any_schedule():
    fwd, bwd, m = [0.7, 1.3, 0.0], [1.9, 2.2, 3.1], 6
    span = pipeline_schedule(fwd, bwd, m)
    busy = [m * (f + b) for f, b in zip(fwd[:-1], bwd[:-1], strict=True)] + [m * bwd[-1]]
    assert max(busy) <= span <= sum(busy)
