"""Compression benchmark: wire bytes and final loss of each codec configuration vs raw.

    nice .venv/bin/python bench/bench_compress.py --steps 150

The measurement itself (a two-stage pipeline in one process that passes every tensor
crossing the network through its codec) is :func:`run` in
``tests/helpers/compress_pipeline.py``; see its docstring for what is counted.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.compress_pipeline import CONFIGS, BenchConfig, run  # noqa: E402

from shoal.data import DataConfig, load_data  # noqa: E402
from shoal.model.config import get_preset  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run every configuration and print the comparison table (Markdown)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = BenchConfig(steps=a.steps, seed=a.seed)
    data = load_data(DataConfig(), get_preset(cfg.model).vocab_size)
    results = {name: run(cfg, CONFIGS[name], data) for name in a.configs.split(",")}
    base = results.get("raw")
    print(f"tiny model, 2 stages [0,{cfg.split}) [{cfg.split},{get_preset(cfg.model).n_total_layers}), "
          f"{cfg.steps} steps, M={cfg.micro_batches}, B={cfg.micro_batch_size}, T={cfg.seq_len}, seed {cfg.seed}")
    print("| config | act fp32/wire | act-grad fp32/wire | grad-push fp32/wire | weight-pull fp32/wire "
          "| total fp32/wire | act + act-grad bf16/wire | final val loss | vs raw | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        b = r["bytes"]
        raw = sum(v["raw"] for v in b.values())
        wire = sum(v["wire"] for v in b.values())
        gap = (r["val_loss"] - base["val_loss"]) / base["val_loss"] if base else math.nan
        # bf16 holds each fp32 element in half the bytes: the ratio a bf16 run's codec saves
        act = [b[k] for k in ("activations", "act_grads")]
        bf16 = sum(v["raw"] for v in act) / 2 / sum(v["wire"] for v in act)
        print(f"| {name} | " + " | ".join(f"{b[k]['ratio']:.2f}x" for k in
                                            ("activations", "act_grads", "grad_push", "weight_pull"))
              + f" | {raw / wire:.2f}x | {bf16:.2f}x | {r['val_loss']:.4f} | {100 * gap:+.2f} % "
              f"| {r['seconds']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
