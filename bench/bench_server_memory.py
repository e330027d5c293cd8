"""What a stage server really holds, against what the planner sizes its host for.

Runs ``shoal launch`` (2 stages, a worker each, or ``--workers-per-stage`` each; 4 micro-batches
a stage, so that a local-mode server's reference gradient runs on as many threads as in a real
run; runs at 2 missed that: bench/results/server-memory.md, 2026-12-05 22:47) once per sync
policy for each model, reads each
member's peak resident memory from ``summary.json`` (``peak_rss_bytes``: VmHWM, which every
member reports in its heartbeats) and prints, per stage server: its layers, parameters, peak
RSS, and the planner's figure for it (``ModelProfile.server_memory``). With two
models the table also fits ``peak = base + k x parameters`` per policy over all their servers
(least squares), the bytes per parameter a server really needs.

    PYTHONPATH=. python bench/bench_server_memory.py [--models tiny,gpt-125m] [--policies exact,local-lowrank]
        [--workers-per-stage 1,4,8] [--spool-mb 1] [--micro-batches M]

Policies: ``exact`` (the launch's default), ``local`` (``--sync local --sync-every 2``),
``local-lowrank`` (the same with ``--compression lowrank``), ``local-int8-frames`` (``int8``),
``*-frames`` (``--merge-memory-gb 0``: pushes and parts held as frames, large ones on disk),
``local-lowrank-replicas`` and ``-replicas4`` (two or four one-stage replicas, a worker each:
every server holds the whole model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REFERENCE_MBS = 4  # shoal.plan.types.SCREEN_REF_MBS: a server's reference gradient takes this many of its micro-batches
POLICIES = {
    "exact": [],
    "local": ["--sync", "local", "--sync-every", "2"],
    "local-lean": ["--sync", "local", "--sync-every", "2", "--lean-workers"],
    "local-lowrank": ["--sync", "local", "--sync-every", "2", "--compression", "lowrank"],
    # every pseudo-gradient held as its frames: what a server holds beside its merge memory
    "local-lowrank-frames": ["--sync", "local", "--sync-every", "2", "--compression", "lowrank",
                             "--merge-memory-gb", "0"],
    "local-frames": ["--sync", "local", "--sync-every", "2", "--merge-memory-gb", "0"],
    "local-int8-frames": ["--sync", "local", "--sync-every", "2", "--compression", "int8", "--merge-memory-gb", "0"],
    "local-int8": ["--sync", "local", "--sync-every", "2", "--compression", "int8"],
    # two one-stage replicas: each server holds the whole model and merges with its peer's part
    "local-lowrank-replicas": ["--sync", "local", "--sync-every", "2", "--compression", "lowrank",
                               "--replicas", "1,1"],
    "local-lowrank-replicas-frames": ["--sync", "local", "--sync-every", "2", "--compression", "lowrank",
                                      "--replicas", "1,1", "--merge-memory-gb", "0"],
    # four: each server waits for three peers' parts
    "local-lowrank-replicas4": ["--sync", "local", "--sync-every", "2", "--compression", "lowrank",
                                "--replicas", "1,1,1,1"],
    "local-lowrank-replicas4-frames": ["--sync", "local", "--sync-every", "2", "--compression", "lowrank",
                                       "--replicas", "1,1,1,1", "--merge-memory-gb", "0"],
}


def sized_model(spec: str, root: Path) -> str:
    """A model folder for ``dWIDTHxLLAYERS`` (e.g. ``d768xL8``: tiny's vocabulary and
    sequence, that width and depth; a size between the presets where whole-model replicas and
    their workers fit one machine), made under ``root`` once; any other name is returned as is."""
    import re

    m = re.fullmatch(r"d(\d+)xL(\d+)", spec)
    if not m:
        return spec
    out = root / spec
    if not out.is_dir():
        from dataclasses import replace

        from shoal.hf.convert import write_hf_dir
        from shoal.model.config import get_preset
        from shoal.model.transformer import build_model

        width, layers = int(m.group(1)), int(m.group(2))
        cfg = replace(get_preset("tiny"), name="custom", d_model=width, n_layers=layers, n_heads=width // 64,
                      ffn_hidden=8 * width // 3 // 64 * 64)
        write_hf_dir(out, {n: p.detach() for n, p in build_model(cfg).named_parameters()}, cfg)
    return str(out)


def run(model: str, policy: str, root: Path, steps: int, per_stage: int = 1, spool_mb: float | None = None,
        micro_batches: int | None = None) -> dict:
    out = root / f"{Path(model).name}-{policy}-x{per_stage}"
    extra = POLICIES[policy]
    # per_stage workers a stage: a replica plan's stages are its replicas' (one each here)
    n = len(extra[extra.index("--replicas") + 1].split(",")) if "--replicas" in extra else 2
    # a model folder (a transformers-style checkpoint, shoal.hf) for sizes between the presets
    what = ["--init-from", str(Path(model).resolve())] if Path(model).is_dir() else ["--model", model]
    cmd = [sys.executable, "-m", "shoal.runtime.processes.cli", "launch", *what, "--stages", str(n),
           "--workers", str(n * per_stage), "--steps", str(steps), "--micro-batches", str(micro_batches or max(REFERENCE_MBS * n, n * per_stage)), "--micro-batch-size", "1",
           "--seq-len", "64", "--out", str(out), "--timeout", "3000", "--dead-after", "120",
           "--min-lease", "120", "--spot-check", "0", *POLICIES[policy]]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          # (PYTHONSAFEPATH: `-m` takes shoal from PYTHONPATH, not the working folder)
                          env=dict(os.environ, OMP_NUM_THREADS="1", SHOAL_TORCH_THREADS="1", PYTHONSAFEPATH="1",
                                   **({} if spool_mb is None else {"SHOAL_SPOOL_MB": str(spool_mb)})))
    if proc.returncode != 0:
        sys.exit(f"{model} {policy}: launch failed ({proc.returncode}): {proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "wall_s": time.time() - t0, "cmd": " ".join(cmd[2:])}


def main() -> None:
    from shoal.hf.convert import read_hf_model_config
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,gpt-125m",
                   help="presets, model folders (--init-from), or dWIDTHxLLAYERS (a folder made for it)")
    p.add_argument("--policies", default="exact,local-lowrank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--workers-per-stage", default="1",
                   help="workers on each stage, or several (1,4): a run each (a server holds a round's pushes)")
    p.add_argument("--spool-mb", type=float, default=None,
                   help="servers receive pushes of this many MB or more into files (SHOAL_SPOOL_MB; "
                        "default: shoal.net.stream.SPOOL_BYTES): a small model's pushes as a large one's")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches a step (default: 4 a stage, or one a worker if more): a local-mode "
                        "server's screen computes its reference gradient on up to 4 of its own a step, "
                        "one thread each, as in a real run")
    p.add_argument("--keep", default=None, help="folder to keep the runs in (default: a temp folder, removed)")
    args = p.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="shoal-srvmem-"))
    rows = []
    models = [sized_model(m, root) for m in args.models.split(",")]
    for policy in args.policies.split(","):
        for model, per_stage in [(m, int(k)) for m in models for k in args.workers_per_stage.split(",")]:
            r = run(model, policy, root, args.steps, per_stage, args.spool_mb, args.micro_batches)
            print(f"# {r['cmd']}  ({r['wall_s']:.0f} s)", flush=True)
            prof = profile_model(read_hf_model_config(model) if Path(model).is_dir() else get_preset(model), 64, 1)
            layers = r["summary"]["layers"]
            peaks = r["summary"]["peak_rss_bytes"]
            for s, (a, b) in enumerate(layers):
                name = r["summary"]["stage_servers"][s]  # (server names need not follow stage order)
                rows.append((policy if per_stage == 1 else f"{policy} x{per_stage}", Path(model).name, name, (a, b), prof.params(a, b), peaks.get(name, 0),
                             prof.server_memory(a, b, local=policy.startswith("local"))))
    print("| policy | model | server | layers | parameters | peak RSS MB | planned MB | planned / peak |")
    print("|---|---|---|---|---|---|---|---|")
    for policy, model, name, (a, b), n, peak, planned in rows:
        print(f"| {policy} | {model} | {name} | [{a}, {b}) | {n / 1e6:.1f} M | {peak / 2**20:.0f} | "
              f"{planned / 2**20:.0f} | {planned / peak if peak else float('nan'):.2f} |")
    for policy in args.policies.split(","):
        pts = [(n, peak) for pol, _m, _s, _l, n, peak, _p in rows if pol == policy and peak]
        if pts and max(n for n, _ in pts) >= 1.5 * min(n for n, _ in pts):  # (two model sizes at least)
            mx = sum(n for n, _ in pts) / len(pts)
            my = sum(y for _, y in pts) / len(pts)
            k = sum((n - mx) * (y - my) for n, y in pts) / sum((n - mx) ** 2 for n, _ in pts)
            print(f"{policy}: peak RSS = {(my - k * mx) / 2**20:.0f} MB + {k:.1f} B x parameters "
                  f"(least squares over {len(pts)} servers)")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
