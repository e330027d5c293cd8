"""bench/trace_step.py's per-worker summary, on hand-written trace events."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("trace_step", Path(__file__).parents[1] / "bench" / "trace_step.py")
trace_step = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trace_step)


def _ev(t, who, ev, **kw):
    return {"t": t, "who": who, "ev": ev, **kw}


def test_workers_counts_steps_grants_and_pairs_pushes_in_order():
    ev = [
        _ev(0.0, "s0", "grant", w="w-ab12-w0", step=1, mb=0, d=0),  # before first_step: not counted
        _ev(0.1, "w0", "push_make", step=1),
        _ev(0.2, "w0", "push_ack", step=1),
        _ev(1.0, "s0", "grant", w="w-ab12-w0", step=2, mb=0, d=0),
        _ev(1.1, "s0", "grant", w="w-cd34-w5", step=2, mb=1, d=0),
        _ev(1.2, "s0", "grant", w="w-ab12-w0", step=3, mb=0, d=0),
        _ev(1.3, "w5", "push_make", step=2),
        _ev(1.4, "w5", "push_make", step=2),  # a second push made before the first is acknowledged
        _ev(3.3, "w5", "push_ack", step=2),
        _ev(4.4, "w5", "push_ack", step=2),
        _ev(5.0, "w0", "push_ack", step=3),  # no push made: ignored
    ]
    per = trace_step.workers(ev, first_step=2)
    assert per["w0"]["steps"] == {2, 3} and per["w0"]["grants"] == 2 and per["w0"]["pushes"] == []
    assert per["w5"]["steps"] == {2} and per["w5"]["grants"] == 1
    assert per["w5"]["pushes"] == pytest.approx([2.0, 3.0])
    assert trace_step.workers(ev, first_step=0)["w0"]["pushes"] == pytest.approx([0.1])
