"""Time per step and peak memory of a gpt-125m ``shoal launch`` (streamed transfers).

Runs::

    shoal launch --model gpt-125m --stages 2 --workers 2 --steps 2 --micro-batches 2 \\
        --micro-batch-size 1 --seq-len 64 --chunk-mb 1

polls the resident memory and CPU time of every process of the swarm (coordinator,
servers, workers; from /proc, twice a second) and prints a table: time of each step (from
the run's metrics), peak RSS and CPU seconds per process, the peak of their RSS sum and
their CPU sum. Linux only.

    PYTHONPATH=. python bench/bench_gpt125m_launch.py [--steps 2] [--chunk-mb 1] [--keep DIR]
        [--precision bf16] [--dead-after 3 --min-lease 2] [--busy-core]

``--busy-core`` runs a busy loop (one Python process spinning, pinned to CPU 0) beside the
swarm for the whole run; the table then also counts the deaths: members the coordinator
declared dead (``leave`` events for missed heartbeats, with what each was doing), workers a
stage server voided, and workers told to join again.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procstat import cpu_s  # noqa: E402


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


def print_deaths(out: Path) -> None:
    """Members declared dead (coordinator), voided (stage servers), told to join again (workers)."""
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    dead = [e for e in events if e["event"] == "leave" and e.get("why") == "missed heartbeats"]
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
    voided = sum(text.count("voided worker") for name, text in logs.items() if name.startswith("server"))
    rejoined = sum(text.count("the coordinator dropped us") for name, text in logs.items()
                   if name.startswith("worker"))
    print(f"declared dead by the coordinator: {len(dead)}; voided by a server: {voided}; "
          f"workers told to join again: {rejoined}")
    for e in dead:
        print(f"  {e['device']} ({e['role']}): silent {e.get('silent_s')} s, last sign {e.get('last_sign')}, "
              f"was {e.get('doing')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--chunk-mb", type=float, default=1.0)
    p.add_argument("--keep", default=None, help="run folder to keep (default: a temp folder, removed)")
    p.add_argument("--precision", default="", help="--precision of the run (default: the run's default)")
    p.add_argument("--dead-after", type=float, default=120.0, help="--dead-after of the run")
    p.add_argument("--min-lease", type=float, default=120.0, help="--min-lease of the run")
    p.add_argument("--busy-core", action="store_true", help="spin a busy loop on CPU 0 beside the swarm")
    args = p.parse_args()
    out = Path(args.keep or tempfile.mkdtemp(prefix="shoal-125m-")) / "run"
    cmd = [sys.executable, "-m", "shoal.runtime.processes.cli", "launch", "--model", "gpt-125m", "--stages", "2",
           "--workers", "2", "--steps", str(args.steps), "--micro-batches", "2", "--micro-batch-size", "1",
           "--seq-len", "64", "--chunk-mb", str(args.chunk_mb), "--out", str(out), "--timeout", "3000",
           "--dead-after", f"{args.dead_after:g}", "--min-lease", f"{args.min_lease:g}"]
    if args.precision:
        cmd += ["--precision", args.precision]
    env = dict(os.environ, OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1")
    busy = None
    if args.busy_core:
        busy = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    peak: dict[str, int] = {}
    cpu: dict[str, float] = {}  # role -> its CPU seconds when last seen (sampled twice a second)
    peak_sum = 0
    while proc.poll() is None:
        total = 0
        for pid in _tree(proc.pid):
            rss, name = _rss_and_name(pid)
            total += rss
            if name:
                peak[name] = max(peak.get(name, 0), rss)
                cpu[name] = max(cpu.get(name, 0.0), cpu_s(pid))
        peak_sum = max(peak_sum, total)
        time.sleep(0.5)
    wall = time.time() - t0
    if busy is not None:
        busy.kill()
        busy.wait()
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
    print(f"{'process':<16} {'peak RSS MB':>12} {'CPU s':>8}")
    for name in sorted(peak):
        print(f"{name:<16} {peak[name] / 2**20:>12.0f} {cpu.get(name, 0.0):>8.1f}")
    print(f"{'sum':<16} {peak_sum / 2**20:>12.0f} {sum(cpu.values()):>8.1f}  (RSS: peak of the sum; CPU: user + "
          f"system when last seen, sampled every 0.5 s)")
    for kind, c in summary["bytes"].items():
        print(f"  {kind:<17} {c['wire'] / 1e6:>9.1f} MB")
    print_deaths(out)
    if not args.keep:
        import shutil

        shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
