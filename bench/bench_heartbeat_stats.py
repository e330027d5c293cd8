"""CPU of a stage server's per-heartbeat figures (``stats_snapshot`` + ``describe_wait``) at M
micro-batches: what the server spends 5 times a second on the dashboard's and the stall
report's figures, in process, no sockets.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_heartbeat_stats.py [--mbs 16,256] [--calls 2000]

The step's micro-batches are spread over every forward and gradient state and three
holders; prints the median (and range) of 5 rounds in microseconds per heartbeat.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types

from shoal.net import shoal_pb2 as pb
from shoal.runtime.pool.pool import MbState, StepMbs
from shoal.runtime.roles.server import StageServer


def server_with_step(m: int, folder: str) -> StageServer:
    """A stage-0 server of a 2-stage tiny run holding one step of ``m`` micro-batches."""
    srv = StageServer("unused:0", "127.0.0.1:0", "tok", folder, name="bench")
    srv.spec = pb.RunSpec(model="tiny", stages=2, steps=5, micro_batches=m, micro_batch_size=2, seq_len=16,
                          seed=0, dead_after_s=3, data="synthetic", run_id="bench")
    srv.stage, srv.first, srv.last, srv.epoch, srv.version, srv.step = 0, 0, 3, 0, 0, 0
    srv.cfg = types.SimpleNamespace(n_total_layers=6)  # a middle stage: forward and gradient states
    mbs = srv.steps.setdefault(0, StepMbs())
    for mb in range(m):
        st = mbs.setdefault(mb, MbState())
        st.fwd = ("todo", "leased", "done", "wait")[mb % 4]
        st.grad = ("wait", "todo", "leased", "computed")[mb % 4]
        st.holder = f"w{mb % 3}" if st.grad in ("leased", "computed") else ""
    return srv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbs", default="16,256")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for m in (int(x) for x in args.mbs.split(",")):
            srv = server_with_step(m, folder)
            rounds = []
            for _ in range(5):
                t = time.thread_time()
                for _ in range(args.calls):
                    srv.stats_snapshot()
                    srv.describe_wait()
                rounds.append((time.thread_time() - t) / args.calls * 1e6)
            print(f"M={m}: {statistics.median(rounds):.1f} us per heartbeat's figures "
                  f"(median of 5 rounds, {min(rounds):.1f}-{max(rounds):.1f})")


if __name__ == "__main__":
    main()
