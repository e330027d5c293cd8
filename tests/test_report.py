"""Run report from a synthetic run directory: every file, and numbers that match."""

import io
import json

import pytest
from rich.console import Console

from shoal.demo.report import (
    achieved_step_time,
    build_report,
    compare_runs,
    count_events,
    load_run,
    print_summary,
    write_report,
)
from shoal.train.metrics import JsonlWriter, step_record

PLAN = {
    "scenario": "demo", "model": "tiny", "method": "shoal",
    "stages": [
        {"layers": [0, 3], "server": "srv-eu", "workers": ["eu-3060", "eu-3070", "eu-4090"]},
        {"layers": [3, 6], "server": "srv-us", "workers": ["us-3080", "us-4070"]},
    ],
    "micro_batch_size": 4, "micro_batches": 8, "predicted": {"step_time_s": 0.8},
}


def _make_run(path, steps=10, step_time=1.0, loss0=5.0, wire_div=3.9, sample="To be, or not"):
    path.mkdir(parents=True, exist_ok=True)
    t = 1.0  # workers join during the first second, before step 0 starts
    with JsonlWriter(path / "metrics.jsonl") as mw:
        for s in range(steps):
            st = step_time * (2.0 if s == 0 else 1.0)
            t += st
            mw.write(step_record(s, loss0 - 0.1 * s, 1e-3, 1.0, 2048, st, t,
                                 val_loss=(loss0 - 0.1 * s + 0.05) if s % 5 == 4 else None))
    with JsonlWriter(path / "events.jsonl") as ew:
        for rec in [
            {"time_s": 0.1, "event": "join", "device": "eu-3060", "role": "worker"},
            {"time_s": 0.2, "event": "join", "device": "srv-eu", "role": "server", "stage": 0},
            {"time_s": 4.0, "event": "kill", "device": "eu-3070"},
            {"time_s": 4.5, "event": "leave", "device": "eu-3070", "role": "worker"},
            {"time_s": 4.6, "event": "requeue", "stage": 0, "count": 3},
            {"time_s": 6.0, "event": "kill", "device": "us-4070"},
            {"time_s": 6.2, "event": "requeue", "stage": 1},
            {"time_s": 8.0, "event": "join", "device": "eu-3070", "role": "worker"},
        ]:
            ew.write(rec)
    raw = 4_000_000
    summary = {
        "scenario": "demo", "model": "tiny", "plan": PLAN,
        "simulated_step_time_s": 0.9,
        "bytes": {"activations": {"raw": raw, "wire": int(raw / wire_div)},
                  "grad_push": {"raw": 2 * raw, "wire": raw}},
        "codecs": {"activations": "int8", "grad_push": "fp16"},
        "churn": True,
        "sample_text": sample,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_achieved_step_time_excludes_fill_step():
    ms = [step_record(i, 1.0, 0.0, 0.0, 10, t, 0.0) for i, t in enumerate([5.0, 1.0, 2.0])]
    assert achieved_step_time(ms) == pytest.approx(1.5)
    assert achieved_step_time(ms[:1]) == 5.0
    assert achieved_step_time([]) is None


def test_count_events_does_not_double_count_kill_and_leave():
    ms = [step_record(0, 1.0, 0.0, 0.0, 10, 1.0, 1.0)]
    ev = [{"time_s": 0.0, "event": "join", "device": "a"},  # start-up join: not churn
          {"time_s": 2.0, "event": "kill", "device": "a"},
          {"time_s": 2.1, "event": "leave", "device": "a", "role": "worker"},
          {"time_s": 2.2, "event": "kill", "device": "s0", "role": "server"},
          {"time_s": 2.3, "event": "kill", "device": "s1"},  # the launcher's server kill: no role
          {"time_s": 3.0, "event": "join", "device": "a", "role": "worker"}]
    c = count_events(ev, ms)
    assert c == {"workers_lost": 1, "servers_lost": 2, "failures": 3, "workers_joined": 1,
                 "tasks_requeued": 0}
    # without kill events (the churn driver did not log), leaves count
    c2 = count_events([e for e in ev if e["event"] != "kill"], ms)
    assert c2["workers_lost"] == 1 and c2["failures"] == 1
    # no role: a worker unless named like a server
    assert count_events([{"time_s": 5.0, "event": "kill", "device": "w3"}], ms)["workers_lost"] == 1


def test_write_report_produces_every_file_with_matching_numbers(tmp_path):
    run = _make_run(tmp_path / "run")
    folder = write_report(run)
    assert folder == run / "report"
    for name in ("loss.png", "throughput.png", "report.md", "report.json"):
        assert (folder / name).stat().st_size > 0, name
    for png in ("loss.png", "throughput.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (folder / "report.md").read_text()
    rep = json.loads((folder / "report.json").read_text())
    # step times: predicted from the plan, simulated from the summary, achieved = mean of steps 1..9
    assert rep["step_time"]["predicted_s"] == 0.8
    assert rep["step_time"]["achieved_s"] == pytest.approx(1.0)
    assert "| cost model (predicted, no churn) | 0.800 s | 1.25 |" in md
    assert "| simulator | 0.900 s | 1.11 |" in md
    assert "| achieved (mean, step 0 excluded) | 1.000 s | 1.00 |" in md
    # plan table
    assert "| 0 | [0, 3) | srv-eu | 3 | eu-3060, eu-3070, eu-4090 |" in md
    assert "| 1 | [3, 6) | srv-us | 2 | us-3080, us-4070 |" in md
    # bytes per link class
    assert "| activations | int8 | 4,000,000 (4.00 MB) | 1,025,641 (1.03 MB) | 3.90 |" in md
    assert "| grad_push | fp16 | 8,000,000 (8.00 MB) | 4,000,000 (4.00 MB) | 2.00 |" in md
    assert rep["bytes_total"] == {"raw": 12_000_000, "wire": 5_025_641,
                                  "ratio": pytest.approx(12_000_000 / 5_025_641)}
    # faults: two kills (no double count with the leave), one mid-run join, 3 + 1 requeued
    assert "- failures survived: 2 (workers lost: 2)" in md
    assert "- workers joined mid-run: 1" in md
    assert "- tasks re-queued: 4" in md
    assert "To be, or not" in md
    # final loss is the last validation loss (step 9: 5.0 - 0.9 + 0.05)
    assert rep["final_loss"] == pytest.approx(4.15)
    assert rep["steps"] == 10 and rep["tokens"] == 20480


def test_summary_overrides_and_runtime_keys(tmp_path):
    run = _make_run(tmp_path / "run")
    s = json.loads((run / "summary.json").read_text())
    s.update(requeues=7, achieved_step_time_s=2.0, failures_survived=5)
    (run / "summary.json").write_text(json.dumps(s))
    rep = build_report(*load_run(run))
    assert rep["tasks_requeued"] == 7 and rep["failures_survived"] == 5
    assert rep["step_time"]["achieved_over_simulated"] == pytest.approx(2.0 / 0.9)


def test_simulated_over_predicted_leaves_the_replayed_churn_out(tmp_path):
    """The cost model's step has no churn: the ratio sets it beside the simulator's step without
    the churn, and the table names the simulation that replayed the run's churn as such."""
    run = _make_run(tmp_path / "run")
    s = json.loads((run / "summary.json").read_text())
    s.update(simulated_step_time_s=1.2, simulated_no_churn_step_time_s=0.88)
    (run / "summary.json").write_text(json.dumps(s))
    folder = write_report(run)
    rep = json.loads((folder / "report.json").read_text())
    assert rep["step_time"]["simulated_over_predicted"] == pytest.approx(0.88 / 0.8)
    assert rep["step_time"]["achieved_over_simulated"] == pytest.approx(1.0 / 1.2)
    md = (folder / "report.md").read_text()
    assert "| simulator, this run's churn replayed | 1.200 s | 0.83 |" in md
    assert "| simulator, without the churn | 0.880 s | 1.14 |" in md
    assert "simulated / predicted (both without the churn): 1.10" in md


def test_report_of_an_almost_empty_run(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    with JsonlWriter(run / "metrics.jsonl") as mw:
        mw.write(step_record(0, 4.0, 1e-3, 1.0, 100, 0.5, 0.5))
    folder = write_report(run, tmp_path / "out")
    md = (folder / "report.md").read_text()
    assert "no plan recorded" in md and "not measured" in md
    assert (folder / "throughput.png").exists()


def test_print_summary(tmp_path):
    run = _make_run(tmp_path / "run")
    rep = build_report(*load_run(run))
    buf = io.StringIO()
    print_summary(rep, folder=run / "report", console=Console(file=buf, width=160))
    out = buf.getvalue()
    assert "achieved 1.000 s" in out and "simulated 0.900 s" in out
    assert "2 failures survived" in out and "4 tasks re-queued" in out
    assert str(run / "report") in out


def test_compare_runs_measures_loss_gap_and_wire_reduction(tmp_path):
    base = _make_run(tmp_path / "base", wire_div=1.0)
    comp = _make_run(tmp_path / "int8", loss0=5.05, wire_div=3.9)
    c = compare_runs(comp, base)
    assert c["loss_gap"] == pytest.approx((4.2 - 4.15) / 4.15)
    # activations shrink 3.9x, grad push is the same in both runs
    assert c["wire_reduction_vs_baseline"] == pytest.approx((4e6 + 4e6) / (1_025_641 + 4e6))


def test_requeues_from_step_records(tmp_path):
    run = _make_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for r in recs:
        r["requeues"] = 2 if r["step"] == 3 else 0
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    rep = build_report(*load_run(run))
    assert rep["tasks_requeued"] == 2 + 4  # per-step requeues + requeue events


def test_plan_from_the_coordinators_replan_event(tmp_path):
    run = tmp_path / "rt"
    run.mkdir()
    with JsonlWriter(run / "metrics.jsonl") as mw:
        mw.write(step_record(0, 4.0, 1e-3, 1.0, 100, 0.5, 1.5))
    with JsonlWriter(run / "events.jsonl") as ew:
        ew.write({"time_s": 0.5, "event": "assign", "device": "s0", "role": "server", "stage": 0})
        ew.write({"time_s": 0.6, "event": "assign", "device": "s1", "role": "server", "stage": 1})
        ew.write({"time_s": 0.7, "event": "replan", "why": "start", "method": "shoal",
                  "layers": [[0, 3], [3, 6]], "assignment": {"w0": 0, "w2": 0, "w1": 1}})
        ew.write({"time_s": 2.0, "event": "replan", "why": "leave", "method": "repair",
                  "layers": [[0, 3], [3, 6]], "assignment": {"w0": 0, "w1": 1}})
    md = (write_report(run) / "report.md").read_text()
    assert "| 0 | [0, 3) | s0 | 2 | w0, w2 |" in md and "| 1 | [3, 6) | s1 | 1 | w1 |" in md
    assert "method: shoal" in md


def test_report_shows_the_no_churn_simulation_and_the_bytes_method():
    from shoal.demo.report import render_markdown

    summary = {"simulated_step_time_s": 3.0, "simulated_no_churn_step_time_s": 2.0,
               "achieved_step_time_s": 2.5, "bytes_method": "computed from task counts",
               "bytes": {"activations": {"raw": 400, "wire": 103}}}
    rep = build_report([], [], summary)
    assert rep["step_time"]["achieved_over_simulated_no_churn"] == pytest.approx(1.25)
    md = render_markdown(rep)
    assert "| simulator, without the churn | 2.000 s | 1.25 |" in md
    assert "(computed from task counts)" in md
    # without a separate no-churn figure there is no extra row
    assert "without the churn" not in render_markdown(build_report([], [], {"simulated_step_time_s": 3.0}))
