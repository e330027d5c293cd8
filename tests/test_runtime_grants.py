"""The credit window and take-back decisions (shoal.runtime.pool.grants) on hand-written
event sequences: grant, grant ahead taken back, lease expiry, re-queue, ban, move."""

from __future__ import annotations

import pytest

from shoal.runtime.pool.grants import MAX_CREDIT, GrantBook, credit_window


def test_credit_window():
    assert credit_window(None, None) == 1  # unknown pace: nothing granted ahead
    assert credit_window(0.5, None) == 2
    assert credit_window(0.5, 0.01) == 2  # round trip well under a task: one ahead hides it
    assert credit_window(0.005, 0.012) == 4  # 5 ms tasks, 12 ms round trip: three ahead
    assert credit_window(0.001, 1.0) == MAX_CREDIT
    assert credit_window(0.5, 0.01, local=True) == 1  # local mode never holds a forward ahead


def _paced(book: GrantBook, wid: str, task_s: float) -> None:
    book.grant(1000 + len(book.paces), wid, 0.0, ahead=False)
    book.end(1000 + len(book.paces) - 1, wid, task_s=task_s, idle=True)


def test_a_grant_ahead_is_taken_back_for_a_faster_idle_worker():
    book = GrantBook()
    _paced(book, "slow", 4.0)
    _paced(book, "fast", 1.0)
    assert book.may_grant_ahead("slow") and book.credit("slow") == 2
    book.grant(1, "slow", 10.0, ahead=False)  # slow computes lease 1 from t=10 (until ~14)
    book.start(1, "slow", 10.0)
    book.grant(2, "slow", 10.0, ahead=True)  # and holds lease 2 ahead: it would finish it at ~18
    assert not book.may_grant_ahead("slow")  # its window (2) is full
    assert book.take_back("slow", 11.0) is None  # never from oneself
    # fast goes idle at t=11: it would finish lease 2 at 12, long before slow: taken back
    assert book.take_back("fast", 11.0) == 2
    assert book.ahead == {} and book.taken_back == 1
    assert book.take_back("fast", 11.0) is None  # nothing else to take


def test_a_grant_ahead_stays_with_a_holder_that_finishes_first():
    book = GrantBook()
    _paced(book, "fast", 1.0)
    _paced(book, "slow", 10.0)
    book.grant(1, "fast", 5.0, ahead=False)
    book.start(1, "fast", 5.0)
    book.grant(2, "fast", 5.0, ahead=True)  # fast finishes lease 2 at ~7
    assert book.take_back("slow", 5.5) is None  # slow would finish at 15.5
    # once started, a grant is no longer ahead: it is never taken back
    book.start(2, "fast", 6.0)
    assert book.ahead == {}
    _paced(book, "faster", 0.1)
    assert book.take_back("faster", 6.1) is None


def test_expiry_requeue_and_result_end_a_grant():
    book = GrantBook()
    _paced(book, "a", 2.0)
    _paced(book, "b", 1.0)
    book.grant(1, "a", 0.0, ahead=False)
    book.start(1, "a", 0.0)
    book.grant(2, "a", 0.0, ahead=True)
    book.grant(3, "a", 0.0, ahead=True)
    # lease 2 expired (or was re-queued) at the server: the book forgets it when it looks
    live = {1, 3}
    assert book.take_back("b", 0.5, live=lambda lid: lid in live) == 3
    assert 2 not in book.ahead
    # a result ends a grant and teaches the pace
    book.end(1, "a", task_s=4.0, idle=True)
    assert book.paces["a"].task_s == pytest.approx(0.7 * 2.0 + 0.3 * 4.0)
    assert book.paces["a"].busy_since is None


def test_ban_and_move_return_the_unstarted_grants():
    book = GrantBook()
    _paced(book, "a", 1.0)
    _paced(book, "b", 1.0)
    book.grant(1, "a", 0.0, ahead=False)
    book.start(1, "a", 0.0)
    book.grant(2, "a", 0.0, ahead=True)
    book.grant(3, "b", 0.0, ahead=True)
    assert book.drop_worker("a") == [2]  # banned (or moved to another stage): lease 2 is re-queued
    assert list(book.ahead) == [3] and book.paces["a"].busy_since is None
    assert book.drop_worker("a") == []


def test_round_trip_is_learnt_from_grants_to_idle_workers():
    book = GrantBook()
    _paced(book, "a", 0.004)
    book.grant(7, "a", 1.000, ahead=False)
    book.start(7, "a", 1.010)  # 10 ms from the grant to its start
    assert book.paces["a"].rtt_s == pytest.approx(0.010)
    assert book.credit("a") == 4  # 1 + ceil(10 / 4)
    book.start(99, "b", 2.0)  # a start of a grant the book never saw only marks the worker busy
    assert book.paces["b"].busy_since == 2.0


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_sessions_asking_ahead_beside_a_busy_worker_stay_exact(tmp_path, tmp_path_factory):
    """One stage, two workers on sessions asking ahead (--prefetch): worker 0's first task of step 1 spins 10 s, so a
    task granted to it ahead may wait unstarted while worker 1 runs out of work, and the
    server may take it back for worker 1 (whether worker 0 holds a grant ahead at that moment
    depends on timing, so the take-back itself is tested on the pure GrantBook above). The
    run ends with the failure-free weights (every exact run's, whatever its stages and
    workers), taken back or not."""
    from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

    from shoal.runtime.processes.launch import launch

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    mark = tmp_path / "busy.json"
    args = [["--prefetch", "--inject", f"busy_bwd:secs=10:step=1:mark={mark}"], ["--prefetch"]]
    summary = launch(launch_config(out, stages=1, workers=2, worker_args=args, session=True))
    assert mark.exists() and summary["steps"] == RUN["steps"]
    assert_equal_weights(out, reference)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_calls_end_where_sessions_do(tmp_path, tmp_path_factory):
    """Two stages, two workers: the failure-free reference runs on sessions (exact sync's
    default: every result carries the worker's next lease request, answered with the result's
    verdict in one reply; the server side is tested message by message in test_runtime_pool);
    the same run with a gRPC call per lease, result and renewal (``--no-session``) ends with
    exactly its weights."""
    from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

    from shoal.runtime.processes.launch import launch

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    summary = launch(launch_config(out, session=False))
    assert summary["steps"] == RUN["steps"]
    assert "session of" not in "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    assert "session of" in "".join(p.read_text() for p in (reference_logs(tmp_path_factory)).glob("server*.log"))
    assert_equal_weights(out, reference)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_results_larger_than_a_session_message_go_by_call_and_stay_exact(tmp_path, tmp_path_factory):
    """Sessions (exact sync's default) with 4 KB chunks: every result is larger than a
    session carries (result_on_session), so it goes by a call of its own while leases and
    renewals stay on the session; the run ends with the failure-free weights."""
    from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

    from shoal.runtime.processes.launch import launch

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    summary = launch(launch_config(out, chunk_mb=0.004))
    assert summary["steps"] == RUN["steps"]
    assert "session of" in "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    assert_equal_weights(out, reference)


def test_a_session_carries_only_results_it_sends_quickly():
    import math

    from shoal.runtime.transport.session import (
        SESSION_HOLD_S,
        SESSION_RESULT_BYTES,
        result_on_session,
    )

    # the uplink's rate not known: at most 128 KB
    assert result_on_session(64 * 1024, 1 << 20)
    assert not result_on_session(SESSION_RESULT_BYTES + 1, 1 << 20)
    assert not result_on_session(8 * 1024, 4 * 1024)  # more than one chunk, whatever the link
    assert not result_on_session(8 * 1024, 4 * 1024, math.inf)
    # measured: what the uplink sends in SESSION_HOLD_S (1 Mbit/s: 1.25 KB; 1 Gbit/s: 1.25 MB)
    assert result_on_session(1_000, 1 << 20, 125_000) and not result_on_session(2_000, 1 << 20, 125_000)
    assert result_on_session(1 << 20, 1 << 20, 125e6) and not result_on_session((1 << 20) + 1, 1 << 20, 125e6)
    assert SESSION_HOLD_S * 125e6 >= 1 << 20
    assert result_on_session(1 << 20, 1 << 20, math.inf)  # the same host: up to a chunk


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_results_over_128_kb_ride_the_session_on_loopback(tmp_path):
    """Each activation here is 131 kB in fp32 (B 4, T 64, width 128): more than a session
    carries on a link of unknown rate, but the workers measured their servers on this host, so
    every result goes on the session, none by a call of its own."""
    import re

    from shoal.runtime.processes.launch import LaunchConfig, launch

    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), model="tiny", micro_batches=4, micro_batch_size=4, seq_len=64,
                                  seed=0, steps=2, stages=2, workers=2, timeout_s=280, ckpt_every=0))
    assert summary["steps"] == 2
    counts = [tuple(map(int, m.groups())) for p in (out / "logs").glob("server*.log")
              for m in re.finditer(r"took (\d+) results on sessions and (\d+) by call", p.read_text())]
    assert len(counts) == 2 and sum(s for s, _ in counts) >= 2 * 4 * 3 and all(c == 0 for _, c in counts), counts


def reference_logs(tmp_path_factory):
    """The failure-free reference run's log folder (tests/swarm_reference.py)."""
    from pathlib import Path

    return Path(tmp_path_factory.getbasetemp()) / "failure_free" / "run" / "logs"


def test_sessions_are_the_default_in_exact_sync_only():
    from shoal.runtime.roles.worker import sessions_for

    assert sessions_for(None, local=False) and not sessions_for(None, local=True)
    assert sessions_for(True, local=True) and not sessions_for(False, local=False)
