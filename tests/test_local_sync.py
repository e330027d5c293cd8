"""Local-update mode (``--sync local``): the outer step's pure math by hand, the flags'
checks, and real swarms: H=1 with one worker per stage reproduces exact training; a
worker killed mid-round drops out of the merge without changing the others'
contributions; a joiner starts from the last merged weights."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from shoal.errors import ShoalError
from shoal.runtime.sync.local import (
    add_residual,
    bwd_owner_free,
    mean_scale,
    rebase_replica,
    replica_sq_norm,
    shift_replica,
)
from shoal.train.outer import (
    SyncConfig,
    is_sync_step,
    merge_pseudo_grads,
    merge_weights,
    outer_nesterov_step,
    round_closed_by,
)

# ---------------------------------------------------------------------------- pure math


def test_merge_weights_uneven_shares():
    # 5, 2 and 1 micro-batches of 8; a worker with none drops out
    w = merge_weights({"a": 5, "b": 2, "c": 1, "d": 0})
    assert w == {"a": 5 / 8, "b": 2 / 8, "c": 1 / 8}
    assert merge_weights({"a": 0}) == {}
    assert merge_weights({"solo": 7}) == {"solo": 1.0}


def test_merge_pseudo_grads_hand_computed():
    deltas = {"a": {"x": torch.tensor([8.0, -8.0])}, "b": {"x": torch.tensor([0.0, 4.0])},
              "c": {"x": torch.tensor([16.0, 0.0])}}
    merged = merge_pseudo_grads(deltas, {"a": 3, "b": 4, "c": 1})
    # (3*8 + 4*0 + 1*16) / 8 = 5 ; (3*-8 + 4*4 + 0) / 8 = -1
    assert torch.equal(merged["x"], torch.tensor([5.0, -1.0]))
    # a contributor that died is simply absent: the others keep their deltas, renormalised
    merged = merge_pseudo_grads({k: deltas[k] for k in ("a", "b")}, {"a": 3, "b": 4, "c": 1})
    assert torch.allclose(merged["x"], torch.tensor([24 / 7, -8 / 7]))
    assert torch.equal(deltas["a"]["x"], torch.tensor([8.0, -8.0]))  # inputs untouched
    assert merge_pseudo_grads({}, {}) is None
    # one contributor: its pseudo-gradient bit for bit
    d = torch.randn(100)
    assert torch.equal(merge_pseudo_grads({"a": {"x": d}}, {"a": 3})["x"], d)


def test_outer_nesterov_step_by_hand():
    p = {"x": torch.tensor([1.0, 2.0])}
    m: dict = {}
    d = {"x": torch.tensor([0.5, -1.0])}
    outer_nesterov_step(p, d, m, lr=0.5, mu=0.5)
    # m = 0.5*0 + d = [0.5, -1]; update = d + 0.5 m = [0.75, -1.5]; p -= 0.5 update
    assert torch.allclose(p["x"], torch.tensor([0.625, 2.75]))
    assert torch.allclose(m["x"], torch.tensor([0.5, -1.0]))
    outer_nesterov_step(p, d, m, lr=0.5, mu=0.5)
    # m = 0.25 + 0.5 = 0.75 / -0.5 - 1 = -1.5; update = d + 0.5 m = [0.875, -1.75]
    assert torch.allclose(m["x"], torch.tensor([0.75, -1.5]))
    assert torch.allclose(p["x"], torch.tensor([0.625 - 0.4375, 2.75 + 0.875]))
    # lr 1, no momentum: the plain update p - d
    q = {"x": torch.tensor([1.0, 2.0])}
    outer_nesterov_step(q, d, {}, lr=1.0, mu=0.0)
    assert torch.equal(q["x"], torch.tensor([0.5, 3.0]))


def test_small_decisions():
    assert [s for s in range(10) if is_sync_step(s, 4, 10)] == [3, 7, 9]
    assert [s for s in range(3) if is_sync_step(s, 1, 3)] == [0, 1, 2]
    # replica norms weighted by share: one replica with all M micro-batches reports its own
    assert replica_sq_norm({"a": (4, 2.5)}, 4) == 2.5
    assert replica_sq_norm({"a": (3, 2.0), "b": (1, 6.0)}, 4) == pytest.approx(0.75 * 2.0 + 0.25 * 6.0)
    assert mean_scale(4, 4) == 1.0 and mean_scale(8, 2) == 4.0
    assert not bwd_owner_free(owner_known=True, owner_gen_same=True, owner_alive=True)
    assert bwd_owner_free(False, False, False) and bwd_owner_free(True, False, True)
    assert bwd_owner_free(True, True, False)


def test_round_closed_by():
    """The round a worker closes when it sees a step's decision (delayed application)."""
    assert [round_closed_by(d, 4, 10) for d in (-1, 0, 2, 3, 4, 6, 7, 8, 9)] == [0, 0, 0, 4, 4, 4, 8, 8, 10]
    assert [round_closed_by(d, 1, 3) for d in (-1, 0, 1, 2)] == [0, 1, 2, 3]
    # every sync step closes its own round
    assert all(round_closed_by(s, 3, 11) == s + 1 for s in range(11) if is_sync_step(s, 3, 11))


def test_delayed_application_by_hand():
    """Two workers, three rounds of delayed application on hand-sized tensors (values exact in
    binary): each worker's pseudo-gradient is its own progress in that round only; it rebases
    onto the merge of the round before, so its replica is always the newest merge it has plus
    its own progress not merged yet; after the last round's merge the weights hold every
    round's mean progress exactly once."""
    m0 = torch.tensor([1.0, -2.0, 4.0])
    progress = [[torch.tensor([0.5, 0.0, -1.0]), torch.tensor([0.25, 1.0, 0.0])],  # round 0: w0, w1
                [torch.tensor([-0.5, 0.5, 0.5]), torch.tensor([0.0, 0.25, 1.0])],
                [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-1.0, 0.0, 0.5])]]
    merged = {0: {"p": m0.clone()}}  # merges by round: {version: weights}
    params = [{"p": m0.clone()} for _ in range(2)]
    anchors = [{"p": m0.clone()} for _ in range(2)]
    held = [{"p": m0.clone()} for _ in range(2)]  # the merge each worker holds
    for r, steps in enumerate(progress):
        pushes = []
        for w in range(2):
            params[w]["p"].sub_(steps[w])  # the round's inner steps
            pushes.append(anchors[w]["p"] - params[w]["p"])  # its pseudo-gradient: this round only
            assert torch.equal(pushes[-1], steps[w])
            newest = merged[max(merged)]  # the previous round's merge (this one's is not made yet)
            held[w] = {"p": newest["p"].clone()}
            rebase_replica(params[w], held[w], anchors[w])
            assert torch.equal(params[w]["p"], held[w]["p"] - steps[w])  # the merge plus its own progress
            assert torch.equal(anchors[w]["p"], params[w]["p"])
        # the round's merge (outer lr 1, momentum 0), made while the next round computes
        mean = merge_pseudo_grads({"w0": {"p": pushes[0]}, "w1": {"p": pushes[1]}}, {"w0": 1, "w1": 1})
        merged[r + 1] = {"p": merged[max(merged)]["p"] - mean["p"]}
    expected = m0 - sum((steps[0] + steps[1]) / 2 for steps in progress)
    assert torch.equal(merged[3]["p"], expected)
    # what a push left (keeps_residual) goes on the anchor: the next pseudo-gradient carries it
    p, a, m = {"p": torch.tensor([1.0, 1.0])}, {"p": torch.tensor([2.0, 2.0])}, {"p": torch.tensor([4.0, 0.0])}
    rebase_replica(p, m, a)
    add_residual(a, {"p": torch.tensor([0.5, -0.5])})
    assert torch.equal(p["p"], torch.tensor([3.0, -1.0])) and torch.equal(a["p"], torch.tensor([3.5, -1.5]))
    assert torch.equal(a["p"] - p["p"], torch.tensor([0.5, -0.5]))


def test_delayed_application_mid_round_by_hand():
    """Delayed application as soon as the merge is pulled (``shift_replica``): two workers,
    three rounds, each round's progress in two parts, before and after the previous round's
    merge arrives. After the shift the replica is that merge plus its progress since its
    round's end; each pseudo-gradient is still its own round's progress only; the merges hold
    every round's mean progress exactly once (values exact in binary)."""
    m0 = torch.tensor([1.0, -2.0, 4.0])
    before = [[torch.tensor([0.5, 0.0, -1.0]), torch.tensor([0.25, 1.0, 0.0])],
              [torch.tensor([-0.5, 0.5, 0.5]), torch.tensor([0.0, 0.25, 1.0])],
              [torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-1.0, 0.0, 0.5])]]
    after = [[torch.tensor([0.25, 0.5, 0.0]), torch.tensor([0.0, -0.5, 0.25])],
             [torch.tensor([1.0, 0.0, -0.5]), torch.tensor([0.5, 0.5, 0.5])],
             [torch.tensor([0.0, 0.25, 0.0]), torch.tensor([-0.25, 0.0, 1.0])]]
    merged = {0: m0.clone()}
    params = [{"p": m0.clone()} for _ in range(2)]
    anchors = [{"p": m0.clone()} for _ in range(2)]
    for r in range(3):
        pushes = []
        for w in range(2):
            params[w]["p"].sub_(before[r][w])
            if r > 0:  # the previous round's merge arrives mid-round
                shift_replica(params[w], {"p": merged[r].clone()}, anchors[w])
                assert torch.equal(params[w]["p"], merged[r] - before[r][w])
                assert torch.equal(anchors[w]["p"], merged[r])
            params[w]["p"].sub_(after[r][w])
            pushes.append(anchors[w]["p"] - params[w]["p"])  # closed: its pseudo-gradient
            assert torch.equal(pushes[-1], before[r][w] + after[r][w])
            anchors[w]["p"].copy_(params[w]["p"])  # the merge was applied already: only the anchor moves
        mean = merge_pseudo_grads({"w0": {"p": pushes[0]}, "w1": {"p": pushes[1]}}, {"w0": 1, "w1": 1})
        merged[r + 1] = merged[r] - mean["p"]
    assert torch.equal(merged[3], m0 - sum((before[r][0] + after[r][0] + before[r][1] + after[r][1]) / 2
                                          for r in range(3)))
    # what the last push left (keeps_residual) is in the anchor: after the shift the replica is
    # the merge less what the push left and less its progress since the close (where a merge
    # pulled at the round's end puts it: rebase_replica), and the next pseudo-gradient still
    # carries what was left
    p, a = {"p": torch.tensor([0.5, 2.0])}, {"p": torch.tensor([1.5, 0.5])}  # closed at [1, 1], left [0.5, -0.5]
    shift_replica(p, {"p": torch.tensor([3.0, 0.0])}, a)
    assert torch.equal(p["p"], torch.tensor([2.0, 1.5]))  # [3, 0] - [0.5, -0.5] - ([1, 1] - [0.5, 2])
    assert torch.equal(a["p"], torch.tensor([3.0, 0.0]))  # the merge
    assert torch.equal(a["p"] - p["p"], torch.tensor([1.0, -1.5]))  # what was left plus the progress
    p2, a2 = {"p": torch.tensor([0.5, 2.0])}, {"p": torch.tensor([1.5, 0.5])}
    rebase_replica(p2, {"p": torch.tensor([3.0, 0.0])}, a2)  # the same merge taken at the round's end
    assert torch.equal(p2["p"], p["p"])


@pytest.mark.parametrize("kw,msg", [
    (dict(mode="dilo"), "--sync must be one of"), (dict(mode="local", sync_every=0), "--sync-every"),
    (dict(mode="local", outer_lr=0.0), "--outer-lr"), (dict(mode="local", outer_lr=math.nan), "--outer-lr"),
    (dict(mode="local", outer_momentum=1.0), "--outer-momentum"),
])
def test_sync_config_refuses_bad_values(kw, msg):
    with pytest.raises(ShoalError, match=msg):
        SyncConfig(**kw).validate()
    with pytest.raises(ShoalError, match="fp16"):
        SyncConfig(mode="local").validate("fp16")
    assert SyncConfig().validate() == SyncConfig(mode="exact", sync_every=32, outer_lr=1.0, outer_momentum=0.0)


def test_launch_cli_bad_sync_is_one_line(tmp_path, capsys):
    from shoal.runtime.processes.cli import main

    assert main(["launch", "--out", str(tmp_path / "r"), "--sync", "local", "--sync-every", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --sync-every must be at least 1, got 0"]


def test_demo_checks_sync_flags():
    from shoal.demo.cli import DemoConfig

    with pytest.raises(ShoalError, match="--outer-momentum must be in"):
        DemoConfig(sync="local", outer_momentum=-0.1, dashboard=None).validate()
    DemoConfig(sync="local", sync_every=4, dashboard=None).validate()


def test_cli_registration_does_not_import_torch():
    import subprocess
    import sys

    code = ("import argparse, sys; import shoal.runtime.processes.cli as c; p = argparse.ArgumentParser(); "
            "c.register(p.add_subparsers()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-500:]


# ---------------------------------------------------------------------------- swarms

RUN = dict(model="tiny", micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)


def _merges(out: Path) -> list[dict]:
    """Every ``local merge`` the stage servers logged."""
    recs = []
    for p in sorted((out / "logs").glob("server*.log")):
        for m in re.finditer(r"^(\S+ \S+) .*local merge (\{.*\})$", p.read_text(), re.M):
            recs.append({**json.loads(m.group(2)), "at": _stamp(m.group(1))})
    return recs


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_h1_one_worker_per_stage_equals_exact(tmp_path):
    """H=1, outer lr 1, momentum 0, one worker per stage: the replica's inner AdamW step is the
    exact step and the merge is the lone replica's weights (workers send weights, not
    ``p - p'``, at outer lr 1 and momentum 0: ``p - (p - p')`` differs from ``p'`` in the last
    bit where ``p - p'`` is rounded, and AdamW grows those bits); the clip coefficient comes from
    the replicas' per-parameter norms. So losses, norms and weights equal the local trainer's,
    bit for bit."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.train.local import TrainConfig, train_local
    from shoal.train.metrics import read_jsonl

    steps = 4
    ref = train_local(TrainConfig(**RUN, steps=steps, out=str(tmp_path / "ref"), eval_every=0, eval_batches=1),
                      quiet=True)
    out = tmp_path / "run"
    launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=2, workers=2, dead_after_s=3.0, min_lease_s=1.5,
                        timeout_s=200, sync="local", sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                        overlap=False))
    recs = [(r["loss"], r["grad_norm"]) for r in read_jsonl(out / "metrics.jsonl")]
    assert recs == [(r["loss"], r["grad_norm"]) for r in ref.records]
    weights = load_final_weights(out)
    ref_w = {k: v.detach() for k, v in ref.model.state_dict().items()}
    differ = [k for k in ref_w if not torch.equal(weights[k], ref_w[k])]
    assert not differ, (differ[:3], max(float((weights[k] - ref_w[k]).abs().max()) for k in ref_w))
    merges = _merges(out)
    assert sorted((m["stage"], m["version"]) for m in merges) == [(s, v) for s in (0, 1) for v in range(1, 5)]
    assert all(list(m["contributors"].values()) == [4] for m in merges)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_overlap_one_worker_per_stage_follows_exact(tmp_path):
    """Delayed application (the default) with one worker per stage, H = 2: each worker rebases
    onto the previous round's merge, which is its own earlier progress, so it trains as exact
    sync does up to rounding (a double-counted or lost round would move the loss by far more).
    A round's merge is made while the next round computes: the worker pulls version v - 2 when
    it closes round v, with the server's digest of that merge."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.train.local import TrainConfig, train_local
    from shoal.train.metrics import read_jsonl

    steps = 6
    ref = train_local(TrainConfig(**RUN, steps=steps, out=str(tmp_path / "ref"), eval_every=0, eval_batches=1),
                      quiet=True)
    out = tmp_path / "run"
    launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=2, workers=2, dead_after_s=3.0, min_lease_s=1.5,
                        timeout_s=200, sync="local", sync_every=2))
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert losses == pytest.approx([r["loss"] for r in ref.records], rel=1e-5, abs=0)
    weights = load_final_weights(out)
    worst = max(float((weights[k] - v.detach()).abs().max()) for k, v in ref.model.state_dict().items())
    assert worst < 1e-4, worst
    merges = _merges(out)
    assert sorted((m["stage"], m["version"]) for m in merges) == [(s, v) for s in (0, 1) for v in (2, 4, 6)]
    assert all(m.get("overlap") for m in merges)
    digests = {(m["stage"], m["version"]): m["digest"] for m in merges}
    for k in (0, 1):
        text = (out / "logs" / f"worker{k}.log").read_text()
        # the order of one worker's rounds: merge v - 2 reaches the replica (mid-round, once
        # pulled, or at the round's end), then round v is sent
        events = re.findall(r"(pulled merged weights v(\d+) digest (\w+) \((?:its replica rebased|applied mid-round)|"
                            r"sent its pseudo-gradient for v(\d+))", text)
        seq = [("pull", int(v)) if v else ("send", int(s)) for _, v, _, s in events]
        # (merge v4 may reach it during the last round, if pulled before that round ends)
        assert seq in ([("pull", 0), ("send", 2), ("pull", 2), ("send", 4), ("send", 6)],
                       [("pull", 0), ("send", 2), ("pull", 2), ("send", 4), ("pull", 4), ("send", 6)]), seq
        pulled = [d for _, v, d, _ in events if v and int(v) == 2]
        assert pulled in ([digests[(0, 2)]], [digests[(1, 2)]]), (pulled, digests)


@pytest.mark.integration
@pytest.mark.timeout(280)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "waited"])
def test_a_pseudo_gradient_that_cannot_land_is_withdrawn(tmp_path, overlap):
    """Worker 0's first pseudo-gradient never leaves it (every attempt fails): it tells its
    server that it will not come, so the merge goes on without it at once instead of waiting
    out the flush grace (here 4 x 30 s) and voiding it, and the run ends. The grace is long
    enough that a merge that waited for it would log the void this test refuses."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), **RUN, steps=4, stages=2, workers=2, dead_after_s=30.0,
                                  min_lease_s=1.5, timeout_s=240, sync="local", sync_every=2, overlap=overlap,
                                  worker_args=[["--inject", "pseudo_abandon"], []]))
    assert summary["steps"] == 4 and len(read_jsonl(out / "metrics.jsonl")) == 4
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
    assert "attempt 5 of 5" in logs["worker0.log"]
    assert "withdrew from the merge of v2 (withdrawn from the merge)" in logs["worker0.log"]
    servers = "".join(v for k, v in logs.items() if k.startswith("server"))
    assert re.search(r"withdrew from the merge of v2: it could not send its pseudo-gradient", servers)
    assert "sent no pseudo-gradient" not in servers
    # its stage merged v2 without it (the other stage's worker is in its own merge). Waiting for
    # each round, it pulled v2 and was in v4. With delayed application the send failed while
    # round v4 went on: if the round had ended by the resync, its progress went with it and it
    # withdrew from v4 too; if not, it pulled v2 and was in v4 (which depends on the box's speed)
    merged = {v: sorted(len(m["contributors"]) for m in _merges(out) if m["version"] == v) for v in (2, 4)}
    gave_up = "withdrew from the merge of v4 (withdrawn from the merge)" in logs["worker0.log"]
    assert merged == {2: [0, 1], 4: [0, 1] if gave_up else [1, 1]}, (merged, gave_up)
    assert overlap or not gave_up


def _started_by_stage(sw) -> dict[int, list[str]]:
    """Start the swarm, wait for its first committed step, return its workers by stage."""
    sw.start()
    while sw.committed_steps() < 1:
        time.sleep(0.05)
    by_stage: dict[int, list[str]] = {}
    for name, stage in sw.status()["workers"].items():
        by_stage.setdefault(stage, []).append(name)
    return by_stage


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill9_mid_round_and_joiner(tmp_path):
    """S=2, three workers, H=3: kill -9 one of the two workers of a stage in the first round,
    then start a joiner. The killed worker is in no merge; the survivor's contribution is the
    micro-batch count it applied itself; the joiner's first weights are a merge's, bit for bit."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    steps, h = 12, 3
    cfg = LaunchConfig(out=str(tmp_path / "run"), **RUN, steps=steps, stages=2, workers=3, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=280, sync="local", sync_every=h, outer_lr=0.7,
                       outer_momentum=0.9, worker_args=[["--slow", "0.2"]] * 4)
    with Swarm(cfg) as sw:
        by_stage = _started_by_stage(sw)
        pair = next(sorted(ws) for ws in by_stage.values() if len(ws) == 2)
        victim, survivor = pair
        assert sw.committed_steps() < h, "the run reached the first merge before the kill; slow it down"
        sw.kill_worker(int(victim[1:]))
        joiner = f"w{sw.start_worker()}"
        summary = sw.wait()
    out = tmp_path / "run"
    assert summary["steps"] == steps and all(math.isfinite(x) for x in summary["losses"])
    merges = _merges(out)
    assert sorted((m["stage"], m["version"]) for m in merges) == [(s, v) for s in (0, 1) for v in (3, 6, 9, 12)]
    contributors = [mid for m in merges for mid in m["contributors"]]
    assert not any(mid.endswith(f"-{victim}") for mid in contributors)
    # the survivor's weight in the first merge is the count it applied itself, not changed by the
    # kill. The re-plan after the kill often moves it to the other stage mid-round: it holds
    # that move until its pseudo-gradient is sent (and keeps its weight: it once weighed 0
    # when voided right after sending). Only a stage idle past dead_after_s + 2 s lets the move
    # go first; then its un-merged progress is dropped and it is in no first merge.
    slog = (out / "logs" / f"worker{survivor[1:]}.log").read_text()
    sent = re.search(r"sent its pseudo-gradient for v3 covering (\d+) micro-batches", slog)
    first = [m for m in merges if m["version"] == 3]
    got = {mid.rsplit("-", 1)[1]: n for m in first for mid, n in m["contributors"].items()}
    moves = [m.start() for m in re.finditer(r"works on stage", slog)]
    if sent:
        assert got[survivor] == int(sent.group(1)) > 0
        held = slog.find("holds its move")
        if held >= 0 and len(moves) >= 2:  # held mid-round: moved only after the send (or not at
            assert held < sent.start() < moves[1], slog[-2000:]  # all, when a later re-plan kept it)
    else:
        assert len(moves) >= 2 and survivor not in got, slog[-2000:]
    # every contributor of a first merge weighs exactly what it applied itself. (Which workers
    # contribute depends on the re-plan after the kill: a worker the coordinator moves to the
    # victim's stage loses its un-merged progress, so a stage's first merge may cover fewer
    # than 3 x 4 micro-batches, or none when every worker of that stage moved or died.)
    for m in first:
        for mid, n in m["contributors"].items():
            w = mid.rsplit("-", 1)[1]
            own = re.findall(r"sent its pseudo-gradient for v3 covering (\d+) micro-batches",
                             (out / "logs" / f"worker{w[1:]}.log").read_text())
            assert own and n == int(own[-1]), (w, n, own)
    # the joiner started from the newest merged weights of its stage when it pulled, bit for bit
    jlog = (out / "logs" / f"worker{joiner[1:]}.log").read_text()
    pulled = re.search(r"^(\S+ \S+) .*pulled merged weights v(\d+) digest ([0-9a-f]+)", jlog, re.M)
    assert pulled, jlog[-2000:]
    # the stage it pulled for: the last assignment before the pull (the coordinator may move it)
    stage = int(re.findall(r"works on stage (\d+)", jlog[:pulled.start()])[-1])
    at, version, digest = _stamp(pulled.group(1)), int(pulled.group(2)), pulled.group(3)
    before = [m for m in merges if m["stage"] == stage and m["at"] <= at]
    if before:
        newest = max(before, key=lambda m: m["version"])
        assert (version, digest) == (newest["version"], newest["digest"])
    else:  # joined before the first merge: the initial weights, as the first workers got them
        assert version == 0
        firsts = {m.group(1) for p in (out / "logs").glob("worker*.log")
                  for m in re.finditer(r"pulled merged weights v0 digest ([0-9a-f]+)", p.read_text())}
        assert digest in firsts
    assert summary["tasks_per_worker"].get(joiner, 0) > 0


def _stamp(text: str) -> float:
    """Seconds of a log line's timestamp (``2026-11-30 16:29:52,921``; all processes share the clock)."""
    import datetime

    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_move_is_urgent_only_when_nobody_else_works_on_the_stage():
    from shoal.runtime.roles.coordinator import move_is_urgent

    assert move_is_urgent(1, "a", {"a": 0, "b": 0})  # nobody at work on stage 1
    assert move_is_urgent(1, "a", {"a": 1})  # only itself (already there, or reporting stale)
    assert not move_is_urgent(1, "a", {"a": 0, "b": 1})
    assert move_is_urgent(0, "a", {})


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_move_into_an_emptied_stage_is_not_held(tmp_path):
    """Local mode, H = 6: kill -9 the lone worker of a stage mid-round. The re-plan moves a
    worker of the other stage, which holds un-merged progress, into the emptied stage: the
    coordinator marks that move urgent (nobody else works there), so the worker moves at its
    next heartbeat instead of holding the move for its round's end (a round that cannot end
    without that stage) or waiting out the idle backstop."""
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    cfg = LaunchConfig(out=str(tmp_path / "run"), **RUN, steps=8, stages=2, workers=3, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=280, sync="local", sync_every=6, worker_args=[["--slow", "0.2"]] * 3)
    with Swarm(cfg) as sw:
        by_stage = _started_by_stage(sw)
        emptied, (lone,) = next((s, ws) for s, ws in by_stage.items() if len(ws) == 1)
        assert sw.committed_steps() < 6, "the run reached the first merge before the kill; slow it down"
        sw.kill_worker(int(lone[1:]))
        summary = sw.wait()
    assert summary["steps"] == 8
    logs = {p.name: p.read_text() for p in (tmp_path / "run" / "logs").glob("worker*.log")}
    moved = [n for n, text in logs.items() if n != f"worker{lone[1:]}.log"
             and len(re.findall(r"works on stage", text)) >= 2 and f"works on stage {emptied} " in text]
    assert moved, {n: t[-1500:] for n, t in logs.items()}
    assert not any(f"holds its move to stage {emptied} " in t for t in logs.values()), \
        {n: t[-1500:] for n, t in logs.items()}


def test_merge_per_layer_of_differently_split_replicas():
    """A replica of layers [0, 6) and one split [0, 3) + [3, 6) merge layer by layer, as by hand."""
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.common import model_config
    from shoal.train.outer import merge_per_layer

    cfg = model_config(pb.RunSpec(model="tiny", seq_len=16))
    n = cfg.n_total_layers
    assert n >= 4
    mid = n // 2
    torch.manual_seed(0)

    def deltas(first, last):
        return {k: torch.randn_like(p) for k, p in build_stage(cfg, first, last, init=False).named_parameters()}

    whole, head, tail = deltas(0, n), deltas(0, mid), deltas(mid, n)
    # the split pipeline's stages: its back stage lost one micro-batch (a recompute it never made)
    counts = {"whole": 3, "split0": 5, "split1": 4}
    got = merge_per_layer({"whole": whole, "split0": head, "split1": tail}, counts)
    assert set(got) == set(whole)
    for name, d in whole.items():
        layer = int(name.split(".")[1])
        other, k = (head[name], 5) if layer < mid else (tail[name], 4)
        assert layer < mid and name in head or layer >= mid and name in tail
        hand = d * (3 / (3 + k)) + other * (k / (3 + k))
        assert torch.allclose(got[name], hand, rtol=0, atol=1e-6), name
    # a layer only one replica holds is its delta bit for bit; a replica with no micro-batch drops out
    got = merge_per_layer({"split0": head, "split1": tail, "whole": whole}, {"split0": 5, "split1": 4, "whole": 0})
    assert all(torch.equal(got[k], head[k]) for k in head) and all(torch.equal(got[k], tail[k]) for k in tail)
    bad = dict(head)
    name = next(iter(bad))
    bad[name] = torch.zeros(3)
    with pytest.raises(ShoalError, match="cannot merge"):
        merge_per_layer({"a": head, "b": bad}, {"a": 1, "b": 1})
