"""Sparse and low-rank pseudo-gradient sync (``--compression sparse``, ``lowrank``) in the real runtime: bytes and quality.

    PYTHONPATH=. .venv/bin/python bench/bench_sparse_sync.py bytes [--steps 8] [--out DIR]
    PYTHONPATH=. .venv/bin/python bench/bench_sparse_sync.py sweep [--steps 60] [--runs a,b] [--out DIR]

``bytes``: ``shoal launch`` (``tiny``, S = 2 stages, or ``--replicas SPEC``; W = 4 workers,
``--sync local --sync-every 4``) uncompressed and with ``--compression sparse`` (and ``sparse:0.01:4``, ``lowrank``, ``lowrank:2:4``).
Per worker per round, from the runtime's byte counters (``bytes_by_codec``, every process):
bytes of one pseudo-gradient push and of one pull of a merge, against the stage's weights in
dense bf16 (the counters' fp32-equivalent ``raw`` bytes / 2). Pushes: every ``grad_push`` frame;
pulls: the update frames (``weight_pull/sparse``); the fp32 pulls of each worker's first
version (the start of every chain) are shown apart, as the share of all pull bytes. The
messages' other fields (ids, step numbers) are counted as ``control`` and not in these rows.

``sweep``: quality at equal tokens on real text (the built-in corpus), ``tiny``, one stage and
two workers (two replicas), the same data and seed in every run: exact sync, local mode
uncompressed and local mode with each ``--codecs`` entry, for each H (``--hs``) and outer
setting (``--outer LR/MU``). Prints final loss (mean of the last 10 steps) and its ratio to
local-uncompressed with the same H and outer setting and to exact, and writes
``sparse_sweep.png`` (loss against tokens and against wall time) into ``--out``. Runs already
in ``--out``'s ``sweep.json`` are read back, not run again. ``--no-overlap`` makes the local
rows wait for each round (no delayed application). ``--replicas SPEC`` runs local mode as
pipeline replicas (``shoal launch --replicas``) instead of one stage's W workers (their
micro-batches fixed per replica: a run is the same from run to run); ``--model`` and ``--seed``
change the model preset and the seed of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")

from shoal.runtime.sync.codecs import stage_codec  # noqa: E402  (no torch: the threads above still apply)

BYTES_RUN = dict(model="tiny", micro_batches=8, micro_batch_size=4, seq_len=64, seed=0, lr=3e-3, warmup=2)
SWEEP_RUN = dict(model="tiny", micro_batches=4, micro_batch_size=4, seq_len=64, seed=0, lr=3e-3, warmup=5)


def launch_run(out: Path, steps: int, stages: int, workers: int, base: dict, **sync) -> dict:
    """One ``shoal launch``; its per-step records and summary."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    summary = launch(LaunchConfig(out=str(out), **base, steps=steps, stages=stages, workers=workers,
                                  timeout_s=3000, dead_after_s=8.0, min_lease_s=3.0, ckpt_every=0, dashboard=None,
                                  **sync))
    return {"recs": read_jsonl(out / "metrics.jsonl"), "summary": summary}


def log_counts(out: Path, last: int = 0) -> tuple[int, int]:
    """(pseudo-gradient pushes taken, pulls of a merge) in the workers' logs; pushes for round
    ``last`` and later left out (0: none)."""
    import re

    pushes = pulls = 0
    for p in (out / "logs").glob("worker*.log"):
        text = p.read_text()
        pushes += len([v for v in re.findall(r"sent its pseudo-gradient for v(\d+)", text)
                       if not last or int(v) < last])
        pulls += len([v for v in re.findall(r"pulled merged weights v(\d+)", text) if int(v) > 0])
    return pushes, pulls


def per_round_bytes(summary: dict, out: Path, steps: int) -> dict[str, float]:
    """Bytes of one push and one pull of a merge (wire, and the stage in dense bf16) from the
    run's counters; pushes and pulls counted in the logs. With ``sparse`` pushes the run's last
    round is dense (``shoal.runtime.sync.codecs.dense_round``): its pushes (in
    ``DENSE_ROUND_CODEC``) are shown apart."""
    from shoal.plan.compression import DENSE_ROUND_CODEC

    by = summary["bytes_by_codec"]
    gp = by.get("grad_push", {})
    stage_key = next((k for k in gp if stage_codec(k)), None)  # sparse or lowrank: one frame per stage
    sparse_push = stage_key is not None
    pushes, pulls = log_counts(out, last=steps if sparse_push else 0)
    push = gp[stage_key] if sparse_push else {k: sum(c[k] for c in gp.values()) for k in ("raw", "wire")}
    wp = by.get("weight_pull", {})
    pull_key = next((k for k in wp if stage_codec(k)), None)
    sparse = pull_key is not None
    # Uncompressed: every pull is the stage in fp32 (the first pulls of version 0 included).
    upd = wp[pull_key] if sparse else {k: sum(c[k] for c in wp.values()) for k in ("raw", "wire")}
    n_upd = pulls if sparse else max(1, pulls + len(list((out / "logs").glob("worker*.log"))))
    return {
        "pushes": pushes, "push_wire": push["wire"] / max(1, pushes), "push_bf16": push["raw"] / 2 / max(1, pushes),
        "pulls": pulls, "pull_wire": upd["wire"] / n_upd, "pull_bf16": upd["raw"] / 2 / n_upd,
        "fp32_pull_bytes": wp.get("raw", {}).get("wire", 0) if sparse else 0,
        "last_round_push_bytes": gp.get(DENSE_ROUND_CODEC, {}).get("wire", 0) if sparse_push else 0,
    }


def bytes_main(args) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_sparse_bytes_"))
    rows = {"local H=4 none": {}, "local H=4 sparse": dict(compression="sparse"),
            "local H=4 sparse:0.01:4": dict(compression="sparse:0.01:4"), "local H=4 lowrank": dict(compression="lowrank"),
            "local H=4 lowrank:2:4": dict(compression="lowrank:2:4")}
    shape = f"--replicas {args.replicas}" if args.replicas else "S=2"
    print(f"tiny, {shape}, W=4, --sync local --sync-every 4, {args.steps} steps, loopback; per worker per round\n")
    print("| run | pushes | B per push (wire) | stage in dense bf16 | bf16 / push | pulls of a merge | B per pull (wire) | "
          "stage in dense bf16 | bf16 / pull | fp32 pulls of the chain starts, B per worker | "
          "the last round's dense pushes, B per worker |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    res = {}
    for name, extra in rows.items():
        print(f"running {name} ...", file=sys.stderr, flush=True)
        folder = out / name.replace(" ", "_").replace("=", "").replace(":", "_")
        r = launch_run(folder, args.steps, 2, 4, BYTES_RUN, sync="local", sync_every=4, **extra,
                       **({"replicas": args.replicas} if args.replicas else {}))
        b = per_round_bytes(r["summary"], folder, args.steps)
        res[name] = b
        print(f"| {name} | {b['pushes']} | {b['push_wire']:,.0f} | {b['push_bf16']:,.0f} | "
              f"{b['push_bf16'] / b['push_wire']:.1f}x | {b['pulls']} | {b['pull_wire']:,.0f} | {b['pull_bf16']:,.0f} | "
              f"{b['pull_bf16'] / b['pull_wire']:.1f}x | {b['fp32_pull_bytes'] / 4:,.0f} | "
              f"{b['last_round_push_bytes'] / 4:,.0f} |")
    (out / "bytes.json").write_text(json.dumps(res, indent=1))
    return 0


def sweep_rows(hs: list[int], codecs: list[str], outers: list[str], replicas: str | None = None,
               overlap: bool = True) -> dict[str, dict]:
    """Row name -> LaunchConfig fields: exact, then per outer setting (``lr/mu``; the default
    1/0 unnamed) and H local mode uncompressed and with each codec (as pipeline replicas
    ``replicas`` when given; ``overlap=False``: the steps wait for each round, ``--no-overlap``)."""
    rows = {"exact": {}}
    for o in outers:
        lr, mu = (float(x) for x in o.split("/"))
        tag = "" if (lr, mu) == (1.0, 0.0) else f" outer {o}"
        for h in hs:
            base = dict(sync="local", sync_every=h, outer_lr=lr, outer_momentum=mu,
                        **({"replicas": replicas} if replicas else {}), **({} if overlap else {"overlap": False}))
            rows[f"local H={h}{tag}"] = base
            for c in codecs:
                rows[f"local H={h} {c}{tag}"] = dict(base, compression=c)
    return rows


def wall_curve(recs: list[dict]) -> list[float]:
    t, out = 0.0, []
    for r in recs:
        t += r["step_time_s"]
        out.append(t)
    return out


def tail_loss(recs: list[dict], n: int = 10) -> float:
    return statistics.fmean(r["loss"] for r in recs[-n:])


def final_val(run_dir: Path) -> float:
    """Validation loss of the run's final weights (its stage servers' last checkpoint: in local
    mode the merged weights, the model the run produces) on 8 held-out micro-batches."""
    from shoal.data import load_data
    from shoal.hf.export import latest_weights
    from shoal.model.transformer import build_stage
    from shoal.train.config import TrainConfig
    from shoal.train.local import evaluate, val_micro_batches

    _, cfg, state = latest_weights(run_dir)
    model = build_stage(cfg, 0, cfg.n_total_layers, SWEEP_RUN["seed"])
    model.load_state_dict(state)
    b, t = SWEEP_RUN["micro_batch_size"], SWEEP_RUN["seq_len"]
    tc = TrainConfig(model=SWEEP_RUN["model"], micro_batch_size=b, seq_len=t, seed=SWEEP_RUN["seed"])
    data = load_data(tc.data_config(), cfg.vocab_size)
    return evaluate(model, val_micro_batches(data, SWEEP_RUN["seed"], 8, b, t))


def plot(results: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for name, res in results.items():
        recs = res["recs"]
        tokens = [sum(r["tokens"] for r in recs[:i + 1]) for i in range(len(recs))]
        style = "-" if "sparse" not in name else "--"
        lw = 2.5 if name == "exact" else 1.2
        a.plot(tokens, [r["loss"] for r in recs], style, label=name, lw=lw)
        b.plot(wall_curve(recs), [r["loss"] for r in recs], style, label=name, lw=lw)
    a.set_xlabel("tokens")
    b.set_xlabel("wall seconds (training, 2 shared cores)")
    for ax in (a, b):
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def sweep_main(args) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_sparse_sweep_"))
    out.mkdir(parents=True, exist_ok=True)
    sep = ";" if ";" in args.codecs or ";" in (args.runs or "") else ","  # ";" lets a codec hold ","
    rows = sweep_rows([int(h) for h in args.hs.split(",")], args.codecs.split(sep), args.outer.split(","),
                      args.replicas, not args.no_overlap)
    names = args.runs.split(sep) if args.runs else list(rows)
    results = {}
    done = out / "sweep.json"
    saved = json.loads(done.read_text()) if done.exists() else {}
    for name in names:
        folder = out / name.replace(" ", "_").replace("=", "").replace(":", "_")
        if name in saved:  # resumable: a run already made is read back
            from shoal.train.metrics import read_jsonl

            results[name] = {"recs": read_jsonl(folder / "metrics.jsonl")}
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = launch_run(folder, args.steps, 1, args.workers, SWEEP_RUN, **rows[name])
        saved[name] = tail_loss(results[name]["recs"])
        done.write_text(json.dumps(saved, indent=1))
    ref_exact = tail_loss(results["exact"]["recs"]) if "exact" in results else None
    tok = sum(r["tokens"] for r in next(iter(results.values()))["recs"])
    shape = f"replicas {args.replicas} (local rows)" if args.replicas else "S=1"
    print(f"\n{SWEEP_RUN['model']}, {shape}, W={args.workers}, M={SWEEP_RUN['micro_batches']} x {SWEEP_RUN['micro_batch_size']} x "
          f"{SWEEP_RUN['seq_len']} tokens, built-in corpus, {args.steps} steps ({tok:,} tokens, equal in every "
          "run); loss = mean of the last 10 steps (the same batches in every run)\n")
    vals = {name: final_val(out / name.replace(" ", "_").replace("=", "").replace(":", "_")) for name in results}
    print("| run | final loss | / local uncompressed (same H) | / exact | val of the final weights | "
          "/ local | / exact | train wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        fin = tail_loss(res["recs"])
        parts = name.split()
        base_name = (" ".join(p for p in parts if not any(stage_codec(x.split("=")[-1]) for x in p.split(",")))
                     if name.startswith("local") else None)
        base = results.get(base_name) if base_name else None
        rel = f"{fin / tail_loss(base['recs']):.4f}" if base is not None and base is not res else "-"
        ex = f"{fin / ref_exact:.4f}" if ref_exact else "-"
        vrel = f"{vals[name] / vals[base_name]:.4f}" if base is not None and base is not res else "-"
        vex = f"{vals[name] / vals['exact']:.4f}" if "exact" in vals else "-"
        print(f"| {name} | {fin:.4f} | {rel} | {ex} | {vals[name]:.4f} | {vrel} | {vex} | "
              f"{wall_curve(res['recs'])[-1]:.0f} |")
    png = out / "sparse_sweep.png"
    plot(results, png, f"{SWEEP_RUN['model']} on the built-in corpus, W={args.workers}: exact vs local vs local with compressed pushes and pulls")
    print(f"\nplot: {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("bytes", "sweep"))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (bytes 8, sweep 60)")
    ap.add_argument("--workers", type=int, default=2, help="sweep: workers (one stage: replicas)")
    ap.add_argument("--hs", default="4,8", help="sweep: H values")
    ap.add_argument("--codecs", default="sparse:0.01:2,sparse:0.01:4,sparse:0.03:2", help="sweep: push/pull codecs, comma-separated (or ';'-separated, then --runs too)")
    ap.add_argument("--outer", default="1/0", help="sweep: outer LR/momentum settings, comma-separated")
    ap.add_argument("--replicas", default=None, help="run local mode as these pipeline replicas "
                    "(a --replicas SPEC, e.g. 1,1: two one-stage replicas; --workers workers)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="sweep: local rows wait for each round (no delayed application)")
    ap.add_argument("--model", default=SWEEP_RUN["model"], help="sweep: the model preset (tiny, small, ...)")
    ap.add_argument("--seed", type=int, default=SWEEP_RUN["seed"], help="sweep: the runs' seed (init, data order)")
    ap.add_argument("--runs", default=None, help="sweep: comma-separated rows (default all)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = ap.parse_args(argv)
    if args.mode == "bytes":
        args.steps = args.steps or 8
        return bytes_main(args)
    args.steps = args.steps or 60
    SWEEP_RUN["seed"], SWEEP_RUN["model"] = args.seed, args.model
    return sweep_main(args)


if __name__ == "__main__":
    sys.exit(main())
