"""Push screening and the ban rule (shoal.runtime.safety.guard), the --fault grammar
(shoal.runtime.safety.faults), and a stage server's recomputation catching a poisoned push."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from shoal.errors import ShoalError
from shoal.runtime.safety.faults import (
    CorruptCkptFault,
    FlapFault,
    KillFault,
    PoisonFault,
    SlowFault,
    check_faults,
    parse_fault,
    worker_fault_args,
)
from shoal.runtime.safety.guard import (
    GuardConfig,
    adam_ratio_bound,
    adamw_move_bound,
    ban_reason,
    low_only,
    needs_verify,
    push_spot_checked,
    rel_error,
    robust_centre,
    round_verdict,
    screen,
    screen_round,
    server_check_note,
    spot_pick,
)
from shoal.runtime.safety.verify import round_measures


def test_sq_diff_by_blocks_is_the_whole_difference_summed_as_sum_product():
    from shoal.runtime.safety.verify import PRODUCT_BLOCK, sq_diff, sum_product

    gen = torch.Generator().manual_seed(7)
    a = {"big": torch.randn(1001, 787, generator=gen),  # three blocks and a part
         "small": torch.randn(300, 5, generator=gen), "t": torch.randn(700, 900, generator=gen).t()}
    assert a["big"].numel() > 3 * PRODUCT_BLOCK
    b = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in a.items()}
    whole = float(sum(sum_product(d, d) for d in (a[k].float() - b[k].float() for k in a)))
    assert sq_diff(a, b) == whole  # the same bits as the difference taken whole
    assert sq_diff(a, a) == 0.0


def test_parse_fault_grammar():
    assert parse_fault("kill:worker:w1:step=3") == KillFault("worker", "w1", 3)
    assert parse_fault("kill:server:step=2") == KillFault("server", None, 2)
    assert parse_fault("kill:coordinator:step=3") == KillFault("coordinator", None, 3)
    assert parse_fault("poison:w1:scale=-20") == PoisonFault("w1", -20.0)
    assert parse_fault("slow:w0:factor=2.5") == SlowFault("w0", 2.5)
    assert parse_fault("flap:w1:period=0.6:down=0.1:for=20") == FlapFault("w1", 0.6, 0.1, 20.0)
    assert parse_fault("corrupt-ckpt:1") == CorruptCkptFault(1, 2)
    assert parse_fault("corrupt-ckpt:0:step=3") == CorruptCkptFault(0, 3)
    assert worker_fault_args([PoisonFault("w1", -20.0), SlowFault("w0", 2.0)], "w1") == ["--fault-poison", "-20.0"]


@pytest.mark.parametrize("spec, message", [
    ("explode:w1", "unknown kind 'explode'"),
    ("kill:worker:w1", "missing step="),
    ("kill:worker:w1:step=x", "step='x' is not an integer"),
    ("kill:gpu:step=1", "kill needs a role"),
    ("kill:coordinator:c0:step=1", "unexpected 'c0'"),
    ("kill:server:w0:step=1", "name the server as sN"),
    ("poison:worker1:scale=2", "name the worker as wN"),
    ("poison:w1", "missing scale="),
    ("poison:w1:scale=nan", "is not finite"),
    ("poison:w1:factor=2", "unexpected 'factor=2'"),
    ("slow:w1:factor=0.5", "factor= must be >= 1"),
    ("flap:w1:period=0.6:down=0.7:for=5", "0 < down < period"),
    ("flap:w1:period=0.6:down=0.1", "missing for="),
    ("flap:w1:period=0.6:period=1:down=0.1:for=2", "period= given twice"),
    ("corrupt-ckpt:one", "needs a stage number"),
    ("corrupt-ckpt:1:step=0", "step= must be >= 1"),
])
def test_parse_fault_errors_are_one_line(spec, message):
    with pytest.raises(ShoalError, match=message) as exc:
        parse_fault(spec)
    assert "\n" not in str(exc.value)


def test_check_faults_against_the_swarm():
    check_faults([PoisonFault("w2", 2.0), CorruptCkptFault(1, 2)], workers=3, stages=2, steps=6)
    with pytest.raises(ShoalError, match="starts w0..w1"):
        check_faults([PoisonFault("w2", 2.0)], workers=2, stages=2, steps=6)
    with pytest.raises(ShoalError, match="stages 0..1"):
        check_faults([CorruptCkptFault(2, 2)], workers=2, stages=2, steps=6)
    with pytest.raises(ShoalError, match="never fires"):
        check_faults([KillFault("worker", "w0", 6)], workers=2, stages=2, steps=6)
    # A corrupt-ckpt in a run that writes no checkpoint before its last step could corrupt
    # nothing: refused in one line (with one, it waits for the stage's first checkpoint).
    check_faults([CorruptCkptFault(1, 2)], workers=2, stages=2, steps=6, ckpt_every=5)
    for every in (0, 6, 10):
        with pytest.raises(ShoalError, match="no checkpoint before the last of the 6 steps") as err:
            check_faults([CorruptCkptFault(1, 2)], workers=2, stages=2, steps=6, ckpt_every=every)
        assert len(str(err.value).splitlines()) == 1


def test_launch_cli_refuses_a_bad_fault(tmp_path):
    from shoal.cli import main

    assert main(["launch", "--out", str(tmp_path / "r"), "--fault", "poison:w9:scale=2", "--steps", "2"]) == 2


def test_screen_flags_norm_and_direction():
    cfg = GuardConfig()
    assert screen(1.0, None, None, cfg) == ""  # no history, no direction: nothing to compare with
    assert screen(1.2, 0.4, 1.0, cfg) == ""
    assert "20.0x the stage's median" in screen(20.0, 0.4, 1.0, cfg)
    assert "below the stage's median" in screen(0.01, 0.4, 1.0, cfg)
    assert "cosine -0.90" in screen(1.0, -0.9, 1.0, cfg)
    assert "not finite" in screen(math.inf, None, None, cfg)
    assert robust_centre([]) is None
    assert robust_centre([1.0, 2.0, 100.0]) == 2.0  # one outlier does not move the centre


def test_screen_round_by_majority_and_by_history():
    cfg = GuardConfig()
    # a quorum: the round's median norm is the centre, the cosine to its median the direction
    norms = {"a": 1.0, "b": 1.2, "c": 20.0}
    assert set(screen_round(norms, {"a": 0.8, "b": 0.7, "c": -0.7}, [], cfg)) == {"c"}
    assert "x the stage's median" in screen_round(norms, {"a": 0.8, "b": 0.7, "c": 0.9}, [], cfg)["c"]
    assert "direction" in screen_round({"a": 1.0, "b": 1.1, "c": 0.9}, {"a": 0.8, "b": 0.7, "c": -0.2}, [], cfg)["c"]
    assert screen_round({"a": 1.0, "b": 1.1, "c": 0.9}, {"a": 0.8, "b": 0.1, "c": 0.6}, [], cfg) == {}
    # never a majority: two of three disagreeing is no verdict
    assert screen_round({"a": 1.0, "b": 1.1, "c": 0.9}, {"a": 0.8, "b": -0.1, "c": -0.6}, [], cfg) == {}
    # below a quorum: the norm against earlier honest rounds, no direction
    two = {"a": 1.0, "c": 20.0}
    assert set(screen_round(two, {"a": None, "c": None}, [0.9, 1.1, 1.0], cfg)) == {"c"}
    assert screen_round(two, {"a": None, "c": None}, [], cfg) == {}  # a first round: nothing to judge by
    assert screen_round({"a": 1.0, "c": 1.3}, {"a": None, "c": None}, [1.0], cfg) == {}
    assert screen_round({"a": 0.05, "c": 0.06}, {"a": None, "c": None}, [1.0], cfg) == {}  # small: no verdict
    assert set(screen_round({"a": float("nan")}, {"a": None}, [], cfg)) == {"a"}


def test_round_verdict_holds_carried_pushes_until_strikes():
    """Pushes that carry earlier rounds' residuals (sparse, lowrank): below a quorum a norm
    flag against the history holds the push out of the merge; its worker is banned only at
    its strikes_to_ban-th flagged round in a row. Other pushes are banned at the first flag,
    and a quorum's verdict or a non-finite norm bans at once either way."""
    cfg = GuardConfig()
    two, cos, hist = {"a": 1.0, "c": 11.3}, {"a": None, "c": None}, [0.9, 1.1, 1.0]
    bans, holds = round_verdict(two, cos, hist, cfg)
    assert set(bans) == {"c"} and holds == {}
    bans, holds = round_verdict(two, cos, hist, cfg, carried=True)
    assert bans == {} and set(holds) == {"c"} and "x the stage's median" in holds["c"]
    bans, holds = round_verdict(two, cos, hist, cfg, carried=True, strikes={"c": cfg.strikes_to_ban - 2, "a": 5})
    assert bans == {} and set(holds) == {"c"}
    bans, holds = round_verdict(two, cos, hist, cfg, carried=True, strikes={"c": cfg.strikes_to_ban - 1})
    assert set(bans) == {"c"} and holds == {} and f"{cfg.strikes_to_ban} rounds in a row" in bans["c"]
    bans, holds = round_verdict({"a": 1.0, "c": float("inf")}, cos, hist, cfg, carried=True)
    assert set(bans) == {"c"} and holds == {} and "in a row" not in bans["c"]
    # a quorum is a majority's verdict: banned at once, carried or not
    three = {"a": 1.0, "b": 1.2, "c": 20.0}
    bans, holds = round_verdict(three, {"a": 0.8, "b": 0.7, "c": 0.9}, [], cfg, carried=True)
    assert set(bans) == {"c"} and holds == {}
    # the server's own gradient and the AdamW bound still ban at once
    bans, holds = round_verdict(two, cos, hist, cfg, ref_cosines={"a": 0.1, "c": -0.2}, carried=True)
    assert set(bans) == {"c"} and holds == {}


def _adam_moves(grads: list[float], beta1: float = 0.9, beta2: float = 0.95) -> list[float]:
    """|weight change| / lr of each step of torch's AdamW (no weight decay) fed ``grads``."""
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(beta1, beta2), eps=1e-30, weight_decay=0.0)
    out = []
    for g in grads:
        before = float(w.detach())
        w.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        out.append(abs(float(w.detach()) - before) / 1e-3)
    return out


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.99)])
def test_adam_ratio_bound_holds_for_torch_adamw_and_is_reached(betas):
    b1, b2 = betas
    bound = adam_ratio_bound(b1, b2)
    assert adam_ratio_bound(b1, b2, steps=1) == pytest.approx(1.0)  # a first step moves by exactly lr
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for kind in range(4):  # random, sign flips, growing, shrinking gradients
        g = torch.randn(300, generator=gen, dtype=torch.float64)
        if kind == 1:
            g = g.abs() * torch.tensor([(-1.0) ** i for i in range(300)], dtype=torch.float64)
        elif kind == 2:
            g = g.abs() * torch.logspace(0, 6, 300, dtype=torch.float64)
        elif kind == 3:
            g = g.abs() * torch.logspace(6, 0, 300, dtype=torch.float64)
        worst = max(worst, *_adam_moves(g.tolist(), b1, b2))
    assert worst <= bound * (1 + 1e-9)
    # the Cauchy-Schwarz equality case at step t: g_i proportional to (b1 / b2)^(t - i)
    best_t = max(range(1, 400), key=lambda t: adam_ratio_bound(b1, b2, steps=t))
    seq = [(b1 / b2) ** (best_t - i) for i in range(1, best_t + 1)]
    assert _adam_moves(seq, b1, b2)[-1] == pytest.approx(adam_ratio_bound(b1, b2, steps=best_t), rel=1e-6)
    assert adam_ratio_bound(b1, b2, steps=best_t) >= 0.99 * bound  # reached within a few hundred steps


def test_adamw_move_bound_adds_weight_decay():
    assert adamw_move_bound(10_000, 0.0, 0.1, 0.9, 0.95) == pytest.approx(adam_ratio_bound(0.9, 0.95) * 100)
    assert adamw_move_bound(10_000, 50.0, 0.1, 0.9, 0.95) == pytest.approx(adam_ratio_bound(0.9, 0.95) * 100 + 5)
    assert math.isinf(adam_ratio_bound(0.9, 0.8))  # b1^2 >= b2: Adam's step has no bound


def test_screen_round_bans_past_the_adamw_bound_in_any_round():
    cfg = GuardConfig()
    two = {"a": 1.0, "c": 20.0}
    bounds = {"a": 2.0, "c": 2.0}  # margin 4: anything over 8 per unit of lr cannot be AdamW
    # a first round below a quorum, no history: only the bound can judge, and it does
    assert set(screen_round(two, {"a": None, "c": None}, [], cfg, bounds)) == {"c"}
    assert "what AdamW steps can move" in screen_round(two, {"a": None, "c": None}, [], cfg, bounds)["c"]
    assert screen_round(two, {"a": None, "c": None}, [], cfg, {"a": 2.0}) == {}  # c not bounded (e.g. top-k)
    assert screen_round({"a": 1.0, "c": 7.9}, {"a": None, "c": None}, [], cfg, bounds) == {}  # within the margin
    # a proof needs no majority: two of three past the bound are banned, and they set no
    # centre for the third (which alone is no quorum, and is not judged against them)
    three = {"a": 1.0, "b": 30.0, "c": 20.0}
    assert set(screen_round(three, {"a": 0.8, "b": 0.7, "c": 0.9}, [], cfg, dict.fromkeys(three, 2.0))) == {"b", "c"}
    four = {"a": 1.0, "b": 1.1, "d": 0.05, "c": 20.0}  # c past the bound; a, b, d a quorum among themselves
    assert set(screen_round(four, {"a": 0.8, "b": 0.7, "d": 0.7, "c": 0.9}, [], cfg, dict.fromkeys(four, 2.0))) == {
        "c", "d"}
    # ... but every replica past it says more about the bound: nobody is banned for it
    assert screen_round({"b": 30.0, "c": 20.0}, {"b": None, "c": None}, [], cfg, {"b": 2.0, "c": 2.0}) == {}


def test_round_measures_by_hand():
    t = torch.tensor
    deltas = {"a": {"w": t([1.0, 2.0]), "v": t([0.0])}, "b": {"w": t([1.0, 3.0]), "v": t([1.0])},
              "c": {"w": t([-20.0, -40.0]), "v": t([0.0])}}
    norms, cos = round_measures(deltas, {"a": 1.0, "b": 2.0, "c": 1.0}, quorum=3)
    assert norms == pytest.approx({"a": math.sqrt(5), "b": math.sqrt(11) / 2, "c": math.sqrt(2000)})
    # coordinate-wise median: w = [1, 2], v = [0]
    assert cos["a"] == pytest.approx(1.0)
    assert cos["b"] == pytest.approx(7 / math.sqrt(11 * 5))
    assert cos["c"] == pytest.approx(-1.0)
    norms2, cos2 = round_measures({k: deltas[k] for k in "ab"}, {"a": 1.0, "b": 1.0}, quorum=3)
    assert cos2 == {"a": None, "b": None} and norms2["b"] == pytest.approx(math.sqrt(11))


@pytest.mark.parametrize("n", [1, 1023, 1024, 5 * 1024 + 7, 300_001])
def test_screen_sums_match_fp64(n):
    """sq_norm, dot and sq_diff (fp32 blocks summed in fp64) agree with plain fp64 sums to
    1e-7 relative, for sizes with and without a partial last block, non-contiguous and
    bf16 tensors included."""
    from shoal.runtime.safety.verify import dot, sq_diff, sq_norm

    gen = torch.Generator().manual_seed(n)
    a = {"w": torch.randn(n, generator=gen) * 3 + 1, "m": torch.randn(4, 6, generator=gen).t()}
    b = {"w": a["w"] + 1e-3 * torch.randn(n, generator=gen), "m": torch.randn(4, 6, generator=gen).t()}
    c = {"w": a["w"].bfloat16(), "m": a["m"]}

    def ref(x, y):
        return sum(float((x[k].double() * y[k].double()).sum()) for k in x)

    scale = ref(a, a) + ref(b, b)
    assert sq_norm(a) == pytest.approx(ref(a, a), rel=1e-7)
    assert abs(dot(a, b) - ref(a, b)) <= 1e-7 * scale
    diff = {k: a[k].double() - b[k].double() for k in a}
    assert sq_diff(a, b) == pytest.approx(ref(diff, diff), rel=1e-5)
    assert sq_norm(c) == pytest.approx(sum(float(t.double().pow(2).sum()) for t in c.values()), rel=1e-7)
    assert sq_diff(a, a) == 0.0


def test_ban_rule():
    cfg = GuardConfig(rel_tol=1e-3, strikes_to_ban=3)
    # Exact runs: only the recomputation decides; a flag alone (even many) never bans.
    assert ban_reason("norm 20x", 0.0, 5, cfg) == ""
    assert "differs from the recomputed one by 21" in ban_reason("norm 20x", 21.0, 1, cfg)
    assert "differs" in ban_reason("", math.nan, 0, cfg)
    # Without a recomputation: the third flagged push bans.
    assert ban_reason("norm 20x", None, 2, cfg) == ""
    assert "3 pushes in a row flagged" in ban_reason("norm 20x", None, 3, cfg)
    assert ban_reason("", None, 7, cfg) == ""
    assert rel_error(0.0, 4.0) == 0.0 and rel_error(1.0, 4.0) == 0.5


def test_a_fraction_of_pushes_is_spot_checked_whatever_their_size():
    """One draw per push: a push pre-summed over 8 micro-batches is drawn as often as a push of one."""
    for mbs in ([0], list(range(8))):
        drawn = [push_spot_checked(3, "run", 1, step, mbs, 0.05) for step in range(4000)]
        assert 0.035 < sum(drawn) / len(drawn) < 0.065
        assert drawn == [push_spot_checked(3, "run", 1, step, mbs, 0.05) for step in range(4000)]  # seeded
    # keyed by the push's first micro-batch
    assert all(push_spot_checked(3, "run", 1, s, [2, 5, 6], 0.3) == spot_pick(3, "run", 1, s, 2, 0.3)
               for s in range(200))
    assert not push_spot_checked(3, "run", 1, 0, [], 1.0)


def test_verify_and_spot_check_draws():
    assert needs_verify("", True, False, exact=True)  # first push of a worker
    assert needs_verify("norm", False, False, exact=True)
    assert not needs_verify("", False, False, exact=True)
    assert not needs_verify("norm", True, True, exact=False)
    # the CPU bench's hook turns every recomputation off (and nothing else); unset, the defaults hold
    from shoal.runtime.safety.guard import DEFAULT, RECOMPUTE_ENV, guard_config

    off = guard_config({RECOMPUTE_ENV: "0"})
    assert not needs_verify("norm", True, True, exact=True, cfg=off)
    assert off.enabled and dataclasses.replace(off, recompute=True) == DEFAULT
    assert guard_config({}) == DEFAULT and guard_config({RECOMPUTE_ENV: "1"}) == DEFAULT
    draws = [spot_pick(3, "run", 1, step, mb, 0.25) for step in range(100) for mb in range(8)]
    assert draws == [spot_pick(3, "run", 1, step, mb, 0.25) for step in range(100) for mb in range(8)]  # seeded
    assert 0.18 < sum(draws) / len(draws) < 0.32
    assert not any(spot_pick(3, "run", 0, s, 0, 0.0) for s in range(50))
    assert all(spot_pick(3, "run", 0, s, 0, 1.0) for s in range(50))


# ---------------------------------------------------------------------------- a real stage server

def _grad_push(srv, step, mb, worker, gen, grads, codec="raw"):
    from shoal.net import shoal_pb2 as pb
    from shoal.net.wire import encode_tensor

    return pb.GradPush(worker=worker, step=step, epoch=0, gen=gen, mbs=[mb],
                       grads=[encode_tensor(n, g, codec) for n, g in grads.items()])


async def _one_stage_server(tmp_path, run_id: str, **shape):
    """A ready one-stage server of the tiny model (no spot checks), driven through its handlers."""
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.roles.server import StageServer

    srv = StageServer("unused:0", "127.0.0.1:0", "tok", str(tmp_path), name="t")
    srv.spec = pb.RunSpec(model="tiny", stages=1, steps=3, seed=0, lr=1e-3, min_lr=1e-4, warmup=1,
                          weight_decay=0.1, grad_clip=1.0, dead_after_s=30, min_lease_s=30, data="synthetic",
                          ordered_grads=True, run_id=run_id, guard_spot_check=0.0, **shape)
    srv.stage, srv.first, srv.last, srv.epoch = 0, 0, 6, 0
    await srv._load(0, 0, 6, 0, 0)
    srv.ready = True
    return srv


async def _settled(srv):
    """Wait until the server's deferred checks (safety/deferred.py) are all judged."""
    while srv.deferred_task is not None:
        await srv.cond.wait(1.0)


async def _compute(srv, worker):
    """Lease one task for ``worker`` and report it computed: ``(task, the result's reply)``."""
    from shoal.net import shoal_pb2 as pb

    t = (await srv.Lease(pb.LeaseRequest(worker=worker, wait_s=0), None)).task
    ok = await srv.Complete(pb.TaskResult(worker=worker, step=t.step, mb=t.mb, direction=t.direction,
                                          epoch=t.epoch, lease_id=t.lease_id, loss=1.0), None)
    return t, ok


def test_server_bans_a_poisoned_push_and_redoes_its_work(tmp_path):
    """A one-stage server: A's and B's honest pushes count (each a first push: recomputed
    beside the step); B's next push, times -20, is flagged by its norm, recomputed before it
    counts and banned: both of B's
    micro-batches go back to todo (its counted push is dropped) and A redoes them."""
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.safety.verify import recompute_grads

    async def main():
        srv = await _one_stage_server(tmp_path, "guard-test", micro_batches=3, micro_batch_size=2, seq_len=16)

        async def compute(worker):
            a = await srv.Lease(pb.LeaseRequest(worker=worker, wait_s=0), None)
            t = a.task
            ok = await srv.Complete(pb.TaskResult(worker=worker, step=t.step, mb=t.mb, direction=t.direction,
                                                  epoch=t.epoch, lease_id=t.lease_id, loss=1.0), None)
            assert ok.accepted
            true = recompute_grads(srv.module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
            return t.mb, ok.gen, true

        mb_a, gen_a, g_a = await compute("A")
        rep = await srv.PushGrads(_grad_push(srv, 0, mb_a, "A", gen_a, g_a), None)
        assert rep.accepted
        mb_b1, gen_b, g_b1 = await compute("B")
        assert (await srv.PushGrads(_grad_push(srv, 0, mb_b1, "B", gen_b, g_b1), None)).accepted
        await _settled(srv)
        assert srv.guard_checks == 2  # both first pushes were recomputed (beside the step)
        assert srv.guard_ok == {"A": 1, "B": 1} and srv.step_unverified == {"A", "B"}
        mb_b, gen_b, g_b = await compute("B")
        rep = await srv.PushGrads(_grad_push(srv, 0, mb_b, "B", gen_b, {n: -20 * g for n, g in g_b.items()}), None)
        assert not rep.accepted and "differs from the recomputed one" in rep.reason and "the stage's median" in rep.reason
        assert "B" in srv.guard_banned and [b.worker for b in srv.guard_bans] == ["B"]
        assert srv.steps[0][mb_a].grad == "counted"
        assert srv.steps[0][mb_b].grad == "todo" and srv.steps[0][mb_b1].grad == "todo"
        assert [p[2] for p in srv.pushes] == ["A"]
        # B gets no more work; A redoes B's micro-batches
        assert not (await srv.Lease(pb.LeaseRequest(worker="B", wait_s=0), None)).has_task
        redone = []
        for _ in range(2):
            mb, gen, g = await compute("A")
            redone.append(mb)
            assert (await srv.PushGrads(_grad_push(srv, 0, mb, "A", gen, g), None)).accepted
        assert sorted(redone) == sorted([mb_b1, mb_b])
        assert all(st.grad == "counted" for st in srv.steps[0].values()) or srv.step == 1

    asyncio.run(main())
    torch.set_grad_enabled(True)


def test_a_push_flagged_only_as_small_is_no_strike():
    cfg = GuardConfig()
    assert low_only(0.05, 0.4, 1.0, cfg)  # 20x below the centre, direction fine
    assert low_only(0.05, None, 1.0, cfg)
    assert not low_only(0.05, -0.9, 1.0, cfg)  # also aimed against the last step
    assert not low_only(0.5, 0.4, 1.0, cfg)  # not flagged at all
    assert not low_only(20.0, 0.4, 1.0, cfg)  # too large
    assert not low_only(0.05, 0.4, None, cfg)  # no centre yet
    assert not low_only(math.nan, None, 1.0, cfg)


def test_server_without_recomputation_bans_no_worker_for_small_pushes(tmp_path):
    """fp16 frames (no exact recomputation): a worker whose pushes fall 20x below the stage's
    median, as honest norms do once training settles, is flagged but never banned, and its
    norms move the centre down; three pushes 20x above the centre ban (the strike rule)."""
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.safety.verify import recompute_grads

    async def main():
        srv = await _one_stage_server(tmp_path, "guard-small", micro_batches=8, micro_batch_size=1, seq_len=8)

        async def push(worker, scale, codec):
            a = await srv.Lease(pb.LeaseRequest(worker=worker, wait_s=0), None)
            t = a.task
            ok = await srv.Complete(pb.TaskResult(worker=worker, step=t.step, mb=t.mb, direction=t.direction,
                                                  epoch=t.epoch, lease_id=t.lease_id, loss=1.0), None)
            g = recompute_grads(srv.module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
            return await srv.PushGrads(_grad_push(srv, 0, t.mb, worker, ok.gen, {n: scale * v for n, v in g.items()},
                                                  codec), None)

        assert (await push("A", 1.0, "raw")).accepted  # recomputed: the centre's first norm
        centre = srv.guard_norms[-1]
        for _ in range(3):
            assert (await push("A", 0.05, "fp16")).accepted
        assert not srv.guard_banned and srv.guard_strikes["A"] == 0
        assert len(srv.guard_norms) == 4 and min(srv.guard_norms) < centre / 10  # the centre follows
        reps = [await push("B", 400.0, "fp16") for _ in range(3)]
        assert [r.accepted for r in reps] == [True, True, False] and "3 pushes in a row" in reps[-1].reason
        assert "B" in srv.guard_banned and "A" not in srv.guard_banned

    asyncio.run(main())
    torch.set_grad_enabled(True)


def test_corrupt_ckpt_follows_the_time_rule_and_a_fault_that_never_fired_is_said(tmp_path, capsys):
    """The start-up check counts the time rule (``--ckpt-every-s``) as the coordinator's
    ``ckpt_due`` does: a run whose step rule writes no checkpoint before its last step may
    still get one from the time rule, so a corrupt-ckpt waits for it instead of being refused;
    with no rule that can write one it is refused in one line. A fault still waiting when the
    run ends (a short run the time rule wrote no checkpoint in) is said on stderr and in the
    events, never silent."""
    from swarm_reference import launch_config

    from shoal.runtime.processes.launch import Swarm
    from shoal.runtime.safety.faults import ckpt_may_come
    from shoal.train.metrics import read_jsonl

    assert ckpt_may_come(5, 0, 6) and ckpt_may_come(10, 60.0, 6) and ckpt_may_come(10, 0.5, 2)
    assert not ckpt_may_come(10, 0, 6) and not ckpt_may_come(10, None, 6) and not ckpt_may_come(0, 60.0, 6)
    check_faults([CorruptCkptFault(1, 2)], workers=2, stages=2, steps=6, ckpt_every=10, ckpt_every_s=60.0)
    with pytest.raises(ShoalError, match=r"--ckpt-every 10, and no time rule: --ckpt-every-s 0\).*or --ckpt-every-s T"):
        check_faults([CorruptCkptFault(1, 2)], workers=2, stages=2, steps=6, ckpt_every=10, ckpt_every_s=0.0)
    with pytest.raises(ShoalError, match="no checkpoints at all, the time rule included"):
        check_faults([CorruptCkptFault(1, 2)], workers=2, stages=2, steps=6, ckpt_every=0, ckpt_every_s=60.0)
    # the launcher applies the default time rule (60 s) at start-up: accepted, then said if it never fired
    sw = Swarm(launch_config(tmp_path / "run", ckpt_every=10, faults=["corrupt-ckpt:1:step=2"]))
    assert sw._pending_faults == [CorruptCkptFault(1, 2)]
    sw._report_unfired()
    err = capsys.readouterr().err
    assert "warning: --fault corrupt-ckpt:1:step=2 did not fire: stage 1 wrote no checkpoint before the run " \
           "ended (--ckpt-every 10, --ckpt-every-s 60); nothing was corrupted" in err, err
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "fault"]
    assert [(e["kind"], e["fault"]) for e in events] == [("not_fired", "corrupt-ckpt:1:step=2")]
    with pytest.raises(ShoalError, match="no time rule"):
        Swarm(launch_config(tmp_path / "run2", ckpt_every=10, ckpt_every_s=0, faults=["corrupt-ckpt:1:step=2"]))


def _tiny_stage_inputs(first: bool, last: bool, micro_batches: int, prefixes: list):
    """A tiny model's stage at that position (whole where both), its run spec and inputs
    (micro-batch, stage input, output gradient, prefix) for each of ``prefixes``' (mb, prefix)."""
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb

    cfg = get_preset("tiny")
    lo, hi = ((0, cfg.n_total_layers) if first and last else (0, 2) if first
              else (cfg.n_layers + 1, cfg.n_layers + 2) if last else (2, 4))
    torch.manual_seed(0)
    module = build_stage(cfg, lo, hi)
    spec = pb.RunSpec(model="tiny", micro_batches=micro_batches, micro_batch_size=2, seq_len=16, seed=3,
                      data="synthetic")
    gen = torch.Generator().manual_seed(1)
    shape = (2, 16, cfg.d_model)
    return module, spec, [(mb, None if first else torch.randn(shape, generator=gen),
                           None if last else torch.randn(shape, generator=gen), prefix) for mb, prefix in prefixes]


@pytest.mark.parametrize("first,last", [(True, False), (False, False), (False, True)])
def test_recompute_sum_in_threads_is_the_same_bits_as_one_at_a_time(first, last):
    """A push's recomputation runs its micro-batches in threads: each summed in the push's
    order, so the sum is the same bits as the sequential loop, at any stage position."""
    from shoal.runtime.safety.verify import recompute_grads, recompute_sum

    module, spec, inputs = _tiny_stage_inputs(first, last, 5, [(mb, None) for mb in (4, 0, 2, 3, 1)])
    inputs = [x[:3] for x in inputs]
    one = {}
    for mb, inp, og in inputs:
        for n, t in recompute_grads(module, spec, 7, mb, first=first, last=last, inp=inp, out_grad=og).items():
            one[n] = t if n not in one else one[n] + t
    for threads in (1, 2, 4):
        got = recompute_sum(module, spec, 7, inputs, first=first, last=last, threads=threads)
        assert sorted(got) == sorted(one)
        assert all(torch.equal(got[n], one[n]) for n in one), threads


@pytest.mark.parametrize("first,last", [(True, False), (False, True), (True, True)])
def test_reference_gradient_in_threads_is_the_same_bits_and_survives_a_failing_micro_batch(first, last):
    """The screen's reference gradient runs a micro-batch a thread and adds each parameter's
    gradient into one sum as autograd makes it, in micro-batch order: the same bits as whole
    gradients summed one at a time, with causal prefixes and a whole model (the head tied to the
    embedding: one gradient from two uses). A micro-batch that fails fails the whole, without
    leaving the others waiting for it, and leaves no hook on the weights."""
    from concurrent.futures import ThreadPoolExecutor

    from shoal.runtime.safety.verify import recompute_grads, reference_gradient

    module, spec, inputs = _tiny_stage_inputs(first, last, 4, [(2, None), (0, 5), (3, 16), (1, 1)])
    one = {}
    for mb, inp, og, prefix in inputs:
        g = recompute_grads(module, spec, 5, mb, first=first, last=last, inp=inp, out_grad=og, prefix=prefix)
        for n, t in g.items():
            one[n] = t if n not in one else one[n] + t
    with ThreadPoolExecutor(max_workers=4) as pool:
        for p in (None, pool):
            got = reference_gradient(module, spec, 5, inputs, first=first, last=last, pool=p)
            assert sorted(got) == sorted(one)
            assert all(torch.equal(got[n], one[n]) for n in one), p
            assert all(t.stride() != (0,) * t.dim() or t.numel() <= 1 for t in got.values())
        if not (first and last):  # (a stage input or output gradient of a wrong shape fails its micro-batch)
            bad = list(inputs)
            bad[1] = (0, None, torch.zeros(1, 1), 5) if first else (0, torch.zeros(1, 1), None, 5)
            with pytest.raises((RuntimeError, ValueError)):
                reference_gradient(module, spec, 5, bad, first=first, last=last, pool=pool)
    assert all(not p._backward_hooks for p in module.parameters())


def test_server_recomputes_a_push_of_several_micro_batches_in_threads(tmp_path):
    """The production path: a one-stage server recomputes a worker's first push, three
    micro-batches in one push, on its recompute threads (beside the step: the push counts at
    once, unverified). The honest sum passes; the same push with one micro-batch's gradient
    1 % off bans its worker, whose counted micro-batches go back to todo."""
    from shoal.net import shoal_pb2 as pb
    from shoal.net.wire import encode_tensor
    from shoal.runtime.safety.verify import recompute_grads

    async def run(tamper: bool):
        srv = await _one_stage_server(tmp_path / str(tamper), "guard-threads", micro_batches=3, micro_batch_size=2,
                                      seq_len=16)
        total, mbs, gen = {}, [], 0
        for _ in range(3):
            t, ok = await _compute(srv, "A")
            assert ok.accepted
            g = recompute_grads(srv.module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
            if tamper and not mbs:
                g = {n: x * 1.01 for n, x in g.items()}
            for n, x in g.items():
                total[n] = x if n not in total else total[n] + x
            mbs.append(t.mb)
            gen = ok.gen
        push = pb.GradPush(worker="A", step=0, epoch=0, gen=gen, mbs=mbs,
                           grads=[encode_tensor(n, x, "raw") for n, x in total.items()])
        rep = await srv.PushGrads(push, None)
        assert rep.accepted and srv.step_unverified == {"A"}
        await _settled(srv)
        return srv, rep

    srv, rep = asyncio.run(run(False))
    assert srv.guard_checks == 1 and srv.guard_ok == {"A": 1} and "A" not in srv.guard_banned
    srv, rep = asyncio.run(run(True))
    assert "A" in srv.guard_banned and "deferred check" in srv.guard_banned["A"]
    assert "differs from the recomputed one" in srv.guard_banned["A"]
    assert not srv.pushes and all(st.grad == "todo" for st in srv.steps[0].values())
    torch.set_grad_enabled(True)


def test_server_check_note_only_where_servers_recompute_an_accelerators_pushes():
    """The coordinator warns once when a worker on a GPU joins a run whose stage servers hold
    steps to recompute pushes on their CPUs: the last step's with spot checks on, and in fp32
    flagged pushes at any rate (routine checks are deferred). CPU workers, local mode and bf16
    at --spot-check 0 get no warning. The note names the device, what is held, and a way out
    that works."""
    bf16 = server_check_note(False, 0.05, "bf16", "cuda: NVIDIA H200")
    assert "NVIDIA H200" in bf16 and "give --spot-check 0," in bf16 and "--sync local" in bf16 and "\n" not in bf16
    assert "the last step's pushes are recomputed before they count" in bf16 and "flags" not in bf16
    fp32 = server_check_note(False, 0.0, "fp32", "cuda: NVIDIA H200")
    assert "--precision bf16 with --spot-check 0" in fp32 and "flags are" in fp32 and "last step" not in fp32
    assert "flags and the last step's" in server_check_note(False, 0.05, "fp32", "cuda: NVIDIA H200")
    assert server_check_note(False, 0.05, "bf16", "cpu: AMD EPYC") == ""
    assert server_check_note(True, 0.05, "fp32", "cuda: NVIDIA H200") == ""
    assert server_check_note(False, 0.0, "bf16", "cuda: NVIDIA H200") == ""
