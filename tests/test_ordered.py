"""Exact sync's ordered pushes: the worker's running sum of its run from micro-batch 0."""

import itertools
import random

import pytest
import torch

from shoal.runtime.sync.ordered import PrefixFold, PushFold, ordered_groups


def _grads(n: int, seed: int = 0) -> dict[int, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes apart by powers of ten: a different order of additions gives other bits
    return {mb: {"w": torch.randn(7, 5, generator=gen) * 10 ** (mb % 4), "b": torch.randn(5, generator=gen)}
            for mb in range(n)}


def _same(a, b) -> bool:
    return [ids for ids, _ in a] == [ids for ids, _ in b] and all(
        ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga) for (_, ga), (_, gb) in zip(a, b, strict=True))


@pytest.mark.parametrize("held", [(0, 1, 2, 3), (0, 1, 2, 5, 7), (1, 2, 5), (0,), (0, 2, 3), (3, 0, 1, 2)])
def test_the_fold_pushes_what_ordered_groups_pushes_in_every_arrival_order(held):
    g = _grads(8)
    want = ordered_groups({mb: g[mb] for mb in held})
    orders = list(itertools.permutations(held)) if len(held) <= 4 else \
        [random.Random(s).sample(held, len(held)) for s in range(30)]
    for order in orders:
        fold = PrefixFold()
        for mb in order:
            fold.add(mb, g[mb])
        assert _same(fold.groups(), want), order


def _commit_sum(pushes):
    """The stage server's sum at commit without a fold (StageServer._sum_pushes): pushes by first
    micro-batch, each tensor cloned from the first and added to in that order."""
    out = {}
    for _, grads, *_ in sorted(pushes, key=lambda p: p[0]):
        for name, t in grads.items():
            if name in out:
                out[name].add_(t)
            else:
                out[name] = t.clone()
    return out


@pytest.mark.parametrize("groups", [[(0,), (1,), (2,), (3,), (4,)], [(0, 1, 2), (3,), (4,), (5,)],
                                    [(0, 2), (1, 3), (4,), (5, 6)]])
def test_the_servers_fold_sums_pushes_as_the_commit_would_in_every_arrival_order(groups):
    """PushFold adds a push once every micro-batch before it is in: whatever order the pushes
    arrive in, the sum is the commit's bit for bit, and all of it is made by the last push."""
    g = _grads(8, seed=1)
    pushes = []
    for ids in groups:
        summed = {k: sum((g[mb][k] for mb in ids[1:]), g[ids[0]][k].clone()) for k in ("w", "b")}
        pushes.append((min(ids), summed, "w0", ids))
    want = _commit_sum(pushes)
    for s in range(12):
        order = random.Random(s).sample(pushes, len(pushes))
        fold, arrived = PushFold(), []
        for p in order:
            arrived.append(p)
            while (nxt := fold.ready(arrived)) is not None:
                fold.take(nxt)
            # a push is taken only once every micro-batch before its first is covered
            assert all(all(mb in {m for q in fold.taken for m in q[3]} for mb in range(q[0])) for q in fold.taken)
        got = fold.result(sorted(arrived, key=lambda p: p[0]))
        assert got is not None and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # a list other than the one summed (a push taken back by a ban): no sum, the commit sums anew
    fold = PushFold()
    while (nxt := fold.ready(pushes)) is not None:
        fold.take(nxt)
    assert fold.result(sorted(pushes[1:], key=lambda p: p[0])) is None
    assert fold.result(sorted(pushes, key=lambda p: p[0])) is not None


def test_a_stages_only_worker_holds_one_sum_and_its_gradients_stay_unchanged():
    g = _grads(16, seed=1)
    before = {mb: {k: v.clone() for k, v in x.items()} for mb, x in g.items()}
    fold = PrefixFold()
    most = 0
    for mb in (0, 2, 1, 3, 4, 6, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15):  # one held out of order at a time
        fold.add(mb, g[mb])
        most = max(most, fold.held())
    assert fold.held() == 1 and most == 2
    (ids, total), = fold.groups()
    assert ids == list(range(16))
    seq = {k: v.clone() for k, v in g[0].items()}
    for mb in range(1, 16):
        for k in seq:
            seq[k] += g[mb][k]
    assert all(torch.equal(total[k], seq[k]) for k in seq)  # bitwise the server's (and autograd's) order
    assert all(torch.equal(g[mb][k], before[mb][k]) for mb in g for k in g[mb])  # nothing added in place


def test_a_shared_stage_worker_holds_its_micro_batches_outside_the_run_apart():
    g = _grads(8, seed=2)
    fold = PrefixFold()
    for mb in (5, 0, 3):
        fold.add(mb, g[mb])
    assert fold.held() == 3 and [ids for ids, _ in fold.groups()] == [[0], [3], [5]]
    assert fold.groups()[0][1] is g[0]  # a run of one goes as it is, as ordered_groups sends it
    # a micro-batch taken twice (the same bits in exact sync): the first stays, nothing is added twice
    assert fold.add(3, g[3]) is False and fold.add(0, g[0]) is False and fold.add(1, g[1]) is True
    assert [ids for ids, _ in fold.groups()] == [[0, 1], [3], [5]]
    assert fold.add(1, g[1]) is False and [ids for ids, _ in fold.groups()] == [[0, 1], [3], [5]]


# ------------------------------------------------------------------ priced: the cost model and the simulator
def test_the_count_the_simulator_charges_is_the_runtimes_number_of_pushes():
    from shoal.plan.cost import ordered_push_count, ordered_pushes

    rng = random.Random(3)
    g = _grads(12, seed=3)
    for _ in range(200):
        held = rng.sample(range(12), rng.randint(0, 12))
        assert ordered_pushes(held) == len(ordered_groups({mb: g[mb] for mb in held})), held
    assert ordered_push_count(64, 1) == 1  # a stage's only worker: its run from 0, once
    assert ordered_push_count(21.3, 3) == 21.3 and ordered_push_count(0.4, 2) == 1


def _one_stage(ordered: bool):
    """tests/helpers/scenarios.hand_scenario's two workers on one stage of the whole tiny model
    (M = 4, 20 Mbit/s uplinks, a 10 Gbit/s server host), and the stage's parameter bytes."""
    from shoal.plan.cost import scenario_profile
    from shoal.plan.types import Plan, StagePlan, SyncPolicy
    from tests.helpers.scenarios import hand_scenario

    scn = hand_scenario(2)
    plan = Plan("hand", "tiny", "hand", [StagePlan((0, 6), "h", ["w0", "w1"])], 2, 4, SyncPolicy(ordered=ordered))
    return scn, plan, scenario_profile(scn, 2).param_bytes(0, 6)


def test_ordered_pushes_cost_a_push_per_micro_batch_of_a_shared_stage_in_both_models():
    from shoal.plan.cost import stage_costs
    from shoal.sim import simulate

    m, up = 4, 20e6 / 8
    (scn, summed, par), (_, ordered, _) = _one_stage(False), _one_stage(True)
    # cost model: each of the two equal workers pushes its m / 2 micro-batches one by one at its
    # 20 Mbit/s uplink (the server's 10 Gbit/s downlink, halved, is not what binds)
    extra = stage_costs(ordered, scn)[0].sync - stage_costs(summed, scn)[0].sync
    assert extra == pytest.approx((m / 2 - 1) * par / up, rel=1e-9)
    # simulator: each worker's pushes are those of the micro-batches it ran ({0, 2} and {1, 3}:
    # two each, where the summed push is one), and its step is longer by one more push
    a, b = simulate(summed, scn, steps=1), simulate(ordered, scn, steps=1)
    assert a.link_bytes["w0->h"] == pytest.approx(par) and a.link_bytes["w1->h"] == pytest.approx(par)
    assert b.link_bytes["w0->h"] == pytest.approx(2 * par) and b.link_bytes["w1->h"] == pytest.approx(2 * par)
    assert b.step_times_s[0] - a.step_times_s[0] == pytest.approx(extra, rel=1e-3)


@pytest.mark.parametrize("ordered,mode,overlap", [(True, "", False), (False, "", False), (True, "local", True),
                                                   (True, "local", False)])
def test_the_coordinator_plans_the_pushes_its_workers_will_send(tmp_path, ordered, mode, overlap):
    """The coordinator prices its plan as the run runs: exact sync's pushes, or local mode's
    H, delayed application and codecs."""
    import asyncio

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.roles.coordinator import Coordinator

    spec = pb.RunSpec(model="tiny", stages=2, steps=3, micro_batches=4, micro_batch_size=2, seq_len=16, seed=0,
                      lr=3e-3, min_lr=3e-4, warmup=1, weight_decay=0.1, grad_clip=1.0, dead_after_s=5.0,
                      min_lease_s=1.0, data="synthetic", ordered_grads=ordered, sync_mode=mode,
                      sync_every=2 if mode else 0, sync_overlap=overlap, compress_push="int8" if mode else "")

    async def main():
        c = Coordinator(spec, "tok", min_workers=4, out=str(tmp_path))
        ids = [(await c.Join(pb.JoinRequest(role="server", address=f"127.0.0.1:{i + 1}", name=f"s{i}"), None)).member_id
               for i in range(2)]
        ids += [(await c.Join(pb.JoinRequest(role="worker", flops=1e9, name=f"w{i}"), None)).member_id
                for i in range(4)]
        beats = [await c.Heartbeat(pb.MemberRequest(member_id=m, ckpt_version=0), None) for m in ids]
        assert all(b.ready for b in beats) and c.plan is not None
        return c.plan.sync

    sync = asyncio.run(main())
    assert sync.ordered == (ordered and not mode)
    assert sync.local == bool(mode)
    if mode:
        assert (sync.sync_every, sync.overlap, sync.push_codec, sync.act_codec) == (2, overlap, "int8", "none")


def test_shoal_plan_prices_exact_sync_as_launch_runs_it_and_says_so(tmp_path, capsys):
    from shoal.cli import main
    from shoal.plan.types import Plan

    ordered, summed = tmp_path / "ordered.json", tmp_path / "summed.json"
    assert main(["plan", "--scenario", "hetero-network", "--sync", "exact", "--json", str(ordered)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps at the terminal's width)
    assert "pushes each micro-batch's gradient alone" in out and "--unordered-grads" in out
    assert main(["plan", "--scenario", "hetero-network", "--sync", "exact", "--unordered-grads",
                 "--json", str(summed)]) == 0
    assert "pushes each micro-batch's gradient alone" not in " ".join(capsys.readouterr().out.split())
    a, b = Plan.from_json(str(ordered)), Plan.from_json(str(summed))
    assert a.sync.ordered and not b.sync.ordered
    assert a.predicted["step_time_s"] > b.predicted["step_time_s"]  # a push per micro-batch of a shared stage


def test_a_waiting_stage_hands_its_micro_batches_out_more_evenly_than_by_speed():
    from shoal.plan.cost import idle_queue_wait, ordered_sync_time

    times, rates, m, g = [1.0, 3.0], [10.0, 1.0], 8, 5.0  # a fast worker on a fast uplink, a slow one on a slow one
    lat, pull, cpu = 0.1, 2.0, 0.01
    # tasks all there at the start (pipe_rate 0): by speed, 6 and 2 micro-batches
    by_speed = ordered_sync_time(times, rates, 0.0, m, lat, pull, cpu, g)
    assert by_speed == pytest.approx(3 * lat + max(6 * g / 10.0, 2 * g / 1.0) + pull + cpu)
    # at a pipeline rate of 1 micro-batch/s (the stage could take 4/3): each waits W for a task
    w = idle_queue_wait(times, 1.0)
    assert 1 / (1 + w) + 1 / (3 + w) == pytest.approx(1.0)
    share_slow = m / ((3 + w) * 1.0)
    assert 2 < share_slow < 4  # more than its 2 by speed, fewer than an even 4
    waiting = ordered_sync_time(times, rates, 1.0, m, lat, pull, cpu, g)
    assert waiting == pytest.approx(3 * lat + share_slow * g / 1.0 + pull + cpu)
    assert waiting > by_speed  # the slow uplink holds more pushes
