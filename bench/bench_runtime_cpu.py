"""Where does a swarm's CPU go? Process CPU seconds per step of every member of ``launch``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_runtime_cpu.py [--stages 1,2] [--steps 8]
        [--micro-batches 4,16] [--calls] [--threads] [--profile DIR] [--chunk-mb MB] [--spot-check F]

Runs bench_runtime's RUN (tiny, B=4 T=64, M=4 unless given) as ``launch`` S=W for each S
given, reads every member's user+system CPU time from /proc when the first step is committed
and again when the last one is, and prints CPU ms per step and per micro-batch task for each
role, beside the local trainer's CPU time per step (one thread) of the same run. CPU time,
unlike wall time, does not depend much on what else runs on a shared box.

"Per task" divides a step's whole CPU by its tasks, so at a small M it is mostly per-step
work (the ordered sum, AdamW, serialising the weights, pulls and pushes). With two values of
``--micro-batches`` the bench also prints what each further task costs (the difference in
CPU over the difference in tasks; the workers' beyond the local trainer's own difference)
and the per-step rest. ``--spot-check 0`` leaves the servers' recomputation of drawn pushes
(compute, not framework) out of the measured steps: with the default rate a new worker's
first pushes are all recomputed, which in an 8-step run is most of them.

With ``--profile DIR`` every member runs under cProfile (``SHOAL_PROFILE``, each thread's
CPU time, all threads merged) and dumps ``DIR/S<S>/COMMAND-PID-1.prof`` at the first mark
and ``...-2.prof`` at the last (read with ``python -m pstats``; ``bench/prof_diff.py`` prints
what each function took between them); profiling roughly doubles the main threads' CPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import RUN  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[str, float]:
    """(command name, user + system CPU seconds) from a /proc stat file; ("", 0) once gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "", 0.0
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / TICK


def cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``: its main thread (the asyncio loop: RPC handling) and
    its other threads ("pool": compute, serialisation and checks in executor threads, and
    gRPC's own threads)."""
    out = {"main": 0.0, "pool": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        out["main" if tid == str(pid) else "pool"] += _stat(f"/proc/{pid}/task/{tid}/stat")[1]
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process ``pid`` by thread name (same names summed; the
    main thread is "main")."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        name, used = _stat(f"/proc/{pid}/task/{tid}/stat")
        key = "main" if tid == str(pid) else name
        out[key] = out.get(key, 0.0) + used
    return out


def local_cpu(steps: int, run: dict) -> float:
    """The local trainer's CPU seconds per step (one torch thread): a run of ``steps`` minus a
    run of one step (model build, data and warm-up counted out), over ``steps - 1``."""
    from shoal.train.local import TrainConfig, train_local

    used = []
    for n in (1, 1, steps):  # the first run pays the imports
        with tempfile.TemporaryDirectory(prefix="shoal-cpu-") as tmp:
            t0 = time.process_time()
            train_local(TrainConfig(**run, steps=n, out=str(Path(tmp) / "r"), eval_every=0, eval_batches=1),
                        quiet=True)
            used.append(time.process_time() - t0)
    return (used[2] - used[1]) / (steps - 1)


def swarm_cpu(stages: int, steps: int, profile: str | None, chunk_mb: float | None = None,
              spot_check: float | None = None, session: bool = True,
              run: dict = RUN) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per step of each role (coordinator, servers, workers; main thread and
    others), steps 1..last, and the same by role and thread name."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    with tempfile.TemporaryDirectory(prefix="shoal-cpu-") as tmp:
        env_prof = None
        if profile:
            env_prof = str(Path(profile) / f"S{stages}")
            os.environ["SHOAL_PROFILE"] = env_prof
        try:
            cfg = LaunchConfig(out=str(Path(tmp) / "run"), stages=stages, workers=stages, steps=steps,
                               timeout_s=600, chunk_mb=chunk_mb, session=session,
                               **({} if spot_check is None else {"spot_check": spot_check}), **run)
            marks: dict[int, dict[str, float]] = {}
            threads: dict[int, dict[str, float]] = {}
            swarm_ref: list = []

            def members():
                s = swarm_ref[0]
                out = {"coordinator": [s.coord.pid]} if s.coord else {}
                out["servers"] = [p.pid for p in s.servers]
                out["workers"] = [p.pid for p in s.workers if p]
                return out

            def on_event(rec):
                if rec.get("event") != "step" or not swarm_ref:
                    return
                if rec["step"] in (0, steps - 1):
                    ms = members()
                    marks[rec["step"]] = {f"{k}/{kind}": sum(cpu_s(p)[kind] for p in v)
                                          for k, v in ms.items() for kind in ("main", "pool")}
                    threads[rec["step"]] = {}
                    for k, v in ms.items():
                        for p in v:
                            for name, used in thread_cpu_s(p).items():
                                key = f"{k}/{name}"
                                threads[rec["step"]][key] = threads[rec["step"]].get(key, 0.0) + used
                    if profile:  # a dump at each mark: their difference is the measured steps
                        for pids in ms.values():
                            for p in pids:
                                os.kill(p, signal.SIGUSR1)
                        time.sleep(1.0)

            with Swarm(cfg, on_event) as swarm:
                swarm_ref.append(swarm)
                swarm.start()
                swarm.wait()
        finally:
            if env_prof:
                os.environ.pop("SHOAL_PROFILE", None)
    a, b = marks[0], marks[steps - 1]
    ta, tb = threads[0], threads[steps - 1]
    per_thread = {k: (tb[k] - ta.get(k, 0.0)) / (steps - 1) for k in tb}
    return {k: (b[k] - a[k]) / (steps - 1) for k in a}, per_thread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--chunk-mb", type=float, default=None, help="the swarm's --chunk-mb (default: the run default)")
    ap.add_argument("--spot-check", type=float, default=None,
                    help="the swarm's --spot-check (default: the run default; each drawn push is recomputed on its "
                         "server, a random number of times per run)")
    ap.add_argument("--calls", action="store_true",
                    help="also run each S with a call per lease, result and renewal (--no-session)")
    ap.add_argument("--threads", action="store_true",
                    help="also print each role's CPU by thread name (main thread, executor threads, gRPC's)")
    ap.add_argument("--micro-batches", default=str(RUN["micro_batches"]),
                    help="M of the run, or two values (4,16): then also the CPU each further task adds "
                         "(the difference over the difference in tasks), apart from the per-step part")
    args = ap.parse_args()
    ms = [int(x) for x in args.micro_batches.split(",")]
    print(f"CPU time per step (tiny, M={args.micro_batches} B={RUN['micro_batch_size']} T={RUN['seq_len']}, "
          f"{args.steps} steps, steps after the first)\n")
    print("(each role: main thread / other threads, ms per step, summed over its members)\n")
    print("| run | coordinator | servers | workers | total | beyond local, per task | vs local |")
    print("|---|---|---|---|---|---|---|")
    seen: dict[tuple, tuple[int, float, float, float]] = {}
    for m in ms:
        run = {**RUN, "micro_batches": m}
        loc = local_cpu(args.steps, run)
        print(f"| train --local T=1, M={m} | | | | {loc * 1e3:.0f} ms | | 1.00x |")
        for s in (int(x) for x in args.stages.split(",")):
            for session in (True, False) if args.calls else (True,):
                c, per_thread = swarm_cpu(s, args.steps, args.profile, args.chunk_mb, args.spot_check, session, run)
                tot = sum(c.values())

                def role(r, c=c):
                    return " / ".join(f"{c.get(f'{r}/{k}', 0) * 1e3:.0f}" for k in ("main", "pool"))

                tag = "" if session else ", calls"
                print(f"| launch S={s} W={s} M={m}{tag} | {role('coordinator')} | {role('servers')} | "
                      f"{role('workers')} | {tot * 1e3:.0f} ms | {(tot - loc) / m * 1e3:.1f} ms | {tot / loc:.2f}x |",
                      flush=True)
                # Tasks per step: M on the last stage, 2M (forward and backward) on each other one.
                tasks = m * (2 * s - 1)
                srv = c.get("servers/main", 0) + c.get("servers/pool", 0)
                wrk = c.get("workers/main", 0) + c.get("workers/pool", 0)
                print(f"|   per task ({tasks} a step) | | {srv / tasks * 1e3:.2f} ms | "
                      f"{max(0.0, wrk - loc) / tasks * 1e3:.2f} ms beyond compute | | | |", flush=True)
                if args.threads:
                    busy = sorted(((v, k) for k, v in per_thread.items() if v >= 0.0005), reverse=True)
                    print("|   by thread (ms a step) | " + ", ".join(f"{k} {v * 1e3:.1f}" for v, k in busy)
                          + " | | | | | |", flush=True)
                key = (s, session)
                if key in seen:
                    t0, srv0, wrk0, loc0 = seen[key]
                    dt = tasks - t0
                    if dt > 0:
                        # Each further task's CPU: the server's all framework; the workers' beyond the
                        # local trainer's own increase (the compute of the extra micro-batches).
                        d_srv = (srv - srv0) / dt
                        d_wrk = ((wrk - wrk0) - (loc - loc0)) / dt
                        print(f"|   each further task, S={s}{tag} | | {d_srv * 1e3:.2f} ms | "
                              f"{d_wrk * 1e3:.2f} ms beyond compute | | | |", flush=True)
                        print(f"|   per step apart from tasks, S={s}{tag} | | {(srv - d_srv * tasks) * 1e3:.0f} ms | "
                              f"{(wrk - loc - d_wrk * tasks) * 1e3:.0f} ms beyond compute | | | |", flush=True)
                seen[key] = (tasks, srv, wrk, loc)


if __name__ == "__main__":
    main()
