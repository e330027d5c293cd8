"""Fault bench: poisoned workers against the push screen, adaptive recomputation and the
ban's undo (docs/poisoning.md, "Poisoned and broken gradients").

Per attack (x-20, x-2, sign flip, Gaussian noise of the honest norm, a consistent bias of
0.5 x the per-element RMS along a fixed sign vector) and scenario (one poisoner from step
0, one from step 2, two of five colluding from step 2), an exact run (fp32, 2 stages,
ordered pushes, tiny model): the step of each ban, the version each undo went back to, and
the final weights against an honest run of the same workload (exact: torch.equal) with
the loss gap. Local mode (``--sync local``): the same attacks and scenarios, final loss
against the mean of ``--local-honest`` honest local runs of the same worker count (whose own
gaps to that mean are the run-to-run spread). ``--bf16-attacks``: the attacks alone from step 2 in bf16 (no
exact recomputation: what a ban undoes there) against an honest bf16 run. Honest runs with
uneven workers (one 3x slower), fp32 and bf16: false bans.

    python bench/bench_poison.py --steps 10 --honest 6
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from shoal.runtime.processes.launch import LaunchConfig, launch
from shoal.runtime.roles.artifacts import load_final_weights
from shoal.train.metrics import read_jsonl

ATTACKS = {"x-20": "scale=-20", "x-2": "scale=-2", "sign flip": "scale=-1", "noise": "kind=noise",
           "bias": "kind=bias:scale=0.5"}


def SCENARIOS(spec: str) -> list[tuple[str, int, list[str]]]:  # noqa: N802 (a table)
    """The scenarios of an attack: (name, workers, faults)."""
    return [("alone from step 0", 3, [f"poison:w1:{spec}"]),
            ("alone from step 2", 3, [f"poison:w1:{spec}:from=2"]),
            ("2 of 5 colluding from step 2", 5, [f"poison:w1:{spec}:from=2", f"poison:w3:{spec}:from=2"])]


def run(out: Path, args, *, workers: int, faults: list[str], **kw) -> dict:
    """One swarm run; its bans, undos, final loss and weights."""
    cfg = LaunchConfig(out=str(out), model="tiny", steps=args.steps, micro_batches=4, micro_batch_size=2, seq_len=32,
                       seed=3, lr=3e-3, warmup=2, data="synthetic", stages=2, workers=workers, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=600, ckpt_every=1, faults=faults, **kw)
    t0 = time.time()
    summary = launch(cfg)
    events = read_jsonl(out / "events.jsonl")
    logs = "".join(p.read_text() for p in sorted((out / "logs").glob("server*.log")))
    zs = [z for m in re.finditer(r"drift after step \d+: (\{.*\})$", logs, re.M)
          for z, _ in json.loads(m.group(1)).values()]
    return {"bans": [(e["device"], e["step"]) for e in events if e["event"] == "ban"],
            "by": [how(e["why"]) for e in events if e["event"] == "ban"],
            "undos": [e["version"] for e in events if e["event"] == "rollback" and e.get("why") == "undo"],
            "loss": summary["final_loss"], "weights": load_final_weights(out), "wall_s": time.time() - t0,
            # redundant checks (another worker computed a push again): agreed, disagreed
            "dup": [len(re.findall(r"check \d+: \S+ and \S+ agree", logs)),
                    len(re.findall(r"check \d+: \S+ and \S+ disagree", logs))],
            "recomputed": len(re.findall(r"recomputed the push of", logs)),
            "end_checks": len(re.findall(r"end check: recomputed", logs)),
            # local mode: pseudo-gradients held out of a merge (cosine to the server's gradient in (-0.05, 0))
            "held": len(re.findall(r"holds \S+ pseudo-gradient out of the merge", logs)),
            "suspects": sorted(set(re.findall(r"drift of \S+-(w\d+) after step \d+: z \S+ over \d+ steps: a suspect",
                                              logs))),
            "max_drift_z": round(max(zs), 2) if zs else None,
            "warnings": sum(" WARNING " in line for p in (out / "logs").glob("*.log")
                            for line in p.read_text().splitlines())}


def how(why: str) -> str:
    """Which check banned a worker, from the ban's reason."""
    if "end check" in why:
        return "end check"
    if why.startswith("redundant computation"):
        return "redundant"
    if "recomputed one" in why:
        return "recompute"
    if "pseudo-gradient" in why:
        return "local screen"
    return "screen strikes"


def gap(a: dict, b: dict) -> tuple[bool, float]:
    equal = all(torch.equal(a[k], b[k]) for k in b)
    return equal, max(float((a[k] - b[k]).abs().max()) for k in b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--honest", type=int, default=6, help="honest runs with uneven workers (half of them bf16)")
    ap.add_argument("--sync-every", type=int, default=2, help="local mode: steps per round")
    ap.add_argument("--skip-exact", action="store_true", help="no exact-mode attack runs")
    ap.add_argument("--local-honest", type=int, default=3,
                    help="local mode: honest runs per worker count (3 and 5), the reference and its spread")
    ap.add_argument("--skip-local", action="store_true", help="no local-mode runs")
    ap.add_argument("--honest-workers", type=int, default=3, help="workers of each honest run (one of them 3x slower)")
    ap.add_argument("--honest-absent", action="store_true",
                    help="in the honest runs w1 takes no task of the last step (stop fault): the end check's work")
    ap.add_argument("--bf16-attacks", action="store_true", help="the attacks alone from step 2 in bf16 too")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="shoal-poison-"))
    rows = []
    ref = None if args.skip_exact else run(root / "honest", args, workers=3, faults=[])
    if ref is not None:
        print(f"honest exact run: loss {ref['loss']:.6f}, bans {ref['bans']}", flush=True)
    for name, spec in ATTACKS.items() if ref is not None else ():
        for scen, workers, faults in SCENARIOS(spec):
            r = run(root / f"{name.replace(' ', '_')}-{scen.split()[0]}-{scen.split()[-1]}", args, workers=workers,
                    faults=faults)
            equal, worst = gap(r["weights"], ref["weights"])
            row = {"mode": "exact", "attack": name, "scenario": scen, "bans": r["bans"], "by": r["by"],
                   "undo_to": r["undos"], "dup": r["dup"], "recomputed": r["recomputed"],
                   "suspects": r["suspects"], "equal": equal, "max_diff": worst, "loss_gap_pct": 100 * (r["loss"] - ref["loss"]) / ref["loss"],
                   "wall_s": round(r["wall_s"], 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.bf16_attacks:
        bref = run(root / "bf16-honest", args, workers=3, faults=[], precision="bf16")
        print(f"honest bf16 run: loss {bref['loss']:.6f}, bans {bref['bans']}", flush=True)
        for name, spec in ATTACKS.items():
            r = run(root / f"bf16-{name.replace(' ', '_')}", args, workers=3, faults=[f"poison:w1:{spec}:from=2"],
                    precision="bf16")
            equal, worst = gap(r["weights"], bref["weights"])
            row = {"mode": "bf16", "attack": name, "scenario": "alone from step 2", "bans": r["bans"], "by": r["by"],
                   "undo_to": r["undos"], "dup": r["dup"], "suspects": r["suspects"], "equal": equal,
                   "max_diff": worst, "loss_gap_pct": 100 * (r["loss"] - bref["loss"]) / bref["loss"],
                   "wall_s": round(r["wall_s"], 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    false_bans = 0
    if not args.skip_local:
        # Honest local runs differ from run to run (timing decides which replica covers which
        # micro-batch), so each worker count gets several honest runs: the attacks are judged
        # against their mean, and the honest runs' own gaps to it are the spread.
        lrefs = {}
        for workers in (3, 5):
            lrefs[workers] = []
            for i in range(args.local_honest):
                r = run(root / f"local-honest-{workers}w-{i}", args, workers=workers, faults=[], sync="local",
                        sync_every=args.sync_every)
                false_bans += len(r["bans"])
                lrefs[workers].append(r)
            mean = sum(r["loss"] for r in lrefs[workers]) / len(lrefs[workers])
            for i, r in enumerate(lrefs[workers]):
                row = {"mode": "local honest", "workers": workers, "run": i, "bans": r["bans"],
                       "loss": r["loss"], "loss_gap_pct": 100 * (r["loss"] - mean) / mean,
                       "warnings": r["warnings"], "wall_s": round(r["wall_s"], 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            lrefs[workers] = mean
        for name, spec in ATTACKS.items():
            for scen, workers, faults in SCENARIOS(spec):
                r = run(root / f"local-{name.replace(' ', '_')}-{scen.split()[0]}-{scen.split()[-1]}", args,
                        workers=workers, faults=faults, sync="local", sync_every=args.sync_every)
                row = {"mode": "local", "attack": name, "scenario": scen, "bans": r["bans"], "by": r["by"],
                       "held": r["held"], "loss": r["loss"],
                       "loss_gap_pct": 100 * (r["loss"] - lrefs[workers]) / lrefs[workers],
                       "wall_s": round(r["wall_s"], 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for i in range(args.honest):
        precision = "bf16" if i % 2 else "fp32"
        faults = ["slow:w2:factor=3"] + ([f"stop:w1:step={args.steps - 1}"] if args.honest_absent else [])
        r = run(root / f"honest-{i}", args, workers=args.honest_workers, faults=faults, precision=precision)
        false_bans += len(r["bans"])
        row = {"mode": f"honest {precision}", "run": i, "bans": r["bans"], "dup": r["dup"],
               "recomputed": r["recomputed"], "end_checks": r["end_checks"], "suspects": r["suspects"],
               "max_drift_z": r["max_drift_z"],
               "warnings": r["warnings"], "wall_s": round(r["wall_s"], 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"false bans over {args.honest} honest runs with uneven workers: {false_bans}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
