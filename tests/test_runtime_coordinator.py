"""The coordinator's decisions, driven in-process through its RPC handlers: readiness and
planning on the joined devices, the step commit, and the roll-back after a server dies."""

from __future__ import annotations

import asyncio
import math
import time

from shoal.net import shoal_pb2 as pb
from shoal.runtime.roles.coordinator import (
    Coordinator,
    asks_final,
    beat_floor_s,
    busy_excuse,
    final_refusal,
    replan_wait,
    stage_without_worker,
)
from shoal.train.metrics import read_jsonl
from shoal.train.optim import OptimConfig, clip_coefficient, lr_at

SPEC = pb.RunSpec(model="tiny", stages=2, steps=3, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                  lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0, dead_after_s=0.3,
                  min_lease_s=1.0, data="synthetic", ordered_grads=True)


def test_ready_plan_commit_and_rollback(tmp_path):
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        s0 = (await c.Join(pb.JoinRequest(role="server", address="127.0.0.1:1", name="s0"), None)).member_id
        s1 = (await c.Join(pb.JoinRequest(role="server", address="127.0.0.1:2", name="s1"), None)).member_id
        w0 = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w0"), None)).member_id
        a = await c.Heartbeat(pb.MemberRequest(member_id=w0), None)
        assert not a.ready and a.stage == -1  # waits for --min-workers
        w1 = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w1"), None)).member_id
        hb = {m: await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=0), None) for m in (s0, s1, w0, w1)}
        assert all(h.ready for h in hb.values())
        assert sorted(hb[m].stage for m in (s0, s1)) == [0, 1]
        assert sorted(hb[m].stage for m in (w0, w1)) == [0, 1]  # every stage has a worker
        layers = [(hb[m].first, hb[m].last) for m in sorted((s0, s1), key=lambda m: hb[m].stage)]
        assert layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == 6
        by_stage = {hb[m].stage: m for m in (s0, s1)}

        # step 0: both stages report; the decision is the shared optimizer's
        r0 = pb.StepReport(member_id=by_stage[0], stage=0, step=0, epoch=0, sq_norm=3.0)
        r1 = pb.StepReport(member_id=by_stage[1], stage=1, step=0, epoch=0, sq_norm=1.0, losses=[2.0, 4.0])
        r1.tasks_per_worker[w1] = 2
        d0, d1 = await asyncio.gather(c.ReportStep(r0, None), c.ReportStep(r1, None))
        assert d0 == d1 and d0.ready
        ocfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.1, grad_clip=1.0)
        assert math.isclose(d0.coef, clip_coefficient(4.0, 1.0)) and math.isclose(d0.lr, lr_at(0, 3, ocfg))
        rec = read_jsonl(tmp_path / "metrics.jsonl")[0]
        assert rec["step"] == 0 and rec["loss"] == 3.0 and math.isclose(rec["grad_norm"], 2.0)
        assert rec["tasks_per_worker"] == {"w1": 2}
        # a repeated report gets the same decision (idempotent)
        assert await c.ReportStep(r0, None) == d0

        # the stage 1 server dies; a standby joins and restores; everyone rolls back
        await asyncio.sleep(0.7)  # > 2 x dead_after_s: all members silent
        alive = by_stage[0]
        for m in (alive, w0, w1):
            await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=1), None)
        reaper = asyncio.create_task(c.reap())
        await asyncio.sleep(0.2)
        reaper.cancel()
        assert by_stage[1] not in c.members and c.stage_server[1] == ""
        s2 = (await c.Join(pb.JoinRequest(role="server", address="127.0.0.1:3", name="s2"), None)).member_id
        assert c.stage_server[1] == s2 and c.pending_restore
        a = await c.Heartbeat(pb.MemberRequest(member_id=alive, ckpt_version=1), None)
        assert not a.ready  # the new server has not said what it can restore
        a = await c.Heartbeat(pb.MemberRequest(member_id=s2, ckpt_version=0), None)
        assert a.epoch == 1 and a.restart_version == 0 and a.stage == 1
        # reports from the old epoch are stale now
        stale = await c.ReportStep(pb.StepReport(member_id=alive, stage=0, step=1, epoch=0), None)
        assert stale.stale
        events = [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")]
        assert "server_restart" in events and "rollback" in events

    asyncio.run(main())


def test_dead_lone_worker_forces_a_replan(tmp_path):
    """3 workers on 2 stages: the only worker of one stage stops heartbeating. The reaper
    drops it and the coordinator must re-plan, moving a worker into the emptied stage (or
    that stage's tasks would never be leased again)."""
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=3, out=str(tmp_path))
        servers = [(await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"),
                                 None)).member_id for i in range(2)]
        workers = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
                   for i in range(3)]
        hb = {m: await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=0), None)
              for m in servers + workers}
        assert all(h.ready for h in hb.values())
        per_stage = {s: [w for w in workers if hb[w].stage == s] for s in (0, 1)}
        lone_stage = next(s for s, ws in per_stage.items() if len(ws) == 1)
        (lone,) = per_stage[lone_stage]
        reaper = asyncio.create_task(c.reap())
        try:
            t0 = asyncio.get_running_loop().time()
            while lone in c.members and asyncio.get_running_loop().time() - t0 < 5:
                for m in servers + workers:
                    if m != lone:
                        await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=0), None)
                await asyncio.sleep(0.05)
        finally:
            reaper.cancel()
        assert lone not in c.members
        assert sorted(set(c.assign.values())) == [0, 1], c.assign  # no stage left empty
        assert lone not in c.assign
        moved = [w for w in workers if w != lone and c.assign.get(w) == lone_stage]
        assert moved
        a = await c.Heartbeat(pb.MemberRequest(member_id=moved[0], ckpt_version=0), None)
        assert a.stage == lone_stage  # the moved worker is told its new stage
        events = read_jsonl(tmp_path / "events.jsonl")
        assert any(e["event"] == "replan" and e["why"] == "missed heartbeats" for e in events), events

    asyncio.run(main())


def test_a_worker_that_dies_before_measuring_does_not_hold_the_start(tmp_path):
    """4 measuring workers join; one is killed before it reports its measurement and the
    other three have measured: once the reaper drops it, the run starts (the start waited
    for its measurement alone, and nothing else would ever call for the plan again)."""
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=3, out=str(tmp_path))
        servers = [(await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"),
                                 None)).member_id for i in range(2)]
        workers = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}", will_measure=True),
                                 None)).member_id for i in range(4)]
        c._ask_measure()
        links = [pb.LinkProbe(target=f"127.0.0.1:{i + 1}", rtt_s=1e-3, up_bps=1e8, down_bps=1e8) for i in range(2)]
        for w in workers[1:]:
            await c.Measured(pb.MeasureReport(member_id=w, flops=2e9, request=1, links=links), None)
        assert not c.ready  # w0 has not measured
        reaper = asyncio.create_task(c.reap())
        try:
            t0 = asyncio.get_running_loop().time()
            while not c.ready and asyncio.get_running_loop().time() - t0 < 5:
                for m in servers + workers[1:]:
                    await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=0), None)
                await asyncio.sleep(0.05)
        finally:
            reaper.cancel()
        assert workers[0] not in c.members
        assert c.ready and sorted(set(c.assign.values())) == [0, 1]

    asyncio.run(main())


def test_a_measurement_without_every_stage_server_is_asked_again(tmp_path):
    """A worker whose report lacks a link to a stage server is not placed on it: the
    coordinator asks it to measure again (event remeasure, naming the server), and plans
    once a report covers every stage server."""
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=1, out=str(tmp_path))
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        w = (await c.Join(pb.JoinRequest(role="worker", name="w0", will_measure=True), None)).member_id
        c._ask_measure()
        link = {i: pb.LinkProbe(target=f"127.0.0.1:{i + 1}", rtt_s=1e-3, up_bps=1e8, down_bps=1e8) for i in range(2)}
        await c.Measured(pb.MeasureReport(member_id=w, flops=2e9, request=1, links=[link[0]]), None)
        assert not c._settled(c.members[w]) and c.members[w].measure_req == 2  # asked again, not placeable
        await c.Measured(pb.MeasureReport(member_id=w, flops=2e9, request=2, links=[link[0], link[1]]), None)
        assert c._settled(c.members[w])
        assert {p.dst for p in c.figures[w].paths} == {m for m in c.members if m.startswith("s")}
        events = read_jsonl(tmp_path / "events.jsonl")
        assert [e["why"] for e in events if e["event"] == "remeasure"] == ["no link figures to s1"]

    asyncio.run(main())


def test_replan_wait_keeps_replans_to_their_share_of_the_time():
    # a cheap re-plan is never put off
    assert replan_wait(now=10.0, last_end=10.0, last_cost_s=0.05) == 0.0
    # one that took 1 s waits 4 s after its end at the default share of 0.2 ...
    assert math.isclose(replan_wait(now=10.0, last_end=10.0, last_cost_s=1.0), 4.0)
    assert math.isclose(replan_wait(now=12.5, last_end=10.0, last_cost_s=1.0), 1.5)
    assert replan_wait(now=14.0, last_end=10.0, last_cost_s=1.0) == 0.0
    # ... and 1 s at a share of one half
    assert math.isclose(replan_wait(now=10.0, last_end=10.0, last_cost_s=1.0, share=0.5), 1.0)


def test_stage_without_worker():
    assert stage_without_worker({}, 2)
    assert stage_without_worker({"w0": 0, "w1": 0}, 2)
    assert not stage_without_worker({"w0": 0, "w1": 1}, 2)
    assert stage_without_worker({"w0": 0, "w1": 1, "w2": 3}, 3)  # a stage out of range fills none


def test_joins_while_a_replan_is_put_off_are_planned_in_together(tmp_path):
    """After an expensive re-plan, joins wait for the next one (the reaper runs it once due);
    it plans them all in at once and says how many changes it answered."""
    async def main():
        spec = pb.RunSpec()
        spec.CopyFrom(SPEC)
        spec.dead_after_s = 600.0  # the reaper runs below: nobody may die of a slow test
        c = Coordinator(spec, "tok", min_workers=2, out=str(tmp_path))
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        first = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
                 for i in range(2)]
        assert c.ready and sorted(c.assign.values()) == [0, 1]
        # the last re-plan took 1 s and just ended: the next is put off
        c.replan_cost_s, c.replan_end = 1.0, time.monotonic()
        late = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
                for i in range(2, 5)]
        assert set(c.assign) == set(first) and len(c.replan_why) == 3
        a = await c.Heartbeat(pb.MemberRequest(member_id=late[0]), None)
        assert a.known and a.stage == -1  # not planned in yet
        c.replan_end -= 10.0  # the wait is over: the reaper's next tick re-plans
        reaper = asyncio.create_task(c.reap())
        for _ in range(50):
            await asyncio.sleep(0.02)
            if not c.replan_why:
                break
        reaper.cancel()
        assert set(c.assign) == set(first + late) and not c.replan_why
        a = await c.Heartbeat(pb.MemberRequest(member_id=late[0]), None)
        assert a.stage in (0, 1)
        replans = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "replan"]
        assert replans[-1]["why"] == "join" and replans[-1]["changes"] == 3

    asyncio.run(main())


def test_a_stage_left_without_workers_is_repaired_at_once(tmp_path):
    """A put-off re-plan never leaves a stage without workers: a death that empties one re-plans now."""
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        workers = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
                   for i in range(3)]
        per_stage = {s: [w for w in workers if c.assign[w] == s] for s in (0, 1)}
        lone = next(ws[0] for ws in per_stage.values() if len(ws) == 1)
        c.replan_cost_s, c.replan_end = 1.0, time.monotonic()
        await c.Leave(pb.MemberRequest(member_id=lone), None)
        assert sorted(set(c.assign.values())) == [0, 1] and not c.replan_why

    asyncio.run(main())


def test_a_repair_plans_on_the_members_and_the_plan_not_on_everyone_ever(tmp_path):
    """A worker that left is in the scenario of the repair that takes it out of the plan,
    and in none after (else every death and re-join would make each repair slower)."""
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        workers = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
                   for i in range(4)]
        c._replan_flush(urgent=True)
        assert c.plan is not None and set(workers) <= c.planned
        gone = workers[0]
        await c.Leave(pb.MemberRequest(member_id=gone), None)
        c._replan_flush(urgent=True)  # (a slow box may have put it off)
        assert gone not in c.planned and gone not in c.assign
        new = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w9"), None)).member_id
        c._replan_flush(urgent=True)
        ids = {d.id for d in c.planned_on.devices}
        assert new in ids and gone not in ids and set(workers[1:]) <= ids

    asyncio.run(main())


def test_beat_floor_spreads_a_large_swarms_beats_but_keeps_three_per_dead_after():
    assert beat_floor_s(10, 3.0) == 0.01  # a small swarm: the workers' own period (0.5 s) rules
    assert beat_floor_s(500, 3.0) == 0.5
    assert beat_floor_s(1000, 3.0) == 1.0  # 1 000 beats a second
    assert beat_floor_s(3000, 3.0) == 1.0  # never fewer than three beats per dead_after
    assert beat_floor_s(3000, 30.0) == 3.0
    assert beat_floor_s(1000, 3.0, beats_per_s=4000.0) == 0.25


def test_heartbeats_tell_workers_the_floor_of_their_period(tmp_path):
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        w = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w0"), None)).member_id
        a = await c.Heartbeat(pb.MemberRequest(member_id=w), None)
        assert a.beat_floor_s == beat_floor_s(1, SPEC.dead_after_s)
        for i in range(9):
            await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"x{i}"), None)
        a = await c.Heartbeat(pb.MemberRequest(member_id=w), None)
        assert a.beat_floor_s == beat_floor_s(10, SPEC.dead_after_s) > 0

    asyncio.run(main())


def test_a_tick_the_loop_spent_computing_is_not_the_members_silence():
    assert busy_excuse(cpu_s=0.098, wall_s=0.1) == 0.1  # busy the whole tick: beats may wait unread
    assert busy_excuse(cpu_s=0.45, wall_s=0.5) == 0.5
    assert busy_excuse(cpu_s=0.05, wall_s=0.1) == 0.0  # half idle: it heard whoever beat
    assert busy_excuse(cpu_s=0.0, wall_s=0.0) == 0.0
    assert busy_excuse(cpu_s=0.085, wall_s=0.1, share=0.8) == 0.1


def test_asks_final_after_the_last_commit_until_the_weights_are_in():
    assert not asks_final(committed=2, steps=3, done=False, sent=False)
    assert asks_final(committed=3, steps=3, done=False, sent=False)
    assert not asks_final(committed=3, steps=3, done=False, sent=True)
    assert not asks_final(committed=3, steps=3, done=True, sent=False)


def test_final_refusal_names_what_is_wrong():
    assert final_refusal(0, [0, 3], [0, 3], 1, 1, 5, 5) == ""
    assert final_refusal(-1, None, [0, 3], 1, 1, 5, 5) == "the sender serves no stage"
    assert "not its stage's [3, 6]" in final_refusal(1, [3, 6], [0, 3], 1, 1, 5, 5)
    assert "epoch 0 is not the run's 1" in final_refusal(0, [0, 3], [0, 3], 0, 1, 5, 5)
    assert "before the last step" in final_refusal(0, [0, 3], [0, 3], 1, 1, 4, 5)


class _Caller:
    """An in-process call's context: the member id the auth interceptor checked (what
    ``shoal.net.auth.caller`` reads from the call's metadata)."""

    def __init__(self, member: str):
        self.member = member

    def invocation_metadata(self):
        from shoal.net.auth import MEMBER_HEADER, ROLE_HEADER

        return [(MEMBER_HEADER, self.member), (ROLE_HEADER, "server")]


async def _final_chunks(head: pb.WeightsReply, params: dict):
    """A stage server's final weights as it streams them (``head`` with ``params`` framed)."""
    from shoal.net.stream import split
    from shoal.runtime.transport.frames import serialise_weights

    for c in split("WeightsReply", serialise_weights(head, params), 1 << 16):
        yield c


async def _run_to_the_end(c: Coordinator, addresses: list[str]) -> tuple[dict, dict, list, dict]:
    """Two servers (at ``addresses``) and two workers join ``c`` and every step is committed;
    returns (server member id by stage, layers by stage, worker ids, each stage's weights)."""
    from shoal.model.transformer import build_stage
    from shoal.runtime.common import model_config

    servers = [(await c.Join(pb.JoinRequest(role="server", address=a, name=f"s{i}"), None)).member_id
               for i, a in enumerate(addresses)]
    ws = [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id for i in range(2)]
    hb = {m: await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=0), None) for m in (*servers, *ws)}
    by_stage = {hb[m].stage: m for m in servers}
    layers = {s: [hb[m].first, hb[m].last] for s, m in by_stage.items()}
    for step in range(SPEC.steps):
        assert not any(h.send_final for h in hb.values())
        await asyncio.gather(
            c.ReportStep(pb.StepReport(member_id=by_stage[0], stage=0, step=step, epoch=0, sq_norm=1.0), None),
            c.ReportStep(pb.StepReport(member_id=by_stage[1], stage=1, step=step, epoch=0, sq_norm=1.0,
                                       losses=[2.0, 2.0]), None))
        hb = {m: await c.Heartbeat(pb.MemberRequest(member_id=m, version=step + 1), None) for m in (*servers, *ws)}
    assert [hb[m].send_final for m in (*servers, *ws)] == [True, True, False, False]
    cfg = model_config(SPEC)
    params = {s: dict(build_stage(cfg, *layers[s], seed=7).named_parameters()) for s in (0, 1)}
    return by_stage, layers, ws, params


def _final_of(layers: dict, stage: int, **kw) -> pb.WeightsReply:
    return pb.WeightsReply(**{"version": SPEC.steps, "epoch": 0, "first": layers[stage][0],
                              "last": layers[stage][1], **kw})


def _ended_with(tmp_path, params: dict, how: dict) -> None:
    import torch

    from shoal.runtime.roles.artifacts import load_final_weights

    done = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "done"]
    assert done and done[0]["final_weights"] == how
    got = load_final_weights(tmp_path)
    sent = {**params[0], **params[1]}
    assert set(got) == set(sent) and all(torch.equal(got[n], sent[n].detach()) for n in sent)


def test_servers_send_their_final_weights_when_asked_and_the_run_ends_without_a_pull(tmp_path):
    """After the last commit each stage server's heartbeat reply asks for its final weights;
    weights of the wrong layers, epoch or version are refused with the reason; once both
    stages' are in, the asks stop and the run ends with them (no pull: the servers'
    addresses here accept no connection)."""
    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        by_stage, layers, ws, params = await _run_to_the_end(c, ["127.0.0.1:1", "127.0.0.1:2"])
        s0, s1 = by_stage[0], by_stage[1]
        refused = [await c.FinalWeights(_final_chunks(_final_of(layers, 1), params[1]), _Caller(s0)),
                   await c.FinalWeights(_final_chunks(_final_of(layers, 0, epoch=1), params[0]), _Caller(s0)),
                   await c.FinalWeights(_final_chunks(_final_of(layers, 0, version=SPEC.steps - 1), params[0]),
                                        _Caller(s0)),
                   await c.FinalWeights(_final_chunks(_final_of(layers, 0), params[0]), _Caller(ws[0]))]
        assert not any(r.accepted for r in refused)
        assert [r.reason.split(" ")[0] for r in refused] == ["layers", "epoch", "version", "the"]
        assert (await c.FinalWeights(_final_chunks(_final_of(layers, 0), params[0]), _Caller(s0))).accepted
        assert (await c.Heartbeat(pb.MemberRequest(member_id=s0), None)).send_final is False
        assert (await c.Heartbeat(pb.MemberRequest(member_id=s1), None)).send_final is True
        assert (await c.FinalWeights(_final_chunks(_final_of(layers, 1), params[1]), _Caller(s1))).accepted
        await asyncio.wait_for(_until_done(c), 60)
        _ended_with(tmp_path, params, {"sent": 2, "pulled": 0})

    asyncio.run(main())


def test_a_stage_whose_server_sends_nothing_is_pulled_after_the_wait(tmp_path, monkeypatch):
    """One server sends its final weights, the other never does: after FINAL_WAIT_S (0.5 s
    here; the run must end well before the default 30 s) the coordinator pulls that stage over
    gRPC from the server's address (a gRPC server in this process answering
    ``GetWeightsStream`` with that stage's weights)."""
    import grpc

    from shoal.net import shoal_pb2_grpc as pbg
    from shoal.net.stream import split
    from shoal.runtime.roles import coordinator as coordinator_mod
    from shoal.runtime.transport.frames import serialise_weights

    monkeypatch.setattr(coordinator_mod, "FINAL_WAIT_S", 0.5)

    class Stage(pbg.StageServerServicer):
        data: bytes = b""
        pulls = 0

        async def GetWeightsStream(self, request, context):
            assert request.worker == "coordinator"
            Stage.pulls += 1
            for chunk in split("WeightsReply", Stage.data, 1 << 16):
                yield pb.Chunk(kind=chunk.kind, total=chunk.total, offset=chunk.offset, data=bytes(chunk.data))

    async def main():
        srv = grpc.aio.server()
        pbg.add_StageServerServicer_to_server(Stage(), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        try:
            c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
            by_stage, layers, _, params = await _run_to_the_end(c, ["127.0.0.1:1", f"127.0.0.1:{port}"])
            silent = next(s for s, m in by_stage.items() if c.members[m].address.endswith(f":{port}"))
            Stage.data = bytes(serialise_weights(_final_of(layers, silent), params[silent]))
            other = 1 - silent
            assert (await c.FinalWeights(_final_chunks(_final_of(layers, other), params[other]),
                                         _Caller(by_stage[other]))).accepted
            await asyncio.wait_for(_until_done(c), 20)
            assert Stage.pulls == 1
            _ended_with(tmp_path, params, {"sent": 1, "pulled": 1})
        finally:
            await srv.stop(None)

    asyncio.run(main())


def test_a_run_whose_final_weights_cannot_be_collected_fails_and_writes_none(tmp_path, monkeypatch):
    """Neither server sends its final weights and neither address answers a pull: after the
    tries the run fails with a line that says to resume it, and no final model is written."""
    from shoal.runtime.roles import coordinator as coordinator_mod

    monkeypatch.setattr(coordinator_mod, "FINAL_WAIT_S", 0.2)
    monkeypatch.setattr(coordinator_mod, "FINAL_TRIES", 3)

    async def main():
        c = Coordinator(SPEC, "tok", min_workers=2, out=str(tmp_path))
        await _run_to_the_end(c, ["127.0.0.1:1", "127.0.0.1:2"])  # (ports nobody listens on)
        t0 = time.monotonic()
        while not c.error and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.05)
        assert c.error == ("could not collect the final weights of stage(s) [0, 1]; resume the run (--resume) "
                           "to write them")
        assert not (tmp_path / "checkpoint").exists() and not getattr(c, "final_weights", None)
        events = [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")]
        assert events[-1] == "failed" and "done" not in events

    asyncio.run(main())


async def _until_done(c) -> None:
    while not c.done:
        await asyncio.sleep(0.05)
