"""A local-mode worker's step sum (shoal.runtime.sync.ordered.LocalFold): bitwise the micro-batch
order where the results come in order or its device has room to wait for a gap, else one sum:
one whole-stage gradient whatever the step's size, what the plan counts."""

from __future__ import annotations

import torch

from shoal.runtime.sync.ordered import LOCAL_APART, LocalFold, PrefixFold


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
    # results acknowledged a little out of order (uploads run concurrently): each waits for its
    # gap where the device has room for one more gradient (Worker._apart_room)
    arrivals = [0, 2, 1, 3, 5, 4, 6, 8, 7, 9, 11, 10]
    fold = LocalFold()
    most = 0
    for mb in arrivals:
        assert fold.add(mb, g[mb], room=1)
        most = max(most, fold.held())
    assert _equal(fold.total(), _in_order(g, list(range(12))))
    # the run's sum and at most one result waiting for its gap: never a gradient a micro-batch
    assert most <= 2
    # a shuffled order within the window gives the same bits
    fold2 = LocalFold()
    for mb in [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10]:
        fold2.add(mb, g[mb], room=1)
    assert _equal(fold2.total(), _in_order(g, list(range(12))))
    # in order, no room is needed: the same bits holding the run's sum alone
    fold3 = LocalFold()
    for mb in range(12):
        fold3.add(mb, g[mb])
        assert fold3.held() == 1
    assert _equal(fold3.total(), _in_order(g, list(range(12))))


def test_on_a_tight_device_the_sum_gives_up_the_order_and_holds_one_gradient():
    g = _grads(range(12))
    arrivals = [0, 2, 1, 3, 5, 4, 6, 8, 7, 9, 11, 10]
    fold = LocalFold()  # no room: the plan counts one sum
    for mb in arrivals:
        assert fold.add(mb, g[mb])
        assert fold.held() == 1
    assert not fold.add(7, g[7]) and not fold.add(0, g[0])  # held already: refused
    # the run (0), then 2, then the rest as they came: the same gradients, other bits
    assert fold.rest_mbs == arrivals
    assert _equal(fold.total(), _in_order(g, arrivals))


def test_a_shared_stages_worker_holds_one_sum_however_many_micro_batches_it_runs():
    mine = [0, 3, 5, 8, 10, 12, 15, 17, 20, 22, 25, 27, 30, 31]  # the others went to other workers
    g = _grads(mine)
    fold = LocalFold()
    most = 0
    for mb in mine:
        fold.add(mb, g[mb])
        most = max(most, fold.held())
    # one sum (LOCAL_APART = 0 kept apart without room): not len(mine) = 14 gradients
    assert LOCAL_APART == 0 and most == 1
    # in the order the server accepted them
    assert _equal(fold.total(), _in_order(g, mine))
    # with room for two, two wait for their gaps before the order is given up (3 held at most)
    roomy = LocalFold()
    most = 0
    for mb in mine:
        roomy.add(mb, g[mb], room=2)
        most = max(most, roomy.held())
    assert most == 3 and _equal(roomy.total(), _in_order(g, mine))


def test_an_owned_fold_sums_in_the_tasks_own_gradients_with_the_same_bits():
    # a real worker's task gradients are its own (not a shadow worker's shared tensors): the sum
    # is built in the first of them, no further copy of the stage on the device
    g = _grads([0, 1, 2, 5, 7])
    copy = {mb: {n: t.clone() for n, t in d.items()} for mb, d in g.items()}
    fold = LocalFold(owned=True)
    for mb in (0, 1, 2, 5, 7):
        fold.add(mb, g[mb])
    total = fold.total()
    assert total["w"] is g[0]["w"] and total["b"] is g[0]["b"]
    assert _equal(total, _in_order(copy, [0, 1, 2, 5, 7]))
    # the same when the order is given up before micro-batch 0 came (the first apart is the base)
    g = _grads([3, 0, 1])
    copy = {mb: {n: t.clone() for n, t in d.items()} for mb, d in g.items()}
    fold = LocalFold(owned=True)
    for mb in (3, 0, 1):
        fold.add(mb, g[mb])
    assert fold.total()["w"] is g[3]["w"] and _equal(fold.total(), _in_order(copy, [3, 0, 1]))


def test_the_fold_keeps_the_first_of_a_micro_batch_and_never_writes_into_a_tasks_gradient():
    g = _grads([0, 1, 4, 6, 9])
    before = {mb: {n: t.clone() for n, t in d.items()} for mb, d in g.items()}
    fold = LocalFold(apart=1)
    for mb in (0, 1, 4, 6, 9):
        assert fold.add(mb, g[mb])
    assert not fold.add(4, {"w": torch.ones(64), "b": torch.ones(3)})  # a second copy (in the sum): refused
    assert not fold.add(9, {"w": torch.ones(64), "b": torch.ones(3)})  # (added after): refused
    assert not fold.add(1, g[1])  # in the run already
    total = fold.total()
    # (shadow workers' gradients are shared tensors: nothing the fold got was changed in place)
    assert all(_equal(g[mb], before[mb]) for mb in g)
    # the run (0, 1), those apart when 6 came (4, 6), then 9
    assert _equal(total, _in_order(g, [0, 1, 4, 6, 9]))


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
    # without the room the order is given up at 3: the same gradients, other bits, one sum held
    tight = LocalFold()
    for mb in (0, 1, 3, 4, 5, 2, 6):
        tight.add(mb, g[mb])
    assert tight.rest_mbs == [0, 1, 3, 4, 5, 2, 6] and tight.held() == 1


def test_exact_syncs_fold_gives_up_the_largest_apart_first_and_keeps_the_run():
    # a shared stage's worker in exact sync (Worker._push_apart): the gradients apart beyond the
    # device's room leave to be pushed alone, largest first; the run and the rest stay
    g = _grads([0, 1, 3, 5, 6, 9])
    fold = PrefixFold()
    for mb in (0, 1, 3, 5, 6, 9):
        fold.add(mb, g[mb])
    assert fold.run == 2 and sorted(fold.apart) == [3, 5, 6, 9]
    out = fold.take_apart(1)
    assert [mb for mb, _ in out] == [9, 6, 5] and all(grads is g[mb] for mb, grads in out)
    assert sorted(fold.apart) == [3] and fold.held() == 2
    assert fold.take_apart(1) == [] and [mb for mb, _ in fold.take_apart(0)] == [3]
    # the pushes left are the run's sum in order: what the server sums first
    assert [mbs for mbs, _ in fold.groups()] == [[0, 1]] and _equal(fold.groups()[0][1], _in_order(g, [0, 1]))


def test_exact_syncs_fold_without_a_prefix_keeps_every_micro_batch_apart():
    # armed with the test fault hang_mid_push a worker sums no run: two micro-batches are two
    # pushes, and the server's ordered sum of them is the run's sum, bit for bit
    g = _grads([0, 1, 2])
    fold = PrefixFold(prefix=False)
    for mb in (1, 0, 2):
        fold.add(mb, g[mb])
    groups = fold.groups()
    assert [mbs for mbs, _ in groups] == [[0], [1], [2]] and fold.held() == 3
    assert all(grads is g[mb] for (mb,), grads in groups)
    summed = PrefixFold()
    for mb in (1, 0, 2):
        summed.add(mb, g[mb])
    server = {n: t.clone() for n, t in groups[0][1].items()}
    for _, grads in groups[1:]:
        for n, t in grads.items():
            server[n].add_(t)
    assert _equal(server, summed.groups()[0][1])
