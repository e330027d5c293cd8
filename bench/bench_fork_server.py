"""CPU cost of one local swarm run with members forked from the warm fork server vs spawned.

Each row runs the same ``launch`` (tiny model, default corpus, ``--stages/--workers/--steps``)
in this process and counts the CPU seconds (user + system) of every process it started:
the coordinator, servers and workers, and in fork mode the fork server itself, which is
started fresh for each run (its imports are part of the run's cost, as for one
``shoal launch``) and stopped afterwards so its time and its children's are reaped and
counted. Every run's final weights are compared bitwise with ``train_local``'s.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_fork_server.py [--stages 3] [--workers 4] [--steps 4] [--repeat 1]

Modes alternate (spawn, fork, spawn, fork, ...) so both see the same load.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from shoal.runtime.processes.forkserver import shutdown_fork_server
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.train.local import TrainConfig, train_local

    torch.set_num_threads(1)
    run = dict(model="tiny", steps=args.steps, micro_batches=4, micro_batch_size=2, seq_len=32, seed=0,
               lr=3e-3, warmup=2)
    tmp = Path(tempfile.mkdtemp(prefix="bench-fork-"))
    ref = train_local(TrainConfig(**run, out=str(tmp / "local"), eval_every=0, eval_batches=1), quiet=True)
    ref_w = {k: v.detach() for k, v in ref.model.state_dict().items()}
    rows: dict[str, list[tuple[float, float, bool]]] = {"spawn": [], "fork": []}
    load0 = os.getloadavg()[0]
    for i in range(args.repeat):
        for mode in ("spawn", "fork"):
            out = tmp / f"{mode}{i}"
            c0, t0 = _children_cpu(), time.perf_counter()
            launch(LaunchConfig(**run, out=str(out), stages=args.stages, workers=args.workers,
                                timeout_s=1800, fork_server=mode == "fork"))
            shutdown_fork_server()
            wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
            w = load_final_weights(out)
            exact = set(w) == set(ref_w) and all(torch.equal(w[k], ref_w[k]) for k in ref_w)
            rows[mode].append((wall, cpu, exact))
    print(f"launch: tiny, {args.stages} stages, {args.workers} workers, {args.steps} steps, default corpus; "
          f"{os.cpu_count()} cores, load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'members':8} {'runs':>4} {'wall s (mean)':>14} {'CPU s (mean)':>13} {'bitwise = train_local':>22}")
    for mode, rs in rows.items():
        print(f"{mode:8} {len(rs):>4} {statistics.mean(r[0] for r in rs):>14.1f} "
              f"{statistics.mean(r[1] for r in rs):>13.1f} {str(all(r[2] for r in rs)):>22}")
    spawn_cpu = statistics.mean(r[1] for r in rows["spawn"])
    fork_cpu = statistics.mean(r[1] for r in rows["fork"])
    print(f"CPU per run: fork / spawn = {fork_cpu / spawn_cpu:.2f} ({spawn_cpu - fork_cpu:.1f} CPU-s saved per launch)")


if __name__ == "__main__":
    main()
