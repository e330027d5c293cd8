"""Where does a swarm's CPU go? Process CPU seconds per step of every member of ``launch``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_runtime_cpu.py [--stages 1,2] [--steps 8]
        [--micro-batches 4,16] [--calls] [--threads] [--profile DIR] [--chunk-mb MB] [--spot-check F]
        [--models tiny,d128xL32] [--workers-per-stage 1,2] [--from-step 2] [--recompute]
        [--micro-batch-size B] [--seq-len T] [--insecure] [--compression SPEC]

Runs bench_runtime's RUN (tiny, B=4 T=64, M=4 unless given) as ``launch`` S=W for each S
given, reads every member's user+system CPU time from /proc when the first step is committed
and again when the last one is, and prints CPU ms per step and per micro-batch task for each
role, beside the local trainer's CPU time per step (one thread) of the same run. CPU time,
unlike wall time, does not depend much on what else runs on a shared box.

"Per task" divides a step's whole CPU by its tasks, so at a small M it is mostly per-step
work (the ordered sum, AdamW, serialising the weights, pulls and pushes). With two values of
``--micro-batches`` the bench also prints what each further task costs (the difference in
CPU over the difference in tasks; the workers' beyond the local trainer's own difference)
and the per-step rest. ``--spot-check 0`` leaves the servers' recomputation of drawn pushes
(compute, not framework) out of the measured steps: with the default rate a new worker's
first pushes are all recomputed, which in an 8-step run is most of them. The servers' other
recomputations (a worker's first push, pushes the screen flags: an early run's gradient norms
fall fast, so many are flagged as small) are left out too (``SHOAL_BENCH_RECOMPUTE=0``) unless
``--recompute`` is given.

With several ``--models`` (presets or ``dWIDTHxLLAYERS``, as bench_server_memory makes them)
or ``--workers-per-stage`` values it also fits the servers' CPU per step to what their exact
sync handles (each push in, each pull out, the optimizer step and the new version once a step),
by least squares over the runs: the basis of ``FrameworkCpu.server_step_param_s``,
``server_push_param_s`` and ``server_pull_param_s``.

With ``--profile DIR`` every member runs under cProfile (``SHOAL_PROFILE``, each thread's
CPU time, all threads merged) and dumps ``DIR/S<S>/COMMAND-PID-1.prof`` at the first mark
and ``...-2.prof`` at the last (read with ``python -m pstats``; ``bench/prof_diff.py`` prints
what each function took between them); profiling roughly doubles the main threads' CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHOAL_TORCH_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import RUN  # noqa: E402
from bench_server_memory import sized_model  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
TLS = [True]  # the swarm's members talk mutual TLS, as shoal launch's (--insecure: plain text)


def _stat(path: str) -> tuple[str, float]:
    """(command name, user + system CPU seconds) from a /proc stat file; ("", 0) once gone."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return "", 0.0
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return name, (int(fields[11]) + int(fields[12])) / TICK


def cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``: its main thread (the asyncio loop: RPC handling) and
    its other threads ("pool": compute, serialisation and checks in executor threads, and
    gRPC's own threads)."""
    out = {"main": 0.0, "pool": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        out["main" if tid == str(pid) else "pool"] += _stat(f"/proc/{pid}/task/{tid}/stat")[1]
    return out


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of process ``pid`` by thread name (same names summed; the
    main thread is "main")."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        name, used = _stat(f"/proc/{pid}/task/{tid}/stat")
        key = "main" if tid == str(pid) else name
        out[key] = out.get(key, 0.0) + used
    return out


def local_cpu(steps: int, run: dict) -> float:
    """The local trainer's CPU seconds per step (one torch thread): a run of ``steps`` minus a
    run of one step (model build, data and warm-up counted out), over ``steps - 1``."""
    from shoal.train.local import TrainConfig, train_local

    used = []
    for n in (1, 1, steps):  # the first run pays the imports
        with tempfile.TemporaryDirectory(prefix="shoal-cpu-") as tmp:
            t0 = time.process_time()
            local = {k: v for k, v in run.items() if k != "compression"}  # (the trainer sends nothing)
            train_local(TrainConfig(**local, steps=n, out=str(Path(tmp) / "r"), eval_every=0, eval_batches=1),
                        quiet=True)
            used.append(time.process_time() - t0)
    return (used[2] - used[1]) / (steps - 1)


def swarm_cpu(stages: int, steps: int, profile: str | None, chunk_mb: float | None = None,
              spot_check: float | None = None, session: bool = True,
              run: dict = RUN, per_stage: int = 1,
              from_step: int = 0) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """CPU seconds per step of each role (coordinator, servers, workers; main thread and
    others), steps ``from_step + 1``..last, the same by role and thread name, and the run's
    push and pull bytes a step (``grad_push``, ``weight_pull``: its byte counters over all steps)."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    with tempfile.TemporaryDirectory(prefix="shoal-cpu-") as tmp:
        env_prof = None
        if profile:
            env_prof = str(Path(profile) / f"S{stages}")
            os.environ["SHOAL_PROFILE"] = env_prof
        try:
            cfg = LaunchConfig(out=str(Path(tmp) / "run"), stages=stages, workers=stages * per_stage, steps=steps,
                               timeout_s=600, chunk_mb=chunk_mb, session=session, tls=TLS[0],
                               **({} if spot_check is None else {"spot_check": spot_check}), **run)
            marks: dict[int, dict[str, float]] = {}
            threads: dict[int, dict[str, float]] = {}
            swarm_ref: list = []

            def members():
                s = swarm_ref[0]
                out = {"coordinator": [s.coord.pid]} if s.coord else {}
                out["servers"] = [p.pid for p in s.servers]
                out["workers"] = [p.pid for p in s.workers if p]
                return out

            def on_event(rec):
                if rec.get("event") != "step" or not swarm_ref:
                    return
                if rec["step"] in (from_step, steps - 1):
                    ms = members()
                    marks[rec["step"]] = {f"{k}/{kind}": sum(cpu_s(p)[kind] for p in v)
                                          for k, v in ms.items() for kind in ("main", "pool")}
                    threads[rec["step"]] = {}
                    for k, v in ms.items():
                        for p in v:
                            for name, used in thread_cpu_s(p).items():
                                key = f"{k}/{name}"
                                threads[rec["step"]][key] = threads[rec["step"]].get(key, 0.0) + used
                    if profile:  # a dump at each mark: their difference is the measured steps
                        for pids in ms.values():
                            for p in pids:
                                os.kill(p, signal.SIGUSR1)
                        time.sleep(1.0)

            with Swarm(cfg, on_event) as swarm:
                swarm_ref.append(swarm)
                swarm.start()
                swarm.wait()
            counted = json.loads((Path(tmp) / "run" / "summary.json").read_text())["bytes"]
            sync = {k: counted.get(k, {}).get("wire", 0) / steps for k in ("grad_push", "weight_pull")}
        finally:
            if env_prof:
                os.environ.pop("SHOAL_PROFILE", None)
    a, b = marks[from_step], marks[steps - 1]
    ta, tb = threads[from_step], threads[steps - 1]
    n = steps - 1 - from_step
    per_thread = {k: (tb[k] - ta.get(k, 0.0)) / n for k in tb}
    return {k: (b[k] - a[k]) / n for k in a}, per_thread, sync


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--chunk-mb", type=float, default=None, help="the swarm's --chunk-mb (default: the run default)")
    ap.add_argument("--spot-check", type=float, default=None,
                    help="the swarm's --spot-check (default: the run default; each drawn push is recomputed on its "
                         "server, a random number of times per run)")
    ap.add_argument("--calls", action="store_true",
                    help="also run each S with a call per lease, result and renewal (--no-session)")
    ap.add_argument("--threads", action="store_true",
                    help="also print each role's CPU by thread name (main thread, executor threads, gRPC's)")
    ap.add_argument("--micro-batches", default=str(RUN["micro_batches"]),
                    help="M of the run, or two values (4,16): then also the CPU each further task adds "
                         "(the difference over the difference in tasks), apart from the per-step part")
    ap.add_argument("--models", default="tiny",
                    help="presets or dWIDTHxLLAYERS (tiny's vocabulary, that width and depth); with several, "
                         "the servers' CPU per step against a stage's parameters")
    ap.add_argument("--workers-per-stage", default="1",
                    help="workers a stage (W = S x this), or several values (1,2): each model runs with each")
    ap.add_argument("--from-step", type=int, default=0,
                    help="measure from this step's commit on (2: after the workers' first pushes)")
    ap.add_argument("--micro-batch-size", type=int, default=RUN["micro_batch_size"],
                    help="B of the run (with --seq-len and the width: the size of each activation a task carries)")
    ap.add_argument("--seq-len", type=int, default=RUN["seq_len"], help="T of the run")
    ap.add_argument("--insecure", action="store_true",
                    help="plain text between the members (default: mutual TLS, as shoal launch): what TLS costs")
    ap.add_argument("--recompute", action="store_true",
                    help="let the servers recompute pushes (first, flagged): compute, not protocol, so off by default")
    ap.add_argument("--compression", default=None, metavar="SPEC",
                    help="the swarm's --compression (e.g. act=quad-pc,grad=tern-dither: what the activation "
                         "codecs cost at each end; default: none)")
    args = ap.parse_args()
    RUN.update(micro_batch_size=args.micro_batch_size, seq_len=args.seq_len)
    if args.compression:
        RUN["compression"] = args.compression
    TLS[0] = not args.insecure
    if not args.recompute:
        from shoal.runtime.safety.guard import RECOMPUTE_ENV

        os.environ[RECOMPUTE_ENV] = "0"  # the members started by launch inherit it
    ms = [int(x) for x in args.micro_batches.split(",")]
    pers = [int(x) for x in args.workers_per_stage.split(",")]
    print(f"CPU time per step ({args.models}, M={args.micro_batches} B={RUN['micro_batch_size']} T={RUN['seq_len']}, "
          f"{args.steps} steps, measured after step {args.from_step}, {args.workers_per_stage} worker(s) a stage)\n")
    print("(each role: main thread / other threads, ms per step, summed over its members)\n")
    print("| run | coordinator | servers | workers | total | beyond local, per task | vs local |")
    print("|---|---|---|---|---|---|---|")
    by_model: list[tuple] = []  # (model, S, W a stage, params a stage, servers' CPU s a step, push B, pull B a step)
    with tempfile.TemporaryDirectory(prefix="shoal-cpu-models-") as tmp:  # the dWIDTHxLLAYERS folders
        bases = {}
        for spec in args.models.split(","):
            model = sized_model(spec, Path(tmp))
            bases[spec] = ({**RUN, "init_from": str(Path(model).resolve())} if Path(model).is_dir()
                           else {**RUN, "model": model})
            for per in pers:
                _one_model(args, ms, per, spec, bases[spec], by_model)
        if len(by_model) > 2:
            # the update timed on the last (largest) model's stage
            sync_fit(by_model, ms[0], step_cpu_per_param(bases[by_model[-1][0]], by_model[-1][1]))


def step_cpu_per_param(run: dict, stages: int, repeat: int = 3) -> float:
    """CPU seconds per parameter of what a stage server does once an exact step, timed here on
    one thread with the runtime's own functions: each gradient's squared norm (the clipping),
    the scaled AdamW step (``apply_update``) and the new version serialised
    (``serialise_weights``), on the mean stage of ``run``'s model (least of ``repeat``)."""
    import torch

    from shoal.hf.convert import read_hf_model_config
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_model
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.transport.frames import serialise_weights
    from shoal.train.optim import OptimConfig, apply_update, make_optimizer, param_sq_norms

    torch.set_num_threads(1)
    cfg = read_hf_model_config(run["init_from"]) if run.get("init_from") else get_preset(run["model"])
    model = build_model(cfg)
    params = list(model.named_parameters())[: max(1, len(list(model.parameters())) // stages)]
    n = sum(p.numel() for _, p in params)
    opt = make_optimizer(params, OptimConfig())
    best = float("inf")
    for _ in range(repeat + 1):
        for _, p in params:
            p.grad = torch.randn_like(p)
        t0 = time.process_time()
        param_sq_norms([p for _, p in params])
        apply_update(opt, 1e-4, 0.5)
        serialise_weights(pb.WeightsReply(), {k: p for k, p in params})
        best = min(best, time.process_time() - t0)
    return best / n


def sync_fit(rows: list[tuple], m: int, step_s: float) -> None:
    """The servers' CPU a step against what their exact sync handles: least squares of a
    server's CPU a step - ``step_s`` x its stage's parameters (once a step, timed apart:
    :func:`step_cpu_per_param`) = fixed + b x parameters pushed to it (each push received,
    decoded, checked, measured, summed) + c x parameters pulled from it (each pull sent)."""
    import numpy as np

    print("\nServers' CPU per step against what their exact sync handles "
          f"(M={m}; pushes and pulls from the byte counters, fp32):\n")
    print("| model | S | workers a stage | parameters a stage | pushes a stage a step | pulls a stage a step "
          "| CPU a server a step |")
    print("|---|---|---|---|---|---|---|")
    xs, ys = [], []
    for spec, s, per, params, srv, push_b, pull_b in rows:
        pushes, pulls = push_b / 4 / s / params, pull_b / 4 / s / params  # full-stage equivalents
        print(f"| {spec} | {s} | {per} | {params / 1e6:.2f} M | {pushes:.2f} | {pulls:.2f} | {srv / s * 1e3:.0f} ms |")
        xs.append([1.0, pushes * params, pulls * params])
        ys.append(srv / s - step_s * params)
    coef, *_ = np.linalg.lstsq(np.array(xs), np.array(ys), rcond=None)
    fit = np.array(xs) @ coef + np.array([step_s * r[3] for r in rows])
    worst = max(abs(f / (r[4] / r[1]) - 1) for f, r in zip(fit, rows, strict=True))
    print(f"\n- once a step, timed apart (clipping norms, AdamW, the version serialised): {step_s * 1e9:.1f} ns a "
          "parameter")
    print(f"- least squares over {len(ys)} runs: a server's CPU a step = {coef[0] * 1e3:.0f} ms "
          f"+ {step_s * 1e9:.1f} ns x its stage's parameters + {coef[1] * 1e9:.1f} ns x each parameter pushed "
          f"+ {coef[2] * 1e9:.1f} ns x each parameter pulled (worst run off by {worst * 100:.0f} %)")


def stage_params(run: dict, stages: int) -> float:
    """Parameters of a mean stage of ``run``'s model (all of them over ``stages``)."""
    from shoal.hf.convert import read_hf_model_config
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_model

    cfg = read_hf_model_config(run["init_from"]) if run.get("init_from") else get_preset(run["model"])
    return sum(p.numel() for p in build_model(cfg).parameters()) / stages


def _one_model(args, ms: list[int], per: int, spec: str, base: dict, by_model: list) -> None:
    """The CPU table's rows of one model (every M and S asked for)."""
    seen: dict[tuple, tuple[int, float, float, float]] = {}
    for m in ms:
        run = {**base, "micro_batches": m}
        loc = local_cpu(args.steps, run)
        print(f"| train --local T=1, M={m} | | | | {loc * 1e3:.0f} ms | | 1.00x |")
        for s in (int(x) for x in args.stages.split(",")):
            for session in (True, False) if args.calls else (True,):
                c, per_thread, sync = swarm_cpu(s, args.steps, args.profile, args.chunk_mb, args.spot_check,
                                                session, run, per, args.from_step)
                tot = sum(c.values())

                def role(r, c=c):
                    return " / ".join(f"{c.get(f'{r}/{k}', 0) * 1e3:.0f}" for k in ("main", "pool"))

                tag = "" if session else ", calls"
                print(f"| {spec} launch S={s} W={s * per} M={m}{tag} | {role('coordinator')} | {role('servers')} | "
                      f"{role('workers')} | {tot * 1e3:.0f} ms | {(tot - loc) / m * 1e3:.1f} ms | {tot / loc:.2f}x |",
                      flush=True)
                # Tasks per step: M on the last stage, 2M (forward and backward) on each other one.
                tasks = m * (2 * s - 1)
                srv = c.get("servers/main", 0) + c.get("servers/pool", 0)
                if session and m == ms[0]:
                    by_model.append((spec, s, per, stage_params(run, s), srv, sync["grad_push"], sync["weight_pull"]))
                wrk = c.get("workers/main", 0) + c.get("workers/pool", 0)
                print(f"|   per task ({tasks} a step) | | {srv / tasks * 1e3:.2f} ms | "
                      f"{max(0.0, wrk - loc) / tasks * 1e3:.2f} ms beyond compute | | | |", flush=True)
                if args.threads:
                    busy = sorted(((v, k) for k, v in per_thread.items() if v >= 0.0005), reverse=True)
                    print("|   by thread (ms a step) | " + ", ".join(f"{k} {v * 1e3:.1f}" for v, k in busy)
                          + " | | | | | |", flush=True)
                key = (s, session)
                if key in seen:
                    t0, srv0, wrk0, loc0 = seen[key]
                    dt = tasks - t0
                    if dt > 0:
                        # Each further task's CPU: the server's all framework; the workers' beyond the
                        # local trainer's own increase (the compute of the extra micro-batches).
                        d_srv = (srv - srv0) / dt
                        d_wrk = ((wrk - wrk0) - (loc - loc0)) / dt
                        print(f"|   each further task, S={s}{tag} | | {d_srv * 1e3:.2f} ms | "
                              f"{d_wrk * 1e3:.2f} ms beyond compute | | | |", flush=True)
                        print(f"|   per step apart from tasks, S={s}{tag} | | {(srv - d_srv * tasks) * 1e3:.0f} ms | "
                              f"{(wrk - loc - d_wrk * tasks) * 1e3:.0f} ms beyond compute | | | |", flush=True)
                seen[key] = (tasks, srv, wrk, loc)


if __name__ == "__main__":
    main()
