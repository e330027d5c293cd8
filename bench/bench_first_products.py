"""Do a process's first products, made by several threads at once, come out in the usual bits?

    .venv/bin/python bench/bench_first_products.py --runs 250 --threads 4

Each run is a fresh Python process (``--child``) that builds the tiny model (seed 0), then
computes the forward and backward of ``--threads`` micro-batches (2 x 32 tokens) at once in a
``compute_pool`` of that many threads, released together by a barrier, and then each again
one after another in its own thread. It reports, per micro-batch, whether the threaded
logits and gradients equal the sequential ones bitwise, and the sum of the first sequential
micro-batch's logits (another value: the whole process computes other bits). Runs alternate
``cold`` (nothing computed before the threads start) and ``warm`` (``warm_kernels`` first, as
``shoal train --local`` does before its first threaded step), so both see the same load.
Prints a markdown table per mode: runs, runs whose threaded bits differed, distinct first-logit sums.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading


def child(mode: str, n: int) -> dict:
    import torch
    import torch.nn.functional as F

    from shoal.model.config import get_preset
    from shoal.model.transformer import build_model
    from shoal.threads import compute_pool
    from shoal.train.local import CPU_FP32, warm_kernels

    torch.set_num_threads(1)
    cfg = get_preset("tiny")
    model = build_model(cfg, seed=0)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, cfg.vocab_size, (2, 32), generator=g) for _ in range(n)]
    ys = [torch.randint(0, cfg.vocab_size, (2, 32), generator=g) for _ in range(n)]
    if mode == "warm":
        warm_kernels(model, CPU_FP32)
    barrier = threading.Barrier(n)

    def one(i: int, together: bool = True):
        if together:
            barrier.wait()
        logits = model(xs[i])
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), ys[i].view(-1))
        return logits.detach().clone(), [t.clone() for t in torch.autograd.grad(loss, params)]

    with compute_pool(n, "mb") as pool:
        got = [f.result() for f in [pool.submit(one, i) for i in range(n)]]
    ref = [one(i, False) for i in range(n)]
    same = [torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))
            for a, b in zip(got, ref, strict=True)]
    return {"mode": mode, "same": same, "logit_sum": float(ref[0][0].double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100, help="runs of each mode")
    ap.add_argument("--threads", type=int, default=4, help="micro-batch threads started together")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "THREADS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    counts = {m: [0, 0, set()] for m in ("cold", "warm")}
    for i in range(args.runs):
        for mode in ("cold", "warm"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(args.threads)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            c = counts[mode]
            c[0] += 1
            c[1] += not all(r["same"])
            c[2].add(r["logit_sum"])
        if (i + 1) % 25 == 0:
            print(f"{i + 1} runs each: " + ", ".join(f"{m} {c[1]} differed" for m, c in counts.items()),
                  file=sys.stderr, flush=True)
    print("| start | runs | threaded bits differed | distinct first-logit sums |\n|---|---|---|---|")
    for mode, (runs, differed, sums) in counts.items():
        print(f"| {mode} | {runs} | {differed} | {len(sums)} |")


if __name__ == "__main__":
    main()
