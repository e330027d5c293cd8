"""``shoal launch --fault``: real swarms with a poisoned worker, a flapping worker and a
corrupted checkpoint, compared with the shared failure-free run (swarm_reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

from shoal.train.metrics import read_jsonl


@pytest.fixture
def failure_free(tmp_path_factory):
    return failure_free_weights(tmp_path_factory)


def _honest_run(tmp_path_factory) -> Path:
    return Path(tmp_path_factory.getbasetemp()) / "failure_free" / "run"


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_poisoned_worker_is_banned_and_a_corrupt_checkpoint_falls_back(tmp_path, tmp_path_factory, failure_free):
    """Two faults in one run (to keep the suite short), each checked on its own:

    * w1 pushes its gradients times -20: a stage server recomputes its first push, bans it
      by step 3, its work is redone by the others. The honest run (every worker's first
      push and 5 % of the rest recomputed) bans nobody.
    * at step 2 the server of stage 1 is killed and its newest checkpoint corrupted: the
      replacement reports the checksum failure, sets the file aside, and the run rolls
      back to the previous checkpoint.

    The run ends with exactly the honest run's weights: no poisoned push was committed."""
    from shoal.runtime.processes.launch import launch

    honest = _honest_run(tmp_path_factory)
    assert not [e for e in read_jsonl(honest / "events.jsonl") if e["event"] == "ban"]
    out = tmp_path / "run"
    summary = launch(launch_config(out, workers=3, faults=["poison:w1:scale=-20", "corrupt-ckpt:1:step=2"]))
    assert summary["steps"] == RUN["steps"]
    events = read_jsonl(out / "events.jsonl")
    # the poisoned worker
    bans = [e for e in events if e["event"] == "ban"]
    assert [b["device"] for b in bans] == ["w1"], bans
    assert bans[0]["step"] <= 3 and "differs from the recomputed one" in bans[0]["why"]
    assert "w1 is banned from the run" in (out / "logs" / "worker1.log").read_text()
    # journaled by name: a restarted or resumed coordinator refuses w1 too
    from shoal.runtime.safety.journal import find_run, read_journal, resume_state, run_dir

    assert set(resume_state(read_journal(run_dir(*find_run(out)) / "journal.jsonl")).bans) == {"w1"}
    ref = json.loads((honest / "summary.json").read_text())["final_loss"]
    assert abs(summary["final_loss"] - ref) <= 0.02 * abs(ref)
    # the corrupted checkpoint
    fault = next(e for e in events if e["event"] == "fault")
    assert fault["kind"] == "corrupt-ckpt" and fault["path"], fault
    logs = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    assert "fails its checksum (corrupted)" in logs and "using the previous checkpoint" in logs
    assert Path(fault["path"] + ".bad").exists()
    corrupted = int(Path(fault["path"]).stem[1:])
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks and rollbacks[-1]["version"] < corrupted, rollbacks
    assert_equal_weights(out, failure_free)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_flapping_worker_and_a_killed_worker(tmp_path, failure_free):
    """w1 reaches both stage servers through links that reset every connection for 0.1 s
    every 0.6 s, and w2 is killed with SIGKILL once 2 steps are committed: the run
    completes with the failure-free weights."""
    from shoal.runtime.processes.launch import launch

    out = tmp_path / "run"
    summary = launch(launch_config(out, workers=3, faults=["flap:w1:period=0.6:down=0.1:for=12",
                                                           "kill:worker:w2:step=2"]))
    assert summary["steps"] == RUN["steps"]
    events = read_jsonl(out / "events.jsonl")
    fault = next(e for e in events if e["event"] == "fault")
    assert fault["kind"] == "kill" and fault["target"] == "w2" and fault["step"] >= 2, fault
    assert any(e["event"] == "kill" and e["device"] == "w2" for e in events)
    assert_equal_weights(out, failure_free)
