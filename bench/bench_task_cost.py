"""CPU cost of the messages of one task between a worker and its stage server (shoal's handlers).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_task_cost.py [--tasks 1000] [--rounds 3]

A real stage server (one stage of the tiny model, B=1 T=16, two micro-batches) serves on
loopback in this process; a client with a worker's credential takes tasks from it and sends
their results, over and over (the bench puts each finished micro-batch back in the pool, so
the pool never runs dry and no step commits), and the process's CPU time per task is
printed (both ends together, no compute): a ``Lease`` and a ``Complete`` unary call each;
on the worker's open ``Session``, a lease request and a result each answered; and on the
session with the next lease request carried by the result (``TaskResult.next``), answered
by one ``LeaseReply`` holding the verdict. The task carries its token windows (first and
last stage), the result no tensor (one stage: no activation goes anywhere), so this is the
protocol's own cost per task, not the tensors'.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.net import shoal_pb2 as pb  # noqa: E402
from shoal.net import shoal_pb2_grpc as pbg  # noqa: E402
from shoal.net.auth import Identity, run_public_key  # noqa: E402
from shoal.net.channel import open_channel  # noqa: E402
from shoal.runtime.roles.server import StageServer  # noqa: E402
from shoal.runtime.safety.guard import GuardConfig  # noqa: E402
from shoal.runtime.transport.session import SessionClient  # noqa: E402

TOKEN, SECRET = "task-bench-token", b"task-bench-secret"
CHUNK = 1 << 20
WORKER = "w-bench"


async def _server(tmp: str) -> tuple[StageServer, object]:
    srv = StageServer("127.0.0.1:9", "127.0.0.1:0", TOKEN, tmp, name="s-bench")
    srv.spec = pb.RunSpec(version=1, run_id="task-bench", model="tiny", stages=1, steps=3, micro_batches=2,
                          micro_batch_size=1, seq_len=16, seed=0, lr=1e-3, min_lr=1e-4, warmup=1,
                          weight_decay=0.1, grad_clip=1.0, ckpt_every=0, dead_after_s=600.0, min_lease_s=600.0,
                          data="synthetic", ordered_grads=True, chunk_bytes=CHUNK)
    srv.stage, srv.first, srv.last, srv.epoch = 0, 0, 6, 0  # the whole tiny model: FWDBWD tasks
    srv.guard_cfg = GuardConfig(enabled=False)
    await srv._load(0, 0, 6, 0, 0)
    srv.ready = True
    srv.channels.identity.run_key = run_public_key(SECRET)
    return srv, await srv.start_rpc()


def _result(task: pb.Task) -> pb.TaskResult:
    return pb.TaskResult(worker=WORKER, step=task.step, mb=task.mb, direction=task.direction, epoch=task.epoch,
                         lease_id=task.lease_id, loss=1.0, compute_s=0.01)


async def _main(tasks: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-task-") as tmp:
        srv, rpc = await _server(tmp)
        try:
            async with open_channel(srv.address, TOKEN, identity=Identity.joined(TOKEN, SECRET, WORKER,
                                                                                  "worker")) as ch:
                stub = pbg.StageServerStub(ch)
                sess = SessionClient(stub.Session, WORKER, CHUNK, 1 << 24)

                def back(task: pb.Task) -> None:
                    srv._requeue(task.step, task.mb, task.direction)  # the pool never runs dry

                async def calls(n: int) -> None:
                    for _ in range(n):
                        rep = await stub.Lease(pb.LeaseRequest(worker=WORKER, wait_s=0))
                        done = await stub.Complete(_result(rep.task))
                        assert rep.has_task and done.accepted, done.reason
                        back(rep.task)

                async def session(n: int) -> None:
                    for _ in range(n):
                        rep = await sess.lease(pb.LeaseRequest(worker=WORKER, wait_s=0), timeout=10)
                        res = _result(rep.task)
                        done = await sess.complete(res, res.SerializeToString(), timeout=10)
                        assert rep.has_task and done.accepted, done.reason
                        back(rep.task)

                async def carried(n: int) -> None:
                    rep = await sess.lease(pb.LeaseRequest(worker=WORKER, wait_s=0), timeout=10)
                    for _ in range(n):
                        res = _result(rep.task)
                        ask, fut = sess.ask_with(res, pb.LeaseRequest(worker=WORKER, wait_s=0))
                        done = await sess.complete(res, res.SerializeToString(), timeout=10)
                        nxt = await sess.next_reply(ask, fut, timeout=10)
                        assert done.accepted and nxt.has_task, done.reason
                        back(rep.task)
                        rep = nxt
                    await sess.complete(_result(rep.task), _result(rep.task).SerializeToString(), timeout=10)
                    back(rep.task)

                ways = {"Lease + Complete unary calls": calls, "session: lease request, result": session,
                        "session: next request carried by the result": carried}
                if not hasattr(sess, "ask_with"):  # a tree from before requests rode on results
                    del ways["session: next request carried by the result"]
                print(f"one task (lease and result, no tensors but the task's token windows), {tasks} tasks per "
                      "way and round, CPU of both ends (one process)\n")
                print("| way | " + " | ".join(f"round {r + 1} CPU-ms" for r in range(rounds)) + " |")
                print("|---|" + "---|" * rounds)
                results: dict[str, list[float]] = {w: [] for w in ways}
                for _ in range(rounds):
                    for way, fn in ways.items():
                        await fn(50)  # warm-up
                        c0 = time.process_time()
                        await fn(tasks)
                        results[way].append((time.process_time() - c0) / tasks * 1e3)
                for way, vals in results.items():
                    print(f"| {way} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
                sess.close()
        finally:
            for t in list(srv._bg):
                t.cancel()
            await rpc.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    asyncio.run(_main(args.tasks, args.rounds))


if __name__ == "__main__":
    main()
