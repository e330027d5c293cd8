#!/bin/bash
# Loss of local mode with delayed application against --no-overlap (and a second source tree
# with delayed application), 96 steps of tiny on loopback, H = 4, int8, runs alternating:
# the mean loss of the last three steps (the same micro-batches in every run), tokens/s.
# Usage (from the repository root):
#     bench/overlap_ab.sh OTHER_TREE OUT_DIR RUNS STAGES WORKERS
# OTHER_TREE: e.g. `git worktree add /tmp/before <rev>`; this checkout's .venv runs both.
set -euo pipefail
other=$1; out=$2; runs=$3; stages=$4; workers=$5
py=$(pwd)/.venv/bin/python
mkdir -p "$out"
run() {
  local name=$1 tree=$2; shift 2
  rm -rf "${out:?}/$name"
  (cd "$tree" && PYTHONPATH=$tree OMP_NUM_THREADS=1 "$py" -c "import sys; from shoal.cli import main; sys.exit(main(sys.argv[1:]))" \
     launch --model tiny --stages "$stages" --workers "$workers" --steps 96 --micro-batches 8 --micro-batch-size 4 \
     --seq-len 64 --lr 3e-3 --warmup 2 --sync local --sync-every 4 --compression int8 --insecure --no-dashboard \
     --ckpt-every 0 --out "$out/$name" "$@" > "$out/$name.log" 2>&1)
  "$py" - "$out/$name" "$name" <<'PY'
import json, sys
out, tag = sys.argv[1], sys.argv[2]
recs = [json.loads(line) for line in open(out + "/metrics.jsonl")]
last = [r["loss"] for r in recs][-3:]
s = json.load(open(out + "/summary.json"))
print(f"{tag}: {len(recs)} steps, loss of the last three {sum(last) / len(last):.4f}, "
      f"{s.get('tokens_per_s', 0):,.0f} tokens/s", flush=True)
PY
}
for i in $(seq 1 "$runs"); do
  run "this$i" "$(pwd)"
  run "other$i" "$other"
  run "waits$i" "$(pwd)" --no-overlap
done
