"""Hot standby stage servers (``shoal launch --standbys``): a real swarm whose stage-1
server is killed with SIGKILL mid-step; the standby, on its own empty checkpoint folder,
takes over from the copy it pulled over the network, and the run ends with exactly the
failure-free run's weights (shared reference run: swarm_reference)."""

from __future__ import annotations

import time

import pytest
from swarm_reference import assert_equal_weights, failure_free_weights, launch_config

from shoal.runtime.coordinator import standby_stages
from shoal.runtime.launch import Swarm
from shoal.train.metrics import read_jsonl


def test_standbys_copy_stages_round_robin():
    assert standby_stages(["a", "b", "c"], 2) == {"a": 0, "b": 1, "c": 0}
    assert standby_stages([], 3) == {}


def _copied(folder, stage: int) -> list[int]:
    """Versions of the complete checkpoint files of ``stage`` a standby holds."""
    return sorted(int(p.name[1:].split(".")[0]) for p in folder.glob(f"run-*/stage{stage}/v*.safetensors"))


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_standby_takes_over_a_killed_stage_server(tmp_path, tmp_path_factory):
    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    slow = [["--slow", "0.3"]] * 2  # keeps a step in flight while we kill
    with Swarm(launch_config(out, standbys=2, worker_args=slow)) as sw:
        sw.start()
        # Standbys s2 and s3 start on empty folders of their own; one copies each stage.
        deadline = time.time() + 300
        while True:
            assert time.time() < deadline, "no standby copied a checkpoint of step 2 or later"
            committed = sw.committed_steps()
            holder = next((f"s{i}" for i in (2, 3) if committed in _copied(out / "standby_ckpt" / f"s{i}", 1)), None)
            if committed >= 2 and holder:
                break
            time.sleep(0.05)
        victim = sw._stage_server_index(1)
        assert victim is not None and victim < 2  # an active server, not a standby
        sw.kill_server(victim)
        summary = sw.wait()
    assert summary["steps"] == 6
    events = read_jsonl(out / "events.jsonl")
    assigns = [e for e in events if e["event"] == "assign" and e.get("role") == "server" and e.get("stage") == 1]
    assert assigns[-1]["device"] == holder  # the stage-1 standby was promoted
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks, "a promotion restarts the stages at one version"
    # No roll-back beyond the step in flight: every stage restarts at the newest committed step.
    assert rollbacks[0]["version"] == rollbacks[0]["committed"] >= committed, rollbacks[0]
    assert_equal_weights(out, reference)
