"""Where does a swarm's CPU go? Process CPU seconds per step of every member of ``launch``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_runtime_cpu.py [--stages 1,2] [--steps 8]
        [--profile DIR] [--chunk-mb MB] [--spot-check F]

Runs bench_runtime's RUN (tiny, M=4 B=4 T=64) as ``launch`` S=W for each S given, reads
every member's user+system CPU time from /proc when the first step is committed and again
when the last one is, and prints CPU ms per step and per micro-batch task for each role,
beside the local trainer's CPU time per step (one thread) of the same run. CPU time, unlike
wall time, does not depend much on what else runs on a shared box.

With ``--profile DIR`` every member runs under cProfile (``SHOAL_PROFILE``) and dumps
``DIR/S<S>/COMMAND-PID.prof`` at the last step (read with ``python -m pstats``).
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


def local_cpu(steps: int) -> float:
    """The local trainer's CPU seconds per step (one torch thread): a run of ``steps`` minus a
    run of one step (model build, data and warm-up counted out), over ``steps - 1``."""
    from shoal.train.local import TrainConfig, train_local

    used = []
    for n in (1, 1, steps):  # the first run pays the imports
        with tempfile.TemporaryDirectory(prefix="shoal-cpu-") as tmp:
            t0 = time.process_time()
            train_local(TrainConfig(**RUN, steps=n, out=str(Path(tmp) / "r"), eval_every=0, eval_batches=1),
                        quiet=True)
            used.append(time.process_time() - t0)
    return (used[2] - used[1]) / (steps - 1)


def swarm_cpu(stages: int, steps: int, profile: str | None, chunk_mb: float | None = None,
              spot_check: float | None = None, session: bool = True) -> dict[str, float]:
    """CPU seconds per step of each role (coordinator, servers, workers), steps 1..last."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    with tempfile.TemporaryDirectory(prefix="shoal-cpu-") as tmp:
        env_prof = None
        if profile:
            env_prof = str(Path(profile) / f"S{stages}")
            os.environ["SHOAL_PROFILE"] = env_prof
        try:
            cfg = LaunchConfig(out=str(Path(tmp) / "run"), stages=stages, workers=stages, steps=steps,
                               timeout_s=600, chunk_mb=chunk_mb, session=session,
                               **({} if spot_check is None else {"spot_check": spot_check}), **RUN)
            marks: dict[int, dict[str, float]] = {}
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
                    if rec["step"] == steps - 1 and profile:
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
    return {k: (b[k] - a[k]) / (steps - 1) for k in a}


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
    args = ap.parse_args()
    m = RUN["micro_batches"]
    loc = local_cpu(args.steps)
    print(f"CPU time per step (tiny, M={m} B={RUN['micro_batch_size']} T={RUN['seq_len']}, "
          f"{args.steps} steps, steps after the first)\n")
    print("(each role: main thread / other threads, ms per step, summed over its members)\n")
    print("| run | coordinator | servers | workers | total | beyond local, per task | vs local |")
    print("|---|---|---|---|---|---|---|")
    print(f"| train --local T=1 | | | | {loc * 1e3:.0f} ms | | 1.00x |")
    for s in (int(x) for x in args.stages.split(",")):
        for session in (True, False) if args.calls else (True,):
            c = swarm_cpu(s, args.steps, args.profile, args.chunk_mb, args.spot_check, session)
            tot = sum(c.values())

            def role(r, c=c):
                return " / ".join(f"{c.get(f'{r}/{k}', 0) * 1e3:.0f}" for k in ("main", "pool"))

            tag = "" if session else ", calls"
            print(f"| launch S={s} W={s}{tag} | {role('coordinator')} | {role('servers')} | {role('workers')} | "
                  f"{tot * 1e3:.0f} ms | {(tot - loc) / m * 1e3:.1f} ms | {tot / loc:.2f}x |", flush=True)
            # Tasks per step: M on the last stage, 2M (forward and backward) on each other one.
            tasks = m * (2 * s - 1)
            srv = c.get("servers/main", 0) + c.get("servers/pool", 0)
            wrk = c.get("workers/main", 0) + c.get("workers/pool", 0)
            print(f"|   per task ({tasks} a step) | | {srv / tasks * 1e3:.2f} ms | "
                  f"{max(0.0, wrk - loc) / tasks * 1e3:.2f} ms beyond compute | | | |", flush=True)


if __name__ == "__main__":
    main()
