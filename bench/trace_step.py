"""Where one step's time goes across a swarm's processes, from ``SHOAL_TRACE`` files.

    SHOAL_TRACE=DIR PYTHONPATH=. python bench/bench_shadow.py ...   # or any shoal launch
    PYTHONPATH=. python bench/trace_step.py DIR [--step K] [--events]

Every member appends its step events to ``DIR/trace-PID.jsonl`` (``shoal.runtime.common.trace``:
wall clock, one box). For step K (default: the middle committed step) this prints, from the
previous commit: each stage server's milestones (first grant, last result, commit start = last
push counted, report, decision, commit), and the medians of the hops a step is made of:
worker compute end -> server has the result, relay sent -> taken by the next server, lease
reply -> pull done, push made -> push acknowledged. ``--events`` lists every event of the step.
``--workers`` adds, per worker over every committed step from ``--from`` on: the steps it took
a task in, its grants (checks included) and its pushes' made -> acknowledged times (in exact
sync a step commits only once every worker that computed a gradient in it has pushed, so one
slow uplink sets the step's end).
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
from collections import defaultdict


def load(folder: str) -> list[dict]:
    """Every trace event of ``folder``, by time."""
    out = []
    for path in glob.glob(f"{folder}/trace-*.jsonl"):
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda e: e["t"])


def hops(ev: list[dict]) -> dict[str, list[float]]:
    """Durations (s) of the step's hops, matched by worker, micro-batch and direction."""
    out: dict[str, list[float]] = defaultdict(list)
    computed = {}
    relay_out = {}
    last_by_worker: dict[tuple[str, str], float] = {}
    for e in ev:
        k, who = e["ev"], e["who"]
        if k == "computed":
            computed[(e["mb"], e["d"])] = e["t"]
        elif k == "result" and (e["mb"], e["d"]) in computed:
            out["result: computed -> at server"].append(e["t"] - computed.pop((e["mb"], e["d"])))
        elif k == "relay_out":
            relay_out[(e["mb"], e["d"])] = e["t"]
        elif k == "relay_in" and (e["mb"], 1 if e["d"] == 1 else 0) in relay_out:
            out["relay: sent -> taken"].append(e["t"] - relay_out.pop((e["mb"], 1 if e["d"] == 1 else 0)))
        elif k in ("pull", "push_make", "grant"):
            last_by_worker[(who if k != "grant" else e["w"], k)] = e["t"]
        elif k == "pulled" and (who, "pull") in last_by_worker:
            out["pull: asked -> received"].append(e["t"] - last_by_worker.pop((who, "pull")))
        elif k == "push_ack" and (who, "push_make") in last_by_worker:
            out["push: made -> acknowledged"].append(e["t"] - last_by_worker.pop((who, "push_make")))
    return out


def workers(ev: list[dict], first_step: int = 0) -> dict[str, dict]:
    """Per worker (its short name: the member id's last part), over the steps from
    ``first_step`` on: ``steps`` (those it was granted a task in), ``grants`` and ``pushes``
    (made -> acknowledged, seconds; a worker's acknowledgements matched to its pushes in order)."""
    out: dict[str, dict] = defaultdict(lambda: {"steps": set(), "grants": 0, "pushes": []})
    made: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in ev:
        k = e["ev"]
        if k == "grant" and e.get("step", -1) >= first_step:
            w = out[e["w"].rsplit("-", 1)[-1]]
            w["steps"].add(e["step"])
            w["grants"] += 1
        elif k == "push_make":
            made[e["who"]].append((e["t"], e.get("step", -1)))
        elif k == "push_ack" and made[e["who"]]:
            t, s = made[e["who"]].pop(0)
            if s >= first_step:
                out[e["who"].rsplit("-", 1)[-1]]["pushes"].append(e["t"] - t)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--events", action="store_true")
    ap.add_argument("--workers", action="store_true", help="per worker: steps taken part in, grants, push times")
    ap.add_argument("--from", dest="first", type=int, default=2,
                    help="--workers: count from this step (default 2: weights pulled, graphs built)")
    args = ap.parse_args()
    ev = load(args.folder)
    if args.workers:
        per = workers(ev, args.first)
        steps = sorted({s for w in per.values() for s in w["steps"]})
        print(f"workers over steps {steps[0] if steps else '-'}-{steps[-1] if steps else '-'} ({len(steps)} steps):")
        for name, w in sorted(per.items(), key=lambda kv: (len(kv[0]), kv[0])):
            p = w["pushes"]
            pushes = (f"median {1e3 * statistics.median(p):.0f} ms, max {1e3 * max(p):.0f} ms ({len(p)})"
                      if p else "none")
            print(f"  {name:8s} in {len(w['steps'])} steps, {w['grants']} grants; pushes made -> acknowledged: {pushes}")
    commits = defaultdict(list)
    for e in ev:
        if e["ev"] == "committed":
            commits[e["step"]].append(e["t"])
    done = sorted(s for s in commits if s - 1 in commits)
    if not done:
        raise SystemExit(f"{args.folder}: no two consecutive committed steps traced")
    step = args.step if args.step is not None else done[len(done) // 2]
    t0, t1 = min(commits[step - 1]), max(commits[step])
    ev = [e for e in ev if t0 <= e["t"] <= t1 + 1e-6]
    print(f"step {step}: {1e3 * (t1 - t0):.1f} ms from the first commit of step {step - 1} to the last of step {step}")
    servers = sorted({e["who"] for e in ev if e["ev"] in ("grant", "committed")})
    for s in servers:
        mine = [e for e in ev if e["who"] == s]

        def at(kind: str, pick=min, mine=mine) -> str:
            ts = [e["t"] for e in mine if e["ev"] == kind and e.get("step", step) == step]
            return f"{1e3 * (pick(ts) - t0):7.1f}" if ts else "      -"

        print(f"  {s}: first grant {at('grant')}  last result {at('result', max)}  commit start "
              f"{at('commit_start')}  report {at('report', max)}  decided {at('decided')}  committed {at('committed')} ms")
    for name, xs in hops(ev).items():
        print(f"  {name}: median {1e3 * statistics.median(xs):.1f} ms, max {1e3 * max(xs):.1f} ms ({len(xs)})")
    if args.events:
        for e in ev:
            rest = {k: v for k, v in e.items() if k not in ("t", "who", "ev")}
            print(f"{1e3 * (e['t'] - t0):8.1f} {e['who']:8s} {e['ev']:13s} {rest}")


if __name__ == "__main__":
    main()
