"""Resume after a total stop and a restartable coordinator (issue 12 items 2 and 4).

Both multi-process tests compare against the session's failure-free reference run
(``swarm_reference``): same losses, final weights ``torch.equal``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

from shoal.errors import ShoalError
from shoal.runtime.roles.coordinator import pick_standby
from shoal.runtime.safety.journal import (
    Journal,
    find_run,
    load_resume,
    point_link,
    read_journal,
    resume_state,
    run_dir,
)
from shoal.train.metrics import read_jsonl


def _reference(tmp_path_factory) -> tuple[dict, dict]:
    """The failure-free run's final weights and summary."""
    weights = failure_free_weights(tmp_path_factory)
    out = Path(tmp_path_factory.getbasetemp()) / "failure_free" / "run"
    return weights, json.loads((out / "summary.json").read_text())


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _wait_steps(sw, n: int, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while sw.committed_steps() < n:
        assert sw.coord.poll() is None, "the coordinator exited early"
        assert time.time() < deadline, f"fewer than {n} steps after {timeout_s} s"
        time.sleep(0.05)


def _fake_run(out: Path, run_id: str, *, done: bool) -> None:
    """A journal (and a metrics file) of another run in the same folder."""
    j = Journal(run_dir(out, run_id) / "journal.jsonl")
    j.write("run", spec={"run_id": run_id, "steps": "6", "stages": 2}, options={"min_workers": 2}, t0=1.0)
    j.write("plan", layers=[[0, 2], [2, 4]], epoch=0)
    j.write("commit", step=0, epoch=0, record={"step": 0, "loss": 1.0}, scale=None)
    if done:
        j.write("done", epoch=0)
    j.close()
    (run_dir(out, run_id) / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')


# ---------------------------------------------------------------------- decisions


def test_resume_state_folds_the_journal(tmp_path):
    j = Journal(tmp_path / "journal.jsonl")
    j.write("run", spec={"steps": "6"}, options={"min_workers": 2}, t0=5.0)
    j.write("listen", address="127.0.0.1:9", listen="127.0.0.1:9", epoch=0)
    j.write("plan", layers=[[0, 1], [1, 4]], epoch=0)
    for step in range(4):
        j.write("commit", step=step, epoch=0, record={"step": step, "loss": float(step)}, scale=None)
    j.write("epoch", epoch=1, version=2)  # a roll-back: steps 2, 3 run again
    j.write("commit", step=2, epoch=1, record={"step": 2, "loss": 99.0}, scale=[512.0, 3])
    j.close()
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write('{"kind": "commit", "step": 3, "epo')  # the coordinator died mid-write
    st = resume_state(read_journal(tmp_path / "journal.jsonl"))
    assert st.layers == [(0, 1), (1, 4)] and st.epoch == 1 and st.committed == 3 and st.t0 == 5.0
    assert [r["loss"] for r in st.records] == [0.0, 1.0, 2.0, 3.0]  # first commit of a step is kept
    assert st.scale_at == {3: (512.0, 3)} and st.options["bound"] == "127.0.0.1:9"
    assert st.state == "running"
    # A journal written after a torn line stays readable.
    Journal(tmp_path / "journal.jsonl").write("failed", why="x", epoch=1)
    st = resume_state(read_journal(tmp_path / "journal.jsonl"))
    assert st.state == "failed" and st.committed == 3
    with pytest.raises(ShoalError, match="run record"):
        resume_state([{"kind": "commit", "step": 0}])


def test_resumed_coordinator_keeps_the_decisions_a_standby_replays(tmp_path):
    """The journal keeps each commit's decision (lr, clip coefficient, skip, next loss scale), so
    a standby promoted after a coordinator restart can replay steps decided before it."""
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.safety.journal import DECISIONS_KEPT
    from shoal.runtime.safety.standby import decisions_since

    j = Journal(tmp_path / "journal.jsonl")
    j.write("run", spec={"steps": "200"}, options={}, t0=0.0)
    n = DECISIONS_KEPT + 6
    for step in range(n):
        j.write("commit", step=step, epoch=0, record={"step": step, "loss": 1.0}, scale=None,
                decision=[1e-3 * (step + 1), 0.5, step == n - 4, 0.0])
    j.write("epoch", epoch=1, version=n - 1)  # a roll-back: the last step runs again
    j.write("commit", step=n - 1, epoch=1, record={"step": n - 1, "loss": 1.0}, scale=None,
            decision=[9.0, 1.0, False, 0.0])
    j.close()
    st = resume_state(read_journal(tmp_path / "journal.jsonl"))
    assert st.decisions[(0, n - 4)] == (pytest.approx(1e-3 * (n - 3)), 0.5, True, 0.0)
    assert (0, 0) not in st.decisions and (0, n - DECISIONS_KEPT) in st.decisions  # bounded
    assert st.decisions[(1, n - 1)] == (9.0, 1.0, False, 0.0)
    decisions = {k: pb.StepDecision(ready=True, lr=lr, coef=c, skip=sk, next_loss_scale=nl)
                 for k, (lr, c, sk, nl) in st.decisions.items()}
    got = decisions_since(decisions, 2, n, n - 3)
    assert [(d.epoch, d.step, round(d.lr, 6)) for d in got] == \
        [(0, n - 3, round(1e-3 * (n - 2), 6)), (0, n - 2, round(1e-3 * (n - 1), 6)), (1, n - 1, 9.0)]


def test_find_run_and_bad_resume_folders(tmp_path):
    with pytest.raises(ShoalError, match="no such folder"):
        find_run(tmp_path / "nope")
    with pytest.raises(ShoalError, match="no run journal"):
        find_run(tmp_path)
    _fake_run(tmp_path, "20260101-000000-aaaaaa", done=False)
    _fake_run(tmp_path, "20260102-000000-bbbbbb", done=True)
    assert find_run(tmp_path) == (tmp_path, "20260102-000000-bbbbbb")  # the newest
    assert find_run(tmp_path, "20260101-000000-aaaaaa")[1] == "20260101-000000-aaaaaa"
    assert find_run(run_dir(tmp_path, "20260101-000000-aaaaaa")) == (tmp_path, "20260101-000000-aaaaaa")
    with pytest.raises(ShoalError, match="no run 'zzz'"):
        find_run(tmp_path, "zzz")
    with pytest.raises(ShoalError, match="finished"):
        load_resume(tmp_path)
    _, rid, st = load_resume(tmp_path, "20260101-000000-aaaaaa")
    assert rid == "20260101-000000-aaaaaa" and st.committed == 1


def test_links_follow_the_newest_run_and_keep_old_files(tmp_path):
    (tmp_path / "events.jsonl").write_text("old layout\n")  # a plain file where a link goes
    for rid in ("r1", "r2"):
        run_dir(tmp_path, rid).mkdir(parents=True)
        (run_dir(tmp_path, rid) / "events.jsonl").write_text(rid + "\n")
        point_link(tmp_path, "events.jsonl", rid)
        assert (tmp_path / "events.jsonl").read_text() == rid + "\n"
    (kept,) = (tmp_path / "runs").glob("previous-*/events.jsonl")
    assert kept.read_text() == "old layout\n"
    assert (run_dir(tmp_path, "r1") / "events.jsonl").read_text() == "r1\n"


def test_pick_standby_gives_a_server_its_old_stage_back():
    assert pick_standby(0, [("a", 1), ("b", 0)], {0, 1}) == "b"
    assert pick_standby(0, [("a", 1)], {0, 1}) is None  # a waits for stage 1
    assert pick_standby(1, [("a", 1)], {0, 1}) == "a"
    assert pick_standby(0, [("a", 1), ("c", -1)], {0, 1}) == "c"
    assert pick_standby(0, [("a", 1)], {0}) == "a"  # stage 1 has its server: a can take 0


def test_cli_refuses_bad_resume_in_one_line(tmp_path, capsys):
    from shoal.runtime.processes.cli import main

    _fake_run(tmp_path / "done", "20260102-000000-bbbbbb", done=True)
    for cmd, why in ((["coordinator", "--resume", str(tmp_path / "nope")], "no such folder"),
                     (["coordinator", "--resume", str(tmp_path / "done")], "is finished"),
                     (["coordinator", "--run-id", "x"], "use it with --resume")):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and why in err and err.count("\n") == 1, err
    # `shoal launch --resume` reads the journal in Swarm(), before any process starts
    # (main() turns the ShoalError into the same one line).
    from shoal.runtime.processes.launch import Swarm

    with pytest.raises(ShoalError, match="no run journal"):
        Swarm(launch_config(tmp_path, resume=True))
    assert not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------- real processes


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_total_stop_at_step_3_then_resume_equals_uninterrupted(tmp_path, tmp_path_factory):
    """Every process is killed (-9) after step 3 of 6; `launch --resume` continues from the
    last step every stage checkpointed: same losses, same weights as the failure-free run.
    Another (newer, finished) run in the same folder is neither touched nor picked when
    --run-id names ours."""
    from shoal.runtime.processes.launch import Swarm, launch

    ref_weights, ref_summary = _reference(tmp_path_factory)
    out = tmp_path / "run"
    with Swarm(launch_config(out, worker_args=[["--slow", "0.1"]] * 2)) as sw:
        sw.start()
        _wait_steps(sw, 3)
        sw.stop()  # kill -9 every member and the coordinator
        rid = sw.run_id
    killed_at = len(read_jsonl(run_dir(out, rid) / "metrics.jsonl"))
    assert 3 <= killed_at < RUN["steps"]
    _fake_run(out, "29990101-000000-ffffff", done=True)  # sorts newest: --run-id must win
    other = _hashes(run_dir(out, "29990101-000000-ffffff"))

    summary = launch(launch_config(out, resume=True, run_id=rid))
    assert summary["run_id"] == rid and summary["steps"] == RUN["steps"]
    assert summary["losses"] == ref_summary["losses"]
    assert_equal_weights(out, ref_weights)
    kinds = [r["kind"] for r in read_journal(run_dir(out, rid) / "journal.jsonl")]
    assert kinds.count("resume") == 1 and kinds[-1] == "done"
    rollback = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "rollback"]
    # Checkpoints are written in a thread after each commit: a kill -9 can land before the
    # newest commit's file is complete, so the resume may redo that one step, never more.
    assert rollback and rollback[-1]["version"] >= killed_at - 1 >= 2, (rollback, killed_at)
    assert _hashes(run_dir(out, "29990101-000000-ffffff")) == other
    assert (out / "summary.json").resolve() == (run_dir(out, rid) / "summary.json").resolve()


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_coordinator_killed_mid_run_is_restarted_and_the_run_stays_exact(tmp_path, tmp_path_factory):
    """kill -9 the coordinator after step 2: `launch` restarts it with --resume on the same
    address; servers and workers (never restarted) ride out the outage, re-join, and the
    run completes with the failure-free run's weights."""
    from shoal.runtime.processes.launch import Swarm

    ref_weights, ref_summary = _reference(tmp_path_factory)
    out = tmp_path / "run"
    with Swarm(launch_config(out, worker_args=[["--slow", "0.1"]] * 2)) as sw:
        sw.start()
        members = [p.pid for p in [*sw.servers, *sw.workers]]
        _wait_steps(sw, 2)
        address = sw.address
        sw.kill_coordinator()
        summary = sw.wait()
        assert sw.address == address
        assert [p.pid for p in [*sw.servers, *sw.workers]] == members  # no member was restarted
    assert summary["steps"] == RUN["steps"]
    assert summary["losses"] == ref_summary["losses"]
    assert_equal_weights(out, ref_weights)
    events = [e["event"] for e in read_jsonl(out / "events.jsonl")]
    assert "coordinator_restart" in events and "resume" in events


def test_resumed_coordinator_keeps_layers_and_gives_servers_their_stages(tmp_path):
    """In process: a coordinator commits 2 steps and is dropped; one resumed from its
    journal keeps the layer ranges and records, gives each re-joining server the stage it
    asks for, rolls back to the newest version both stages have, in a newer epoch."""
    import asyncio

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.roles.coordinator import Coordinator

    spec = pb.RunSpec(model="tiny", stages=2, steps=4, micro_batches=2, micro_batch_size=2, seq_len=16,
                      seed=0, lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0,
                      dead_after_s=5.0, min_lease_s=1.0, data="synthetic", ordered_grads=True)

    async def first():
        c = Coordinator(spec, "tok", min_workers=2, out=str(tmp_path), options={"min_workers": 2})
        for i in range(2):
            await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)
        for i in range(2):
            await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)
        s = list(c.stage_server)  # the plan may swap the servers' stages when workers join
        for step in range(2):
            reps = [pb.StepReport(member_id=s[k], stage=k, step=step, epoch=0, sq_norm=1.0,
                                  losses=[2.0 + step] * 2 if k else []) for k in range(2)]
            await asyncio.gather(*(c.ReportStep(r, None) for r in reps))
        return c.spec.run_id, list(c.layers), [c.members[m].name for m in s]

    run_id, layers, served = asyncio.run(first())
    _, rid, st = load_resume(tmp_path)
    assert rid == run_id and st.committed == 2 and st.layers == layers

    async def second():
        from google.protobuf import json_format

        # --min-workers gates a run's start only: a resumed run whose workers died or were
        # banned since then must not wait for them (7 here; two workers come back).
        c = Coordinator(json_format.ParseDict(st.spec, pb.RunSpec()), "tok", min_workers=7, out=str(tmp_path),
                        resume=st)
        assert c.epoch == 1 and c.committed == 2 and [r["loss"] for r in c.history] == [2.0, 3.0]
        # the servers re-join, stage 1's first, each asking for the stage it served
        new = {}
        for k in (1, 0):
            new[k] = (await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{9 + k}", name=served[k],
                                                  ckpt_stage=k), None)).member_id
        assert c.stage_server == [new[0], new[1]] and c.pending_restore
        for i in range(2):
            await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}", will_measure=True), None)
        assert not any(m.will_measure for m in c.members.values())  # nothing is re-planned
        a = [await c.Heartbeat(pb.MemberRequest(member_id=new[k], ckpt_version=2 - k), None) for k in range(2)]
        assert c.layers == layers and (a[0].first, a[0].last) == layers[0]
        assert a[1].epoch == 2 and a[1].restart_version == 1 and c.committed == 1  # stage 1 has only v1
        stale = await c.ReportStep(pb.StepReport(member_id=new[0], stage=0, step=1, epoch=0), None)
        assert stale.stale  # the old coordinator's epoch is fenced off

    asyncio.run(second())
    kinds = [r["kind"] for r in read_journal(run_dir(tmp_path, run_id) / "journal.jsonl")]
    assert kinds[0] == "run" and kinds.count("commit") == 2 and "resume" in kinds and kinds[-1] == "epoch"


def test_launch_restarts_a_dead_coordinator_only_while_the_run_is_unfinished():
    from shoal.runtime.processes.launch import should_restart

    assert should_restart(-9, 3, run_done=False)  # kill -9 mid-run: restarted with --resume
    assert should_restart(1, 1, run_done=False)  # a crash
    assert not should_restart(0, 3, run_done=False)  # done
    assert not should_restart(2, 3, run_done=False)  # a one-line error ends the run
    assert not should_restart(-9, 0, run_done=False)  # no restarts left
    assert not should_restart(-11, 3, run_done=True)  # died after journaling "done": nothing to resume
