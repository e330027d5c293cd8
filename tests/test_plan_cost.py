"""The cost model against hand-computed small cases."""


import pytest

from shoal.plan import predict, scenario_from_dict
from shoal.plan.cost import (
    CostOptions,
    flow_bandwidth,
    pipeline_time,
    stage_costs,
    stage_sync_time,
    stage_throughput,
    step_time,
    sync_time,
    transfer_time,
)
from shoal.plan.types import Plan, StagePlan, SyncPolicy
from tests.helpers.scenarios import FREE_CPU, hand_scenario

# tiny model, T=64, B=2 (128 tokens): forward FLOPs per token = 4 blocks x (2(4d^2 + 3df) + 4Td)
# + head 2dV = 4 x 434176 + 524288 = 2260992; forward + backward = 3x; x 128 tokens.
TINY_FLOPS_PER_MB = 3 * 2260992 * 128
TINY_PARAMS = 2048 * 128 + 4 * (4 * 128**2 + 3 * 128 * 352 + 2 * 128) + (128 * 2048 + 128)
HIDDEN = 2 * 64 * 128 * 4  # B*T*d fp32
TOKENS = 2 * 64 * 8  # int64 ids


scenario = hand_scenario


def plan(stages, m=4):
    return Plan("hand", "tiny", "test", stages, micro_batch_size=2, micro_batches=m)


def test_pure_formulas():
    assert transfer_time(0, 0.1, 1e6) == 0.0
    assert transfer_time(1e6, 0.1, 1e6) == pytest.approx(1.1)
    assert flow_bandwidth(100.0, 50.0, 400.0, 1, 4) == 50.0
    assert flow_bandwidth(100.0, 500.0, 400.0, 1, 8) == 50.0
    assert stage_throughput([1.0, 2.0, 4.0], 8) == pytest.approx(1.75)
    assert stage_throughput([1.0, 2.0, 4.0], 2) == pytest.approx(1.5)  # only M workers get tasks
    assert pipeline_time(5, [2.0, 1.0], [0.5, 0.25]) == pytest.approx(4 + 0.75)
    assert sync_time(100.0, 0.5, 0.01, 10.0, 50.0) == pytest.approx(0.03 + 5 + 1)
    assert stage_sync_time(0.01, 4.0, 2.0) == pytest.approx(6.03)
    assert stage_sync_time(0.01, 4.0, 2.0, sync_every=3) == pytest.approx(2.01)
    assert sync_time(100.0, 1.0, 0.0, 10.0, 10.0, sync_every=4) == pytest.approx(5.0)
    assert step_time(3.0, 2.0) == 5.0 and step_time(3.0, 2.0, overlap_sync=True) == 3.0


def test_one_stage_one_worker_by_hand():
    s = scenario(1)
    p = plan([StagePlan((0, 6), "h", ["w0"])])
    r = predict(p, s)
    compute = TINY_FLOPS_PER_MB / 1e12
    # stage 0 is also the last: one task per micro-batch whose lease round trip costs 2 x 5 ms;
    # token ids and targets come from the server over the worker's 200 Mbit/s downlink (25e6 B/s).
    tau = compute + 0.010 + 2 * TOKENS / 25e6
    assert r["pipeline_s"] == pytest.approx(3 * tau + tau)
    pbytes = TINY_PARAMS * 4
    sync = 0.015 + pbytes / 2.5e6 + pbytes / 25e6  # push over 20 Mbit/s up, pull over 200 down, 3 latencies
    assert r["sync_s"] == pytest.approx(sync)
    assert r["step_time_s"] == pytest.approx(4 * tau + sync)
    assert p.predicted["step_time_s"] == r["step_time_s"]
    assert r["compute_s"] + r["transfer_s"] == pytest.approx(r["pipeline_s"])
    assert r["compute_s"] == pytest.approx(4 * tau * compute / tau)
    assert r["bottleneck_stage"] == 0
    # the one worker computes 4 micro-batches per step
    assert r["utilisation"] == pytest.approx(4 * compute / r["step_time_s"])
    need = 2 * pbytes + 0  # weights + grads; saved activations added below
    assert 0 < r["memory_headroom"] < 1 - need / 8e9
    over = predict(p, s, CostOptions(overlap_sync=True))
    assert over["step_time_s"] == pytest.approx(max(4 * tau, sync))


def test_two_stages_share_the_server_link_by_hand():
    s = scenario(3)
    p = plan([StagePlan((0, 3), "h", ["w0", "w1"]), StagePlan((3, 6), "h", ["w2"])])
    costs = stage_costs(p, s)
    # Stage 0 worker: tokens in, hidden out to stage 1's server, output-gradient in; 3 transfers.
    # The host's 10 Gbit/s is shared by 3 workers but their own 20/200 Mbit/s links are tighter.
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    c0 = (prof.fwd_flops(0, 3) + prof.bwd_flops(0, 3)) / 1e12
    # Stage 0 worker: 2 tasks per micro-batch (2 lease round trips of 2 x 5 ms), tokens and the
    # output gradient down at 25e6 B/s, hidden state up at 2.5e6 B/s (fire and forget: no latency).
    tau0 = c0 + 4 * 0.005 + TOKENS / 25e6 + HIDDEN / 25e6 + HIDDEN / 2.5e6
    assert costs[0].task_times["w0"] == pytest.approx(tau0)
    assert costs[0].throughput == pytest.approx(2 / tau0)
    c1 = (prof.fwd_flops(3, 6) + prof.bwd_flops(3, 6)) / 1e12
    # Last stage: one task (forward and backward at once), input + targets down, input-gradient up.
    tau1 = c1 + 2 * 0.005 + (HIDDEN + TOKENS) / 25e6 + HIDDEN / 2.5e6
    assert costs[1].task_times["w2"] == pytest.approx(tau1)
    r = predict(p, s)
    # fill/drain: each stage's fastest worker plus the latency of its upload to the other server
    assert r["fill_drain_s"] == pytest.approx(tau0 + 0.005 + tau1 + 0.005)
    assert r["pipeline_s"] == pytest.approx(3 / min(2 / tau0, 1 / tau1) + tau0 + tau1 + 0.010)
    assert r["mean_stage_time_s"] == pytest.approx((3 / (2 / tau0) + 3 / (1 / tau1)) / 2)
    assert r["throughput_mb_s"] == pytest.approx(min(2 / tau0, 1 / tau1))
    b0, b1 = prof.param_bytes(0, 3), prof.param_bytes(3, 6)
    assert r["sync_s"] == pytest.approx(max(0.015 + b0 / 2.5e6 + b0 / 25e6, 0.015 + b1 / 2.5e6 + b1 / 25e6))


def test_compression_and_local_mode_shrink_sync():
    s = scenario(1)
    base = predict(plan([StagePlan((0, 6), "h", ["w0"])]), s)["sync_s"]
    p = plan([StagePlan((0, 6), "h", ["w0"])])
    p.sync = SyncPolicy(mode="local", grad_compression=0.25, sync_every=4, overlap=False)
    assert predict(p, s)["sync_s"] == pytest.approx((base - 0.015) / 16 + 0.015 / 4)


def test_worker_on_its_own_server_host_pays_no_transfer():
    s = scenario(1)
    from dataclasses import replace
    s.devices[0] = replace(s.devices[0], can_host_server=True)
    r = predict(plan([StagePlan((0, 6), "w0", ["w0"])]), s)
    assert r["sync_s"] == 0.0
    assert r["step_time_s"] == pytest.approx(4 * TINY_FLOPS_PER_MB / 1e12)
    assert r["utilisation"] == pytest.approx(1.0)  # it computes the whole (sub-second) step


def test_link_share_by_hand():
    from shoal.plan.cost import link_share
    assert link_share(0.0, 1) == 1.0
    assert link_share(0.0, 8) == 1.0  # nobody else in flight: the whole link
    assert link_share(8.0, 8) == 8.0  # everyone always transferring: the worst case
    assert link_share(2.0, 5) == pytest.approx(1 + 2.0 * 4 / 5)  # arrival sees (k-1)/k of the load
    assert link_share(50.0, 5) == 5.0  # clipped to the number of users


def _shared_host_scenario(n_workers, tflops):
    # workers on 1 Gbit/s links, host uplink 1 Gbit/s: the host's link is the only shared bound
    devices = [{"id": f"w{i}", "tflops": tflops, "memory_gb": 8, "region": "a", "up_gbps": 1, "down_gbps": 1}
               for i in range(n_workers)]
    devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 1, "down_gbps": 1,
                    "can_host_server": True})
    return scenario_from_dict({
        "name": "share",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 64, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 0, "bandwidth_gbps": 10}}},
        "devices": devices, "framework_cpu": FREE_CPU,
    })


def test_server_link_shared_by_transfers_in_flight():
    # One stage, k identical workers, zero latency: tau = c + s * k_eff with s = the download's
    # seconds over the whole link. The fixed point of k_eff = 1 + (k - 1) s k_eff / tau (each
    # worker is on the link s k_eff / tau of its time) solves by hand to
    # k_eff = tau / (tau - (k - 1) s), i.e. tau^2 - (c + k s) tau + c (k - 1) s = 0.
    import math as _m
    k = 4
    p = Plan("share", "tiny", "test", [StagePlan((0, 6), "h", [f"w{i}" for i in range(k)])],
             micro_batch_size=2, micro_batches=32)
    s_bytes = 2 * TOKENS  # tokens and targets
    s = s_bytes / 125e6
    for tflops in (4000.0, 40.0):  # transfer-bound (c << s), then c comparable to s
        scn = _shared_host_scenario(k, tflops)
        c = TINY_FLOPS_PER_MB / (tflops * 1e12)
        b = c + k * s
        tau = (b + _m.sqrt(b * b - 4 * c * (k - 1) * s)) / 2
        got = stage_costs(p, scn)[0].task_times["w0"]
        assert got == pytest.approx(tau, rel=0.02)
        assert c + s <= got <= c + k * s  # between the lone transfer and the worst case


def test_churn_formulas_by_hand():
    from shoal.plan.cost import availability, late_task_delay, leave_cost
    assert availability(None, 600.0) == 1.0
    assert availability(3600.0, 1800.0) == pytest.approx(2 / 3)
    assert late_task_delay(0.0, 10.0) == 0.0
    assert late_task_delay(2.0, 10.0) == pytest.approx(4 / 20)  # D^2 / 2P
    assert late_task_delay(30.0, 10.0) == pytest.approx(25.0)  # D - P/2
    # 4 workers of tau = 0.5 s (X = 8/s), M = 16, P = 10 s, fill 1 s, timeout 10 s:
    # late task D = 11.5 > P -> 6.5 s; held gradients: share 4, half of it re-run at 6/s -> 1/3 s.
    assert leave_cost(0.5, 8.0, 16, 10.0, 1.0, 10.0, 3.0) == pytest.approx(6.5 + 2 / 6)
    # the only worker: a replacement needs the timeout and the 3 s pull, then re-runs M/2 at 0.5 s
    assert leave_cost(0.5, 2.0, 16, 10.0, 1.0, 10.0, 3.0) == pytest.approx(6.5 + 10 + 3 + 8 * 0.5)


def _churn_scenario(enabled):
    devices = [{"id": f"w{i}", "tflops": 1, "memory_gb": 8, "region": "a", "up_mbps": 20, "down_mbps": 200,
                "mean_session_h": 0.5 if i == 0 else 4} for i in range(3)]
    devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 10, "down_gbps": 10,
                    "can_host_server": True})
    return scenario_from_dict({
        "name": "churny",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": devices, "framework_cpu": FREE_CPU, "churn": {"enabled": enabled, "mean_offline_min": 30},
    })


def test_churn_term_in_predict():
    from shoal.plan.cost import availability, churn_step_time, stage_costs
    p = plan([StagePlan((0, 6), "h", ["w0", "w1"])])
    off = predict(p, _churn_scenario(False))
    assert off["churn_s"] == 0.0 and off["expected_step_time_s"] == off["step_time_s"]
    s = _churn_scenario(True)
    on = predict(p, s)
    assert on["step_time_s"] == pytest.approx(off["step_time_s"])  # the steady state ignores churn
    costs = stage_costs(p, s)
    tau = costs[0].task_times["w0"]
    x_a = availability(1800.0, 1800.0) / tau + availability(14400.0, 1800.0) / tau
    pipe_a = 3 / x_a + on["fill_drain_s"]
    assert on["expected_step_time_s"] == pytest.approx(pipe_a + on["sync_s"] + on["churn_s"])
    assert on["churn_s"] > 0
    # churn = sum_d (T / S_d) leave_cost_d, each worker's leave costed by hand-checked leave_cost
    from shoal.plan.cost import leave_cost
    hand_churn = sum(on["step_time_s"] / sess * leave_cost(tau, costs[0].throughput, 4, on["pipeline_s"],
                                                           on["fill_drain_s"], 10.0, costs[0].pull)
                     for sess in (1800.0, 14400.0))
    assert on["churn_s"] == pytest.approx(hand_churn)
    assert off["sync_round_s"] == 0.0  # exact sync has no rounds
    direct = churn_step_time(p, s, costs, on["pipeline_s"], on["fill_drain_s"], on["sync_s"], on["step_time_s"],
                             CostOptions())
    assert direct[1] == pytest.approx(on["churn_s"])
    # exact sync: no pipeline floor, no local-mode correction (the defaults); a step of milliseconds
    assert on["pipeline_s"] < 1.0
    assert direct[0] == pytest.approx(on["expected_step_time_s"])
    # the reliable device alone beats the flaky one alone, though they are equally fast
    flaky = predict(plan([StagePlan((0, 6), "h", ["w0"])]), s)
    steady = predict(plan([StagePlan((0, 6), "h", ["w1"])]), s)
    assert flaky["step_time_s"] == pytest.approx(steady["step_time_s"])
    assert flaky["expected_step_time_s"] > steady["expected_step_time_s"]


def test_sync_bursts_share_a_narrow_server_link_by_the_workers_that_sync():
    """When the server host's own link is the narrowest, one syncing worker gets all of it and
    k simultaneous syncs get 1/k each (pushes share its downlink, pulls its uplink)."""
    def narrow_host(n):
        devices = [{"id": f"w{i}", "tflops": 1, "memory_gb": 8, "region": "a", "up_mbps": 20, "down_mbps": 200}
                   for i in range(n)]
        devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_mbps": 8, "down_mbps": 4,
                        "can_host_server": True})
        return scenario_from_dict({
            "name": "narrow",
            "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
            "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
            "devices": devices, "framework_cpu": FREE_CPU,
        })

    pbytes = TINY_PARAMS * 4
    one = predict(plan([StagePlan((0, 6), "h", ["w0"])]), narrow_host(1))
    # push over the host's 4 Mbit/s downlink (0.5e6 B/s), pull over its 8 Mbit/s uplink (1e6 B/s)
    assert one["sync_s"] == pytest.approx(0.015 + pbytes / 0.5e6 + pbytes / 1e6)
    two = predict(plan([StagePlan((0, 6), "h", ["w0", "w1"])]), narrow_host(2))
    assert two["sync_s"] == pytest.approx(0.015 + 2 * pbytes / 0.5e6 + 2 * pbytes / 1e6)


def test_overlapped_uploads_by_hand():
    """With ``overlap_uploads`` a stage-0 worker's hidden-state upload runs while it fetches and
    computes the next task: tau = max(compute + fetches, upload) instead of their sum."""
    s = scenario(2)
    p = plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])])
    p.sync = SyncPolicy(overlap_uploads=True)
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    c0 = (prof.fwd_flops(0, 3) + prof.bwd_flops(0, 3)) / 1e12
    fetch0 = 4 * 0.005 + TOKENS / 25e6 + HIDDEN / 25e6
    up0 = HIDDEN / 2.5e6
    assert up0 > c0 + fetch0  # the upload is the bottleneck resource here
    costs = stage_costs(p, s)
    assert costs[0].task_times["w0"] == pytest.approx(max(c0 + fetch0, up0))
    plain = stage_costs(plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])]), s)
    assert plain[0].task_times["w0"] == pytest.approx(c0 + fetch0 + up0)


def test_compressed_activations_and_gradients_shrink_the_transfers_by_hand():
    """int8 activations and fp16 activation gradients: each crossing moves raw bytes x the
    codec's wire ratio (the ratios themselves are checked in tests/test_plan_local.py)."""
    s = scenario(2)
    pol = SyncPolicy(act_codec="int8", grad_codec="fp16")
    ra, rg = pol.ratio("act", 4), pol.ratio("grad", 4)
    assert ra < rg < 1
    p = plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])])
    p.sync = pol
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    c0 = (prof.fwd_flops(0, 3) + prof.bwd_flops(0, 3)) / 1e12
    c1 = (prof.fwd_flops(3, 6) + prof.bwd_flops(3, 6)) / 1e12
    costs = stage_costs(p, s)
    # stage 0: tokens and the (fp16) output gradient down, the (int8) hidden state up
    assert costs[0].task_times["w0"] == pytest.approx(
        c0 + 4 * 0.005 + TOKENS / 25e6 + HIDDEN * rg / 25e6 + HIDDEN * ra / 2.5e6)
    # last stage: the (int8) input and the targets down, the (fp16) input gradient up
    assert costs[1].task_times["w1"] == pytest.approx(
        c1 + 2 * 0.005 + (HIDDEN * ra + TOKENS) / 25e6 + HIDDEN * rg / 2.5e6)


def test_self_hosted_stages_share_a_downlink_by_transfers_in_flight():
    """Three stages, each worker hosting its own stage's server: nobody downloads from a
    server, but the middle host receives uploads from both neighbours. Compute-heavy
    neighbours are rarely uploading at once, so the fixed point must give each upload more
    than the worst-case half of that host's narrow downlink (and less than all of it)."""
    devices = [{"id": f"d{i}", "tflops": 0.05, "memory_gb": 8, "region": "a", "up_mbps": 100,
                "down_mbps": 10 if i == 1 else 100, "can_host_server": True} for i in range(3)]
    s = scenario_from_dict({
        "name": "self-hosted",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": devices, "framework_cpu": FREE_CPU,
    })
    p = plan([StagePlan((0, 2), "d0", ["d0"]), StagePlan((2, 4), "d1", ["d1"]), StagePlan((4, 6), "d2", ["d2"])])
    tau = stage_costs(p, s)[0].task_times["d0"]
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    c0 = (prof.fwd_flops(0, 2) + prof.bwd_flops(0, 2)) / 1e12
    down1 = 10e6 / 8
    whole, half = c0 + HIDDEN / down1, c0 + HIDDEN / (down1 / 2)
    assert whole < tau < half, (whole, tau, half)


def test_two_servers_on_one_host_add_up_their_memory():
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.cost import server_memory_headroom
    s = scenario(2)
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    p = plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])])
    hm = 64e9  # the scenario's default host memory
    need = prof.server_memory(0, 3) + prof.server_memory(3, 6)
    assert server_memory_headroom(p, s) == pytest.approx((hm - need) / hm, rel=1e-12)


def test_a_host_is_sized_for_its_servers_under_the_plans_sync_policy():
    """A host with room for two stage servers in local mode but not in exact sync: the validator
    takes the plan in local mode and refuses it in exact sync, naming the host."""
    from dataclasses import replace

    from shoal.errors import ShoalError
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.cost import servers_memory
    from shoal.plan.validate import validate_plan

    s = scenario(2)
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    local, exact = SyncPolicy(mode="local", sync_every=4), SyncPolicy()
    stages = [StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])]
    need = {pol.mode: servers_memory(stages, prof, pol)["h"] for pol in (local, exact)}
    assert need["local"] < need["sync"]
    s.devices = [replace(d, host_memory=(need["local"] + need["sync"]) / 2) if d.id == "h" else d for d in s.devices]
    p = plan(stages)
    p.sync = local
    validate_plan(p, s)
    p.sync = exact
    with pytest.raises(ShoalError, match="server host h has .* but its stage servers need"):
        validate_plan(p, s)


def test_share_counts_by_hand():
    """Who loads which server link: a stage's remote workers download from and upload to its
    host and sync with it; they also upload activations to the next stage's host and input
    gradients to the previous one's, unless they are that host."""
    from shoal.plan.cost import _share_counts
    devices = [{"id": d, "tflops": 1, "memory_gb": 8, "region": "a", "up_mbps": 20, "down_mbps": 200,
                "can_host_server": True} for d in ("h0", "h1", "h2", "a", "b", "c")]
    s = scenario_from_dict({
        "name": "counts",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": devices, "framework_cpu": FREE_CPU,
    })
    # stage 0 on h0: a and h1 (h1 hosts stage 1); stage 1 on h1: b and h0 (h0 hosts stage 0);
    # stage 2 on h2: c and h2 itself
    p = plan([StagePlan((0, 2), "h0", ["a", "h1"]), StagePlan((2, 4), "h1", ["b", "h0"]),
              StagePlan((4, 6), "h2", ["c", "h2"])])
    dl, ul, sy = _share_counts(p, s)
    assert dl == {"h0": 2, "h1": 2, "h2": 1}
    assert sy == {"h0": 2, "h1": 2, "h2": 1}
    # h0 <- a, h1 (own stage), b (input gradients; h0 itself does not count);
    # h1 <- a (activations; h1 itself does not count), b, h0 (own stage), c, h2 (input gradients);
    # h2 <- b, h0 (activations), c (own stage)
    assert ul == {"h0": 3, "h1": 5, "h2": 3}


def test_two_stage_link_sharing_fixed_point_by_hand():
    """Two stages on hosts h0 and h1 with narrow links, two remote workers each (one fast, one
    slow). The fixed point of the link shares is recomputed here step by step from the model
    in docs/planner-cost-model.md: worst-case shares first, then k_eff = link_share(N, k) from each worker's
    serialisation seconds on a link times the micro-batches it completes per second (scaled by
    its stage's utilisation x / X_s), until no share moves by more than 1 % or 4 passes."""
    # capped at 4 passes; then one whose fourth pass settles after a third that moved a share
    # by 1.2 %
    _fixed_point_case({"a": 0.02, "b": 0.005, "c": 0.02, "d": 0.01}, {"h0": (6, 8), "h1": (5, 7)})
    _fixed_point_case({"a": 0.002, "b": 0.001, "c": 0.02, "d": 0.01}, {"h0": (6, 30), "h1": (10, 20)})
    # and one that settles after 3 passes, before the cap
    _fixed_point_case({"a": 0.002, "b": 0.001, "c": 0.02, "d": 0.01}, {"h0": (3, 30), "h1": (3, 20)})
    # and stages slower than one micro-batch per second (the loads still count)
    _fixed_point_case({"a": 0.0003, "b": 0.0002, "c": 0.0004, "d": 0.0003}, {"h0": (0.5, 1), "h1": (0.5, 0.8)})


def _fixed_point_case(tf, links):
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.cost import link_share

    devices = [{"id": w, "tflops": t, "memory_gb": 8, "region": "a", "up_mbps": 100, "down_mbps": 100}
               for w, t in tf.items()]
    devices += [{"id": h, "tflops": 0, "memory_gb": 0, "region": "a", "up_mbps": up, "down_mbps": down,
                 "can_host_server": True} for h, (up, down) in links.items()]
    scn = scenario_from_dict({
        "name": "fixed-point",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": devices, "framework_cpu": FREE_CPU,
    })
    p = plan([StagePlan((0, 3), "h0", ["a", "b"]), StagePlan((3, 6), "h1", ["c", "d"])])
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    mbps = 1e6 / 8
    up = {h: u * mbps for h, (u, _) in links.items()}
    down = {h: d * mbps for h, (_, d) in links.items()}
    wl = 100 * mbps  # every worker's up and down
    comp = {w: (prof.fwd_flops(*((0, 3) if w in "ab" else (3, 6))) + prof.bwd_flops(*((0, 3) if w in "ab" else (3, 6))))
            / (tf[w] * 1e12) for w in tf}
    # per worker: fixed seconds, then (bytes, own-link bound, host link, direction) per transfer
    fixed = {w: comp[w] + (4 if w in "ab" else 2) * 0.005 for w in tf}
    xfers = {w: [(TOKENS + HIDDEN, "h0", "up"), (HIDDEN, "h1", "down")] for w in "ab"}  # in: tokens, out-grad
    xfers.update({w: [(HIDDEN + TOKENS, "h1", "up"), (HIDDEN, "h0", "down")] for w in "cd"})
    n_dl = {"h0": 2, "h1": 2}
    n_ul = {"h0": 4, "h1": 4}  # own stage (sync) + the other stage's activations or gradients
    k = {("h0", "up"): 2.0, ("h1", "up"): 2.0, ("h0", "down"): 4.0, ("h1", "down"): 4.0}

    def times(k):
        out, secs = {}, {}
        for w in tf:
            ss = []
            for nbytes, h, way in xfers[w]:
                host = (up if way == "up" else down)[h] / k[(h, way)]
                ss.append((nbytes / min(wl, host), h, way))
            out[w] = fixed[w] + sum(x[0] for x in ss)
            secs[w] = ss
        return out, secs

    for it in range(5):
        tau, secs = times(k)
        if it == 4:
            break
        xs = {"ab": 1 / tau["a"] + 1 / tau["b"], "cd": 1 / tau["c"] + 1 / tau["d"]}
        x = min(xs.values())
        load = dict.fromkeys(k, 0.0)
        for st, ws in (("ab", "ab"), ("cd", "cd")):
            for w in ws:
                for s_, h, way in secs[w]:
                    load[(h, way)] += s_ * min(1.0, x / xs[st]) / tau[w]
        new = {key: link_share(load[key], (n_dl if key[1] == "up" else n_ul)[key[0]]) for key in k}
        settled = all(abs(new[key] - k[key]) <= 0.01 * k[key] for key in k)
        k = new
        if settled:
            tau, _ = times(k)
            break
    assert 1.0 < k[("h0", "up")] < 2.0 and 1.0 < k[("h1", "down")] < 4.0  # shares strictly between
    assert it >= 2  # the fixed point did move
    costs = stage_costs(p, scn)
    got = {**costs[0].task_times, **costs[1].task_times}
    for w in tf:
        assert got[w] == pytest.approx(tau[w], rel=1e-9), (w, got[w], tau[w])
    xs = [1 / tau["a"] + 1 / tau["b"], 1 / tau["c"] + 1 / tau["d"]]
    assert predict(p, scn)["mean_stage_time_s"] == pytest.approx((3 / xs[0] + 3 / xs[1]) / 2, rel=1e-9)


def test_recompute_charges_the_forward_again_except_on_the_last_stage():
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    s = scenario(2)
    p = plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])])
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    plain = stage_costs(p, s)
    rec = stage_costs(p, s, CostOptions(recompute=True))
    assert rec[0].task_times["w0"] - plain[0].task_times["w0"] == pytest.approx(prof.fwd_flops(0, 3) / 1e12)
    assert rec[1].task_times["w1"] == pytest.approx(plain[1].task_times["w1"])  # runs fwd+bwd at once


def test_pull_time_and_an_unrunnable_plan():
    s = scenario(1)
    c = stage_costs(plan([StagePlan((0, 6), "h", ["w0"])]), s)[0]
    # a replacement's start-up: one latency and the stage's weights over the worker's downlink
    assert c.pull == pytest.approx(0.005 + TINY_PARAMS * 4 / 25e6)
    # a worker with no compute: the plan never finishes a step, and nobody is utilised
    r = predict(plan([StagePlan((0, 6), "h", ["h"])]), s)
    assert r["step_time_s"] == float("inf") and r["utilisation"] == 0.0


def _slow_link_scenario(latency_ms):
    devices = [{"id": f"w{i}", "tflops": 1, "memory_gb": 8, "region": "a", "up_mbps": 20, "down_mbps": 200}
               for i in range(2)]
    devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 10, "down_gbps": 10,
                    "can_host_server": True})
    return scenario_from_dict({
        "name": "lat",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": latency_ms, "bandwidth_gbps": 1}}},
        "devices": devices, "framework_cpu": FREE_CPU,
    })


def test_prefetch_by_hand():
    """With ``prefetch`` a worker fetches its next task (lease round trips and input download)
    while it computes and uploads: tau = max(compute + uploads, fetches)."""
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    c0 = (prof.fwd_flops(0, 3) + prof.bwd_flops(0, 3)) / 1e12
    c1 = (prof.fwd_flops(3, 6) + prof.bwd_flops(3, 6)) / 1e12
    for lat in (0.05, 0.001):  # fetch-bound, then upload-bound
        s = _slow_link_scenario(lat * 1000)
        p = plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])])
        p.sync = SyncPolicy(prefetch=True)
        costs = stage_costs(p, s)
        fetch0 = 4 * lat + (TOKENS + HIDDEN) / 25e6
        fetch1 = 2 * lat + (HIDDEN + TOKENS) / 25e6
        assert costs[0].task_times["w0"] == pytest.approx(max(c0 + HIDDEN / 2.5e6, fetch0))
        assert costs[1].task_times["w1"] == pytest.approx(max(c1 + HIDDEN / 2.5e6, fetch1))


def test_local_mode_round_links_by_hand():
    """Local mode records, per worker, its push and pull at full rate and the seconds per step
    its links carry activations (its M micro-batches' transfers), which the round shares."""
    s = scenario(2)
    p = plan([StagePlan((0, 3), "h", ["w0"]), StagePlan((3, 6), "h", ["w1"])])
    p.sync = SyncPolicy(mode="local", sync_every=4)
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    costs = stage_costs(p, s)
    for i, (a, b), up_s, down_s in ((0, (0, 3), HIDDEN / 2.5e6, (TOKENS + HIDDEN) / 25e6),
                                    (1, (3, 6), HIDDEN / 2.5e6, (HIDDEN + TOKENS) / 25e6)):
        g = prof.param_bytes(a, b)
        (link,) = costs[i].round_links
        assert link == pytest.approx((g / 2.5e6, g / 25e6, 4 * up_s, 4 * down_s))
