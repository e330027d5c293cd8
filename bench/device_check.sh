#!/usr/bin/env bash
# The device check: one prepared run on a lent accelerator machine (a CUDA GPU and its host's
# cores), every part with its own time limit so that one hang cannot eat the lease.
#
#   bench/device_check.sh OUT [PART...]           # on the device machine (wheels carried in .whl/)
#   SMOKE=1 bench/device_check.sh OUT [PART...]   # the same parts on tiny shapes on a CPU
#
# Parts, each writing OUT/<part>.md; the default is the first three (at most 540 s: one call of
# the device tool, whose limit is 600 s); gpu_checks (at most 330 s) goes in a second call:
#   gpu_runtime  shoal launch S=2 W=2 against train --local on the one GPU (gpt-125m bf16)
#   shadow       shadow swarms of 16, 64 and 256 workers at time scale 1 on the host's cores
#   gpu          bench_gpu.py: per-stage throughput and MFU, fp32 vs bf16 loss
#   gpu_checks   the exact launch at the default --spot-check: the servers' routine
#                recomputations run beside the steps (docs/poisoning.md, "Deferred checks");
#                the last step's are still inline, so its steps' times are the figure, not the wall
set -u
OUT=${1:?usage: device_check.sh OUT [gpu_runtime] [shadow] [gpu] [gpu_checks]}
shift
PARTS=" ${*:-gpu_runtime shadow gpu} "
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -z "${SMOKE:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
{ date -u; nproc; free -g | head -2; nvidia-smi -L 2>&1; $PY -c 'import torch, grpc, google.protobuf as p, shoal.cli
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "grpc", grpc.__version__, "protobuf", p.__version__)'
} 2>&1 | tee "$OUT/machine.txt"

if [ -n "${SMOKE:-}" ]; then
    rt=(--device cpu --smoke --precision fp32); sh=(--workers 16 --steps 3); gp=(--device cpu --smoke)
    ck=(--device cpu --smoke --precision fp32 --sync exact)
else
    # --spot-check 0: the runtime's own costs, no server recomputation (a minute a gpt-125m push
    # on the server's CPU, bench/results/gpu-runtime.md); part gpu_checks runs the default.
    rt=(--timeout 150 --spot-check 0); sh=(--workers 16,64,256 --steps 6); gp=(--loss-steps 30)
    ck=(--timeout 300 --sync exact --steps 10)
fi
part() { [[ "$PARTS" == *" $1 "* ]]; }
if part gpu_runtime; then
    if command -v nvidia-smi >/dev/null; then  # the GPU's busy share over the runtime bench, twice a second
        nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 500 > "$OUT/gpu_util.csv" &
        smi=$!
    fi
    runs=$(mktemp -d /tmp/gpurt.XXXX)  # a fresh folder: a rerun on a warm machine must not meet the last run's
    timeout 300 $PY bench/bench_gpu_runtime.py "${rt[@]}" --out "$runs" 2>&1 | tee "$OUT/gpu_runtime.md"
    [ -n "${smi:-}" ] && kill "$smi"
    # the runs' logs, events and metrics (no checkpoints): where a slow step went
    tar czf "$OUT/gpu_runtime_logs.tgz" -C "$runs" --exclude='*.safetensors' --exclude='*ckpt*' --exclude='*.pt' . \
        2>/dev/null
fi
if part shadow; then
    timeout 140 $PY bench/bench_shadow.py --model tiny --micro-batches 8 --micro-batch-size 4 --seq-len 64 \
        --speedup 1 --per-process 64 "${sh[@]}" 2>&1 | tee "$OUT/shadow.md"
fi
if part gpu; then
    timeout 100 $PY bench/bench_gpu.py "${gp[@]}" 2>&1 | tee "$OUT/gpu.md"
fi
if part gpu_checks; then
    runs=$(mktemp -d /tmp/gpuck.XXXX)
    timeout 330 $PY bench/bench_gpu_runtime.py "${ck[@]}" --out "$runs" 2>&1 | tee "$OUT/gpu_checks.md"
    # every recomputation with its step and whether it ran beside the steps; each step's time
    grep -h "recomputed the push\|recomputed [0-9]* pushes" "$runs"/launch-exact/logs/server*.log \
        > "$OUT/gpu_checks_recomputed.txt" 2>/dev/null
    cp "$runs"/launch-exact/metrics.jsonl "$OUT/gpu_checks_metrics.jsonl" 2>/dev/null
fi
exit 0
