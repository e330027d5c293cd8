"""Runtime benchmark: framework overhead, stage-server throughput, swarm vs local tokens/s.

    .venv/bin/python bench/bench_runtime.py [--steps 6] [--out /tmp/bench_runtime]
        [--seq-len T] [--micro-batch-size B] [--skip-relay]

``--seq-len`` / ``--micro-batch-size`` make each task longer with the same calls per task
(how the framework's fixed cost per call amortises); the issue-11 target uses the defaults.

Prints one table; every number is a ratio or rate measured in this one run on this
machine (loopback, one torch thread per process), so compare rows, not machines.

1. *Per-task overhead*: ``shoal launch`` with 1 stage and 1 worker runs exactly the local
   trainer's compute (one forward+backward task per micro-batch), so
   ``(runtime step time - local step time) / M`` is the framework's time per task beyond
   compute (lease, weight pull, result, gradient push, step commit), on loopback.
2. *Stage-server throughput*: a client process keeps 8 relays in flight to a real stage
   server (activation frames of the given shape are decoded, validated and stored), and
   pulls the stage's weights repeatedly: messages/s and MB/s.
3. *Swarm tokens/s*: ``shoal launch`` with S = 2, 3, 4 stages (one worker per stage)
   against ``shoal train --local`` on the same model and batch, at equal compute-thread
   budgets: a swarm of W one-thread workers is compared with the local trainer given W
   torch threads (the setup of each row is printed).

Step times are the *mean* over all steps after the first (warm-up: weights pulled, graphs
built), with the median beside it; tokens/s is tokens over the summed time of those steps,
so a slow step counts in full.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")

RUN = dict(model="tiny", micro_batches=4, micro_batch_size=4, seq_len=64, seed=0, warmup=2)


def _steady(recs: list[dict]) -> tuple[float, float, float]:
    """(mean step time, median step time, tokens/s) over every step after the first."""
    rest = [r for r in recs if r["step"] >= 1] or recs
    times = [r["step_time_s"] for r in rest]
    return statistics.fmean(times), statistics.median(times), sum(r["tokens"] for r in rest) / sum(times)


def local_run(out: Path, steps: int, threads: int = 1) -> tuple[float, float, float]:
    """The local trainer with ``threads`` torch threads (the swarm's compute-thread budget)."""
    from shoal.train.local import TrainConfig, train_local

    old = os.environ.get("SHOAL_TORCH_THREADS")
    os.environ["SHOAL_TORCH_THREADS"] = str(threads)
    try:
        res = train_local(TrainConfig(**RUN, steps=steps, out=str(out), eval_every=0, eval_batches=1),
                          quiet=True)
    finally:
        os.environ["SHOAL_TORCH_THREADS"] = old or "1"
        import torch

        torch.set_num_threads(1)
    return _steady(res.records)


def swarm_run(out: Path, steps: int, stages: int, workers: int,
              session: bool = True, spot_check: float | None = None) -> tuple[tuple[float, float, float], list]:
    """The swarm's (mean step, median step, tokens/s) and the layer split its planner chose."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    launch(LaunchConfig(out=str(out), stages=stages, workers=workers, steps=steps, timeout_s=600,
                        session=session, **({} if spot_check is None else {"spot_check": spot_check}), **RUN))
    layers = [e["layers"] for e in read_jsonl(out / "events.jsonl") if e.get("event") == "replan"][-1]
    return _steady(read_jsonl(out / "metrics.jsonl")), layers


def pipeline_schedule(fwd: list[float], bwd: list[float], m: int) -> float:
    """Makespan of one step of an S-stage pipeline with one worker per stage and free transfers.

    ``fwd[s]``/``bwd[s]``: seconds of one micro-batch's forward / backward task at stage s
    (the last stage's single forward+backward task is ``bwd[-1]``, its ``fwd[-1]`` unused).
    Each worker takes its stage's tasks as their inputs arrive, forwards first (the stage
    servers' ``pick_order``), so this is the step the runtime's own schedule gives when every
    call, relay and sync costs nothing.
    """
    n = len(bwd)
    f_done: list[list[float | None]] = [[None] * m for _ in range(n)]  # None: not scheduled yet
    b_done: list[list[float | None]] = [[None] * m for _ in range(n)]
    free = [0.0] * n
    fwd_next, bwd_next = [0] * n, [0] * n
    left = sum(m * (2 if s < n - 1 else 1) for s in range(n))
    while left:
        best = None  # (start time, not-a-forward, stage): the task that can start first
        for s in range(n):
            last = s == n - 1
            if not last and fwd_next[s] < m:
                ready = f_done[s - 1][fwd_next[s]] if s else 0.0
                if ready is not None:
                    best = min(best or (math.inf,), (max(free[s], ready), 0, s))
            if bwd_next[s] < m:
                mb = bwd_next[s]
                ready = (f_done[s - 1][mb] if s else 0.0) if last else b_done[s + 1][mb]
                if ready is not None and (last or f_done[s][mb] is not None):
                    best = min(best or (math.inf,), (max(free[s], ready), 1, s))
        start, is_bwd, s = best
        if not is_bwd:
            free[s] = f_done[s][fwd_next[s]] = start + fwd[s]
            fwd_next[s] += 1
        else:
            free[s] = b_done[s][bwd_next[s]] = start + bwd[s]
            if s == n - 1:
                f_done[s][bwd_next[s]] = free[s]
            bwd_next[s] += 1
        left -= 1
    return max(free)


def pipeline_bound(layers: list, reps: int = 20) -> tuple[float, list[tuple[float, float, float]]]:
    """The swarm's step with no framework cost at all, timed here: (seconds, per-stage costs).

    Each stage of ``layers`` is built and its tasks are timed on one torch thread, as a
    worker runs them (a forward that keeps its graph, the backward from that graph, the last
    stage's forward+backward with the loss), medians of ``reps`` runs; the step is
    :func:`pipeline_schedule`'s makespan plus the slowest stage's AdamW step (the stage
    servers update in parallel). Anything the real swarm adds, calls, relays, gradient
    pushes, weight pulls, coordination, comes on top: the swarm cannot beat this.
    """
    import torch

    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.train.optim import OptimConfig, make_optimizer
    from shoal.train.precision import backward_loss

    cfg = get_preset(RUN["model"])
    m, b, t = RUN["micro_batches"], RUN["micro_batch_size"], RUN["seq_len"]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=gen)
    stages = [build_stage(cfg, a, z) for a, z in layers]

    def med(fn, setup=None) -> float:
        times = []
        for i in range(reps + 3):
            arg = setup() if setup else None
            t0 = time.perf_counter()
            fn(arg)
            if i >= 3:  # warm-up runs are not counted
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    costs, x = [], tokens
    for s, mod in enumerate(stages):
        last = s == len(stages) - 1
        inp = x if s == 0 else x.detach()

        def graph(mod=mod, inp=inp, s=s):
            xi = inp if s == 0 else inp.clone().requires_grad_(True)
            return mod(xi)

        if last:
            f = 0.0
            bw = med(lambda _, mod=mod, inp=inp, s=s: backward_loss(
                mod(inp if s == 0 else inp.clone().requires_grad_(True), targets), m, 1.0))
        else:
            f = med(lambda _, graph=graph: graph())
            out = graph().detach()
            grad_out = torch.randn(out.shape, generator=gen)
            bw = med(lambda o, g=grad_out: o.backward(g), setup=graph)
            x = out
        opt = make_optimizer(mod.named_parameters(), OptimConfig())
        for p in mod.parameters():
            p.grad = torch.zeros_like(p)
        step = med(lambda _, opt=opt: opt.step())
        costs.append((f, bw, step))
    span = pipeline_schedule([c[0] for c in costs], [c[1] for c in costs], m)
    return span + max(c[2] for c in costs), costs


BENCH_SECRET = b"bench-run-secret"  # signing secret of the credentials the benchmark uses


def _server_proc(q, token: str, ckpt: str, shape: tuple[int, int, int]) -> None:
    from shoal.net import shoal_pb2 as pb
    from shoal.net.auth import run_public_key
    from shoal.runtime.common import set_threads
    from shoal.runtime.roles.server import StageServer

    set_threads()

    async def main():
        srv = StageServer("unused:0", "127.0.0.1:0", token, ckpt, name="bench")
        srv.spec = pb.RunSpec(model="tiny", stages=2, steps=10**6, micro_batches=64,
                              micro_batch_size=shape[0], seq_len=shape[1], seed=0, lr=1e-3,
                              min_lr=1e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                              dead_after_s=60, min_lease_s=5, data="synthetic", ordered_grads=True,
                              run_id="bench")
        srv.channels.identity.run_key = run_public_key(BENCH_SECRET)  # as if it had joined a run
        server = await srv.start_rpc()
        srv.stage, srv.first, srv.last, srv.epoch = 1, 3, 6, 0
        await srv._load(1, 3, 6, 0, 0)
        srv.ready = True
        q.put(srv.address)
        await asyncio.sleep(3600)
        await server.stop(0)

    asyncio.run(main())


async def _blast(address: str, token: str, shape, seconds: float) -> tuple[float, float, float]:
    import torch

    from shoal.net import shoal_pb2 as pb
    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.net.auth import Identity
    from shoal.net.channel import open_channel
    from shoal.net.wire import encode_tensor

    # The blaster relays as a stage server of the run would (plain text on loopback).
    ch = open_channel(address, token, identity=Identity.joined(token, BENCH_SECRET, "s-bench", "server"))
    stub = pbg.StageServerStub(ch)
    frame = encode_tensor("act", torch.randn(*shape))
    n, mb = 0, 0
    stop = time.perf_counter() + seconds

    async def one_lane(lane: int):
        nonlocal n
        i = lane
        while time.perf_counter() < stop:
            # every relay is decoded and checked; the first of each micro-batch id is stored
            rep = await stub.SubmitRelay(pb.Relay(step=0, mb=i % 64, epoch=0, direction=pb.FWD,
                                                  tensor=frame))
            assert rep.accepted, rep.reason
            n += 1
            i += 8

    t0 = time.perf_counter()
    await asyncio.gather(*(one_lane(k) for k in range(8)))
    dt = time.perf_counter() - t0
    msgs = n / dt
    mbps = msgs * len(frame.data) / 1e6
    # weight pulls: big messages, pulled as a worker of the run would
    wch = open_channel(address, token, identity=Identity.joined(token, BENCH_SECRET, "w-bench", "worker"))
    wstub = pbg.StageServerStub(wch)
    t0, pulled, k = time.perf_counter(), 0, 0
    while time.perf_counter() - t0 < seconds / 2:
        rep = await wstub.GetWeights(pb.WeightsRequest(worker="w-bench"))
        pulled += sum(len(f.data) for f in rep.params)
        k += 1
    pull_mbps = pulled / (time.perf_counter() - t0) / 1e6
    await ch.close()
    await wch.close()
    _ = mb
    return msgs, mbps, pull_mbps


def server_throughput(shape, seconds: float) -> tuple[float, float, float]:
    token = "bench-token"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as ckpt:
        p = ctx.Process(target=_server_proc, args=(q, token, ckpt, shape), daemon=True)
        p.start()
        try:
            address = q.get(timeout=120)
            return asyncio.run(_blast(address, token, shape, seconds))
        finally:
            p.kill()
            p.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per training run")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each throughput test")
    ap.add_argument("--stages", default="1,2,3,4", help="swarm sizes S (= W) to run, comma-separated")
    ap.add_argument("--repeat", type=int, default=1, help="run the local T=S and swarm S=W pairs this many times")
    ap.add_argument("--seq-len", type=int, default=RUN["seq_len"],
                    help="tokens per sequence (larger: longer tasks, the same number of calls per task)")
    ap.add_argument("--micro-batch-size", type=int, default=RUN["micro_batch_size"], help="sequences per micro-batch")
    ap.add_argument("--skip-relay", action="store_true", help="skip the stage-server relay and pull throughput tests")
    ap.add_argument("--spot-check", type=float, default=None,
                    help="the launches' --spot-check (default: launch's; 0: no push drawn for a recomputation)")
    ap.add_argument("--calls", action="store_true",
                    help="also run each swarm with a call per lease, result and renewal (--no-session)")
    args = ap.parse_args(argv)
    RUN.update(seq_len=args.seq_len, micro_batch_size=args.micro_batch_size)
    import torch

    torch.set_num_threads(1)
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_runtime_"))
    rows = []

    def row(name: str, setup: str, r: tuple[float, float, float], local_tok: float) -> None:
        rows.append((name, setup, f"{r[0] * 1000:.0f} ms", f"{r[1] * 1000:.0f} ms", f"{r[2]:.0f}",
                     f"{r[2] / local_tok:.2f}x"))
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)  # progress: a long run keeps what it measured

    sizes = [int(x) for x in args.stages.split(",") if x]
    per_task = None
    for rep in range(args.repeat):
        tag = f" (#{rep + 1})" if args.repeat > 1 else ""
        for n in sizes:
            # Each swarm right after its local reference: load changes on a shared box hit both.
            local = local_run(root / f"local{n}-{rep}", args.steps, n)
            row(f"train --local T={n}{tag}", f"1 process, {n} torch threads", local, local[2])
            swarm, layers = swarm_run(root / f"s{n}-{rep}", args.steps, n, n, spot_check=args.spot_check)
            row(f"launch S={n} W={n}{tag}", f"{n} workers x 1 thread (+{n} servers, coordinator); vs local T={n}",
                swarm, local[2])
            if args.calls:
                calls, _ = swarm_run(root / f"s{n}-{rep}-calls", args.steps, n, n, session=False,
                                     spot_check=args.spot_check)
                row(f"launch S={n} W={n}, calls{tag}", "the same with a call per lease, result and renewal "
                    f"(--no-session); vs local T={n}", calls, local[2])
            bound, _ = pipeline_bound(layers)
            tokens = RUN["micro_batches"] * RUN["micro_batch_size"] * RUN["seq_len"]
            row(f"zero-overhead bound S={n}{tag}", f"the swarm's tasks on layers {layers}, timed here, scheduled "
                f"with free calls and syncs; vs local T={n}", (bound, bound, tokens / bound), local[2])
            if n == 1 and per_task is None:
                per_task = (swarm[0] - local[0]) / RUN["micro_batches"]
    small = (RUN["micro_batch_size"], RUN["seq_len"], 128)
    big = (8, 256, 128)
    if not args.skip_relay:
        m_small, mb_small, pull = server_throughput(small, args.seconds)
        m_big, mb_big, _ = server_throughput(big, args.seconds)

    print(f"\nruntime benchmark (tiny model, M={RUN['micro_batches']} B={RUN['micro_batch_size']} "
          f"T={RUN['seq_len']}, {args.steps} steps, loopback, {os.cpu_count()} cores)\n")
    print("| run | setup | mean step | median step | tokens/s | vs local, same threads |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if per_task is not None:
        print(f"\nper-task framework overhead (S=1 W=1 vs local T=1, mean step, per micro-batch): "
              f"{per_task * 1000:.1f} ms")
    if not args.skip_relay:
        print(f"stage server relay, {small} fp32 ({small[0] * small[1] * small[2] * 4 / 1e3:.0f} kB): "
              f"{m_small:.0f} msg/s, {mb_small:.1f} MB/s")
        print(f"stage server relay, {big} fp32 ({big[0] * big[1] * big[2] * 4 / 1e6:.2f} MB): "
              f"{m_big:.0f} msg/s, {mb_big:.1f} MB/s")
        print(f"stage server weight pull (stage [3,6) of tiny): {pull:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
