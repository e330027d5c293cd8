"""Time per step and peak memory of a gpt-125m ``shoal launch`` (streamed transfers).

Runs::

    shoal launch --model gpt-125m --stages 2 --workers 2 --steps 2 --micro-batches 2 \\
        --micro-batch-size 1 --seq-len 64 --chunk-mb 1

polls the resident memory of every process of the swarm (coordinator, servers,
workers; from /proc, twice a second) and prints a table: time of each step (from the
run's metrics), peak RSS per process and the peak of their sum. Linux only.

    PYTHONPATH=. python bench/bench_gpt125m_launch.py [--steps 2] [--chunk-mb 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # the task ended meanwhile
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _rss_and_name(pid: int) -> tuple[int, str]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return 0, ""
    rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    args = [a.decode() for a in cmd if a]
    name = ""
    if "shoal.runtime.processes.cli" in args:
        i = args.index("shoal.runtime.processes.cli")
        role = args[i + 1] if i + 1 < len(args) else "?"
        name = role
        if "--name" in args:
            name = f"{role} {args[args.index('--name') + 1]}"
    return rss, name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chunk-mb", type=float, default=1.0)
    p.add_argument("--keep", default=None, help="run folder to keep (default: a temp folder, removed)")
    args = p.parse_args()
    out = Path(args.keep or tempfile.mkdtemp(prefix="shoal-125m-")) / "run"
    cmd = [sys.executable, "-m", "shoal.runtime.processes.cli", "launch", "--model", "gpt-125m", "--stages", "2",
           "--workers", "2", "--steps", str(args.steps), "--micro-batches", "2", "--micro-batch-size", "1",
           "--seq-len", "64", "--chunk-mb", str(args.chunk_mb), "--out", str(out), "--timeout", "3000",
           "--dead-after", "120", "--min-lease", "120"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    peak: dict[str, int] = {}
    peak_sum = 0
    while proc.poll() is None:
        total = 0
        for pid in _tree(proc.pid):
            rss, name = _rss_and_name(pid)
            total += rss
            if name:
                peak[name] = max(peak.get(name, 0), rss)
        peak_sum = max(peak_sum, total)
        time.sleep(0.5)
    wall = time.time() - t0
    log = proc.stdout.read()
    if proc.returncode != 0:
        print(log[-3000:])
        sys.exit(f"launch failed with exit code {proc.returncode}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    print(f"command: {' '.join(cmd[2:])}")
    print(f"{'step':>4} {'loss':>9} {'step time s':>12}")
    for r in recs:
        print(f"{r['step']:>4} {r['loss']:>9.5f} {r['step_time_s']:>12.1f}")
    print(f"launch wall time {wall:.1f} s (start-up, {len(recs)} steps, final weights)")
    print(f"{'process':<16} {'peak RSS MB':>12}")
    for name in sorted(peak):
        print(f"{name:<16} {peak[name] / 2**20:>12.0f}")
    print(f"{'sum (peak)':<16} {peak_sum / 2**20:>12.0f}")
    for kind, c in summary["bytes"].items():
        print(f"  {kind:<17} {c['wire'] / 1e6:>9.1f} MB")
    if not args.keep:
        import shutil

        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
