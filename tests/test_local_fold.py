"""A local-mode worker's step sum (shoal.runtime.sync.ordered.LocalFold): bitwise the micro-batch
order where the results come in order, a few whole-stage gradients whatever the step's size."""

from __future__ import annotations

import torch

from shoal.runtime.sync.ordered import LOCAL_APART, LocalFold


def _grads(mbs) -> dict[int, dict[str, torch.Tensor]]:
    # magnitudes that differ by powers of ten, so that the order of the additions shows in the bits
    gen = torch.Generator().manual_seed(7)
    return {mb: {"w": torch.randn(64, generator=gen) * 10 ** (mb % 4), "b": torch.randn(3, generator=gen)}
            for mb in mbs}


def _in_order(g: dict[int, dict[str, torch.Tensor]], order) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in g[order[0]].items()}
    for mb in order[1:]:
        for n, t in g[mb].items():
            out[n].add_(t)
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_a_stages_only_worker_sums_bitwise_in_micro_batch_order_whatever_order_results_land():
    g = _grads(range(12))
    # results acknowledged a little out of order (uploads run concurrently): each waits for its gap
    arrivals = [0, 2, 1, 3, 5, 4, 6, 8, 7, 9, 11, 10]
    fold = LocalFold()
    most = 0
    for mb in arrivals:
        assert fold.add(mb, g[mb])
        most = max(most, fold.held())
    assert _equal(fold.total(), _in_order(g, list(range(12))))
    # the run's sum and at most one result waiting for its gap: never a gradient a micro-batch
    assert most <= 2
    # a shuffled order within the window gives the same bits
    fold2 = LocalFold()
    for mb in [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10]:
        fold2.add(mb, g[mb])
    assert _equal(fold2.total(), _in_order(g, list(range(12))))


def test_a_shared_stages_worker_holds_a_few_gradients_however_many_micro_batches_it_runs():
    mine = [0, 3, 5, 8, 10, 12, 15, 17, 20, 22, 25, 27, 30, 31]  # the others went to other workers
    g = _grads(mine)
    fold = LocalFold()
    most = 0
    for mb in mine:
        fold.add(mb, g[mb])
        most = max(most, fold.held())
    # the run (0), the rest, and LOCAL_APART kept apart: not len(mine) = 14 gradients
    assert most == LOCAL_APART + 2
    # run, then the rest in the order its gradients left the apart set, then the last ones apart
    rest = mine[1:-LOCAL_APART]
    want = _in_order(g, [0])
    for part in (_in_order(g, rest), *(g[mb] for mb in mine[-LOCAL_APART:])):
        for n, t in part.items():
            want[n].add_(t)
    assert _equal(fold.total(), want)
    plain = {n: sum(g[mb][n] for mb in mine) for n in ("w", "b")}
    got = LocalFold()
    for mb in mine:
        got.add(mb, g[mb])
    assert all(torch.allclose(got.total()[n], plain[n], rtol=1e-5, atol=1e-3) for n in plain)


def test_the_fold_keeps_the_first_of_a_micro_batch_and_never_writes_into_a_tasks_gradient():
    g = _grads([0, 1, 4, 6, 9])
    before = {mb: {n: t.clone() for n, t in d.items()} for mb, d in g.items()}
    fold = LocalFold(apart=1)
    for mb in (0, 1, 4, 6, 9):
        assert fold.add(mb, g[mb])
    assert not fold.add(4, {"w": torch.ones(64), "b": torch.ones(3)})  # a second copy (in the rest): refused
    assert not fold.add(9, {"w": torch.ones(64), "b": torch.ones(3)})  # (kept apart): refused
    assert not fold.add(1, g[1])  # in the run already
    total = fold.total()
    # (shadow workers' gradients are shared tensors: nothing the fold got was changed in place)
    assert all(_equal(g[mb], before[mb]) for mb in g)
    want = _in_order(g, [0, 1])  # the run, then the rest (4 + 6), then the one kept apart (9)
    for part in (_in_order(g, [4, 6]), g[9]):
        for n, t in part.items():
            want[n].add_(t)
    assert _equal(total, want)


def test_a_lone_gradient_is_copied_and_no_gradient_sums_to_nothing():
    assert LocalFold().total() == {}
    g = _grads([3])
    fold = LocalFold()
    fold.add(3, g[3])
    total = fold.total()
    assert _equal(total, g[3]) and all(total[n] is not g[3][n] for n in total)
    for t in total.values():
        t.add_(1.0)  # the caller adds an earlier report into it: the task's tensors stay
    assert not _equal(total, g[3])


def test_with_room_a_stalled_result_overtaken_by_several_still_sums_in_order():
    # mb 2's upload stalls while 3, 4 and 5 land: with room for three apart (a worker whose
    # device has it, Worker._apart_room) the run waits for 2 and stays in micro-batch order
    g = _grads(range(7))
    fold = LocalFold()
    for mb in (0, 1, 3, 4, 5, 2, 6):
        fold.add(mb, g[mb], room=3)
    assert fold.rest is None and _equal(fold.total(), _in_order(g, list(range(7))))
    # without the room the one kept apart leaves for the rest: the same gradients, other bits
    tight = LocalFold()
    for mb in (0, 1, 3, 4, 5, 2, 6):
        tight.add(mb, g[mb])
    assert tight.rest_mbs == [3, 4, 5] and tight.held() <= LOCAL_APART + 2
