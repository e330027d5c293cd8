"""Local mode with sparse or low-rank sync, in one process: the runtime's codec and merge code, no processes.

    PYTHONPATH=. .venv/bin/python bench/sim_sparse_sync.py --steps 240 --runs "exact;local h=4;local h=4 c=sparse"

Each run trains ``tiny`` on the built-in corpus with the runtime's arithmetic: W replicas of the
whole model (one stage), micro-batch ``i`` of a step computed by replica ``i % W`` (the runtime
leases them to whichever worker asks; the batches are the same), each replica's gradient the
mean of its micro-batches, the global clip from the replicas' weighted squared norms, one inner
AdamW step per replica at the step's learning rate; every H steps the pseudo-gradients (anchor
minus weights) are pushed with the run's push codec and error feedback
(:func:`shoal.runtime.sync.codecs.stage_frame`, :class:`shoal.net.compress.ErrorFeedback`),
merged (:func:`shoal.train.outer.weighted_sum`) and applied by the server's code: the outer
Nesterov step, or with a sparse or lowrank pull codec :class:`shoal.runtime.sync.codecs.UpdatePulls` (the
encoded update with the server's error feedback); every replica then restarts from the server's
weights. Exact mode is one AdamW step on the mean gradient of all M micro-batches.

A run is words separated by spaces, runs by ``;``: ``exact`` or ``local``, ``h=H``,
``c=CODEC`` (push and pull), ``push=CODEC``, ``pull=CODEC``, ``lr=OUTER_LR``,
``mu=OUTER_MOMENTUM`` (defaults 1 and 0). Variants the runtime does not have, tried against
the runtime's scheme (bench/results/sparse-sync.md):

* ``flush=1``: the run's last round is dense (every pseudo-gradient whole, plus a worker's
  error-feedback residual unless ``keep=1``; the server adds its pull residual), as the runtime
  does with ``sparse`` pushes (``keep=1 flush=1`` is the runtime's scheme since 2026-12-02);
* ``lastc=CODEC``: the dense last round's pushes in ``CODEC`` (the runtime: int8) instead of exact;
* ``keep=1``: after a merge a replica keeps what its own push did not carry (replica = merged
  weights minus its residual) instead of restarting from the merged weights; ``keep=F`` (a
  fraction) keeps that share of it and holds the rest in a buffer for the next push, dropped
  at the dense last round (seeds 0-2 at 120 steps, ``keep=0.8``: val -0.3 %, +0.5 %, -0.8 %
  against ``keep=1``, within the seeds' spread);
* ``rescale=1`` (with ``keep=1``): a replica's kept residual is re-weighted in its next push to
  the share it was made at (:func:`shoal.runtime.sync.codecs.residual_reweight`, as the runtime does);
* ``decay=B``: the worker's error-feedback residual is multiplied by ``B`` before each push;
* ``ef21=1``: EF21 -- a push is the compressed change of the worker's running estimate of its
  pseudo-gradient, the pull the compressed change of the merged estimate, and every merge
  applies the whole (dense) merged estimate;
* ``c=stride:S:BITS``: every S-th entry from offset round mod S (no indices on the wire),
  ``BITS`` per value with a least-squares scale per 4096 entries, error feedback both ways
  (S = 7 at 1 bit and S = 14 at 2 bits are 111x smaller than bf16, as ``sparse:0.01:2``).

Prints final loss (mean training loss of the last 10 steps) and the validation loss of the
final weights (the server's in local mode).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def parse_run(text: str) -> dict:
    run = dict(mode="exact", h=4, push="none", pull="none", lr=1.0, mu=0.0, keep=0, decay=1.0, ef21=0, flush=0, owed=1,
               lastc="raw", split="fixed", rescale=0)
    for word in text.split():
        if word in ("exact", "local"):
            run["mode"] = word
        elif "=" in word:
            k, v = word.split("=", 1)
            if k == "c":
                run["push"] = run["pull"] = v
            elif k == "split":
                if v not in ("fixed", "random"):
                    raise SystemExit(f"split={v}: fixed or random")
                run["split"] = v
            elif k in ("push", "pull", "lastc"):
                run[k] = v
            elif k == "h":
                run["h"] = int(v)
            elif k in ("lr", "mu", "decay", "keep"):
                run[k] = float(v)
            elif k in ("ef21", "flush", "owed", "rescale"):
                run[k] = int(v)
            else:
                raise SystemExit(f"unknown knob {k}")
    return run


def stride_roundtrip(x, stride: int, offset: int, bits: int):
    """Decoded ``x`` (flat) through the strided codec: every ``stride``-th entry from ``offset``,
    ``bits`` per value with one least-squares scale per 4096 kept entries; the rest 0."""
    import torch

    out = torch.zeros_like(x)
    sel = x[offset::stride]
    n = sel.numel()
    pad = (-n) % 4096
    v = torch.cat([sel, torch.zeros(pad)]).view(-1, 4096)
    a = v.abs()
    levels = 1 << (bits - 1)
    top = a.amax(dim=1, keepdim=True)
    safe = torch.where(top > 0, top, torch.ones_like(top))
    j = torch.clamp(torch.ceil(a * levels / safe) - 1, 0, levels - 1)
    c = (j + 1) / levels
    sc = (a * c).sum(dim=1, keepdim=True) / (c * c).sum(dim=1, keepdim=True).clamp_min(1e-30)
    sc = sc.to(torch.float16).to(torch.float32)
    dec = (torch.sign(v) * sc * c).reshape(-1)[:n]
    out[offset::stride] = dec
    return out


def strided(d: dict, codec: str, rnd: int, ef: dict | None, key):
    """The strided codec with error feedback ``ef[key]`` over the flattened stage (name order)."""
    import torch

    _, stride, bits = codec.split(":")
    names = sorted(d)
    flat = torch.cat([d[n].reshape(-1) for n in names])
    if ef is not None and key in ef:
        flat = flat + ef[key]
    dec = stride_roundtrip(flat, int(stride), rnd % int(stride), int(bits))
    if ef is not None:
        ef[key] = flat - dec
    out, at = {}, 0
    for n in names:
        k = d[n].numel()
        out[n] = dec[at:at + k].view_as(d[n])
        at += k
    return out


def simulate(run: dict, steps: int, workers: int = 2, m: int = 4, mbs: int = 4, seq: int = 64, seed: int = 0,
             lr: float = 3e-3, warmup: int = 5, model: str = "tiny") -> dict:
    import torch

    from shoal.data import get_micro_batch, load_data
    from shoal.model.transformer import build_stage
    from shoal.net.compress import ErrorFeedback
    from shoal.runtime.sync.codecs import (
        STAGE_FRAME,
        UpdatePulls,
        residual_reweight,
        runtime_codec,
        split_flat,
        split_stage_frame,
        stage_frame,
    )
    from shoal.train.config import TrainConfig
    from shoal.train.local import evaluate, val_micro_batches
    from shoal.train.optim import (
        apply_update,
        clip_coefficient,
        grad_sq_norm,
        lr_at,
        make_optimizer,
    )
    from shoal.train.outer import (
        is_sync_step,
        merge_weights,
        outer_nesterov_step,
        outer_nesterov_update,
        weighted_sum,
    )

    torch.set_num_threads(1)
    cfg = TrainConfig(model=model, steps=steps, micro_batches=m, micro_batch_size=mbs, seq_len=seq, seed=seed,
                      lr=lr, warmup=warmup)
    mc = cfg.model_config()
    data = load_data(cfg.data_config(), mc.vocab_size)
    optim = cfg.optim_config()
    local = run["mode"] == "local"
    n_rep = workers if local else 1
    reps = [build_stage(mc, 0, mc.n_total_layers, seed) for _ in range(n_rep)]
    server = build_stage(mc, 0, mc.n_total_layers, seed)
    opts = [make_optimizer(r.named_parameters(), optim) for r in reps]
    push = runtime_codec(run["push"])
    pull = run["pull"]
    efs = [ErrorFeedback(push) if push not in ("raw",) and not push.startswith("stride") else None for _ in reps]
    up = UpdatePulls(pull) if local and pull.startswith(("sparse", "lowrank")) else None
    if pull.startswith("stride"):
        pull = pull
    key = (0, 0, 0)
    outer_m: dict = {}
    sp = dict(server.named_parameters())
    anchor = [{n: p.detach().clone() for n, p in r.named_parameters()} for r in reps]
    recs = []
    kept: dict = {}
    kept_n: dict = {}  # the round count of the round each kept residual came from
    buf: dict = {}
    last_replica = None
    est: dict = {}
    sef: dict = {}
    G: dict = {}
    t0 = time.perf_counter()
    round_counts = [0] * n_rep  # micro-batches each replica covered since the last merge
    for step in range(steps):
        batches = [get_micro_batch(data, "train", seed, step, i, mbs, seq) for i in range(m)]
        losses, sqs, counts = [], [], []
        owner = [i % n_rep for i in range(m)]
        if run["split"] == "random":  # as the runtime's leases may: any replica, any share
            rng = random.Random(seed * 1_000_003 + step)
            owner = [rng.randrange(n_rep) for _ in range(m)]
        for ri, rep in enumerate(reps):
            mine = [i for i in range(m) if owner[i] == ri]
            round_counts[ri] += len(mine)
            for i in mine:
                x, y = batches[i]
                loss = rep(x, y)
                (loss / len(mine)).backward()
                losses.append(float(loss.detach()))
            sqs.append(grad_sq_norm(rep.parameters()))
            counts.append(len(mine))
        coef = clip_coefficient(sum(c / m * s for c, s in zip(counts, sqs, strict=True)), optim.grad_clip)
        step_lr = lr_at(step, steps, optim)
        for o in opts:
            apply_update(o, step_lr, coef)
        rec = {"step": step, "loss": statistics.fmean(losses), "t": time.perf_counter() - t0}
        if local and is_sync_step(step, run["h"], steps):
            deltas = {}
            last = run["flush"] and step == steps - 1
            for ri, rep in enumerate(reps):
                d = {n: anchor[ri][n] - p.detach() for n, p in rep.named_parameters()}
                if last:
                    r = efs[ri].residual(STAGE_FRAME) if efs[ri] is not None and not run["keep"] else None
                    if r is not None:  # the worker's unsent residual goes too, dense
                        d = {n: d[n] + e for n, e in split_flat(r, sp).items()}
                    if run["lastc"] != "raw":  # the dense round's pushes in another codec
                        from shoal.net.wire import decode_tensor, encode_tensor

                        d = {n: decode_tensor(encode_tensor(n, t, run["lastc"]), shape=tuple(t.shape), dtype="float32")
                             for n, t in d.items()}
                    deltas[f"w{ri}"] = d  # (a keep < 1 buffer is dropped: the replica relearned it)
                    continue
                if push.startswith("stride"):
                    d = strided(d, push, step // run["h"], sef, ri)
                elif run["ef21"]:
                    # EF21: the push is the compressed change of the worker's estimate g of its
                    # pseudo-gradient; the server holds the same g
                    g = est.setdefault(ri, {n: torch.zeros_like(t) for n, t in d.items()})
                    c = split_stage_frame(stage_frame({n: d[n] - g[n] for n in d}, push), sp)
                    for n in g:
                        g[n].add_(c[n])
                    d = {n: g[n].clone() for n in g}
                elif efs[ri] is not None and run["keep"]:
                    # the replica keeps (a share ``keep`` of) what its push did not carry; the
                    # rest waits in a buffer for the next push
                    if ri in buf:
                        d = {n: d[n] + buf[ri][n] for n in d}
                    if run["rescale"] and ri in kept:
                        # the kept residual was made at another share: re-weight it to the share it had
                        f = residual_reweight(kept_n[ri], round_counts[ri]) - 1.0
                        if f:
                            d = {n: d[n] + f * kept[ri][n] for n in d}
                    kept_n[ri] = round_counts[ri]
                    sent = split_stage_frame(stage_frame(d, push), sp)
                    kept[ri] = {n: run["keep"] * (d[n] - sent[n]) for n in d}
                    if run["keep"] < 1:
                        buf[ri] = {n: d[n] - sent[n] - kept[ri][n] for n in d}
                    d = sent
                elif efs[ri] is not None:
                    if run["decay"] != 1.0:
                        r = efs[ri]._residual.get("*stage")
                        if r is not None:
                            r.mul_(run["decay"])
                    d = split_stage_frame(stage_frame(d, push, efs[ri]), sp)
                deltas[f"w{ri}"] = d
            shares = merge_weights({f"w{ri}": round_counts[ri] for ri in range(n_rep)})
            round_counts = [0] * n_rep
            delta = weighted_sum(deltas, shares)
            if last:  # the dense round: merged exactly, then what the pulls still owed
                outer_nesterov_step({n: p.data for n, p in sp.items()}, delta, outer_m, run["lr"], run["mu"])
                if up is not None and run["owed"]:
                    up.flush({n: p.data for n, p in sp.items()})
            elif pull.startswith("stride"):
                update = outer_nesterov_update(delta, outer_m, run["lr"], run["mu"])
                dec = strided({n: -u for n, u in update.items()}, pull, step // run["h"], sef, "server")
                with torch.no_grad():
                    for n, p in sp.items():
                        p.add_(dec[n])
            elif run["ef21"]:
                # the merged estimate G follows mean(g) by compressed differences (the pull)
                for n in delta:
                    G.setdefault(n, torch.zeros_like(delta[n]))
                c = split_stage_frame(stage_frame({n: delta[n] - G[n] for n in delta}, runtime_codec(pull)), sp) \
                    if pull.startswith("sparse") else {n: delta[n] - G[n] for n in delta}
                for n in G:
                    G[n].add_(c[n])
                outer_nesterov_step({n: p.data for n, p in sp.items()}, {n: G[n].clone() for n in G}, outer_m,
                                    run["lr"], run["mu"])
            elif up is not None:
                update = outer_nesterov_update(delta, outer_m, run["lr"], run["mu"])
                new = (step + 1, 0, 0)
                up.merge({n: p.data for n, p in sp.items()}, update, key, new, 0, 0)
                key = new
            else:
                outer_nesterov_step({n: p.data for n, p in sp.items()}, delta, outer_m, run["lr"], run["mu"])
            if step == steps - 1:
                last_replica = copy.deepcopy(reps[0])
            with torch.no_grad():
                for ri, rep in enumerate(reps):
                    for n, p in rep.named_parameters():
                        p.copy_(sp[n])
                    anchor[ri] = {n: p.detach().clone() for n, p in rep.named_parameters()}
                    if ri in kept:
                        for n, p in rep.named_parameters():
                            p.sub_(kept[ri][n])
        recs.append(rec)
    final_model = reps[0] if not local else server
    vb = val_micro_batches(data, seed, 8, mbs, seq)
    val = evaluate(final_model, vb)
    # (local mode) the first replica's own weights at the end, before the last merge replaced them
    return {"recs": recs, "val": val, "final": statistics.fmean(r["loss"] for r in recs[-10:]),
            "val_replica": evaluate(last_replica, vb) if local else val}


def run_name(text: str, args) -> str:
    """A run's key in the ``--out`` file: its words, steps, workers, and seed and model unless the defaults."""
    return (f"{text.strip()} steps={args.steps} W={args.workers}" + (f" seed={args.seed}" if args.seed else "")
            + (f" model={args.model}" if args.model != "tiny" else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order")
    ap.add_argument("--model", default="tiny", help="model preset")
    ap.add_argument("--runs", required=True, help="';'-separated runs (see the module docstring)")
    ap.add_argument("--out", default=None, help="JSON file to add the results to (runs in it are not run again)")
    ap.add_argument("--plot", default=None, help="PNG of loss against tokens of the runs (with --out)")
    args = ap.parse_args(argv)
    saved = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else {}
    for text in args.runs.split(";"):
        name = run_name(text, args)
        if name not in saved:
            res = simulate(parse_run(text), args.steps, args.workers, seed=args.seed, model=args.model)
            saved[name] = {"final": res["final"], "val": res["val"], "loss": [r["loss"] for r in res["recs"]],
                           "t": res["recs"][-1]["t"], "val_replica": res["val_replica"]}
            if args.out:
                Path(args.out).write_text(json.dumps(saved))
        r = saved[name]
        rep = f" replica 0 before the last merge {r['val_replica']:.4f}" if "val_replica" in r else ""
        print(f"{name:60s} final {r['final']:.4f} val {r['val']:.4f}{rep} ({r['t']:.0f} s)", flush=True)
    if args.plot:
        plot(saved, [run_name(t, args) for t in args.runs.split(";")], args.plot)
    return 0


def plot(saved: dict, names: list[str], path: str) -> None:
    """Loss against tokens (1,024 per step), smoothed over 5 steps, of ``names``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name in names:
        loss = saved[name]["loss"]
        sm = [statistics.fmean(loss[max(0, i - 4):i + 1]) for i in range(len(loss))]
        style = "--" if ("sparse" in name or "stride" in name or "lowrank" in name) else "-"
        ax.plot([1024 * (i + 1) for i in range(len(sm))], sm, style, label=name.split(" steps=")[0],
                lw=2.5 if name.startswith("exact") else 1.2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("training loss (mean of 5 steps)")
    ax.set_ylim(top=7.0)
    ax.legend(fontsize=7)
    ax.set_title("tiny, built-in corpus, 2 replicas, in-process (bench/sim_sparse_sync.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
