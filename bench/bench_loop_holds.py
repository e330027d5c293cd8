"""How long each member's event loop is held, and who is declared dead for it, in a gpt-125m
local-mode ``shoal launch`` on this box.

    python bench/bench_loop_holds.py [--python A/.venv/bin/python B/.venv/bin/python] [--runs 2]
        [--keep DIR] [-- extra launch flags]

Runs ``shoal launch --model gpt-125m --precision bf16 --stages 2 --workers 2 --steps 4
--micro-batches 2 --micro-batch-size 1 --seq-len 64 --sync local --sync-every 2 --spot-check 0``
(the run that lost workers to missed heartbeats on the 2-core box) with ``PYTHONASYNCIODEBUG=1``:
asyncio then logs every callback or task step that held a loop for over 0.1 s, and every
shoal member logs to its own file. With several ``--python`` (each tree's own virtualenv, so
each runs its own code) the runs alternate between them. Prints one row per run: the longest
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
HELD = re.compile(r"took (\d+\.\d+) seconds")


def holds(log: Path) -> list[float]:
    """Every loop hold asyncio's debug mode reported in ``log`` (seconds)."""
    return [float(m.group(1)) for m in HELD.finditer(log.read_text(errors="replace"))] if log.exists() else []


def one(python: str, out: Path, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONASYNCIODEBUG="1", OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1")
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
    ap.add_argument("extra", nargs="*", help="more `shoal launch` flags (after --)")
    args = ap.parse_args()
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
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
