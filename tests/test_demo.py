"""``shoal demo``: its pure decisions, and the real command end to end (report files, no orphans, Ctrl-C)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.demo.cli import (
    DemoConfig,
    churn_trace,
    default_out,
    demo_scenario,
    demo_workload,
    pick_workers,
    runtime_plan,
    traffic_bytes,
)
from shoal.demo.emulated import emulation_spec, swarm_churn
from shoal.errors import ShoalError
from shoal.plan.scenario import load_scenario
from shoal.plan.types import Plan, StagePlan

REPORT_FILES = ("loss.png", "throughput.png", "report.md", "report.json")


def test_pick_workers_spreads_over_regions_in_scenario_order():
    sc = load_scenario("gaming-eu")
    picked = pick_workers(sc.workers, 10)
    assert len(picked) == 10
    regions = [d.region for d in picked]
    assert all(regions.count(r) == 2 for r in set(regions)) and len(set(regions)) == 5
    order = [d.id for d in sc.workers]
    assert [d.id for d in picked] == sorted((d.id for d in picked), key=order.index)


def test_demo_workload_keeps_small_models_and_replaces_big_ones():
    sc = load_scenario("demo")
    w, sub = demo_workload(sc.workload)
    assert not sub and w.model == "tiny" and w.seq_len == sc.workload.seq_len and w.micro_batches == 8
    big, sub = demo_workload(load_scenario("gaming-eu").workload)
    assert sub and big.model == "tiny" and big.seq_len <= 128 and 2 <= big.micro_batches <= 8


def test_demo_scenario_subset_and_errors():
    sc = load_scenario("gaming-eu")
    sub, notes = demo_scenario(sc, None, max_workers=12)
    assert len(sub.workers) == 12 and len(sub.server_hosts) == len(sc.server_hosts)
    assert any("12 of the scenario" in n for n in notes) and any("replaced by tiny" in n for n in notes)
    with pytest.raises(ShoalError, match="only"):
        demo_scenario(load_scenario("demo"), 99, max_workers=12)
    for bad in (DemoConfig(steps=0), DemoConfig(compression="zip"), DemoConfig(workers=0)):
        with pytest.raises(ShoalError):
            bad.validate()
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ShoalError, match="--bandwidth-scale must be a positive number"):
            DemoConfig(bandwidth_scale=scale).validate()
    DemoConfig(bandwidth_scale=1.0).validate()  # the scenario's links as written


def test_runtime_plan_maps_process_names_to_devices():
    events = [
        {"event": "assign", "role": "server", "device": "s1", "stage": 0},
        {"event": "assign", "role": "server", "device": "s0", "stage": 1},
        {"event": "replan", "layers": [[0, 4], [4, 6]], "method": "shoal",
         "assignment": {"w0": 1, "w2": 0, "w10": 0, "w1": 1}},
    ]
    workers = [f"d{i}" for i in range(11)]
    plan = runtime_plan(events, workers, ["host-a", "host-b"], "tiny", "x", 4, 8)
    assert [s.layers for s in plan.stages] == [(0, 4), (4, 6)]
    assert [s.server for s in plan.stages] == ["host-b", "host-a"]
    assert plan.stages[0].workers == ["d2", "d10"] and plan.stages[1].workers == ["d0", "d1"]
    assert runtime_plan([], workers, ["h"], "tiny", "x", 4, 8) is None


def test_churn_trace_keeps_applied_events_shifted():
    done = [(1.0, "a", "leave", True), (2.0, "b", "leave", False), (5.0, "a", "join", True)]
    assert churn_trace(done, 0.5) == ((1.5, "a", "leave"), (5.5, "a", "join"))


def test_traffic_bytes_counts_boundaries_and_codec_sizes():
    plan = Plan("x", "tiny", "t", [StagePlan((0, 3), "h", ["a", "b"]), StagePlan((3, 6), "h", ["c"])], 4, 8)
    metrics = [{"step": 0, "tokens": 8 * 4 * 128, "tasks_per_worker": {"a": 5, "b": 3, "c": 8}},
               {"step": 1, "tokens": 8 * 4 * 128, "tasks_per_worker": {"a": 8, "b": 0, "c": 8}}]
    raw = traffic_bytes(metrics, plan, 4 * 128, 128, [1000, 2000], "raw")
    act = 2 * 8 * 4 * 128 * 128 * 4  # 2 steps x 8 micro-batches x one boundary, fp32
    assert raw["activations"] == {"raw": act, "wire": act} == raw["activation_grads"]
    assert raw["weight_pull"]["raw"] == 4 * (1000 + 1000 + 2000 + 1000 + 2000)  # workers that worked
    q = traffic_bytes(metrics, plan, 4 * 128, 128, [1000, 2000], "int8")
    assert q["activations"]["raw"] == act and act / q["activations"]["wire"] >= 3.5
    assert q["weight_pull"] == raw["weight_pull"]  # the runtime pulls weights raw
    # quad-pc's size depends on the channel count: the estimate charges (tokens, d_model) tensors
    from shoal.plan.compression import act_nbytes

    pc = traffic_bytes(metrics, plan, 4 * 128, 128, [1000, 2000], "quad-pc")
    assert pc["activations"]["wire"] == 2 * 8 * act_nbytes("quad-pc", 4 * 128 * 128, 128) == pc["activation_grads"]["wire"]


def test_measured_bytes_win_over_the_computed_estimate():
    from shoal.demo.cli import prefer_measured_bytes

    extra = {"bytes": {"activations": {"raw": 1, "wire": 1}}, "bytes_method": "computed ...",
             "codecs": {"activations": "raw"}, "x": 1}
    assert prefer_measured_bytes({}, extra) == extra  # an older runtime: keep the estimate
    measured = {"bytes": {"activations": {"raw": 5, "wire": 5}}, "bytes_method": "counted: ..."}
    got = prefer_measured_bytes(measured, extra)
    assert "bytes" not in got and "bytes_method" not in got  # the runtime's keys stay in summary.json
    assert got["bytes_computed"] == extra["bytes"] and got["bytes_computed_method"] == "computed ..."
    assert got["x"] == 1 and got["codecs"]["control"] == "raw"


def test_sync_policy_follows_the_codec():
    from shoal.demo.cli import sync_policy

    assert sync_policy("raw").act_compression == 1.0
    q = sync_policy("int8")
    assert q.act_compression == pytest.approx((1 + 4 / 128) / 4) and q.grad_compression == 1.0  # pulls are raw


def test_demo_runs_the_planners_choice_by_default(tmp_path):
    """``--sync auto`` is the default: the demo runs the policy plan_auto picks for its one
    pipeline (mode, H, codec per kind); ``--sync exact`` stays exact and uncompressed;
    ``--compression`` pins the codecs."""
    import argparse

    from shoal.demo.cli import choose_sync, register
    from shoal.plan.auto import QualityBudget, plan_auto
    from shoal.plan.scenario import save_scenario

    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    args = ap.parse_args(["demo"])
    assert args.sync == "auto" and args.sync_every is None and DemoConfig().sync == "auto"
    sc, _ = demo_scenario(load_scenario("demo"), None, 12)
    save_scenario(sc, tmp_path / "s.json")
    em = emulation_spec(sc, str(tmp_path / "s.json"), model_task_s=1.2, bandwidth_scale=4.0, seed=0).emulated
    plan, cfg = choose_sync(DemoConfig(), em, 2)
    budget = QualityBudget(replicas=False)
    want = plan_auto(em, budget, seed=0, stages=2).sync
    assert len(plan.stages) == 2 and plan.sync == want
    assert cfg.sync == ("local" if want.local else "exact")
    assert cfg.sync_every == (want.sync_every if want.local else None)
    pol = [want.act_codec, want.grad_codec, want.push_codec, want.pull_codec]
    assert cfg.compression == ("none" if set(pol) == {"none"} else
                               ",".join(f"{k}={c}" for k, c in zip(("act", "grad", "push", "pull"), pol, strict=True)))
    exact_plan, exact = choose_sync(DemoConfig(sync="exact"), em, 2)
    assert exact.sync == "exact" and exact.compression == "none" and not exact_plan.sync.local
    _, pinned = choose_sync(DemoConfig(compression="int8", sync_every=8), em, 2)
    assert pinned.compression == "act=int8,grad=int8,push=int8,pull=int8"
    assert pinned.sync == "exact" or pinned.sync_every == 8
    with pytest.raises(ShoalError):
        DemoConfig(sync="exact", sync_every=4).validate()


def _hosts_everywhere(path: Path, workers: int | None = None):
    """The demo scenario with a server host in every region (``host-asia`` added), saved to
    ``path``, and its emulation: there the planner's replica clusters are the regions."""
    from dataclasses import replace

    from shoal.plan.scenario import save_scenario

    sc = load_scenario("demo")
    host = next(d for d in sc.devices if d.id == "host-us")
    save_scenario(replace(sc, name="demo-3-hosts", devices=[*sc.devices, replace(host, id="host-asia", region="asia")]),
                  path)
    sub, _ = demo_scenario(load_scenario(str(path)), workers, 12)
    save_scenario(sub, path.with_name("emulated-" + path.name))
    return emulation_spec(sub, str(path.with_name("emulated-" + path.name)), model_task_s=1.2, bandwidth_scale=4.0,
                          seed=0).emulated


def test_auto_without_stages_runs_the_planners_shape(tmp_path):
    """Without ``--stages`` ``--sync auto`` weighs one pipeline of any depth and pipeline replicas,
    and the demo runs the chosen shape: one pipeline of the planner's depth or its replicas;
    with a server host in every region replicas, passed on as the ``--replicas`` SPEC of the
    plan (its layer splits and micro-batch shares); ``--stages 2``
    gives one pipeline of 2 stages."""
    from shoal.demo.cli import _sync_text, choose_sync
    from shoal.plan.auto import QualityBudget, plan_auto
    from shoal.plan.scenario import save_scenario
    from shoal.runtime.sync.codecs import parse_run_compression
    from shoal.runtime.sync.replicas import parse_replica_plan, parse_replica_regions

    sc, _ = demo_scenario(load_scenario("demo"), None, 12)
    save_scenario(sc, tmp_path / "s.json")
    em = emulation_spec(sc, str(tmp_path / "s.json"), model_task_s=1.2, bandwidth_scale=4.0, seed=0).emulated
    plan, cfg = choose_sync(DemoConfig(), em, None)
    want = plan_auto(em, QualityBudget(), seed=0)
    if len(want.replicas) >= 2:  # the planner's choice, whichever shape: replicas as a --replicas SPEC
        assert cfg.replicas and cfg.stages == sum(len(r.stages) for r in want.replicas) == len(plan.all_stages)
    else:
        assert not cfg.replicas and cfg.stages == len(plan.stages) == len(want.stages)
    assert plan.sync == want.sync

    em3 = _hosts_everywhere(tmp_path / "s3.json", workers=6)
    plan, cfg = choose_sync(DemoConfig(), em3, None)
    assert len(plan.replicas) >= 2 and cfg.sync == "local" and cfg.replicas
    assert plan.sync.pull_codec == parse_run_compression(cfg.compression).pull  # the planner's codec, sparse or not
    counts, mbs, layers = parse_replica_plan(cfg.replicas, plan.micro_batches, 6)
    assert counts == [len(r.stages) for r in plan.replicas] and mbs == [r.micro_batches for r in plan.replicas]
    assert parse_replica_regions(cfg.replicas) == [r.cluster for r in plan.replicas]
    assert layers == [s.layers[1] - s.layers[0] for r in plan.replicas for s in r.stages]
    assert cfg.stages == sum(counts) and cfg.sync_every == plan.sync.sync_every
    one, cfg2 = choose_sync(DemoConfig(stages=2), em3, 2)
    assert not one.replicas and len(one.stages) == 2 and cfg2.stages == 2 and not cfg2.replicas
    _, exact = choose_sync(DemoConfig(sync="exact"), em3, None)
    assert exact.stages == 2 and not exact.replicas  # exact and local keep 2 stages unless told
    hand_plan, hand = choose_sync(DemoConfig(replicas="1,2"), em3, None)
    assert hand.stages == 3 and hand.sync == "local" and [len(r.stages) for r in hand_plan.replicas] == [1, 2]
    assert _sync_text(hand, "auto", by_hand=True).endswith("(replicas given by hand)")
    assert _sync_text(cfg, "auto").endswith("(auto: the planner's choice)") and cfg.replicas in _sync_text(cfg, "auto")
    # lean workers: the planner's choice travels to the run's config; asked for, local mode prices them
    assert cfg.lean == plan.sync.lean
    lean_plan, lean_cfg = choose_sync(DemoConfig(sync="local", lean=True), em3, None)
    assert lean_plan.sync.lean and lean_cfg.lean and "lean workers" in _sync_text(lean_cfg, "local")
    for bad in (DemoConfig(sync="exact", lean=True), DemoConfig(lean=True)):
        with pytest.raises(ShoalError, match="--lean-workers applies to --sync local"):
            bad.validate()


def test_auto_takes_int8_where_sparse_buys_no_speed(tmp_path):
    """At the demo's x4 links sparse pushes and pulls are no faster than int8: auto takes int8
    (pure rule: :func:`shoal.plan.auto.lighter`). On the scenario's own links, 100x slower, a
    codec of ~100x fewer bytes than int8 is faster and stays."""
    from shoal.plan.auto import QualityBudget, lighter, plan_auto
    from shoal.plan.scenario import save_scenario
    from shoal.plan.types import SyncPolicy

    sc, _ = demo_scenario(load_scenario("demo"), None, 12)
    save_scenario(sc, tmp_path / "s.json")
    budget = QualityBudget(replicas=False)
    for scale, light in ((4.0, True), (0.01, False)):
        em = emulation_spec(sc, str(tmp_path / "s.json"), model_task_s=1.2, bandwidth_scale=scale, seed=0).emulated
        got = plan_auto(em, budget, stages=2).sync
        assert got.local, scale
        if light:
            assert (got.push_codec, got.pull_codec) == ("int8", "int8"), scale
        else:  # a codec of ~100x fewer bytes: sparse, or lowrank where it is as fast (less loss)
            assert got.push_codec.split(":")[0] in ("sparse", "lowrank") and got.pull_codec == got.push_codec, scale
    pol = SyncPolicy(mode="local", sync_every=4, push_codec="sparse", pull_codec="sparse")
    assert lighter(pol, budget) == [SyncPolicy(mode="local", sync_every=4, push_codec="int8", pull_codec="int8"),
                                    SyncPolicy(mode="local", sync_every=4, push_codec="lowrank", pull_codec="lowrank")]
    assert lighter(pol, QualityBudget(codecs=("none", "sparse"))) == []
    assert lighter(pol, QualityBudget(pin_codecs={"act": "none", "grad": "none", "push": "sparse",
                                                  "pull": "sparse"})) == []
    assert lighter(SyncPolicy(mode="local", sync_every=4, push_codec="int8", pull_codec="int8"), budget) == []
    low = SyncPolicy(mode="local", sync_every=4, push_codec="lowrank", pull_codec="lowrank")
    assert lighter(low, budget) == [SyncPolicy(mode="local", sync_every=4, push_codec="int8", pull_codec="int8")]


def test_default_out_is_a_timestamped_runs_folder():
    assert default_out(0).startswith("runs/demo-") and len(default_out(0)) == len("runs/demo-YYYYmmdd-HHMMSS")


class _Proc:
    def __init__(self, alive=True):
        self.alive = alive

    def poll(self):
        return None if self.alive else -9


class _Swarm:
    """Process table stand-in: records kills/starts, keeps liveness."""

    def __init__(self, n):
        self.workers = [_Proc() for _ in range(n)]
        self.calls = []

    def kill_worker(self, i):
        self.workers[i].alive = False
        self.calls.append(("kill", i))

    def start_worker(self, i):
        self.workers[i] = _Proc()
        self.calls.append(("start", i))


def test_swarm_churn_keeps_min_live_and_never_doubles_a_worker():
    spec = emulation_spec(load_scenario("demo"), "demo")
    a, b, c = spec.workers[:3]
    swarm = _Swarm(3)
    sched = [(0.0, a, "leave"), (0.01, b, "leave"), (0.02, c, "join"), (0.03, a, "join"), (0.04, b, "join")]
    drv = swarm_churn(swarm, spec, sched, min_live=2).start()
    drv.join(timeout=10)
    # b's leave would leave 1 < 2 live: skipped, and so its join (still running); c never left
    assert swarm.calls == [("kill", 0), ("start", 0)]
    assert [ok for *_, ok in drv.done] == [True, False, False, True, False]


def _procs_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line mentions ``text`` (our run folder)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().split()[2]
        except OSError:
            continue
        if text in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


def _demo_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shoal.cli", "demo", "--out", str(out), "--workers", "4", *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_demo_command_end_to_end(tmp_path):
    out = tmp_path / "run"
    # two stages, so every traffic kind flows (the default shape is the planner's: below)
    r = subprocess.run(_demo_cmd(out, "--steps", "3", "--task-time", "0.6", "--stages", "2"), capture_output=True,
                       text=True, env=_env(), timeout=230)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"report: {out / 'report'}" in r.stdout.splitlines()
    for name in REPORT_FILES:
        assert (out / "report" / name).stat().st_size > 0, name
    assert (out / "checkpoint").is_dir() and (out / "logs").is_dir() and (out / "scenario.json").is_file()
    rep = json.loads((out / "report" / "report.json").read_text())
    assert rep["steps"] == 3 and rep["final_loss"] < rep["first_loss"] + 0.5
    st = rep["step_time"]
    assert st["predicted_s"] > 0 and st["simulated_s"] > 0 and st["achieved_s"] > 0
    assert len(rep["plan"]["stages"]) == 2
    assert all(rep["bytes"][k]["raw"] > 0 for k in ("activations", "activation_grads", "grad_push", "weight_pull"))
    assert rep["bytes_method"].startswith("counted")  # measured by the runtime, not computed
    assert "control" in rep["bytes"]
    assert rep["sample_text"] and not rep["sample_text"].startswith("(no sample")
    md = (out / "report" / "report.md").read_text()
    assert "## Plan" in md and "## Bytes on the wire" in md and "failures survived" in md
    assert _procs_mentioning(str(out)) == []  # every child is gone


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_demo_runs_the_replicas_auto_chooses(tmp_path):
    """The default ``shoal demo`` (``--sync auto``, no ``--stages``) on a scenario where the
    planner chooses pipeline replicas runs them: the coordinator's plan has the planner's replica
    shapes, the replicas end with equal weights, and the report says it was auto's choice."""
    _hosts_everywhere(tmp_path / "s3.json")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "shoal.cli", "demo", "--out", str(out), "--scenario",
                        str(tmp_path / "s3.json"), "--workers", "6", "--steps", "3", "--task-time", "0.6",
                        "--no-churn", "--quiet", "--no-dashboard"], capture_output=True, text=True, env=_env(),
                       timeout=140)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    choice = summary["sync_choice"]
    assert choice["by"] == "auto" and choice["replicas"] and "auto: the planner's choice" in choice["ran"]
    planned = summary["demo_plan"]["replicas"]
    assert len(planned) >= 2 and "pull=sparse" not in choice["compression"]
    replan = next(e for e in (json.loads(x) for x in (out / "events.jsonl").read_text().splitlines())
                  if e.get("event") == "replan" and e.get("layers"))
    assert replan["replicas"] == {"stages": [len(p["stages"]) for p in planned],
                                  "micro_batches": [p["micro_batches"] for p in planned]}
    assert replan["layers"] == [s["layers"] for p in planned for s in p["stages"]]
    # every replica is staffed from its planned cluster's regions (w{i} plays the i-th worker device)
    region = {f"w{i}": d.region for i, d in enumerate(load_scenario(str(out / "scenario.json")).workers)}
    replica_of = [r for r, p in enumerate(planned) for _ in p["stages"]]
    assert all(region[w] in planned[replica_of[s]]["cluster"].split("+") for w, s in replan["assignment"].items())
    assert all("@" in item for item in choice["replicas"].split(","))
    assert summary["replicas"]["final_weights_differ"] == []
    rep = json.loads((out / "report" / "report.json").read_text())
    assert rep["steps"] == 3 and len(rep["plan"]["replicas"]) == len(planned)
    st = rep["step_time"]
    assert st["predicted_s"] > 0 and st["simulated_s"] > 0 and st["achieved_s"] > 0
    md = (out / "report" / "report.md").read_text()
    assert "(auto: the planner's choice)" in md and "| stage | replica (micro-batches) |" in md
    assert _procs_mentioning(str(out)) == []


@pytest.mark.integration
@pytest.mark.timeout(150)
def test_demo_ctrl_c_kills_every_child_and_keeps_the_run_folder(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen(_demo_cmd(out, "--steps", "50", "--quiet"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 120
        # wait until the swarm runs: a worker has joined the coordinator
        while time.time() < deadline:
            ev = out / "events.jsonl"
            if ev.exists() and '"role": "worker"' in ev.read_text():
                break
            assert p.poll() is None, p.communicate()
            time.sleep(0.2)
        assert len(_procs_mentioning(str(out))) >= 4  # coordinator, servers, workers
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 2 and "interrupted" in err
    assert _procs_mentioning(str(out)) == []
    assert (out / "logs" / "coordinator.log").is_file() and (out / "report" / "report.md").is_file()
