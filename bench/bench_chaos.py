"""Chaos run: a local swarm under random kills, link flaps and one poisoned worker.

3 stages, 6+ workers (the last one poisoned: it pushes its gradients times -20, and one
other reaches the servers through a flapping link). Every ``--kill-every`` committed
steps a random honest worker is killed with SIGKILL and restarted; every
``--server-kill-every`` steps the server of a random stage is killed and replaced (it
restores the stage's newest checkpoint and the run rolls back); every ``--coordinator-kill-every`` steps the
coordinator is killed and restarted with ``--resume`` on the same address. At the end the final
weights are compared with ``train_local`` of the same workload (exact fp32: they must be
equal once the poisoned worker's pushes are kept out).

Prints: kills survived, steps redone (roll-backs), tasks re-queued, time lost per kill
(the commit gap around each kill minus the median step time), bans, and the largest
weight difference to the failure-free run.

    python bench/bench_chaos.py --steps 100 --workers 7
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shoal.runtime.processes.launch import LaunchConfig, Swarm
from shoal.runtime.roles.artifacts import load_final_weights
from shoal.train.local import TrainConfig, train_local
from shoal.train.metrics import read_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--workers", type=int, default=7, help="workers, the last one poisoned")
    ap.add_argument("--kill-every", type=int, default=5, help="kill a random honest worker every N steps")
    ap.add_argument("--server-kill-every", type=int, default=25, help="kill a random stage's server every N steps (0: never)")
    ap.add_argument("--coordinator-kill-every", type=int, default=40,
                    help="kill the coordinator every N steps; launch restarts it with --resume (0: never)")
    ap.add_argument("--standbys", type=int, default=3, help="hot standby servers (one per stage up to N)")
    ap.add_argument("--flap-for", type=float, default=60.0, help="seconds the flapping worker's links flap")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    ap.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--reference", default=None,
                    help="file of the failure-free run's final weights and loss: read if it exists, else "
                         "computed with train_local and written there (same workload flags only)")
    args = ap.parse_args()
    # The bundled corpus (the default data of shoal launch and train_local alike).
    run = dict(model="tiny", steps=args.steps, micro_batches=6, micro_batch_size=2, seq_len=32, seed=3, lr=3e-3,
               warmup=2)
    out = Path(args.out or tempfile.mkdtemp(prefix="shoal-chaos-")) / "run"
    poisoned, flapping = f"w{args.workers - 1}", f"w{args.workers - 2}"
    cfg = LaunchConfig(**run, out=str(out), stages=args.stages, workers=args.workers, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=args.timeout, standbys=args.standbys,
                       faults=[f"poison:{poisoned}:scale=-20",
                               f"flap:{flapping}:period=0.6:down=0.1:for={args.flap_for}"])
    rng = random.Random(args.seed)
    kills: list[tuple[float, str]] = []  # (run clock time, target)
    t_start = time.time()
    with Swarm(cfg) as sw:
        sw.start()
        next_kill, next_server_kill = args.kill_every, args.server_kill_every or args.steps + 1
        next_coord_kill = args.coordinator_kill_every or args.steps + 1
        deadline = time.time() + args.timeout
        while sw.coord.poll() is None or sw._should_restart():
            if sw.coord.poll() is not None:
                sw.restart_coordinator()  # what Swarm.wait() does for a dead coordinator
                continue
            if time.time() > deadline:
                raise SystemExit(f"the chaos run did not finish within {args.timeout:.0f} s; see {out / 'logs'}")
            sw.poll_records()
            sw.fault_tick()
            done = sw.committed_steps()
            now = time.time() - (sw.run_t0 or sw.t0)
            if done >= next_kill and done < args.steps - 1:
                next_kill += args.kill_every
                # Honest workers only (the poisoned one is banned; the flapping one keeps its proxy).
                live = [i for i, p in enumerate(sw.workers) if p is not None and p.poll() is None
                        and f"w{i}" not in (poisoned, flapping)]
                if live:
                    i = rng.choice(live)
                    sw.kill_worker(i)
                    kills.append((now, f"w{i}"))
                    sw.start_worker(i)
            if done >= next_server_kill and done < args.steps - 1:
                next_server_kill += args.server_kill_every
                stage = rng.randrange(args.stages)
                i = sw._stage_server_index(stage)
                if i is not None and sw.servers[i].poll() is None:
                    sw.kill_server(i)
                    kills.append((now, f"s{i} (stage {stage})"))
                    sw.start_server()
            if done >= next_coord_kill and done < args.steps - 1:
                next_coord_kill += args.coordinator_kill_every
                sw.kill_coordinator()
                kills.append((now, "coordinator"))
            time.sleep(0.1)
        summary = sw.wait()
    wall = time.time() - t_start
    events = read_jsonl(out / "events.jsonl")
    recs = sorted(read_jsonl(out / "metrics.jsonl"), key=lambda r: r["time_s"])
    # Time lost per kill: the gap between the commits around it, minus a normal step.
    times = [r["time_s"] for r in recs]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    normal = statistics.median(gaps) if gaps else 0.0
    lost = []
    for t, _ in kills:
        after = next((x for x in times if x > t), None)
        before = max((x for x in times if x <= t), default=0.0)
        if after is not None:
            lost.append(max(after - before - normal, 0.0))
    rollbacks = [e for e in events if e["event"] == "rollback"]
    redone = sum(max(e["committed"] - e["version"], 0) for e in rollbacks)
    per_kill = kill_rollbacks(events)
    bans = [e for e in events if e["event"] == "ban"]
    ref_w, ref_loss = reference(run, out.parent / "local", args.reference)
    weights = load_final_weights(out)
    diff = max(float((weights[k].float() - ref_w[k].float()).abs().max()) for k in ref_w)
    equal = all(torch.equal(weights[k], ref_w[k]) for k in ref_w)
    print(f"chaos run: {args.steps} steps, {args.stages} stages, {args.standbys} standbys, {args.workers} workers "
          f"({poisoned} poisoned x -20, {flapping} on a flapping link for {args.flap_for:.0f} s), seed {args.seed}")
    print(f"{'committed steps':<34} {summary['steps']}")
    print(f"{'wall time':<34} {wall:.0f} s (median step {normal:.2f} s)")
    print(f"{'kills survived':<34} {len(kills)} ({sum(k[1].startswith('w') for k in kills)} workers, "
          f"{sum(k[1].startswith('s') for k in kills)} servers, "
          f"{sum(k[1] == 'coordinator' for k in kills)} coordinators)")
    print(f"{'steps redone (roll-backs)':<34} {redone} in {len(rollbacks)} roll-backs")
    print(f"{'tasks re-queued':<34} {summary['requeues']}")
    print(f"{'time lost per kill':<34} median {statistics.median(lost) if lost else 0:.2f} s, "
          f"max {max(lost) if lost else 0:.2f} s")
    banned = ", ".join(f"{b['device']} at step {b['step']}" for b in bans) or "none"
    print(f"{'bans':<34} {banned}")
    print(f"{'final loss':<34} {summary['final_loss']:.4f} (failure-free {ref_loss:.4f})")
    print(f"{'max |weight diff| vs failure-free':<34} {diff:.3g} ({'bitwise equal' if equal else 'NOT equal'})")
    print(f"{'run folder':<34} {out}")
    print()
    print("server and coordinator kills: the roll-back that followed each (steps redone = committed - version)")
    print(f"{'time s':>8}  {'killed':<12} {'stage':>5}  {'taken over by':<14} {'committed':>9} {'version':>7} "
          f"{'redone':>6}")
    for k in per_kill:
        print(f"{k['time_s']:>8.1f}  {k['device']:<12} {k['stage']:>5}  {k['by']:<14} {k['committed']:>9} "
              f"{k['version']:>7} {k['redone']:>6}")
    for e in rollbacks:
        if not any(k["rollback"] is e for k in per_kill):
            print(f"{e['time_s']:>8.1f}  {'(no kill)':<12} {'':>5}  {'':<14} {e['committed']:>9} {e['version']:>7} "
                  f"{max(e['committed'] - e['version'], 0):>6}")


def reference(run: dict, folder: Path, cache: str | None) -> tuple[dict[str, torch.Tensor], float]:
    """The failure-free run's final weights and loss (``train_local``), kept in ``cache`` if given.

    The cache holds the workload it was made for and is used only for the same one.
    """
    if cache and Path(cache).exists():
        saved = torch.load(cache, weights_only=True)
        if saved["run"] == repr(sorted(run.items())):
            return saved["weights"], saved["loss"]
    ref = train_local(TrainConfig(**run, out=str(folder), eval_every=0, eval_batches=1), quiet=True)
    if ref.interrupted or ref.steps_done != run["steps"]:  # train_local ends cleanly on SIGTERM: no reference
        raise SystemExit(f"the failure-free run stopped after {ref.steps_done} of {run['steps']} steps")
    weights = {k: v.detach().clone() for k, v in ref.model.state_dict().items()}
    loss = float(ref.records[-1]["loss"])
    if cache:
        tmp = Path(f"{cache}.tmp")
        torch.save({"run": repr(sorted(run.items())), "weights": weights, "loss": loss}, tmp)
        tmp.replace(cache)  # whole or absent: another bench may read it
    return weights, loss


def kill_rollbacks(events: list[dict]) -> list[dict]:
    """Each server or coordinator kill in ``events`` with the roll-back that followed it.

    A killed server's stage (its last ``assign``), the server that took the stage over (the
    next ``assign`` of that stage; a coordinator kill has none), and the first ``rollback``
    after the kill: ``committed`` when it ran, ``version`` it went to, ``redone`` steps.
    """
    out: list[dict] = []
    stage_of: dict[str, int] = {}
    for i, e in enumerate(events):
        if e["event"] == "assign" and e.get("role") == "server":
            stage_of[e["device"]] = e["stage"]
        if e["event"] != "kill" or e.get("role") not in ("server", "coordinator"):
            continue
        stage = stage_of.get(e["device"], -1) if e["role"] == "server" else -1
        later = events[i + 1:]
        rb = next((r for r in later if r["event"] == "rollback"), None)
        by = next((a["device"] for a in later if a["event"] == "assign" and a.get("role") == "server"
                   and a.get("stage") == stage and a["device"] != e["device"]), "") if stage >= 0 else ""
        out.append(dict(time_s=e.get("time_s", 0.0), device=e["device"], stage=stage if stage >= 0 else "",
                        by=by or "-", rollback=rb,
                        committed=rb["committed"] if rb else "", version=rb["version"] if rb else "",
                        redone=max(rb["committed"] - rb["version"], 0) if rb else ""))
    return out


if __name__ == "__main__":
    main()
