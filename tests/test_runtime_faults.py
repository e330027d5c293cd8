"""Faults that land on real work: a worker is kill -9'd in an exact state of the run
(holding a lease mid-forward or mid-backward, holding accepted gradients it has not
pushed, between two of its pushes), chosen by the worker's test-only ``--inject hang_*``
faults: the first worker to reach the state reports it to a file and stops working
(heartbeats go on), the test kills it. Each case asserts what the fault must cause: the
work it held re-queued (counted in the step's record), the worker voided by its server and
dropped by the coordinator, a re-plan, no step lost, and the final weights bitwise equal to
``train_local``'s."""

from __future__ import annotations

import json
import time

import pytest
import torch

from shoal.runtime.processes.launch import LaunchConfig, Swarm
from shoal.runtime.roles.artifacts import load_final_weights
from shoal.runtime.roles.worker import parse_hangs
from shoal.train.local import TrainConfig, train_local
from shoal.train.metrics import read_jsonl

STEPS = 4
RUN = dict(model="tiny", steps=STEPS, micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3,
           warmup=2)


def test_parse_hangs():
    assert parse_hangs("nan_grad,hang_fwd:step=1:mark=/tmp/a,hang_mid_push:only=/tmp/b") == {
        "hang_fwd": {"step": "1", "mark": "/tmp/a"}, "hang_mid_push": {"only": "/tmp/b"}}
    from shoal.errors import ShoalError

    with pytest.raises(ShoalError, match="bad --inject item"):
        parse_hangs("hang_sideways")
    with pytest.raises(ShoalError, match="bad --inject item"):
        parse_hangs("hang_fwd:step1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    res = train_local(TrainConfig(**RUN, out=str(out), eval_every=0, eval_batches=1), quiet=True)
    return [r["loss"] for r in res.records], {k: v.detach().clone() for k, v in res.model.state_dict().items()}


def _latest_assignment(events: list[dict]) -> dict[str, int] | None:
    """The newest plan's worker -> stage (the start plan, or a repair after a join or a
    re-measurement), or None before the first plan."""
    plans = [e["assignment"] for e in events if e["event"] == "replan"]
    return plans[-1] if plans else None


def _run_with_hangs(tmp_path, hangs: list[list[str]], workers: int, restart: bool, lone: bool = False,
                    session: bool | None = None):
    """Run a 2-stage swarm whose workers carry ``hangs`` (one list of ``kind:step=N`` per
    fault, all sharing that fault's report file); kill -9 each reporting worker as soon as
    it reports. With ``lone``, only the single worker of a one-worker stage may hang (it is
    named in an ``only`` file once the start plan is known), so its death empties a stage.
    ``session``: the workers' transport (None: the run's default). Returns (reports, events,
    records, summary)."""
    marks = [tmp_path / f"fault{i}.json" for i in range(len(hangs))]
    only = tmp_path / "only.txt"
    spec = ",".join(f"{h}:mark={m}" + (f":only={only}" if lone else "")
                    for hs, m in zip(hangs, marks, strict=True) for h in hs)
    cfg = LaunchConfig(**RUN, out=str(tmp_path / "run"), stages=2, workers=workers, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=360, worker_args=[["--inject", spec]] * workers, session=session)
    reports: list[dict] = []
    out = tmp_path / "run"
    with Swarm(cfg) as sw:
        sw.start()
        pending = list(marks)
        deadline = time.time() + 330
        while pending and time.time() < deadline and sw.coord.poll() is None:
            if lone and not marks[0].exists() and (out / "events.jsonl").exists():
                # Follow the newest plan until the hang is claimed: a repair (a join, a
                # re-measurement) can move workers, and only a lone worker may hang.
                assign = _latest_assignment(read_jsonl(out / "events.jsonl"))
                if assign is not None:
                    per_stage = [[w for w, s in assign.items() if s == st] for st in (0, 1)]
                    loners = [ws[0] for ws in per_stage if len(ws) == 1]
                    assert loners, assign  # 3 workers on 2 stages: one stage has one
                    if not only.exists() or only.read_text() != loners[0] + "\n":
                        tmp = only.with_suffix(".tmp")
                        tmp.write_text(loners[0] + "\n")
                        tmp.replace(only)
            if pending[0].exists():
                rep = json.loads(pending.pop(0).read_text())
                i = int(rep["worker"][1:])
                sw.kill_worker(i)
                reports.append(rep)
                if restart:
                    sw.start_worker(i)
            time.sleep(0.05)
        assert not pending, f"no worker reached the state of {pending[0].name}"
        summary = sw.wait()
    return reports, read_jsonl(out / "events.jsonl"), read_jsonl(out / "metrics.jsonl"), summary


def _assert_outcome(tmp_path, reference, reports, events, recs, summary, requeued: list[int]):
    ref_losses, ref_weights = reference
    # no step lost, and the run is exactly the local trainer's
    assert summary["steps"] == STEPS
    assert [r["step"] for r in recs] == list(range(STEPS))
    assert [r["loss"] for r in recs] == ref_losses
    weights = load_final_weights(tmp_path / "run")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("server*.log"))
    for rep, n in zip(reports, requeued, strict=True):
        # the held work went back to the pool, counted in the step it belonged to
        assert recs[rep["step"]]["requeues"] >= n, (rep, recs[rep["step"]])
        # its server voided it and the coordinator dropped it
        assert f"voided worker {rep['member_id']}" in logs, rep
        kill = next(i for i, e in enumerate(events) if e["event"] == "kill" and e["device"] == rep["worker"])
        assert any(e["event"] == "leave" and e["device"] == rep["worker"] and e["why"] == "missed heartbeats"
                   for e in events[kill:]), rep
    assert summary["requeues"] >= sum(requeued)


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_kill9_lone_worker_mid_task_forces_a_replan(tmp_path, reference):
    """3 workers on 2 stages: the only worker of one stage dies inside a leased task (a
    forward on stage 0, forward+backward on the last stage). Its task is re-queued, and
    the coordinator must re-plan, moving a worker into the empty stage, or the run stalls."""
    reports, events, recs, summary = _run_with_hangs(
        tmp_path, [["hang_fwd:step=1", "hang_bwd:step=1"]], workers=3, restart=False, lone=True)
    (rep,) = reports
    assert rep["direction"] == ("FWD" if rep["stage"] == 0 else "FWDBWD"), rep
    _assert_outcome(tmp_path, reference, reports, events, recs, summary, [1])
    kill = next(i for i, e in enumerate(events) if e["event"] == "kill")
    moved = [e for e in events[kill:] if e["event"] == "replan" and e["why"] == "missed heartbeats"]
    assert moved and rep["stage"] in moved[0]["assignment"].values(), events[kill:]
    assert rep["worker"] not in moved[0]["assignment"]


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_kill9_holding_unpushed_gradients_then_between_pushes(tmp_path, reference):
    """Step 1: a worker dies holding accepted gradients it never pushed; step 2: another
    dies after one of its pushes was accepted, the rest unsent. Both are restarted."""
    # "Mid push" needs a push still to come: armed with hang_mid_push a worker sums no run from
    # micro-batch 0 (Worker._new_fold), so any worker holding two of a step's micro-batches gets
    # there, and with 4 micro-batches on at most 2 workers a stage one always does (a pre-summed
    # run 0..k would be one push: a fresh-clone suite once saw no such worker in steps 2-3).
    reports, events, recs, summary = _run_with_hangs(
        tmp_path, [["hang_before_push:step=1"], ["hang_mid_push:step=2"]], workers=4, restart=True)
    push, mid = reports
    assert push["held"] and mid["pushed"], reports
    _assert_outcome(tmp_path, reference, reports, events, recs, summary, [len(push["held"]), len(mid["unpushed"])])
