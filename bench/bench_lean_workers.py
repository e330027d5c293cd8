"""Lean local-mode workers (``--lean-workers``) against standard ones: loss at equal tokens.

    PYTHONPATH=. .venv/bin/python bench/bench_lean_workers.py [--steps 60] [--seeds 0,1,2] [--h 4]
        [--stages 1] [--workers 2] [--model tiny] [--out DIR]

A lean worker holds 12 bytes a parameter instead of 20 (shoal.runtime.sync.lean): backward sums
each step's gradients in ``.grad`` in the order its tasks come, and its inner AdamW keeps bf16
moments (shoal.train.optim.LeanAdamW). What that costs is measured here on the real runtime
(``shoal launch``, the built-in corpus, ``--sync local``, the same data and seed in both rows of a
seed): per seed, exact sync, local mode and local mode with lean workers; per row, the training
loss (mean of the last 10 steps: the same batches in every run) and the validation loss of the
run's final (merged) weights on 8 held-out micro-batches, and the lean row's ratio to local mode
and to exact; then the mean ratios over the seeds. ``--again`` runs local mode a second time per
seed: two runs of one policy differ too (which worker runs which micro-batch follows their
timing), and their ratio is the noise the lean row's ratio sits in. ``--compression SPEC`` adds
a row of lean workers with those wire codecs (e.g. what ``--sync auto`` chooses for gaming-world:
``act=int8,grad=int8,push=lowrank,pull=lowrank``), against the same local and exact rows. Every
number is from this one run on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sparse_sync as sparse  # noqa: E402  (launch_run, final_val, tail_loss: the sweep's measures)

ROWS = {"exact": {}, "local": dict(sync="local"), "local lean": dict(sync="local", lean=True)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    ap.add_argument("--seeds", default="0,1,2", help="seeds (init and data order), one run of each row per seed")
    ap.add_argument("--h", type=int, default=4, help="local mode's H")
    ap.add_argument("--stages", type=int, default=1, help="pipeline stages")
    ap.add_argument("--workers", type=int, default=2, help="workers")
    ap.add_argument("--model", default="tiny", help="model preset")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--again", action="store_true", help="run local mode twice per seed (the runs' own spread)")
    ap.add_argument("--compression", default=None, help="also a row of lean workers with these wire codecs")
    args = ap.parse_args(argv)
    rows = dict(ROWS, **({"local again": dict(sync="local")} if args.again else {}))
    if args.compression:
        rows["lean codecs"] = dict(sync="local", lean=True, compression=args.compression)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_lean_"))
    sparse.SWEEP_RUN["model"] = args.model
    table: dict[str, dict[int, tuple[float, float]]] = {r: {} for r in rows}
    for seed in [int(s) for s in args.seeds.split(",")]:
        sparse.SWEEP_RUN["seed"] = seed
        for row, sync in rows.items():
            folder = out / f"seed{seed}_{row.replace(' ', '_')}"
            print(f"running {row}, seed {seed} ...", file=sys.stderr, flush=True)
            h = dict(sync_every=args.h) if sync else {}
            res = sparse.launch_run(folder, args.steps, args.stages, args.workers, sparse.SWEEP_RUN, **sync, **h)
            table[row][seed] = (sparse.tail_loss(res["recs"]), sparse.final_val(folder))
    r = sparse.SWEEP_RUN
    print(f"\n{args.model}, S={args.stages}, W={args.workers}, H={args.h}, M={r['micro_batches']} x "
          f"{r['micro_batch_size']} x {r['seq_len']} tokens, {args.steps} steps, built-in corpus\n")
    again = "local again" in table
    print("| seed | exact train / val | local train / val | lean train / val | lean / local (train, val) | "
          "lean / exact (train, val) |" + (" local again / local (train, val) |" if again else ""))
    print("|---|---|---|---|---|---|" + ("---|" if again else ""))
    ratios = []
    for seed in table["exact"]:
        (et, ev), (lt, lv), (nt, nv) = table["exact"][seed], table["local"][seed], table["local lean"][seed]
        at, av = table["local again"][seed] if again else (lt, lv)
        ratios.append((nt / lt, nv / lv, nt / et, nv / ev, at / lt, av / lv))
        print(f"| {seed} | {et:.4f} / {ev:.4f} | {lt:.4f} / {lv:.4f} | {nt:.4f} / {nv:.4f} | "
              f"{nt / lt:.4f}, {nv / lv:.4f} | {nt / et:.4f}, {nv / ev:.4f} |"
              + (f" {at / lt:.4f}, {av / lv:.4f} |" if again else ""))
    mean = [statistics.fmean(x[i] for x in ratios) for i in range(6)]
    print(f"| mean | | | | {mean[0]:.4f}, {mean[1]:.4f} | {mean[2]:.4f}, {mean[3]:.4f} |"
          + (f" {mean[4]:.4f}, {mean[5]:.4f} |" if again else ""))
    if "lean codecs" in table:
        print(f"\nlean workers with --compression {args.compression}:\n")
        print("| seed | train / val | / local (train, val) | / exact (train, val) |")
        print("|---|---|---|---|")
        got = []
        for seed, (ct, cv) in table["lean codecs"].items():
            (et, ev), (lt, lv) = table["exact"][seed], table["local"][seed]
            got.append((ct / lt, cv / lv, ct / et, cv / ev))
            print(f"| {seed} | {ct:.4f} / {cv:.4f} | {ct / lt:.4f}, {cv / lv:.4f} | {ct / et:.4f}, {cv / ev:.4f} |")
        m = [statistics.fmean(x[i] for x in got) for i in range(4)]
        print(f"| mean | | {m[0]:.4f}, {m[1]:.4f} | {m[2]:.4f}, {m[3]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
