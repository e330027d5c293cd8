"""The ``sparse`` codec (chunked top-k, in-chunk indices, low-bit values): sizes equal to the
planner's, what it keeps, error feedback over rounds, malformed payloads."""

import math

import numpy as np
import pytest
import torch

from shoal.net.compress import (
    SPARSE_CHUNK,
    CodecError,
    ErrorFeedback,
    NonFiniteError,
    decode,
    encode,
    encoded_nbytes,
    sparse_kept,
    wire_fraction,
)
from shoal.plan.compression import bytes_per_element, sparse_kept_per_chunk

CODECS = ["sparse", "sparse:0.01:1", "sparse:0.02:3", "sparse:0.05:4", "sparse:0.25:8", "sparse:1:2"]


def _rand(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * scale


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("chunks", [8, 24, 64])
def test_bytes_equal_the_planners_formula(codec, chunks):
    # Whole multiples of 8 chunks: the planner's per-element size times the element count is
    # a whole number of bytes, and the payload is exactly that long.
    n = chunks * SPARSE_CHUNK
    payload, _ = encode(_rand(n), codec)
    assert len(payload) == encoded_nbytes(codec, n)
    assert len(payload) == bytes_per_element(codec, 2) * n
    assert wire_fraction(codec) * 4 == pytest.approx(bytes_per_element(codec, 2))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 3, 40, 41, 100, 4095, 4096, 4097, 10000, 3 * 4096 + 5])
def test_bytes_of_any_length(codec, n):
    # By hand: one bf16 scale per chunk, (12 + bits)-bit words for min(k, chunk length) entries.
    density, bits = (float(codec.split(":")[1]), int(codec.split(":")[2])) if ":" in codec else (0.01, 2)
    k = sparse_kept_per_chunk(density)
    assert k == sparse_kept(density)
    lens = [min(SPARSE_CHUNK, n - c) for c in range(0, n, SPARSE_CHUNK)]
    kept = sum(min(k, m) for m in lens)
    payload, meta = encode(_rand(n, seed=n), codec)
    assert len(payload) == 2 * len(lens) + math.ceil(kept * (12 + bits) / 8) == encoded_nbytes(codec, n)
    y = decode(payload, meta, (n,))
    assert int((y != 0).sum()) == kept


def test_default_is_111x_smaller_than_bf16():
    n = 64 * SPARSE_CHUNK
    payload, _ = encode(_rand(n), "sparse")
    assert 2 * n / len(payload) == pytest.approx(111.07, abs=0.01)


def test_keeps_each_chunks_largest_entries_with_their_signs():
    n = 3 * SPARSE_CHUNK + 700
    x = _rand(n, seed=3)
    payload, meta = encode(x, "sparse:0.02:8")
    y = decode(payload, meta, (n,))
    k = sparse_kept(0.02)
    for c in range(0, n, SPARSE_CHUNK):
        xs, ys = x[c:c + SPARSE_CHUNK], y[c:c + SPARSE_CHUNK]
        top = set(torch.topk(xs.abs(), min(k, xs.numel())).indices.tolist())
        assert set(torch.nonzero(ys).flatten().tolist()) == top
        idx = sorted(top)
        assert torch.equal(torch.sign(ys[idx]), torch.sign(xs[idx]))
        # 8 bits: 128 magnitude levels up to a least-squares scale near the chunk's max
        assert (ys[idx] - xs[idx]).abs().max() <= xs.abs().max() / 100


def test_one_bit_is_sign_times_mean_magnitude():
    x = torch.tensor([0.5, -3.0, 0.1, 2.0] + [0.0] * 96)
    payload, meta = encode(x, "sparse:0.0005:1")  # 3 entries of the (only, short) chunk
    y = decode(payload, meta, x.shape)
    s = float(torch.tensor((3.0 + 2.0 + 0.5) / 3).bfloat16())
    assert y[:4].tolist() == pytest.approx([s, -s, 0.0, s])
    assert not y[4:].any()


def test_zero_and_bf16_tensors():
    z = torch.zeros(5000)
    payload, meta = encode(z, "sparse")
    assert not decode(payload, meta, z.shape).any()
    x = _rand(5000).to(torch.bfloat16).reshape(50, 100)
    payload, meta = encode(x, "sparse")
    y = decode(payload, meta, x.shape, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape


@pytest.mark.parametrize("codec", ["sparse", "sparse:0.05:4", "sparse:0.01:1"])
def test_error_feedback_sums_to_the_dense_updates(codec):
    """Over many rounds, the decoded updates add up to the dense ones minus the final residual
    (to fp32 rounding: the only difference is the rounding of the two additions per round), and
    what is still unsent stays bounded while the dense sum grows."""
    shape = (3, 3000)  # 9000 elements: two whole chunks and a short one
    ef = ErrorFeedback(codec)
    sent = torch.zeros(shape, dtype=torch.float64)
    total = torch.zeros(shape, dtype=torch.float64)
    drift = _rand(9000, seed=99).reshape(shape)  # a direction every round shares
    rounds = 60
    for r in range(rounds):
        g = 0.5 * drift + _rand(9000, seed=r).reshape(shape)
        payload, meta = ef.encode("w", g)
        sent += decode(payload, meta, shape).double()
        total += g.double()
        resid = ef.residual("w").double()
        # fp32: each round rounds g + r and (g + r) - decoded once; bound by r-many ulps of the sizes involved
        tol = 4 * (r + 1) * 2.0**-24 * float(total.abs().max() + resid.abs().max() + 10)
        assert (sent - (total - resid)).abs().max() <= tol
    # error feedback: the unsent part is a bounded fraction of the sum sent so far
    assert float(resid.norm()) < 0.5 * float(total.norm())
    # without it the sum of decoded updates would miss most of what a top-k drops
    one, meta = encode(total.float(), codec)
    assert float((decode(one, meta, shape).double() - total).norm()) > float(resid.norm())


def _payload(n=2 * SPARSE_CHUNK + 100, codec="sparse"):
    x = _rand(n, seed=5)
    payload, meta = encode(x, codec)
    return bytearray(payload), meta, n


def _bf16_bytes(v: float) -> bytes:
    """One chunk scale as it lies on the wire (little-endian bf16)."""
    return torch.tensor([v], dtype=torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def test_malformed_payloads_are_codec_errors():
    payload, meta, n = _payload()
    nc = -(-n // SPARSE_CHUNK)
    good = decode(bytes(payload), meta, (n,))
    bad = [
        (bytes(payload[:-1]), meta, (n,)),  # truncated
        (bytes(payload) + b"\0", meta, (n,)),  # one byte too many
        (bytes(payload), meta, (n + 1,)),  # another shape
        (bytes(payload), {**meta, "k": 0}, (n,)),
        (bytes(payload), {**meta, "k": SPARSE_CHUNK + 1}, (n,)),
        (bytes(payload), {**meta, "k": "41"}, (n,)),
        (bytes(payload), {**meta, "bits": 5}, (n,)),
        (bytes(payload), {**meta, "bits": True}, (n,)),
        (bytes(payload), {**meta, "numel": n + 1}, (n,)),
    ]
    neg = bytearray(payload)
    neg[0:2] = _bf16_bytes(-1.0)  # negative scale
    nan = bytearray(payload)
    nan[2:4] = _bf16_bytes(float("nan"))
    inf = bytearray(payload)
    inf[4:6] = _bf16_bytes(float("inf"))
    tail = bytearray(payload)
    tail[-1] |= 0x80  # 3 x 41 entries of 14 bits end 6 bits into the last byte: its top bit set
    # the first word's index (12 low bits of the stream) set to 4095, above the second's
    desc = bytearray(payload)
    desc[2 * nc] = 0xFF
    desc[2 * nc + 1] |= 0x0F
    bad += [(bytes(p), meta, (n,)) for p in (neg, nan, inf, tail, desc)]
    for p, m, shape in bad:
        with pytest.raises(CodecError):
            decode(p, m, shape)
    assert torch.equal(decode(bytes(payload), meta, (n,)), good)


def test_index_past_a_short_last_chunk_is_refused():
    # One short chunk of 100 elements keeping 41: its last index set to 4095 (past the end)
    # keeps the order ascending, so only the range check can catch it.
    x = _rand(100, seed=1)
    payload, meta = encode(x, "sparse")
    bits = np.unpackbits(np.frombuffer(payload[2:], dtype=np.uint8), bitorder="little")
    w = 14
    bits[40 * w: 40 * w + 12] = 1
    forged = payload[:2] + np.packbits(bits, bitorder="little").tobytes()
    with pytest.raises(CodecError, match="past the tensor's end"):
        decode(forged, meta, (100,))


def test_bad_specs_and_inputs():
    for codec in ("sparse:0", "sparse:1.5", "sparse:0.01:5", "sparse:0.01:2:1", "sparse:x"):
        with pytest.raises(CodecError):
            encode(torch.ones(10), codec)
    with pytest.raises(NonFiniteError):
        encode(torch.tensor([1.0, float("nan")]), "sparse")
    with pytest.raises(CodecError, match="bf16 range"):
        encode(torch.full((10,), 3.4e38), "sparse")


def test_tiny_values_keep_their_scale():
    """A late round's pseudo-gradient can lie far below fp16's range (6e-8 is its smallest
    subnormal): its chunk scale must not flush to zero, so the kept entries decode near their
    values."""
    torch.manual_seed(0)
    x = torch.randn(8192) * 1e-9
    payload, meta = encode(x, "sparse:0.01:2")
    y = decode(payload, meta, (8192,))
    kept = y != 0
    assert int(kept.sum()) == 2 * 41
    rel = ((y[kept] - x[kept]).abs() / x[kept].abs()).max()
    assert float(rel) < 0.5, rel  # 2-bit levels: each kept entry within half of its magnitude
    assert torch.equal(torch.sign(y[kept]), torch.sign(x[kept]))
