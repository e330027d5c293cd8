"""The runtime at device speed: ``shoal launch`` against ``shoal train --local`` on one accelerator.

    PYTHONPATH=. python bench/bench_gpu_runtime.py                      # on a CUDA machine (defaults)
    PYTHONPATH=. python bench/bench_gpu_runtime.py --device cpu --smoke # end to end on a CPU: tiny shapes

Trains ``--model`` for ``--steps`` steps with ``shoal train --local`` (one process, the whole
model on ``--device``) and with ``shoal launch`` (S stage servers, W workers on the same
device, loopback, TLS), once per ``--sync`` policy, on the same data, batch and precision, and
prints one table: tokens/s over the steps after the first, the ratio to the local trainer,
where the launch's steps went (the runtime's own per-stage split: compute, transfer, sync,
waiting) and the CPU seconds each role spent per step and per micro-batch task (from /proc,
between the commits of the first and the last step). The worker compute share is
a worker's compute over its stage's step: what the framework leaves of the device.
Every process, the local trainer's too, runs one CPU torch thread (as in ``bench_runtime.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import _steady  # noqa: E402  (mean step, median step, tokens/s after the first step)
from procstat import cpu_s  # noqa: E402


def local_run(run: dict, out: Path) -> tuple[float, float]:
    """The local trainer on the run's device: (mean step time, tokens/s)."""
    from shoal.train.config import TrainConfig
    from shoal.train.local import train_local

    res = train_local(TrainConfig(**run, out=str(out), eval_every=0, eval_batches=1), quiet=True)
    mean, _, tps = _steady(res.records)
    return mean, tps


def launch_run(run: dict, out: Path, stages: int, workers: int, sync: str, sync_every: int,
               timeout_s: float, spot_check: float | None = None) -> dict:
    """One ``shoal launch``: steady step time, tokens/s, mean split per stage and CPU per role."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.train.metrics import read_jsonl

    steps = run["steps"]
    cfg = LaunchConfig(out=str(out), stages=stages, workers=workers, timeout_s=timeout_s, sync=sync,
                       sync_every=sync_every, **({} if spot_check is None else {"spot_check": spot_check}), **run)
    marks: dict[int, dict[str, float]] = {}
    ref: list = []

    def on_event(rec: dict) -> None:
        if rec.get("event") == "step" and ref and rec["step"] in (0, steps - 1):
            s = ref[0]
            roles = {"coordinator": [s.coord.pid] if s.coord else [], "servers": [p.pid for p in s.servers],
                     "workers": [p.pid for p in s.workers if p]}
            marks[rec["step"]] = {k: sum(cpu_s(p) for p in v) for k, v in roles.items()}

    t0 = time.monotonic()
    with Swarm(cfg, on_event) as swarm:
        ref.append(swarm)
        swarm.start()
        swarm.wait()
    wall = time.monotonic() - t0
    recs = read_jsonl(out / "metrics.jsonl")
    mean, _, tps = _steady(recs)
    rest = [r for r in recs if r["step"] >= 1] or recs  # the steps _steady measured
    split: dict[str, float] = {}
    for r in rest:
        for st in r.get("split", {}).values():
            for k in ("total_s", "compute_s", "transfer_s", "sync_s", "waiting_s"):
                split[k] = split.get(k, 0.0) + st.get(k, 0.0) / (len(rest) * len(r["split"]))
    a, b = marks.get(0, {}), marks.get(steps - 1, {})
    cpu = {k: (b[k] - a[k]) / (steps - 1) for k in b if k in a} if steps > 1 else {}
    dead = sum(1 for e in read_jsonl(out / "events.jsonl")
               if e.get("event") == "leave" and e.get("why") == "missed heartbeats")
    return {"mean": mean, "tps": tps, "split": split, "cpu": cpu, "wall": wall, "dead": dead}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-125m")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (every process)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--sync", default="exact,local", help="sync policies of the launch runs, comma-separated")
    ap.add_argument("--sync-every", type=int, default=4, help="H of the local runs")
    ap.add_argument("--spot-check", type=float, default=None,
                    help="the launches' --spot-check (default: the run default; a drawn push is recomputed on its "
                         "stage server's CPU, and a new worker's first push always is)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each launch may take")
    ap.add_argument("--smoke", action="store_true", help="tiny model, B=2 T=32 M=4, 4 steps (a CPU check)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.micro_batch_size, args.seq_len, args.micro_batches, args.steps = "tiny", 2, 32, 4, 4
    import torch

    from shoal.train.precision import resolve_device

    dev = resolve_device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    run = dict(model=args.model, precision=args.precision, device=args.device, steps=args.steps,
               micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
               seed=0, warmup=2)
    tokens = args.micro_batches * args.micro_batch_size * args.seq_len
    print(f"# bench_gpu_runtime on {name}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print(f"{args.model} {args.precision}, M={args.micro_batches} B={args.micro_batch_size} T={args.seq_len} "
          f"({tokens} tokens per step), {args.steps} steps (the first left out); launch: S={args.stages} "
          f"W={args.workers} on one device, loopback, TLS"
          f"{'' if args.spot_check is None else f', --spot-check {args.spot_check:g}'}\n", flush=True)
    root = Path(args.out or tempfile.mkdtemp(prefix="shoal-gpurt-"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    lmean, ltps = local_run(run, root / "local")
    print(f"local trainer: {lmean:.3f} s per step, {ltps:,.0f} tokens/s ({time.monotonic() - t0:.0f} s wall)\n",
          flush=True)
    rows = []
    for sync in args.sync.split(","):
        r = launch_run(run, root / f"launch-{sync}", args.stages, args.workers, sync, args.sync_every, args.timeout,
                       args.spot_check)
        rows.append((sync, r))
        print(f"launch --sync {sync}: {r['mean']:.3f} s per step, {r['tps']:,.0f} tokens/s, "
              f"{r['wall']:.0f} s wall", flush=True)
    tasks = args.micro_batches * (2 * args.stages - 1)
    print("\n| run | s per step | tokens/s | vs local | compute / transfer / sync / waiting (s, mean stage) "
          "| worker compute share | CPU s per step: coordinator / servers / workers | CPU ms per task (all roles) | declared dead |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| train --local | {lmean:.3f} | {ltps:,.0f} | 1.00x | | | | | |")
    for sync, r in rows:
        sp, c = r["split"], r["cpu"]
        split = " / ".join(f"{sp.get(k, 0):.3f}" for k in ("compute_s", "transfer_s", "sync_s", "waiting_s"))
        share = sp.get("compute_s", 0) / sp["total_s"] if sp.get("total_s") else 0
        roles = " / ".join(f"{c.get(k, 0):.2f}" for k in ("coordinator", "servers", "workers"))
        label = f"launch --sync {sync}" + (f" H={args.sync_every}" if sync == "local" else "")
        print(f"| {label} | {r['mean']:.3f} | {r['tps']:,.0f} | {r['tps'] / ltps:.2f}x | {split} | {share:.0%} | "
              f"{roles} | {sum(c.values()) / tasks * 1e3:.1f} | {r['dead']} |")
    print("\n(split: the runtime's per-stage step split, a stage's step from its opening to its commit, "
          "workers' means; worker compute share: compute over that span; "
          "CPU per task: every role's CPU per step over the step's tasks, M(2S-1))")


if __name__ == "__main__":
    main()
