"""Hot standby stage servers (``shoal launch --standbys``): a real swarm whose stage-1
server is killed with SIGKILL mid-step; the standby, on its own empty checkpoint folder,
takes over from the copy it pulled over the network, and the run ends with exactly the
failure-free run's weights (shared reference run: swarm_reference)."""

from __future__ import annotations

import json
import time

import pytest
from swarm_reference import assert_equal_weights, failure_free_weights, launch_config

from shoal.runtime.processes.launch import Swarm
from shoal.runtime.roles.coordinator import standby_stages
from shoal.train.metrics import read_jsonl


def test_standbys_copy_stages_round_robin():
    assert standby_stages(["a", "b", "c"], 2) == {"a": 0, "b": 1, "c": 0}
    assert standby_stages([], 3) == {}


def test_standbys_copy_a_stage_served_from_another_host():
    # One standby per server host, the active servers of stages 0..2 on hosts h0..h2: no
    # standby copies the stage served from its own host (round robin would give each its own).
    hosts = {"a": "h0", "b": "h1", "c": "h2"}
    got = standby_stages(["a", "b", "c"], 3, hosts=hosts, active_hosts=["h0", "h1", "h2"])
    assert sorted(got.values()) == [0, 1, 2]
    assert all(["h0", "h1", "h2"][k] != hosts[mid] for mid, k in got.items()), got
    # As many standbys per stage as round robin gives (2 each), each on the other host.
    got = standby_stages(["a", "b", "c", "d"], 2, hosts={"a": "h0", "b": "h0", "c": "h1", "d": "h1"},
                         active_hosts=["h0", "h1"])
    assert got == {"a": 1, "b": 1, "c": 0, "d": 0}
    # Every host the same (loopback) or unknown: plain round robin in join order.
    same = {"a": "127.0.0.1", "b": "127.0.0.1", "c": "127.0.0.1"}
    assert standby_stages(["a", "b", "c"], 2, hosts=same, active_hosts=["127.0.0.1"] * 2) == {"a": 0, "b": 1, "c": 0}
    assert standby_stages(["a", "b"], 2, hosts={}, active_hosts=["", ""]) == {"a": 0, "b": 1}
    # One standby, two stages: it copies the stage served from the other host, not the first
    # stage round robin would give it (which is served from its own host).
    assert standby_stages(["a"], 2, hosts={"a": "h0"}, active_hosts=["h0", "h1"]) == {"a": 1}
    assert standby_stages(["a"], 2, hosts={"a": "h1"}, active_hosts=["h0", "h1"]) == {"a": 0}
    # A standby holding copies keeps its stage, even on the active server's host.
    assert standby_stages(["a", "b"], 2, {"a": {0: 4}}, hosts={"a": "h0", "b": "h0"},
                          active_hosts=["h0", "h1"]) == {"a": 0, "b": 1}


def _stage1_copied(sw, out, deadline: float) -> tuple[int, str, int]:
    """Wait until a step >= 2 is committed and one of the standbys s2, s3 (each starts on an
    empty folder of its own; one copies each stage) holds stage 1's copy of it. Returns
    (the committed step, that standby, the index of stage 1's active server)."""
    while True:
        assert time.time() < deadline, "no standby copied a checkpoint of step 2 or later"
        committed = sw.committed_steps()
        holder = next((f"s{i}" for i in (2, 3) if committed in _copied(out / "standby_ckpt" / f"s{i}", 1)), None)
        if committed >= 2 and holder:
            break
        time.sleep(0.05)
    victim = sw._stage_server_index(1)
    assert victim is not None and victim < 2  # an active server, not a standby
    return committed, holder, victim


def _copied(folder, stage: int) -> list[int]:
    """Versions of the complete checkpoint files of ``stage`` a standby holds."""
    return sorted(int(p.name[1:].split(".")[0]) for p in folder.glob(f"run-*/stage{stage}/v*.safetensors"))


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_standby_takes_over_a_killed_stage_server(tmp_path, tmp_path_factory):
    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    slow = [["--slow", "0.3"]] * 2  # keeps a step in flight while we kill
    with Swarm(launch_config(out, standbys=2, worker_args=slow)) as sw:
        sw.start()
        committed, holder, victim = _stage1_copied(sw, out, time.time() + 300)
        sw.kill_server(victim)
        summary = sw.wait()
    assert summary["steps"] == 6
    events = read_jsonl(out / "events.jsonl")
    assigns = [e for e in events if e["event"] == "assign" and e.get("role") == "server" and e.get("stage") == 1]
    assert assigns[-1]["device"] == holder  # the stage-1 standby was promoted
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks, "a promotion restarts the stages at one version"
    # No roll-back beyond the step in flight: every stage restarts at the newest committed step.
    assert rollbacks[0]["version"] == rollbacks[0]["committed"] >= committed, rollbacks[0]
    assert_equal_weights(out, reference)


def test_standbys_keep_the_stage_they_hold_copies_of():
    # b holds copies of stage 1 (it copied them before a coordinator restart): it keeps it.
    assert standby_stages(["a", "b", "c"], 2, {"b": {1: 7}}) == {"a": 0, "b": 1, "c": 0}
    assert standby_stages(["a", "b"], 3, {"a": {2: 5, 0: 3}}) == {"a": 2, "b": 0}


def test_pick_holder_prefers_the_newest_checkpoint_then_the_copier():
    from shoal.runtime.roles.coordinator import pick_holder

    cands = [("spare", {0: 40, 1: 25}), ("sb", {1: 40}), ("empty", {})]
    assert pick_holder(1, cands, copier=None) == "sb"
    assert pick_holder(0, cands, copier="sb") == "spare"
    assert pick_holder(2, cands, copier="sb") is None
    assert pick_holder(1, [("spare", {1: 40}), ("sb", {1: 40})], copier="sb") == "sb"


def test_prune_never_deletes_the_file_just_written():
    from shoal.runtime.common import abandoned_ckpts, ckpts_to_prune

    # A stage rolled back to 0 in a folder holding v22..v25: writing v1 keeps v1.
    assert ckpts_to_prune([1, 22, 23, 24, 25], 1, 4) == []
    assert ckpts_to_prune([1, 2, 3, 4, 5, 30], 5, 4) == [1]
    assert abandoned_ckpts([3, 4, 5, 6], 4) == [5, 6]


class _Refused(Exception):
    pass


class _Context:
    """Stands in for a gRPC servicer context: ``abort`` raises."""

    async def abort(self, code, details):
        raise _Refused(f"{code.name}: {details}")


def test_resumed_coordinator_rebinds_stages_to_their_holders_and_keeps_bans(tmp_path):
    """In process: stage 1's server dies and the hot standby takes it over, a worker is
    banned, then the coordinator is replaced by one resumed from the journal. A spare
    server that joins first gets no stage; each stage goes back to the server that served
    it (stage 1: the promoted standby), and the banned worker cannot join again."""
    import asyncio

    from google.protobuf import json_format

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.roles.coordinator import Coordinator
    from shoal.runtime.safety.journal import load_resume

    spec = pb.RunSpec(model="tiny", stages=2, steps=8, micro_batches=2, micro_batch_size=2, seq_len=16,
                      seed=0, lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                      dead_after_s=5.0, min_lease_s=1.0, data="synthetic", ordered_grads=True)

    async def first():
        c = Coordinator(spec, "tok", min_workers=2, out=str(tmp_path), options={"min_workers": 2})
        ids = {}
        for name in ("s0", "s1"):
            ids[name] = (await c.Join(pb.JoinRequest(role="server", address=f"h:{name}", name=name), None)).member_id
        ids["sb"] = (await c.Join(pb.JoinRequest(role="server", address="h:sb", name="sb", standby=True),
                                  None)).member_id
        for name in ("w0", "w1", "w2"):
            ids[name] = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=name), None)).member_id
        assert c.ready and ids["sb"] not in c.stage_server
        names = {v: k for k, v in ids.items()}
        s1 = names[c.stage_server[1]]
        await c.Leave(pb.MemberRequest(member_id=ids[s1]), None)  # stage 1's server dies
        assert c.stage_server[1] == ids["sb"]  # the hot standby is promoted
        await c.Heartbeat(pb.MemberRequest(member_id=c.stage_server[0], role="server", guard_bans=[
            pb.GuardBan(worker=ids["w1"], reason="poisoned", stage=0, step=0)]), None)
        spare = (await c.Join(pb.JoinRequest(role="server", address="h:s9", name="s9"), None)).member_id
        assert spare not in c.stage_server
        # A spare plain server copies a stage too once the run started (the standby is busy).
        a = await c.Heartbeat(pb.MemberRequest(member_id=spare, role="server"), None)
        assert a.stage == -1 and a.standby_for == 1 and (a.standby_first, a.standby_last) == tuple(c.layers[0])
        assert a.standby_source == c.stage_server[0]  # the only server whose step log it takes
        return [names[m] for m in c.stage_server], ids["w1"]

    before, w1_id = asyncio.run(first())
    assert before[1] == "sb"
    _, _, st = load_resume(tmp_path)
    assert st.stage_servers == before and set(st.bans) == {"w1"}

    async def second():
        c = Coordinator(json_format.ParseDict(st.spec, pb.RunSpec()), "tok", min_workers=2, out=str(tmp_path),
                        resume=st)
        # The spare (on the shared folder: it holds old checkpoints of both stages) joins first.
        spare = (await c.Join(pb.JoinRequest(role="server", address="h:s9", name="s9"), None)).member_id
        await c.Heartbeat(pb.MemberRequest(member_id=spare, role="server", standby_held=[
            pb.StandbyHeld(stage=0, version=1), pb.StandbyHeld(stage=1, version=1)]), None)
        assert c.stage_server == ["", ""]
        assert any("wait up to" in w for w in c.waiting_for())
        got = {}
        for name in (before[1], before[0]):
            got[name] = (await c.Join(pb.JoinRequest(role="server", address=f"h:{name}", name=name,
                                                     standby=name == "sb"), None)).member_id
        assert c.stage_server == [got[before[0]], got[before[1]]]
        with pytest.raises(_Refused, match="PERMISSION_DENIED.*w1.*banned"):
            await c.Join(pb.JoinRequest(role="worker", flops=1e9, name="w1"), _Context())
        assert "w1" in json.loads((await c.Status(pb.Empty(), None)).json)["banned"]
        # A server re-reports its bans (old member ids) to the new coordinator: no second ban.
        await c.Heartbeat(pb.MemberRequest(member_id=got[before[0]], role="server", guard_bans=[
            pb.GuardBan(worker=w1_id, reason="poisoned", stage=0, step=0)]), None)
        assert [e["device"] for e in c.recent if e["event"] == "ban"] == []
        # Once the reservations end, a vacant stage goes to the server holding its newest copy.
        await c.Leave(pb.MemberRequest(member_id=got["sb"]), None)
        assert c.stage_server[1] == spare

    asyncio.run(second())
    assert [r["name"] for r in read_journal_of(tmp_path) if r["kind"] == "ban"] == ["w1"]


def read_journal_of(out):
    from shoal.runtime.safety.journal import find_run, read_journal, run_dir

    return read_journal(run_dir(*find_run(out)) / "journal.jsonl")


def test_reservation_ends_and_the_best_holder_takes_the_stage(tmp_path):
    """A resumed run whose stage-0 server never comes back: after the grace the stage goes
    to the joined server holding its newest checkpoint, not to the one that joined first."""
    import asyncio

    from google.protobuf import json_format

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.roles.coordinator import Coordinator
    from shoal.runtime.safety.journal import Journal, read_journal, resume_state, run_dir

    spec = {"run_id": "20260101-000000-abcdef", "model": "tiny", "stages": 2, "steps": "8", "micro_batches": 2,
            "micro_batch_size": 2, "seq_len": 16, "seed": "0", "lr": 3e-3, "dead_after_s": 5.0,
            "data": "synthetic", "ordered_grads": True}
    j = Journal(run_dir(tmp_path, spec["run_id"]) / "journal.jsonl")
    j.write("run", spec=spec, options={"min_workers": 2}, t0=1.0)
    j.write("plan", layers=[[0, 2], [2, 4]], epoch=0)
    j.write("servers", names=["gone", "s1"], epoch=0)
    for step in range(3):
        j.write("commit", step=step, epoch=0, record={"step": step, "loss": 1.0}, scale=None)
    j.close()
    st = resume_state(read_journal(run_dir(tmp_path, spec["run_id"]) / "journal.jsonl"))

    async def main():
        c = Coordinator(json_format.ParseDict(st.spec, pb.RunSpec()), "tok", out=str(tmp_path), resume=st)
        ids = {}
        for name in ("a", "b", "s1"):
            ids[name] = (await c.Join(pb.JoinRequest(role="server", address=f"h:{name}", name=name), None)).member_id
        await c.Heartbeat(pb.MemberRequest(member_id=ids["b"], role="server",
                                           standby_held=[pb.StandbyHeld(stage=0, version=3)]), None)
        assert c.stage_server == ["", ids["s1"]]  # stage 0 waits for "gone"
        c.reserve_until = 0.0  # the grace is over
        c._fill_vacancies()
        assert c.stage_server == [ids["b"], ids["s1"]]

    asyncio.run(main())



@pytest.mark.integration
@pytest.mark.timeout(420)
def test_promoted_standby_keeps_its_stage_across_a_coordinator_restart(tmp_path, tmp_path_factory):
    """kill -9 the last stage's server at step 2 (its hot standby is promoted; `launch`
    starts a spare on the shared checkpoint folder), then kill -9 the coordinator at step 4
    (`launch` restarts it with --resume). Stage 1 goes to whichever server holds its newest
    checkpoint: the hot standby, or the spare started on the killed server's folder when
    the standby had not copied the last file yet. The resumed coordinator gives every stage
    back to the server that served it (not to another standby); no roll-back goes beyond
    the step in flight, and the final weights equal the failure-free run's."""
    from shoal.runtime.processes.launch import launch

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    summary = launch(launch_config(out, standbys=2, faults=["kill:server:step=2", "kill:coordinator:step=4"],
                                   worker_args=[["--slow", "0.2"]] * 2))
    assert summary["steps"] == 6
    events = read_jsonl(out / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert "coordinator_restart" in kinds and "resume" in kinds
    resumed = kinds.index("resume")
    promoted = [e["device"] for e in events[:resumed]
                if e["event"] == "assign" and e.get("role") == "server" and e.get("stage") == 1][-1]
    assert promoted in ("s2", "s3", "s4")  # a standby or the spare took stage 1 from the killed s0/s1
    after = [e for e in events[resumed:] if e["event"] == "assign" and e.get("role") == "server"]
    assert {e["stage"]: e["device"] for e in after}[1] == promoted, after
    others = {"s2", "s3", "s4"} - {promoted}
    assert not others & {e["device"] for e in after}, after  # no other standby took a stage
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) >= 2, rollbacks
    for r in rollbacks:
        # ckpt-every 1: at most the step in flight is lost (a standby copy one commit behind).
        assert r["version"] >= r["committed"] - 1 >= 1, rollbacks
    assert_equal_weights(out, reference)


def test_outer_momentum_travels_with_the_checkpoint(tmp_path):
    """Local mode: the outer Nesterov momentum is saved with the merged weights, so a server
    restoring the file (after a roll-back, a resume, or as a promoted standby holding a copy
    of it) continues with the momentum, not with zeros."""
    import shutil

    import torch

    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.common import ckpt_dir, save_stage_ckpt
    from shoal.runtime.roles.server import StageServer
    from shoal.train.optim import OptimConfig, make_optimizer

    cfg = get_preset("tiny")
    m = build_stage(cfg, 0, 2, seed=1)
    opt = make_optimizer(m.named_parameters(), OptimConfig())
    momentum = {n: torch.randn_like(p) for n, p in m.named_parameters()}
    save_stage_ckpt(tmp_path / "active", 0, 3, m, opt, run_id="r1", layers=(0, 2), outer_m=momentum)
    # A standby's copy is the file's bytes in its own folder.
    (ckpt_dir(tmp_path / "standby", 0, "r1")).mkdir(parents=True)
    shutil.copy(ckpt_dir(tmp_path / "active", 0, "r1") / "v3.safetensors", ckpt_dir(tmp_path / "standby", 0, "r1"))
    srv = StageServer("127.0.0.1:1", "127.0.0.1:0", "tok", str(tmp_path / "standby"))
    srv.spec = pb.RunSpec(model="tiny", stages=2, steps=8, seed=1, lr=3e-3, run_id="r1", sync_mode="local")
    *_, restored, pull_ef = srv._make(0, 0, 2, 3)
    assert pull_ef == {}  # no sparse pulls in this run
    assert set(restored) == set(momentum) and all(torch.equal(restored[n], momentum[n]) for n in momentum)


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_local_mode_standby_is_promoted_with_the_outer_momentum(tmp_path):
    """--sync local (H=2, outer momentum 0.9): kill -9 the last stage's server at the commit of
    step 5 (that of step 3 published and checkpointed the first merge, v2: delayed application);
    its hot standby, holding copies of the merged checkpoints, is promoted and restores the
    merged weights with the outer momentum saved with them; the run completes."""
    import math
    import re

    from shoal.runtime.processes.launch import launch

    out = tmp_path / "run"
    summary = launch(launch_config(out, steps=8, standbys=2, sync="local", sync_every=2, outer_lr=0.7,
                                   outer_momentum=0.9, faults=["kill:server:step=5"],
                                   worker_args=[["--slow", "0.2"]] * 2))
    assert summary["steps"] == 8 and all(math.isfinite(x) for x in summary["losses"])
    events = read_jsonl(out / "events.jsonl")
    promoted = [e["device"] for e in events if e["event"] == "server_restart"]
    assert promoted and promoted[-1] in ("s2", "s3"), promoted
    rollback = [e for e in events if e["event"] == "rollback"][-1]
    # Local mode checkpoints merges only (every H=2 steps), and with delayed application the
    # merge published at a round's end is the round's before: at most two rounds are redone.
    assert rollback["version"] >= 2 and rollback["version"] >= rollback["committed"] - 4, rollback
    log = (out / "logs" / f"server{promoted[-1][1:]}.log").read_text()
    assert re.search(rf"serves stage \d .* from version {rollback['version']} .*with the saved outer momentum", log), \
        log[-1500:]


def test_standby_is_sent_the_newest_checkpoint_it_lacks():
    from shoal.runtime.roles.server import standby_send_version

    assert standby_send_version([3, 4, 5], have=4, loading=False) == 5
    assert standby_send_version([3, 4, 5], have=5, loading=False) == 0  # nothing new: the call waits
    assert standby_send_version([3, 4], have=6, loading=False) == 4  # rolled back: the older file
    assert standby_send_version([], have=0, loading=False) == 0
    assert standby_send_version([3, 4, 5], have=4, loading=True) == 0


def test_replay_plan_runs_from_the_copy_while_each_step_has_gradient_and_decision():
    from shoal.runtime.safety.standby import replay_plan

    logged = {(1, 4), (1, 5), (1, 6)}
    assert replay_plan(4, logged, {(1, 4), (1, 5)}) == [(1, 4), (1, 5)]  # step 6 in flight: no decision
    assert replay_plan(3, logged, {(1, 4), (1, 5)}) == []  # step 3 is neither copied nor logged
    assert replay_plan(5, logged, {(1, 4), (1, 5), (1, 6)}) == [(1, 5), (1, 6)]
    # A gradient and a decision of different epochs never pair up; the newest epoch with both wins.
    assert replay_plan(4, {(1, 4), (2, 5)}, {(1, 4), (1, 5)}) == [(1, 4)]
    assert replay_plan(4, {(1, 4), (2, 4)}, {(1, 4), (2, 4)}) == [(2, 4)]
    assert replay_plan(0, set(), set()) == []


def test_a_roll_back_drops_the_log_of_the_history_it_left():
    from shoal.runtime.safety.standby import covered, overflow, superseded

    keys = [(1, 4), (1, 5), (1, 6), (0, 2)]
    # Epoch 2 redoes step 5: epoch 1's steps 5 and 6 are gone, step 4 (and older epochs' older steps) stay.
    assert sorted(superseded(keys, (2, 5))) == [(1, 5), (1, 6)]
    assert superseded(keys, (1, 7)) == []  # the same epoch going on drops nothing
    assert sorted(covered(keys, 5)) == [(0, 2), (1, 4)]  # a full copy at v5 holds steps 0..4
    assert overflow([(1, k) for k in range(10)], most=8) == [(1, 0), (1, 1)]
    assert overflow([(1, 3)], most=8) == []


def test_active_server_skips_a_standby_that_timed_out_for_a_while():
    from shoal.runtime.safety.standby import STANDBY_LAG_S, lag_seconds, send_to

    assert send_to(["a", "b"], {}, now=100.0) == ["a", "b"]
    assert send_to(["a", "b"], {"a": 120.0}, now=100.0) == ["b"]  # skipped until 120
    assert send_to(["a", "b"], {"a": 100.0}, now=100.0) == ["a", "b"]
    assert lag_seconds(timed_out=True) == STANDBY_LAG_S > 0  # a hung standby would stall each step
    assert lag_seconds(timed_out=False) == 0.0  # refused or unreachable: answered at once, tried again


def test_coordinator_gives_a_standby_the_decisions_of_the_committed_steps():
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.safety.standby import decisions_since

    d = {(0, k): pb.StepDecision(ready=True, lr=0.1 * (k + 1), coef=1.0) for k in range(6)}
    d[(1, 4)] = pb.StepDecision(ready=True, lr=9.0, coef=0.5)  # redone after a roll-back to 4
    got = decisions_since(d, epoch=1, committed=5, since=2)
    assert [(x.epoch, x.step) for x in got] == [(0, 2), (0, 3), (1, 4)]  # step 5 of epoch 0: abandoned
    assert got[-1].lr == 9.0 and got[-1].coef == 0.5
    assert [x.step for x in decisions_since(d, epoch=1, committed=5, since=0, most=2)] == [3, 4]


def test_kill_at_commit_hook_fires_only_on_its_stage_and_step():
    from shoal.runtime.safety.standby import kill_at_commit

    assert not kill_at_commit(0, 2, standby=False, env="")
    assert not kill_at_commit(1, 2, standby=False, env="0:3")
    assert not kill_at_commit(0, 1, standby=False, env="0:3")
    assert not kill_at_commit(0, 2, standby=True, env="0:3")  # a promoted standby never fires


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_standby_replays_logged_steps_when_the_active_dies_at_a_commit(tmp_path, tmp_path_factory, monkeypatch):
    """The active server of stage 0 is killed (SIGKILL, by itself) the moment the decision of
    step 2 lands, before it applies or checkpoints it: its standby, on its own empty folder,
    holds at most the file of v2 but logged step 2's gradient before the step was reported.
    Promoted, it replays that step, every stage restarts at v3 (the newest committed: only
    the step in flight is lost), and the final weights equal the failure-free run's."""
    from shoal.runtime.processes.launch import launch
    from shoal.runtime.safety.standby import KILL_AT_COMMIT_ENV

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    monkeypatch.setenv(KILL_AT_COMMIT_ENV, "0:3")
    summary = launch(launch_config(out, standbys=1))
    assert summary["steps"] == 6
    events = read_jsonl(out / "events.jsonl")
    promoted = [e for e in events if e["event"] == "server_restart"]
    assert [(e["device"], e["stage"]) for e in promoted] == [("s2", 0)], promoted
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks and rollbacks[0]["committed"] == 3, rollbacks
    assert all(r["version"] == r["committed"] for r in rollbacks), rollbacks
    log = (out / "logs" / "server2.log").read_text()
    assert "logged step(s) replayed -> v3" in log, log[-2000:]
    assert_equal_weights(out, reference)


def test_replaying_the_step_log_equals_the_active_servers_updates(tmp_path):
    """In process: an "active" stage applies three decided steps (one a skipped fp16 overflow,
    one clipped) to its weights and AdamW state; a standby holding the checkpoint of the first
    version and the three logged gradients replays them to the same bits, loss scale included."""
    import torch

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.common import list_ckpts, save_stage_ckpt, stage_ckpt_loss_scale
    from shoal.runtime.roles.server import StageServer
    from shoal.train.optim import apply_update

    spec = pb.RunSpec(model="tiny", stages=2, steps=8, seed=1, lr=3e-3, weight_decay=0.1, run_id="r1",
                      precision="fp16", ckpt_every=1)
    srv = StageServer("127.0.0.1:1", "127.0.0.1:0", "tok", str(tmp_path / "standby"))
    srv.spec = spec
    _, module, opt, scale, *_ = srv._make(0, 0, 2, 0)
    params = dict(module.named_parameters())
    g = torch.Generator().manual_seed(0)
    decisions = [pb.StandbyDecision(epoch=1, step=4, lr=1e-3, coef=1.0, next_loss_scale=512.0),
                 pb.StandbyDecision(epoch=1, step=5, skip=True, next_loss_scale=256.0),
                 pb.StandbyDecision(epoch=1, step=6, lr=2e-3, coef=0.37, next_loss_scale=256.0)]
    # Some AdamW history first, then the full copy at v4 (the standby's own folder).
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=g)
    apply_update(opt, 1e-3, 1.0)
    save_stage_ckpt(tmp_path / "standby", 0, 4, module, opt, run_id="r1", layers=(0, 2), loss_scale=1024.0)
    srv._sb_reset(0, (0, 2))
    for d in decisions:
        grads = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
        if d.skip:
            grads[next(iter(grads))][0] = float("inf")  # an overflowed fp16 step
        srv.sb_log[(d.epoch, d.step)] = {n: t.clone() for n, t in grads.items()}
        srv.sb_decided[(d.epoch, d.step)] = d
        for n, p in params.items():  # what the active server does with the decision
            p.grad = grads[n]
        if d.skip:
            opt.zero_grad(set_to_none=True)
        else:
            apply_update(opt, d.lr, d.coef)
    assert srv.standby_replayable() == 7
    assert srv._sb_replay(0, 0, 2) == 7
    assert list_ckpts(tmp_path / "standby", 0, "r1") == [4, 5, 6, 7]  # --ckpt-every 1: each replayed version
    assert stage_ckpt_loss_scale(tmp_path / "standby", 0, 7, 1.0, run_id="r1") == 256.0
    _, restored, ropt, *_ = srv._make(0, 0, 2, 7)
    for (n, p), (_, q) in zip(module.named_parameters(), restored.named_parameters(), strict=True):
        assert torch.equal(p, q), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, ropt.state[q][k]), (n, k)


def test_a_standby_logs_steps_only_from_the_active_server_the_coordinator_names(tmp_path):
    """In process: told by the coordinator that s-active serves stage 0, a standby refuses a
    step log from another server (a forged log would be replayed into the stage on a
    promotion) and takes the active's; before it is told, a server naming the stage is taken."""
    import asyncio

    import torch

    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import split
    from shoal.net.wire import encode_tensor
    from shoal.runtime.roles.server import StageServer

    spec = pb.RunSpec(model="tiny", stages=2, steps=8, seed=1, lr=3e-3, weight_decay=0.1, run_id="r1", ckpt_every=1)
    srv = StageServer("127.0.0.1:1", "127.0.0.1:0", "tok", str(tmp_path / "standby"))
    srv.spec = spec

    async def main():
        srv._sb_reset(0, (0, 2))
        shapes = await srv._sb_param_shapes()

        async def log_step(member: str, step: int) -> pb.StandbyStepAck:
            m = pb.StandbyStep(member_id=member, stage=0, epoch=0, step=step, first=0, last=2)
            m.grads.extend(encode_tensor(n, torch.zeros(shape)) for n, shape in shapes.items())

            async def chunks():
                for c in split("StandbyStep", m.SerializeToString(), 1 << 20):
                    yield c
            return await srv.StandbyStepStream(chunks(), None)

        early = await log_step("s-early", 1)  # not told yet: taken
        srv.standby_heard(pb.Assignment(stage=-1, standby_for=1, standby_first=0, standby_last=2,
                                        standby_source="s-active"))
        forged = await log_step("s-other", 2)
        real = await log_step("s-active", 3)
        return early, forged, real

    early, forged, real = asyncio.run(main())
    assert early.ok and real.ok, (early, real)
    assert not forged.ok and "s-other is not the active server of stage 0" in forged.reason
    assert sorted(srv.sb_log) == [(0, 1), (0, 3)]


def test_planner_places_standbys_on_the_near_host_where_round_robin_would_not():
    """Emulated runs with a plan: standbys copy the stage the planner's placement
    (shoal.plan.standby.place_standbys) gives their host. Stage 0 is served in region r,
    stage 1 in region far, behind a 100 kB/s path from r. Round robin in join order sends
    b (in far) to stage 0 and a (in r) to stage 1, both copying over the slow path; the
    planner gives each stage the standby in its own region."""
    from shoal.model.config import get_preset
    from shoal.model.profile import profile_model
    from shoal.plan.types import (
        ChurnModel,
        Device,
        Link,
        Network,
        Plan,
        Scenario,
        StagePlan,
        SyncPolicy,
        Workload,
    )
    from shoal.runtime.safety.standby import planned_standby_stages

    def host(name: str, region: str, memory: float = 64e9) -> Device:
        return Device(name, "server", 0.0, 0.0, region, 1e8, 1e8, can_host_server=True, host_memory=memory)

    net = Network(intra={"r": Link(0.01, 1e9), "far": Link(0.01, 1e9)}, inter={("far", "r"): Link(0.05, 1e5)})
    gpus = [Device(f"g{i}", "gpu", 1e11, 8e9, "r", 1e7, 1e7) for i in range(2)]
    scn = Scenario("hand", [host("h0", "r"), host("h1", "far"), host("h2", "far"), host("h3", "r"), *gpus], net,
                   Workload("tiny", 32, 16, 1, 4), ChurnModel())
    plan = Plan("hand", "tiny", "hand", [StagePlan((0, 3), "h0", ["g0"]), StagePlan((3, 6), "h1", ["g1"])],
                1, 16, SyncPolicy())
    prof = profile_model(get_preset("tiny"), 32, 1, 4)
    hosts = {"b": "h2", "a": "h3"}
    assert standby_stages(["b", "a"], 2, hosts=hosts, active_hosts=["h0", "h1"]) == {"b": 0, "a": 1}
    assert planned_standby_stages(["b", "a"], hosts, plan, scn, prof) == {"a": 0, "b": 1}
    # Fewer standbys than stages: no full round for the planner (round robin places them).
    assert planned_standby_stages(["b"], {"b": "h2"}, plan, scn, prof) == {}
    # No host with memory for a stage's state: the planner refuses, round robin places them.
    small = Scenario("hand", [host("h0", "r"), host("h1", "far"), host("h2", "far", 1e3), host("h3", "r", 1e3),
                              *gpus], net, Workload("tiny", 32, 16, 1, 4), ChurnModel())
    assert planned_standby_stages(["b", "a"], hosts, plan, small, prof) == {}
    # Two standbys on one host (the only one running standbys): one per stage, in join order.
    assert planned_standby_stages(["a", "c"], {"a": "h3", "c": "h3"}, plan, scn, prof) == {"a": 0, "c": 1}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_hung_standby_does_not_stop_the_run(tmp_path, tmp_path_factory):
    """SIGSTOP the hot standby after step 2: the active server's next step log to it times
    out (bounded wait), is logged as lagging, and the step goes on without it; the run
    completes with the failure-free run's weights."""
    import os
    import signal

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    with Swarm(launch_config(out, standbys=1)) as sw:
        sw.start()
        deadline = time.time() + 200
        while sw.committed_steps() < 2:
            assert time.time() < deadline, "the run did not reach step 2"
            time.sleep(0.05)
        standby = sw.servers[2]  # s0, s1 serve the stages; s2 is the standby
        os.kill(standby.pid, signal.SIGSTOP)
        try:
            summary = sw.wait()
        finally:
            if standby.poll() is None:
                os.kill(standby.pid, signal.SIGCONT)
    assert summary["steps"] == 6
    logs = "".join((out / "logs" / f"server{i}.log").read_text() for i in (0, 1))
    assert "standby 127.0.0.1" in logs and "did not log step" in logs and "DEADLINE_EXCEEDED" in logs, logs[-2000:]
    assert_equal_weights(out, reference)


def test_a_failing_copy_warns_once_and_names_the_copier(tmp_path, caplog):
    """A copy retried at every heartbeat (its source died) warns once per stage, source and
    reason, not five times a second; a plain spare server does not call itself a standby."""
    import logging

    from shoal.runtime.roles.server import StageServer

    srv = StageServer("127.0.0.1:1", "127.0.0.1:0", "tok", str(tmp_path), name="s2")
    assert srv.copier_label == "spare"
    with caplog.at_level(logging.DEBUG, logger="shoal.server"):
        for _ in range(25):  # five seconds of heartbeats
            srv._copy_failed(1, "127.0.0.1:9", "copying stage 1 from 127.0.0.1:9 failed (UNAVAILABLE)")
        srv._copy_failed(1, "127.0.0.1:8", "copying stage 1 from 127.0.0.1:8 failed (UNAVAILABLE)")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert all(w.startswith("s2 (spare): copying stage 1") for w in warnings)
    srv.standby = True
    assert srv.copier_label == "standby"


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_a_frozen_stage_server_is_replaced_and_its_return_changes_nothing(tmp_path, tmp_path_factory):
    """SIGSTOP stage 1's server once a standby holds a copy of step 2 or later (a host that
    freezes: its connections stay open, nothing answers; the workers wait on it on their
    sessions). The coordinator declares it dead and promotes the standby; then SIGCONT: the
    server comes back to a run that has forgotten it. The run completes with the failure-free
    weights."""
    import os
    import signal

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    slow = [["--slow", "0.3"]] * 2  # keeps a step in flight while we freeze
    with Swarm(launch_config(out, standbys=2, worker_args=slow)) as sw:
        sw.start()
        deadline = time.time() + 300
        _, _, victim = _stage1_copied(sw, out, deadline)
        frozen = sw.servers[victim]
        seen = len(read_jsonl(out / "events.jsonl"))  # (stage 1 may have moved between servers before)
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            while True:  # frozen until the coordinator has given its stage to another server
                assert time.time() < deadline, "the frozen server's stage was never given to another"
                events = read_jsonl(out / "events.jsonl")[seen:]
                if any(e["event"] == "assign" and e.get("role") == "server" and e.get("stage") == 1
                       and e.get("device") != f"s{victim}" for e in events):
                    break
                time.sleep(0.1)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        summary = sw.wait()
    assert summary["steps"] == 6
    events = read_jsonl(out / "events.jsonl")
    assigns = [e for e in events[seen:] if e["event"] == "assign" and e.get("role") == "server" and e.get("stage") == 1]
    assert assigns and all(e["device"] != f"s{victim}" for e in assigns), assigns
    assert_equal_weights(out, reference)
