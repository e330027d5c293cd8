"""Wire codecs: round trips, error bounds, malformed payloads, error feedback."""

import numpy as np
import pytest
import torch

from shoal.net.compress import (
    CODECS,
    CodecError,
    CompressionConfig,
    ErrorFeedback,
    NonFiniteError,
    WireCounter,
    decode,
    encode,
    encoded_nbytes,
    roundtrip,
    wire_fraction,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 127, 128, 129, 1000]


def _rand(n, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_raw_is_lossless(dtype, n):
    x = _rand(n, dtype)
    y, nbytes = roundtrip(x, "raw")
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, x)
    assert nbytes == 4 * n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_fp16_relative_error(dtype, n):
    x = _rand(n, dtype)
    y, nbytes = roundtrip(x, "fp16")
    assert y.dtype == dtype and nbytes == 2 * n
    xf, yf = x.float(), y.float()
    # fp16 keeps 11 significant bits; a bf16 result rounds again (8 bits)
    tol = 2.0**-11 if dtype != torch.bfloat16 else 2.0**-8 + 2.0**-11
    assert ((yf - xf).abs() <= tol * xf.abs() + 1e-7).all()
    if dtype == torch.float16:
        assert torch.equal(x, y)  # fp16 input is carried exactly


def _int8_bound(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element bound scale/2 of each element's block (plus float32 rounding)."""
    xf = x.float().reshape(-1)
    n = xf.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block)
    padded[:n] = xf.abs()
    scale = padded.reshape(nb, block).amax(dim=1) / 127
    per = scale.repeat_interleave(block)[:n]
    return per / 2 * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", [64, 128, 256])
def test_int8_error_within_half_scale(dtype, n, block):
    x = _rand(n, dtype, seed=n + block)
    payload, meta = encode(x, "int8", block=block)
    assert len(payload) == encoded_nbytes("int8", n, block) == n + 4 * (-(-n // block))
    y = decode(payload, meta, x.shape, torch.float32)
    err = (y - x.float()).reshape(-1).abs()
    assert (err <= _int8_bound(x, block)).all()
    # decoding to the input dtype gives the same values up to that dtype's rounding
    y2 = decode(payload, meta, x.shape, dtype)
    assert y2.dtype == dtype
    assert torch.equal(y2, y.to(dtype))


def test_int8_large_odd_size_and_ratio():
    n = 1_000_003  # not divisible by any block size
    x = _rand(n, torch.float32, seed=5)
    for block in (64, 128, 256):
        payload, meta = encode(x, "int8", block=block)
        y = decode(payload, meta, (n,))
        assert ((y - x).abs() <= _int8_bound(x, block)).all()
        raw = len(encode(x, "raw")[0])
        assert raw / len(payload) >= 3.5, (block, raw / len(payload))


def test_int8_blocks_are_independent():
    # a huge value in one block must not wreck the precision of the next block
    x = torch.cat([torch.full((128,), 1000.0), torch.linspace(-1, 1, 128)])
    y, _ = roundtrip(x, "int8", block=128)
    assert (y[128:] - x[128:]).abs().max() <= 1 / 127 / 2 * 1.0001


@pytest.mark.parametrize("codec", CODECS)
def test_zeros_and_negatives(codec):
    z = torch.zeros(300)
    y, _ = roundtrip(z, codec)
    assert torch.equal(y, z)
    x = -torch.arange(1, 301, dtype=torch.float32) / 7
    y, _ = roundtrip(x, codec)
    assert (y < 0).all()
    # symmetric quantisation: encoding -x gives exactly minus the decode of x
    y_neg, _ = roundtrip(-x, codec)
    assert torch.equal(y_neg, -y)


@pytest.mark.parametrize("codec", CODECS)
def test_multidim_and_scalar_shapes(codec):
    x = _rand(2 * 3 * 5, torch.float32).reshape(2, 3, 5)
    y, _ = roundtrip(x, codec)
    assert y.shape == (2, 3, 5)
    s = torch.tensor(2.5)
    y, _ = roundtrip(s, codec)
    assert y.shape == () and abs(float(y) - 2.5) < 0.01
    e = torch.zeros(0, 4)
    y, n = roundtrip(e, codec)
    assert y.shape == (0, 4) and n == 0


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_rejected(codec, bad):
    x = torch.ones(10)
    x[3] = bad
    with pytest.raises(NonFiniteError, match="non-finite"):
        encode(x, codec)


def test_fp16_overflow_rejected_int8_accepts():
    x = torch.tensor([1.0, 1e6])
    with pytest.raises(CodecError, match="fp16 range"):
        encode(x, "fp16")
    y, _ = roundtrip(x, "int8")
    assert abs(float(y[1]) - 1e6) <= 1e6 / 254 * 1.0001


def test_bad_inputs_are_clear_errors():
    with pytest.raises(CodecError, match="unknown codec"):
        encode(torch.ones(3), "zstd")
    with pytest.raises(CodecError, match="unsupported dtype"):
        encode(torch.ones(3, dtype=torch.int64), "raw")
    with pytest.raises(CodecError, match="block"):
        encode(torch.ones(3), "int8", block=0)


@pytest.mark.parametrize("codec", CODECS)
def test_decode_rejects_mismatched_payloads(codec):
    x = _rand(100, torch.float32)
    payload, meta = encode(x, codec)
    with pytest.raises(CodecError, match="bytes"):
        decode(payload[:-1], meta, (100,))
    with pytest.raises(CodecError):
        decode(payload, meta, (101,))
    with pytest.raises(CodecError):
        decode(payload, {**meta, "codec": "pickle"}, (100,))
    with pytest.raises(CodecError):
        decode(payload, "not a dict", (100,))


def test_decode_rejects_bad_int8_scale():
    payload, meta = encode(torch.ones(10), "int8", block=8)
    bad = bytearray(payload)
    bad[0:4] = np.array([np.nan], dtype="<f4").tobytes()
    with pytest.raises(CodecError, match="scale"):
        decode(bytes(bad), meta, (10,))


def test_numpy_input():
    a = np.linspace(-2, 2, 50, dtype=np.float32)
    payload, meta = encode(a, "fp16")
    y = decode(payload, meta, (50,))
    assert np.allclose(y.numpy(), a, rtol=2**-11, atol=1e-7)


def test_error_feedback_keeps_sum_of_sent_close_to_sum_of_true():
    torch.manual_seed(0)
    ef = ErrorFeedback("int8", block=64)
    true_sum = torch.zeros(1000)
    sent_sum = torch.zeros(1000)
    plain_sum = torch.zeros(1000)
    g = torch.randn(1000) * 1e-3
    for step in range(50):
        # a small constant component under a big per-block maximum is lost by plain rounding
        x = g.clone()
        x[::64] = 1.0 * (1 if step % 2 else -1)
        true_sum += x
        payload, meta = ef.encode("w", x)
        sent_sum += decode(payload, meta, x.shape)
        plain, _ = roundtrip(x, "int8", block=64)
        plain_sum += plain
    ef_err = (sent_sum - true_sum).abs().max().item()
    plain_err = (plain_sum - true_sum).abs().max().item()
    # with feedback, the accumulated error stays within one step's quantisation error
    assert ef_err <= 1 / 127 / 2 * 1.001 + 1e-6
    assert plain_err > 5 * ef_err
    r = ef.residual("w")
    assert r is not None and r.abs().max() <= 1 / 127 / 2 * 1.001
    ef.reset("w")
    assert ef.residual("w") is None


def test_error_feedback_shape_change_restarts():
    ef = ErrorFeedback("fp16")
    ef.encode("a", torch.full((4,), 1 / 3))
    payload, meta = ef.encode("a", torch.ones(6))
    assert decode(payload, meta, (6,)).shape == (6,)


def test_wire_fraction_and_config():
    assert wire_fraction("raw") == 1.0 and wire_fraction("fp16") == 0.5
    assert wire_fraction("int8", 128) == pytest.approx((1 + 4 / 128) / 4)
    cfg = CompressionConfig(activations="int8", act_grads="int8", grad_push="fp16", weight_pull="fp16")
    act, grad = cfg.sync_fractions()
    assert act < 1 / 3.5 and grad == 0.5
    assert cfg.codec_for("activations") == "int8"
    with pytest.raises(CodecError):
        CompressionConfig(activations="gzip")


def test_wire_counter():
    wc = WireCounter()
    x = torch.ones(1000)
    for codec in ("raw", "int8"):
        payload, _ = encode(x, codec)
        wc.add(f"act-{codec}", x.numel(), len(payload))
    d = wc.as_dict()
    assert d["act-raw"]["raw"] == d["act-raw"]["wire"] == 4000
    assert d["act-int8"]["wire"] == 1000 + 4 * 8
    assert d["act-int8"]["ratio"] > 3.5
