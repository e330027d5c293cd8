"""What each function of a role took between two profile dumps of ``bench_runtime_cpu.py --profile``.

    .venv/bin/python bench/prof_diff.py DIR/S2 server [--per N] [--sort tot|cum] [--top 40]

Sums, over every member of the role (``server-PID-1.prof`` and ``server-PID-2.prof``), the
second dump minus the first: the measured steps without start-up. ``--per N`` divides by N
(e.g. the tasks of those steps); times are each thread's CPU in ms.
"""

from __future__ import annotations

import argparse
import glob
import pstats
from pathlib import Path


def stats_of(path: str) -> dict:
    return pstats.Stats(path).stats


def diff(folder: str, role: str) -> dict:
    """function -> (calls, total CPU s, cumulative CPU s) between the dumps, all members summed."""
    out: dict = {}
    for first in glob.glob(f"{folder}/{role}-*-1.prof"):
        second = first[:-len("-1.prof")] + "-2.prof"
        if not Path(second).exists():
            continue
        a, b = stats_of(first), stats_of(second)
        for fn, (_, nc, tt, ct, _) in b.items():
            _, nc0, tt0, ct0, _ = a.get(fn, (0, 0, 0.0, 0.0, {}))
            calls, tot, cum = out.get(fn, (0, 0.0, 0.0))
            out[fn] = (calls + nc - nc0, tot + tt - tt0, cum + ct - ct0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("role", help="coordinator, server or worker")
    ap.add_argument("--per", type=float, default=1.0, help="divide by this (e.g. tasks)")
    ap.add_argument("--sort", choices=("tot", "cum"), default="tot")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    d = diff(args.folder, args.role)
    col = 1 if args.sort == "tot" else 2
    rows = sorted(d.items(), key=lambda kv: -kv[1][col])
    total = sum(v[1] for v in d.values())
    print(f"{args.role}: {total / args.per * 1e3:.3f} ms of CPU in profiled threads (per {args.per:g})")
    print("    calls   tot ms   cum ms  function")
    for fn, (calls, tot, cum) in rows[:args.top]:
        where = fn[0].split("site-packages/")[-1].split("lib/python3")[-1]
        print(f"{calls / args.per:9.2f} {tot / args.per * 1e3:8.3f} {cum / args.per * 1e3:8.3f}  {where}:{fn[1]}({fn[2]})")


if __name__ == "__main__":
    main()
