"""Exactness bench: `shoal train --local` as a user runs it against `shoal launch` swarms.

    .venv/bin/python bench/bench_exact.py                        # 30 steps, S in 1,2,3, W in 1,3
    .venv/bin/python bench/bench_exact.py --steps 5 --stages 2 --workers 1

Runs ``shoal train --local --steps N --out DIR`` once with its defaults (no
``SHOAL_TORCH_THREADS``, no ``OMP_NUM_THREADS``: the thread settings a user's shell has),
then ``shoal launch --stages S --workers S*W`` (W workers per stage, TLS, defaults) for each
S and W, every command a subprocess with that same environment, and compares each swarm's
final weights and per-step losses and gradient norms with the local run's. Prints a markdown
table (also written to ``--out``): the largest absolute weight difference (0.0 is bitwise
equal), how many tensors differ, whether every logged loss and norm is equal, and wall times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def user_env() -> dict[str, str]:
    """The environment a user's shell gives the commands: no thread settings of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHOAL_TORCH_THREADS", "OMP_NUM_THREADS",
                                                             "MKL_NUM_THREADS")}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def shoal(args: list[str], timeout: float) -> float:
    """Run ``shoal ARGS`` (``python -m shoal.cli``) to completion; its wall seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "shoal.cli", *args], env=user_env(), capture_output=True,
                       text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"shoal {' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return time.perf_counter() - t0


def compare(local: Path, swarm: Path) -> dict:
    """Weight and metric differences between a local run folder and a swarm run folder."""
    import torch

    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.train.checkpoint import load_checkpoint

    a = load_checkpoint(local / "checkpoint").model_state
    b = load_final_weights(swarm)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:3]
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    differ = sum(1 for k in a if not torch.equal(a[k], b[k]))
    ra = [json.loads(x) for x in (local / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (swarm / "metrics.jsonl").read_text().splitlines()]
    same = len(ra) == len(rb) and all(x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"]
                                      for x, y in zip(ra, rb, strict=True))
    return {"worst": worst, "differ": differ, "tensors": len(a), "metrics_equal": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stages", default="1,2,3", help="comma-separated S values")
    ap.add_argument("--workers", default="1,3", help="comma-separated W values (workers per stage)")
    ap.add_argument("--out", default="bench/results/exact.md")
    ap.add_argument("--keep", default="", help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--local-dir", default="", help="compare with this finished `shoal train --local` run "
                                                    "(same --steps) instead of running one")
    args = ap.parse_args(argv)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="shoal-exact-"))
    base.mkdir(parents=True, exist_ok=True)
    if args.local_dir:
        local, t_local = Path(args.local_dir), float("nan")
    else:
        local = base / "local"
        shutil.rmtree(local, ignore_errors=True)
        t_local = shoal(["train", "--local", "--steps", str(args.steps), "--out", str(local), "--quiet"],
                        timeout=3600)
    print(f"local: {t_local:.1f} s", flush=True)
    rows = []
    for s in (int(x) for x in args.stages.split(",")):
        for w in (int(x) for x in args.workers.split(",")):
            run = base / f"s{s}w{w}"
            shutil.rmtree(run, ignore_errors=True)
            t = shoal(["launch", "--steps", str(args.steps), "--stages", str(s), "--workers", str(s * w),
                       "--out", str(run), "--no-dashboard", "--timeout", "3000"], timeout=3600)
            c = compare(local, run)
            rows.append(f"| {s} | {w} ({s * w}) | {c['worst']:.3g} | {c['differ']} of {c['tensors']} | "
                        f"{'yes' if c['metrics_equal'] else 'no'} | {t:.0f} |")
            print(rows[-1], flush=True)
    load = os.getloadavg()
    head = [
        f"# Exactness: `shoal train --local` (defaults) vs `shoal launch`, {args.steps} steps",
        "",
        f"Command: `.venv/bin/python bench/bench_exact.py --steps {args.steps} --stages {args.stages} "
        f"--workers {args.workers}`",
        f"Date: {datetime.date.today()}; machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"load {load[0]:.1f} at the end; SHOAL_TORCH_THREADS and OMP_NUM_THREADS unset.",
        f"Model tiny and every other flag at its default (M=4, B=8, T=128, bundled corpus, TLS). "
        f"`shoal train --local`: {t_local:.0f} s.",
        "",
        "| S | W per stage (workers) | max weight diff | tensors differing | losses and norms equal | launch s |",
        "|---|---|---|---|---|---|",
    ]
    text = "\n".join(head + rows) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
