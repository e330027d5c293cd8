"""What a worker really holds as a step grows: its peak resident memory against the micro-batches
of a step, beside the planner's figure for its stage.

    PYTHONPATH=. python bench/bench_worker_memory.py [--model d768xL8] [--policies local,exact]
        [--micro-batches 8,32]

Runs ``shoal launch`` (2 stages, a worker each, 4 steps, sequence 64, one sequence a micro-batch:
``bench_server_memory.run``) once per sync policy and step size, on the CPU, and prints each
worker's peak RSS (``peak_rss_bytes`` of ``summary.json``, its heartbeats' ``VmHWM``) beside
``stage_worker_memory`` for its stage (weights, a gradient and one micro-batch's saved activations
in float32; in local mode the inner AdamW state too; ``local-lean``: a lean worker's 12 bytes a
parameter, docs/lean-workers.md). On a CPU the process holds the stage's
tensors, so what grows with the step's micro-batches beyond that figure is what a GPU worker
would hold on its device beyond the plan: gradients kept per micro-batch, forward graphs kept
for its own backward tasks.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server_memory import run, sized_model  # noqa: E402


def main() -> None:
    from shoal.hf.convert import read_hf_model_config
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.cost import stage_worker_memory
    from shoal.plan.types import SyncPolicy

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="d768xL8", help="a preset, a model folder, or dWIDTHxLLAYERS")
    p.add_argument("--policies", default="local,exact", help="bench_server_memory's policies")
    p.add_argument("--micro-batches", default="8,32", help="micro-batches a step, a run each")
    p.add_argument("--keep", default=None, help="folder to keep the runs in (default: a temp folder, removed)")
    args = p.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="shoal-wmem-"))
    model = sized_model(args.model, root)
    cfg = read_hf_model_config(model) if Path(model).is_dir() else get_preset(model)
    prof = profile_model(cfg, 64, 1)
    print("| policy | micro-batches | worker | layers | parameters | peak RSS MB | planned MB | peak - planned MB |")
    print("|---|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        sync = SyncPolicy(mode="local", lean="lean" in policy) if policy.startswith("local") else None
        for m in (int(x) for x in args.micro_batches.split(",")):
            sub = root / f"M{m}"
            sub.mkdir(parents=True, exist_ok=True)
            r = run(model, policy, sub, 4, 1, None, m)
            summary = r["summary"]
            peaks = summary["peak_rss_bytes"]
            for k, (a, b) in enumerate(summary["layers"]):
                # each worker's stage from its own log ("works on stage S [a,b)"), the last one it had
                log = (sub / f"{Path(model).name}-{policy}-x1" / "logs" / f"worker{k}.log").read_text()
                got = [line.split("works on stage ", 1)[1].split()[1] for line in log.splitlines()
                       if "works on stage " in line]
                lo, hi = (int(x) for x in got[-1].strip("[)").split(",")) if got else (a, b)
                planned = stage_worker_memory(prof, lo, hi, sync)
                peak = peaks.get(f"w{k}", 0)
                print(f"| {policy} | {m} | w{k} | [{lo}, {hi}) | {prof.params(lo, hi) / 1e6:.1f} M | "
                      f"{peak / 2**20:.0f} | {planned / 2**20:.0f} | {(peak - planned) / 2**20:.0f} |", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
