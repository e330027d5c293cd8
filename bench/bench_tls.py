"""TLS overhead: the same short ``shoal launch`` run with TLS (the default) and ``--insecure``.

    .venv/bin/python bench/bench_tls.py [--pairs 2] [--steps 12] [--out /tmp/bench_tls]

Runs are alternated (TLS, plain, TLS, plain, ...) so a change in the machine's load hits
both modes alike. Prints one table: tokens/s of each run (tokens over the summed step
times, as the run summary reports it), the final loss (equal in both modes: encryption
does not change the arithmetic) and the ratio of the mean tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUN = ["--model", "tiny", "--stages", "2", "--workers", "2", "--micro-batches", "4", "--micro-batch-size", "2",
       "--seq-len", "64", "--data", "synthetic", "--no-dashboard", "--timeout", "600"]


def one(out: Path, steps: int, insecure: bool) -> dict:
    """Summary of one launch run (raises if it failed)."""
    cmd = [sys.executable, "-m", "shoal.runtime.processes.cli", "launch", "--out", str(out), "--steps", str(steps), *RUN,
           *(["--insecure"] if insecure else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"launch failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2, help="TLS/plain run pairs")
    ap.add_argument("--steps", type=int, default=12, help="steps per run")
    ap.add_argument("--out", default="/tmp/bench_tls", help="folder for the run folders")
    args = ap.parse_args(argv)
    base = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    rows: list[tuple[str, dict]] = []
    for i in range(args.pairs):
        for insecure in (False, True):
            mode = "plain (--insecure)" if insecure else "TLS"
            rows.append((mode, one(base / f"{i}-{'plain' if insecure else 'tls'}", args.steps, insecure)))
    print("| run | mode | tokens/s | wall s | final loss |")
    print("|---|---|---|---|---|")
    for k, (mode, s) in enumerate(rows):
        print(f"| {k + 1} | {mode} | {s['tokens_per_s']:.1f} | {s['wall_time_s']:.1f} | {s['final_loss']:.6f} |")
    tls = statistics.fmean(s["tokens_per_s"] for m, s in rows if m == "TLS")
    plain = statistics.fmean(s["tokens_per_s"] for m, s in rows if m != "TLS")
    print(f"\nmean tokens/s: TLS {tls:.1f}, plain {plain:.1f}; TLS / plain = {tls / plain:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
