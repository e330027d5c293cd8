"""Edge cases of the cost model's pure formulas, by hand (the boundaries mutation testing
showed untested: zero work, zero speed, unshared links, the documented defaults)."""

import math

import pytest

from shoal.plan.cost import (
    CostOptions,
    availability,
    compute_time,
    flow_bandwidth,
    late_task_delay,
    leave_cost,
    link_share,
    pipeline_time,
    stage_sync_time,
    stage_throughput,
    step_time,
    sync_time,
    transfer_time,
)


def test_defaults():
    o = CostOptions()
    assert (o.overlap_sync, o.recompute, o.churn, o.lease_timeout_s) == (False, False, True, 10.0)


def test_compute_time_edges():
    assert compute_time(0.0, 0.0) == 0.0  # no work costs nothing, even on a device with no speed
    assert compute_time(-1.0, 5.0) == 0.0
    assert compute_time(1e9, 0.0) == math.inf  # work on a device with no speed never ends
    assert compute_time(6e9, 2e9) == 3.0


def test_flow_bandwidth_unshared_and_shared():
    assert flow_bandwidth(100.0, 50.0, 400.0) == 50.0
    assert flow_bandwidth(100.0, 50.0, 400.0, 1, 1) == 50.0
    assert flow_bandwidth(100.0, 500.0, 400.0, 0, 0) == 100.0  # shares below 1 count as 1
    assert flow_bandwidth(1000.0, 500.0, 400.0, 2, 1) == 250.0
    assert flow_bandwidth(1000.0, 500.0, 400.0, 1, 2) == 200.0


def test_transfer_and_throughput_edges():
    assert transfer_time(-5.0, 1.0, 1.0) == 0.0
    assert transfer_time(1.0, 0.0, 4.0) == 0.25
    assert stage_throughput([], 4) == 0.0
    assert stage_throughput([math.inf, math.inf], 4) == 0.0
    assert stage_throughput([2.0, math.inf, 4.0], 1) == 0.5
    assert stage_throughput([0.0, 2.0], 4) == 0.5  # a zero time is ignored, not infinite


def test_pipeline_time_edges():
    assert pipeline_time(4, [0.0, 1.0], [0.1, 0.1]) == math.inf  # a stage with no throughput
    assert pipeline_time(1, [2.0], [0.3]) == pytest.approx(0.3)  # one micro-batch: only fill/drain
    assert pipeline_time(3, [4.0, 1.0, 2.0], [0.0, 0.0, 0.0]) == pytest.approx(2.0)


def test_sync_edges():
    assert sync_time(0.0, 1.0, 0.1, 1.0, 1.0) == 0.0
    assert sync_time(100.0, 0.0, 0.1, 1.0, 1.0) == 0.0
    assert stage_sync_time(0.5, 0.0, 0.0) == 0.0  # nothing to send: the latencies are not paid
    assert stage_sync_time(0.5, 1.0, 0.0) == pytest.approx(2.5)
    assert stage_sync_time(0.5, 0.0, 1.0) == pytest.approx(2.5)
    assert stage_sync_time(0.0, 2.0, 2.0, sync_every=0) == pytest.approx(4.0)  # 0 counts as 1
    assert step_time(2.0, 3.0, overlap_sync=True) == 3.0


def test_link_share_and_availability_edges():
    assert link_share(5.0, 0) == 1.0
    assert link_share(5.0, 1) == 1.0
    assert link_share(1.0, 2) == pytest.approx(1.5)
    assert availability(100.0, -50.0) == 1.0  # negative time away counts as none
    assert availability(100.0, 0.0) == 1.0
    assert availability(100.0, 300.0) == pytest.approx(0.25)


def test_late_task_and_leave_cost_edges():
    assert late_task_delay(-1.0, 10.0) == 0.0
    assert late_task_delay(3.0, 0.0) == 3.0  # no pipeline to hide in
    assert late_task_delay(0.25, 0.5) == pytest.approx(0.0625)  # short pipelines too: D^2 / 2P
    assert late_task_delay(2.0, 0.5) == pytest.approx(1.75)
    assert late_task_delay(10.0, 10.0) == pytest.approx(5.0)  # both branches agree at D = P
    # very slow workers (tau = 1e9 s, two of them): the other still runs the leaver's share
    # (rest = 1e-9 > 1e-12 X): the late task (timeout + tau + fill - P / 2) plus half of its
    # share of 2 at the other's 1e-9/s; a lone-worker answer would add the timeout and a 1e9 s pull
    assert leave_cost(1e9, 2e-9, 4, 10.0, 1.0, 10.0, 1e9) == pytest.approx((10 + 1e9 + 1 - 5) + 0.5 * 2 / 1e-9)
    assert leave_cost(0.0, 1.0, 4, 10.0, 1.0, 10.0, 1.0) == 0.0
    assert leave_cost(math.inf, 1.0, 4, 10.0, 1.0, 10.0, 1.0) == 0.0
    assert leave_cost(1.0, 0.0, 4, 10.0, 1.0, 10.0, 1.0) == 0.0
    # two workers of tau 1 (X = 2): share M/(tau X) = 2, half re-run at the other's 1/s -> 1 s;
    # late task D = 10 + 1 + 1 = 12 > P = 20? no: D^2 / 2P = 144 / 40
    assert leave_cost(1.0, 2.0, 4, 20.0, 1.0, 10.0, 5.0) == pytest.approx(144 / 40 + 1.0)
    # alone (X = 1/tau): timeout + pull + M/2 tau on top of the late task
    assert leave_cost(1.0, 1.0, 4, 20.0, 1.0, 10.0, 5.0) == pytest.approx(144 / 40 + 10 + 5 + 2)


def test_receiver_downlink_alone_can_bound_a_flow():
    # the receiver's unshared downlink is the narrowest of the three
    assert flow_bandwidth(1000.0, 500.0, 400.0) == 400.0
    assert flow_bandwidth(1000.0, 500.0, 400.0, 3, 1) == pytest.approx(500.0 / 3)


def test_local_mode_worker_holds_two_fp32_moments_per_parameter():
    """A local-mode worker runs its own AdamW: 2 fp32 moments (8 bytes) per parameter of its
    stage on top of what an exact-sync worker needs."""
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.types import SyncPolicy

    prof = profile_model(get_preset("tiny"), 64, 2, 4)
    exact = stage_worker_memory(prof, 0, 3, SyncPolicy())
    local = stage_worker_memory(prof, 0, 3, SyncPolicy(mode="local"))
    assert exact == stage_worker_memory(prof, 0, 3) == prof.worker_memory(0, 3)
    assert local - exact == 2 * 4 * prof.params(0, 3)


def test_small_work_and_slow_devices_are_not_rounded_away():
    # the guards are for "no work" and "no speed" only, not for small figures
    assert compute_time(0.5, 1.0) == 0.5
    assert compute_time(2.0, 0.5) == 4.0
    assert sync_time(1.0, 1.0, 0.0, 4.0, 4.0) == 0.5
    # nothing to send over a link that has no bandwidth costs nothing (and does not divide by 0)
    assert sync_time(0.0, 1.0, 0.1, 0.0, 0.0) == 0.0


def test_local_round_with_nothing_to_send_costs_nothing():
    from shoal.plan.cost import local_round_time, local_round_wait

    assert local_round_time(0.5, 0.0, 0.0) == 0.0  # no latencies paid for an empty round
    assert local_round_time(0.5, 1.0, 0.0) == pytest.approx(2.5)
    assert local_round_wait([(0.0, 0.0, 0.0, 0.0)], 0.5, 2, 1.0) == (0.0, 0.0)


def test_cost_options_are_immutable_and_profiles_follow_the_micro_batch():
    import dataclasses

    from shoal.plan import scenario_from_dict
    from shoal.plan.cost import scenario_profile

    with pytest.raises(dataclasses.FrozenInstanceError):
        CostOptions().churn = False  # shared defaults cannot be changed by one caller
    s = scenario_from_dict({
        "name": "p", "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": [{"id": "h", "tflops": 1, "memory_gb": 8, "region": "a", "up_mbps": 20, "down_mbps": 200,
                     "can_host_server": True}]})
    assert scenario_profile(s).tokens_per_micro_batch == 2 * 64
    assert scenario_profile(s, 4).tokens_per_micro_batch == 4 * 64  # the plan's micro-batch wins


def test_local_round_wait_by_hand():
    """Push then pull, each worker's transfer at ``idle = max(1e-3, 1 - busy / P)`` of its rate
    during the ``H P`` window of steps and at full rate after it; the steps wait for what ends
    past the window (:func:`shoal.plan.cost.background_finish`)."""
    from shoal.plan.cost import (
        background_finish,
        local_round_time,
        local_round_wait,
        local_sync_per_step,
    )

    assert local_round_time(0.5, 0.0, 0.5) == pytest.approx(2.0)  # a pull alone pays the latencies
    links = [(4.0, 2.0, 0.0, 0.0)]
    # no pipeline time to hide it in, or an unbounded one: the whole round is waited for
    assert local_round_wait(links, 0.0, 3, 0.0) == (6.0, 6.0)
    assert local_round_wait(links, 0.0, 3, math.inf) == (6.0, 6.0)
    # latencies count three times: R = 6.3; idle links, so the wait is R - H P = 6.3 - 3
    full, wait = local_round_wait(links, 0.1, 3, 1.0)
    assert full == pytest.approx(6.3) and wait == pytest.approx(3.3)
    # H = 1
    assert local_round_wait(links, 0.0, 1, 1.0)[1] == pytest.approx(5.0)
    # the uplink busy a quarter of a 2 s step: 3 s of push in the 4 s window, 1 s after, then the pull
    assert local_round_wait([(4.0, 2.0, 0.5, 0.0)], 0.0, 2, 2.0)[1] == pytest.approx(3.0)
    # the downlink busy half of each step, but the push fills the window: the pull runs at full rate
    assert local_round_wait([(4.0, 2.0, 0.0, 0.5)], 0.0, 4, 1.0)[1] == pytest.approx(2.0)
    # a link busy the whole step still gets the 1e-3 idle floor: 0.004 s of push in the window
    assert local_round_wait([(4.0, 2.0, 1.0, 0.0)], 0.0, 4, 1.0)[1] == pytest.approx(6.0 - 0.004)
    # background_finish's three cases: past the window, within it, across its end
    assert background_finish(5.0, 2.0, 0.5, 4.0) == 7.0
    assert background_finish(1.0, 1.0, 0.5, 4.0) == 3.0
    assert background_finish(1.0, 2.0, 0.5, 4.0) == pytest.approx(4.0 + 2.0 - 1.5)
    assert background_finish(0.0, 2.0, 0.5, 4.0) == 4.0  # ends exactly at the window's end
    # amortised per step
    assert local_sync_per_step(6.0, 1, 1.0, overlap=False) == 6.0
    assert local_sync_per_step(0.5, 1, 0.1) == pytest.approx(0.4)  # a short round, partly hidden
    assert local_sync_per_step(0.0, 2, 1.0) == 0.0
    assert local_sync_per_step(0.0, 2, 1.0, overlap=False) == 0.0
