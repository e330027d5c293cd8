"""The activation codec ``quad-pc`` (channel means, four principal directions with each row's
coefficients, then ``quad`` of the rest): round trips in every dtype and shape, its error against
``oct`` on Gaussian tensors and on tensors with channel offsets and a few dominant directions (as a
transformer's residual stream has), its size equal to the planner's ``act_nbytes`` at the
tensor's channel count, malformed payloads refused in one line, and its place in the spec."""

import json
import math

import numpy as np
import pytest
import torch
from helpers.tensors import seeded_randn as _rand

from shoal.errors import ShoalError
from shoal.net.compress import (
    CodecError,
    channel_count,
    decode,
    encode,
    encoded_nbytes,
    wire_fraction,
)
from shoal.net.wire import WireError, decode_tensor, encode_tensor
from shoal.plan.compression import act_nbytes, bytes_per_element, parse_codec, parse_compression


def _rel_err(codec: str, x: torch.Tensor) -> float:
    """Squared error of a round trip over the tensor's energy."""
    p, meta = encode(x, codec)
    return float((decode(p, meta, x.shape) - x).square().sum() / x.square().sum())


def _by_hand(shape) -> int:
    """Means, min(4, C) directions of C, 4 coefficients a row (bf16), then quad (34 bytes a block)."""
    n = math.prod(shape)
    if n == 0:
        return 0
    c = shape[-1] if len(shape) >= 2 else 1
    k = min(4, c)
    return 2 * c + 2 * k * c + 2 * k * (n // c) + 34 * math.ceil(n / 128)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (0, 128), (3, 100), (2, 4, 128), (8, 128, 128),
                                   (7, 33, 256), (129, 1), (10, 3)])
def test_bytes_equal_act_nbytes_at_the_channel_count(shape):
    x = _rand(*shape, seed=len(shape))
    n = x.numel()
    c = shape[-1] if len(shape) >= 2 and shape[-1] else 1
    assert channel_count(shape) == c
    payload, meta = encode(x, "quad-pc")
    assert meta == {"codec": "quad-pc", "numel": n}
    assert len(payload) == _by_hand(shape) == encoded_nbytes("quad-pc", n, channels=c) == act_nbytes("quad-pc", n, c)
    y = decode(payload, meta, shape)
    assert y.shape == x.shape and y.dtype == torch.float32
    if n:  # few channels: the directions span them, so the rest is (nearly) nothing
        assert float((y - x).square().sum()) <= 0.12 * float(x.square().sum()) + 1e-12


@pytest.mark.timeout(60)
def test_the_planners_rate_and_the_pair_with_tern_dither():
    # the planner charges quad and a 128-channel tensor's coefficients (4 bf16 a row of 128)
    assert bytes_per_element("quad-pc", 2) == pytest.approx((34 + 8) / 128)
    assert wire_fraction("quad-pc") == pytest.approx((34 + 8) / 128 / 4)
    # the bench's shape (B 8, T 128, d 128): 1,024 rows; with tern-dither back 3.52 bits, 9.1x below bf16
    n = 8 * 128 * 128
    fwd = 8 * act_nbytes("quad-pc", n, 128) / n
    assert fwd == pytest.approx(2.125 + 16 / 1024 + 64 / 1024 + 64 / 128)
    bits = fwd + 8 * act_nbytes("tern-dither", n) / n
    assert bits == pytest.approx(3.516, abs=1e-3) and 2 * 16 / bits == pytest.approx(9.10, abs=0.01)
    # on few rows the per-tensor part costs more: B 2, T 32 of 128 channels is 4.69 bits (6.8x)
    n = 2 * 32 * 128
    assert 8 * (act_nbytes("quad-pc", n, 128) + act_nbytes("tern-dither", n)) / n == pytest.approx(4.69, abs=0.01)
    # wide tensors: C 768, 8,192 rows: 2.22 bits
    assert 8 * act_nbytes("quad-pc", 768 * 8192, 768) / (768 * 8192) == pytest.approx(2.218, abs=1e-3)
    with pytest.raises(CodecError, match="pass channels"):
        encoded_nbytes("quad-pc", 1024)
    with pytest.raises(CodecError, match="do not divide"):
        encoded_nbytes("quad-pc", 1000, channels=128)
    with pytest.raises(ShoalError, match="do not divide"):
        act_nbytes("quad-pc", 1000, 3)


@pytest.mark.timeout(120)
def test_planner_and_simulator_charge_quad_pc_at_the_models_width():
    # gpt-350m (width 1,024, T 1,024, B 1): a row's 4 coefficients cost 8 bytes per 1,024
    # channels, not per 128 as on tiny. Only act and grad change between the runs, so the bytes
    # saved against the uncompressed run are in the ratio of the codecs' savings per element,
    # and those are the encoder's bytes at the activation's real shape.
    from helpers.scenarios import act_codec_link_bytes

    from shoal.model.config import get_preset
    from shoal.plan import load_scenario, make_plan
    from shoal.plan.compression import wire_ratio

    s = load_scenario("hetero-compute")
    p = make_plan(s, stages=2)
    db, width = s.workload.dtype_bytes, get_preset(s.workload.model).d_model
    rows = s.workload.seq_len * p.micro_batch_size
    assert width == 1024 and rows == 1024
    total = act_codec_link_bytes(p, s, ("none", "int8", "quad-pc"))
    real = act_nbytes("quad-pc", rows * width, width) / (rows * width * db)
    assert wire_ratio("quad-pc", db, rows, width) == pytest.approx(real)
    saved = (total["none"] - total["quad-pc"]) / (total["none"] - total["int8"])
    assert saved == pytest.approx((1 - real) / (1 - wire_ratio("int8", db)), rel=0.01)
    # the 128-channel rate would have charged 16 % more per element here
    assert wire_ratio("quad-pc", db) / real == pytest.approx(1.16, abs=0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_dtypes_zeros_constants_and_determinism(dtype):
    x = (_rand(4, 64, 128, seed=3) * 3 + 1).to(dtype)
    p, meta = encode(x, "quad-pc")
    y = decode(p, meta, x.shape, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert encode(x, "quad-pc")[0] == p  # no draws: the same tensor makes the same payload
    assert float((y.float() - x.float()).square().sum() / x.float().square().sum()) < 0.12
    z = torch.zeros(3, 256)
    p, meta = encode(z, "quad-pc")
    assert torch.equal(decode(p, meta, z.shape), z)
    # channels constant over the rows (bf16-exact values): the means carry them, exactly
    c = torch.arange(128, dtype=torch.float32).repeat(16, 1) / 4 - 8
    p, meta = encode(c, "quad-pc")
    assert torch.equal(decode(p, meta, c.shape), c)


@pytest.mark.timeout(60)
def test_error_on_gaussian_and_on_offsets_and_dominant_directions():
    # Gaussian rows with no structure: quad's error (0.117) plus a little, oct's is 0.0345
    x = _rand(16, 128, 128, seed=5)
    assert 0.10 < _rel_err("quad-pc", x) < 0.12
    # channel offsets holding half the energy: the means take them, the error halves
    off = _rand(128, seed=6)
    y = x + off
    share = float(off.square().sum() * 16 * 128 / y.square().sum())
    assert 0.4 < share < 0.6
    assert _rel_err("quad-pc", y) == pytest.approx(0.115 * (1 - share), rel=0.1)
    # a residual stream's shape: offsets, four dominant directions (99 % of the centred energy) and
    # a small isotropic rest: quad-pc's error is under a tenth of oct's, at 2.70 bits against 3.125
    g = torch.Generator().manual_seed(7)
    dirs = torch.linalg.qr(torch.randn(128, 4, generator=g)).Q.T
    rows = (torch.randn(1024, 4, generator=g) * torch.tensor([40.0, 25.0, 15.0, 10.0])) @ dirs
    z = (rows + torch.randn(1024, 128, generator=g) * 0.3 + 5 * off).view(8, 128, 128)
    e_oct, e_pc = _rel_err("oct", z), _rel_err("quad-pc", z)
    assert 0.03 < e_oct < 0.04 and e_pc < 0.1 * e_oct
    assert len(encode(z, "quad-pc")[0]) * 8 / z.numel() == pytest.approx(2.703, abs=1e-3)
    # a vector is one channel: its mean removed, each element its own coefficient in bf16
    v = _rand(4096, seed=8) + 3
    assert _rel_err("quad-pc", v) < 1e-3


@pytest.mark.timeout(60)
def test_malformed_payloads_are_one_line_codec_errors():
    x = _rand(3, 256, seed=8) + 1
    p, meta = encode(x, "quad-pc")
    size = 2 * 256 + 2 * 4 * 256 + 2 * 4 * 3 + 34 * 6
    assert len(p) == size
    with pytest.raises(CodecError, match=f"must be {size} bytes"):
        decode(p[:-1], meta, x.shape)
    with pytest.raises(CodecError, match="must be"):
        decode(p + b"\x00", meta, x.shape)
    with pytest.raises(CodecError, match="must be"):  # another channel count: another size
        decode(p, {"codec": "quad-pc", "numel": 768}, (6, 128))
    with pytest.raises(CodecError, match="holds 768 elements"):
        decode(p, meta, (4, 256))
    for at in (10, 2 * 256 + 40, 2 * (256 + 4 * 256) + 2):  # a mean, a direction, a coefficient
        for bad in (b"\x80\x7f", b"\xc0\x7f", b"\x80\xff"):  # inf, NaN, -inf in bf16
            with pytest.raises(CodecError, match="non-finite channel mean, direction or coefficient") as e:
                decode(p[:at] + bad + p[at + 2:], meta, x.shape)
            assert "\n" not in str(e.value)
    at = 2 * (256 + 4 * 256 + 4 * 3)  # the first quad block scale
    for scale in (b"\x80\xbf", b"\x80\x7f"):  # -1.0, inf
        with pytest.raises(CodecError, match="negative or non-finite block scale"):
            decode(p[:at] + scale + p[at + 2:], meta, x.shape)
    big = b"\x70\x7f"  # 3.2e38 in bf16: a coefficient times a direction of the same overflows
    q = p[:2 * 256] + big + p[2 * 256 + 2:2 * (256 + 4 * 256)] + big + p[2 * (256 + 4 * 256) + 2:]
    with pytest.raises(CodecError, match="beyond the float32 range"):
        decode(q, meta, x.shape)
    with pytest.raises(CodecError, match="non-finite"):
        encode(torch.tensor([[1.0, float("nan")]]), "quad-pc")
    # random bytes of the right length: decoded, or refused in one line
    rng = np.random.default_rng(0)
    n = encoded_nbytes("quad-pc", 1024, channels=128)
    for _ in range(20):
        try:
            out = decode(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), {"codec": "quad-pc", "numel": 1024}, (8, 128))
        except CodecError as e:
            assert ("non-finite" in str(e) or "float32 range" in str(e)) and "\n" not in str(e)
        else:
            assert out.shape == (8, 128) and bool(torch.isfinite(out).all())
    # in a wire frame: the receiver's shape gives the channel count; a cut frame is a WireError
    t = _rand(4, 128, seed=9)
    frame = encode_tensor("out", t, "quad-pc")
    assert frame.codec == "quad-pc" and json.loads(frame.meta) == {"codec": "quad-pc", "numel": 512}
    assert decode_tensor(frame, shape=(4, 128), dtype="float32").shape == (4, 128)
    frame.data = frame.data[:-1]
    with pytest.raises(WireError, match="'out': bad quad-pc payload"):
        decode_tensor(frame, shape=(4, 128), dtype="float32")


@pytest.mark.timeout(60)
def test_spec_allows_quad_pc_for_activations_and_their_gradients_only():
    assert parse_codec("quad-pc", "act") == "quad-pc" and parse_codec("quad-pc", "grad") == "quad-pc"
    for kind in ("push", "pull"):
        with pytest.raises(ShoalError, match="activations"):
            parse_codec("quad-pc", kind)
    with pytest.raises(ShoalError, match="takes no arguments"):
        parse_codec("quad-pc:2", "act")
    spec = parse_compression("act=quad-pc,grad=tern-dither")
    assert (spec["act"], spec["grad"], spec["push"], spec["pull"]) == ("quad-pc", "tern-dither", "none", "none")
