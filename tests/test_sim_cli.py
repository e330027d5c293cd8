"""Simulator outputs: JSON, timeline PNG, the `shoal simulate` command, built-in scenarios."""

from __future__ import annotations

import json
import struct

import pytest

from shoal.cli import main
from shoal.errors import ShoalError
from shoal.plan import load_scenario, make_plan
from shoal.sim import plot_timeline, simulate


@pytest.fixture(scope="module")
def demo():
    scn = load_scenario("demo")
    return scn, make_plan(scn, "shoal")


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        data = f.read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_result_json_round_trip(demo, tmp_path):
    scn, plan = demo
    r = simulate(plan, scn, steps=2)
    out = tmp_path / "r.json"
    r.to_json(out)
    d = json.loads(out.read_text())
    assert d["steps"] == 2 and len(d["step_times_s"]) == 2
    assert d["lost_micro_batches"] == 0
    assert set(d["utilisation"]) == {w for st in plan.stages for w in st.workers}
    # every worker pulled the weights at least twice: bytes on its server -> worker link
    host = plan.stages[0].server
    for w in plan.stages[0].workers:
        assert d["link_bytes"][f"{host}->{w}"] > 0
    assert d["tokens_per_s"] == pytest.approx(
        scn.workload.global_batch * scn.workload.seq_len * 2 / sum(r.step_times_s))


def test_timeline_png(demo, tmp_path):
    scn, plan = demo
    r = simulate(plan, scn, steps=2, record_timeline=True)
    kinds = {k for *_, k in r.timeline}
    assert kinds == {"compute", "send", "recv"}
    out = tmp_path / "t.png"
    plot_timeline(r, out)
    w, h = _png_size(out)
    assert w > 500 and h > 100


def test_timeline_requires_recording(demo, tmp_path):
    scn, plan = demo
    r = simulate(plan, scn, steps=1)
    with pytest.raises(ShoalError, match="record_timeline"):
        plot_timeline(r, tmp_path / "t.png")


def test_cli_simulate_prints_summary_and_writes_files(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "tl.png"
    rc = main(["simulate", "--scenario", "demo", "--steps", "2", "--json", str(out), "--timeline", str(png)])
    text = capsys.readouterr().out
    assert rc == 0
    for word in ("simulated step time", "cost-model prediction", "tokens/s", "of the swarm's FLOP limit",
                 "devices used", "busy share", "re-queued"):
        assert word in text
    d = json.loads(out.read_text())
    assert d["plan"]["scenario"] == "demo" and d["predicted_step_time_s"] > 0
    _png_size(png)


def test_cli_simulate_from_plan_file_with_churn(tmp_path, capsys, demo):
    scn, plan = demo
    path = tmp_path / "plan.json"
    plan.to_json(path)
    rc = main(["simulate", "--scenario", "demo", "--plan", str(path), "--steps", "2", "--churn", "on"])
    assert rc == 0
    assert "churn on" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["simulate", "--scenario", "no-such-scenario"], "no built-in scenario"),
    (["simulate", "--scenario", "demo", "--steps", "0"], "--steps"),
    (["simulate", "--scenario", "demo", "--plan", "/does/not/exist.json"], "does not exist"),
])
def test_cli_errors_are_one_line(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and "Traceback" not in err


def test_cli_refuses_plan_for_another_scenario(tmp_path, capsys, demo):
    _, plan = demo
    plan_path = tmp_path / "p.json"
    plan.to_json(plan_path)
    assert main(["simulate", "--scenario", "hetero-all", "--plan", str(plan_path)]) == 2
    assert "made for scenario demo" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["hetero-all", "gaming-eu"])
def test_builtin_scenarios_conserve_work_with_churn(name):
    scn = load_scenario(name)
    plan = make_plan(scn, "shoal")
    r = simulate(plan, scn, steps=2, churn=True, seed=3)
    assert r.steps == 2 and r.lost_micro_batches == 0 and not r.stalled
    for rec in r.passes:
        for per in rec["grad"]:
            assert sorted(per) == list(range(plan.micro_batches)) and set(per.values()) == {1}


def test_fault_flags_parse_and_slow_the_run(capsys):
    from shoal.sim.cli import parse_server_failure, parse_straggler

    st = parse_straggler("host:a:0:5:10")
    assert (st.device, st.start_s, st.duration_s, st.factor) == ("host:a", 0.0, 5.0, 10.0)
    sf = parse_server_failure("1:30:20")
    assert (sf.stage, sf.time_s, sf.recovery_s) == (1, 30.0, 20.0)
    for bad in ("x", "d:1:2", "d:-1:2:3"):
        with pytest.raises(ShoalError, match="--straggler"):
            parse_straggler(bad)
    with pytest.raises(ShoalError, match="--server-failure"):
        parse_server_failure("1:2")
    # exact sync: every step ends with a pull from each stage server, so a server down mid-step delays it
    assert main(["simulate", "--scenario", "demo", "--sync", "exact", "--steps", "1"]) == 0
    base = capsys.readouterr().out
    assert main(["simulate", "--scenario", "demo", "--sync", "exact", "--steps", "1",
                 "--server-failure", "0:0.05:2"]) == 0
    failed = capsys.readouterr().out

    def step(text):
        return float(text.split("simulated step time")[1].split()[0])

    assert step(failed) > step(base) + 1.0
