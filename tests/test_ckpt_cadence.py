"""Checkpoint cadence by time: a total stop redoes a bounded amount of committed work (issue 24).

Servers checkpoint every K steps (``--ckpt-every``) and, whichever comes first, once T seconds
of committed work are in no checkpoint (``--ckpt-every-s``, decided by the coordinator so that
every stage checkpoints the same versions). The real-process test makes every step longer
than T by construction (workers wait a fixed time per task; load only lengthens a step), so
the time rule alone must checkpoint every version of a run whose K exceeds its steps.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

from shoal.errors import ShoalError
from shoal.runtime.common import CKPT_EVERY_S, ckpt_due
from shoal.runtime.safety.journal import Journal, read_journal, resume_state, run_dir
from shoal.train.metrics import read_jsonl


def test_ckpt_due_is_the_step_rule_or_the_time_rule_whichever_first():
    # the step rule alone (time rule off)
    assert [v for v in range(1, 25) if ckpt_due(v, 10, 0.0, 0.0)] == [10, 20]
    # the time rule: due once the unsaved committed work reaches T, at any version
    assert ckpt_due(3, 10, 60.0, 60.0) and ckpt_due(3, 10, 61.5, 60.0)
    assert not ckpt_due(3, 10, 59.9, 60.0)
    assert ckpt_due(3, 10, math.inf, 60.0)  # a coordinator that took the run over knows nothing
    # the step rule still fires before T
    assert ckpt_due(10, 10, 0.1, 60.0)
    # K = 0 turns checkpoints off, the time rule included
    assert not ckpt_due(3, 0, 1e9, 60.0) and not ckpt_due(10, 0, 0.0, 0.0)
    # T = 0 turns the time rule off, never the step rule
    assert not ckpt_due(3, 10, 1e9, 0.0) and ckpt_due(30, 10, 0.0, 0.0)


def test_ckpt_every_s_default_and_refusals():
    from shoal.runtime.processes.launch import LaunchConfig, resolve_ckpt_every_s

    assert resolve_ckpt_every_s(None) == CKPT_EVERY_S > 0
    assert resolve_ckpt_every_s(0) == 0.0 and resolve_ckpt_every_s(2.5) == 2.5
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ShoalError, match="--ckpt-every-s"):
            resolve_ckpt_every_s(bad)
    with pytest.raises(ShoalError, match="--ckpt-every-s"):
        LaunchConfig(out="x", ckpt_every_s=-5.0).validate()


def test_help_states_the_bound(capsys):
    from shoal.cli import main

    for cmd in ("launch", "coordinator"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "--ckpt-every-s T" in text, cmd
        assert "a total stop (every process killed) redoes at most about T s of committed work" in text, cmd


def test_the_journal_keeps_which_steps_were_checkpointed(tmp_path):
    """A coordinator taking the run over hands a standby the time rule's decisions too."""
    j = Journal(tmp_path / "journal.jsonl")
    j.write("run", spec={"steps": "10"}, options={}, t0=0.0)
    for step in range(4):
        j.write("commit", step=step, epoch=0, record={"step": step, "loss": 1.0}, scale=None,
                decision=[1e-3, 1.0, False, 0.0], **({"ckpt": True} if step == 2 else {}))
    j.close()
    st = resume_state(read_journal(tmp_path / "journal.jsonl"))
    assert st.checkpointed == {(0, 2)}
    assert st.decisions[(0, 2)] == (1e-3, 1.0, False, 0.0)


def _journal_committed(out: Path, rid: str) -> int:
    return resume_state(read_journal(run_dir(out, rid) / "journal.jsonl")).committed


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_total_stop_redoes_at_most_the_step_that_crossed_t(tmp_path, tmp_path_factory):
    """K = 10 (the default) over a 6-step run, T = 0.3 s, and every step at least 0.4 s of
    committed work (each worker waits 0.1 s per task and does 4 or more tasks a step): the
    time rule checkpoints every version. Every process is killed (-9) once step 3 is
    committed; the resume restarts from the newest committed version or the one before it
    (its checkpoint is written in a thread after the commit), never from version 0 as the
    step rule alone would, and ends with the failure-free run's weights."""
    from shoal.runtime.processes.launch import Swarm, launch

    ref_weights = failure_free_weights(tmp_path_factory)
    ref_summary = json.loads((Path(tmp_path_factory.getbasetemp()) / "failure_free" / "run" /
                              "summary.json").read_text())
    out = tmp_path / "run"
    cfg = launch_config(out, ckpt_every=None, ckpt_every_s=0.3, worker_args=[["--slow", "0.1"]] * 2)
    with Swarm(cfg) as sw:
        sw.start()
        deadline = time.time() + 400
        while sw.committed_steps() < 3:
            assert sw.coord.poll() is None, "the coordinator exited early"
            assert time.time() < deadline, "fewer than 3 steps after 400 s"
            time.sleep(0.05)
        sw.stop()  # kill -9 every member and the coordinator
        rid = sw.run_id
    committed = _journal_committed(out, rid)
    assert 3 <= committed < RUN["steps"]
    commits = [r for r in read_journal(run_dir(out, rid) / "journal.jsonl") if r["kind"] == "commit"]
    # the time rule (not K = 10) marked every committed step; each took at least 0.4 s
    assert [bool(r.get("ckpt")) for r in commits] == [True] * committed, commits
    assert all(r["record"]["step_time_s"] >= 0.3 for r in commits), [r["record"]["step_time_s"] for r in commits]

    summary = launch(launch_config(out, resume=True, run_id=rid, ckpt_every=None, ckpt_every_s=0.3))
    assert summary["steps"] == RUN["steps"] and summary["losses"] == ref_summary["losses"]
    assert_equal_weights(out, ref_weights)
    rollback = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "rollback"]
    assert rollback, "the resumed run did not restart from a checkpoint"
    redone = committed - rollback[-1]["version"]
    assert 0 <= redone <= 1, (committed, rollback)
