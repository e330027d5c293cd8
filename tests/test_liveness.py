"""Liveness under network faults: a gradient push that fails is retried with the same
identity or released, never both dropped by the worker and awaited by the server.

In-process tests drive the server's handlers directly; the integration tests run real
processes with pushes that fail and a link that resets its connections periodically,
and compare the final weights with a failure-free run (torch.equal)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import encode_tensor
from shoal.runtime.roles.server import StageServer
from shoal.runtime.safety.guard import GuardConfig

M, B, T = 2, 2, 16


def _server(tmp_path) -> StageServer:
    srv = StageServer("unused:0", "127.0.0.1:0", "tok", str(tmp_path), name="t")
    srv.spec = pb.RunSpec(model="tiny", stages=1, steps=5, micro_batches=M, micro_batch_size=B, seq_len=T,
                          seed=0, lr=1e-3, min_lr=1e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                          dead_after_s=0.3, min_lease_s=5.0, data="synthetic", ordered_grads=True,
                          run_id="liveness-test")
    srv.stage, srv.first, srv.last, srv.epoch = 0, 0, 6, 0
    srv.guard_cfg = GuardConfig(enabled=False)  # the pushes here are made up
    return srv


def _grads(srv):
    return [encode_tensor(n, torch.zeros_like(p)) for n, p in srv.params.items()]


async def _compute_all(srv, worker):
    """Lease and complete every micro-batch of step 0 as ``worker``; returns its generation."""
    gen = 0
    for _ in range(M):
        a = await srv.Lease(pb.LeaseRequest(worker=worker, wait_s=0), None)
        t = a.task
        ok = await srv.Complete(pb.TaskResult(worker=worker, step=t.step, mb=t.mb, direction=t.direction,
                                              epoch=t.epoch, lease_id=t.lease_id, loss=1.0), None)
        assert ok.accepted
        gen = ok.gen
    return gen


def test_release_puts_the_micro_batches_back(tmp_path):
    """A worker that lost its gradients is told to flush; its empty push releases them."""
    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        gen = await _compute_all(srv, "A")
        rep = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
        assert rep.flush and not rep.has_task
        rel = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=gen), None)
        assert rel.accepted and rel.reason == "released" and rel.gen == gen + 1
        assert all(st.grad == "todo" for st in srv.steps[0].values())
        # redone by another worker; a late push of A's old generation is refused
        gen_b = await _compute_all(srv, "B")
        late = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=gen, mbs=[0],
                                               grads=_grads(srv)), None)
        assert not late.accepted
        for mb in range(M):
            ok = await srv.PushGrads(pb.GradPush(worker="B", step=0, epoch=0, gen=gen_b, mbs=[mb],
                                                 grads=_grads(srv)), None)
            assert ok.accepted
        assert all(st.grad == "counted" for st in srv.steps[0].values())

    asyncio.run(main())


def test_unpushed_gradients_are_voided_after_the_flush_grace(tmp_path):
    """A worker alive (it keeps leasing) but whose pushes never arrive is voided."""
    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        await _compute_all(srv, "A")
        now = 1000.0
        assert not srv._flush_repair(now)  # the grace starts now
        assert not srv._flush_repair(now + srv.flush_grace_s / 2)
        assert srv._flush_repair(now + srv.flush_grace_s + 0.1)
        assert all(st.grad == "todo" for st in srv.steps[0].values())
        assert "grad:todo=2" in srv.describe_wait()

    asyncio.run(main())


# ---------------------------------------------------------------------------- real processes

@pytest.fixture
def failure_free(tmp_path_factory):
    return failure_free_weights(tmp_path_factory)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_failed_pushes_are_retried_or_released(tmp_path, failure_free):
    """Worker 0's first push attempt is lost before it is sent, worker 1's first push lands
    but its reply is lost (the retry is a duplicate), worker 2's first push never lands
    (it releases the micro-batches): the run completes with the failure-free weights."""
    from shoal.runtime.processes.launch import launch

    out = tmp_path / "run"
    args = [["--inject", "push_fail"], ["--inject", "push_lost"], ["--inject", "push_abandon"]]
    summary = launch(launch_config(out, workers=3, worker_args=args))
    assert summary["steps"] == RUN["steps"]
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
    assert "attempt 1 of 5" in logs["worker0.log"]
    assert "attempt 1 of 5" in logs["worker1.log"]
    assert "releasing them to be redone" in logs["worker2.log"]
    servers = "".join(v for k, v in logs.items() if k.startswith("server"))
    assert "released its gradients" in servers
    assert_equal_weights(out, failure_free)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_flapping_links_to_the_servers(tmp_path, failure_free):
    """Every worker reaches the stage servers through a link that resets all its
    connections for 0.1 s every 0.6 s: the run completes with the failure-free weights."""
    import time

    from shoal.emulate.flap import FlapProxy
    from shoal.runtime.processes.launch import Swarm

    out = tmp_path / "run"
    cfg = launch_config(out, min_workers=2)
    proxies = []
    with Swarm(cfg) as sw:
        sw.cfg.workers = 0  # started below, once the servers' addresses are known
        sw.start()
        deadline = time.time() + 60
        while not all(sw.status()["servers"]):
            assert time.time() < deadline, "servers did not join"
            time.sleep(0.1)
        servers = sw.status()["servers"]
        proxies = [FlapProxy(addr, period_s=0.6, down_s=0.1, for_s=20).start() for addr in servers]
        dial = [a for addr, p in zip(servers, proxies, strict=True) for a in ("--dial-map", f"{addr}={p.address}")]
        for i in range(2):
            sw.start_worker(i, extra=dial)
        summary = sw.wait()
    for p in proxies:
        p.close()
    assert summary["steps"] == RUN["steps"]
    assert sum(p.resets for p in proxies) > 0
    assert_equal_weights(out, failure_free)
