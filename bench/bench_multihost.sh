#!/usr/bin/env bash
# Three "machines" on one Linux box, run exactly as docs/real-machines.md says.
#
#   host A (10.77.0.1): coordinator + stage server     } listen on 0.0.0.0,
#   host B (10.77.0.2): stage server                   } advertise their own address
#   host C (10.77.0.3): two workers, outbound connections only (nothing listens there)
#
# Each pair of hosts is joined by its own veth link, shaped both ways with tbf (rate
# limit; netem is not available here). The script measures every link (TCP round trip
# and a timed bulk transfer each way), trains with the roles started by hand, trains the
# same run with `shoal train --local`, and prints both loss curves, the link figures and
# the bytes each kind of traffic moved. Everything it creates (namespaces, links,
# processes, its temp folder) is removed on exit, also on Ctrl-C or failure.
#
# Needs root (ip netns, tc). Usage, from the repository root:
#   sudo bench/bench_multihost.sh            # PYTHON=... to pick the interpreter
# Knobs (environment): STEPS (10), MODEL (tiny), RATE_AB/RATE_AC/RATE_BC (tbf rates,
# default 400mbit/100mbit/50mbit), CHUNK_MB (1), KEEP=1 keeps the temp folder.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
STEPS=${STEPS:-10}
MODEL=${MODEL:-tiny}
RATE_AB=${RATE_AB:-400mbit}
RATE_AC=${RATE_AC:-100mbit}
RATE_BC=${RATE_BC:-50mbit}
CHUNK_MB=${CHUNK_MB:-1}
RUNFLAGS=(--model "$MODEL" --steps "$STEPS" --micro-batches 4 --micro-batch-size 2 --seq-len 64 --seed 0)

[ "$(id -u)" = 0 ] || { echo "error: run as root (needs ip netns and tc)" >&2; exit 2; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "error: needs iproute2 (ip, tc)" >&2; exit 2; }

TAG=$$
NS_A=shoal-a-$TAG; NS_B=shoal-b-$TAG; NS_C=shoal-c-$TAG
TAG=${TAG: -5}   # veth names: v + TAG + two letters, within 15 characters
WORK=$(mktemp -d /tmp/shoal-multihost.XXXXXX)
PIDS=()

cleanup() {
    set +e
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    sleep 0.5
    for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
    for ns in "$NS_A" "$NS_B" "$NS_C"; do ip netns del "$ns" 2>/dev/null; done
    if [ "${KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- the three hosts
declare -A NS=([A]=$NS_A [B]=$NS_B [C]=$NS_C)
declare -A IP=([A]=10.77.0.1 [B]=10.77.0.2 [C]=10.77.0.3)
for h in A B C; do
    ip netns add "${NS[$h]}"
    ip -n "${NS[$h]}" link set lo up
    ip -n "${NS[$h]}" addr add "${IP[$h]}/32" dev lo   # the host's address, reached over any of its links
done

# burst RATE: tbf bucket of 10 ms at RATE ("400mbit"), at least 64 KiB.
burst() { local m=${1%mbit}; echo "$(( m * 1000000 / 8 / 100 / 1024 > 64 ? m * 1000000 / 8 / 100 / 1024 + 1 : 64 ))kb"; }

# link H1 H2 RATE: a veth pair between two hosts, tbf-shaped at RATE on both ends.
link() {
    local h1=$1 h2=$2 rate=$3 h peer dev
    ip link add "v$TAG$h1$h2" netns "${NS[$h1]}" type veth peer name "v$TAG$h2$h1" netns "${NS[$h2]}"
    for h in "$h1" "$h2"; do
        peer=$([ "$h" = "$h1" ] && echo "$h2" || echo "$h1")
        dev="v$TAG$h$peer"
        ip -n "${NS[$h]}" link set "$dev" up
        ip -n "${NS[$h]}" route add "${IP[$peer]}/32" dev "$dev" src "${IP[$h]}"
        # burst: 10 ms of traffic (at least 64 KiB), or tbf cannot reach its rate above ~100 Mbit/s
        tc -n "${NS[$h]}" qdisc add dev "$dev" root tbf rate "$rate" burst "$(burst "$rate")" latency 200ms
    done
}
link A B "$RATE_AB"
link A C "$RATE_AC"
link B C "$RATE_BC"

on() { local h=$1; shift; ip netns exec "${NS[$h]}" env PYTHONPATH="$ROOT" OMP_NUM_THREADS=1 "$@"; }
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"

# ---------------------------------------------------------------- link figures
echo "== links (tbf rate each way; measured: TCP round trip, 4 MB each way)"
printf "%-8s %-10s %10s %14s %14s\n" link tbf rtt_ms "up Mbit/s" "down Mbit/s"
for pair in "A B $RATE_AB" "A C $RATE_AC" "B C $RATE_BC"; do
    read -r n1 n2 rate <<<"$pair"
    on "$n1" "$PY" "$ROOT/bench/netprobe.py" serve "${IP[$n1]}:7999" &
    srv=$!
    res=$(on "$n2" "$PY" "$ROOT/bench/netprobe.py" probe "${IP[$n1]}:7999" --mb 4)
    wait "$srv"
    # "up" is host 2 -> host 1 (the prober sends first)
    "$PY" -c "import json,sys; r=json.loads(sys.argv[1]); print(f\"%-8s %-10s %10.2f %14.1f %14.1f\" % (sys.argv[2], sys.argv[3], r['rtt_ms'], r['down_mbit_s'], r['up_mbit_s']))" \
        "$res" "$n1->$n2" "$rate"
done
echo "(up: first host -> second host; down: second -> first)"

# ---------------------------------------------------------------- the run, by hand
export SHOAL_TOKEN
SHOAL_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(16))')
# Stage servers join with the server token (the join token admits workers only; workers ignore it).
export SHOAL_SERVER_TOKEN
SHOAL_SERVER_TOKEN=$("$PY" -c 'import secrets; print(secrets.token_hex(16))')
RUN=$WORK/run
A=${IP[A]}; B=${IP[B]}
# Every member uses the run's certificates (mutual TLS); one folder serves all three hosts here.
export SHOAL_TLS_DIR=$WORK/keys
"$PY" -m shoal.cli keys --out "$SHOAL_TLS_DIR" --hosts "$A,$B" >/dev/null
echo
echo "== run: coordinator + server on A, server on B, 2 workers on C ($MODEL, $STEPS steps, chunks of $CHUNK_MB MB)"
t0=$(date +%s.%N)
(cd "$WORK" && on A "$PY" -m shoal.cli coordinator --listen 0.0.0.0:7070 --advertise "$A:7070" \
    --min-workers 2 --chunk-mb "$CHUNK_MB" --out "$RUN" "${RUNFLAGS[@]}" >"$WORK/coordinator.log" 2>&1) &
COORD=$!; PIDS+=("$COORD")
(cd "$WORK" && on A "$PY" -m shoal.cli server --join "$A:7070" --listen 0.0.0.0:7071 --advertise "$A:7071" \
    --ckpt-dir "$WORK/ckpt-a" --name server-a >"$WORK/server-a.log" 2>&1) &
PIDS+=($!)
(cd "$WORK" && on B "$PY" -m shoal.cli server --join "$A:7070" --listen 0.0.0.0:7071 --advertise "$B:7071" \
    --ckpt-dir "$WORK/ckpt-b" --name server-b >"$WORK/server-b.log" 2>&1) &
PIDS+=($!)
for w in 0 1; do
    (cd "$WORK" && on C "$PY" -m shoal.cli worker --join "$A:7070" --name "w$w" >"$WORK/worker$w.log" 2>&1) &
    PIDS+=($!)
done
# Workers only dial out: host C must have no listening TCP socket while they run.
sleep 5
listening=$(ip netns exec "$NS_C" ss -ltnH | wc -l)
echo "listening TCP sockets on the worker host C while workers run: $listening"
[ "$listening" = 0 ] || { echo "error: something listens on the worker host" >&2; exit 1; }
if ! timeout 1800 tail --pid="$COORD" -f /dev/null; then echo "error: run timed out" >&2; exit 1; fi
wait "$COORD" || { echo "error: coordinator failed; log:" >&2; tail -20 "$WORK/coordinator.log" >&2; exit 1; }
t1=$(date +%s.%N)

# ---------------------------------------------------------------- the same run, locally
echo "== reference: shoal train --local with the same flags"
(cd "$WORK" && PYTHONPATH="$ROOT" OMP_NUM_THREADS=1 "$PY" -m shoal.cli train --local "${RUNFLAGS[@]}" \
    --eval-every 0 --eval-batches 1 --quiet --out "$WORK/local" >"$WORK/local.log" 2>&1)

"$PY" - "$RUN" "$WORK/local" "$t0" "$t1" "$RATE_AB" "$RATE_AC" "$RATE_BC" <<'EOF'
import json, sys
from pathlib import Path
run, local, t0, t1 = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rd = lambda p: [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
multi = {r["step"]: r["loss"] for r in rd(run / "metrics.jsonl")}
ref = {r["step"]: r["loss"] for r in rd(local / "metrics.jsonl") if "loss" in r and "step" in r}
print(f"{'step':>4} {'3 hosts':>10} {'local':>10} {'|diff|':>9}")
worst = 0.0
for s in sorted(multi):
    d = abs(multi[s] - ref[s]); worst = max(worst, d)
    print(f"{s:>4} {multi[s]:>10.5f} {ref[s]:>10.5f} {d:>9.2e}")
print(f"max |loss - local| over {len(multi)} steps: {worst:.2e}")
summ = json.loads((run / "summary.json").read_text())
print(f"run wall time {t1 - t0:.1f} s (processes started to coordinator exit); "
      f"train time {summ['train_time_s']:.1f} s; {summ['tokens_per_s']:.0f} tokens/s")
print("bytes moved (all processes, serialized messages):")
for kind, c in summ["bytes"].items():
    print(f"  {kind:<17} {c['wire'] / 1e6:>9.2f} MB in {c['messages']} messages")

# What the members measured (their `measured` events; the newest per member) against the tbf rates.
host = {"coordinator": "A", "server-a": "A", "server-b": "B", "w0": "C", "w1": "C"}
tbf = {}
for pair, rate in zip(("AB", "AC", "BC"), sys.argv[5:8]):
    tbf[pair] = tbf[pair[::-1]] = float(rate.removesuffix("mbit"))
events = [json.loads(line) for f in run.rglob("events.jsonl") for line in f.read_text().splitlines() if line.strip()]
measured = [e for e in events if e.get("event") == "measured"]
newest = {e["device"]: e for e in measured}
first = {}
for e in measured:
    first.setdefault(e["device"], e)
servers = {"server-a", "server-b"}
gaps = {n: sorted(servers - {n} - set(e.get("links", {}))) for n, e in first.items()}
print("each member's first report probed every other stage server: "
      + ("yes" if not any(gaps.values()) else f"no {gaps}"))
print("measured links (each member's newest report; up = member -> peer), against the tbf rate:")
print(f"{'member':<9} {'peer':<12} {'hosts':<6} {'tbf':>5} {'rtt ms':>7} {'up':>7} {'down':>7} {'up/tbf':>7} "
      f"{'down/tbf':>8}  timed by")
worst, bad = 0.0, []
for name, e in sorted(newest.items()):
    for peer, f in sorted(e.get("links", {}).items()):
        a, b = host.get(name, "?"), host.get(peer, "?")
        rate = tbf.get(a + b)
        if rate is None or f.get("same_host"):
            ok = rate is None and f.get("same_host")
            print(f"{name:<9} {peer:<12} {a + b:<6} {'-':>5} {f['rtt_ms']:>7.2f} {'-':>7} {'-':>7}"
                  f"  same host{'' if ok else ' (WRONG: hosts ' + a + ', ' + b + ')'}")
            bad += [] if ok else [f"{name}->{peer}"]
            continue
        ru, rd = f["up_mbps"] / rate, f["down_mbps"] / rate
        worst = max(worst, abs(ru - 1), abs(rd - 1))
        bad += [f"{name}->{peer}"] if max(abs(ru - 1), abs(rd - 1)) > 0.2 else []
        print(f"{name:<9} {peer:<12} {a + '-' + b:<6} {rate:>5.0f} {f['rtt_ms']:>7.2f} {f['up_mbps']:>7.1f} "
              f"{f['down_mbps']:>7.1f} {ru:>7.2f} {rd:>8.2f}  {f.get('timed_by', '')}")
print(f"largest deviation of a measured rate from its tbf rate: {worst:.0%}; "
      f"outside 20 %: {', '.join(bad) if bad else 'none'}")
EOF
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
