"""A merge round's pseudo-gradients held within the server's merge memory (shoal.runtime.sync.held):
pushes beyond it wait as their real wire frames and decode to the same bits where read; the
screen and the merge read each contributor once; a large stage's median is taken over a sample."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from shoal.runtime.measure import available_ram
from shoal.runtime.safety.verify import (
    PRODUCT_BLOCK,
    norm_and_dot,
    reference_cosines,
    reference_gradient,
    round_measures,
    sample_positions,
    screen_measures,
    sum_product,
)
from shoal.runtime.sync.codecs import split_stage_frame, stage_frame
from shoal.runtime.sync.held import HeldPushes, default_merge_memory, host_memory_bytes
from shoal.train.outer import merge_weights, weighted_sum


def _stage(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(48, 32, generator=g), "b.weight": torch.randn(32, 40, generator=g),
            "b.bias": torch.randn(40, generator=g)}


def _round(budget: float, codec: str = "lowrank", n: int = 4):
    """``n`` contributors' pushes as a server holds them: each encoded with ``codec`` into one
    real stage frame, then decoded from it (the dense copy) with the frame's decoder beside."""
    shapes = _stage(0)
    held, dense, calls = HeldPushes(budget, available=lambda: 1e18, ram=0), {}, {}  # (the budget alone decides)
    for i in range(n):
        frame = stage_frame(_stage(10 + i), codec)

        def decode(frame=frame, w=f"w{i}"):
            calls[w] = calls.get(w, 0) + 1
            return split_stage_frame(frame, shapes)

        dense[f"w{i}"] = decode()
        calls[f"w{i}"] = 0
        held.put(f"w{i}", dense[f"w{i}"], decode, frame.ByteSize())
    return held, dense, calls


def test_pushes_past_the_budget_wait_as_frames_and_decode_to_the_same_bits():
    nbytes = sum(t.numel() * 4 for t in _stage(0).values())
    held, dense, _ = _round(budget=2.5 * nbytes)
    assert held.framed == 2 and len(held) == 4 and list(held) == ["w0", "w1", "w2", "w3"]
    for w in held:
        assert all(torch.equal(held[w][n], dense[w][n]) for n in dense[w])
    snap = held.snapshot()
    held.pop("w3")
    held.pop("w0")
    assert "w3" not in held and "w3" in snap and len(snap) == 4 and len(held) == 2
    # a dropped decoded push frees its room: the next one is held decoded
    assert not held.put("w9", dense["w1"], lambda: dense["w1"], 10)
    # frames no smaller than the decoded push are never kept instead of it
    assert not HeldPushes(0).put("w", dense["w0"], lambda: dense["w0"], nbytes)
    assert set(held.snapshot(only={"w1", "w9"})) == {"w1", "w9"}


def test_a_push_is_held_as_frames_when_the_host_runs_short_of_ram_whatever_the_budget():
    """Servers sharing a host each take a budget of what was free when their rounds began: a
    push is kept decoded only while the host still has its reserve free beside it."""
    nbytes = sum(t.numel() * 4 for t in _stage(0).values())
    free = [10 * nbytes]
    held = HeldPushes(1e18, available=lambda: free[0], ram=20 * nbytes)  # reserve: 4 pushes' bytes
    d = _stage(1)
    assert not held.put("w0", d, lambda: d, 10)
    free[0] = 4.5 * nbytes  # another server on the host took memory meanwhile
    assert held.put("w1", d, lambda: d, 10) and held.framed == 1
    free[0] = 6 * nbytes
    assert not held.put("w2", d, lambda: d, 10) and held.framed == 1
    assert held.snapshot().reserve == held.reserve


def test_the_merge_and_the_screen_read_the_same_from_frames_and_each_push_once():
    """weighted_sum of pushes held as frames is bitwise the merge of the decoded pushes;
    round_measures agrees; each reads every push exactly once."""
    framed, dense, calls = _round(budget=0)
    assert framed.framed == 4
    shares = merge_weights({"w0": 3, "w1": 5, "w2": 4, "w3": 4})
    a, b = weighted_sum(framed, shares), weighted_sum(dense, shares)
    assert all(torch.equal(a[n], b[n]) for n in b)
    assert calls == dict.fromkeys(calls, 1)
    lrs = {"w0": 1.0, "w1": 2.0, "w2": 1.0, "w3": 0.5}
    n1, c1 = round_measures(framed, lrs, quorum=3)
    assert calls == dict.fromkeys(calls, 2)  # one read a contributor, not one per tensor
    n2, c2 = round_measures(dense, lrs, quorum=3)
    assert n1 == n2 and c1 == pytest.approx(c2, abs=1e-12)


def test_the_screens_measures_read_each_push_once_with_the_reference():
    """screen_measures with the reference gradient (as the server calls it): each push held as
    frames is decoded once for its norm, its median sample and its cosine to the reference; the
    cosines are reference_cosines' floats, the same on the merge's threads, and the float64 ones
    within rounding."""
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb

    cfg = get_preset("tiny")
    module = build_stage(cfg, 0, cfg.n_total_layers, seed=0)
    params = {n: p.detach() for n, p in module.named_parameters()}
    spec = pb.RunSpec(model="tiny", stages=1, steps=4, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                      data="synthetic")
    held, calls = HeldPushes(0), {}
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        d = {n: 1e-3 * torch.randn(p.shape, generator=g) for n, p in params.items()}
        frame = stage_frame(d, "lowrank")

        def decode(frame=frame, w=f"w{i}"):
            calls[w] = calls.get(w, 0) + 1
            return split_stage_frame(frame, params)

        assert held.put(f"w{i}", decode(), decode, frame.ByteSize())
    ref = reference_gradient(module, spec, 0, [(0, None, None, None)], first=True, last=True)
    lrs = dict.fromkeys(held, 1.0)
    calls.clear()
    norms, med, cos, _ = screen_measures(held, lrs, quorum=3, ref=ref, seed=3)
    assert calls == {"w0": 1, "w1": 1, "w2": 1}
    assert set(cos) == {"w0", "w1", "w2"} and all(c is not None and -1 <= c <= 1 for c in cos.values())
    assert (norms, med) == round_measures(held, lrs, quorum=3, seed=3)
    calls.clear()
    assert reference_cosines(ref, held) == cos
    with ThreadPoolExecutor(max_workers=3) as pool:
        assert screen_measures(held, lrs, quorum=3, ref=ref, seed=3, pool=pool) == (norms, med, cos, None)
    # against the cosines in float64
    for w, c in cos.items():
        d = {k: t.double() for k, t in held[w].items()}
        num = sum(float((d[k] * ref[k].double()).sum()) for k in d)
        den = math.sqrt(sum(float((t * t).sum()) for t in d.values()) * sum(float((t.double() ** 2).sum())
                                                                          for t in ref.values()))
        assert c == pytest.approx(num / den, rel=1e-5, abs=1e-7)


def test_the_screens_read_takes_the_merges_weighted_sum_to_the_same_bits():
    """screen_measures with the round's shares (as the server's screen calls it): the fourth item
    is weighted_sum's result bit for bit (tensors over several product blocks, with and without
    the merge's threads, pushes held as frames read once), the measures are unchanged, a lone
    contributor's sum is its push, and a weight without a push leaves the sum to the merge."""
    shapes = {"a.weight": (600, 1000), "b.bias": (7,), "c.weight": (64, 64)}
    assert 2 * PRODUCT_BLOCK < 600 * 1000
    g = torch.Generator().manual_seed(9)
    pushes = {f"w{i}": {k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()} for i in range(4)}
    ref = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    shares = merge_weights({"w0": 3, "w1": 5, "w2": 1, "w3": 7})
    lrs = dict.fromkeys(pushes, 1.0)
    want = weighted_sum(pushes, shares)
    base = screen_measures(pushes, lrs, quorum=3, ref=ref, seed=1)
    assert base[3] is None
    with ThreadPoolExecutor(max_workers=2) as pool:
        for p in (None, pool):
            norms, med, cos, summed = screen_measures(pushes, lrs, quorum=3, ref=ref, sum_weights=shares, seed=1,
                                                      pool=p)
            assert (norms, med, cos) == base[:3]
            assert summed.keys() == want.keys() and all(torch.equal(summed[k], want[k]) for k in want)
    # held as frames: one decode of each push for the screen and the sum together
    held, calls = HeldPushes(0), {}
    for w, d in pushes.items():
        frame = stage_frame(d, "int8")

        def decode(frame=frame, w=w):
            calls[w] = calls.get(w, 0) + 1
            return split_stage_frame(frame, pushes["w0"])

        held.put(w, decode(), decode, frame.ByteSize())
    calls.clear()
    summed = screen_measures(held, lrs, quorum=3, ref=ref, sum_weights=shares, seed=1)[3]
    assert calls == dict.fromkeys(pushes, 1)
    framed_want = weighted_sum({w: held[w] for w in pushes}, shares)
    assert all(torch.equal(summed[k], framed_want[k]) for k in framed_want)
    # a lone contributor: its push, bit for bit
    one = screen_measures({"w2": pushes["w2"]}, lrs, quorum=3, sum_weights={"w2": 1.0})[3]
    assert all(torch.equal(one[k], pushes["w2"][k]) for k in shapes)
    # a weight whose push is missing, or weights out of name order
    assert screen_measures({"w0": pushes["w0"]}, lrs, quorum=3, sum_weights={"w0": 0.5, "w1": 0.5})[3] is None
    with pytest.raises(ValueError, match="name order"):
        screen_measures(pushes, lrs, quorum=3, sum_weights={"w1": 0.5, "w0": 0.5})


@pytest.mark.parametrize("n", [1000, PRODUCT_BLOCK, 3 * PRODUCT_BLOCK + 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_are_taken_a_block_at_a_time_within_float_rounding(n, dtype):
    """sum_product and norm_and_dot (the screen's norms and cosines) against float64: within
    1e-6 of the sum of magnitudes; norm_and_dot gives sum_product's two floats in one read."""
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) + 0.1).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    exact_ab = float((a.double() * b.double()).sum())
    exact_aa = float((a.double() ** 2).sum())
    scale = float((a.double() * b.double()).abs().sum())
    assert sum_product(a, b) == pytest.approx(exact_ab, abs=1e-6 * scale)
    assert sum_product(a, a) == pytest.approx(exact_aa, rel=1e-6)
    assert norm_and_dot(a, b) == (sum_product(a, a), sum_product(a, b))
    # a matrix is taken flat, in the same blocks
    m = a[: n - n % 8].reshape(8, -1)
    assert sum_product(m, m) == sum_product(m.reshape(-1), m.reshape(-1))


def test_a_push_is_measured_in_one_read_with_the_floats_of_two():
    """The exact-sync screen's norm and product of a push in one read (push_norm_and_dot, as
    StageServer._guard_measure takes them) are the bits of sq_norm and dot, also where the
    reference lacks a tensor of the push."""
    from shoal.runtime.safety.verify import dot, push_norm_and_dot, sq_norm

    g = torch.Generator().manual_seed(3)
    push = {"a": torch.randn(3 * PRODUCT_BLOCK + 5, generator=g), "b": torch.randn(17, 9, generator=g),
            "c": torch.randn(40, generator=g)}
    ref = {"a": torch.randn(3 * PRODUCT_BLOCK + 5, generator=g), "c": torch.randn(40, generator=g)}
    assert push_norm_and_dot(push, ref) == (sq_norm(push), dot(push, ref))
    assert push_norm_and_dot(push, None) == (sq_norm(push), 0.0)


def test_a_large_stages_median_is_taken_over_a_secret_sample():
    """Over a sample of a stage larger than ``sample``, the cosines are the full ones within
    1/100, the sample is the same for one seed and another for another, and a flipped push is
    still far from the rest."""
    g = torch.Generator().manual_seed(7)
    base = {"w": torch.randn(300, 200, generator=g), "v": torch.randn(5000, generator=g)}
    deltas = {f"w{i}": {n: t + 0.8 * torch.randn(t.shape, generator=g) for n, t in base.items()} for i in range(4)}
    deltas["bad"] = {n: -t for n, t in deltas["w0"].items()}
    lrs = dict.fromkeys(deltas, 1.0)
    full_n, full_c = round_measures(deltas, lrs, quorum=3)
    samp_n, samp_c = round_measures(deltas, lrs, quorum=3, sample=4096, seed=11)
    assert samp_n == full_n  # norms are always over the whole stage
    for w in deltas:
        assert samp_c[w] == pytest.approx(full_c[w], abs=0.01), (w, samp_c[w], full_c[w])
    assert samp_c["bad"] < -0.5 < 0.5 < min(samp_c[w] for w in deltas if w != "bad")
    total = 300 * 200 + 5000
    p1, p2 = sample_positions(total, 4096, 11), sample_positions(total, 4096, 12)
    assert torch.equal(p1, sample_positions(total, 4096, 11)) and not torch.equal(p1, p2)
    assert p1.numel() == 4096 and int(p1.max()) < total and sample_positions(100, 4096, 11) is None


def test_the_default_budget_is_a_quarter_of_the_ram_and_at_most_half_of_the_free():
    ram, free = host_memory_bytes(), available_ram()
    assert 0 < free <= ram
    budget = default_merge_memory()
    assert math.isfinite(budget) and 0 < budget <= ram / 4 * 1.0001 and budget <= free / 2 * 1.05


def test_a_negative_merge_memory_is_a_one_line_error(tmp_path):
    from shoal.errors import ShoalError
    from shoal.runtime.processes.launch import LaunchConfig
    from shoal.runtime.sync.held import merge_memory_bytes

    assert merge_memory_bytes(None) is None and merge_memory_bytes(1.5) == 1.5e9
    with pytest.raises(ShoalError, match="--merge-memory-gb must be"):
        merge_memory_bytes(-1.0)
    with pytest.raises(ShoalError, match="--merge-memory-gb must be"):
        LaunchConfig(out=str(tmp_path), merge_memory_gb=float("nan")).validate()


def test_the_reference_spreads_its_tokens_over_micro_batches_as_causal_prefixes():
    from shoal.runtime.safety.verify import reference_inputs

    held = [(mb, None, None) for mb in range(6)]
    whole = [(mb, None, None, None) for mb in range(4)]
    # micro-batches of 2 x 32 = 64 tokens: four whole ones within 1,024 tokens, either way
    assert reference_inputs(held, 2, 32, 4, 1024) == whole == reference_inputs(held, 2, 32, 4, 1024, spread=False)
    # 150 tokens over four: 37 each, the first 18 positions of each one's 2 sequences (144 tokens)
    assert reference_inputs(held, 2, 32, 4, 150) == [(mb, None, None, 18) for mb in range(4)]
    # or whole ones first: two, then 11 positions of the third one's sequences
    assert reference_inputs(held, 2, 32, 4, 150, spread=False) == [*whole[:2], (2, None, None, 11)]
    # micro-batches of 1 x 1024 within 512 tokens: the first 128 positions of four of them
    assert reference_inputs(held, 1, 1024, 4, 512) == [(mb, None, None, 128) for mb in range(4)]
    assert reference_inputs(held[:1], 1, 1024, 4, 512) == [(0, None, None, 512)]
    assert reference_inputs(held, 2, 32, 0, 1024) == [] and reference_inputs(held, 2, 32, 4, 0) == []


@pytest.mark.parametrize("last", [False, True])
def test_a_causal_prefix_is_the_gradient_of_its_positions(last):
    """The reference on the first P positions of each sequence equals the full micro-batch's
    gradient where the positions after P contribute nothing (their output gradient zero, or
    at the last stage their loss left out): attention is causal, so a prefix's outputs do
    not depend on what follows it."""
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.safety.verify import recompute_grads

    cfg = get_preset("tiny")
    a, b = (1, 3) if not last else (3, cfg.n_total_layers)
    module = build_stage(cfg, a, b, seed=0)
    spec = pb.RunSpec(model="tiny", stages=2, steps=4, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                      data="synthetic")
    g = torch.Generator().manual_seed(3)
    inp = torch.randn(2, 16, cfg.d_model, generator=g)
    out_grad = None if last else torch.randn(2, 16, cfg.d_model, generator=g)
    pre = recompute_grads(module, spec, 1, 0, first=False, last=last, inp=inp, out_grad=out_grad, prefix=5)
    if last:
        # the loss is a mean over positions: the prefix's mean over 5 of them
        from shoal.runtime.common import micro_batch

        tokens, targets = micro_batch(spec, 1, 0)
        names = [n for n, _ in module.named_parameters()]
        params = [p for _, p in module.named_parameters()]
        with torch.enable_grad():
            logits = module(inp)[:, :5]  # the whole sequence through the stage, the loss of 5 positions
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                     targets[:, :5].reshape(-1)) / spec.micro_batches
            full = dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True), strict=True))
        full = {n: torch.zeros_like(p) if full[n] is None else full[n] for n, p in module.named_parameters()}
    else:
        masked = out_grad.clone()
        masked[:, 5:] = 0
        full = recompute_grads(module, spec, 1, 0, first=False, last=False, inp=inp, out_grad=masked)
    assert set(pre) == set(full)
    for n in pre:
        torch.testing.assert_close(pre[n], full[n], rtol=1e-4, atol=1e-6)
    assert sum(float(t.abs().sum()) for t in pre.values()) > 0


def test_the_merge_on_threads_is_the_same_bits_and_reads_each_push_once():
    """The server's merge pool (shoal.runtime.sync.local.merge_pool) adds each contributor's
    tensors in chunks on its threads: bitwise the serial sum, for weights of 1 and not, for a
    tensor spanning several chunks and names only a later contributor holds; the screen's norms
    on the pool are the serial ones exactly; each push held as frames is still read once."""
    from shoal.runtime.safety.verify import sq_norm
    from shoal.runtime.sync.local import merge_pool
    from shoal.train.outer import SUM_CHUNK

    g = torch.Generator().manual_seed(3)
    big = {f"w{i}": {"big": torch.randn(2 * SUM_CHUNK + 77, generator=g), "m": torch.randn(7, 5, generator=g)}
           for i in range(3)}
    big["w2"]["late"] = torch.randn(9, generator=g)
    pool = merge_pool()
    for shares in (merge_weights({"w0": 3, "w1": 5, "w2": 1}), {"w1": 1.0}):
        a, b = weighted_sum(big, shares, pool), weighted_sum(big, shares)
        assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in b)
    assert all(sq_norm(d, pool) == sq_norm(d) for d in big.values())
    framed, dense, calls = _round(budget=0)
    shares = merge_weights({"w0": 3, "w1": 5, "w2": 4, "w3": 4})
    a, b = weighted_sum(framed, shares, pool), weighted_sum(dense, shares)
    assert all(torch.equal(a[n], b[n]) for n in b) and calls == dict.fromkeys(calls, 1)
    lrs = dict.fromkeys(dense, 1.0)
    assert round_measures(framed, lrs, quorum=3, pool=pool) == round_measures(dense, lrs, quorum=3)


def test_large_frames_past_the_budget_go_to_disk_and_decode_to_the_same_bits(tmp_path):
    """int8 and raw frames that the budget holds neither decoded nor as frames are written to
    disk (SpilledPush) and read back to the same bits; lowrank frames stay in memory; frames
    the budget holds stay in memory and count against it; the file goes with the push."""
    import gc

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.sync.held import SpilledPush

    shapes = _stage(0)
    nbytes = sum(t.numel() * 4 for t in shapes.values())

    def spilled(frame):
        def decode(data):
            t = pb.Tensor()
            t.ParseFromString(data)
            return split_stage_frame(t, shapes)
        return SpilledPush.written(frame.SerializeToString(), decode, tmp_path)

    held = HeldPushes(0)
    for i, codec in enumerate(["int8", "raw", "lowrank"]):
        frame = stage_frame(_stage(10 + i), codec)
        wire = frame.ByteSize()
        assert held.should_spill(nbytes, wire) == (codec != "lowrank"), codec
        dense = split_stage_frame(frame, shapes)
        assert held.put(f"w{i}", dense, lambda f=frame: split_stage_frame(f, shapes), wire,
                        spilled(frame) if codec != "lowrank" else None)
        assert all(torch.equal(held[f"w{i}"][n], dense[n]) for n in dense)
    assert held.spilled == 2 and held.framed == 3 and len(list(tmp_path.iterdir())) == 2
    held.pop("w0")
    gc.collect()
    assert len(list(tmp_path.iterdir())) == 1 and held.spilled == 1 and held.snapshot().spilled == 1
    # raw frames without a spill: held decoded, as before (their frames are no smaller)
    frame = stage_frame(_stage(20), "raw")
    assert not held.put("w9", split_stage_frame(frame, shapes), lambda: split_stage_frame(frame, shapes),
                        frame.ByteSize())
    # a budget that holds int8 frames but not the decoded push: the frames stay in memory, counted
    frame = stage_frame(_stage(30), "int8")
    roomy = HeldPushes(1.5 * frame.ByteSize(), available=lambda: 1e18, ram=0)
    assert not roomy.should_spill(nbytes, frame.ByteSize())
    assert roomy.put("a", split_stage_frame(frame, shapes), lambda: split_stage_frame(frame, shapes), frame.ByteSize())
    assert roomy.should_spill(nbytes, frame.ByteSize())  # a second one no longer fits beside it


@pytest.mark.parametrize("codec", ["int8", "raw"])
def test_a_received_push_spills_as_it_came_and_reads_back_to_the_same_bits(tmp_path, codec):
    """The server's spill of a push as it received it (a Framed message: frames kept out of
    protobuf): its pieces written to disk without a joined copy parse back to the same
    message, and its decoder gives the same tensors as the received push's."""
    from shoal.net import shoal_pb2 as pb
    from shoal.net.wire import encode_tensor, message_pieces, serialize_framed, split_framed
    from shoal.runtime.sync.held import SpilledPush
    from shoal.runtime.sync.local import GRADS_FIELD, parse_push, push_decoder

    params = _stage(0)
    msg = pb.GradPush(worker="w1", step=3, local_round=4, local_mbs=2)
    for n, t in sorted(_stage(5).items()):
        msg.grads.append(encode_tensor(n, t, codec))
    got = split_framed(msg.SerializeToString(), pb.GradPush, GRADS_FIELD)  # as the stream hands it over
    pieces = message_pieces(got, GRADS_FIELD)
    assert b"".join(bytes(p) for p in pieces) == bytes(serialize_framed(got.head, GRADS_FIELD, got.frames))
    want = push_decoder(got, params)()
    spilled = SpilledPush.written(pieces, lambda data: push_decoder(parse_push(data), params)(), tmp_path)
    back = spilled()
    assert back.keys() == want.keys() and all(torch.equal(back[n], want[n]) for n in want)
    assert parse_push(bytes(b"".join(bytes(p) for p in pieces))).head == got.head


@pytest.mark.parametrize("codec", ["int8", "raw"])
def test_a_large_push_is_received_into_a_file_and_decodes_to_the_same_bits(tmp_path, monkeypatch, codec):
    """A push of the spool's size or more, streamed in chunks, is received into an unlinked
    file of the spool folder (page cache, not the process's memory: no named file is left, an
    open one is); its frames are views of that file and decode to the same tensors as the
    push sent; a ``SpilledPush`` of its decoder holds it without writing it again. A smaller push and a
    receive without a spool folder come in memory."""
    import asyncio
    import os

    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import receive, split
    from shoal.net.wire import encode_tensor
    from shoal.runtime.sync.held import SpilledPush
    from shoal.runtime.sync.local import GRADS_FIELD, push_decoder, released

    params = _stage(0)
    msg = pb.GradPush(worker="w1", step=3, local_round=4, local_mbs=2)
    for n, t in sorted(_stage(5).items()):
        msg.grads.append(encode_tensor(n, t, codec))
    data = msg.SerializeToString()
    want = push_decoder(msg, params)()
    monkeypatch.setenv("SHOAL_SPOOL_MB", str(len(data) / 2**20))
    folder = tmp_path / "pushes"

    def fds_in_folder() -> int:
        return sum(os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)) for fd in os.listdir("/proc/self/fd")
                   if os.path.islink(f"/proc/self/fd/{fd}"))

    def mapped_kb(folder) -> int:
        """Resident kB of this process's mappings of files in ``folder`` (/proc/self/smaps)."""
        kb, ours = 0, False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                ours = len(head) >= 6 and head[5].startswith(str(folder))
            elif ours and head[0] == "Rss:":
                kb += int(head[1])
        return kb

    async def got(msg_bytes, spool):
        async def chunks():
            for c in split("GradPush", msg_bytes, 1000):
                yield c
        return await receive(chunks(), pb.GradPush, 10 * len(data), frames_field=GRADS_FIELD, spool=spool)

    r = asyncio.run(got(data, folder))
    assert r.spool is not None and fds_in_folder() == 1 and not list(folder.iterdir())
    assert all(isinstance(f.data, memoryview) for f in r.grads)
    push = SpilledPush(released(push_decoder(r, params), r.spool))
    assert push.path is None and not list(folder.iterdir())
    held = HeldPushes(0)
    assert held.put("w1", want, push_decoder(r, params), len(data), push)
    assert held.spilled == held.spooled == 1
    back = held["w1"]
    assert back.keys() == want.keys() and all(torch.equal(back[n], want[n]) for n in want)
    assert mapped_kb(folder) == 0  # the read let go of the pages it mapped
    r.grads[0].data[0]  # (a read of a view maps a page again)
    assert mapped_kb(folder) > 0
    del r, push, back, held
    import gc

    gc.collect()
    assert fds_in_folder() == 0  # the file (and its bytes) went with the push
    small = pb.GradPush(worker="w2", grads=[encode_tensor("b.bias", params["b.bias"], codec)]).SerializeToString()
    assert asyncio.run(got(small, folder)).spool is None
    assert asyncio.run(got(data, None)).spool is None
