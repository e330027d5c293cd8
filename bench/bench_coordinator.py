"""The coordinator's CPU with N members: a join storm, then steady heartbeats.

    PYTHONPATH=. python bench/bench_coordinator.py [--members 100,300,1000] [--per-process 250]
        [--window 20] [--stages 2] [--model gpt-350m] [--out DIR]

For each N: a real coordinator process (``shoal.runtime.processes.cli coordinator``, the
run emulating a scenario of N - S RTX 4090s and S server hosts, so it plans on the
scenario and asks nobody to measure), and N members joining it over gRPC on loopback,
``--per-process`` of them to a process on one event loop:

* N - S **workers**: real :class:`shoal.runtime.roles.worker.Worker` objects that join with
  their own ``_join_request`` over their own channel and keep themselves alive with the
  worker's own heartbeat loop (``_coordinator_beats``: the real request, every
  ``heartbeat_period`` seconds, joining again if dropped). They run no task loop: the
  assignment a heartbeat brings is taken at once (the task loop would take it between
  tasks), so each beats at its assigned rate (0.5 s at the defaults).
* S **stage servers** that join with the server token and beat like a stage server does
  (every 0.2 s, its checkpoint version, epoch, and ``alive``: the workers whose traffic it
  saw since its last beat; here two fifths of its share of the workers per beat, as 0.5 s
  lease renewals give). They hold no model and serve no tasks.

The run becomes ready once S workers joined (``--min-workers S``), so most joins land in a
running swarm, as late joins do. Measured from /proc (user + system CPU of the
coordinator's process, all threads, over a wall window):

* **join storm**: from the moment every member process is released (all call ``Join`` at
  once) until every worker has its stage: coordinator cores, CPU-ms per join, seconds;
* **steady state**: a ``--window`` second window starting 3 s after that: coordinator
  cores, heartbeats answered per second (counted by the members), CPU-ms per heartbeat,
  and CPU-ms per member-second (the planner's FrameworkCpu figure).

Members declared dead (the coordinator's ``leave`` events for missed heartbeats) and
members that had to join again are counted over the whole run; either means the box could
not keep the members' beats on time, and the row says so. The members' own CPU is printed
too: on a small box they compete with the coordinator for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procstat import cpu_s  # noqa: E402

# --profile: the coordinator runs under cProfile; SIGUSR1 writes what it profiled so far to
# ARGV[1].storm and starts again, SIGTERM writes the rest to ARGV[1].steady and exits.
PROFILED = """
import cProfile, os, runpy, signal, sys
out = sys.argv[1]
prof = [cProfile.Profile()]
def dump(suffix):
    prof[0].disable()
    prof[0].dump_stats(out + suffix)
def storm(*_):
    dump(".storm")
    prof[0] = cProfile.Profile()
    prof[0].enable()
def stop(*_):
    dump(".steady")
    os._exit(0)
signal.signal(signal.SIGUSR1, storm)
signal.signal(signal.SIGTERM, stop)
sys.argv = sys.argv[1:]
prof[0].enable()
runpy.run_module("shoal.runtime.processes.cli", run_name="__main__")
"""
SERVER_BEAT_S = 0.2  # a stage server's heartbeat period (StageServer's heartbeat_s default)
RENEW_SHARE = 0.4  # share of a server's workers it heard from since its last beat (0.2 s / 0.5 s renewals)



def scenario_dict(workers: int, stages: int, model: str) -> dict:
    """``workers`` RTX 4090s and ``stages`` server hosts in one region."""
    from shoal.plan.scenario import EFFICIENCY, GPUS

    peak, mem = GPUS["rtx4090"]
    dev = {"kind": "rtx4090", "tflops": round(peak * EFFICIENCY, 2), "memory_gb": mem, "region": "dc",
           "up_mbps": 1000, "down_mbps": 1000}
    host = {"kind": "server", "tflops": 0, "memory_gb": 0, "region": "dc", "up_gbps": 10, "down_gbps": 10,
            "can_host_server": True, "host_memory_gb": 128}
    return {"name": f"coord-{workers}", "description": f"{workers} x rtx4090, {stages} server hosts",
            "workload": {"model": model, "seq_len": 256, "global_batch": 64, "micro_batch_size": 4, "dtype": "fp32"},
            "network": {"intra": {"dc": {"latency_ms": 1, "bandwidth_gbps": 10}}, "inter": []},
            "devices": [{"count": workers, "id_prefix": "g", "template": dev},
                        *({"id": f"host-{k}", **host} for k in range(stages))],
            "churn": {"enabled": False}}


# ---------------------------------------------------------------------- member processes
class Counts:
    """What one member process reports to the bench (written to its stats file)."""

    def __init__(self):
        self.joined = self.assigned = self.beats = self.joins = self.server_misses = 0


class CountingStub:
    """The coordinator stub a bench worker uses: counts replies; takes a new assignment at once
    (the part of the task loop that matters to the coordinator)."""

    def __init__(self, stub, worker, counts: Counts):
        self._stub, self._w, self._c = stub, worker, counts

    async def Join(self, request, **kw):
        self._c.joins += 1
        return await self._stub.Join(request, **kw)

    async def Heartbeat(self, request, **kw):
        a = await self._stub.Heartbeat(request, **kw)
        self._c.beats += 1
        w = self._w
        if a.known and a.ready and a.stage >= 0 and a.stage != w.stage:
            if w.stage < 0:
                self._c.assigned += 1
            w.stage, w.first, w.last = a.stage, a.first, a.last
        elif not a.known and w.stage >= 0:
            self._c.assigned -= 1  # dropped: joins again, unassigned
        return a

    def __getattr__(self, name):
        return getattr(self._stub, name)


async def bench_worker(w, counts: Counts, go: asyncio.Event, ids: list[str]) -> None:
    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.runtime.transport.frames import retry

    w.coord = CountingStub(pbg.CoordinatorStub(w.channels.open(w.coord_addr)), w, counts)
    await go.wait()
    reply = await retry(lambda: w.coord.Join(w._join_request()), budget_s=600.0)
    w.member_id, w.spec = reply.member_id, reply.spec
    counts.joined += 1
    ids.append(w.member_id)
    await w._coordinator_beats()


async def bench_server(coord: str, token: str, server_token: str, name: str, k: int, stages: int,
                       ids_dir: Path, counts: Counts, go: asyncio.Event) -> None:
    """A stage server's membership traffic: join with the server token, beat every 0.2 s."""
    import grpc

    from shoal.net import shoal_pb2 as pb
    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.net.auth import Identity
    from shoal.net.channel import ChannelFactory
    from shoal.net.traffic import Traffic
    from shoal.runtime.transport.frames import retry

    traffic = Traffic()
    factory = ChannelFactory(token, traffic=traffic, identity=Identity(token, server_token=server_token))
    stub = pbg.CoordinatorStub(factory.open(coord))
    await go.wait()
    reply = await retry(lambda: stub.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{9000 + k}", name=name,
                                                        schema=1, ckpt_version=-1, ckpt_stage=-1, device=name,
                                                        will_measure=True)), budget_s=600.0)
    mid, epoch, beat, workers = reply.member_id, 0, 0, []
    counts.joined += 1
    while True:
        if beat % 10 == 0:  # its share of the workers (by id), as the members' files list them
            workers = sorted(i for f in ids_dir.glob("ids-*.txt") for i in f.read_text().split()
                             if hash(i) % stages == k)
        alive = [w for j, w in enumerate(workers) if (j + beat) % 5 < 5 * RENEW_SHARE]
        try:
            a = await stub.Heartbeat(pb.MemberRequest(
                member_id=mid, version=0, ckpt_version=0, epoch=epoch, counter_id=traffic.id, role="server",
                traffic=traffic.snapshot(), stats=pb.MemberStats(stage=k), alive=alive, doing="waiting for tasks",
                ckpt_versions=[0]), timeout=5)
        except grpc.aio.AioRpcError:  # as a stage server does: the next beat tries again
            counts.server_misses += 1
            await asyncio.sleep(SERVER_BEAT_S)
            continue
        counts.beats += 1
        epoch, beat = a.epoch, beat + 1
        if not a.known:  # declared dead: join again, as a stage server does
            counts.joins += 1
            mid = (await stub.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{9000 + k}", name=name,
                                                  schema=1, ckpt_version=-1, ckpt_stage=k, device=name),
                                   timeout=10)).member_id
        await asyncio.sleep(SERVER_BEAT_S)


async def member_process(args) -> None:
    """One process of bench members (``--member-process``): build them, wait for the go file,
    join all at once, beat; write counts to ``stats-K.json`` twice a second."""
    from shoal.runtime.roles.worker import Worker, WorkerOptions

    token, server_token = os.environ["SHOAL_TOKEN"], os.environ["SHOAL_SERVER_TOKEN"]
    run = Path(args.run)
    counts, go, ids = Counts(), asyncio.Event(), []
    tasks = []
    for name in args.servers.split(",") if args.servers else []:
        k = int(name.rsplit("-", 1)[1])
        tasks.append(bench_server(args.coord, token, server_token, name, k, args.stages, run, counts, go))
    for dev in args.devices.split(",") if args.devices else []:
        w = Worker(args.coord, token, WorkerOptions(name=dev, device=dev, flops=1e12, torch_device="cpu"))
        tasks.append(bench_worker(w, counts, go, ids))
    running = [asyncio.ensure_future(t) for t in tasks]
    stats, ids_file = run / f"stats-{args.index}.json", run / f"ids-{args.index}.txt"
    while True:
        if not go.is_set() and (run / "go").exists():
            go.set()
        for t in running:
            if t.done() and t.exception() is not None:
                raise t.exception()
        tmp = stats.with_suffix(".tmp")
        tmp.write_text(json.dumps({**vars(counts), "cpu_s": time.process_time(), "ready": True}))
        tmp.replace(stats)
        if ids:
            tmp = ids_file.with_suffix(".tmp")
            tmp.write_text("\n".join(ids))
            tmp.replace(ids_file)
        await asyncio.sleep(0.5)


# ---------------------------------------------------------------------- the bench
def read_stats(run: Path, procs: int) -> list[dict]:
    out = []
    for k in range(procs):
        try:
            out.append(json.loads((run / f"stats-{k}.json").read_text()))
        except (OSError, ValueError):
            out.append({})
    return out


def total(stats: list[dict], key: str) -> float:
    return sum(s.get(key, 0) for s in stats)


def wait_for(pred, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    end = time.monotonic() + timeout
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a bench process exited ({p.returncode}) while waiting for {what}")
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_one(n: int, args, root: Path) -> dict:
    from shoal.runtime.common import heartbeat_period
    from shoal.runtime.roles.coordinator import beat_floor_s

    stages = args.stages
    workers = n - stages
    run = root / f"n{n}"
    shutil.rmtree(run, ignore_errors=True)  # no file of an earlier run may be taken for this one's
    run.mkdir(parents=True)
    scen = run / "scenario.json"
    scen.write_text(json.dumps(scenario_dict(workers, stages, args.model)))
    env = dict(os.environ, SHOAL_TOKEN=secrets.token_hex(8), SHOAL_SERVER_TOKEN=secrets.token_hex(8),
               OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1")
    addr_file = run / "coord.addr"
    logs = contextlib.ExitStack()  # the processes' log files, closed once they are gone
    head = [sys.executable, "-c", PROFILED, str(run / "coordinator.prof")] if args.profile else \
        [sys.executable, "-m", "shoal.runtime.processes.cli"]
    coord = subprocess.Popen(
        [*head, "coordinator", "--listen", "127.0.0.1:0",
         "--address-file", str(addr_file), "--out", str(run / "out"), "--model", args.model, "--stages", str(stages),
         "--steps", "1000", "--micro-batches", "16", "--micro-batch-size", "4", "--seq-len", "256",
         "--min-workers", str(stages), "--stall-timeout", "0", "--insecure", "--emulate-scenario", str(scen),
         "--dead-after", f"{args.dead_after:g}"],
        env=env, stdout=logs.enter_context((run / "coordinator.log").open("w")), stderr=subprocess.STDOUT)
    procs = [coord]
    try:
        wait_for(addr_file.exists, 120, "the coordinator's address", procs)
        address = addr_file.read_text().strip()
        devs = [f"g{i}" for i in range(workers)]
        groups = [devs[i:i + args.per_process] for i in range(0, len(devs), args.per_process)] or [[]]
        members = []
        for k, group in enumerate(groups):
            cmd = [sys.executable, __file__, "--member-process", "--run", str(run), "--coord", address,
                   "--index", str(k), "--stages", str(stages), "--devices", ",".join(group)]
            if k == 0:
                cmd += ["--servers", ",".join(f"host-{s}" for s in range(stages))]
            members.append(subprocess.Popen(cmd, env=env, stdout=logs.enter_context((run / f"members-{k}.log").open("w")),
                                            stderr=subprocess.STDOUT))
        procs += members
        wait_for(lambda: all(s.get("ready") for s in read_stats(run, len(members))), 600,
                 "the member processes to start", procs)
        time.sleep(1.0)  # the coordinator idles: its start-up CPU is behind us
        c0, t0 = cpu_s(coord.pid), time.monotonic()
        (run / "go").write_text("")
        wait_for(lambda: total(read_stats(run, len(members)), "assigned") >= workers
                 and total(read_stats(run, len(members)), "joined") >= n, 900, "every worker's stage", procs)
        c1, t1 = cpu_s(coord.pid), time.monotonic()
        if args.profile:
            coord.send_signal(signal.SIGUSR1)
        time.sleep(3.0)
        s0, c2, t2 = read_stats(run, len(members)), cpu_s(coord.pid), time.monotonic()
        m0 = {p.pid: cpu_s(p.pid) for p in members}
        time.sleep(args.window)
        s1, c3, t3 = read_stats(run, len(members)), cpu_s(coord.pid), time.monotonic()
        m1 = {p.pid: cpu_s(p.pid) for p in members}
        beats = total(s1, "beats") - total(s0, "beats")
        steady_wall = t3 - t2
        rejoins = total(s1, "joins") - (n - stages)  # first joins of the workers
    finally:
        for p in procs[1:]:
            p.send_signal(signal.SIGKILL)
        coord.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        logs.close()
    events = []
    for f in (run / "out").glob("runs/*/events.jsonl"):
        events += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    dead = sum(1 for e in events if e.get("event") == "leave" and e.get("why") == "missed heartbeats")
    replans = sum(1 for e in events if e.get("event") == "replan")
    storm_wall = t1 - t0
    # a worker's period: its own (min lease 2 s, the run default), or the coordinator's floor
    period = max(heartbeat_period(args.dead_after, 2.0), beat_floor_s(n, args.dead_after))
    steady_cpu = c3 - c2
    return {"members": n, "storm_s": storm_wall, "storm_cores": (c1 - c0) / storm_wall,
            "ms_per_join": (c1 - c0) / n * 1e3, "steady_cores": steady_cpu / steady_wall,
            "beats_per_s": beats / steady_wall, "nominal_beats_per_s": workers / period + stages / SERVER_BEAT_S,
            "ms_per_beat": steady_cpu / max(beats, 1) * 1e3,
            "ms_per_member_s": steady_cpu * 1e3 / (n * steady_wall),
            "members_cores": sum(m1[p] - m0[p] for p in m1) / steady_wall,
            "dead": dead, "rejoins": rejoins, "replans": replans}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", default="100,300,1000", help="member counts (stage servers included)")
    ap.add_argument("--per-process", type=int, default=250, help="bench workers per process")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of the steady-state window")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--model", default="gpt-350m")
    ap.add_argument("--dead-after", type=float, default=3.0, help="the run's --dead-after (default: the run default)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    ap.add_argument("--profile", action="store_true",
                    help="run the coordinator under cProfile (N/coordinator.prof.storm, .steady; slows it)")
    # a member process (started by the bench itself)
    ap.add_argument("--member-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--coord", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--devices", default="", help=argparse.SUPPRESS)
    ap.add_argument("--servers", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.member_process:
        asyncio.run(member_process(args))
        return 0
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_coord_"))
    load = os.getloadavg()
    print(f"coordinator with N members: {args.stages} stage servers + N-{args.stages} workers, "
          f"{args.per_process} per member process, --dead-after {args.dead_after:g}; {os.cpu_count()} cores, "
          f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| members | storm s | storm cores | CPU-ms/join | steady cores | beats/s (nominal) | CPU-ms/beat | "
          "CPU-ms/member-s | members' cores | dead | re-joins | replans |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.members.split(",") if x):
        r = run_one(n, args, root)
        print(f"| {n} | {r['storm_s']:.1f} | {r['storm_cores']:.2f} | {r['ms_per_join']:.2f} | "
              f"{r['steady_cores']:.3f} | {r['beats_per_s']:.0f} ({r['nominal_beats_per_s']:.0f}) | "
              f"{r['ms_per_beat']:.3f} | {r['ms_per_member_s']:.3f} | {r['members_cores']:.2f} | "
              f"{r['dead']} | {r['rejoins']} | {r['replans']} |", flush=True)
    load = os.getloadavg()
    print(f"\nload after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
