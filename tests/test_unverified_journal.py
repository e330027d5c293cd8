"""Unverified pushes are journaled: a ban after a restart still undoes them (issue 24).

Each stage server names, in its step report, the workers with a push in the step that was
never recomputed; the coordinator journals their names with the commit. A resumed or
restarted coordinator, whose workers all re-join under new member ids and whose servers may
be fresh processes, reads the record back: a later ban of a worker rolls the run back past
every unverified push made under its name.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

from shoal.net import shoal_pb2 as pb
from shoal.runtime.common import list_ckpts
from shoal.runtime.safety.journal import load_resume, read_journal, resume_state, run_dir
from shoal.train.metrics import read_jsonl


def test_the_journal_folds_unverified_names_and_a_roll_back_drops_the_redone():
    recs = [{"kind": "run", "spec": {}}]
    recs += [{"kind": "commit", "step": s, "epoch": 0, "record": {"step": s},
              **({"unverified": ["w1"]} if s >= 2 else {}), **({"unverified": ["w0", "w1"]} if s == 4 else {})}
             for s in range(6)]
    assert resume_state(recs).unverified == {"w1": 2, "w0": 4}
    # a roll-back to v3 redoes steps 3-5: w0's push of step 4 is no longer in the weights
    recs += [{"kind": "epoch", "epoch": 1, "version": 3}]
    assert resume_state(recs).unverified == {"w1": 2}
    recs += [{"kind": "epoch", "epoch": 2, "version": 2, "undo": True}]
    assert resume_state(recs).unverified == {}
    recs += [{"kind": "commit", "step": 2, "epoch": 2, "record": {"step": 2}, "unverified": ["w2"]}]
    assert resume_state(recs).unverified == {"w2": 2}


SPEC = dict(model="tiny", stages=2, steps=8, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0, lr=3e-3,
            min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0, dead_after_s=5.0, min_lease_s=1.0,
            data="synthetic", ordered_grads=True, ckpt_every=1)


def test_a_ban_after_a_resume_undoes_pushes_made_under_an_earlier_member_id(tmp_path):
    """In process: w1's pushes of steps 2-3 are committed unverified (stage 0 reports them); the
    coordinator is dropped after step 3. The resumed one, whose workers re-join under new ids
    and whose servers know nothing of w1, keeps v2 pinned (guard_keep) and, when stage 1's
    server bans w1 for a push of step 4, rolls every stage back to v2."""
    from google.protobuf import json_format

    from shoal.runtime.roles.coordinator import Coordinator

    spec = pb.RunSpec(**SPEC)

    async def first():
        c = Coordinator(spec, "tok", min_workers=2, out=str(tmp_path), options={"min_workers": 2})
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        workers = {}
        for i in range(2):
            workers[f"w{i}"] = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
        s = list(c.stage_server)
        for step in range(4):
            reps = [pb.StepReport(member_id=s[k], stage=k, step=step, epoch=0, sq_norm=1.0,
                                  losses=[2.0] * 2 if k else [],
                                  unverified=[workers["w1"]] if k == 0 and step >= 2 else [])
                    for k in range(2)]
            await asyncio.gather(*(c.ReportStep(r, None) for r in reps))
        return c.spec.run_id, [c.members[m].name for m in s]

    run_id, served = asyncio.run(first())
    commits = [r for r in read_journal(run_dir(tmp_path, run_id) / "journal.jsonl") if r["kind"] == "commit"]
    assert [r.get("unverified") for r in commits] == [None, None, ["w1"], ["w1"]]
    _, _, st = load_resume(tmp_path)
    assert st.unverified == {"w1": 2} and st.committed == 4

    async def second():
        c = Coordinator(json_format.ParseDict(st.spec, pb.RunSpec()), "tok", min_workers=2, out=str(tmp_path),
                        resume=st)
        new = {}
        for k in (0, 1):
            new[k] = (await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{9 + k}", name=served[k],
                                                  ckpt_stage=k), None)).member_id
        w1 = None
        for i in range(2):
            mid = (await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
            w1 = mid if i == 1 else w1
        held = [1, 2, 3, 4]  # each server's checkpoints (v1 pruned would be fine; v2 is pinned)

        async def beat(k, **kw):
            return await c.Heartbeat(pb.MemberRequest(member_id=new[k], ckpt_version=4, ckpt_versions=held,
                                                      epoch=c.epoch, version=4, **kw), None)

        a = [await beat(k) for k in range(2)]  # the resume's own roll-back: to v4
        assert c.committed == 4 and a[1].restart_version == 4
        a = [await beat(k) for k in range(2)]
        assert {x.guard_keep for x in a} == {3}  # keep the newest checkpoint at or before v2
        a = await beat(1, guard_bans=[pb.GuardBan(worker=w1, reason="test", stage=1, step=4, undo_from=0)])
        return c, a

    c, a = asyncio.run(second())
    assert a.restart_version == 2 and c.committed == 2 and c.unverified_names == {}
    journal = read_journal(run_dir(tmp_path, run_id) / "journal.jsonl")
    assert journal[-1]["kind"] == "epoch" and journal[-1]["version"] == 2 and journal[-1].get("undo")
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "undo"] == [2]


@pytest.fixture
def failure_free(tmp_path_factory):
    return failure_free_weights(tmp_path_factory)


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_a_poisoner_banned_after_a_total_stop_is_undone_bitwise(tmp_path, failure_free, monkeypatch):
    """Exact mode, 3 workers: w1 pushes noise of the honest norm from step 3, random spot
    checks off (the test hook), so its pushes past its first checked ones, poisoned ones among
    them, are committed unverified. (From step 3, not 2: a new worker's pushes are checked until
    two have passed, and when w1 shares its stage the leases may leave it without a micro-batch
    in a step; by step 3 it has had three steps to pass them.) Every process is killed (-9) once
    a commit names a poisoned push of w1 unverified and every stage's checkpoint of it is on
    disk. After `launch --resume`, w1 (a new member id, fresh servers) is banned at its first
    recomputed push; the run goes back to the version before its first unverified push and ends
    with the failure-free weights bit for bit. Without the journaled record the ban finds
    nothing to undo and the poisoned steps stay."""
    from shoal.runtime.processes.launch import Swarm, launch
    from shoal.runtime.safety.guard import DEFERRED_ENV, SPOT_RATE_ENV

    monkeypatch.setenv(SPOT_RATE_ENV, "0")
    # Inline checks: the schedule needs w1's first pushes judged before it lies. Deferred, its
    # record can still be short at step 3, its poisoned push is then drawn and checked by
    # another worker, and it is banned before the stop (a fresh-clone CI run). The undo of a
    # deferred check's ban is tested in test_deferred_checks.py and test_fault_inject.py.
    monkeypatch.setenv(DEFERRED_ENV, "0")
    faults = ["poison:w1:kind=noise:from=3"]
    import time

    def poisoned_unverified(out, rid: str) -> bool:
        """A commit of step 3 or later names w1 unverified (a poisoned push of it is in the
        weights), and every stage's newest checkpoint on disk is of that commit's version or
        later: a resume restarts from the stages' oldest newest checkpoint, so a kill before
        one of them is written would roll back past the push, leaving nothing to undo."""
        path = run_dir(out, rid) / "journal.jsonl"
        steps = [r["step"] for r in (read_journal(path) if path.exists() else [])
                 if r["kind"] == "commit" and r["step"] >= 3 and "w1" in (r.get("unverified") or [])]
        newest = [max(list_ckpts(out / "server_ckpt", s, rid), default=-1) for s in range(2)]
        return bool(steps) and min(newest) >= min(steps) + 1

    # A schedule in which w1's record was still short at its first poisoned push (it took no
    # micro-batch in a step before 3) has that push checked: w1 is caught before the stop,
    # rightly, but that is not the case under test (a fresh-clone CI run). It is run again.
    for attempt in range(3):
        out = tmp_path / f"run{attempt}"
        ended = False
        with Swarm(launch_config(out, workers=3, faults=faults, worker_args=[["--slow", "0.1"]] * 3)) as sw:
            sw.start()
            deadline = time.time() + 400
            # The stop waits for a state, not a step: w1 may take no micro-batch of step 3 (its
            # stage's other worker leased both), and its first poisoned push then comes later.
            while not (sw.run_id and poisoned_unverified(out, sw.run_id)):
                if sw.coord.poll() is not None:
                    ended = True
                    break
                assert time.time() < deadline, "no poisoned push of w1 committed unverified after 400 s"
                time.sleep(0.05)
            if not ended:
                sw.stop()  # kill -9 every member and the coordinator
            rid = sw.run_id
        before = read_jsonl(run_dir(out, rid) / "events.jsonl")
        bans = [e for e in before if e["event"] == "ban"]
        if bans and [b["device"] for b in bans] == ["w1"] and bans[0]["step"] >= 3:
            continue  # a poisoned push checked before the stop (see above)
        assert not bans, f"banned before the stop (an honest push): {bans}"
        assert not ended, "the coordinator exited early (w1's poison never committed unverified)"
        break
    else:
        pytest.fail("w1's first poisoned push was checked before the stop in 3 runs")
    st = resume_state(read_journal(run_dir(out, rid) / "journal.jsonl"))
    # w1's pushes not recomputed: from its first push past its checked ones, a poisoned one among them
    first = st.unverified.get("w1")
    assert first is not None and 4 <= st.committed < RUN["steps"], (st.unverified, st.committed)

    summary = launch(launch_config(out, resume=True, run_id=rid, workers=3, faults=faults))
    assert summary["steps"] == RUN["steps"]
    events = read_jsonl(out / "events.jsonl")
    bans = [e for e in events if e["event"] == "ban"]
    assert [b["device"] for b in bans] == ["w1"], bans
    undos = [e for e in events if e["event"] == "undo"]
    assert undos and undos[0]["version"] == first, (undos, first)
    back = [e for e in events if e["event"] == "rollback" and e.get("why") == "undo"]
    assert back and back[0]["version"] <= first, back
    logs = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    assert not re.search(r"Traceback", logs)
    assert_equal_weights(out, failure_free)
