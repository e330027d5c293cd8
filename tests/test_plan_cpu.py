"""The framework's own CPU in the cost model, the planner, the report and the simulator: a stage
server host with too few cores saturates, the planner avoids it or stops feeding it workers, the
report names it, and the simulator charges the same CPU (shoal.plan.types.FrameworkCpu)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shoal.errors import ShoalError
from shoal.plan import load_scenario, make_plan, predict, scenario_from_dict
from shoal.plan.cost import (
    coordinator_cores,
    coordinator_floor,
    coordinator_member_limit,
    exact_server_cpu,
    scenario_profile,
    server_cpu_caps,
    server_cpu_per_step,
    worker_task_compute,
)
from shoal.plan.report import IDLE_SERVER_CPU, swarm_report
from shoal.plan.saturation import fit_coordinator, unfed_workers
from shoal.plan.scenario import scenario_to_dict
from shoal.plan.types import FrameworkCpu, Plan, StagePlan
from shoal.sim import SimConfig, simulate
from tests.helpers.scenarios import FREE_CPU


def _scenario(n_workers=4, cores=1, server_task_ms=50.0, worker_task_ms=0.0, far_cores=None, member_ms=0.0,
              tflops=1.0):
    """``n_workers`` tiny-model workers (``tflops`` TFLOP/s) and a server host ``h`` with ``cores`` cores
    in region a; with ``far_cores``, a second host ``far`` in region b, 40 ms away."""
    devices = [{"id": f"w{i}", "tflops": tflops, "memory_gb": 8, "region": "a", "up_mbps": 200, "down_mbps": 200}
               for i in range(n_workers)]
    devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 10, "down_gbps": 10,
                    "can_host_server": True, "cores": cores})
    net = {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}}
    if far_cores is not None:
        devices.append({"id": "far", "tflops": 0, "memory_gb": 0, "region": "b", "up_gbps": 10, "down_gbps": 10,
                        "can_host_server": True, "cores": far_cores})
        net["intra"]["b"] = {"latency_ms": 5, "bandwidth_gbps": 1}
        net["inter"] = [{"regions": ["a", "b"], "latency_ms": 40, "bandwidth_gbps": 1}]
    return scenario_from_dict({
        "name": "cpu-hand",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 16, "micro_batch_size": 2, "dtype": "fp32"},
        "network": net,
        "devices": devices,
        "framework_cpu": {**FREE_CPU, "server_task_ms": server_task_ms, "worker_task_ms": worker_task_ms,
                          "coordinator_member_ms": member_ms},
    })


def _two_stage_plan(workers=("w0", "w1", "w2", "w3"), m=8):
    half = len(workers) // 2
    return Plan("cpu-hand", "tiny", "hand", [StagePlan((0, 3), "h", list(workers[:half])),
                                             StagePlan((3, 6), "h", list(workers[half:]))], 2, m)


def test_scenario_file_carries_cores_and_framework_cpu():
    s = _scenario(cores=3, server_task_ms=12.5)
    assert s.device("h").cores == 3 and s.cpu.server_task_s == pytest.approx(0.0125)
    back = scenario_from_dict(scenario_to_dict(s))
    assert back.device("h").cores == 3 and back.cpu == s.cpu
    d = scenario_to_dict(s)
    d["framework_cpu"]["server_task_ms"] = -1
    with pytest.raises(ShoalError, match="framework_cpu.server_task_ms"):
        scenario_from_dict(d)
    d = scenario_to_dict(s)
    d["framework_cpu"]["lease_ms"] = 1
    with pytest.raises(ShoalError, match="unknown field"):
        scenario_from_dict(d)
    d = scenario_to_dict(s)
    d["devices"][-1]["cores"] = 0
    with pytest.raises(ShoalError, match="cores must be a positive integer"):
        scenario_from_dict(d)
    # without a framework_cpu section a scenario has today's measured figures
    assert load_scenario("gaming-eu").cpu == FrameworkCpu()


def test_worker_task_compute_by_hand():
    assert worker_task_compute(0.5, 1.0, False, 0.1) == 1.5  # compute binds: the plain sum
    assert worker_task_compute(0.05, 1.0, False, 0.1) == pytest.approx(1.1)  # the forward is CPU-bound
    assert worker_task_compute(0.02, 0.03, True, 0.1) == 0.1  # one task on the last stage


def test_server_cpu_caps_and_step_floor_by_hand():
    s = _scenario(cores=1, server_task_ms=50.0)
    p = _two_stage_plan()
    # per step: M (2 + 1) tasks on host h, 50 CPU-ms each, on one core
    demand = 8 * 3 * 0.05
    assert server_cpu_caps(p, s) == [[pytest.approx(8 / demand), pytest.approx(8 / demand)]]
    assert server_cpu_per_step(p, s) == {"h": pytest.approx(demand)}
    pred = predict(p, s)
    assert pred["step_time_s"] >= demand  # the host's CPU, not the workers, sets the step
    assert pred["server_cpu_share"] == pytest.approx(demand / pred["step_time_s"])
    assert pred["throughput_mb_s"] == pytest.approx(8 / demand)
    # the same plan with the host's CPU at 64 cores: the workers set the pace again
    fast = predict(_two_stage_plan(), _scenario(cores=64, server_task_ms=50.0))
    assert fast["step_time_s"] < 0.5 * demand and fast["server_cpu_share"] < 0.5


def test_server_cpu_per_byte_of_activation_by_hand():
    """A task's result costs its servers CPU per byte it carries (``server_task_byte_s``): the
    forward output of every stage but the last, the input gradient of every stage but the first,
    as sent (with the run's codecs). The model's host demand and step, and the simulator's step,
    grow with it; a scenario file sets it in ns a byte."""
    from shoal.plan.cost import micro_batch_handling, stage_result_bytes
    from shoal.plan.types import SyncPolicy

    s = _scenario(cores=1, server_task_ms=0.0)
    prof = scenario_profile(s, 2)
    hidden = prof.layers[0].out_act_bytes  # B x T x d x 4 bytes (fp32)
    assert hidden == 2 * 64 * scenario_profile(s).cfg.d_model * 4
    plain = SyncPolicy()
    assert stage_result_bytes(prof, plain, True, False) == hidden  # first stage: its output only
    assert stage_result_bytes(prof, plain, False, True) == hidden  # last stage: its input's gradient
    assert stage_result_bytes(prof, plain, False, False) == 2 * hidden
    assert stage_result_bytes(prof, plain, True, True) == 0.0  # one stage: nothing leaves it
    int8 = SyncPolicy(act_codec="int8")
    assert stage_result_bytes(prof, int8, True, False) == pytest.approx(
        hidden * int8.ratio("act", prof.dtype_bytes, *prof.act_shape))
    assert stage_result_bytes(prof, int8, True, False) < 0.3 * hidden
    cpu = dataclasses.replace(s.cpu, server_task_s=1e-3, server_task_byte_s=2e-9)
    assert micro_batch_handling(False, 1e6, cpu) == pytest.approx(2 * 1e-3 + 2e-3)  # 2 tasks + 1 MB
    assert micro_batch_handling(True, 1e6, cpu) == pytest.approx(1e-3 + 2e-3)

    plan = _two_stage_plan()
    base_model, base_sim = predict(plan, s)["step_time_s"], simulate(plan, s, steps=3, seed=0).mean_step_time_s
    per_byte = 0.05 / hidden  # 50 ms of one core for each hidden-sized result
    s.cpu = dataclasses.replace(s.cpu, server_task_byte_s=per_byte)
    demand = 8 * (hidden + hidden) * per_byte  # M = 8: stage 0's outputs and stage 1's input gradients
    assert server_cpu_per_step(plan, s) == {"h": pytest.approx(demand)}
    assert server_cpu_caps(plan, s) == [[pytest.approx(8 / demand), pytest.approx(8 / demand)]]
    model, sim = predict(plan, s)["step_time_s"], simulate(plan, s, steps=3, seed=0).mean_step_time_s
    assert model >= demand > 2 * base_model and sim >= demand > 2 * base_sim  # the host's CPU sets the step
    assert sim == pytest.approx(model, rel=0.15)
    d = scenario_to_dict(s)
    assert d["framework_cpu"]["server_task_ns_per_byte"] == pytest.approx(per_byte * 1e9)
    assert scenario_from_dict(d).cpu.server_task_byte_s == pytest.approx(per_byte)


def test_activation_codec_cpu_by_hand_in_the_model_and_the_simulator():
    """The activation codecs' CPU (``compression.ACT_CODEC_CPU_S`` per element, times
    ``act_codec_scale``): a worker decodes its input and encodes its output in series with its
    compute (``stage_codec_cpu``: forward and backward of a first stage, the last stage's one
    task), each lossy result is decoded once, by the server it is sent to (``stage_result_decode``;
    the next server keeps the relay undecoded; raw is checked as received); the model's task times and host demand and the simulator's step grow with it."""
    from shoal.plan.compression import ACT_CODEC_CPU_S
    from shoal.plan.cost import (
        server_task_demand,
        stage_codec_cpu,
        stage_costs,
        stage_result_decode,
    )
    from shoal.plan.types import SyncPolicy

    s = _scenario(cores=64, server_task_ms=0.0)  # (cores to spare: the workers' codecs set the step)
    s.cpu = dataclasses.replace(s.cpu, act_codec_scale=1.0)
    prof = scenario_profile(s, 2)
    n = 2 * 64 * prof.cfg.d_model  # one micro-batch's activation: B x T x d elements
    (ae, ad), (ge, gd) = ACT_CODEC_CPU_S["quad-pc"], ACT_CODEC_CPU_S["tern-dither"]
    q = SyncPolicy(act_codec="quad-pc", grad_codec="tern-dither")
    assert stage_codec_cpu(prof, q, True, False, s.cpu) == pytest.approx((n * ae, n * gd))
    assert stage_codec_cpu(prof, q, False, False, s.cpu) == pytest.approx((n * (ad + ae), n * (gd + ge)))
    assert stage_codec_cpu(prof, q, False, True, s.cpu) == pytest.approx((n * (ad + ge), 0.0))
    assert stage_codec_cpu(prof, q, True, True, s.cpu) == (0.0, 0.0)  # one stage: nothing leaves it
    assert stage_result_decode(prof, q, True, False, s.cpu) == pytest.approx(n * ad)
    assert stage_result_decode(prof, q, False, True, s.cpu) == pytest.approx(n * gd)
    assert stage_result_decode(prof, SyncPolicy(), False, False, s.cpu) == 0.0  # raw: checked as received
    assert stage_codec_cpu(prof, q, False, True, dataclasses.replace(s.cpu, act_codec_scale=0.0)) == (0.0, 0.0)

    # the production path: a plan's task times, its host's demand and the simulated step
    plan = _two_stage_plan(workers=("w0", "w1"))  # one worker a stage: M = 8 tasks each in series
    plan.sync = q
    s.cpu = dataclasses.replace(s.cpu, act_codec_scale=0.0)
    free_times = [dict(c.task_times) for c in stage_costs(plan, s)]
    free_sim = simulate(plan, s, steps=3, seed=0).mean_step_time_s
    scale = 40.0  # tiny's activations are small: scaled up until the codecs are most of a task
    s.cpu = dataclasses.replace(s.cpu, act_codec_scale=scale)
    for i, c in enumerate(stage_costs(plan, s)):
        extra = sum(stage_codec_cpu(prof, q, i == 0, i == 1, s.cpu))
        assert extra > 0
        for w, t in c.task_times.items():
            assert t == pytest.approx(free_times[i][w] + extra, rel=0.02)
    decode = 8 * (stage_result_decode(prof, q, True, False, s.cpu) + stage_result_decode(prof, q, False, True, s.cpu))
    assert server_task_demand(plan, s) == {"h": pytest.approx(decode)}
    model, sim = predict(plan, s)["step_time_s"], simulate(plan, s, steps=3, seed=0).mean_step_time_s
    # each worker runs all 8 micro-batches of its stage, each its codecs longer
    assert sim > free_sim + 7 * min(sum(stage_codec_cpu(prof, q, i == 0, i == 1, s.cpu)) for i in (0, 1))
    assert sim == pytest.approx(model, rel=0.15)
    # four workers a stage on a one-core host: the servers' decoding sets the step
    s = _scenario(n_workers=8, cores=1, server_task_ms=0.0)
    s.cpu = dataclasses.replace(s.cpu, act_codec_scale=2 * scale)
    decode *= 2
    plan = _two_stage_plan(workers=tuple(f"w{i}" for i in range(8)))
    plan.sync = q
    model, sim = predict(plan, s)["step_time_s"], simulate(plan, s, steps=3, seed=0).mean_step_time_s
    assert server_task_demand(plan, s) == {"h": pytest.approx(decode)}
    assert decode > 1.5 * free_sim and model >= decode and sim >= decode
    assert sim == pytest.approx(model, rel=0.15)


def test_simulator_step_grows_with_server_cpu_and_agrees_with_the_model():
    steps = []
    for ms in (0.0, 10.0, 50.0):
        s = _scenario(cores=1, server_task_ms=ms)
        p = _two_stage_plan()
        pred = predict(p, s)["step_time_s"]
        r = simulate(p, s, steps=3)
        steps.append(r.mean_step_time_s)
        assert r.mean_step_time_s == pytest.approx(pred, rel=0.15), ms
    assert steps[0] < steps[1] < steps[2]
    assert steps[2] >= 8 * 3 * 0.05  # saturated: at least the host's CPU per step


def test_a_local_merge_holds_its_round_for_its_cpu_in_the_model_and_the_simulator():
    """merge_cpu_time by hand (the last push's decode, each push's screen and sum, the pull's
    encoding and decoding; the norms, the sums and the lowrank decode on merge_cores, the host's
    cores shared by its servers, at most MERGE_THREADS) and its place in the round: local mode,
    H = 1, no overlap, so the step waits for
    the whole round; the simulator's step grows by the same merge as the cost model's (both
    steps differ by about 0.03 s of round latencies on this hand scenario, merge or not)."""
    from shoal.plan.compression import codec_cpu_s
    from shoal.plan.cost import merge_cores, merge_cpu_time, scenario_profile
    from shoal.plan.types import SCREEN_SAMPLE, SyncPolicy

    pol = SyncPolicy(mode="local", sync_every=1, push_codec="lowrank", pull_codec="sparse", overlap=False)
    cpu = dataclasses.replace(FrameworkCpu(), server_codec_speedup=1.25)  # (apart from the merge's, so each is seen)
    n = 1_000_000
    by_hand = (n * (codec_cpu_s("lowrank")[1] + sum(codec_cpu_s("sparse")))
               + 3 * (n * cpu.server_merge_param_s + min(n, SCREEN_SAMPLE) * cpu.server_screen_sample_s))
    assert merge_cpu_time(n, 3, pol, cpu) == pytest.approx(by_hand)
    assert merge_cpu_time(n, 3, SyncPolicy(), cpu) == 0.0  # exact sync has no merge
    # an uncompressed pull is the weights as they are: encoded, not decoded again
    raw = dataclasses.replace(pol, pull_codec="none")
    assert merge_cpu_time(n, 3, raw, cpu) == pytest.approx(by_hand - n * sum(codec_cpu_s("sparse"))
                                                           + n * codec_cpu_s("none")[0])
    assert merge_cpu_time(n, 3, dataclasses.replace(pol, grad_compression=0.5), cpu) == pytest.approx(by_hand / 2)
    # the norms, cosines and weighted sum (server_merge_speedup) and the lowrank push's decode
    # (server_codec_speedup) on the server's merge threads, faster from 2 cores on (memory-bound);
    # the sparse pull's codec and the median's sample on one
    summed, decoded = 3 * n * cpu.server_merge_param_s, n * codec_cpu_s("lowrank")[1]
    assert cpu.server_merge_speedup != cpu.server_codec_speedup  # (each is taken where it belongs)
    for share in (1.0, 1.0, 0.5, 0.0):
        cores = 1.0 + share if share < 1.0 else 4.0
        speedup, threaded = 1 + (cpu.server_merge_speedup - 1) * share, 1 + (cpu.server_codec_speedup - 1) * share
        assert merge_cpu_time(n, 3, pol, cpu, cores) == pytest.approx(
            by_hand - summed - decoded + summed / speedup + decoded / threaded)
    assert merge_cores(dataclasses.replace(_two_stage_plan(), sync=pol), _scenario(cores=8)) == [[4.0, 4.0]]
    assert merge_cores(dataclasses.replace(_two_stage_plan(), sync=pol), _scenario(cores=2)) == [[1.0, 1.0]]
    steps, preds = [], []
    for merge_ms in (0.0, 200.0):  # CPU-ms per million parameters of each push
        d = scenario_to_dict(_scenario(cores=2, server_task_ms=0.0))
        d["framework_cpu"]["server_merge_ms_per_mparam"] = merge_ms
        s = scenario_from_dict(d)
        p = dataclasses.replace(_two_stage_plan(), sync=pol)
        pred = predict(p, s)["step_time_s"]
        r = simulate(p, s, steps=3)
        steps.append(r.mean_step_time_s)
        preds.append(pred)
        assert r.mean_step_time_s == pytest.approx(pred, rel=0.25), merge_ms
    prof = scenario_profile(s)
    slowest = max(merge_cpu_time(prof.params(*st.layers), len(st.workers), pol, s.cpu) for st in p.stages)
    assert slowest > 0.1  # (a stage's merge on its own core: the rounds of both stages run at once)
    assert preds[1] - preds[0] == pytest.approx(slowest, rel=0.02)
    assert steps[1] - steps[0] == pytest.approx(slowest, rel=0.02)


def test_simulator_charges_the_workers_cpu_beside_their_compute():
    base = simulate(_two_stage_plan(), _scenario(server_task_ms=0.0), steps=2).mean_step_time_s
    s = _scenario(server_task_ms=0.0, worker_task_ms=200.0)  # far above a tiny task's compute
    p = _two_stage_plan()
    r = simulate(p, s, steps=2)
    assert r.mean_step_time_s > base + 0.2
    assert r.mean_step_time_s == pytest.approx(predict(p, s)["step_time_s"], rel=0.15)


def test_planner_puts_servers_on_a_host_with_cores_to_spare():
    # the near host is 40 ms closer to every worker; with shoal's own CPU free it is the choice
    free = make_plan(_scenario(n_workers=6, cores=1, server_task_ms=0.0, far_cores=64))
    assert {st.server for st in free.stages} == {"h"}
    # at 50 CPU-ms a task its one core would saturate: the planner moves to the 64-core host
    busy_s = _scenario(n_workers=6, cores=1, server_task_ms=50.0, far_cores=64)
    busy = make_plan(busy_s)
    assert {st.server for st in busy.stages} == {"far"}
    assert busy.predicted["server_cpu_share"] < 0.5
    forced = Plan(busy.scenario, busy.model, "hand", [StagePlan(st.layers, "h", list(st.workers))
                                                      for st in busy.stages], busy.micro_batch_size,
                  busy.micro_batches, busy.sync)
    assert predict(forced, busy_s)["step_time_s"] > busy.predicted["step_time_s"]


def test_planner_stops_feeding_a_saturated_server_and_the_report_says_why():
    # slow workers (87 ms a micro-batch), so compute, not their links, sets their pace
    s = _scenario(n_workers=8, cores=1, server_task_ms=100.0, tflops=0.01)
    plan = make_plan(s, stages=1)
    used = len(plan.workers)
    assert 1 <= used < 8  # the host's one core handles 10 tasks/s: one or two workers feed it
    assert plan.predicted["server_cpu_share"] > 0.5  # busy most of the step (fill and drain aside)
    rep = swarm_report(plan, s)
    assert set(rep.idle.values()) == {IDLE_SERVER_CPU}
    assert "h" in rep.cpu_bound and "CPU-bound" in rep.summary()
    assert "server host h is CPU-bound" in next(iter(rep.why.values()))
    # the same swarm with a free framework uses every worker
    assert len(make_plan(_scenario(n_workers=8, cores=1, server_task_ms=0.0, tflops=0.01), stages=1).workers) == 8


def test_unfed_workers_by_hand():
    times = {"a": 1.0, "b": 0.5, "c": 2.0, "d": 4.0}
    assert unfed_workers(times, 2.5, 8) == ["c", "d"]  # b and a give 3 micro-batches/s >= 2.5
    assert unfed_workers(times, 10.0, 8) == []  # the cap does not bind
    assert unfed_workers(times, math.inf, 8) == []


def test_coordinator_membership_by_hand_and_the_issue_target():
    cpu = FrameworkCpu()  # today's measured figures
    # liveness of 1000 members plus two stage reports every 2 s: about 0.8 cores, under one
    assert coordinator_cores(1000, 2, 2.0, cpu) == pytest.approx(1000 * 0.8e-3 + 2 * 14e-3 / 2.0)
    assert coordinator_cores(1000, 2, 2.0, cpu) <= 1.0
    assert coordinator_floor(1000, 2, cpu) == pytest.approx(2 * 14e-3 / (1.0 - 0.8))
    assert coordinator_floor(1250, 2, cpu) == math.inf  # liveness alone needs the whole core
    assert coordinator_member_limit(0, 1.0, cpu) == 1249
    # a plan with more members than the coordinator keeps alive is cut to fit
    s = _scenario(n_workers=16, cores=64, server_task_ms=0.0, member_ms=100.0)  # 9 members per core
    p = Plan("cpu-hand", "tiny", "hand", [StagePlan((0, 6), "h", [f"w{i}" for i in range(16)])], 2, 8)
    assert predict(p, s)["step_time_s"] == math.inf
    fit = fit_coordinator(p, s)
    assert len(fit.workers) + 1 <= 9 and math.isfinite(fit.predicted["step_time_s"])
    assert fit.predicted["coordinator_cores"] <= 1.0
    assert len(make_plan(s).workers) + 1 <= 9


def test_default_per_message_figures_leave_a_builtin_plan_where_they_are_not_the_limit():
    s = load_scenario("gaming-eu")
    plan = make_plan(s)
    pred = dict(plan.predicted)
    assert pred["server_cpu_share"] < 0.2 and pred["coordinator_cores"] < 0.1
    free = dataclasses.replace(s.cpu, **{k: 0.0 for k in ("server_task_s", "server_task_byte_s", "worker_task_s",
                                                           "server_sync_s", "coordinator_member_s",
                                                           "coordinator_report_s")})
    s.cpu = free
    without = predict(plan, s)
    assert pred["step_time_s"] == pytest.approx(without["step_time_s"], rel=0.02)
    # ... while what an exact step's pushes, pulls and update cost per parameter is not small there
    # (gpt-1.3b stages of 300-400 M parameters: seconds of a server's CPU a worker)
    s.cpu = dataclasses.replace(free, server_push_param_s=0.0, server_pull_param_s=0.0, server_step_param_s=0.0)
    assert predict(plan, s)["step_time_s"] < 0.9 * without["step_time_s"]


def test_exact_sync_server_cpu_per_parameter_by_hand():
    cpu = dataclasses.replace(FrameworkCpu(), server_push_param_s=10e-9, server_pull_param_s=12e-9,
                              server_step_param_s=9.5e-9)
    p = 1e8
    per = 22e-9 * p  # one worker's push and pull
    assert exact_server_cpu(p, 1, cpu, 8) == pytest.approx(per + 9.5e-9 * p)
    assert exact_server_cpu(p, 8, cpu, 8) == pytest.approx(per + 9.5e-9 * p)  # one each on 8 cores
    assert exact_server_cpu(p, 9, cpu, 8) == pytest.approx(2 * per + 9.5e-9 * p)  # the ninth waits its turn
    assert exact_server_cpu(p, 3, cpu, 1) == pytest.approx(3 * per + 9.5e-9 * p)
    assert exact_server_cpu(0, 3, cpu, 1) == 0.0 and exact_server_cpu(p, 0, cpu, 1) == 0.0
    # the cost model adds it to an exact step's sync; the simulator charges the same
    s = _scenario(n_workers=4, cores=2, server_task_ms=0.0)
    plan = Plan("cpu-hand", "tiny", "hand", [StagePlan((0, 6), "h", ["w0", "w1", "w2", "w3"])], 2, 8)
    params = scenario_profile(s).params(0, 6)
    base = predict(plan, s)
    s.cpu = dataclasses.replace(s.cpu, server_push_param_s=1e-6, server_pull_param_s=2e-6, server_step_param_s=4e-6)
    charged = predict(plan, s)
    extra = 2 * 3e-6 * params + 4e-6 * params  # 4 workers on 2 cores: two turns, then the update
    assert charged["sync_s"] - base["sync_s"] == pytest.approx(extra, rel=1e-6)
    # ... and the report's busy share of the host counts all of it over its 2 cores
    assert server_cpu_per_step(plan, s)["h"] == pytest.approx((4 * 3e-6 + 4e-6) * params / 2)
    sim_base = simulate(plan, _scenario(n_workers=4, cores=2, server_task_ms=0.0), steps=3, seed=0)
    sim = simulate(plan, s, steps=3, seed=0)
    assert sim.mean_step_time_s - sim_base.mean_step_time_s == pytest.approx(extra, rel=0.1)
    # a scenario file may set them (ms per million parameters)
    d = scenario_to_dict(s)
    assert d["framework_cpu"]["server_step_ms_per_mparam"] == pytest.approx(4000.0)  # 4 us = 4,000 ms a million
    assert scenario_from_dict(d).cpu.server_pull_param_s == pytest.approx(2e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_every_micro_batch_exactly_once_under_churn_with_cpu_charged(seed):
    # the three-stage churn case of test_sim_engine, its servers' CPU charged at 20 ms a task on
    # one core each: deferred handling must still count every forward and gradient exactly once
    from tests.test_sim_engine import _assert_conserved, _three_stage

    p, scn = _three_stage(True, session=1.5)
    for d in scn.devices:
        if d.can_host_server:
            scn.devices[scn.devices.index(d)] = dataclasses.replace(d, cores=1)
    scn.cpu = dataclasses.replace(FrameworkCpu(), server_task_s=0.02, coordinator_member_s=0.0)
    r = simulate(p, scn, steps=8, churn=True, seed=seed, config=SimConfig(lease_timeout_s=0.3))
    assert r.steps == 8 and r.leaves > 0
    _assert_conserved(r, 3, 24)


def test_shoal_plan_prints_the_framework_cpu_and_the_saturated_host(tmp_path, capsys):
    from shoal.cli import main
    from shoal.plan.scenario import save_scenario

    path = tmp_path / "cpu.json"
    save_scenario(_scenario(n_workers=8, cores=1, server_task_ms=100.0, tflops=0.01), path)
    assert main(["plan", "--scenario", str(path), "--stages", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "framework CPU: the busiest server host's cores" in out
    assert "idle for server CPU" in out and "server host h is CPU-bound" in out


def test_a_repair_keeps_the_members_the_coordinator_can_keep_alive():
    # 16 workers, 9 members per coordinator core, a plan over the limit losing a stage's only
    # worker: the repaired plan fits the coordinator
    from shoal.plan import repair

    s = _scenario(n_workers=16, cores=64, server_task_ms=0.0, member_ms=100.0)
    p = Plan("cpu-hand", "tiny", "hand", [StagePlan((0, 3), "h", [f"w{i}" for i in range(15)]),
                                          StagePlan((3, 6), "h", ["w15"])], 2, 8)
    q = repair(p, s, left=["w15"])
    assert len(q.workers) + 1 <= 9 and "w15" not in q.workers
    assert math.isfinite(q.predicted["step_time_s"])


def test_the_screens_reference_gradient_by_hand():
    """reference_cpu_time: forward and backward of at most 4 micro-batches and at most
    SCREEN_REF_TOKENS tokens at server_flops a core, on reference_cores cores (one thread a
    micro-batch, the host's cores shared by its stage servers); local_round_wait: a round's
    merge waits for it, so the steps wait for ``P + reference + merge - H P`` where positive."""
    from shoal.plan.cost import (
        local_round_wait,
        reference_cores,
        reference_cpu_time,
        reference_tokens,
    )
    from shoal.plan.types import SCREEN_REF_MBS, SCREEN_REF_TOKENS, SyncPolicy

    pol = SyncPolicy(mode="local", sync_every=8)
    cpu = FrameworkCpu(server_flops=1e9)
    assert reference_tokens(64) == min(SCREEN_REF_MBS * 64, SCREEN_REF_TOKENS) == 256
    assert reference_tokens(1024) == SCREEN_REF_TOKENS
    assert reference_cpu_time(2e6, 1024, pol, cpu) == pytest.approx(SCREEN_REF_TOKENS * 2e6 / 1e9)
    assert reference_cpu_time(2e6, 1024, pol, cpu, 4.0) == pytest.approx(SCREEN_REF_TOKENS * 2e6 / 1e9 / 4)
    assert reference_cpu_time(2e6, 1024, SyncPolicy(), cpu) == 0.0  # exact sync has no merge screen
    half = dataclasses.replace(pol, grad_compression=0.5)
    assert reference_cpu_time(2e6, 1024, half, cpu) == pytest.approx(reference_cpu_time(2e6, 1024, pol, cpu) / 2)
    # two stages on an 8-core host: 4 cores each (one thread a micro-batch, at most 4); on a
    # 1-core host they share it (at least one core each); a replica of 2 micro-batches: 2 threads
    s = _scenario(cores=8)
    p = dataclasses.replace(_two_stage_plan(), sync=pol)
    assert reference_cores(p, s) == [[4.0, 4.0]]
    assert reference_cores(p, _scenario(cores=1)) == [[1.0, 1.0]]
    assert reference_cores(dataclasses.replace(p, micro_batches=2), s) == [[2.0, 2.0]]
    assert reference_cores(p, _scenario(cores=3)) == [[1.5, 1.5]]
    # the round: hidden behind H P = 8 s when P + ref + merge fits, the rest waited for
    assert local_round_wait([], 0.0, 8, 1.0, True, 0.5, 6.0) == (0.5, 0.0)
    assert local_round_wait([], 0.0, 8, 1.0, True, 0.5, 9.0)[1] == pytest.approx(1.0 + 9.0 + 0.5 - 8.0)
    # without overlap it has the round's other steps and the pushes: 7 s + 2 L + push
    links = [(0.3, 0.2, 0.0, 0.0)]
    full, wait = local_round_wait(links, 0.01, 8, 1.0, False, 0.5, 9.0)
    assert wait == pytest.approx(full + 9.0 + 1.0 - 8.0 - (0.02 + 0.3))


def test_a_local_merge_waits_for_the_reference_in_the_model_and_the_simulator():
    """Local mode, H = 1, no overlap, a server core of a few MFLOP/s: the reference gradient
    (started at the step's commit) takes far longer than the pushes, and the simulator's step
    grows by the same as the cost model's when the reference is made slower."""
    from shoal.plan.cost import reference_cores, reference_cpu_time, scenario_profile
    from shoal.plan.types import SyncPolicy

    pol = SyncPolicy(mode="local", sync_every=1, overlap=False)
    steps, preds, refs = [], [], []
    for gflops in (1.0, 0.5):
        d = scenario_to_dict(_scenario(cores=2, server_task_ms=0.0))
        d["framework_cpu"]["server_gflops"] = gflops
        s = scenario_from_dict(d)
        p = dataclasses.replace(_two_stage_plan(), sync=pol)
        preds.append(predict(p, s)["step_time_s"])
        steps.append(simulate(p, s, steps=3).mean_step_time_s)
        prof = scenario_profile(s)
        cores = reference_cores(p, s)[0]
        refs.append(max(reference_cpu_time((prof.fwd_flops(*st.layers) + prof.bwd_flops(*st.layers))
                                           / prof.tokens_per_micro_batch, prof.tokens_per_micro_batch, pol, s.cpu, k)
                        for st, k in zip(p.stages, cores, strict=True)))
    assert refs[0] > 1.0  # far above the round's pushes and the steps
    assert refs[1] == pytest.approx(2 * refs[0])
    assert preds[1] - preds[0] == pytest.approx(refs[0], rel=0.02)
    assert steps[1] - steps[0] == pytest.approx(refs[0], rel=0.02)
    assert steps[0] == pytest.approx(preds[0], rel=0.1)
