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

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_task_cost.py --rate K [--seconds 10] [--tls]

``--rate K``: the stage server's own rate. It serves in this process while ``K`` worker
processes each run the carried-request session loop as fast as it answers (64 micro-batches
a step, each put back in the pool once its result is taken); prints the tasks the server
took per second and its CPU-ms per task (all its threads) over ``--seconds`` after a warm-up.
The workers share the box's other cores, so on a 2-core box the rate is the two sides' and
the server's CPU per task says what one core of server could take alone.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
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


class _Refilling(StageServer):
    """A stage server whose taken results go back in its pool (the rate bench's workers never run dry)."""

    taken = 0

    async def Complete(self, request, context):
        reply = await super().Complete(request, context)
        if reply.accepted:
            self.taken += 1
            self._requeue(request.step, request.mb, request.direction)
        return reply


async def _server(tmp: str, micro_batches: int = 2, cls=StageServer, tls=None) -> tuple[StageServer, object]:
    srv = cls("127.0.0.1:9", "127.0.0.1:0", TOKEN, tmp, name="s-bench", tls=tls)
    srv.spec = pb.RunSpec(version=1, run_id="task-bench", model="tiny", stages=1, steps=3, micro_batches=micro_batches,
                          micro_batch_size=1, seq_len=16, seed=0, lr=1e-3, min_lr=1e-4, warmup=1,
                          weight_decay=0.1, grad_clip=1.0, ckpt_every=0, dead_after_s=600.0, min_lease_s=600.0,
                          data="synthetic", ordered_grads=True, chunk_bytes=CHUNK)
    srv.stage, srv.first, srv.last, srv.epoch = 0, 0, 6, 0  # the whole tiny model: FWDBWD tasks
    srv.guard_cfg = GuardConfig(enabled=False)
    await srv._load(0, 0, 6, 0, 0)
    srv.ready = True
    srv.channels.identity.run_key = run_public_key(SECRET)
    return srv, await srv.start_rpc()


def _result(task: pb.Task, worker: str = WORKER) -> pb.TaskResult:
    return pb.TaskResult(worker=worker, step=task.step, mb=task.mb, direction=task.direction, epoch=task.epoch,
                         lease_id=task.lease_id, loss=1.0, compute_s=0.01)


def _rate_worker(address: str, wid: str, until: float, q, tls_dir: str | None) -> None:
    """One worker process of ``--rate``: the carried-request loop until ``until`` (wall time)."""
    from shoal.net.tls import load_tls

    async def run() -> int:
        async with open_channel(address, TOKEN, identity=Identity.joined(TOKEN, SECRET, wid, "worker"),
                                tls=load_tls(tls_dir) if tls_dir else None) as ch:
            sess = SessionClient(pbg.StageServerStub(ch).Session, wid, CHUNK, 1 << 24)
            rep = await sess.lease(pb.LeaseRequest(worker=wid, wait_s=2), timeout=30)
            q.put(("ready", wid))
            n = 0
            while time.time() < until:
                res = _result(rep.task, wid)
                ask, fut = sess.ask_with(res, pb.LeaseRequest(worker=wid, wait_s=2))
                done = await sess.complete(res, res.SerializeToString(), timeout=30)
                rep = await sess.next_reply(ask, fut, timeout=30)
                if not (done.accepted and rep.has_task):
                    raise RuntimeError(f"{wid}: {done.reason or 'no task'}")
                n += 1
            sess.close()
            return n

    q.put(("done", asyncio.run(run())))


async def _rate(workers: int, seconds: float, tls: bool) -> None:
    from shoal.net.tls import load_tls, make_keys

    with tempfile.TemporaryDirectory(prefix="shoal-task-") as tmp:
        tls_dir = str(make_keys(Path(tmp) / "tls")) if tls else None
        srv, rpc = await _server(tmp, micro_batches=max(8, 4 * workers), cls=_Refilling,
                                 tls=load_tls(tls_dir) if tls_dir else None)
        ctx = mp.get_context("spawn")  # no fork after gRPC started
        q = ctx.Queue()
        warm = 20.0 + 2.0 * workers  # start-up of the spawned interpreters, then 2 s of warm-up
        until = time.time() + warm + seconds
        procs = [ctx.Process(target=_rate_worker, args=(srv.address, f"w-rate-{i}", until, q, tls_dir),
                             daemon=True)
                 for i in range(workers)]
        try:
            for p in procs:
                p.start()
            loop = asyncio.get_running_loop()
            for _ in procs:
                kind, _ = await loop.run_in_executor(None, q.get, True, 120)
                assert kind == "ready"
            await asyncio.sleep(max(0.0, until - seconds - time.time()))
            c0, n0, t0 = time.process_time(), srv.taken, time.time()
            await asyncio.sleep(seconds)
            c1, n1, t1 = time.process_time(), srv.taken, time.time()
            for _ in procs:
                await loop.run_in_executor(None, q.get, True, 120)
        finally:
            for p in procs:
                p.kill()
            for t in list(srv._bg):
                t.cancel()
            await rpc.stop(0)
        n = n1 - n0
        print(f"stage server rate, {workers} worker processes on sessions (next request carried by the result), "
              f"{'mutual TLS' if tls else 'plain text'}, {seconds:.0f} s, {os.cpu_count()} cores\n")
        print("| workers | tasks taken / s | server CPU-ms per task | server cores busy |")
        print("|---|---|---|---|")
        print(f"| {workers} | {n / (t1 - t0):,.0f} | {(c1 - c0) / max(1, n) * 1e3:.3f} | {(c1 - c0) / (t1 - t0):.2f} |")


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
    ap.add_argument("--rate", type=int, default=0, metavar="K", help="the server's rate with K worker processes")
    ap.add_argument("--seconds", type=float, default=10.0, help="--rate: measured seconds")
    ap.add_argument("--tls", action="store_true", help="--rate: mutual TLS as a launched run has")
    args = ap.parse_args()
    if args.rate:
        asyncio.run(_rate(args.rate, args.seconds, args.tls))
    else:
        asyncio.run(_main(args.tasks, args.rounds))


if __name__ == "__main__":
    main()
