"""Deferred checks (shoal.runtime.safety.deferred): a stage server's routine recomputations
run beside the steps; the push counts as unverified until judged."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from shoal.runtime.safety.deferred import defer_check, deferred_room
from shoal.runtime.safety.guard import GuardConfig, ban_undo_cap


def test_routine_checks_are_deferred_and_a_server_holds_few():
    cfg = GuardConfig()
    assert defer_check("", small=False, last=False, suspect=False, cfg=cfg)  # a first push, a random draw
    large = "norm 9 is 20.0x the stage's median 0.45"
    assert not defer_check(large, small=False, last=False, suspect=False, cfg=cfg)
    # only too small (honest early in training, when norms fall fast): no sign of a lie
    assert defer_check("norm 2.2 is 26.3x below the stage's median 58", small=True, last=False, suspect=False,
                       cfg=cfg)
    assert not defer_check("", small=False, last=True, suspect=False, cfg=cfg)  # the run's last step
    assert not defer_check("", small=False, last=False, suspect=True, cfg=cfg)  # a drift suspect
    assert not defer_check("", small=False, last=False, suspect=False,
                           cfg=dataclasses.replace(cfg, deferred_checks=False))
    assert [deferred_room(n, cfg) for n in range(4)] == [True, True, False, False]


def test_a_ban_of_a_push_in_the_step_being_committed_rolls_that_step_back():
    """A deferred check can ban after a server summed the push into the step it commits,
    before the coordinator decides it (seen: bench_poison's x-20 from step 0 ended with the
    poisoned weights, the ban's undo skipped as 'nothing committed'). That step is undone
    too; steps after the decided ones are not in any record."""
    assert ban_undo_cap([0], committed=0) == 0  # summed into step 0, not decided yet
    assert ban_undo_cap([3, 5], committed=7) == 3
    assert ban_undo_cap([], committed=4) is None  # every push of it was recomputed
    assert ban_undo_cap([5], committed=4) is None  # (no server sums a step past the decided ones)


@pytest.mark.timeout(120)
def test_the_step_goes_on_during_a_check_and_a_rollback_meanwhile_bans_nobody(tmp_path, monkeypatch):
    """A's first push counts at once, unverified, while the server recomputes it; meanwhile B
    leases and completes a task of the same step (inline, the push's call would not return
    before the recomputation), B's first push finds the checks full and counts unchecked (still
    a first push: checked later), and a rollback loads other weights. The check is judged on
    its own copy of the weights A computed on: A passes, nobody is banned."""
    from test_ban_undo import _old_epoch_server
    from test_guard import _compute, _grad_push, _settled

    import shoal.runtime.safety.verify as verify
    from shoal.net import shoal_pb2 as pb

    real = verify.recompute_grads
    started, release, modules = threading.Event(), threading.Event(), []

    def held(*args, **kwargs):  # (on the check's thread)
        modules.append(args[0])
        started.set()
        release.wait(60)
        return real(*args, **kwargs)

    async def main():
        srv = await _old_epoch_server(tmp_path, "deferred", micro_batches=3)
        srv.guard_cfg = dataclasses.replace(srv.guard_cfg, deferred_pending=1)
        old_module = srv.module
        t, ok = await _compute(srv, "A")
        honest = real(old_module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
        monkeypatch.setattr(verify, "recompute_grads", held)
        rep = await srv.PushGrads(_grad_push(srv, 0, t.mb, "A", ok.gen, honest), None)
        assert rep.accepted and srv.step_unverified == {"A"} and len(srv.deferred) == 1
        while not started.is_set():
            await asyncio.sleep(0.01)
        tb, okb = await _compute(srv, "B")  # the step goes on
        assert okb.accepted
        gb = real(old_module, srv.spec, 0, tb.mb, first=True, last=True, inp=None, out_grad=None)
        assert (await srv.PushGrads(_grad_push(srv, 0, tb.mb, "B", okb.gen, gb), None)).accepted
        assert srv.deferred_skipped == 1 and srv.step_unverified == {"A", "B"} and "B" not in srv.guard_seen
        srv._assigned(pb.Assignment(stage=0, first=0, last=6, epoch=1, restart_version=0))
        while srv.module is old_module:
            await asyncio.sleep(0.01)
        release.set()
        await _settled(srv)
        assert not srv.guard_banned, srv.guard_banned
        assert srv.guard_ok == {"A": 1} and srv.guard_checks == 1 and "A" in srv.guard_seen
        assert modules and all(m is not old_module and m is not srv.module for m in modules)

    try:
        asyncio.run(main())
    finally:
        release.set()
        torch.set_grad_enabled(True)


def _hold_checks(monkeypatch):
    """Make every server recomputation wait for the returned event: ``(the real function, the event)``."""
    import shoal.runtime.safety.verify as verify

    real = verify.recompute_grads
    release = threading.Event()

    def held(*args, **kwargs):  # (on the check's thread)
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "recompute_grads", held)
    return real, release


@pytest.mark.timeout(120)
def test_a_push_while_the_workers_first_is_held_is_not_its_first_and_the_ban_drops_both(tmp_path, monkeypatch):
    """While A's first push is recomputed beside the steps, A's next push is not "its first"
    again (spot checks off here: it is not checked at all); the held check fails (A's first
    push is 1 % off), and the ban drops both pushes: their micro-batches go back to todo,
    nothing of A's is summed."""
    from test_ban_undo import _old_epoch_server
    from test_guard import _compute, _grad_push, _settled

    real, release = _hold_checks(monkeypatch)

    async def main():
        srv = await _old_epoch_server(tmp_path, "deferred-held", micro_batches=3)
        mbs = []
        for k in range(2):
            t, ok = await _compute(srv, "A")
            mbs.append(t.mb)
            g = real(srv.module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
            if k == 0:
                g = {n: 1.01 * v for n, v in g.items()}
            assert (await srv.PushGrads(_grad_push(srv, 0, t.mb, "A", ok.gen, g), None)).accepted
        assert [(c.worker, c.mbs, c.why) for c in srv.deferred] == [("A", (mbs[0],), "its first")]
        assert srv.step_unverified == {"A"} and "A" not in srv.guard_seen
        release.set()
        await _settled(srv)
        assert "A" in srv.guard_banned and srv.guard_checks == 1
        assert all(srv.steps[0][mb].grad == "todo" for mb in mbs), {mb: srv.steps[0][mb].grad for mb in mbs}
        assert not [p for p in srv.pushes if p[2] == "A"]

    try:
        asyncio.run(main())
    finally:
        release.set()
        torch.set_grad_enabled(True)


@pytest.mark.timeout(120)
def test_held_checks_count_toward_the_rate_a_workers_next_pushes_are_drawn_at(tmp_path, monkeypatch):
    """Spot checks on: with A's first push held, its second is drawn at the rate one passed
    check gives (still 1: the first ``verify_first_n`` pushes are all checked), and with two
    held its third at the rate two give (``trust / (trust + 2)``), drawn as the server draws."""
    from test_ban_undo import _old_epoch_server
    from test_guard import _compute, _grad_push, _settled

    from shoal.runtime.safety.guard import push_spot_checked, verify_rate

    real, release = _hold_checks(monkeypatch)

    async def main():
        srv = await _old_epoch_server(tmp_path, "deferred-rate", micro_batches=3)
        srv.spec.guard_spot_check = 0.05
        srv.guard_cfg = dataclasses.replace(srv.guard_cfg, deferred_pending=3)
        mbs = []
        for _ in range(3):
            t, ok = await _compute(srv, "A")
            mbs.append(t.mb)
            g = real(srv.module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
            assert (await srv.PushGrads(_grad_push(srv, 0, t.mb, "A", ok.gen, g), None)).accepted
        third = verify_rate(2, 0, 0.05, srv.guard_cfg)
        assert third < 1
        drawn = push_spot_checked(srv.spec.seed, f"{srv.spec.run_id}/{srv.guard_salt}", srv.stage, 0, [mbs[2]], third)
        want = [("its first", mbs[0]), ("spot check at rate 1.00", mbs[1])]
        want += [(f"spot check at rate {third:.2f}", mbs[2])] if drawn else []
        assert [(c.why, c.mbs[0]) for c in srv.deferred] == want
        release.set()
        await _settled(srv)
        assert not srv.guard_banned and srv.guard_ok == {"A": len(want)}

    try:
        asyncio.run(main())
    finally:
        release.set()
        torch.set_grad_enabled(True)


@pytest.mark.timeout(120)
def test_checks_of_one_version_share_one_copy_of_the_weights(tmp_path, monkeypatch):
    """Two workers' first pushes of one step are held together: one copy of the weights (a
    copy per check would hold the stage's weights once per held check), and both pass."""
    from test_ban_undo import _old_epoch_server
    from test_guard import _compute, _grad_push, _settled

    real, release = _hold_checks(monkeypatch)

    async def main():
        srv = await _old_epoch_server(tmp_path, "deferred-share", micro_batches=3)
        for w in ("A", "B"):
            t, ok = await _compute(srv, w)
            g = real(srv.module, srv.spec, 0, t.mb, first=True, last=True, inp=None, out_grad=None)
            assert (await srv.PushGrads(_grad_push(srv, 0, t.mb, w, ok.gen, g), None)).accepted
        assert [c.worker for c in srv.deferred] == ["A", "B"]
        assert srv.deferred[0].weights is srv.deferred[1].weights
        assert all(torch.equal(srv.deferred[0].weights[n], p) for n, p in srv.params.items())
        release.set()
        await _settled(srv)
        assert srv.guard_ok == {"A": 1, "B": 1} and not srv.guard_banned

    try:
        asyncio.run(main())
    finally:
        release.set()
        torch.set_grad_enabled(True)


def test_a_server_reads_the_inline_hook_from_its_environment(tmp_path, monkeypatch):
    """What a stage server started with SHOAL_DEFERRED_CHECKS=0 (the bench's baseline, and the
    tests that need a worker's first pushes judged before it lies) really runs with."""
    from shoal.runtime.roles.server import StageServer
    from shoal.runtime.safety.guard import DEFERRED_ENV

    assert StageServer("unused:0", "127.0.0.1:0", "tok", str(tmp_path), name="t").guard_cfg.deferred_checks
    monkeypatch.setenv(DEFERRED_ENV, "0")
    cfg = StageServer("unused:0", "127.0.0.1:0", "tok", str(tmp_path), name="t").guard_cfg
    assert not cfg.deferred_checks and cfg.deferred_pending == GuardConfig().deferred_pending
