"""Small hand-built scenarios whose cost-model figures the tests compute by hand."""

from __future__ import annotations

from shoal.plan.scenario import scenario_from_dict
from shoal.plan.types import Scenario

# A frictionless framework (scenario ``framework_cpu``): hand computations of the network and
# compute model leave shoal's own CPU per message out; tests/test_plan_cpu.py charges it.
FREE_CPU = {"server_task_ms": 0, "server_task_ns_per_byte": 0, "worker_task_ms": 0, "server_sync_ms": 0, "coordinator_member_ms": 0,
            "coordinator_report_ms": 0, "server_merge_ms_per_mparam": 0, "server_codec_scale": 0, "act_codec_scale": 0,
            "server_screen_ms_per_mcoord": 0, "server_push_ms_per_mparam": 0, "server_pull_ms_per_mparam": 0,
            "server_step_ms_per_mparam": 0}


def hand_scenario(n_workers: int = 1) -> Scenario:
    """``n_workers`` identical tiny-model workers (1 TFLOP/s, 8 GB, 20 Mbit/s up, 200 down) and one
    server host ``h`` (10 Gbit/s both ways) in one region with 5 ms latency; fp32, M = 4 of 2."""
    devices = [{"id": f"w{i}", "tflops": 1, "memory_gb": 8, "region": "a", "up_mbps": 20, "down_mbps": 200}
               for i in range(n_workers)]
    devices.append({"id": "h", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 10, "down_gbps": 10,
                    "can_host_server": True})
    return scenario_from_dict({
        "name": "hand",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {"intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}}},
        "devices": devices,
        "framework_cpu": FREE_CPU,
    })


def act_codec_link_bytes(plan, scenario: Scenario, codecs: tuple[str, ...]) -> dict[str, float]:
    """Bytes every link carries in one simulated step of ``plan`` with each activation codec
    (``act`` and ``grad`` both): only those change between the runs, so the bytes two codecs
    save against ``none`` are in the ratio of their savings per element."""
    from shoal.plan.types import SyncPolicy
    from shoal.sim import simulate

    total = {}
    for codec in codecs:
        plan.sync = SyncPolicy(act_codec=codec, grad_codec=codec)
        r = simulate(plan, scenario, steps=1)
        assert r.lost_micro_batches == 0 and not r.stalled
        total[codec] = sum(r.link_bytes.values())
    return total
