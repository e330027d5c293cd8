"""The activation codecs (``tern``, rotated blockwise ternary, and its relatives ``tern-sr``,
``quad``, ``oct`` and ``tern-dither``): sizes equal to the planner's, hand-built blocks, their error
on Gaussian and outlier-heavy tensors, unbiasedness of the stochastic ones, malformed and random
payloads, and their place in the compression spec."""

import json
import math

import numpy as np
import pytest
import torch
from helpers.tensors import seeded_randn as _rand

from shoal.errors import ShoalError
from shoal.net.compress import (
    TD_KEPT,
    TERN_BLOCK,
    CodecError,
    NonFiniteError,
    _fwht,
    _td_positions,
    _tern_signs,
    decode,
    encode,
    encoded_nbytes,
    sr_key,
    wire_fraction,
)
from shoal.net.wire import WireError, decode_tensor, encode_tensor
from shoal.plan.compression import (
    TD_SEED_BYTES,
    act_nbytes,
    bytes_per_element,
    parse_codec,
    parse_compression,
    tern_nbytes,
)


def _by_hand_nbytes(n: int) -> int:
    blocks = math.ceil(n / 128)
    return 2 * blocks + math.ceil(128 * blocks / 5)  # fp16 levels, then five digits a byte


@pytest.mark.parametrize("n", [0, 1, 5, 127, 128, 129, 640, 1000, 4096, 3 * 128 * 5 + 7])
def test_bytes_of_any_length(n):
    payload, meta = encode(_rand(n, seed=n), "tern")
    assert meta == {"codec": "tern", "numel": n}
    assert len(payload) == _by_hand_nbytes(n) == encoded_nbytes("tern", n) == tern_nbytes(n)
    assert decode(payload, meta, (n,)).shape == (n,)


def test_bytes_equal_the_planners_rate_and_beat_bf16_8x():
    n = 5 * 128 * 40  # whole bytes of digits: the planner's per-element size times n exactly
    payload, _ = encode(_rand(n), "tern")
    assert len(payload) == bytes_per_element("tern", 2) * n
    assert wire_fraction("tern") * 4 == pytest.approx(bytes_per_element("tern", 2))
    assert 8 * len(payload) / n == pytest.approx(1.725)  # bits per element, scales included
    assert 2 * n / len(payload) == pytest.approx(9.275, abs=0.001)  # >= 8x fewer bytes than bf16
    # an activation-shaped tensor (B, T, d) of any d: still >= 8x against bf16
    for d in (96, 128, 200, 768):
        x = _rand(4, 16, d).to(torch.bfloat16)
        assert 2 * x.numel() / len(encode(x, "tern")[0]) >= 8.0


def test_rotation_is_orthonormal_and_fixed():
    eye = torch.eye(TERN_BLOCK)
    h = _fwht(eye)
    assert torch.allclose(h @ h, eye, atol=1e-6)  # its own inverse
    assert torch.allclose(h.abs(), torch.full_like(h, TERN_BLOCK ** -0.5))
    s = _tern_signs()
    assert set(s.tolist()) == {-1.0, 1.0} and torch.equal(s, _tern_signs())
    # the signs are no Walsh function: a constant block is spread over many coordinates
    assert _fwht((s * torch.ones(TERN_BLOCK))[None]).abs().max() < 0.3 * math.sqrt(TERN_BLOCK)


def test_a_block_that_is_ternary_after_rotation_by_hand():
    # x = D H (2 t): its rotation is 2 t exactly, so its digits are t and its level 2.0 (0x4000 in
    # bf16), and it decodes back to x.
    t = torch.zeros(TERN_BLOCK)
    t[[0, 6, 7, 100]] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    x = (_fwht((2.0 * t)[None]) * _tern_signs()).reshape(-1)
    payload, meta = encode(x, "tern")
    assert payload[:2] == b"\x00\x40"
    digits = np.zeros(130, dtype=np.int64)  # 0: zero, 1: +a, 2: -a; 128 digits + 2 padding
    digits[[0, 7]] = 1
    digits[[6, 100]] = 2
    expected = (digits.reshape(-1, 5) * np.array([1, 3, 9, 27, 81])).sum(axis=1).astype(np.uint8)
    assert payload[2:] == expected.tobytes()
    assert torch.allclose(decode(payload, meta, x.shape), x, atol=1e-6)


def test_error_on_gaussian_and_outlier_heavy_activations():
    # A Gaussian block keeps about 0.44 of its norm as error (the ternary quantiser's); an
    # activation with a few huge channels does no worse, because the rotation spreads them.
    x = _rand(8, 32, 128)
    y = decode(*encode(x, "tern"), x.shape)
    rel = float((y - x).norm() / x.norm())
    assert 0.40 < rel < 0.47, rel
    act = _rand(8, 32, 128, seed=1)
    act[..., 5] *= 60.0
    act[..., 77] -= 30.0
    y = decode(*encode(act, "tern"), act.shape)
    assert float((y - act).norm() / act.norm()) < 0.47
    # the per-block level follows each token's scale: a tiny token is not zeroed by a large one,
    # nor is a gradient far below fp16's range (its levels are bf16)
    x = torch.cat([_rand(1, 128) * 1e-3, _rand(1, 128, seed=2) * 1e3, _rand(1, 128, seed=3) * 1e-9])
    y = decode(*encode(x, "tern"), x.shape)
    for i in range(3):
        assert float((y[i] - x[i]).norm() / x[i].norm()) < 0.47


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_shapes_zeros_and_determinism(dtype):
    x = _rand(3, 7, 50).to(dtype)
    p1, m1 = encode(x, "tern")
    p2, _ = encode(x.clone(), "tern")
    assert p1 == p2  # same tensor, same bytes
    y = decode(p1, m1, x.shape, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, decode(p1, m1, x.shape, dtype))
    z = torch.zeros(2, 130, dtype=dtype)
    assert torch.equal(decode(*encode(z, "tern"), z.shape, dtype), z)
    s = torch.tensor(-3.0, dtype=dtype)  # a scalar: one padded block
    assert decode(*encode(s, "tern"), ()).shape == ()


def test_bad_inputs_are_clear_errors():
    with pytest.raises(NonFiniteError):
        encode(torch.tensor([1.0, float("nan")]), "tern")
    with pytest.raises(CodecError, match="bf16 range of a block level"):
        encode(torch.full((128,), 3e38), "tern")
    with pytest.raises(CodecError, match="only topk-int8, sparse and lowrank take"):
        encode(torch.ones(3), "tern:2")


def _payload(n=300, seed=0):
    x = _rand(n, seed=seed)
    return bytearray(encode(x, "tern")[0]), {"codec": "tern", "numel": n}


def test_malformed_payloads_are_codec_errors():
    p, meta = _payload()
    nb = 3
    with pytest.raises(CodecError, match="must be"):
        decode(bytes(p[:-1]), meta, (300,))
    with pytest.raises(CodecError, match="must be"):
        decode(bytes(p) + b"\x00", meta, (300,))
    with pytest.raises(CodecError, match="elements"):
        decode(bytes(p), meta, (301,))
    bad = bytearray(p)
    bad[2 * nb + 4] = 243  # five ternary digits never make 243 or more
    with pytest.raises(CodecError, match="243"):
        decode(bytes(bad), meta, (300,))
    bad = bytearray(p)
    bad[-1] = 81  # the last byte holds 384 - 383 = 1 digit; its four padding digits must be 0
    with pytest.raises(CodecError, match="past its last block"):
        decode(bytes(bad), meta, (300,))
    for level in (b"\x80\xbf", b"\x80\x7f", b"\xc0\x7f"):  # -1.0, inf, NaN in bf16
        bad = bytearray(p)
        bad[2:4] = level
        with pytest.raises(CodecError, match="level"):
            decode(bytes(bad), meta, (300,))
    # through the frame layer: a one-line WireError naming the tensor
    frame = encode_tensor("out", _rand(4, 128), "tern")
    assert frame.codec == "tern" and json.loads(frame.meta) == {"codec": "tern", "numel": 512}
    frame.data = frame.data[:-1]
    with pytest.raises(WireError, match="'out': bad tern payload"):
        decode_tensor(frame, shape=(4, 128), dtype="float32")


def test_random_payloads_decode_or_raise_codec_error():
    # Fuzz: bytes of the right length but random content decode to finite values or raise
    # CodecError, never anything else; random lengths always raise CodecError.
    rng = np.random.default_rng(0)
    n = 700
    size = encoded_nbytes("tern", n)
    decoded = 0
    for _ in range(300):
        buf = rng.integers(0, 256, size, dtype=np.uint8)
        if rng.random() < 0.5:  # plausible levels and digits, so some decode
            buf[:12] = np.frombuffer(torch.rand(6).to(torch.bfloat16).view(torch.int16).numpy().tobytes(), np.uint8)
            buf[12:] = rng.integers(0, 243, size - 12)
            buf[-1] = rng.integers(0, 3)
        try:
            y = decode(buf.tobytes(), {"codec": "tern", "numel": n}, (n,))
        except CodecError:
            continue
        assert torch.isfinite(y).all()
        decoded += 1
    assert decoded > 50
    for length in rng.integers(0, 2 * size, 50):
        if length != size:
            with pytest.raises(CodecError):
                decode(rng.integers(0, 256, length, dtype=np.uint8).tobytes(), {"codec": "tern", "numel": n}, (n,))


def test_spec_allows_tern_for_activations_only():
    assert parse_codec("tern", "act") == "tern" and parse_codec("tern", "grad") == "tern"
    for kind in ("push", "pull"):
        with pytest.raises(ShoalError, match="activations"):
            parse_codec("tern", kind)
    with pytest.raises(ShoalError, match="no arguments"):
        parse_codec("tern:4", "act")
    assert parse_compression("tern") == {"act": "tern", "grad": "tern", "push": "none", "pull": "none"}
    assert parse_compression("act=tern,grad=int8,push=sparse,pull=sparse")["act"] == "tern"
    with pytest.raises(ShoalError):
        parse_compression("push=tern")
    assert bytes_per_element("tern", 2) == pytest.approx((2 + 128 / 5) / 128)


@pytest.mark.timeout(120)
def test_planner_and_simulator_charge_tern_activation_bytes():
    # Only act and grad change between the three runs, so the bytes they save against the
    # uncompressed run are in the ratio of the codecs' savings per element.
    from helpers.scenarios import act_codec_link_bytes

    from shoal.plan import load_scenario, make_plan
    from shoal.plan.compression import wire_ratio

    s = load_scenario("hetero-compute")
    p = make_plan(s, stages=2)
    db = s.workload.dtype_bytes
    total = act_codec_link_bytes(p, s, ("none", "int8", "tern"))
    saved = (total["none"] - total["tern"]) / (total["none"] - total["int8"])
    assert saved == pytest.approx((1 - wire_ratio("tern", db)) / (1 - wire_ratio("int8", db)), rel=0.01)
    assert wire_ratio("tern", 2) <= 1 / 8


def test_run_spec_carries_tern_and_launch_refuses_it_on_pushes(tmp_path, capsys):
    from shoal.cli import main
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.sync.codecs import compression_of_spec, parse_run_compression

    comp = parse_run_compression("tern")
    assert (comp.act, comp.grad, comp.push, comp.pull) == ("tern", "tern", "none", "none")
    spec = pb.RunSpec()
    comp.to_spec(spec)
    assert compression_of_spec(spec) == comp and comp.wire("act") == "tern" and comp.wire("push") == "raw"
    assert main(["launch", "--out", str(tmp_path / "r"), "--compression", "push=tern"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "activations" in err and err.count("\n") == 1


# ---------------------------------------------------------------- tern-sr and quad

def _rotated_back(r: torch.Tensor) -> torch.Tensor:
    """The tensor whose rotated blocks are the rows of ``r``."""
    return (_fwht(r) * _tern_signs()).reshape(-1)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 3 * 128 * 5 + 7])
def test_tern_sr_and_quad_bytes_of_any_length(n):
    x = _rand(n, seed=n)
    for codec, by_hand in (("tern-sr", _by_hand_nbytes(n)), ("quad", 34 * math.ceil(n / 128))):
        payload, meta = encode(x, codec, key=7)
        assert meta == {"codec": codec, "numel": n}
        assert len(payload) == by_hand == encoded_nbytes(codec, n) == act_nbytes(codec, n)
        assert decode(payload, meta, (n,)).shape == (n,)
    # the planner's rates; quad forward with tern-sr back: >= 8x fewer bytes than bf16 both ways
    assert bytes_per_element("tern-sr", 2) == bytes_per_element("tern", 2)
    assert bytes_per_element("quad", 2) == pytest.approx(34 / 128)
    assert 2 * 2 / (bytes_per_element("quad", 2) + bytes_per_element("tern-sr", 2)) == pytest.approx(8.31, abs=0.01)


def test_tern_sr_block_by_hand():
    # Rotated block r = (2, -1, 0.5, 0, ...): the level is max|r| = 2 (0x4000 in bf16); coordinate 0
    # is always +2, coordinate 1 is -2 half the time, coordinate 2 is +2 a quarter of the time,
    # the rest always 0.
    r = torch.zeros(1, TERN_BLOCK)
    r[0, :3] = torch.tensor([2.0, -1.0, 0.5])
    x = _rotated_back(r)
    seen = np.zeros((3, 3))  # coordinate -> count of digits 0, 1 (+a), 2 (-a)
    keys = 2000
    for k in range(keys):
        payload, _ = encode(x, "tern-sr", key=k)
        assert payload[:2] == b"\x00\x40"
        b = np.frombuffer(payload[2:], dtype=np.uint8).astype(np.int64)
        digits = np.stack([(b // 3 ** j) % 3 for j in range(5)], axis=1).reshape(-1)
        assert not digits[3:].any()
        for i in range(3):
            seen[i, digits[i]] += 1
    assert seen[0, 1] == keys
    assert seen[1, 1] == 0 and abs(seen[1, 2] / keys - 0.5) < 0.05
    assert seen[2, 2] == 0 and abs(seen[2, 1] / keys - 0.25) < 0.05


def _mean_of_decodes(codec: str, keys: int = 1500):
    """Three blocks (one large, one 1e-3 as small: its own level, one with an outlier), the mean
    of ``keys`` decodes of them under ``codec`` (key 0 .. keys-1) and their rotated coordinates."""
    x = _rand(3, 128, seed=4)
    x[1] *= 1e-3
    x[2, 9] = 40.0
    mean = sum(decode(*encode(x, codec, key=k), x.shape) for k in range(keys)) / keys
    return x, keys, mean, _fwht(x * _tern_signs())


def test_tern_sr_is_unbiased_and_tern_is_not():
    # The mean of K decodes (K keys) is x within 5 standard deviations of the mean, element by
    # element. Rounding r_j to 0 or a at random has variance |r_j| (a - |r_j|), and the rotation
    # spreads each block's sum of them evenly over its 128 elements. Deterministic tern fails it.
    x, keys, mean, r = _mean_of_decodes("tern-sr")
    a = r.abs().amax(dim=1, keepdim=True)
    sd = ((r.abs() * (a - r.abs())).sum(dim=1, keepdim=True) / TERN_BLOCK / keys).sqrt()
    assert ((mean - x).abs() <= 5 * sd).all()
    det = decode(*encode(x, "tern"), x.shape)
    assert ((det - x).abs() > 5 * sd).float().mean() > 0.5


def test_tern_sr_rounding_is_fixed_by_key_and_tensor():
    x = _rand(4, 256)
    p, _ = encode(x, "tern-sr", key=3)
    assert encode(x.clone(), "tern-sr", key=3)[0] == p  # a retried task sends the same bytes
    assert encode(x, "tern-sr", key=4)[0] != p
    y = x.clone()
    y[0, 0] += 1e-3
    assert encode(y, "tern-sr", key=3)[0][2 * 8:] != p[2 * 8:]  # another tensor, other draws
    # the worker's key: one per (run seed, stage, step, micro-batch, direction)
    keys = {sr_key(0, s, t, m, d) for s in range(2) for t in range(3) for m in range(4) for d in range(3)}
    assert len(keys) == 2 * 3 * 4 * 3 and sr_key(1, 0, 0, 0, 0) != sr_key(0, 0, 0, 0, 0)
    assert all(0 <= k < 2 ** 64 for k in keys)


def test_quad_block_by_hand_and_its_error():
    # Rotated block r = 2 (c_0 ... c_127) with every c a quad level: codes read back exactly, the
    # scale is 2.0 (0x4000) and the block decodes to x.
    levels = torch.tensor([0.4528, 1.510, -0.4528, -1.510])
    idx = torch.arange(TERN_BLOCK) % 4
    idx[:5] = torch.tensor([1, 1, 1, 3, 3])  # rms 1.13: the threshold 0.98 rms lies between the levels
    x = _rotated_back(2.0 * levels[idx][None])
    payload, meta = encode(x, "quad")
    assert payload[:2] == b"\x00\x40"
    code = idx.numpy()  # the levels above are in code order: bit 0 outer level, bit 1 negative
    assert payload[2:] == (code.reshape(-1, 4) << np.array([0, 2, 4, 6])).sum(axis=1).astype(np.uint8).tobytes()
    assert torch.allclose(decode(payload, meta, x.shape), x, atol=1e-5)
    # a Gaussian keeps sqrt(0.1175) = 0.34 of its norm as error (the 4-level Lloyd-Max quantiser)
    g = _rand(8, 32, 128)
    rel = float((decode(*encode(g, "quad"), g.shape) - g).norm() / g.norm())
    assert 0.32 < rel < 0.36, rel
    z = torch.zeros(2, 130)
    assert torch.equal(decode(*encode(z, "quad"), z.shape), z)


def test_tern_sr_and_quad_bad_inputs_and_payloads():
    for codec in ("tern-sr", "quad"):
        with pytest.raises(NonFiniteError):
            encode(torch.tensor([1.0, float("nan")]), codec)
        with pytest.raises(CodecError, match="bf16 range"):
            encode(torch.full((128,), 3e38), codec)
        p, meta = encode(_rand(300), codec, key=1)
        with pytest.raises(CodecError, match="must be"):
            decode(p[:-1], meta, (300,))
        for level in (b"\x80\xbf", b"\x80\x7f", b"\xc0\x7f"):  # -1.0, inf, NaN in bf16
            with pytest.raises(CodecError, match="negative or non-finite"):
                decode(level + p[2:], meta, (300,))
        frame = encode_tensor("out", _rand(4, 128), codec, key=2)
        assert frame.codec == codec and json.loads(frame.meta) == {"codec": codec, "numel": 512}
        frame.data = frame.data[:-1]
        with pytest.raises(WireError, match=f"'out': bad {codec} payload"):
            decode_tensor(frame, shape=(4, 128), dtype="float32")


def _act_and_grad_only(act: str, grad: str) -> None:
    """``act`` serves activations and their gradients, ``grad`` only the gradients; neither
    pushes nor pulls."""
    assert parse_codec(act, "act") == act and parse_codec(act, "grad") == act
    assert parse_codec(grad, "grad") == grad
    with pytest.raises(ShoalError, match="for activations use tern, quad or oct"):
        parse_codec(grad, "act")
    for codec in (act, grad):
        for kind in ("push", "pull"):
            with pytest.raises(ShoalError, match="activations"):
                parse_codec(codec, kind)
    spec = parse_compression(f"act={act},grad={grad}")
    assert (spec["act"], spec["grad"], spec["push"]) == (act, grad, "none")


def test_spec_allows_quad_for_activations_and_tern_sr_for_their_gradients_only():
    _act_and_grad_only("quad", "tern-sr")
    # --sync auto: the fewest bytes per kind, and at equal bytes the unbiased gradient
    from shoal.plan.auto import QualityBudget, parse_allowed_codecs

    b = QualityBudget(codecs=parse_allowed_codecs("none,tern,tern-sr,quad"))
    assert (b.codec_for("act", 2), b.codec_for("grad", 2)) == ("tern", "tern-sr")
    b = QualityBudget(codecs=parse_allowed_codecs("none,quad,tern-sr"))
    assert (b.codec_for("act", 2), b.codec_for("grad", 2)) == ("quad", "tern-sr")


# ---------------------------------------------------------------- oct and tern-dither

OCT = (0.2451, 0.7560, 1.344, 2.152)  # the 8-level Lloyd-Max magnitudes of a unit Gaussian


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 3 * 128 * 5 + 7])
def test_oct_and_tern_dither_bytes_of_any_length(n):
    x = _rand(n, seed=n)
    nb = math.ceil(n / 128)
    for codec, by_hand in (("oct", 50 * nb), ("tern-dither", 8 + 13 * nb if n else 0)):
        payload, meta = encode(x, codec, key=7)
        assert meta == {"codec": codec, "numel": n}
        assert len(payload) == by_hand == encoded_nbytes(codec, n) == act_nbytes(codec, n)
        assert decode(payload, meta, (n,)).shape == (n,)
    # the planner's rates (tern-dither: a large tensor's, the seed is once per tensor); oct forward
    # with tern-dither back: 3.94 bits per element for the two, 8.13x fewer bytes than bf16
    assert bytes_per_element("oct", 2) == pytest.approx(50 / 128)
    assert bytes_per_element("tern-dither", 2) == pytest.approx(13 / 128)
    assert 2 * 2 / (bytes_per_element("oct", 2) + bytes_per_element("tern-dither", 2)) == pytest.approx(8.13, abs=0.01)
    assert wire_fraction("tern-dither") == pytest.approx(13 / 128 / 4)


def test_oct_block_by_hand_and_its_error():
    # Rotated block r = 2 (c_0 ... c_127) with every c an oct level: codes read back exactly (3 bits
    # each, little-endian bit after bit: bits 0-1 the magnitude, bit 2 the sign), the scale is 2.0
    # (0x4000) and the block decodes to x.
    mag = torch.repeat_interleave(torch.arange(4), torch.tensor([49, 41, 28, 10]))  # a Gaussian's shares
    code = mag + 4 * (torch.arange(TERN_BLOCK) % 2)
    vals = torch.tensor(OCT)[code % 4] * torch.where(code >= 4, -1.0, 1.0)
    assert 0.97 < float(vals.square().mean().sqrt()) < 0.99  # rms ~1: thresholds x rms split the levels
    x = _rotated_back(2.0 * vals[None])
    payload, meta = encode(x, "oct")
    assert payload[:2] == b"\x00\x40"
    bits = ((code.numpy()[:, None] >> np.arange(3)) & 1).astype(np.uint8).reshape(-1)
    assert payload[2:] == np.packbits(bits, bitorder="little").tobytes()
    assert torch.allclose(decode(payload, meta, x.shape), x, atol=1e-5)
    # a Gaussian keeps sqrt(0.0345) = 0.186 of its norm as error (the 8-level Lloyd-Max quantiser),
    # against quad's 0.34
    g = _rand(8, 32, 128)
    rel = float((decode(*encode(g, "oct"), g.shape) - g).norm() / g.norm())
    assert 0.17 < rel < 0.20, rel
    z = torch.zeros(2, 130)
    assert torch.equal(decode(*encode(z, "oct"), z.shape), z)


def test_tern_dither_block_by_hand():
    # Rotated block r = (2, -1, 0.5, 0, then +-2): at least 52 of the +-2 are kept, so the level a is
    # 2 (0x4000 after the 8-byte seed), or one bf16 step above it where the rotations' float rounding
    # put a kept |r| just above 2. A kept coordinate's digit is round((r + u) / a) with the dither u
    # uniform on (-a/2, a/2): +1 with probability r / a for r >= 0, -1 with probability -r / a for
    # r <= 0, else 0: r = 2 (almost) always +1, r = -1 -1 half the time, r = 0.5 +1 a quarter of the
    # time, r = 0 always 0. It decodes to (t a - u) 128 / 55, so the dithered quantiser's error
    # (decoded 55 / 128 - r) is uniform on (-a/2, a/2): mean 0, variance a^2 / 12 (about 1/3); the
    # coordinates not kept decode to 0. Each coordinate is kept with probability 55/128.
    r = torch.full((1, TERN_BLOCK), 2.0)
    r[0, 4::2] = -2.0
    r[0, :4] = torch.tensor([2.0, -1.0, 0.5, 0.0])
    x = _rotated_back(r)
    keys = 2000
    seen = np.zeros((4, 3))  # coordinate -> count of digits 0, +1, -1
    kept = np.zeros(TERN_BLOCK)
    err = []
    for k in range(keys):
        payload, meta = encode(x, "tern-dither", key=k)
        assert len(payload) == TD_SEED_BYTES + 2 + 11 and payload[TD_SEED_BYTES:TD_SEED_BYTES + 2] in (b"\x00\x40", b"\x01\x40")
        pos = _td_positions(int(np.frombuffer(payload[:TD_SEED_BYTES], dtype="<u8")[0]), 1)[0].numpy()
        assert len(set(pos.tolist())) == TD_KEPT
        b = np.frombuffer(payload[TD_SEED_BYTES + 2:], dtype=np.uint8).astype(np.int64)
        digits = np.stack([(b // 3 ** j) % 3 for j in range(5)], axis=1).reshape(-1)  # in the order of pos
        got = _fwht(decode(payload, meta, x.shape).view(1, TERN_BLOCK) * _tern_signs())[0].numpy()
        off = np.ones(TERN_BLOCK, dtype=bool)
        off[pos] = False
        assert np.abs(got[off]).max() < 1e-5  # not kept: 0 up to the float rounding of two rotations
        kept[pos] += 1
        for j, i in enumerate(pos):
            if i < 4:
                seen[i, digits[j]] += 1
                err.append(got[i] * TD_KEPT / TERN_BLOCK - float(r[0, i]))
    assert np.abs(kept / keys - TD_KEPT / TERN_BLOCK).max() < 0.05
    assert seen[0, 2] == 0 and seen[0, 1] / seen[0].sum() > 0.98 and seen[3, 0] == seen[3].sum()
    assert seen[1, 1] == 0 and abs(seen[1, 2] / seen[1].sum() - 0.5) < 0.06
    assert seen[2, 2] == 0 and abs(seen[2, 1] / seen[2].sum() - 0.25) < 0.06
    err = np.array(err)
    assert np.abs(err).max() < 1.01 and abs(err.mean()) < 0.03 and abs(err.var() - 1 / 3) < 0.03


def test_tern_dither_is_unbiased():
    # The mean of K decodes is x within 5 standard deviations, element by element: a rotated
    # coordinate decodes to (t a - u) / p with probability p = 55/128 and to 0 otherwise, so its
    # variance is (1/p - 1) r_j^2 + a^2 / (12 p), spread by the rotation over its block's 128
    # elements (a <= 1.01 max|r|: the kept coordinates' largest, rounded up to bf16). quad
    # (deterministic) fails it.
    x, keys, mean, r = _mean_of_decodes("tern-dither")
    a = 1.01 * r.abs().amax(dim=1, keepdim=True)
    p = TD_KEPT / TERN_BLOCK
    sd = (((1 / p - 1) * r * r + a * a / (12 * p)).sum(dim=1, keepdim=True) / TERN_BLOCK / keys).sqrt()
    assert ((mean - x).abs() <= 5 * sd).all()
    det = decode(*encode(x, "quad"), x.shape)
    assert ((det - x).abs() > 5 * sd).float().mean() > 0.1
    # its error: about 2.6 times the tensor's energy per tensor (tern-sr: about 1.2), which the
    # weight gradients average over the tokens
    g = _rand(64, 128, seed=5)
    nmse = float((decode(*encode(g, "tern-dither", key=1), g.shape) - g).square().sum() / g.square().sum())
    assert 2.0 < nmse < 3.2, nmse


def test_tern_dither_draws_are_fixed_by_key_and_tensor():
    x = _rand(4, 256)
    p, _ = encode(x, "tern-dither", key=3)
    assert encode(x.clone(), "tern-dither", key=3)[0] == p  # a retried task sends the same bytes
    assert encode(x, "tern-dither", key=4)[0] != p
    y = x.clone()
    y[0, 0] += 1e-3
    assert encode(y, "tern-dither", key=3)[0][:TD_SEED_BYTES] != p[:TD_SEED_BYTES]  # another tensor, other draws
    # the seed is the payload's: any 64-bit value decodes (the receiver needs no key)
    q = b"\xff" * TD_SEED_BYTES + p[TD_SEED_BYTES:]
    assert torch.isfinite(decode(q, {"codec": "tern-dither", "numel": 1024}, (4, 256))).all()


def test_oct_and_tern_dither_bad_inputs_and_payloads():
    for codec, at in (("oct", 0), ("tern-dither", TD_SEED_BYTES)):
        with pytest.raises(NonFiniteError):
            encode(torch.tensor([1.0, float("nan")]), codec)
        with pytest.raises(CodecError, match="bf16 range"):
            encode(torch.full((128,), 3e38), codec)
        p, meta = encode(_rand(300), codec, key=1)
        with pytest.raises(CodecError, match="must be"):
            decode(p[:-1], meta, (300,))
        with pytest.raises(CodecError, match="must be"):
            decode(p + b"\x00", meta, (300,))
        for level in (b"\x80\xbf", b"\x80\x7f", b"\xc0\x7f"):  # -1.0, inf, NaN in bf16
            with pytest.raises(CodecError, match="negative or non-finite"):
                decode(p[:at] + level + p[at + 2:], meta, (300,))
        frame = encode_tensor("out", _rand(4, 128), codec, key=2)
        assert frame.codec == codec and json.loads(frame.meta) == {"codec": codec, "numel": 512}
        frame.data = frame.data[:-1]
        with pytest.raises(WireError, match=f"'out': bad {codec} payload"):
            decode_tensor(frame, shape=(4, 128), dtype="float32")
    p, meta = encode(_rand(300), "tern-dither", key=1)
    with pytest.raises(CodecError, match="byte of 243"):
        decode(p[:-1] + bytes([243]), meta, (300,))
    # random bytes of the right length: decoded, or refused in one line (a level, a byte >= 243)
    rng = np.random.default_rng(0)
    for codec in ("oct", "tern-dither"):
        n = encoded_nbytes(codec, 1000)
        for _ in range(20):
            try:
                out = decode(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), {"codec": codec, "numel": 1000}, (1000,))
            except CodecError as e:
                assert "negative or non-finite" in str(e) or "five ternary digits" in str(e)
                assert "\n" not in str(e)
            else:
                assert out.shape == (1000,)


def test_spec_allows_oct_for_activations_and_tern_dither_for_their_gradients_only():
    _act_and_grad_only("oct", "tern-dither")
    from shoal.plan.auto import QualityBudget, parse_allowed_codecs

    b = QualityBudget(codecs=parse_allowed_codecs("none,oct,tern-dither"))
    assert (b.codec_for("act", 2), b.codec_for("grad", 2)) == ("oct", "tern-dither")
    b = QualityBudget(codecs=parse_allowed_codecs("none,quad,oct,tern-sr,tern-dither"))  # the fewest bytes
    assert (b.codec_for("act", 2), b.codec_for("grad", 2)) == ("quad", "tern-dither")
