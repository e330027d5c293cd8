"""Replica plans in the runtime (``shoal launch --replicas``, local mode): the pure pieces by hand,
then real swarms whose every merge on every stage server is checked, bit for bit, against an
in-process reference of the same training (each replica trained on its own micro-batches with the
workers' inner AdamW; at each round every layer set to the micro-batch-weighted mean of the
replicas holding it, computed here by hand)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from shoal.errors import ShoalError
from shoal.runtime.sync.replicas import (
    Slot,
    merge_parts,
    own_part,
    parse_replicas,
    peers,
    replica_slots,
)

# ---------------------------------------------------------------------------- pure pieces


def test_parse_replicas_and_slots():
    assert parse_replicas("2,2", 4, 6) == ([2, 2], [2, 2])
    assert parse_replicas("1,2", 5, 6) == ([1, 2], [3, 2])
    assert parse_replicas("1:3,2:1", 4, 6) == ([1, 2], [3, 1])
    slots = replica_slots([1, 2], [2, 2], 6)
    assert slots == [Slot(0, 0, 6, 0, 2), Slot(1, 0, 3, 2, 4), Slot(1, 3, 6, 2, 4)]
    # a stage merges with the other replicas' stages that share a layer, never with its own replica's
    assert peers(slots, 0) == [1, 2] and peers(slots, 1) == [0] and peers(slots, 2) == [0]
    assert peers(replica_slots([2, 2], [2, 2], 6), 1) == [3]
    # uneven splits: a replica given by its stages' layer counts
    from shoal.runtime.sync.replicas import parse_replica_plan, replicas_of_plan

    assert parse_replica_plan("1:3,2+4:1", 4, 6) == ([1, 2], [3, 1], [6, 2, 4])
    assert parse_replica_plan("1,2+4", 4, 6) == ([1, 2], [2, 2], [6, 2, 4])
    assert replica_slots([1, 2], [3, 1], 6, [6, 2, 4])[1:] == [Slot(1, 0, 2, 3, 4), Slot(1, 2, 6, 3, 4)]
    # a plan of shoal plan --json: its replicas' layer splits and shares
    plan = {"micro_batches": 4, "replicas": [
        {"micro_batches": 3, "stages": [{"layers": [0, 6]}]},
        {"micro_batches": 1, "stages": [{"layers": [0, 2]}, {"layers": [2, 6]}]}]}
    assert replicas_of_plan(plan, 4, 6) == "1:3,2+4:1"
    with pytest.raises(ShoalError, match="give --micro-batches 4"):
        replicas_of_plan(plan, 8, 6)
    with pytest.raises(ShoalError, match="fewer than two"):
        replicas_of_plan({"micro_batches": 4, "replicas": plan["replicas"][:1]}, 4, 6)
    # a plan's clusters travel as each replica's regions after an '@'
    from shoal.runtime.sync.replicas import parse_replica_regions

    plan["replicas"][0]["cluster"], plan["replicas"][1]["cluster"] = "asia", "eu+us"
    assert replicas_of_plan(plan, 4, 6) == "1:3@asia,2+4:1@eu+us"
    assert parse_replica_plan("1:3@asia,2+4:1@eu+us", 4, 6) == ([1, 2], [3, 1], [6, 2, 4])
    assert parse_replica_regions("1:3@asia,2+4:1@eu+us") == ["asia", "eu+us"]
    assert parse_replica_regions("1,2@eu") == ["", "eu"] and parse_replica_regions("1,2") == []
    with pytest.raises(ShoalError, match="names no region"):
        parse_replica_regions("1@,2")


@pytest.mark.parametrize("text,msg", [
    ("2", "at least two replicas"), ("2,x", "is not STAGES"), ("1:3,2", "every replica's micro-batches or none"),
    ("1:3,2:3", "sum to --micro-batches 4"), ("0,2", "1 to 6 stages"), ("1,1,1,1,1", "each be >= 1"),
    ("1,2+3", "sum to the model's 6 layers"), ("1,0+6", "must each be >= 1"), ("1,2+x", "is not STAGES"),
])
def test_parse_replicas_refuses_bad_specs(text, msg):
    with pytest.raises(ShoalError, match=re.escape(msg)):
        parse_replicas(text, 4, 6)


def test_merge_parts_by_hand_across_splits():
    """A [0,6) replica's part and a [0,3)+[3,6) replica's two parts: each parameter is the
    micro-batch-weighted mean of the two replicas' copies, added in stage order."""
    a = {"layers.0.w": torch.tensor([1.0, 2.0]), "layers.4.w": torch.tensor([3.0])}
    b0 = {"layers.0.w": torch.tensor([4.0, 8.0])}
    b1 = {"layers.4.w": torch.tensor([9.0])}
    anchor = {"layers.4.w": torch.tensor([0.0])}  # the [3,6) stage's view
    weights, got = merge_parts({0: (3, True, a), 2: (1, True, b1)}, anchor)
    assert weights and set(got) == {"layers.4.w"}
    assert torch.equal(got["layers.4.w"], torch.tensor([3.0 * 0.75 + 9.0 * 0.25]))
    anchor0 = {"layers.0.w": torch.zeros(2), "layers.4.w": torch.zeros(1)}
    weights, got = merge_parts({0: (3, True, a), 1: (1, True, b0), 2: (1, True, b1)}, anchor0)
    assert torch.equal(got["layers.0.w"], torch.tensor([1.75, 3.5]))
    assert torch.equal(got["layers.4.w"], torch.tensor([4.5]))  # (3 x 3 + 9 x 1) / 4: b1 is a replica too
    # a part of no micro-batches drops out; mixed kinds merge as pseudo-gradients (anchor - weights)
    weights, got = merge_parts({0: (3, True, a), 2: (0, True, {})}, anchor)
    assert torch.equal(got["layers.4.w"], a["layers.4.w"])
    weights, got = merge_parts({0: (1, True, a), 2: (1, False, {"layers.4.w": torch.tensor([1.0])})}, anchor)
    assert not weights and torch.equal(got["layers.4.w"], torch.tensor([-1.0]))


def test_merge_parts_folds_to_merge_per_layers_bits():
    """The merge folds each part into the sum as it reads it: the same bits as each parameter's
    weighted mean over all its holders at once, for pseudo-gradient parts of three splits and
    uneven counts."""
    from shoal.train.outer import merge_pseudo_grads

    g = torch.Generator().manual_seed(7)
    names = [f"layers.{i}.w" for i in range(6)]
    anchor = {n: torch.randn(257, generator=g) for n in names}
    holds = {0: names, 1: names[:2], 2: names[2:], 3: names[:4], 4: names[4:]}
    counts = {0: 3, 1: 5, 2: 5, 3: 7, 4: 7}
    parts = {k: {n: torch.randn(257, generator=g) for n in ns} for k, ns in holds.items()}
    weights, got = merge_parts({k: (counts[k], False, t) for k, t in parts.items()}, anchor)
    # (the reference: each parameter merged over its holders on its own, all at once)
    want = {n: merge_pseudo_grads({k: {n: t[n]} for k, t in parts.items() if n in t}, counts)[n] for n in names}
    assert not weights and set(got) == set(names)
    assert all(torch.equal(got[n], want[n]) for n in names)


def test_own_part_is_the_workers_weighted_mean():
    w1 = {"p": torch.tensor([1.0])}
    w2 = {"p": torch.tensor([4.0])}
    n, weights, t = own_part({"a": w1, "b": w2}, {"a": w1, "b": w2}, {"a": 1, "b": 2}, 1.0, 0.0)
    assert (n, weights) == (3, True) and torch.equal(t["p"], torch.tensor([1.0 / 3 + 4.0 * (2 / 3)]))
    n, weights, t = own_part({"a": w1}, {}, {"a": 2}, 0.7, 0.9)
    assert (n, weights) == (2, False) and torch.equal(t["p"], w1["p"])
    assert own_part({}, {}, {}, 1.0, 0.0)[0] == 0


def test_launch_refuses_replicas_outside_local_mode(tmp_path):
    from shoal.runtime.processes.launch import LaunchConfig

    with pytest.raises(ShoalError, match="needs --sync local"):
        LaunchConfig(out=str(tmp_path), model="tiny", replicas="1,1").validate()
    with pytest.raises(ShoalError, match="at least two replicas"):
        LaunchConfig(out=str(tmp_path), model="tiny", replicas="2", sync="local").validate()
    cfg = LaunchConfig(out=str(tmp_path), model="tiny", replicas="1,2", sync="local", workers=3,
                       micro_batches=4)
    cfg.validate()
    assert cfg.stages == 3
    for comp in ("sparse", "push=sparse,pull=int8", "lowrank"):  # sparse pulls too (PullDeltas of the exact merge)
        LaunchConfig(out=str(tmp_path), model="tiny", replicas="1,1", sync="local", compression=comp,
                     workers=2).validate()


# ---------------------------------------------------------------------------- reference


def _run_spec(out: Path):
    """The run spec the coordinator journaled (the settings every member trained with)."""
    from google.protobuf import json_format

    from shoal.net import shoal_pb2 as pb

    first = json.loads((out / "journal.jsonl").read_text().splitlines()[0])
    return json_format.ParseDict(first["spec"], pb.RunSpec())


def reference(spec) -> tuple[list[float], dict[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The replicas' training in one process, one worker per stage: per-step losses, the merged
    weights after each round (by version), and the final weights.

    Each replica is the whole model (a stage split computes the same bits); per step it runs its
    micro-batches in order (``loss / M`` backward each, summed in micro-batch order, scaled to
    their mean), the clip coefficient comes from every stage's squared norm weighted by its
    replica's share of the step (``replica_sq_norm``, summed exactly), then one inner AdamW step.
    At a round's end every parameter becomes the micro-batch-weighted mean of the replicas'
    copies, replicas added in order, by hand."""
    from shoal.model.transformer import build_stage
    from shoal.runtime.common import micro_batch, model_config, optim_config
    from shoal.runtime.sync.replicas import slots_of_spec, stage_names
    from shoal.train.optim import (
        apply_update,
        clip_coefficient,
        lr_at,
        make_optimizer,
        total_sq_norm,
    )
    from shoal.train.outer import is_sync_step

    torch.manual_seed(0)
    cfg = model_config(spec)
    slots = slots_of_spec(spec, cfg.n_total_layers)
    n_rep = len(spec.replica_stages)
    m = spec.micro_batches
    ocfg = optim_config(spec)
    models = [build_stage(cfg, 0, cfg.n_total_layers, seed=spec.seed) for _ in range(n_rep)]
    opts = [make_optimizer(mod.named_parameters(), ocfg) for mod in models]
    round_mbs = [0] * n_rep
    losses, merged = [], {}
    for step in range(spec.steps):
        step_losses, totals, reports = [], [], []
        for r, mod in enumerate(models):
            s = next(x for x in slots if x.replica == r)
            mine = range(s.mb_lo, s.mb_hi)
            total: dict[str, torch.Tensor] = {}
            for mb in mine:
                x, y = micro_batch(spec, step, mb)
                for p in mod.parameters():
                    p.grad = None
                loss = mod(x, y)
                (loss / m).backward()
                step_losses.append(float(loss.detach()))
                for n, p in mod.named_parameters():
                    if n in total:
                        total[n].add_(p.grad)
                    else:
                        total[n] = p.grad.clone()
            scale = m / len(mine)
            for sl in slots:
                if sl.replica == r:
                    names = stage_names(cfg, sl.first, sl.last)
                    parts = [float((g * scale if scale != 1.0 else g).double().pow(2).sum())
                             for n, g in total.items() if n in names]
                    reports.append(sum([(len(mine) / m) * total_sq_norm(parts)]))
            totals.append((total, scale, len(mine)))
        coef = clip_coefficient(total_sq_norm(reports), ocfg.grad_clip)
        lr = lr_at(step, spec.steps, ocfg)
        for r, mod in enumerate(models):
            total, scale, n_mine = totals[r]
            for n, p in mod.named_parameters():
                g = total[n]
                p.grad = g.mul_(scale) if scale != 1.0 else g
            apply_update(opts[r], lr, coef)
            round_mbs[r] += n_mine
        losses.append(sum(step_losses) / len(step_losses))
        if is_sync_step(step, spec.sync_every, spec.steps):
            grand = sum(round_mbs)
            shares = [n / grand for n in round_mbs]
            params = [dict(mod.named_parameters()) for mod in models]
            with torch.no_grad():
                mean = {}
                for n in params[0]:
                    t = params[0][n].detach() * shares[0]
                    for r in range(1, n_rep):
                        t.add_(params[r][n].detach() * shares[r])
                    mean[n] = t
                for r in range(n_rep):
                    for n, p in params[r].items():
                        p.copy_(mean[n])
            merged[step + 1] = {n: t.clone() for n, t in mean.items()}
            round_mbs = [0] * n_rep
    return losses, merged, {n: p.detach().clone() for n, p in models[0].named_parameters()}


def _merges(out: Path) -> list[dict]:
    recs = []
    for p in sorted((out / "logs").glob("server*.log")):
        for m in re.finditer(r"local merge (\{.*\})$", p.read_text(), re.M):
            recs.append(json.loads(m.group(1)))
    return recs


def _check_against_reference(out: Path, summary: dict, steps: int, h: int) -> None:
    from shoal.runtime.common import model_config, tensors_digest
    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.runtime.sync.replicas import slots_of_spec, stage_names
    from shoal.train.metrics import read_jsonl

    spec = _run_spec(out)
    cfg = model_config(spec)
    slots = slots_of_spec(spec, cfg.n_total_layers)
    assert summary["steps"] == steps and summary["epochs"] == 1
    losses, merged, final = reference(spec)
    assert [r["loss"] for r in read_jsonl(out / "metrics.jsonl")] == losses
    # every stage server's weights after every round: the hand-computed merge of its layers, bit for bit
    merges = _merges(out)
    versions = sorted(merged)
    assert versions == [v for v in range(1, steps + 1) if v % h == 0 or v == steps]
    assert sorted((m["stage"], m["version"]) for m in merges) == [(k, v) for k in range(len(slots)) for v in versions]
    for m in merges:
        sl = slots[m["stage"]]
        names = stage_names(cfg, sl.first, sl.last)
        want = tensors_digest({n: t for n, t in merged[m["version"]].items() if n in names})
        assert m["digest"] == want, (m["stage"], m["version"])
        assert sum(m["contributors"].values()) == h_round(m["version"], h, steps) * (sl.mb_hi - sl.mb_lo)
    weights = load_final_weights(out)
    assert set(weights) == set(final)
    assert [n for n in final if not torch.equal(weights[n], final[n])] == []
    assert summary["replicas"]["final_weights_differ"] == []
    # the merges' bytes are counted: each stage's part to each peer, every round, in fp32
    rm = summary["bytes"]["replica_merge"]
    assert rm["raw"] == rm["wire"] > 0


def h_round(version: int, h: int, steps: int) -> int:
    """Steps in the round that ends at ``version``."""
    return version - (math.ceil(version / h) - 1) * h if version == steps else h


RUN = dict(model="tiny", micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)


def _plan_file(path: Path, one: list[str], first: list[str], second: list[str]) -> str:
    """A plan file (``shoal plan --json``'s form) of two replicas, 2 micro-batches each: [0, 6)
    worked by ``one``; [0, 2) by ``first`` and [2, 6) by ``second``. Returns its path."""
    path.write_text(json.dumps({"micro_batches": 4, "replicas": [
        {"micro_batches": 2, "stages": [{"layers": [0, 6], "workers": one}]},
        {"micro_batches": 2, "stages": [{"layers": [0, 2], "workers": first}, {"layers": [2, 6], "workers": second}]}]}))
    return str(path)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("replicas,workers", [("1,1", 2), ("1,2", 3), ("plan", 3)],
                         ids=["same-split", "split-1-vs-2", "plan-file-uneven"])
def test_replicas_merge_per_layer_bitwise(tmp_path, replicas, workers):
    """Two replicas, one worker per stage, H = 2 over 5 steps (rounds of 2, 2 and 1): losses,
    every stage server's merged weights after every round and the final weights equal the
    in-process reference bit for bit, and every replica holds the same final weights. The third
    case reads the replicas from a plan file (``shoal plan --json``'s form) with an uneven split,
    [0, 6) against [0, 2) + [2, 6)."""
    from shoal.runtime.processes.launch import LaunchConfig, launch

    steps, h = 5, 2
    out = tmp_path / "run"
    if replicas == "plan":
        path = tmp_path / "plan.json"
        path.write_text(json.dumps({"micro_batches": 4, "replicas": [
            {"micro_batches": 2, "stages": [{"layers": [0, 6]}]},
            {"micro_batches": 2, "stages": [{"layers": [0, 2]}, {"layers": [2, 6]}]}]}))
        replicas = str(path)
    # (the reference applies each merge at once: --no-overlap)
    summary = launch(LaunchConfig(out=str(out), **RUN, steps=steps, replicas=replicas, workers=workers,
                                  dead_after_s=3.0, min_lease_s=1.5, timeout_s=280, sync="local", sync_every=h,
                                  overlap=False))
    if replicas.endswith(".json"):
        assert summary["layers"] == [[0, 6], [0, 2], [2, 6]]
    _check_against_reference(out, summary, steps, h)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill9_of_a_replicas_lone_worker_loses_nothing_committed(tmp_path):
    """Two replicas of one stage, three workers (two on one replica, one on the other), H = 3:
    kill -9 the other replica's lone worker in the first round. The coordinator moves a worker
    over; the run commits every step without a roll-back, the killed worker is in no merge, and
    after every round both replicas hold the same weights (their servers' merge digests agree)."""
    import time

    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    steps, h = 9, 3
    cfg = LaunchConfig(out=str(tmp_path / "run"), **RUN, steps=steps, replicas="1,1", workers=3, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=280, sync="local", sync_every=h,
                       worker_args=[["--slow", "0.2"]] * 3)
    with Swarm(cfg) as sw:
        sw.start()
        while sw.committed_steps() < 1:
            time.sleep(0.05)
        by_stage: dict[int, list[str]] = {}
        for name, stage in sw.status()["workers"].items():
            by_stage.setdefault(stage, []).append(name)
        lone = next(ws[0] for ws in by_stage.values() if len(ws) == 1)
        assert sw.committed_steps() < h, "the run reached the first merge before the kill; slow it down"
        sw.kill_worker(int(lone[1:]))
        summary = sw.wait()
    out = tmp_path / "run"
    assert summary["steps"] == steps and summary["epochs"] == 1  # no roll-back: nothing committed lost
    assert all(math.isfinite(x) for x in summary["losses"])
    merges = _merges(out)
    assert sorted((m["stage"], m["version"]) for m in merges) == [(k, v) for k in (0, 1) for v in (3, 6, 9)]
    assert not any(mid.endswith(f"-{lone}") for m in merges for mid in m["contributors"])
    by_version: dict[int, set[str]] = {}
    for m in merges:
        by_version.setdefault(m["version"], set()).add(m["digest"])
    assert all(len(d) == 1 for d in by_version.values()), by_version
    assert summary["replicas"]["final_weights_differ"] == []
    # each replica's stage weighs in the merge what its own workers covered in the round
    covered = {(m["stage"], m["version"]): sum(m["contributors"].values()) for m in merges}
    for m in merges:
        total = covered[(0, m["version"])] + covered[(1, m["version"])]
        assert m["replicas"] == {str(k): covered[(k, m["version"])] / total for k in (0, 1)}, m


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill9_of_a_replicas_stage_server_rolls_back_to_a_merge(tmp_path):
    """Two replicas of one stage, H = 2, checkpoints at every merge, ``lowrank`` pushes and pulls:
    kill -9 replica 1's stage server mid-round once both servers hold the checkpoint of the
    first merge (v2, published and written at the commit of step 3 with delayed application),
    and start another. It restores the last merged
    version, the whole run (both replicas) rolls back to it and replays (every server's part
    residual and pull chain start again), and every merge after the roll-back leaves both
    replicas with the same weights; the final weights agree."""
    import time

    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.train.metrics import read_jsonl

    steps, h = 6, 2
    cfg = LaunchConfig(out=str(tmp_path / "run"), **RUN, steps=steps, replicas="1,1", workers=2, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=280, sync="local", sync_every=h, ckpt_every=h,
                       compression="lowrank", worker_args=[["--slow", "0.3"]] * 2)
    with Swarm(cfg) as sw:
        sw.start()
        while len(list((tmp_path / "run").rglob("v2.safetensors"))) < 2:
            time.sleep(0.02)
        sw.kill_server(1)
        sw.start_server()
        summary = sw.wait()
    out = tmp_path / "run"
    events = read_jsonl(out / "events.jsonl")
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks and rollbacks[0]["version"] == 2 and rollbacks[0]["committed"] >= 3, rollbacks
    assert summary["steps"] == steps and summary["epochs"] >= 2
    merges = _merges(out)
    by_key: dict[tuple[int, int], dict[int, str]] = {}
    for m in merges:
        by_key.setdefault((m["epoch"], m["version"]), {})[m["stage"]] = m["digest"]
    last_epoch = max(e for e, _ in by_key)
    # after the roll-back both replicas merge every round, to the same weights
    assert sorted(v for e, v in by_key if e == last_epoch) == [4, 6]
    for (e, v), digests in by_key.items():
        if e == last_epoch or v == 2:
            assert len(digests) == 2 and len(set(digests.values())) == 1, (e, v, digests)
    assert summary["replicas"]["final_weights_differ"] == []
    assert "lowrank" in summary["bytes_by_codec"]["weight_pull"]
    assert set(summary["bytes_by_codec"]["replica_merge"]) >= {"lowrank"}


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_replicas_with_outer_momentum_and_int8_pushes_stay_identical(tmp_path):
    """Differently split replicas whose parts are pseudo-gradients (int8 pushes with error
    feedback, outer lr 0.7 and momentum 0.9: the outer Nesterov step on every server): the
    run ends, every layer's copies are bitwise equal, and the pushes and the servers' parts
    were int8 (each server merges what its own part decodes to, as its peers do)."""
    from shoal.runtime.processes.launch import LaunchConfig, launch

    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), **RUN, steps=4, replicas="1,2", workers=3, dead_after_s=3.0,
                                  min_lease_s=1.5, timeout_s=280, sync="local", sync_every=2, outer_lr=0.7,
                                  outer_momentum=0.9, compression="push=int8"))
    assert summary["steps"] == 4 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["replicas"]["final_weights_differ"] == []
    assert set(summary["bytes_by_codec"]["grad_push"]) == {"int8"}
    # the stage servers' parts went in the push codec too (with error feedback), as the planner prices them
    rm = summary["bytes_by_codec"]["replica_merge"]
    assert set(rm) == {"int8"} and rm["int8"]["raw"] / rm["int8"]["wire"] >= 3.5, rm
    merges = _merges(out)
    assert sorted((m["stage"], m["version"]) for m in merges) == [(k, v) for k in range(3) for v in (2, 4)]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_replicas_with_sparse_pushes_and_pulls_end_dense_and_identical(tmp_path):
    """``sparse`` both ways across differently split replicas: the rounds before the last push
    and exchange sparse frames, the last is dense both ways (each server's part with what its
    earlier parts left, flush_part); pulls after a merge are sparse deltas of the exact merged
    weights (PullDeltas: each server's reconstruction its own, its weights the same bits as its
    peers'), 100x fewer bytes than the stage in bf16; every layer's copies end bitwise equal and
    the dense last round bans nobody."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), **RUN, steps=6, replicas="1,2", workers=3, dead_after_s=3.0,
                                  min_lease_s=1.5, timeout_s=280, sync="local", sync_every=2, compression="sparse"))
    assert summary["steps"] == 6 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["replicas"]["final_weights_differ"] == []
    assert set(summary["bytes_by_codec"]["grad_push"]) == {"sparse", "int8"}  # the last round: int8
    assert set(summary["bytes_by_codec"]["replica_merge"]) == {"sparse", "raw"}  # servers' last parts: fp32
    pulls = summary["bytes_by_codec"]["weight_pull"]
    assert set(pulls) == {"raw", "sparse"}  # whole weights once per worker, then the merges' deltas
    # deltas of the merges the replicas move onto (delayed application): v2, and v4 where it is
    # pulled before the last round ends; 3 workers: at most 6, fewer where one pulled whole (v6
    # comes after the last round); raw: what they stand for in fp32
    assert 1 <= pulls["sparse"]["messages"] <= 6 and pulls["sparse"]["wire"] * 100 <= pulls["sparse"]["raw"] / 2, pulls
    assert not [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "ban"]


def test_flush_part_adds_the_residual_to_a_pseudo_gradient_and_takes_it_off_weights():
    from shoal.runtime.sync.replicas import flush_part

    t, r = {"a": torch.ones(3), "b": torch.zeros(2)}, {"a": torch.full((3,), 0.5)}
    assert torch.equal(flush_part(t, False, r)["a"], torch.full((3,), 1.5))
    assert torch.equal(flush_part(t, True, r)["a"], torch.full((3,), 0.5))
    assert torch.equal(flush_part(t, True, r)["b"], t["b"])  # no residual: as it was
    assert torch.equal(t["a"], torch.ones(3))  # (pure: the part as it was)
    g = torch.Generator().manual_seed(0)
    for weights in (False, True):  # in place: the same bits, in the part's own tensors
        t, r = {"a": torch.randn(64, generator=g)}, {"a": torch.randn(64, generator=g)}
        want, a = flush_part(t, weights, r)["a"], t["a"]
        got = flush_part(t, weights, r, in_place=True)["a"]
        assert got is a and torch.equal(got, want)


def test_a_part_is_taken_only_from_a_peer_stages_server_and_checked(tmp_path, monkeypatch):
    """The receiving side of ReplicaPartStream in process: a part from the server the
    coordinator named for a peer stage is kept; one naming another member, a stage of the
    same replica, a wrong shape or an old round is not."""
    import asyncio

    from shoal.model.config import get_preset
    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import split
    from shoal.net.wire import encode_tensor
    from shoal.runtime.common import Signal
    from shoal.runtime.sync.held import HeldPushes
    from shoal.runtime.sync.replicas import FramedPart, ReplicaServerMixin, SpilledPart, merge_parts

    class Server(ReplicaServerMixin):
        budget = 1e9  # bytes of decoded parts a round may hold (the server's merge memory)

        def max_bytes(self, _what):
            return 1 << 20

        def _new_round_pushes(self):
            return HeldPushes(self.budget, available=lambda: 1e12, ram=1e9)

    cfg = get_preset("tiny")
    srv = Server()
    srv.spec = pb.RunSpec(stages=3, micro_batches=4, replica_stages=[1, 2], replica_mbs=[2, 2], sync_mode="local")
    srv.cfg, srv.name, srv.cond, srv.ckpt_root = cfg, "s2", Signal(), str(tmp_path)
    srv.stage, srv.epoch, srv.version, srv.local_merged = 2, 0, 2, 2
    srv.server_ids = ["s-a", "s-b", "s-c"]
    srv.params = {"layers.5.w": torch.zeros(3)}
    srv._replica_reset()

    def part(**kw):
        base = dict(member_id="s-a", epoch=0, round=4, stage=0, mbs=4, weights=True)
        base.update(kw)
        tensors = base.pop("tensors", {"layers.5.w": torch.ones(3)})
        msg = pb.ReplicaPart(**base)
        for n, t in tensors.items():
            msg.tensors.append(encode_tensor(n, t, "raw"))

        async def chunks():
            for c in split("ReplicaPart", msg.SerializeToString(), 1 << 16):
                yield c
        return asyncio.run(srv.ReplicaPartStream(chunks(), None))

    assert part(member_id="s-x").reason == "not ready"  # not the server of stage 0
    assert "holds none" in part(member_id="s-b", stage=1).reason  # its own replica's stage
    assert "rejected" in part(tensors={"layers.5.w": torch.ones(4)}).reason
    assert "rejected" in part(tensors={"layers.1.w": torch.ones(3)}).reason
    assert part(round=2).reason == "old; dropped" and not srv.replica_parts
    rep = part()
    assert rep.accepted and not rep.reason
    (n, weights, tensors), = srv.replica_parts[(0, 4)].values()
    assert (n, weights) == (4, True) and torch.equal(tensors["layers.5.w"], torch.ones(3))
    assert isinstance(tensors, dict)  # held decoded: within the merge memory
    # Beyond the merge memory a part is held as its frames, decoded where the merge reads it:
    # the same bits (here an int8 pseudo-gradient part of a later round).
    srv.budget = 0
    srv.params = {"layers.5.w": torch.zeros(4096)}
    g = torch.linspace(-1.0, 1.0, 4096)
    msg_t = encode_tensor("layers.5.w", g, "int8")
    from shoal.net.wire import decode_tensor

    async def framed_part(chunk_bytes=1 << 16):
        msg = pb.ReplicaPart(member_id="s-a", epoch=0, round=6, stage=0, mbs=3, weights=False)
        msg.tensors.append(msg_t)

        async def chunks():
            for c in split("ReplicaPart", msg.SerializeToString(), chunk_bytes):
                yield c
        return await srv.ReplicaPartStream(chunks(), None)

    assert asyncio.run(framed_part()).accepted
    (n, weights, held), = srv.replica_parts[(0, 6)].values()
    assert isinstance(held, FramedPart) and (n, weights) == (3, False)
    dense = decode_tensor(msg_t, shape=(4096,), dtype="float32", finite=True)
    own = {"layers.5.w": torch.linspace(2.0, -0.5, 4096)}
    anchor = {"layers.5.w": torch.zeros(4096)}
    a = merge_parts({0: (3, False, held), 2: (1, False, own)}, anchor)
    b = merge_parts({0: (3, False, {"layers.5.w": dense}), 2: (1, False, own)}, anchor)
    assert a[0] is b[0] is False and torch.equal(a[1]["layers.5.w"], b[1]["layers.5.w"])
    # A raw part (its frames no smaller than its tensors) beyond it goes to disk, read back once
    # by the merge: the same bits; its file goes with it.
    msg_t = encode_tensor("layers.5.w", g, "raw")
    assert asyncio.run(framed_part()).accepted
    (n, weights, spilled), = srv.replica_parts[(0, 6)].values()
    assert isinstance(spilled, SpilledPart) and Path(spilled.path).is_file()
    assert Path(spilled.path).parent == tmp_path / "replica-parts" / "s2"
    a = merge_parts({0: (3, False, spilled), 2: (1, False, own)}, anchor)
    b = merge_parts({0: (3, False, {"layers.5.w": g}), 2: (1, False, own)}, anchor)
    assert torch.equal(a[1]["layers.5.w"], b[1]["layers.5.w"]) and spilled._part is None
    path = spilled.path
    del spilled, held
    srv.replica_parts.clear()
    import gc

    gc.collect()
    assert not Path(path).exists()
    # A large one is received into a file as it comes (here anything of 8 KB or more; the file
    # unlinked at once) and not written again: the same bits, and the merge lets go of its pages.
    monkeypatch.setenv("SHOAL_SPOOL_MB", str(8 / 1024))
    assert asyncio.run(framed_part(4096)).accepted
    (n, weights, spooled), = srv.replica_parts[(0, 6)].values()
    assert isinstance(spooled, SpilledPart) and spooled.path is None and spooled._received.spool is not None
    assert not list((tmp_path / "replica-parts" / "s2").iterdir())
    a = merge_parts({0: (3, False, spooled), 2: (1, False, own)}, anchor)
    assert torch.equal(a[1]["layers.5.w"], b[1]["layers.5.w"]) and spooled._part is None
    monkeypatch.delenv("SHOAL_SPOOL_MB")
    srv.replica_parts.clear()
    # A disk that cannot take it (here the root is a file): the part stays in memory, the same bits.
    (tmp_path / "not-a-folder").write_text("")
    srv.ckpt_root = str(tmp_path / "not-a-folder")
    assert asyncio.run(framed_part()).accepted
    (n, weights, kept), = srv.replica_parts[(0, 6)].values()
    assert isinstance(kept, FramedPart) and torch.equal(kept["layers.5.w"], g)


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_coordinator_kill9_with_replicas_resumes_and_the_replicas_agree(tmp_path):
    """Replicas 1 and 2 stages, H = 2, checkpoints at every merge: kill -9 the coordinator after
    step 3; `launch` restarts it with --resume, it keeps the replicas' layers (from its journal),
    the run rolls back to a merged version and completes, and every layer's copies end bitwise
    equal (no member was restarted)."""
    import time

    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.train.metrics import read_jsonl

    steps, h = 6, 2
    cfg = LaunchConfig(out=str(tmp_path / "run"), **RUN, steps=steps, replicas="1,2", workers=3, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=380, sync="local", sync_every=h, ckpt_every=h,
                       worker_args=[["--slow", "0.2"]] * 3)
    with Swarm(cfg) as sw:
        sw.start()
        members = [p.pid for p in [*sw.servers, *sw.workers]]
        while sw.committed_steps() < 3:
            time.sleep(0.02)
        sw.kill_coordinator()
        summary = sw.wait()
        assert [p.pid for p in [*sw.servers, *sw.workers]] == members
    out = tmp_path / "run"
    events = read_jsonl(out / "events.jsonl")
    assert "coordinator_restart" in [e["event"] for e in events]
    assert summary["steps"] == steps and summary["layers"] == [[0, 6], [0, 3], [3, 6]]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks and all(e["version"] % h == 0 for e in rollbacks), rollbacks
    assert summary["replicas"]["final_weights_differ"] == []


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_standby_takes_over_a_replicas_killed_stage_server(tmp_path):
    """Two replicas of one stage with one hot standby (checkpoints at every merge, H = 2): once
    the standby holds a copy of a merged version of the stage it copies, kill -9 that stage's
    server. The standby is promoted, the run restarts every stage at one merged version and
    completes, and the replicas' final weights are bitwise equal."""
    import time

    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.train.metrics import read_jsonl

    # With delayed application merge v is published (and its file written) at step v + h, so
    # 10 steps leave steps 4..8 in which a copy of v >= 2 exists and the run has steps to go.
    steps, h = 10, 2
    out = tmp_path / "run"
    cfg = LaunchConfig(out=str(out), **RUN, steps=steps, replicas="1,1", workers=2, dead_after_s=3.0, min_lease_s=1.5,
                       timeout_s=380, sync="local", sync_every=h, standbys=1, worker_args=[["--slow", "0.3"]] * 2)
    with Swarm(cfg) as sw:
        sw.start()
        deadline = time.time() + 300
        while True:
            assert time.time() < deadline, "the standby copied no merged version"
            copies = {k: sorted(int(p.name[1:].split(".")[0])
                                for p in (out / "standby_ckpt" / "s2").glob(f"run-*/stage{k}/v*.safetensors"))
                      for k in (0, 1)}
            stage = next((k for k, vs in copies.items() if any(v >= h for v in vs)), None)
            if stage is not None and sw.committed_steps() < steps - 1:
                break
            time.sleep(0.05)
        victim = sw._stage_server_index(stage)
        assert victim is not None and victim < 2
        sw.kill_server(victim)
        summary = sw.wait()
    events = read_jsonl(out / "events.jsonl")
    assigns = [e for e in events if e["event"] == "assign" and e.get("role") == "server" and e.get("stage") == stage]
    assert assigns[-1]["device"] == "s2"  # the standby was promoted
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert rollbacks and all(e["version"] % h == 0 for e in rollbacks), rollbacks
    assert summary["steps"] == steps
    assert summary["replicas"]["final_weights_differ"] == []


def test_demo_plans_replicas_given_by_hand_and_reads_them_back():
    """``shoal demo --replicas``: the plan it predicts is the coordinator's (even layers, servers
    on the hosts in turn, workers balanced), and the plan read back from the run's events has
    the replicas the coordinator logged with its first re-plan."""
    from shoal.demo.cli import DemoConfig, hand_replica_plan, runtime_plan
    from shoal.plan.scenario import load_scenario

    sc = load_scenario("demo")
    plan = hand_replica_plan(sc, "1,2")
    assert [len(r.stages) for r in plan.replicas] == [1, 2]
    assert sum(r.micro_batches for r in plan.replicas) == sc.workload.micro_batches
    assert [st.layers for st in plan.all_stages] == [(0, 6), (0, 3), (3, 6)]
    assert all(st.workers for st in plan.all_stages)
    workers = [d.id for d in sc.workers]
    events = [{"event": "assign", "role": "server", "stage": k, "device": f"s{k}"} for k in range(3)]
    events.append({"event": "replan", "layers": [[0, 6], [0, 3], [3, 6]], "method": "replicas",
                   "assignment": {"w0": 0, "w1": 1, "w2": 2}, "replicas": {"stages": [1, 2], "micro_batches": [3, 1]}})
    got = runtime_plan(events, workers, [d.id for d in sc.server_hosts], "tiny", "demo", 2, 4)
    assert [(len(r.stages), r.micro_batches) for r in got.replicas] == [(1, 3), (2, 1)]
    assert [st.workers for st in got.all_stages] == [[workers[0]], [workers[1]], [workers[2]]]
    with pytest.raises(ShoalError, match="needs --sync local"):
        DemoConfig(replicas="1,1", sync="exact").validate()


def test_replica_workers_only_take_stages_their_memory_holds():
    from shoal.runtime.sync.replicas import assign_replica_workers

    # replica 0: one stage of the whole model (slot 0); replica 1: two stages (slots 1, 2)
    split = replica_slots([1, 2], [2, 2], 6)
    flops = {"a1": 10.0, "a2": 10.0, "b1": 10.0, "b2": 10.0, "b3": 10.0}
    regions = {"a1": "A", "a2": "A", "b1": "B", "b2": "B", "b3": "B"}
    # the 8 GB cards of region A hold half the model, not all of it; B's 24 GB cards hold anything
    fits = {"a1": [1, 2], "a2": [1, 2], "b1": [0, 1, 2], "b2": [0, 1, 2], "b3": [0, 1, 2]}
    # A (whose memory holds only the two-stage replica) chooses first: each replica in one region
    assert assign_replica_workers(flops, regions, split, fits=fits) == {"a1": 1, "a2": 2, "b1": 0, "b2": 0, "b3": 0}
    # without memory figures the larger region B takes the deeper replica
    assert {w for w, k in assign_replica_workers(flops, regions, split).items() if k in (1, 2)} == {"b1", "b2", "b3"}
    # a card that holds no stage is left out
    assert "c" not in assign_replica_workers(dict(flops, c=1.0), dict(regions, c="A"), split,
                                             fits=dict(fits, c=[]))


def test_replica_workers_keep_to_their_regions():
    from shoal.runtime.common import assign_workers
    from shoal.runtime.sync.replicas import assign_replica_workers

    same = replica_slots([1, 1], [2, 2], 6)
    flops = {"a1": 10.0, "a2": 10.0, "b1": 10.0, "b2": 10.0}
    regions = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
    got = assign_replica_workers(flops, regions, same)
    assert got == {"a1": 0, "a2": 0, "b1": 1, "b2": 1}  # each replica inside one region
    # one region for two replicas: plain balancing
    one = dict.fromkeys(flops, "L")
    assert assign_replica_workers(flops, one, same) == assign_workers(flops, [12.0, 12.0])
    # the larger region goes to the replica with more work; each stage of it gets a worker
    split = replica_slots([1, 2], [2, 2], 6)
    flops3 = {"a1": 10.0, "a2": 10.0, "a3": 10.0, "b1": 10.0}
    got = assign_replica_workers(flops3, {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}, split)
    assert {w for w, k in got.items() if k in (1, 2)} <= {"a1", "a2", "a3"} and {1, 2} <= set(got.values())
    assert got["b1"] == 0
    # a joiner goes to the replica already working in its region; kept workers stay
    cur = {"a1": 0, "a2": 0, "b1": 1, "b2": 1}
    got = assign_replica_workers({**flops, "b3": 10.0}, {**regions, "b3": "B"}, same, cur)
    assert got == {**cur, "b3": 1}
    # a region too small for its replica's stages: the empty stage takes a worker from elsewhere
    got = assign_replica_workers({"a1": 10.0, "a2": 10.0, "a3": 10.0, "b1": 10.0},
                                 {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}, replica_slots([2, 2], [2, 2], 6))
    assert set(got.values()) == {0, 1, 2, 3}
    # a plan's regions per replica (homes) name each region's replica; unnamed regions take the
    # replicas left, by the rule; a kept worker's replica wins for its region
    three = replica_slots([1, 1, 1], [2, 4, 2], 6)
    flops4 = {"a1": 10.0, "b1": 30.0, "c1": 10.0}
    reg4 = {"a1": "A", "b1": "B", "c1": "C"}
    by_rule = assign_replica_workers(flops4, reg4, three)
    assert by_rule["b1"] == 1  # the strongest region takes the replica of most work
    got = assign_replica_workers(flops4, reg4, three, homes=["B", "A", "C"])
    assert got == {"b1": 0, "a1": 1, "c1": 2}
    got = assign_replica_workers(flops4, reg4, three, homes=["", "C", ""])
    assert got["c1"] == 1 and {got["a1"], got["b1"]} == {0, 2}
    got = assign_replica_workers(flops4, reg4, three, {"a1": 2}, homes=["A", "B", "C"])
    # (region A stays with the kept worker's replica 2, so C joins it too; the empty replica 0 then
    # takes one of replica 2's two workers)
    assert got["b1"] == 1 and set(got.values()) == {0, 1, 2}


def test_replica_servers_move_to_their_replicas_region():
    from shoal.runtime.sync.replicas import place_replica_servers, replica_regions

    slots = replica_slots([1, 2], [2, 2], 6)
    assign = {"eu1": 0, "eu2": 0, "us1": 1, "us2": 2}
    regions = {"eu1": "eu", "eu2": "eu", "us1": "us", "us2": "us", "s0": "us", "s1": "eu", "s2": "us"}
    want = replica_regions(assign, regions, slots)
    assert want == ["eu", "us"]
    # stage 0 (eu replica) takes the eu server; the us replica's stages keep or take us servers
    assert place_replica_servers(["s0", "s1", "s2"], regions, [want[s.replica] for s in slots]) == ["s1", "s0", "s2"]
    # no server in a region: the stage keeps its own, or takes what is left
    assert place_replica_servers(["a", "b"], {"a": "x", "b": "x"}, ["y", "y"]) == ["a", "b"]
    assert place_replica_servers(["a", "b"], {"a": "x", "b": "y"}, ["y", "x"]) == ["b", "a"]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_a_worker_whose_memory_holds_no_stage_is_never_placed(tmp_path):
    """The demo scenario with one card cut to 1 MB (tiny's stages need several): the coordinator
    says why in an ``unplaced`` event, never assigns it a stage, and the run ends with the rest."""
    from shoal.plan import load_scenario
    from shoal.plan.scenario import scenario_to_dict
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    sc = scenario_to_dict(load_scenario("demo"))
    small = sc["devices"][0]
    small["memory_gb"] = 0.001
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(sc))
    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), model="tiny", stages=2, workers=4, steps=3, micro_batches=4,
                                  micro_batch_size=2, seq_len=32, seed=1, data=("synthetic",), scenario=str(path),
                                  emulate_speedup=3e-4, dead_after_s=3.0, min_lease_s=1.5, timeout_s=300,
                                  dashboard=None))
    assert summary["steps"] == 3
    events = read_jsonl(out / "events.jsonl")
    unplaced = [e for e in events if e["event"] == "unplaced"]
    # (one card: said again only if its process were dropped and joined anew)
    assert unplaced and len({e["device"] for e in unplaced}) == 1 and "hold no stage" in unplaced[0]["why"], unplaced
    name = unplaced[0]["device"]
    plans = [e for e in events if e["event"] == "replan"]
    assert plans and all(name not in e["assignment"] for e in plans), plans
    assert len(plans[0]["assignment"]) == 3, plans[0]  # the other three all work


def test_a_plan_files_worker_placement_is_read_and_kept_to_memory():
    from shoal.runtime.sync.replicas import planned_assignment, replica_workers_of_plan

    plan = {"micro_batches": 4, "replicas": [
        {"micro_batches": 2, "stages": [{"layers": [0, 6], "workers": ["d2", "d3"]}]},
        {"micro_batches": 2, "stages": [{"layers": [0, 2], "workers": ["d0"]}, {"layers": [2, 6], "workers": ["d1"]}]}]}
    assert replica_workers_of_plan(plan) == {"d2": 0, "d3": 0, "d0": 1, "d1": 2}
    assert replica_workers_of_plan({"replicas": [{"stages": [{"layers": [0, 6]}]}]}) == {}  # no worker lists
    plays = {"m0": "d0", "m1": "d1", "m2": "d2", "m9": "elsewhere"}
    placement = replica_workers_of_plan(plan)
    assert planned_assignment(placement, plays, 3) == {"m0": 1, "m1": 2, "m2": 0}
    # a stage the member's memory does not hold, or one the run does not have, is left to the coordinator
    assert planned_assignment(placement, plays, 3, {"m2": [1, 2]}) == {"m0": 1, "m1": 2}
    assert planned_assignment(placement, plays, 2) == {"m0": 1, "m2": 0}


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_launch_places_workers_as_the_replica_plan_file_says(tmp_path):
    """An emulated run given a plan file (``shoal plan --json``'s form) with worker lists: the
    coordinator's first assignment is the planner's (member wI plays the scenario's I-th worker)."""
    from shoal.plan import load_scenario
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    dev = [d.id for d in load_scenario("demo").workers[:4]]
    path = _plan_file(tmp_path / "plan.json", [dev[1], dev[2]], [dev[3]], [dev[0]])
    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), model="tiny", workers=4, steps=2, micro_batches=4, micro_batch_size=2,
                                  seq_len=32, seed=1, data=("synthetic",), scenario="demo", emulate_speedup=3e-4,
                                  dead_after_s=3.0, min_lease_s=1.5, timeout_s=300, dashboard=None, sync="local",
                                  sync_every=2, replicas=path))
    assert summary["steps"] == 2
    first = next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "replan")
    assert first["assignment"] == {"w1": 0, "w2": 0, "w3": 1, "w0": 2}, first


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_real_run_places_workers_named_as_the_plan_files_devices(tmp_path):
    """No emulation: members play no scenario device, so a plan file's worker lists name them by
    ``--name`` (``shoal launch`` names its workers w0, w1, ...); the first assignment is the plan's."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    path = _plan_file(tmp_path / "plan.json", ["w0", "w3"], ["w2"], ["w1"])
    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), **RUN, steps=2, replicas=path, workers=4, dead_after_s=3.0,
                                  min_lease_s=1.5, timeout_s=280, sync="local", sync_every=2))
    assert summary["steps"] == 2
    first = next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "replan")
    assert first["assignment"] == {"w0": 0, "w3": 0, "w2": 1, "w1": 2}, first


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_joiner_named_in_the_plan_file_goes_to_its_planned_stage(tmp_path):
    """w3 joins a running replica plan whose file puts it beside w2 on stage 1; by rule alone it
    would go to stage 0 (the least capacity per unit of work: 6 layers x 2 micro-batches on one
    worker). The re-plan after its join puts it where the plan file says."""
    import time

    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.runtime.sync.replicas import assign_replica_workers, replica_slots
    from shoal.train.metrics import read_jsonl

    slots = replica_slots([1, 2], [2, 2], 6, [6, 2, 4])
    rule = assign_replica_workers({f"w{i}": 1.0 for i in range(4)}, {}, slots, {"w0": 0, "w2": 1, "w1": 2})
    assert rule["w3"] == 0  # what the rule alone would do
    path = _plan_file(tmp_path / "plan.json", ["w0"], ["w2", "w3"], ["w1"])
    out = tmp_path / "run"
    cfg = LaunchConfig(out=str(out), **RUN, steps=6, replicas=path, workers=3, dead_after_s=3.0,
                       min_lease_s=1.5, timeout_s=280, sync="local", sync_every=2, worker_args=[["--slow", "0.2"]] * 4)
    with Swarm(cfg) as sw:
        sw.start()
        while sw.committed_steps() < 1:
            time.sleep(0.02)
        sw.start_worker()
        summary = sw.wait()
    assert summary["steps"] == 6
    replans = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "replan"]
    assert replans[0]["assignment"] == {"w0": 0, "w2": 1, "w1": 2}, replans[0]
    # (a member declared dead meanwhile under load would leave a stage empty, which the rule
    # fills first: judged at the first re-plan that holds all four)
    joined = next(e for e in replans if len(e["assignment"]) == 4)
    assert joined["assignment"] == {"w0": 0, "w2": 1, "w3": 1, "w1": 2}, joined

