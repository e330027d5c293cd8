"""The stage server's task pool, driven in-process through its RPC handlers (no sockets):
leases, late duplicates, malformed results, gradient pushes, voiding a silent worker."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import encode_tensor
from shoal.runtime.pool.pool import (
    EMPTY_TALLY,
    Lease,
    LeaseTable,
    MbState,
    StepMbs,
    TodoPool,
    holding_work,
    leave_to_faster,
    pool_figures,
    unpushed,
    wait_counts,
)
from shoal.runtime.roles.server import StageServer
from shoal.runtime.safety.guard import GuardConfig
from tests.helpers.contexts import MemberCall

M, B, T = 3, 2, 16


def _server(tmp_path) -> StageServer:
    srv = StageServer("unused:0", "127.0.0.1:0", "tok", str(tmp_path), name="t")
    srv.spec = pb.RunSpec(model="tiny", stages=1, steps=5, micro_batches=M, micro_batch_size=B, seq_len=T,
                          seed=0, lr=1e-3, min_lr=1e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                          dead_after_s=0.3, min_lease_s=0.2, data="synthetic", ordered_grads=True,
                          run_id="pool-test")
    srv.stage, srv.first, srv.last, srv.epoch = 0, 0, 6, 0
    srv.guard_cfg = GuardConfig(enabled=False)  # the pushes here are made up
    return srv


class _InProcessCoordinator:
    """A stage server's coordinator stub answered by a real coordinator of the server's run spec."""

    def __init__(self, srv: StageServer, out):
        from shoal.runtime.roles.coordinator import Coordinator

        spec = pb.RunSpec()
        spec.CopyFrom(srv.spec)
        self.coord = Coordinator(spec, "tok", out=str(out))

    async def ReportStep(self, request, timeout=None):
        return await self.coord.ReportStep(request, None)


def _grads(srv, value=0.0):
    return [encode_tensor(n, torch.full_like(p, value)) for n, p in srv.params.items()]


def _result(task, worker, loss=1.0):
    return pb.TaskResult(worker=worker, step=task.step, mb=task.mb, direction=task.direction,
                         epoch=task.epoch, lease_id=task.lease_id, loss=loss, compute_s=0.01)


def test_pool_leases_duplicates_pushes_and_voiding(tmp_path):
    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        reaper = asyncio.create_task(srv._reaper())
        try:
            a = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
            assert a.has_task and a.task.direction == pb.FWDBWD and a.task.mb == 0
            assert not a.task.HasField("input")  # stage 0: tokens are rebuilt by the worker
            # a non-finite loss is refused and the task goes back to the pool
            bad = await srv.Complete(_result(a.task, "A", loss=float("nan")), None)
            assert not bad.accepted and "not finite" in bad.reason
            a = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
            assert a.task.mb == 0
            ok = await srv.Complete(_result(a.task, "A"), None)
            assert ok.accepted
            # the same result again (an upload retried after its reply was lost): acknowledged
            # with the generation it was taken in, taken once
            dup = await srv.Complete(_result(a.task, "A"), None)
            assert dup.accepted and "duplicate" in dup.reason and dup.gen == ok.gen
            assert srv.steps[0][0].grad == "computed" and srv.tasks_per_worker["A"] == 1
            # another worker naming that lease id is refused
            other = await srv.Complete(_result(a.task, "B"), None)
            assert not other.accepted and "lease" in other.reason
            b = await srv.Lease(pb.LeaseRequest(worker="B", wait_s=0), None)
            assert b.task.mb == 1
            # B pushes a micro-batch it does not hold: refused, and B's work is voided
            rep = await srv.PushGrads(pb.GradPush(worker="B", step=0, epoch=0, gen=b.gen, mbs=[0],
                                                  grads=_grads(srv)), None)
            assert not rep.accepted
            assert srv.steps[0][1].grad == "todo" and srv.steps[0][0].grad == "computed"
            # A pushes a NaN gradient: refused, mb 0 goes back to the pool, A's generation moves
            g = _grads(srv)
            g[0] = encode_tensor(g[0].name, torch.full(tuple(g[0].shape), float("nan")))
            rep = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=ok.gen, mbs=[0], grads=g),
                                      None)
            assert not rep.accepted and "NaN" in rep.reason
            assert srv.steps[0][0].grad == "todo" and rep.gen == ok.gen + 1
            # a wrong-shaped gradient is refused too
            a = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
            ok = await srv.Complete(_result(a.task, "A"), None)
            g = _grads(srv)
            g[1] = encode_tensor(g[1].name, torch.zeros(3))
            rep = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=ok.gen, mbs=[a.task.mb],
                                                  grads=g), None)
            assert not rep.accepted and "shape" in rep.reason
            # a silent worker loses its lease (and computed gradients) after dead_after_s
            c = await srv.Lease(pb.LeaseRequest(worker="C", wait_s=0), None)
            assert c.has_task
            held = c.task.mb
            t0 = time.monotonic()
            while "C" in srv.workers and time.monotonic() - t0 < 5:
                await srv.Renew(pb.RenewRequest(worker="A"), None)  # A stays alive
                await asyncio.sleep(0.05)
            assert srv.steps[0][held].grad == "todo" and "C" not in srv.workers
            late = await srv.Complete(_result(c.task, "C"), None)
            assert not late.accepted
            # a good push is counted exactly once
            a = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
            ok = await srv.Complete(_result(a.task, "A"), None)
            rep = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=ok.gen, mbs=[a.task.mb],
                                                  grads=_grads(srv, 1.0)), None)
            assert rep.accepted and srv.steps[0][a.task.mb].grad == "counted"
            again = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=ok.gen, mbs=[a.task.mb],
                                                    grads=_grads(srv, 1.0)), None)
            # the same push again (a retry after a lost reply): acknowledged, not counted twice
            assert again.accepted and "duplicate" in again.reason
            assert srv.steps[0][a.task.mb].grad == "counted"
            assert len(srv.pushes) == 1
        finally:
            reaper.cancel()

    asyncio.run(main())


async def _last_stage_server(tmp_path) -> tuple[StageServer, torch.Tensor]:
    """A ready server of stage 1 (layers [3, 6), the last) and an activation it takes."""
    srv = _server(tmp_path)
    srv.first, srv.last, srv.stage = 3, 6, 1
    await srv._load(1, 3, 6, 0, 0)
    srv.ready = True
    return srv, torch.randn(B, T, 128)


def test_relay_is_checked_and_idempotent(tmp_path):
    async def main():
        srv, act = await _last_stage_server(tmp_path)
        bad = await srv.SubmitRelay(pb.Relay(step=0, mb=0, epoch=0, direction=pb.FWD,
                                             tensor=encode_tensor("act", act[:, :-1])), None)
        assert not bad.accepted and "shape" in bad.reason
        assert srv.steps[0][0].grad == "wait"
        for _ in range(2):
            rep = await srv.SubmitRelay(pb.Relay(step=0, mb=0, epoch=0, direction=pb.FWD,
                                                 tensor=encode_tensor("act", act)), None)
            assert rep.accepted
        assert srv.steps[0][0].grad == "todo" and torch.equal(srv.steps[0][0].input, act)
        future = await srv.SubmitRelay(pb.Relay(step=0, mb=1, epoch=3, direction=pb.FWD,
                                                tensor=encode_tensor("act", act)), None)
        assert not future.accepted and future.retry  # a later epoch than ours: ask again
        lease = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
        assert lease.task.direction == pb.FWDBWD and lease.task.HasField("input")

    asyncio.run(main())


def test_a_lossy_relay_is_kept_as_received_and_granted_undecoded(tmp_path):
    """A stage server's SubmitRelay (a peer server's relay) of an int8 activation: its header is
    checked (a wrong shape is refused), the micro-batch's input is a wire.Undecoded of the
    received frame, granted to the next worker byte for byte, and decoded only when read."""
    from shoal.net.wire import Undecoded, decode_tensor, tensor_of

    async def main():
        srv, act = await _last_stage_server(tmp_path)
        bad = await srv.SubmitRelay(pb.Relay(step=0, mb=0, epoch=0, direction=pb.FWD,
                                             tensor=encode_tensor("act", act[:, :-1], "int8")), None)
        assert not bad.accepted and "shape" in bad.reason
        sent = encode_tensor("act", act, "int8")
        rep = await srv.SubmitRelay(pb.Relay(step=0, mb=0, epoch=0, direction=pb.FWD, tensor=sent), None)
        assert rep.accepted
        kept = srv.steps[0][0].input
        assert isinstance(kept, Undecoded) and kept._tensor is None
        lease = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
        assert lease.task.direction == pb.FWDBWD and lease.task.input == sent and kept._tensor is None
        assert torch.equal(tensor_of(kept), decode_tensor(sent))

    asyncio.run(main())


def test_expired_lease_goes_back_to_the_pool(tmp_path):
    """A live worker (it keeps renewing, but not its lease) lets its lease run out: the task
    is re-queued, counted as a re-queue, and another worker gets it."""
    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        reaper = asyncio.create_task(srv._reaper())
        try:
            d = await srv.Lease(pb.LeaseRequest(worker="D", wait_s=0), None)
            held = d.task.mb
            t0 = time.monotonic()
            while srv.leases and time.monotonic() - t0 < 5:
                await srv.Renew(pb.RenewRequest(worker="D"), None)  # alive, lease not renewed
                await asyncio.sleep(0.05)
            assert "D" in srv.workers  # not voided: only the lease expired
            assert srv.steps[0][held].grad == "todo" and srv.requeues == 1
            e = await srv.Lease(pb.LeaseRequest(worker="E", wait_s=0), None)
            assert e.has_task and e.task.mb == held
        finally:
            reaper.cancel()

    asyncio.run(main())


def test_voided_worker_gives_back_its_computed_gradients(tmp_path):
    """A worker that computed a micro-batch's gradients and then went silent before pushing:
    voiding it puts that micro-batch back in the pool (its gradients will never arrive)."""
    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        reaper = asyncio.create_task(srv._reaper())
        try:
            c = await srv.Lease(pb.LeaseRequest(worker="C", wait_s=0), None)
            assert (await srv.Complete(_result(c.task, "C"), None)).accepted
            held = c.task.mb
            assert srv.steps[0][held].grad == "computed" and srv.steps[0][held].holder == "C"
            t0 = time.monotonic()
            while "C" in srv.workers and time.monotonic() - t0 < 5:
                await srv.Renew(pb.RenewRequest(worker="A"), None)  # A stays alive
                await asyncio.sleep(0.05)
            assert "C" not in srv.workers
            assert srv.steps[0][held].grad == "todo" and srv.steps[0][held].holder == ""
            a = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
            assert a.has_task and a.task.mb == held
        finally:
            reaper.cancel()

    asyncio.run(main())


def test_commit_sums_each_push_once_in_micro_batch_order(tmp_path):
    """Three pushes arrive in reverse micro-batch order with values whose fp32 sum depends on
    the order (5 + 1e8 rounds to 1e8 + 8). The committed gradient, whose squared norm the server
    reports to a real in-process coordinator, is the sum in micro-batch order, each push once:
    what the local trainer's sequential backward passes accumulate. The commit then serialises
    the new weights for the pulls to come without waiting for one."""
    from shoal.train.metrics import read_jsonl

    values = [5.0, 1e8, -1e8]  # push of micro-batch i holds values[i] everywhere

    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        srv.coord = _InProcessCoordinator(srv, tmp_path / "coord")
        leases = {}
        for w in ("A", "B", "C"):
            r = await srv.Lease(pb.LeaseRequest(worker=w, wait_s=0), None)
            ok = await srv.Complete(_result(r.task, w), None)
            assert ok.accepted
            leases[r.task.mb] = (w, ok.gen)
        for mb in (2, 1, 0):  # arrival order: the reverse of micro-batch order
            w, gen = leases[mb]
            rep = await srv.PushGrads(pb.GradPush(worker=w, step=0, epoch=0, gen=gen, mbs=[mb],
                                                  grads=_grads(srv, values[mb])), None)
            assert rep.accepted
        t0 = time.monotonic()
        while srv.version < 1 and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.02)
        assert srv.version == 1
        # The commit also serialises the new version for the pulls to come, before any asks.
        while (srv._wcache is None or srv._wcache[0][0] != 1) and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.02)
        made = pb.WeightsReply.FromString(srv._wcache[1])
        assert made.version == 1 and [f.name for f in made.params] == list(srv.params)
        return sum(p.numel() for p in srv.params.values())

    numel = asyncio.run(main())
    ordered = (torch.tensor(values[0]) + torch.tensor(values[1])) + torch.tensor(values[2])
    arrival = (torch.tensor(values[2]) + torch.tensor(values[1])) + torch.tensor(values[0])
    assert float(ordered) == 8.0 and float(arrival) == 5.0  # the order is visible in fp32
    rec = read_jsonl(tmp_path / "coord" / "metrics.jsonl")[0]
    assert rec["grad_norm"] == pytest.approx(math.sqrt(numel * float(ordered) ** 2), rel=1e-9)


def test_todo_pool_picks_lowest_todo_and_drops_stale_entries():
    """The pool hands out the lowest todo id, drops entries whose task moved on, keeps the
    ones a worker may not take (local mode) for others, and forgets committed steps."""
    state = {mb: "todo" for mb in range(5)}
    pool = TodoPool()
    for mb in (3, 0, 4, 1, 2):
        pool.add(7, "grad", mb)
    todo = lambda mb: state[mb] == "todo"  # noqa: E731
    assert pool.pick(7, "grad", todo) == 0
    state[0] = "leased"
    state[1] = "computed"  # moved on without the pool hearing of it: dropped when met
    assert pool.pick(7, "grad", todo) == 2
    state[2] = "leased"
    # local mode: 3 waits for another worker; 4 is allowed; 3 stays for the other worker
    assert pool.pick(7, "grad", todo, ok=lambda mb: mb != 3) == 4
    state[4] = "leased"
    assert pool.pick(7, "grad", todo) == 3
    state[3] = "leased"
    assert pool.pick(7, "grad", todo) is None
    state[0] = "todo"  # re-queued: added again, picked again
    pool.add(7, "grad", 0)
    pool.add(7, "grad", 0)  # a duplicate entry is harmless
    assert pool.pick(7, "grad", todo) == 0
    state[0] = "leased"
    assert pool.pick(7, "grad", todo) is None
    assert pool.pick(7, "fwd", todo) is None and pool.pick(8, "grad", todo) is None
    pool.add(8, "fwd", 1)
    pool.drop_step(8)
    assert pool.pick(8, "fwd", lambda mb: True) is None


def _scan_tally(mbs) -> tuple[dict, dict]:
    """What a step's tally must say: micro-batches per gradient state, computed ones per holder."""
    states: dict[str, int] = {}
    holders: dict[str, int] = {}
    for st in mbs.values():
        states[st.grad] = states.get(st.grad, 0) + 1
        if st.grad == "computed":
            holders[st.holder] = holders.get(st.holder, 0) + 1
    return states, holders


def _assert_tally(mbs) -> None:
    states, holders = _scan_tally(mbs)
    t = mbs.tally
    assert {k: v for k, v in t.grad.items() if v} == states and t.computed_by == holders and t.n == len(mbs)
    pairs: dict = {}
    leased: dict = {}
    for st in mbs.values():
        pairs[(st.fwd, st.grad)] = pairs.get((st.fwd, st.grad), 0) + 1
        if st.grad == "leased":
            leased[st.holder] = leased.get(st.holder, 0) + 1
    assert t.pairs == pairs and t.leased_by == leased
    for is_last in (False, True):
        _assert_figures(mbs, is_last)


def _assert_figures(mbs, is_last: bool) -> None:
    """The dashboard's and the stall report's figures from the counts equal a scan of the step
    (the expressions the server used before it kept counts)."""
    todo = sum((st.fwd == "todo") + (st.grad == "todo") for st in mbs.values())
    waiting = sum(st.grad == "wait" or (not is_last and st.fwd == "wait") for st in mbs.values())
    wait_input = sum((st.grad if is_last else st.fwd) == "wait" for st in mbs.values())
    wait_grad = sum(not is_last and st.fwd == "done" and st.grad == "wait" for st in mbs.values())
    assert pool_figures(mbs.tally, is_last) == {"todo": todo, "waiting": waiting, "wait_input": wait_input,
                                                 "wait_grad": wait_grad}
    counts: dict[str, int] = {}
    for st in mbs.values():
        counts[f"grad:{st.grad}"] = counts.get(f"grad:{st.grad}", 0) + 1
        if not is_last:
            counts[f"fwd:{st.fwd}"] = counts.get(f"fwd:{st.fwd}", 0) + 1
    assert wait_counts(mbs.tally, is_last) == counts
    assert unpushed(mbs.tally) == sorted({st.holder for st in mbs.values() if st.grad == "computed" and st.holder})
    assert holding_work(mbs.tally) == sorted({st.holder for st in mbs.values() if st.grad in ("leased", "computed")})


def _assert_leases(leases: LeaseTable) -> None:
    per: dict[str, int] = {}
    for lease in leases.values():
        per[lease.worker] = per.get(lease.worker, 0) + 1
    assert leases.per_worker == per


def test_step_tally_follows_every_state_change():
    """A step's counts (which the per-task questions read instead of scanning M micro-batches)
    follow a hand-written sequence: todo, leased, computed, a re-queue, a holder change, counted,
    a state replaced in the dict, and states changed before they joined the step."""
    mbs = StepMbs()
    assert not mbs.tally.all_in("counted")  # an empty step is not complete
    early = MbState()
    early.grad = "todo"  # changed before it is in a step: counted at insertion
    mbs[0] = early
    for mb in (1, 2):
        mbs.setdefault(mb, MbState()).grad = "todo"
    assert mbs.setdefault(1, MbState()) is mbs[1]  # setdefault keeps the state it holds
    _assert_tally(mbs)
    mbs[0].grad, mbs[0].holder = "leased", "A"
    mbs[1].grad, mbs[1].holder = "leased", "B"
    mbs[0].grad = "computed"  # holder A
    mbs[1].holder, mbs[1].grad = "A", "computed"  # the other order of a tuple assignment
    _assert_tally(mbs)
    assert mbs.tally.holds_computed("A") and not mbs.tally.holds_computed("B")
    assert not mbs.tally.all_in("computed", "counted")
    mbs[1].holder = "B"  # a computed gradient changes holder: counted under B now
    assert mbs.tally.computed_by == {"A": 1, "B": 1}
    mbs[1].grad, mbs[1].holder = "todo", ""  # re-queued (voided)
    _assert_tally(mbs)
    assert mbs.tally.computed_by == {"A": 1}
    mbs[1].grad, mbs[1].holder = "computed", "B"
    mbs[2].grad, mbs[2].holder = "computed", "B"
    assert mbs.tally.all_in("computed", "counted") and not mbs.tally.all_in("counted")
    for mb in range(3):
        mbs[mb].grad = "counted"
    assert mbs.tally.all_in("counted") and mbs.tally.computed_by == {}
    gone = mbs[2]
    mbs[2] = MbState()  # replaced: the old state no longer reports here
    _assert_tally(mbs)
    assert not mbs.tally.all_in("counted")
    before = dict(mbs.tally.grad)
    gone.grad = "todo"
    assert dict(mbs.tally.grad) == before
    mbs[1].grad = "todo"
    assert mbs.tally.grad["todo"] == 1
    _assert_tally(mbs)


def test_step_figures_follow_a_pipeline_step():
    """The per-heartbeat figures (pool todo/waiting, inputs and gradients awaited, un-pushed
    holders, the stall report's state counts) kept as counts equal a scan at every event of a
    hand-written step at a middle stage: inputs arrive, forwards are leased, done and re-queued,
    output gradients arrive, gradient tasks are leased, computed, voided, moved and counted."""
    assert pool_figures(EMPTY_TALLY, False) == {"todo": 0, "waiting": 0, "wait_input": 0, "wait_grad": 0}
    assert wait_counts(EMPTY_TALLY, True) == {} and unpushed(EMPTY_TALLY) == holding_work(EMPTY_TALLY) == []
    mbs = StepMbs()
    events = [
        (0, "fwd", "todo", None), (1, "fwd", "todo", None),  # inputs of mbs 0 and 1 came
        (0, "fwd", "leased", None), (2, "fwd", "todo", None),
        (0, "fwd", "done", None), (1, "fwd", "leased", None),
        (1, "fwd", "todo", None),  # lease expired: re-queued
        (1, "fwd", "leased", None), (1, "fwd", "done", None), (2, "fwd", "leased", None),
        (0, "grad", "todo", ""),  # the next stage's gradient for mb 0 came
        (0, "grad", "leased", "A"), (1, "grad", "todo", ""), (1, "grad", "leased", "B"),
        (0, "grad", "computed", "A"), (2, "fwd", "done", None),
        (1, "grad", "computed", "B"), (2, "grad", "todo", ""), (2, "grad", "leased", ""),
        (2, None, None, "A"),  # a leased gradient task's holder set after its state
        (1, "grad", "todo", ""),  # B voided: its computed gradient is redone
        (1, "grad", "leased", "A"), (1, None, None, "C"),  # moved to another worker
        (1, "grad", "computed", "C"), (2, "grad", "computed", "A"),
        (0, "grad", "counted", "A"), (1, "grad", "counted", "C"), (2, "grad", "counted", "A"),
    ]
    for mb in range(3):
        mbs[mb] = MbState()
    mbs[3] = MbState()  # one whose input never comes
    _assert_tally(mbs)
    for mb, what, state, holder in events:
        st = mbs[mb]
        if what == "fwd":
            st.fwd = state
        elif what == "grad":
            st.grad = state
        if holder is not None:
            st.holder = holder
        _assert_tally(mbs)
    mbs[3] = MbState()  # replaced: the old state's pair leaves the counts
    _assert_tally(mbs)


def test_lease_table_counts_each_workers_leases():
    """Whether a worker holds another lease (asked at every result) is a count kept through
    insertions, replacements, deletions, pops and a clear."""
    leases = LeaseTable()

    def lease(lid, w):
        return Lease(lid, 0, lid, pb.BWD, w, 1.0, 0.0)

    leases[1], leases[2], leases[3] = lease(1, "A"), lease(2, "A"), lease(3, "B")
    assert leases.held("A") == 2 and leases.held("B") == 1 and leases.held("C") == 0
    leases[2] = lease(2, "C")  # the same id replaced
    _assert_leases(leases)
    del leases[1]
    assert leases.pop(3).worker == "B" and leases.pop(3, None) is None
    with pytest.raises(KeyError):
        leases.pop(3)
    assert leases.setdefault(4, lease(4, "A")).worker == "A" and leases.setdefault(4, lease(4, "B")).worker == "A"
    _assert_leases(leases)
    assert leases.held("A") == 1 and leases.held("B") == 0
    leases.clear()
    assert leases.per_worker == {} and leases.held("C") == 0


def _scan_pick(mbs) -> tuple[int, int] | None:
    """What a lease pick must choose: the lowest todo forward, else the lowest todo backward."""
    for mb in sorted(mbs):
        if mbs[mb].fwd == "todo":
            return mb, pb.FWD
    for mb in sorted(mbs):
        if mbs[mb].grad == "todo":
            return mb, pb.BWD
    return None


def test_lease_pick_matches_a_full_scan_through_relays_leases_requeues_and_voids(tmp_path):
    """A middle stage (forward and backward tasks) driven through its handlers by a seeded
    random mix of relays in both directions, leases, results, expired leases and voided
    workers: every lease picks exactly what a scan over all micro-batches would."""
    import random

    rng = random.Random(5)
    m = 16

    async def main():
        srv = _server(tmp_path)
        srv.spec.micro_batches = m
        srv.spec.stages = 3
        srv.stage, srv.first, srv.last = 1, 2, 4
        await srv._load(1, 2, 4, 0, 0)
        srv.ready = True
        act = encode_tensor("act", torch.randn(B, T, 128))
        held: dict[int, pb.Task] = {}  # lease id -> task
        picks = done = 0
        for _ in range(400):
            op = rng.random()
            mbs = srv.steps[0]
            if op < 0.25:
                mb, direction = rng.randrange(m), rng.choice((pb.FWD, pb.BWD))
                rep = await srv.SubmitRelay(pb.Relay(step=0, mb=mb, epoch=0, direction=direction, tensor=act), None)
                assert rep.accepted
            elif op < 0.6:
                want = _scan_pick(mbs)
                w = rng.choice("ABC")
                rep = await srv.Lease(pb.LeaseRequest(worker=w, wait_s=0), None)
                got = (rep.task.mb, rep.task.direction) if rep.has_task else None
                assert got == want
                if rep.has_task:
                    held[rep.task.lease_id] = rep.task
                    picks += 1
            elif op < 0.8 and held:
                lid = rng.choice(sorted(held))
                task = held.pop(lid)
                w = srv.leases[lid].worker if lid in srv.leases else "A"
                res = _result(task, w)
                res.output.CopyFrom(encode_tensor("out", torch.randn(B, T, 128)))
                done += (await srv.Complete(res, None)).accepted
            elif op < 0.9 and srv.leases:
                lid = rng.choice(sorted(srv.leases))  # the reaper's expiry path
                lease = srv.leases.pop(lid)
                held.pop(lid, None)
                srv._requeue(lease.step, lease.mb, lease.direction)
            else:
                w = rng.choice("ABC")
                if w in srv.workers:
                    srv._void_worker(w, "test")
                    held = {k: t for k, t in held.items() if k in srv.leases}
            _assert_tally(srv.steps[0])  # the counts the per-task checks read agree with a scan
            _assert_leases(srv.leases)
        for t in list(srv._bg):
            t.cancel()
        return picks, done

    picks, done = asyncio.run(main())
    assert picks > 50 and done > 20


async def _one_step(srv, coord_stub, value: float) -> None:
    """Drive one whole step of a one-stage server in process: lease, result and push of every
    micro-batch, then wait for the commit."""
    srv.coord = coord_stub
    step = srv.step
    for _ in range(M):
        r = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
        ok = await srv.Complete(_result(r.task, "A"), None)
        rep = await srv.PushGrads(pb.GradPush(worker="A", step=step, epoch=0, gen=ok.gen, mbs=[r.task.mb],
                                              grads=_grads(srv, value)), None)
        assert rep.accepted, rep.reason
    t0 = time.monotonic()
    while srv.version < step + 1 and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.01)
    assert srv.version == step + 1


def test_checkpoints_are_written_off_the_loop_and_hold_their_version(tmp_path):
    """With --ckpt-every 1 each commit starts its checkpoint in a thread; the next commit waits
    for it before changing the weights, so v1 holds exactly the weights of version 1 even
    though step 1 commits right after. A write that fails is not lost: the server's fatal
    reason (sent to the coordinator with its heartbeats) names it, unless the stage moved on
    while it was written (then it is abandoned with a warning)."""
    from shoal.runtime.common import read_stage_ckpt

    async def main():
        srv = _server(tmp_path / "ckpt")
        srv.spec.ckpt_every = 1
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        coord = _InProcessCoordinator(srv, tmp_path / "coord")
        await _one_step(srv, coord, 0.5)
        v1 = {n: p.detach().clone() for n, p in srv.params.items()}
        first = srv.ckpt_task
        assert first is not None
        await _one_step(srv, coord, -0.25)
        assert first.done() and srv.ckpt_task is not first
        await srv._ckpt_written()
        saved = read_stage_ckpt(srv.ckpt_root, 0, 1, run_id="pool-test", layers=(0, 6))
        assert all(torch.equal(saved[f"param/{n}"], t) for n, t in v1.items())
        assert any(not torch.equal(v1[n], p) for n, p in srv.params.items())  # version 2 moved on
        assert srv.fatal == ""
        # The heartbeat's checkpoint version: its own writes are known good (no thread, no read);
        # a newest file changed by someone else is checked in a thread, and a bad one set aside.
        assert srv._ckpt_version_known() == 2 == srv._ckpt_version()
        v2 = Path(srv.ckpt_root) / "run-pool-test" / "stage0" / "v2.safetensors"
        v2.write_bytes(v2.read_bytes()[:-8])
        assert srv._ckpt_version_known() is None
        assert srv._ckpt_version() == 1 and not v2.exists()
        assert srv._ckpt_version_known() == 1
        # a checkpoint folder that cannot be made: the background write fails, and it is seen
        (tmp_path / "blocked").write_text("a file where the folder should be")
        srv.ckpt_root = str(tmp_path / "blocked")
        srv._start_ckpt()
        srv.epoch += 1  # ... unless the stage moved on meanwhile (a roll-back, another server):
        await srv._ckpt_written()  # then that write is abandoned, not the run
        await asyncio.sleep(0)
        assert srv.fatal == ""
        srv._start_ckpt()
        await srv._ckpt_written()
        await asyncio.sleep(0)  # the done callback runs
        assert "cannot write the stage 0 checkpoint" in srv.fatal

    asyncio.run(main())


async def _local_server_in_round(tmp_path):
    """A loaded stage-0 server in local mode (H = 2), at step 1: the end of its first round,
    whose merge (version 2) collects the pseudo-gradients."""
    srv = _server(tmp_path)
    srv.spec.sync_mode, srv.spec.sync_every = "local", 2
    await srv._load(0, 0, 6, 0, 0)
    srv.ready = True
    srv.step = 1
    srv.local_collect = 2
    return srv


def test_local_pseudo_gradient_covering_nothing_is_no_contribution(tmp_path):
    """A worker that missed a step's decision dropped that gradient: its pseudo-gradient
    covers fewer micro-batches than the server counted (the merge weighs it by the lower
    count), and one that covers none is zero, which is not screened (an honest run once
    banned such a worker as '0 below the median') nor merged, and the merge stops waiting."""
    async def main():
        srv = await _local_server_in_round(tmp_path)
        srv.local_collect_mbs = {"A": 2, "B": 1}
        srv.local_expect, srv.local_got = {"A", "B"}, srv._new_round_pushes()
        push = dict(step=1, epoch=0, local_round=2, grads=_grads(srv, 0.5))
        a = await srv.PushGrads(pb.GradPush(worker="A", local_mbs=1, **push), None)
        assert a.accepted and "A" in srv.local_got and srv.local_collect_mbs["A"] == 1
        b = await srv.PushGrads(pb.GradPush(worker="B", local_mbs=0, **push), None)
        assert b.accepted and "nothing to merge" in b.reason
        assert "B" not in srv.local_got and srv.local_expect == {"A", "B"} - {"B"}
        # reporting more than the server counted raises nothing
        srv.local_got.pop("A")
        again = await srv.PushGrads(pb.GradPush(worker="A", local_mbs=9, **push), None)
        assert again.accepted and srv.local_collect_mbs["A"] == 1

    asyncio.run(main())


def test_a_withdrawn_pseudo_gradient_is_no_longer_awaited(tmp_path):
    """A worker whose pseudo-gradient cannot come withdraws it: the merge stops waiting for it
    (it is neither voided nor banned, and the round's counts are left as they were); one whose
    pseudo-gradient landed (its reply lost) stays in the merge; a withdrawal for a merge that
    does not await the worker changes nothing."""
    async def main():
        srv = await _local_server_in_round(tmp_path)
        for w in ("A", "B"):
            srv._worker(w)
        srv.local_collect_mbs = {"A": 2, "B": 2}
        srv.local_expect, srv.local_got = {"A", "B", "C"}, srv._new_round_pushes()
        push = dict(step=1, epoch=0, local_round=2, local_mbs=2)
        assert (await srv.PushGrads(pb.GradPush(worker="A", grads=_grads(srv, 0.5), **push), None)).accepted
        withdraw = dict(step=1, epoch=0, local_round=2, local_withdraw=True)
        a = await srv.PushGrads(pb.GradPush(worker="A", **withdraw), None)
        assert a.accepted and a.reason == "duplicate pseudo-gradient" and "A" in srv.local_got
        b = await srv.PushGrads(pb.GradPush(worker="B", **withdraw), None)
        assert b.accepted and b.reason == "withdrawn from the merge"
        assert srv.local_expect == {"A", "C"} and "B" not in srv.local_got and "B" in srv.workers
        assert srv.local_collect_mbs == {"A": 2, "B": 2} and not srv.guard_banned
        late = await srv.PushGrads(pb.GradPush(worker="B", grads=_grads(srv, 0.5), **push), None)
        assert not late.accepted and "no merge awaits" in late.reason
        stale = await srv.PushGrads(pb.GradPush(worker="C", **{**withdraw, "local_round": 4}), None)
        assert not stale.accepted and srv.local_expect == {"A", "C"}

    asyncio.run(main())


def test_a_worker_leaving_after_its_pseudo_gradient_keeps_its_weight(tmp_path):
    """A worker moved to another stage at the round's end leaves right after sending its
    pseudo-gradient: voiding it then must not zero its count or learning-rate sum in the merge
    (the merge once weighed such a survivor 0 and screened it as a 3e12x outlier); one that
    leaves before sending drops out of the merge. Both drop out of the round in progress (with
    delayed application, the next one)."""
    async def main():
        srv = await _local_server_in_round(tmp_path)
        for w in ("A", "B"):
            srv._worker(w)
        srv.local_collect_mbs, srv.local_collect_lr = {"A": 2, "B": 2}, {"A": 0.2, "B": 0.2}
        srv.local_round_mbs, srv.local_round_lr = {"A": 1, "B": 1}, {"A": 0.1, "B": 0.1}
        srv.local_expect, srv.local_got = {"A", "B"}, srv._new_round_pushes()
        push = dict(step=1, epoch=0, local_round=2, local_mbs=2, grads=_grads(srv, 0.5))
        assert (await srv.PushGrads(pb.GradPush(worker="A", **push), None)).accepted
        srv._void_worker("A", "left")
        srv._void_worker("B", "left")
        assert srv.local_collect_mbs == {"A": 2} and srv.local_collect_lr == {"A": 0.2}
        assert srv.local_expect == {"A"} and set(srv.local_got) == {"A"}
        assert srv.local_round_mbs == {} and srv.local_round_lr == {}

    asyncio.run(main())


def test_a_lease_asked_ahead_yields_to_a_worker_waiting_idle(tmp_path):
    """A worker asking for its next task while it computes (``ahead``) gets one only when no
    other worker of the stage waits idle for one; the idle worker gets the task that frees."""
    async def main():
        srv = _server(tmp_path)
        srv.spec.min_lease_s = srv.spec.dead_after_s = 30.0  # nothing runs out during the test
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        reaper = asyncio.create_task(srv._reaper())
        try:
            # Nobody idle: a request made ahead takes a task like any other.
            leased = [await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None),
                      await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0, ahead=True), None),
                      await srv.Lease(pb.LeaseRequest(worker="C", wait_s=0), None)]
            assert all(r.has_task for r in leased)
            assert sorted(r.task.mb for r in leased) == list(range(M))
            # The pool is empty. A asks ahead first, then B waits idle: both long-poll.
            ahead = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="A", wait_s=0.5, ahead=True), None))
            await asyncio.sleep(0.05)
            idle = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="B", wait_s=2.0), None))
            await asyncio.sleep(0.05)
            assert srv.idle_asking == {"B": 1}
            # One task comes free (C leaves): the idle worker gets it, not the earlier request ahead.
            await srv.Leave(pb.MemberRequest(member_id="C"), None)
            got = await asyncio.wait_for(idle, 5)
            assert got.has_task and got.task.mb == leased[2].task.mb
            assert not (await asyncio.wait_for(ahead, 5)).has_task
            assert srv.idle_asking == {}
        finally:
            reaper.cancel()

    asyncio.run(main())


def test_leave_to_faster_counts_only_measured_faster_idle_workers():
    idle = {"slow": 1.0, "mid": 0.5, "fast": 0.1, "new": None, "near": 0.9}
    assert leave_to_faster(idle, "slow", 1) and leave_to_faster(idle, "slow", 2)
    assert not leave_to_faster(idle, "slow", 3)  # more open tasks than faster idle workers
    assert leave_to_faster(idle, "mid", 1) and not leave_to_faster(idle, "mid", 2)
    assert not leave_to_faster(idle, "fast", 1)
    assert not leave_to_faster(idle, "new", 1)  # unmeasured: neither yields nor is yielded to
    assert not leave_to_faster(idle, "slow", 0)
    assert not leave_to_faster({"a": 0.2, "b": 0.2}, "a", 1)  # equals: the older request takes it
    assert not leave_to_faster({"a": 0.24, "b": 0.2}, "a", 1)  # within FASTER_BY: first come as before
    assert not leave_to_faster(idle, "near", 3) and leave_to_faster(idle, "near", 2)


def test_an_open_task_goes_to_the_fastest_idle_worker(tmp_path):
    """Two workers wait idle for a task, the slower one asked first: the task that comes free
    goes to the faster (the step ends when its slowest task does); the slower one's request
    ends without a task. With as many open tasks as idle workers each gets one."""
    async def main():
        srv = _server(tmp_path)
        srv.spec.min_lease_s = srv.spec.dead_after_s = 30.0  # nothing runs out during the test
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        srv._worker("S").ewma_s = 1.0
        srv._worker("F").ewma_s = 0.1
        reaper = asyncio.create_task(srv._reaper())
        try:
            held = [await srv.Lease(pb.LeaseRequest(worker=f"C{i}", wait_s=0), None) for i in range(M)]
            assert all(r.has_task for r in held)
            slow = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="S", wait_s=0.6), None))
            await asyncio.sleep(0.05)
            fast = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="F", wait_s=2.0), None))
            await asyncio.sleep(0.05)
            assert srv.idle_asking == {"S": 1, "F": 1}
            await srv.Leave(pb.MemberRequest(member_id="C0"), None)  # its task comes free
            got = await asyncio.wait_for(fast, 5)
            assert got.has_task and got.task.mb == held[0].task.mb
            assert not (await asyncio.wait_for(slow, 5)).has_task
            # Two tasks free, two idle workers: both get one, the slower too.
            slow = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="S", wait_s=2.0), None))
            fast = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="F2", wait_s=2.0), None))
            srv._worker("F2").ewma_s = 0.1
            await asyncio.sleep(0.05)
            await srv.Leave(pb.MemberRequest(member_id="C1"), None)
            await srv.Leave(pb.MemberRequest(member_id="C2"), None)
            got = [await asyncio.wait_for(t, 5) for t in (slow, fast)]
            assert all(r.has_task for r in got)
            assert sorted(r.task.mb for r in got) == sorted(r.task.mb for r in held[1:])
        finally:
            reaper.cancel()

    asyncio.run(main())


def test_a_result_carrying_the_next_lease_request_is_answered_in_one_message(tmp_path):
    """On a worker's session a result may carry its next lease request (the worker is idle
    once its result is out): the server answers both with one LeaseReply that holds the
    result's verdict when it has a task to grant, and sends the verdict first (the task
    later) when the request has to wait. The attached request is the caller's own whatever
    worker it names."""
    from shoal.net.stream import split
    from shoal.runtime.transport.session import DOWN_KINDS, read_messages

    async def main():
        srv = _server(tmp_path)
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        up: asyncio.Queue = asyncio.Queue()

        async def chunks():
            while (msg := await up.get()) is not None:
                for c in split(type(msg).__name__, msg.SerializeToString(), 1 << 20, "A"):
                    yield c

        down = read_messages(srv.Session(chunks(), MemberCall("A")), DOWN_KINDS, lambda _kind: 1 << 26)

        async def next_msg():
            kind, msg = await asyncio.wait_for(down.__anext__(), 30)
            return kind, msg

        up.put_nowait(pb.LeaseRequest(worker="A", wait_s=0, ask_id=1))
        kind, first = await next_msg()
        assert kind == "LeaseReply" and first.ask_id == 1 and first.task.mb == 0
        res = _result(first.task, "A")
        res.next.CopyFrom(pb.LeaseRequest(worker="B", wait_s=1.0, ask_id=2))  # names another worker
        up.put_nowait(res)
        kind, second = await next_msg()
        assert kind == "LeaseReply" and second.ask_id == 2 and second.has_task and second.task.mb == 1
        assert second.result.accepted and second.result.lease_id == first.task.lease_id
        assert srv.leases[second.task.lease_id].worker == "A" and "B" not in srv.workers
        assert srv.steps[0][0].grad == "computed" and srv.steps[0][0].holder == "A"
        # Nothing else was sent for that result: the next message answers the next request.
        up.put_nowait(pb.LeaseRequest(worker="A", wait_s=0, ask_id=3))
        kind, third = await next_msg()
        assert kind == "LeaseReply" and third.ask_id == 3 and third.task.mb == 2
        # No task left to grant (mb 2 is leased): the verdict first, the lease reply when its wait ends.
        res = _result(second.task, "A")
        res.next.CopyFrom(pb.LeaseRequest(worker="A", wait_s=0.5, ask_id=4))
        up.put_nowait(res)
        kind, verdict = await next_msg()
        assert kind == "CompleteReply" and verdict.accepted and verdict.lease_id == second.task.lease_id
        kind, waited = await next_msg()
        assert kind == "LeaseReply" and waited.ask_id == 4 and not waited.has_task and not waited.HasField("result")
        # The last result with a request: every gradient is computed now, so the reply says push.
        res = _result(third.task, "A")
        res.next.CopyFrom(pb.LeaseRequest(worker="A", wait_s=0.5, ask_id=5))
        up.put_nowait(res)
        kind, last = await next_msg()
        assert kind == "LeaseReply" and last.ask_id == 5 and last.flush and last.result.accepted
        assert srv.steps[0].tally.all_in("computed")
        up.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await next_msg()
        for t in list(srv._bg):
            t.cancel()

    asyncio.run(main())


def test_signal_wakes_every_waiter_times_out_and_forgets_cancelled_waits():
    """The pool's long-poll signal: a notify wakes every waiter (True), a wait with no
    notify ends False at its timeout, and neither a cancelled nor a timed-out wait stays
    behind among the waiters."""
    from shoal.runtime.common import Signal

    async def main():
        sig = Signal()
        waits = [asyncio.create_task(sig.wait(30)) for _ in range(3)]
        await asyncio.sleep(0)
        assert len(sig._waiters) == 3
        sig.notify_all()
        assert await asyncio.gather(*waits) == [True, True, True] and sig._waiters == []
        assert await sig.wait(0.01) is False and sig._waiters == []
        gone = asyncio.create_task(sig.wait(30))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert sig._waiters == []
        sig.notify_all()  # nobody waits: nothing to wake
        later = asyncio.create_task(sig.wait(30))
        await asyncio.sleep(0)
        sig.notify_all()
        assert await later is True


def test_an_idle_lease_request_is_answered_at_the_commit(tmp_path):
    """A worker long-polling for a task while the step commits is answered by the commit
    itself (it then pulls the new weights), not at the end of its wait: idle workers of a
    large swarm need not poll the server to learn of a new version."""

    async def main():
        srv = _server(tmp_path)
        srv.spec.steps = 1  # no tasks after the commit: nothing else would answer the request
        await srv._load(0, 0, 6, 0, 0)
        srv.ready = True
        srv.coord = _InProcessCoordinator(srv, tmp_path / "coord")
        done = []
        for _ in range(M):
            r = await srv.Lease(pb.LeaseRequest(worker="A", wait_s=0), None)
            ok = await srv.Complete(_result(r.task, "A"), None)
            done.append((r.task.mb, ok.gen))
        idle = asyncio.create_task(srv.Lease(pb.LeaseRequest(worker="D", wait_s=60), None))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not idle.done()  # nothing to hand out, nothing to push: it waits
        for mb, gen in done:
            rep = await srv.PushGrads(pb.GradPush(worker="A", step=0, epoch=0, gen=gen, mbs=[mb],
                                                  grads=_grads(srv, 1.0)), None)
            assert rep.accepted
        t0 = time.monotonic()
        while srv.version < 1 and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.01)
        assert srv.version == 1
        for _ in range(50):  # a few turns of the loop after the commit's wake-up, no wall-clock wait
            if idle.done():
                break
            await asyncio.sleep(0)
        assert idle.done()
        rep = idle.result()
        assert not rep.has_task and rep.version == 1

    asyncio.run(main())
