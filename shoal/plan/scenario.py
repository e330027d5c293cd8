"""Scenario files and built-in scenarios; the one place that validates scenario input.

File format: JSON (stdlib ``json``), human units converted to SI on load. See
``docs/planner.md`` for the full reference; in short::

    {
      "name": "my-swarm", "description": "...", "source": "...",
      "workload": {"model": "gpt-1.3b", "seq_len": 1024, "global_batch": 512,
                   "micro_batch_size": 1, "dtype": "fp16"},
      "network": {
        "intra": {"eu": {"latency_ms": 10, "bandwidth_mbps": 1000}},
        "inter": [{"regions": ["eu", "us"], "latency_ms": 80, "bandwidth_gbps": 1}],
        "inter_default": {"latency_ms": 100, "bandwidth_mbps": 500},      (optional)
        "overrides": [{"devices": ["a", "b"], "latency_ms": 1, "bandwidth_gbps": 10}]
      },
      "devices": [
        {"id": "a", "kind": "rtx3090", "tflops": 28, "memory_gb": 24, "region": "eu",
         "up_mbps": 40, "down_mbps": 500, "can_host_server": false, "mean_session_h": 4},
        {"count": 8, "id_prefix": "eu-", "template": {"kind": "rtx3060", ...}}
      ],
      "churn": {"enabled": true, "mean_offline_min": 10, "trace": [[60.0, "a", "leave"]]}
    }

Units: ``tflops`` (effective TFLOP/s), ``memory_gb`` / ``host_memory_gb`` (1e9 bytes),
bandwidths as ``*_mbps`` or ``*_gbps`` (1e6 / 1e9 bit/s), ``latency_ms`` (one way),
``mean_session_h`` (hours, null = never leaves), ``mean_offline_min`` (minutes).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from shoal.errors import ShoalError
from shoal.model.config import PRESETS, ModelConfig
from shoal.model.profile import profile_model
from shoal.plan.types import ChurnModel, Device, FrameworkCpu, Link, Network, Scenario, Workload

MBIT = 1e6 / 8  # bytes/s in one Mbit/s
GBIT = 1e9 / 8  # bytes/s in one Gbit/s
GB = 1e9  # bytes in one GB
TFLOPS = 1e12  # FLOP/s in one TFLOP/s
MS = 1e-3  # seconds in one millisecond
DTYPES = {"fp16": 2, "bf16": 2, "fp32": 4}

# --------------------------------------------------------------------------- units


def _num(d: dict, key: str, where: str, *, positive: bool = True, allow_zero: bool = False) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ShoalError(f"{where}: {key} must be a number, got {v!r}")
    if positive and (v < 0 or (v == 0 and not allow_zero)):
        raise ShoalError(f"{where}: {key} must be {'>= 0' if allow_zero else '> 0'}, got {v}")
    return float(v)


def _bandwidth(d: dict, stem: str, where: str) -> float:
    """Bytes/s from ``<stem>_mbps`` or ``<stem>_gbps`` (exactly one must be given)."""
    keys = [k for k in (f"{stem}_mbps", f"{stem}_gbps") if k in d]
    if len(keys) != 1:
        raise ShoalError(f"{where}: give exactly one of {stem}_mbps or {stem}_gbps")
    scale = MBIT if keys[0].endswith("mbps") else GBIT
    return _num(d, keys[0], where) * scale


def _link(d: dict, where: str) -> Link:
    if not isinstance(d, dict):
        raise ShoalError(f"{where}: expected an object with latency_ms and bandwidth_mbps/gbps")
    if "latency_ms" not in d:
        raise ShoalError(f"{where}: missing latency_ms")
    return Link(latency=_num(d, "latency_ms", where, allow_zero=True) * MS,
                bandwidth=_bandwidth(d, "bandwidth", where))


def _link_dict(link: Link) -> dict:
    return {"latency_ms": link.latency / MS, "bandwidth_mbps": link.bandwidth / MBIT}


_DEVICE_KEYS = {"id", "kind", "tflops", "memory_gb", "region", "up_mbps", "up_gbps", "down_mbps",
                "down_gbps", "can_host_server", "mean_session_h", "host_memory_gb", "cores"}


def _device(d: dict, where: str) -> Device:
    unknown = set(d) - _DEVICE_KEYS
    if unknown:
        raise ShoalError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_DEVICE_KEYS)}")
    for key in ("id", "region", "tflops", "memory_gb"):
        if key not in d:
            raise ShoalError(f"{where}: missing {key}")
    if not isinstance(d["id"], str) or not d["id"]:
        raise ShoalError(f"{where}: id must be a non-empty string")
    where = f"device {d['id']}"
    session = d.get("mean_session_h")
    if session is not None:
        session = _num(d, "mean_session_h", where) * 3600.0
    return Device(
        id=d["id"],
        kind=str(d.get("kind", "gpu")),
        flops=_num(d, "tflops", where, allow_zero=True) * TFLOPS,
        memory=_num(d, "memory_gb", where, allow_zero=True) * GB,
        region=str(d["region"]),
        up=_bandwidth(d, "up", where),
        down=_bandwidth(d, "down", where),
        can_host_server=bool(d.get("can_host_server", False)),
        mean_session_s=session,
        host_memory=_num(d, "host_memory_gb", where) * GB if "host_memory_gb" in d else 64e9,
        cores=_cores(d, where),
    )


def _cores(d: dict, where: str) -> int:
    c = d.get("cores", 8)
    if not isinstance(c, int) or isinstance(c, bool) or c <= 0:
        raise ShoalError(f"{where}: cores must be a positive integer (CPU cores of the host), got {c!r}")
    return c


# framework_cpu keys of a scenario file (milliseconds; coordinator_cores in cores) -> FrameworkCpu fields
_CPU_KEYS = {"server_task_ms": "server_task_s", "server_task_ns_per_byte": "server_task_byte_s", "worker_task_ms": "worker_task_s", "server_sync_ms": "server_sync_s",
             "coordinator_member_ms": "coordinator_member_s", "coordinator_report_ms": "coordinator_report_s",
             "coordinator_cores": "coordinator_cores", "server_merge_ms_per_mparam": "server_merge_param_s",
             "server_codec_scale": "server_codec_scale", "act_codec_scale": "act_codec_scale",
             "server_screen_ms_per_mcoord": "server_screen_sample_s",
             "server_gflops": "server_flops", "server_merge_speedup": "server_merge_speedup",
             "server_codec_speedup": "server_codec_speedup", "server_push_ms_per_mparam": "server_push_param_s",
             "server_pull_ms_per_mparam": "server_pull_param_s", "server_step_ms_per_mparam": "server_step_param_s"}
_CPU_UNITS = {"coordinator_cores": 1.0, "server_task_ns_per_byte": 1e-9, "server_merge_ms_per_mparam": MS / 1e6, "server_codec_scale": 1.0, "act_codec_scale": 1.0,
              "server_screen_ms_per_mcoord": MS / 1e6, "server_gflops": 1e9,
              "server_merge_speedup": 1.0, "server_codec_speedup": 1.0, "server_push_ms_per_mparam": MS / 1e6,
              "server_pull_ms_per_mparam": MS / 1e6, "server_step_ms_per_mparam": MS / 1e6}  # the rest: ms


def _framework_cpu(d: dict, name: str) -> FrameworkCpu:
    """The scenario's ``framework_cpu`` section (CPU-ms per message, per million parameters for
    the ``*_ms_per_mparam`` keys; absent keys keep the defaults)."""
    c = d.get("framework_cpu", {})
    if not isinstance(c, dict):
        raise ShoalError(f"scenario {name}: framework_cpu must be an object of CPU-ms figures")
    unknown = set(c) - set(_CPU_KEYS)
    if unknown:
        raise ShoalError(f"scenario {name}: framework_cpu has unknown field(s) {sorted(unknown)}; "
                         f"allowed: {sorted(_CPU_KEYS)}")
    vals = {}
    for key, attr in _CPU_KEYS.items():
        if key in c:
            v = c[key]
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if (not ok or v < 0 or (key in ("coordinator_cores", "server_gflops") and v <= 0)
                    or (key in ("server_merge_speedup", "server_codec_speedup") and v < 1)):
                raise ShoalError(f"scenario {name}: framework_cpu.{key} must be a non-negative number "
                                 f"(coordinator_cores and server_gflops > 0, server_merge_speedup and server_codec_speedup >= 1), "
                                 f"got {v!r}")
            vals[attr] = float(v) * _CPU_UNITS.get(key, MS)
    return FrameworkCpu(**vals)


def _device_dict(dev: Device) -> dict:
    return {
        "id": dev.id, "kind": dev.kind, "tflops": dev.flops / TFLOPS, "memory_gb": dev.memory / GB,
        "region": dev.region, "up_mbps": dev.up / MBIT, "down_mbps": dev.down / MBIT,
        "can_host_server": dev.can_host_server,
        "mean_session_h": None if dev.mean_session_s is None else dev.mean_session_s / 3600.0,
        "host_memory_gb": dev.host_memory / GB,
        "cores": dev.cores,
    }


def _expand_devices(entries: list) -> list[dict]:
    """Flatten device entries; a group ``{count, id_prefix, template}`` yields ``count`` devices."""
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ShoalError(f"devices[{i}]: expected an object, got {type(e).__name__}")
        if "template" in e:
            count = e.get("count")
            if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
                raise ShoalError(f"devices[{i}]: group count must be a positive integer, got {count!r}")
            prefix = e.get("id_prefix", e["template"].get("kind", "dev") + "-")
            for j in range(count):
                out.append({**e["template"], "id": f"{prefix}{j}"})
        else:
            out.append(e)
    return out


# --------------------------------------------------------------------------- load / dump


def scenario_from_dict(d: dict) -> Scenario:
    """Build and validate a :class:`Scenario` from its file form (human units)."""
    if not isinstance(d, dict):
        raise ShoalError("scenario must be a JSON object")
    name = str(d.get("name", "unnamed"))
    for key, kind in (("workload", dict), ("network", dict), ("devices", list)):
        if key not in d:
            raise ShoalError(f"scenario {name}: missing section {key!r}")
        if not isinstance(d[key], kind):
            raise ShoalError(f"scenario {name}: section {key!r} must be a JSON {'object' if kind is dict else 'array'}")
    w = d["workload"]
    for key in ("model", "seq_len", "global_batch", "micro_batch_size"):
        if key not in w:
            raise ShoalError(f"scenario {name}: workload is missing {key}")
    if w["model"] not in PRESETS and w.get("config") is None:
        raise ShoalError(f"scenario {name}: unknown model preset {w['model']!r}; choose one of: {', '.join(PRESETS)} "
                         "(or give the model's shape as workload.config)")
    dtype = w.get("dtype", "fp16")
    if dtype not in DTYPES:
        raise ShoalError(f"scenario {name}: dtype must be one of {list(DTYPES)}, got {dtype!r}")
    for key in ("seq_len", "global_batch", "micro_batch_size"):
        if not isinstance(w[key], int) or isinstance(w[key], bool) or w[key] <= 0:
            raise ShoalError(f"scenario {name}: workload {key} must be a positive integer, got {w[key]!r}")
    if w["global_batch"] % w["micro_batch_size"]:
        raise ShoalError(
            f"scenario {name}: global_batch {w['global_batch']} is not a multiple of micro_batch_size {w['micro_batch_size']}"
        )
    try:
        config = ModelConfig.from_dict(dict(w["config"])) if w.get("config") is not None else None
    except (TypeError, ValueError) as exc:
        raise ShoalError(f"scenario {name}: workload config is not a model's shape: {exc}") from None
    workload = Workload(model=w["model"], seq_len=w["seq_len"], global_batch=w["global_batch"],
                        micro_batch_size=w["micro_batch_size"], dtype_bytes=DTYPES[dtype],
                        optimizer=str(w.get("optimizer", "adamw")), config=config)

    devices = [_device(e, f"devices[{i}]") for i, e in enumerate(_expand_devices(list(d["devices"])))]
    n = d["network"]
    intra = {str(r): _link(v, f"network.intra.{r}") for r, v in n.get("intra", {}).items()}
    inter: dict[tuple[str, str], Link] = {}
    for i, e in enumerate(n.get("inter", [])):
        regions = e.get("regions")
        if not isinstance(regions, list) or len(regions) != 2:
            raise ShoalError(f"network.inter[{i}]: regions must be a list of two region names")
        inter[tuple(sorted(map(str, regions)))] = _link(e, f"network.inter[{i}] {regions}")
    default = _link(n["inter_default"], "network.inter_default") if "inter_default" in n else None
    overrides: dict[tuple[str, str], Link] = {}
    for i, e in enumerate(n.get("overrides", [])):
        pair = e.get("devices")
        if not isinstance(pair, list) or len(pair) != 2:
            raise ShoalError(f"network.overrides[{i}]: devices must be a list of two device ids")
        overrides[tuple(sorted(map(str, pair)))] = _link(e, f"network.overrides[{i}] {pair}")
    regions = sorted({dev.region for dev in devices})
    for r in regions:
        if r not in intra:
            raise ShoalError(f"scenario {name}: network.intra has no link for region {r!r}; add one")
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            if (a, b) not in inter:
                if default is None:
                    raise ShoalError(
                        f"scenario {name}: no network link between regions {a!r} and {b!r}; add it to network.inter or set network.inter_default"
                    )
                inter[(a, b)] = default
    c = d.get("churn", {})
    try:
        trace = tuple((float(t), str(dev), str(ev)) for t, dev, ev in c.get("trace", []))
    except (TypeError, ValueError) as exc:
        raise ShoalError(f"scenario {name}: churn.trace must be a list of [time_s, device_id, \"leave\"|\"join\"]") from exc
    churn = ChurnModel(enabled=bool(c.get("enabled", False)),
                       mean_offline_s=float(c.get("mean_offline_min", 10.0)) * 60.0, trace=trace)
    scenario = Scenario(name=name, devices=devices, network=Network(intra=intra, inter=inter, overrides=overrides),
                        workload=workload, churn=churn, description=str(d.get("description", "")),
                        source=str(d.get("source", "")), cpu=_framework_cpu(d, name))
    validate_scenario(scenario)
    return scenario


def scenario_to_dict(s: Scenario) -> dict:
    """The file form of ``s`` (human units); ``scenario_from_dict`` reads it back."""
    dtype = {2: "fp16", 4: "fp32"}[s.workload.dtype_bytes]
    return {
        "name": s.name,
        "description": s.description,
        "source": s.source,
        "workload": {"model": s.workload.model, "seq_len": s.workload.seq_len,
                     "global_batch": s.workload.global_batch,
                     "micro_batch_size": s.workload.micro_batch_size, "dtype": dtype,
                     "optimizer": s.workload.optimizer,
                     **({"config": s.workload.config.to_dict()} if s.workload.config is not None else {})},
        "network": {
            "intra": {r: _link_dict(v) for r, v in sorted(s.network.intra.items())},
            "inter": [{"regions": list(k), **_link_dict(v)} for k, v in sorted(s.network.inter.items())],
            "overrides": [{"devices": list(k), **_link_dict(v)} for k, v in sorted(s.network.overrides.items())],
        },
        "devices": [_device_dict(dev) for dev in s.devices],
        "churn": {"enabled": s.churn.enabled, "mean_offline_min": s.churn.mean_offline_s / 60.0,
                  "trace": [list(t) for t in s.churn.trace]},
        "framework_cpu": {k: getattr(s.cpu, a) / _CPU_UNITS.get(k, MS) for k, a in _CPU_KEYS.items()},
    }


def validate_scenario(s: Scenario) -> None:
    """Raise a one-line :class:`ShoalError` for anything that makes ``s`` unusable."""
    seen = set()
    for dev in s.devices:
        if dev.id in seen:
            raise ShoalError(f"scenario {s.name}: device id {dev.id!r} appears twice; ids must be unique")
        seen.add(dev.id)
        for key in ("up", "down"):
            if not getattr(dev, key) > 0:
                raise ShoalError(f"scenario {s.name}: device {dev.id} has {key}link bandwidth {getattr(dev, key)}; it must be > 0")
        if dev.flops < 0 or dev.memory < 0:
            raise ShoalError(f"scenario {s.name}: device {dev.id} has negative flops or memory")
    for where, links in (("intra", s.network.intra), ("inter", s.network.inter), ("override", s.network.overrides)):
        for key, link in links.items():
            if not link.bandwidth > 0 or link.latency < 0:
                raise ShoalError(f"scenario {s.name}: {where} link {key} needs bandwidth > 0 and latency >= 0")
    if not s.workers:
        raise ShoalError(f"scenario {s.name}: no device has tflops > 0, so nothing can compute")
    if not s.server_hosts:
        raise ShoalError(f"scenario {s.name}: no device can host a stage server; set can_host_server on at least one")
    for _t, dev_id, event in s.churn.trace:
        if dev_id not in seen:
            raise ShoalError(f"scenario {s.name}: churn trace names unknown device {dev_id!r}")
        if event not in ("leave", "join"):
            raise ShoalError(f"scenario {s.name}: churn trace event must be 'leave' or 'join', got {event!r}")
    w = s.workload
    cfg = w.model_config()
    if w.seq_len > cfg.max_seq_len:
        raise ShoalError(f"scenario {s.name}: seq_len {w.seq_len} exceeds model {w.model}'s max {cfg.max_seq_len}")
    prof = profile_model(cfg, w.seq_len, w.micro_batch_size, w.dtype_bytes)
    n_layers = len(prof.layers)
    need = prof.worker_memory(0, n_layers)
    have = sum(d.memory for d in s.workers)
    biggest_layer = max(prof.worker_memory(i, i + 1) for i in range(n_layers))
    if have < need or max(d.memory for d in s.workers) < biggest_layer:
        raise ShoalError(
            f"scenario {s.name}: model {w.model} needs {need / GB:.1f} GB of worker memory (largest layer {biggest_layer / GB:.2f} GB) "
            f"but the devices have {have / GB:.1f} GB in total; use a smaller model or micro-batch"
        )
    server_need = prof.server_memory(0, n_layers, local=True)  # (the least a policy needs: local mode's)
    server_have = sum(d.host_memory for d in s.server_hosts)
    if server_have < server_need:
        raise ShoalError(
            f"scenario {s.name}: stage servers need {server_need / GB:.1f} GB of host memory but server hosts have {server_have / GB:.1f} GB"
        )


def load_scenario(name_or_path: str) -> Scenario:
    """A built-in scenario by name (see ``BUILTIN_SCENARIOS``, plus any ``scale-N``) or a JSON file."""
    if name_or_path in _BUILDERS:
        return scenario_from_dict(_BUILDERS[name_or_path]())
    if name_or_path.startswith("scale-"):
        return scenario_from_dict(_scale_dict(_parse_scale(name_or_path)))
    p = Path(name_or_path)
    if not p.is_file():
        raise ShoalError(
            f"no built-in scenario or file called {name_or_path!r}; built-ins: {', '.join(BUILTIN_SCENARIOS)} (and scale-N)"
        )
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ShoalError(f"scenario file {p} is not valid JSON: {exc}") from exc
    return scenario_from_dict(data)


def save_scenario(s: Scenario, path: str | Path) -> None:
    """Write ``s`` as a scenario file."""
    Path(path).write_text(json.dumps(scenario_to_dict(s), indent=2) + "\n")


# --------------------------------------------------------------------------- built-ins

V100_TFLOPS = 125 * 0.4  # V100 fp16 tensor peak ~125 TFLOP/s x ~40 % achieved in training
EFFICIENCY = 0.4  # fraction of peak a consumer GPU reaches in real training (DESIGN: 30-50 %)
# (peak dense fp16 TFLOP/s with fp32 accumulate, memory GB), DESIGN.md gaming-GPU figures
GPUS = {
    "rtx3060": (25, 12), "rtx3070": (41, 8), "rtx3080": (60, 10), "rtx3090": (71, 24),
    "rtx4070": (58, 12), "rtx4080": (97, 16), "rtx4090": (165, 24),
}
GAMING_MIX = ["rtx3060", "rtx3060", "rtx3070", "rtx3070", "rtx3080", "rtx3090", "rtx4070", "rtx4080", "rtx4090"]

DTFM_SOURCE = ("DT-FM (Yuan et al., NeurIPS 2022) network cases as listed in DESIGN.md; V100 effective "
               "50 TFLOP/s = ~125 TFLOP/s fp16 tensor peak x 40 %, 16 GB (p3.16xlarge).")
GAMING_SOURCE = ("DESIGN.md gaming-GPU figures (peak fp16 tensor TFLOP/s x 40 % achieved) and home internet "
                 "figures (down 100-1000 Mbit/s, up 10-50 Mbit/s on cable, symmetric fiber; RTT 5-20 ms in a city, "
                 "30-80 ms in a continent, 100-250 ms across oceans); rented hosts: 10 Gbit/s datacenter links.")


def _v100(region: str) -> dict:
    # A GPU of a cloud machine; NIC capacity is left to the path links (100 Gbit/s).
    return {"kind": "v100", "tflops": V100_TFLOPS, "memory_gb": 16, "region": region,
            "up_gbps": 100, "down_gbps": 100, "can_host_server": True, "host_memory_gb": 61}


def _dtfm_workload() -> dict:
    return {"model": "gpt-1.3b", "seq_len": 2048, "global_batch": 1024, "micro_batch_size": 1, "dtype": "fp16"}


def _dtfm_regions(name: str, desc: str, groups: list[tuple[str, int]], intra: dict, inter: list,
                  inter_default: dict | None = None) -> dict:
    devices = [{"count": n, "id_prefix": f"{r}-", "template": _v100(r)} for r, n in groups]
    net = {"intra": intra, "inter": inter}
    if inter_default is not None:
        net["inter_default"] = inter_default
    return {"name": name, "description": desc, "source": DTFM_SOURCE, "workload": _dtfm_workload(),
            "network": net, "devices": devices}


def _dtfm0() -> dict:
    machines = [(f"m{i}", 8) for i in range(8)]
    return _dtfm_regions(
        "dtfm-0", "DT-FM case 0, data center: 8 machines x 8 V100; 100 Gbit/s inside a machine, 3.125 Gbit/s between.",
        machines, {m: {"latency_ms": 0.01, "bandwidth_gbps": 100} for m, _ in machines}, [],
        {"latency_ms": 0.1, "bandwidth_gbps": 3.125})


def _dtfm1() -> dict:
    groups = [(f"m{i}", 4) for i in range(8)] + [(f"s{i}", 1) for i in range(32)]
    return _dtfm_regions(
        "dtfm-1", "DT-FM case 1, spot: 8 machines x 4 V100 at 100 Gbit/s inside + 32 single-V100 machines; 1.25 Gbit/s between all others.",
        groups, {m: {"latency_ms": 0.01, "bandwidth_gbps": 100} for m, _ in groups}, [],
        {"latency_ms": 0.1, "bandwidth_gbps": 1.25})


def _dtfm2() -> dict:
    return _dtfm_regions(
        "dtfm-2", "DT-FM case 2, two sites: 32 V100 in Ohio, 32 in Virginia; 5 Gbit/s 1 ms inside a site, 1.12 Gbit/s 11 ms across.",
        [("ohio", 32), ("virginia", 32)],
        {r: {"latency_ms": 1, "bandwidth_gbps": 5} for r in ("ohio", "virginia")},
        [{"regions": ["ohio", "virginia"], "latency_ms": 11, "bandwidth_gbps": 1.12}])


_DTFM3 = {("va", "or"): (67, 1.15), ("va", "ca"): (59, 1.05), ("va", "oh"): (11, 1.12),
          ("or", "ca"): (12, 1.25), ("or", "oh"): (49, 1.10), ("ca", "oh"): (52, 1.02)}
_DTFM4 = {
    ("or", "va"): (67, 0.79), ("or", "oh"): (49, 1.10), ("or", "tyo"): (96, 0.523), ("or", "sel"): (124, 0.46),
    ("or", "lon"): (136, 0.42), ("or", "fra"): (143, 0.404), ("or", "irl"): (124, 0.482),
    ("va", "oh"): (11, 1.12), ("va", "tyo"): (143, 0.524), ("va", "sel"): (172, 0.50), ("va", "lon"): (76, 1.16),
    ("va", "fra"): (90, 1.02), ("va", "irl"): (67, 1.05), ("oh", "tyo"): (130, 0.694), ("oh", "sel"): (159, 0.529),
    ("oh", "lon"): (86, 1.05), ("oh", "fra"): (99, 0.799), ("oh", "irl"): (77, 1.14), ("tyo", "sel"): (34, 1.10),
    ("tyo", "lon"): (210, 0.366), ("tyo", "fra"): (223, 0.36), ("tyo", "irl"): (199, 0.465),
    ("sel", "lon"): (238, 0.342), ("sel", "fra"): (235, 0.358), ("sel", "irl"): (228, 0.335),
    ("lon", "fra"): (14, 1.14), ("lon", "irl"): (12, 1.09), ("fra", "irl"): (24, 1.08),
}


def _table_inter(table: dict) -> list:
    return [{"regions": list(k), "latency_ms": ms, "bandwidth_gbps": g} for k, (ms, g) in table.items()]


def _dtfm3() -> dict:
    regions = ["va", "or", "ca", "oh"]
    return _dtfm_regions(
        "dtfm-3", "DT-FM case 3, regional: 16 V100 each in Virginia, Oregon, California, Ohio; 2 Gbit/s 5 ms inside a region.",
        [(r, 16) for r in regions], {r: {"latency_ms": 5, "bandwidth_gbps": 2} for r in regions}, _table_inter(_DTFM3))


def _dtfm4() -> dict:
    regions = ["or", "va", "oh", "tyo", "sel", "lon", "fra", "irl"]
    return _dtfm_regions(
        "dtfm-4", "DT-FM case 4, world-wide: 8 V100 each in Oregon, Virginia, Ohio, Tokyo, Seoul, London, Frankfurt, Ireland.",
        [(r, 8) for r in regions], {r: {"latency_ms": 5, "bandwidth_gbps": 2} for r in regions}, _table_inter(_DTFM4))


def _home_gpu(rng: random.Random, region: str, kind: str, *, churn: bool = True,
              session_h: tuple[float, float] = (1.0, 8.0)) -> dict:
    peak, mem = GPUS[kind]
    fiber = rng.random() < 0.35
    down = rng.choice([100, 250, 500, 1000]) if not fiber else rng.choice([300, 500, 1000])
    up = down if fiber else rng.choice([10, 20, 30, 40, 50])
    return {"kind": kind, "tflops": round(peak * EFFICIENCY, 2), "memory_gb": mem, "region": region,
            "up_mbps": up, "down_mbps": down,
            "mean_session_h": round(rng.uniform(*session_h), 2) if churn else None}


def _rented_host(region: str) -> dict:
    return {"kind": "server", "tflops": 0, "memory_gb": 0, "region": region, "up_gbps": 10, "down_gbps": 10,
            "can_host_server": True, "host_memory_gb": 128}


def _gaming(name: str, desc: str, regions: dict[str, int], intra_ms: dict[str, float],
            inter: dict[tuple[str, str], float], hosts: list[str], seed: int, model: str = "gpt-1.3b") -> dict:
    rng = random.Random(seed)
    devices = []
    for r, n in regions.items():
        for i in range(n):
            devices.append({"id": f"{r}-{i}", **_home_gpu(rng, r, rng.choice(GAMING_MIX))})
    for i, r in enumerate(hosts):
        devices.append({"id": f"host-{r}-{i}", **_rented_host(r)})
    # Paths between homes are limited by the access links; the backbone is not the bottleneck.
    return {
        "name": name, "description": desc, "source": GAMING_SOURCE,
        "workload": {"model": model, "seq_len": 1024, "global_batch": 512, "micro_batch_size": 1, "dtype": "fp16"},
        "network": {"intra": {r: {"latency_ms": intra_ms[r], "bandwidth_gbps": 1} for r in regions},
                    "inter": [{"regions": list(k), "latency_ms": ms, "bandwidth_gbps": 1} for k, ms in inter.items()]},
        "devices": devices,
        "churn": {"enabled": True, "mean_offline_min": 30},
    }


_EU = ["lon", "fra", "par", "ams", "sto"]
_EU_MS = {("lon", "fra"): 8, ("lon", "par"): 5, ("lon", "ams"): 5, ("lon", "sto"): 16, ("fra", "par"): 6,
          ("fra", "ams"): 4, ("fra", "sto"): 12, ("ams", "par"): 5, ("ams", "sto"): 12, ("par", "sto"): 16}


def _gaming_eu() -> dict:
    return _gaming(
        "gaming-eu", "50 home gaming GPUs (RTX 3060-4090) in 5 European cities over home links, churn of hours, "
        "3 rented 10 Gbit/s server hosts; gpt-1.3b.",
        dict.fromkeys(_EU, 48 // len(_EU) + 1), dict.fromkeys(_EU, 8),
        {k: 2 * v + 10 for k, v in _EU_MS.items()}, ["fra", "lon", "ams"], seed=11)


def _gaming_world() -> dict:
    regions = {"lon": 12, "fra": 12, "nyc": 12, "chi": 12, "sfo": 12, "tyo": 12, "sel": 12, "syd": 8}
    cont = {"lon": "eu", "fra": "eu", "nyc": "na", "chi": "na", "sfo": "na", "tyo": "as", "sel": "as", "syd": "oc"}
    far = {("eu", "na"): 45, ("as", "na"): 60, ("eu", "oc"): 140, ("as", "eu"): 110, ("na", "oc"): 80, ("as", "oc"): 55}
    inter = {}
    names = sorted(regions)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ca, cb = sorted((cont[a], cont[b]))
            inter[(a, b)] = 20 if ca == cb else far[(ca, cb)]
    return _gaming(
        "gaming-world", "96 home gaming GPUs on 4 continents (8 cities) over home links, churn, 4 rented server hosts; gpt-1.3b.",
        regions, dict.fromkeys(regions, 8), inter, ["fra", "nyc", "tyo", "sfo"], seed=12)


def _ablation(name: str, compute: bool, network: bool, churn: bool) -> dict:
    """Base: 32 RTX 3090 in 4 regions on 1 Gbit/s fiber, 10 ms inside / 40 ms between; switch one factor on."""
    rng = random.Random(7)
    regions = ["r0", "r1", "r2", "r3"]
    devices = []
    for r in regions:
        for i in range(8):
            kind = rng.choice(GAMING_MIX) if compute else "rtx3090"
            dev = _home_gpu(rng, r, kind, churn=churn)
            if not network:
                dev["up_mbps"] = dev["down_mbps"] = 1000
            devices.append({"id": f"{r}-{i}", **dev})
    for r in regions:
        devices.append({"id": f"host-{r}", **_rented_host(r)})
    if network:
        intra = {r: {"latency_ms": rng.choice([5, 10, 20]), "bandwidth_gbps": 1} for r in regions}
        inter = [{"regions": [a, b], "latency_ms": rng.choice([30, 60, 120, 200]),
                  "bandwidth_mbps": rng.choice([100, 300, 1000])}
                 for i, a in enumerate(regions) for b in regions[i + 1:]]
    else:
        intra = {r: {"latency_ms": 10, "bandwidth_gbps": 1} for r in regions}
        inter = [{"regions": [a, b], "latency_ms": 40, "bandwidth_gbps": 1}
                 for i, a in enumerate(regions) for b in regions[i + 1:]]
    factors = [f for f, on in (("compute", compute), ("network", network), ("churn", churn)) if on]
    return {
        "name": name,
        "description": f"Ablation base (32 RTX 3090, 4 regions, 1 Gbit/s fiber, 4 rented hosts, gpt-350m) with heterogeneous {' + '.join(factors)}.",
        "source": GAMING_SOURCE,
        "workload": {"model": "gpt-350m", "seq_len": 1024, "global_batch": 256, "micro_batch_size": 1, "dtype": "fp16"},
        "network": {"intra": intra, "inter": inter},
        "devices": devices,
        "churn": {"enabled": churn, "mean_offline_min": 30},
    }


def _demo() -> dict:
    rng = random.Random(3)
    regions = {"eu": 4, "us": 4, "asia": 3}
    devices = []
    for r, n in regions.items():
        for i in range(n):
            dev = _home_gpu(rng, r, rng.choice(GAMING_MIX), session_h=(0.05, 0.15))
            devices.append({"id": f"{r}-{i}", **dev})
    devices.append({"id": "host-eu", **_rented_host("eu")})
    devices.append({"id": "host-us", **_rented_host("us")})
    return {
        "name": "demo",
        "description": "Local demo: 11 gaming GPUs in 3 regions over home links with churn (sessions of minutes), "
                       "2 rented server hosts; model tiny, seq 128, micro-batch 4, 8 micro-batches.",
        "source": GAMING_SOURCE,
        "workload": {"model": "tiny", "seq_len": 128, "global_batch": 32, "micro_batch_size": 4, "dtype": "fp32"},
        "network": {"intra": {r: {"latency_ms": 10, "bandwidth_gbps": 1} for r in regions},
                    "inter": [{"regions": ["eu", "us"], "latency_ms": 45, "bandwidth_gbps": 1},
                              {"regions": ["asia", "eu"], "latency_ms": 110, "bandwidth_gbps": 1},
                              {"regions": ["asia", "us"], "latency_ms": 60, "bandwidth_gbps": 1}]},
        "devices": devices,
        "churn": {"enabled": True, "mean_offline_min": 1},
    }


MAX_SCALE = 4096


def _parse_scale(name: str) -> int:
    try:
        n = int(name.split("-", 1)[1])
    except ValueError as exc:
        raise ShoalError(f"scenario {name!r}: expected scale-N with an integer N, e.g. scale-256") from exc
    if not 2 <= n <= MAX_SCALE:
        raise ShoalError(f"scenario {name!r}: N must be in [2, {MAX_SCALE}]")
    return n


def _scale_dict(n: int, seed: int = 0) -> dict:
    """N home GPUs in K regions (K grows with sqrt N), one rented host per region, seeded."""
    rng = random.Random(seed * 1_000_003 + n)
    k = max(2, min(16, round(math.sqrt(n) / 2)))
    regions = [f"r{i}" for i in range(k)]
    # Regions on a ring of continents: latency grows with ring distance.
    inter = []
    for i, a in enumerate(regions):
        for j in range(i + 1, k):
            hop = min(j - i, k - (j - i))
            inter.append({"regions": [a, regions[j]], "latency_ms": 10 + 25 * hop + rng.randint(0, 10),
                          "bandwidth_gbps": 1})
    devices = [{"id": f"d{i}", **_home_gpu(rng, regions[rng.randrange(k)], rng.choice(GAMING_MIX))}
               for i in range(n)]
    devices += [{"id": f"host-{r}", **_rented_host(r)} for r in regions]
    return {
        "name": f"scale-{n}",
        "description": f"Generated: {n} home gaming GPUs in {k} regions, one rented host per region (seed {seed}); gpt-1.3b.",
        "source": GAMING_SOURCE,
        "workload": {"model": "gpt-1.3b", "seq_len": 1024, "global_batch": max(512, 2 * n),
                     "micro_batch_size": 1, "dtype": "fp16"},
        "network": {"intra": {r: {"latency_ms": 8, "bandwidth_gbps": 1} for r in regions}, "inter": inter},
        "devices": devices,
        "churn": {"enabled": True, "mean_offline_min": 30},
    }


_BUILDERS = {
    "dtfm-0": _dtfm0, "dtfm-1": _dtfm1, "dtfm-2": _dtfm2, "dtfm-3": _dtfm3, "dtfm-4": _dtfm4,
    "gaming-eu": _gaming_eu, "gaming-world": _gaming_world,
    "hetero-compute": lambda: _ablation("hetero-compute", True, False, False),
    "hetero-network": lambda: _ablation("hetero-network", False, True, False),
    "hetero-churn": lambda: _ablation("hetero-churn", False, False, True),
    "hetero-all": lambda: _ablation("hetero-all", True, True, True),
    "scale-64": lambda: _scale_dict(64), "scale-256": lambda: _scale_dict(256),
    "scale-1024": lambda: _scale_dict(1024), "scale-4096": lambda: _scale_dict(4096),
    "demo": _demo,
}
BUILTIN_SCENARIOS: tuple[str, ...] = tuple(_BUILDERS)


def builtin_description(name: str) -> str:
    """One line describing built-in scenario ``name``."""
    return _BUILDERS[name]().get("description", "")
