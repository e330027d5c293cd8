"""Hot standbys in the planner (shoal.plan.standby): placement, their copies in the cost model
and in the simulator, the plan file and `shoal plan --standbys`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.errors import ShoalError
from shoal.model.config import get_preset
from shoal.model.profile import profile_model
from shoal.plan.api import make_plan
from shoal.plan.cost import predict
from shoal.plan.scenario import load_scenario
from shoal.plan.standby import (
    LOG_BYTES_PER_PARAM,
    STATE_BYTES_PER_PARAM,
    copy_seconds_per_step,
    log_seconds_per_step,
    place_standbys,
    state_bytes,
    step_log_bytes,
    uplink_bound_step,
)
from shoal.plan.types import (
    ChurnModel,
    Device,
    Link,
    Network,
    Plan,
    Scenario,
    StagePlan,
    SyncPolicy,
    Workload,
)
from shoal.sim import simulate

T, B, DT = 32, 1, 4
PROF = profile_model(get_preset("tiny"), T, B, DT)


def _host(i: int, up: float = 1e8, memory: float = 64e9, region: str = "r") -> Device:
    return Device(f"srv{i}", "server", 0.0, 0.0, region, up, 1e8, can_host_server=True, host_memory=memory)


def _gpu(i: int) -> Device:
    return Device(f"w{i}", "gpu", 1e11, 8e9, "r", 1e7, 1e7)


def _scenario(hosts: list[Device], inter: dict | None = None) -> Scenario:
    net = Network(intra={"r": Link(0.01, 1e9), "far": Link(0.01, 1e9)}, inter=inter or {})
    return Scenario("hand", hosts + [_gpu(i) for i in range(4)], net, Workload("tiny", T, 16, B, DT), ChurnModel())


def _plan(standbys=((), ()), every: int = 1, servers=("srv0", "srv1")) -> Plan:
    return Plan("hand", "tiny", "hand", [StagePlan((0, 3), servers[0], ["w0", "w1"], list(standbys[0])),
                                         StagePlan((3, 6), servers[1], ["w2", "w3"], list(standbys[1]))],
                B, 16, SyncPolicy(), standby_every=every)


def test_state_bytes_and_uplink_bound():
    assert state_bytes(PROF, 0, 3) == PROF.params(0, 3) * STATE_BYTES_PER_PARAM
    assert uplink_bound_step(2.0, 1.5) == 2.0 and uplink_bound_step(2.0, 3.5) == 3.5


def test_placement_avoids_the_active_host_and_balances():
    scn = _scenario([_host(0), _host(1), _host(2)])
    placed = place_standbys(_plan(), scn, PROF, 1)
    # each standby on a host other than its stage's server; the idle host srv2 is taken first
    assert all(h != st.server for st, hs in zip(_plan().stages, placed, strict=True) for h in hs)
    assert [h for hs in placed for h in hs].count("srv2") == 1
    assert place_standbys(_plan(), scn, PROF, 1) == placed  # deterministic
    two = place_standbys(_plan(), scn, PROF, 2)
    assert all(len(set(hs)) == 2 and st.server not in hs for st, hs in zip(_plan().stages, two, strict=True))
    assert place_standbys(_plan(), scn, PROF, 0) == [[], []]


def test_placement_prefers_the_fast_copy_path_and_needs_room():
    slow = {("far", "r"): Link(0.05, 1e5)}
    scn = _scenario([_host(0), _host(1), _host(2, region="far"), _host(3)], inter=slow)
    placed = place_standbys(_plan(), scn, PROF, 1)
    big = 0 if PROF.params(0, 3) >= PROF.params(3, 6) else 1  # placed first: both idle hosts free
    assert placed[big] == ["srv3"]  # the near host, not the one behind a 100 kB/s path
    # a host without memory for the stage's state is never chosen
    full = _scenario([_host(0), _host(1), _host(2, memory=1e6)])
    placed = place_standbys(_plan(), full, PROF, 1)
    assert "srv2" not in [h for hs in placed for h in hs]
    # one reliable host: nowhere to put a standby
    lone = _scenario([_host(0)])
    with pytest.raises(ShoalError, match=r"--standbys 1: stage \d .* needs 1 reliable host"):
        place_standbys(_plan(servers=("srv0", "srv0")), lone, PROF, 1)


def test_copies_count_on_the_active_uplink_in_cost_model_and_simulator():
    """Slow server uplinks (1 MB/s): copying each stage's state after every step makes the
    uplink the bottleneck. The cost model's step and the simulator's steady step agree, and
    copying every 4th step costs a quarter per step."""
    scn = _scenario([_host(0, up=1e6), _host(1, up=1e6), _host(2)])
    base = predict(_plan(), scn)["step_time_s"]
    every1 = _plan((["srv2"], ["srv2"]))
    pred = predict(every1, scn)
    copy0 = state_bytes(PROF, 0, 3) / 1e6
    assert pred["standby_s"] == pytest.approx(max(copy0, state_bytes(PROF, 3, 6) / 1e6))
    assert copy_seconds_per_step(every1, scn, PROF)[0] == pytest.approx(copy0)
    assert pred["step_time_s"] > 1.5 * base
    sim = simulate(every1, scn, steps=8)
    steady = sim.step_times_s[-1]
    assert steady == pytest.approx(pred["step_time_s"], rel=0.1), (steady, pred["step_time_s"])
    # a copy after each of the 8 commits (the last ones are still on the wire when the run ends)
    # besides the 8 step logs, each complete before its step's update
    log0 = step_log_bytes(PROF, 0, 3)
    copies = (sim.link_bytes.get("srv0->srv2", 0.0) - 8 * log0) / state_bytes(PROF, 0, 3)
    assert 5 <= copies <= 8, sim.link_bytes
    quarter = predict(_plan((["srv2"], ["srv2"]), every=4), scn)
    assert quarter["standby_s"] == pytest.approx(pred["standby_s"] / 4)
    assert base <= quarter["step_time_s"] < pred["step_time_s"]
    sim4 = simulate(_plan((["srv2"], ["srv2"]), every=4), scn, steps=8)
    assert 1 <= (sim4.link_bytes.get("srv0->srv2", 0.0) - 8 * log0) / state_bytes(PROF, 0, 3) <= 2  # steps 3, 7
    # no standbys: nothing copied, nothing added
    assert not any("srv2" in k for k in simulate(_plan(), scn, steps=2).link_bytes)


def test_the_step_log_waits_in_exact_sync_only_in_cost_model_and_simulator():
    # a slow copy path (1 MB/s) so the log's wait shows; copies every 1000 steps are negligible
    slow = {("far", "r"): Link(0.05, 1e6)}
    scn = _scenario([_host(0), _host(1), _host(2, region="far")], inter=slow)
    base = _plan(every=1000)
    logged = _plan((["srv2"], ["srv2"]), every=1000)
    log_s = log_seconds_per_step(logged, scn, PROF)
    assert log_s[0] == pytest.approx(step_log_bytes(PROF, 0, 3) / 1e6 + 2 * 0.05)
    assert step_log_bytes(PROF, 0, 3) == PROF.params(0, 3) * LOG_BYTES_PER_PARAM
    p0, p1 = predict(base, scn), predict(logged, scn)
    assert p1["standby_log_s"] == pytest.approx(max(log_s))
    assert p1["step_time_s"] == pytest.approx(p0["step_time_s"] + max(log_s), rel=1e-3)
    s0, s1 = simulate(base, scn, steps=4), simulate(logged, scn, steps=4)
    added = s1.step_times_s[-1] - s0.step_times_s[-1]
    assert added == pytest.approx(max(log_s), rel=0.1), (added, log_s)
    # local mode keeps no step log: the standbys add nothing to the step there
    local = SyncPolicy(mode="local", sync_every=4)
    base.sync = logged.sync = local
    assert log_seconds_per_step(logged, scn, PROF) == [0.0, 0.0]
    assert predict(logged, scn)["standby_log_s"] == 0.0
    assert "srv0->srv2" not in simulate(logged, scn, steps=2).link_bytes


def test_make_plan_places_standbys_and_the_plan_file_keeps_them(tmp_path):
    scn = load_scenario("hetero-network")
    plan = make_plan(scn, standbys=1, standby_every=5)
    for st in plan.stages:
        assert len(st.standbys) == 1 and st.standbys[0] != st.server
        assert scn.device(st.standbys[0]).can_host_server
    assert plan.standby_every == 5 and "standby_s" in plan.predicted
    plan.to_json(tmp_path / "p.json")
    back = Plan.from_json(tmp_path / "p.json")
    assert [st.standbys for st in back.stages] == [st.standbys for st in plan.stages]
    assert back.standby_every == 5
    with pytest.raises(ShoalError, match="--standbys must be >= 0"):
        make_plan(scn, standbys=-1)


def test_shoal_plan_cli_shows_standbys():
    r = subprocess.run([sys.executable, "-m", "shoal.cli", "plan", "--scenario", "demo", "--standbys", "1",
                        "--ckpt-every", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "standby" in r.stdout and "host-eu" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "shoal.cli", "plan", "--scenario", "demo", "--standbys", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --standbys 2: stage 0"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
