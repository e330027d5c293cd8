"""Scenario loading, built-ins, validation errors and JSON round trips."""

import copy
import json

import pytest

from shoal.errors import ShoalError
from shoal.plan import BUILTIN_SCENARIOS, load_scenario, scenario_from_dict, scenario_to_dict
from shoal.plan.scenario import GBIT, MBIT, save_scenario


def small() -> dict:
    return {
        "name": "small",
        "workload": {"model": "tiny", "seq_len": 64, "global_batch": 8, "micro_batch_size": 2, "dtype": "fp32"},
        "network": {
            "intra": {"a": {"latency_ms": 5, "bandwidth_gbps": 1}, "b": {"latency_ms": 2, "bandwidth_mbps": 800}},
            "inter": [{"regions": ["a", "b"], "latency_ms": 40, "bandwidth_mbps": 100}],
        },
        "devices": [
            {"id": "g1", "kind": "rtx3090", "tflops": 28, "memory_gb": 24, "region": "a",
             "up_mbps": 20, "down_mbps": 200, "mean_session_h": 2},
            {"count": 2, "id_prefix": "b-", "template": {"kind": "rtx3060", "tflops": 10, "memory_gb": 12,
                                                          "region": "b", "up_mbps": 50, "down_mbps": 500}},
            {"id": "host", "kind": "server", "tflops": 0, "memory_gb": 0, "region": "a", "up_gbps": 10,
             "down_gbps": 10, "can_host_server": True},
        ],
    }


def test_units_are_converted_to_si_and_groups_expand():
    s = scenario_from_dict(small())
    assert [d.id for d in s.devices] == ["g1", "b-0", "b-1", "host"]
    g1 = s.device("g1")
    assert g1.flops == 28e12 and g1.memory == 24e9
    assert g1.up == 20 * MBIT == 2.5e6 and g1.down == 200 * MBIT
    assert g1.mean_session_s == 7200
    assert s.device("host").up == 10 * GBIT
    link = s.network.link(g1, s.device("b-0"))
    assert link.latency == pytest.approx(0.040) and link.bandwidth == pytest.approx(12.5e6)
    assert s.network.link(s.device("b-0"), s.device("b-1")).bandwidth == pytest.approx(100e6)
    assert s.workload.micro_batches == 4 and s.workload.dtype_bytes == 4


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["devices"][0].update(up_mbps=0), "up_mbps must be > 0"),
        (lambda d: d["devices"][0].update(down_mbps=-5), "down_mbps must be > 0"),
        (lambda d: d["network"]["intra"]["a"].update(bandwidth_gbps=0), "bandwidth_gbps must be > 0"),
        (lambda d: d["network"].update(inter=[]), "no network link between regions"),
        (lambda d: d["workload"].update(model="gpt-9000"), "unknown model preset"),
        (lambda d: d["devices"].append(dict(d["devices"][0])), "appears twice"),
        (lambda d: d["devices"].pop(), "no device can host a stage server"),
        (lambda d: d["workload"].update(model="llama-7b", seq_len=2048), "needs"),
        (lambda d: d["workload"].update(global_batch=7), "not a multiple"),
        (lambda d: d["network"]["intra"].pop("b"), "no link for region"),
        (lambda d: d["network"]["inter"][0].update(latency_ms=-1), "latency_ms must be >= 0"),
        (lambda d: d["devices"][0].update(tflops=-3), "tflops must be >= 0"),
        (lambda d: d.update(churn={"trace": [[5.0, "ghost", "leave"]]}), "unknown device"),
        (lambda d: d.update(churn={"trace": [[5.0, "g1", "explode"]]}), "'leave' or 'join'"),
        (lambda d: d.update(devices={}), "must be a JSON array"),
    ],
)
def test_each_bad_value_is_a_one_line_error(mutate, message):
    d = small()
    mutate(d)
    with pytest.raises(ShoalError) as exc:
        scenario_from_dict(d)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_scenario_round_trip_through_json(tmp_path):
    s = scenario_from_dict(small())
    d = scenario_to_dict(s)
    again = scenario_from_dict(json.loads(json.dumps(d)))
    assert scenario_to_dict(again) == d
    for x, y in zip(s.devices, again.devices, strict=True):
        assert x.id == y.id and x.flops == pytest.approx(y.flops) and x.up == pytest.approx(y.up)
    save_scenario(s, tmp_path / "s.json")
    assert scenario_to_dict(load_scenario(str(tmp_path / "s.json"))) == d


def test_a_workload_of_a_model_folder_carries_its_shape():
    """A workload whose model names no preset (a run from a model folder) carries the model's
    shape: it round-trips through JSON, the planner's profile is that model's, and a shape that
    is not a model's is a one-line error."""
    from dataclasses import replace

    from shoal.model.config import get_preset
    from shoal.plan.cost import scenario_profile

    d = small()
    cfg = replace(get_preset("tiny"), name="custom", n_layers=6)
    d["workload"] = {**d["workload"], "model": "hf", "config": cfg.to_dict()}
    s = scenario_from_dict(d)
    assert s.workload.model_config() == cfg and len(scenario_profile(s).layers) == 6 + 2
    assert scenario_from_dict(json.loads(json.dumps(scenario_to_dict(s)))).workload.config == cfg
    d["workload"]["config"] = {"d_model": 64}
    with pytest.raises(ShoalError, match="workload config is not a model's shape"):
        scenario_from_dict(d)


@pytest.mark.parametrize("name", [n for n in BUILTIN_SCENARIOS if n != "scale-4096"])
def test_builtins_load_and_document_their_sources(name):
    s = load_scenario(name)
    assert s.description and s.source
    assert s.server_hosts and s.workers
    assert scenario_to_dict(scenario_from_dict(copy.deepcopy(scenario_to_dict(s)))) == scenario_to_dict(s)


def test_dtfm_cases_match_design_figures():
    s = load_scenario("dtfm-3")
    assert len(s.workers) == 64
    va, oh = s.device("va-0"), s.device("oh-0")
    link = s.network.link(va, oh)
    assert link.latency == pytest.approx(0.011) and link.bandwidth == pytest.approx(1.12 * GBIT)
    assert va.flops == pytest.approx(50e12)
    s0 = load_scenario("dtfm-0")
    assert s0.network.link(s0.device("m0-0"), s0.device("m0-1")).bandwidth == pytest.approx(100 * GBIT)
    assert s0.network.link(s0.device("m0-0"), s0.device("m1-1")).bandwidth == pytest.approx(3.125 * GBIT)


def test_scale_n_is_seeded_and_bounded():
    a, b = load_scenario("scale-100"), load_scenario("scale-100")
    assert scenario_to_dict(a) == scenario_to_dict(b)
    assert len(a.workers) == 100
    with pytest.raises(ShoalError):
        load_scenario("scale-99999")
    with pytest.raises(ShoalError, match="no built-in scenario or file"):
        load_scenario("nope")


def test_demo_is_small_and_churns():
    s = load_scenario("demo")
    assert 8 <= len(s.workers) <= 12 and len({d.region for d in s.workers}) >= 3
    assert s.workload.model == "tiny" and s.workload.seq_len == 128
    assert s.workload.micro_batch_size == 4 and s.workload.micro_batches == 8
    assert s.churn.enabled and len(s.server_hosts) >= 2
