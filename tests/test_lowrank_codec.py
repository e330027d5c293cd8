"""The ``lowrank`` pseudo-gradient codec: exact sizes (the planner's formula), the best low-rank
approximation, the same decoded bits at any thread count, error feedback, and refusals."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shoal.errors import ShoalError
from shoal.net import compress as c
from shoal.net.compress import CodecError, ErrorFeedback, NonFiniteError
from shoal.plan.compression import (
    bytes_per_element,
    lowrank_matrix,
    lowrank_nbytes,
    lowrank_params,
    parse_codec,
    parse_compression,
)

STAGE = [(64, 192), (64,), (256, 64), (3,), (2, 2), (16, 4, 8)]  # matrices, vectors, a tiny matrix, a 3-D tensor


def _stage(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(*s, generator=g).reshape(-1) for s in STAGE])


@pytest.mark.parametrize("codec", ["lowrank", "lowrank:1:8", "lowrank:8:4", "lowrank:2:8"])
def test_bytes_equal_the_planners_formula(codec):
    x = _stage()
    rank, bits = lowrank_params(codec)
    payload, meta = c.encode(x, codec, layout=STAGE)
    assert len(payload) == lowrank_nbytes(STAGE, rank, bits) == c.encoded_nbytes(codec, x.numel(), layout=STAGE)
    assert meta == {"codec": "lowrank", "numel": x.numel(), "rank": rank, "bits": bits}
    assert c.decode(payload, meta, x.shape, layout=STAGE).shape == x.shape
    # which tensors go as factors: the 2-D and 3-D ones whose factors are under a quarter of their
    # int8 bytes (the 16 x 32 view of the 3-D one: 4 (8 r + 2 r + 4 r) bytes at 4 bits < 512)
    assert [lowrank_matrix(s, rank, bits) for s in STAGE] == [True, False, True, False, False, codec != "lowrank:8:4"]


def test_a_low_rank_matrix_comes_back_and_small_tensors_go_in_int8():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(300, 3, generator=g) @ torch.randn(3, 500, generator=g)  # rank 3
    v = torch.randn(40, generator=g)
    x = torch.cat([m.reshape(-1), v])
    layout = [(300, 500), (40,)]
    out = c.decode(*c.encode(x, "lowrank:3:8", layout=layout), x.shape, layout=layout)
    assert float((out[:150000] - m.reshape(-1)).norm() / m.norm()) < 0.02  # 8-bit factors
    assert float((out[150000:] - v).abs().max()) <= float(v.abs().max()) / 254 + 1e-7  # int8, one block
    # 4 bits: coarser, still the same subspace
    out4 = c.decode(*c.encode(m, "lowrank:3:4"), m.shape)
    assert float((out4 - m).norm() / m.norm()) < 0.25
    assert 2 * m.numel() / c.encoded_nbytes("lowrank:3:4", m.numel(), layout=[m.shape]) > 240  # vs bf16


def test_the_randomised_svd_finds_the_top_directions():
    """A matrix too large for the exact SVD path: rank-3 signal plus noise; the codec's factors
    (8-bit) are the exact best rank-3 approximation but for about 1 % (the randomised range
    finder and the 8-bit codes)."""
    g = torch.Generator().manual_seed(2)
    sig = torch.randn(400, 3, generator=g) @ torch.randn(3, 600, generator=g)
    x = sig + 0.05 * torch.randn(400, 600, generator=g)
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    best = (u[:, :3] * s[:3]) @ vh[:3]
    got = c.decode(*c.encode(x, "lowrank:3:8"), x.shape)
    assert float((got - best).norm() / best.norm()) < 0.02


def test_decoding_is_the_same_bits_at_any_thread_count():
    x = torch.randn(512, 768, generator=torch.Generator().manual_seed(3))
    payload, meta = c.encode(x, "lowrank:8:4")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = c.decode(payload, meta, x.shape)
        torch.set_num_threads(max(2, threads))
        many = c.decode(payload, meta, x.shape)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_the_codec_threads_give_the_same_payload_and_bits_as_one_thread():
    """A stage server encodes and decodes a frame's matrices on its merge threads
    (``set_codec_threads``): the payload and the decoded bits are those of one thread, and each
    decoded matrix is the sum of its outer products in order (factors read back from the
    payload by hand), the small tensors in their places."""
    layout = [(96, 400), (7,), (300, 64), (2, 2), (128, 128), (16, 4, 8), (5,)]
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(math.prod(s), generator=g) for s in layout])
    assert c.codec_threads() == 1
    one, meta = c.encode(x, "lowrank:3:4", layout=layout)
    dec_one = c.decode(one, meta, x.shape, layout=layout)
    try:
        c.set_codec_threads(3)
        assert c.codec_threads() == 3
        many, _ = c.encode(x, "lowrank:3:4", layout=layout)
        dec_many = c.decode(many, meta, x.shape, layout=layout)
    finally:
        c.set_codec_threads(1)
    assert many == one and torch.equal(dec_many, dec_one)
    # by hand: the first matrix's factors, and a small tensor's int8 values in its place
    m, n, rank = 96, 400, 3
    sa, sb = (torch.frombuffer(bytearray(one[k * 4 * rank:(k + 1) * 4 * rank]), dtype=torch.float32) for k in (0, 1))
    at = 8 * rank
    a = c._unpack_codes(memoryview(one)[at:], m, rank, 4) * sa
    b = c._unpack_codes(memoryview(one)[at + m * rank // 2:], n, rank, 4) * sb
    want = a[:, 0:1] * b[:, 0] + a[:, 1:2] * b[:, 1] + a[:, 2:3] * b[:, 2]
    assert torch.equal(dec_one[:m * n].view(m, n), want)
    # the tensors that are not factored share one int8 block: each element within its scale / 2
    rest = [(at, math.prod(s)) for at, s in zip([0, *itertools.accumulate(math.prod(s) for s in layout)], layout,
                                                  strict=False) if not lowrank_matrix(s, 3, 4)]
    assert sum(k for _, k in rest) == 16
    scale = max(float(x[at:at + k].abs().max()) for at, k in rest) / 127
    for at, k in rest:
        assert float((dec_one[at:at + k] - x[at:at + k]).abs().max()) <= scale / 2 + 1e-7


def test_error_feedback_sums_to_the_dense_updates():
    """What ``K`` encodes of the same update sent, plus the residual still held, is ``K`` times
    the update; for an update of the codec's rank the residual stays at the codes' rounding
    (it does not grow with ``K``)."""
    ef = ErrorFeedback("lowrank")
    g = torch.Generator().manual_seed(4)
    x = torch.cat([(torch.randn(s[0], 2, generator=g) @ torch.randn(2, math.prod(s[1:]), generator=g)).reshape(-1)
                   if lowrank_matrix(s, 3, 4) else torch.randn(math.prod(s), generator=g) for s in STAGE])
    sent = torch.zeros_like(x, dtype=torch.float64)
    norms = []
    for _ in range(12):
        payload, meta = ef.encode("*stage", x, layout=STAGE)
        sent += c.decode(payload, meta, x.shape, layout=STAGE).double()
        norms.append(float(ef.residual("*stage").norm()))
    assert torch.allclose(sent + ef.residual("*stage").double(), 12 * x.double(), atol=1e-3)
    assert max(norms) < 0.3 * float(x.norm()) and norms[-1] < 2 * norms[0], norms


def test_malformed_payloads_and_layouts_are_codec_errors():
    x = _stage()
    payload, meta = c.encode(x, "lowrank", layout=STAGE)
    with pytest.raises(CodecError, match="must be"):
        c.decode(payload[:-1], meta, x.shape, layout=STAGE)
    with pytest.raises(CodecError, match="does not cover"):
        c.decode(payload, meta, x.shape, layout=STAGE[:-1])
    with pytest.raises(CodecError, match="does not cover"):
        c.encode(x, "lowrank", layout=STAGE[1:])
    for bad in ({**meta, "rank": 0}, {**meta, "rank": 65}, {**meta, "rank": True}, {**meta, "bits": 3}):
        with pytest.raises(CodecError):
            c.decode(payload, bad, x.shape, layout=STAGE)
    # a non-finite factor scale (the first matrix's first scale) is refused, never decoded
    bad = bytearray(payload)
    bad[0:4] = bytes.fromhex("0000c07f")  # NaN
    with pytest.raises(CodecError, match="scale"):
        c.decode(bytes(bad), meta, x.shape, layout=STAGE)
    y = x.clone()
    y[5] = float("nan")
    with pytest.raises(NonFiniteError):
        c.encode(y, "lowrank", layout=STAGE)


def test_planner_names_and_rates():
    assert lowrank_params("lowrank") == (3, 4) and lowrank_params("lowrank:2:8") == (2, 8)
    assert parse_codec("lowrank:2:8", "pull") == "lowrank:2:8"
    assert parse_compression("lowrank:2") == {"act": "none", "grad": "none", "push": "lowrank:2", "pull": "lowrank:2"}
    for bad, kind in (("lowrank", "act"), ("lowrank:0", "push"), ("lowrank:3:3", "push"), ("lowrank:x", "push"),
                      ("lowrank:1:4:9", "push")):
        with pytest.raises(ShoalError):
            parse_codec(bad, kind)
    # per weight of a transformer block: falls with the width, 1,000x below bf16 at gpt-1.3b's
    assert bytes_per_element("lowrank", 2, 0, 128) > bytes_per_element("lowrank", 2, 0, 2048)
    assert 2 / bytes_per_element("lowrank", 2, 0, 2048) > 1000
    d = 768
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] + [(d,)] * 13
    assert math.isclose(bytes_per_element("lowrank", 2, 0, d), lowrank_nbytes(shapes, 3, 4) / (12 * d * d + 13 * d))


def test_a_stage_frame_of_lowrank_splits_by_the_receivers_shapes():
    """Through the runtime's stage frame: the layout is the receiver's own parameters (name
    order), never the sender's; another stage's shapes are a WireError."""
    from shoal.net.wire import WireError
    from shoal.runtime.sync.codecs import split_stage_frame, stage_frame

    g = torch.Generator().manual_seed(5)
    t = {"b.bias": torch.randn(7, generator=g), "a.w": torch.randn(40, 300, generator=g),
         "c.w": torch.randn(64, 64, generator=g)}
    frame = stage_frame(t, "lowrank:2:8")
    assert frame.codec == "lowrank"
    got = split_stage_frame(frame, t)
    assert list(got) == sorted(t) and all(got[n].shape == t[n].shape for n in t)
    assert float((got["b.bias"] - t["b.bias"]).abs().max()) < float(t["b.bias"].abs().max()) / 100
    # the same element count in other shapes (another factor size) or a tensor short: refused
    with pytest.raises(WireError):
        split_stage_frame(frame, {"b.bias": torch.zeros(7), "a.w": torch.zeros(300, 40), "c.w": torch.zeros(32, 128)})
    with pytest.raises(WireError):
        split_stage_frame(frame, {"b.bias": torch.zeros(7), "a.w": torch.zeros(40, 300)})
