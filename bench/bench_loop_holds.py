"""How long each member's event loop is held, and who is declared dead for it, in a gpt-125m
local-mode ``shoal launch`` on this box.

    python bench/bench_loop_holds.py [--python A/.venv/bin/python B/.venv/bin/python] [--runs 2]
        [--keep DIR] [--busy-core] [-- extra launch flags]

Runs ``shoal launch --model gpt-125m --precision bf16 --stages 2 --workers 2 --steps 4
--micro-batches 2 --micro-batch-size 1 --seq-len 64 --sync local --sync-every 2 --spot-check 0``
(the run that lost workers to missed heartbeats on the 2-core box) with ``SHOAL_LOOP_WATCH=0.1``:
each member logs every hold of its event loop over 0.1 s, whether by work on the loop, by
another thread holding the interpreter lock or by a starved process
(shoal/runtime/loopwatch.py), with the hold's whole length. With several ``--python`` (each
tree's own virtualenv, so each runs its own code; an older tree needs loopwatch.py and its
hook in ``run_member``) the runs alternate between them. ``--busy-core`` spins a Python busy
loop pinned to CPU 0 for every run (issue 23's liveness condition). Prints one row per run: the longest
hold of each role's loop, the holds over 0.5 s, the members declared dead, the run's wall time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = ["--model", "gpt-125m", "--precision", "bf16", "--stages", "2", "--workers", "2", "--steps", "4",
          "--micro-batches", "2", "--micro-batch-size", "1", "--seq-len", "64", "--sync", "local",
          "--sync-every", "2", "--spot-check", "0"]
HELD = re.compile(r"event loop held for (\d+\.\d+) s in all")


def holds(log: Path) -> list[float]:
    """Every loop hold the loop watch reported in ``log`` (seconds)."""
    return [float(m.group(1)) for m in HELD.finditer(log.read_text(errors="replace"))] if log.exists() else []


def one(python: str, out: Path, extra: list[str]) -> dict:
    env = dict(os.environ, SHOAL_LOOP_WATCH="0.1", OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1")
    t0 = time.monotonic()
    rc = subprocess.run([python, "-m", "shoal.cli", "launch", *LAUNCH, *extra, "--out", str(out)], env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    wall = time.monotonic() - t0
    logs = out / "logs"
    roles = {"coordinator": holds(logs / "coordinator.log"),
             "servers": [h for p in sorted(logs.glob("server*.log")) for h in holds(p)],
             "workers": [h for p in sorted(logs.glob("worker*.log")) for h in holds(p)]}
    coord = (logs / "coordinator.log").read_text(errors="replace") if (logs / "coordinator.log").exists() else ""
    return {"rc": rc, "wall": wall, "dead": coord.count("declared dead"), "roles": roles}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", nargs="+", default=[sys.executable], help="each tree's interpreter (its venv)")
    ap.add_argument("--runs", type=int, default=1, help="runs per interpreter, alternating")
    ap.add_argument("--keep", default=None, help="folder for the runs (default: a temp folder, removed)")
    ap.add_argument("--busy-core", action="store_true", help="spin a busy loop on CPU 0 beside every run")
    ap.add_argument("extra", nargs="*", help="more `shoal launch` flags (after --)")
    args = ap.parse_args()
    busy = None
    if args.busy_core:
        busy = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_loop_holds_"))
    print("| run | tree | longest hold: coordinator / servers / workers | holds > 0.5 s | declared dead | wall |")
    print("|---|---|---|---|---|---|")
    try:
        for k in range(args.runs):
            for i, py in enumerate(args.python):
                out = root / f"run{k}-{i}"
                r = one(py, out, args.extra)
                longest = " / ".join(f"{max(v, default=0.0):.2f} s" for v in r["roles"].values())
                over = sum(h > 0.5 for v in r["roles"].values() for h in v)
                tree = str(Path(py).absolute().parents[2]) if ".venv" in py else py
                status = "" if r["rc"] == 0 else f" (exit {r['rc']})"
                print(f"| {k + 1} | {tree} | {longest} | {over} | {r['dead']} | {r['wall']:.0f} s{status} |",
                      flush=True)
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
