#!/bin/bash
# shoal demo with its default flags (no churn, 24 steps), two source trees alternating:
# mean step time and final loss of each run. Usage (from the repository root):
#     bench/demo_ab.sh BEFORE_TREE AFTER_TREE OUT_DIR [RUNS]
# e.g. a tree made with `git worktree add /tmp/before <rev>` against this one (`$PWD`).
# Both trees run with this checkout's .venv; OMP_NUM_THREADS=1.
set -euo pipefail
before=$1; after=$2; outdir=$3; runs=${4:-2}
py=$(pwd)/.venv/bin/python
mkdir -p "$outdir"
for i in $(seq 1 "$runs"); do
  for t in before after; do
    if [ "$t" = before ]; then src=$before; else src=$after; fi
    out=$outdir/$t$i; rm -rf "$out"
    (cd "$src" && OMP_NUM_THREADS=1 PYTHONPATH=$src "$py" -c "import sys; from shoal.cli import main; sys.exit(main(sys.argv[1:]))" \
       demo --no-churn --steps 24 --quiet --no-dashboard --out "$out" > "$out.log" 2>&1)
    "$py" - "$out" "$t$i" <<'PY'
import json, sys
out, tag = sys.argv[1], sys.argv[2]
recs = [json.loads(line) for line in open(out + "/metrics.jsonl")]
st = [r["step_time_s"] for r in recs]
print(f"{tag}: mean step {sum(st) / len(st):.3f} s (after the first {sum(st[1:]) / len(st[1:]):.3f} s), "
      f"final loss {recs[-1]['loss']:.4f}", flush=True)
PY
  done
done
