"""Shadow swarms: achieved against simulated step time, stage-server task rate and the
coordinator's CPU, with N shadow workers (shoal.runtime.roles.shadow) playing N equal GPUs.

    PYTHONPATH=. python bench/bench_shadow.py [--workers 16,64,256] [--model gpt-350m]
        [--gpu rtx4090] [--stages 2] [--steps 4] [--micro-batches 16] [--micro-batch-size 4]
        [--seq-len 256] [--speedup 1] [--per-process 64] [--sync local --sync-every 4] [--host-cores 8]

For each N: a scenario of N ``--gpu`` devices (one region, 1 Gb/s links) and two server
hosts (10 Gb/s, ``--host-cores`` cores each: the simulator's server CPU) with the run's
workload; ``shoal launch --shadow --scenario`` at ``--emulate-speedup`` (1: real GPU time),
its workers grouped ``--per-process`` to a process.
Prints per N: the simulator's step time for the planner's plan of that scenario (steps
after the first, as measured), the achieved step time (metrics, steps after the first),
their ratio, the stage servers' tasks per second, and the CPU seconds per wall second of
the coordinator, of each server and of each shadow worker process (from /proc, first commit
to last).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procstat import cpu_s  # noqa: E402


def scenario_dict(n: int, gpu: str, args) -> dict:
    from shoal.plan.scenario import EFFICIENCY, GPUS

    peak, mem = GPUS[gpu]
    dev = {"kind": gpu, "tflops": round(peak * EFFICIENCY, 2), "memory_gb": mem, "region": "dc",
           "up_mbps": 1000, "down_mbps": 1000}
    host = {"kind": "server", "tflops": 0, "memory_gb": 0, "region": "dc", "up_gbps": 10, "down_gbps": 10,
            "can_host_server": True, "host_memory_gb": 128, "cores": args.host_cores}
    return {"name": f"shadow-{n}", "description": f"{n} x {gpu}, two server hosts, one region",
            "workload": {"model": args.model, "seq_len": args.seq_len,
                         "global_batch": args.micro_batches * args.micro_batch_size,
                         "micro_batch_size": args.micro_batch_size, "dtype": "fp32"},
            "network": {"intra": {"dc": {"latency_ms": 1, "bandwidth_gbps": 10}}, "inter": []},
            "devices": [{"count": n, "id_prefix": "g", "template": dev},
                        {"id": "host-0", **host}, {"id": "host-1", **host}],
            "churn": {"enabled": False}}


def simulated_step(path: Path, args) -> float | None:
    from shoal.emulate.pacing import emulated_scenario
    from shoal.plan import make_plan
    from shoal.plan.scenario import load_scenario
    from shoal.sim.engine import simulate

    sc = emulated_scenario(load_scenario(str(path)), speedup=args.speedup)
    plan = make_plan(sc, stages=args.stages)
    res = simulate(plan, sc, steps=args.steps)
    body = res.step_times_s[1:] or res.step_times_s
    return statistics.fmean(body) if body else None


def run_one(n: int, args, root: Path) -> dict:
    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.train.metrics import read_jsonl

    path = root / f"shadow-{n}.json"
    path.write_text(json.dumps(scenario_dict(n, args.gpu, args)))
    out = root / f"run{n}"
    cfg = LaunchConfig(out=str(out), model=args.model, stages=args.stages, workers=n, steps=args.steps,
                       micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size,
                       seq_len=args.seq_len, data=("synthetic",), scenario=str(path), emulate_speedup=args.speedup,
                       shadow=True, shadow_per_process=args.per_process, dashboard=None, timeout_s=args.timeout,
                       sync=args.sync, sync_every=args.sync_every, ckpt_every=0,
                       dead_after_s=args.dead_after, min_lease_s=args.dead_after)
    marks: dict[int, tuple[float, dict[str, float]]] = {}
    ref: list = []

    def on_event(rec):
        if rec.get("event") == "step" and ref and rec["step"] in (0, args.steps - 1):
            sw = ref[0]
            pids = {"coordinator": sw.coord.pid, **{f"server{i}": p.pid for i, p in enumerate(sw.servers)},
                    **{f"workers{p.pid}": p.pid for p in {id(w): w for w in sw.workers if w}.values()}}
            marks[rec["step"]] = (time.monotonic(), {k: cpu_s(p) for k, p in pids.items()})
            if os.environ.get("SHOAL_PROFILE"):  # dump 1 at the first commit, 2 at the last (bench/prof_diff.py)
                for p in pids.values():
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGUSR1)

    with Swarm(cfg, on_event) as sw:
        ref.append(sw)
        sw.start()
        sw.wait()
    recs = read_jsonl(out / "metrics.jsonl")
    body = [r["step_time_s"] for r in recs if r["step"] >= 1] or [r["step_time_s"] for r in recs]
    achieved = statistics.fmean(body)
    sim = simulated_step(path, args)
    (t0, c0), (t1, c1) = marks[0], marks[args.steps - 1]
    wall = max(1e-9, t1 - t0)
    cpu = {k: (c1[k] - c0[k]) / wall for k in c0}
    tasks = args.micro_batches * (2 * args.stages - 1)  # per step, all stages
    return {"workers": n, "simulated_s": sim, "achieved_s": achieved,
            "ratio": achieved / sim if sim else None, "tasks_per_s_per_server": tasks / args.stages / achieved,
            "cpu": cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="16,64,256")
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--gpu", default="rtx4090")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--speedup", type=float, default=1.0, help="--emulate-speedup (1: real GPU time)")
    ap.add_argument("--per-process", type=int, default=64, help="shadow workers per process")
    ap.add_argument("--sync", default="exact")
    ap.add_argument("--sync-every", type=int, default=4)
    ap.add_argument("--dead-after", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--host-cores", type=int, default=8,
                    help="cores of each server host in the simulated scenario (the box's: its cores shared)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_shadow_"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"shadow swarms: {args.model}, {args.stages} stages, M={args.micro_batches} B={args.micro_batch_size} "
          f"T={args.seq_len}, {args.gpu} x N at time scale {args.speedup:g}, sync {args.sync}, "
          f"{os.cpu_count()} cores; simulated server hosts of {args.host_cores} cores\n")
    print("| workers | simulated step | achieved step | achieved / simulated | tasks/s per server | "
          "coordinator CPU | server CPU | worker processes' CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.workers.split(",") if x):
        r = run_one(n, args, root)
        srv = " / ".join(f"{v:.2f}" for k, v in sorted(r["cpu"].items()) if k.startswith("server"))
        wrk = " / ".join(f"{v:.2f}" for k, v in sorted(r["cpu"].items()) if k.startswith("workers"))
        sim = f"{r['simulated_s']:.3f} s" if r["simulated_s"] else "n/a"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "n/a"
        print(f"| {n} | {sim} | {r['achieved_s']:.3f} s | {ratio} | {r['tasks_per_s_per_server']:.1f} | "
              f"{r['cpu']['coordinator']:.2f} cores | {srv} cores | {wrk} cores |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
