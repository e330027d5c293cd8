"""Tensor codecs for the wire: ``raw`` (fp32), ``fp16``, ``int8`` (blockwise), sparse and low-bit ones.

Every tensor that crosses the network (activations, their gradients, gradient pushes,
weight pulls) is encoded by one of these codecs:

* ``raw`` -- little-endian float32, lossless for float32/float16/bfloat16 inputs.
  4 bytes per element.
* ``fp16`` -- little-endian IEEE half precision. 2 bytes per element; relative error
  at most 2^-11 for normal values; values beyond +-65504 are rejected (they would
  become inf), use ``int8`` or ``raw`` for such tensors.
* ``int8`` -- blockwise symmetric absmax quantisation: the flattened tensor is cut
  into blocks of ``block`` elements (the last one may be shorter); each block stores
  one float32 scale ``s = max|x| / 127`` and ``q = round(x / s)`` in [-127, 127] as
  int8. Decoding is ``q * s``, so every element's error is at most ``s / 2`` of its
  block. ``1 + 4 / block`` bytes per element: 3.88x smaller than fp32 at block 128.
* ``topk-int8[:density]`` -- sparse: the ``k = ceil(density * numel)`` entries of largest
  magnitude (default density 0.1), as ascending little-endian int32 indices followed by
  their values in blockwise int8 (as above); every other entry decodes to 0.
  ``5 k + 4 ceil(k / block)`` bytes. Only for pseudo-gradients and weight deltas sent with
  error feedback (what it drops is carried to the next send), never for activations.
* ``sparse[:density[:bits]]`` -- chunked top-k with low-bit values: the flattened tensor is cut
  into chunks of ``SPARSE_CHUNK`` (4096) elements; each keeps its ``k = ceil(density * 4096)``
  entries of largest magnitude (default density 0.01, so k = 41; a last, shorter chunk keeps
  ``min(k, its length)``). Each kept entry is one ``12 + bits``-bit word: its index inside the
  chunk (12 bits) and a ``bits``-bit code (default 2): a sign bit and ``bits - 1`` magnitude bits
  (``bits = 1``: the sign only). Code ``j`` of a chunk with scale ``s`` decodes to
  ``+-s (j + 1) / L`` with ``L = 2^(bits - 1)`` magnitude levels; ``s`` (one bf16 per chunk) is
  the least-squares fit of the kept magnitudes to their levels (``bits = 1``: their mean), the
  levels first chosen against the chunk's largest magnitude. Payload: the chunks' bf16 scales,
  then the words packed little-endian bit after bit, ``2 n_chunks + ceil(K (12 + bits) / 8)``
  bytes for ``K`` kept entries in all -- the planner's ``sparse`` size
  (:mod:`shoal.plan.compression`): 111x smaller than bf16 at the defaults. Within a chunk the
  indices ascend strictly; the decoder checks that, every index against its chunk's length, the
  scales (finite, not negative) and the unused tail bits (zero). Pushes and pulls with error
  feedback only.
* ``lowrank[:rank[:bits]]`` -- low-rank pseudo-gradients and weight updates of a whole stage: the
  caller passes the stage's tensor shapes (``layout``, in the order the flat tensor holds them);
  each matrix (a tensor's first dimension by the rest, where factors are under a quarter of its
  int8 bytes: :func:`shoal.plan.compression.lowrank_matrix`) is sent as its ``rank`` (default 3)
  leading singular directions ``A B^T`` (``A = U sqrt(S)``, ``B = V sqrt(S)``; an exact SVD of a
  small matrix, else a randomised one with two power iterations from a fixed start), each factor
  column as ``bits``-bit (4 or 8, default 4) signed codes with one fp32 scale (absmax, symmetric
  levels); every other tensor's elements go together in blockwise int8. Decoding sums the
  ``rank`` outer products one at a time in a fixed order with elementwise float32 arithmetic (no
  BLAS, whose order depends on the thread count), so every receiver decodes the same bits.
  Payload: per matrix its two scale vectors, then the codes of ``A`` and of ``B`` (column after
  column, 4-bit codes two per byte, low nibble first, stored as code + 8), then the int8 part:
  :func:`shoal.plan.compression.lowrank_nbytes`. 124x smaller than bf16 on the tiny model as one stage,
  1,300x on a gpt-1.3b block. The decoder checks the scales (finite, not negative) and the layout
  against the receiver's own shapes. Pushes and pulls with error feedback only.
* ``tern`` -- rotated blockwise ternary, for activations and activation gradients: the flattened
  tensor is cut into blocks of ``TERN_BLOCK`` (128) elements (the last one padded with zeros);
  each block ``x`` is rotated, ``r = H D x`` with ``D`` fixed pseudo-random signs and ``H`` the
  orthonormal Walsh-Hadamard matrix, which spreads a block's outliers over all its coordinates so
  that they are near Gaussian. Each ``r_i`` becomes a ternary digit: 0 where
  ``|r_i| <= TERN_THRESHOLD * rms(r)`` (0.612: the mean-square-error optimum for a Gaussian), else
  its sign; the block's level ``a`` (bf16: fp16 would flush small gradients to 0) is the mean ``|r_i|`` of the digits that are not 0
  (the least-squares level). Decoding is ``x = D H (a t)``. Payload: the blocks' bf16 levels,
  then the digits five per byte (``t_0 + 3 t_1 + 9 t_2 + 27 t_3 + 81 t_4`` with 0, 1, 2 meaning
  0, +a, -a), ``2 n_blocks + ceil(128 n_blocks / 5)`` bytes: 1.725 bits per element, 9.28x
  smaller than bf16 (the planner's ``tern`` size). The decoder checks the levels (finite, not
  negative), every byte (< 243) and the padding digits of the last byte (zero). The relative
  error per block is about 0.44 (the ternary quantiser of a Gaussian), so it is measured for its
  effect on the loss (bench/results/compress_bench.md), not bounded per element.
* ``tern-sr`` -- ``tern``'s rotation, format and size with stochastic rounding, for activation
  gradients: the block's level is its largest ``|r_i|`` rounded up to bf16, and each ``r_i`` is
  sent as its sign with probability ``|r_i| / a``, else 0, so the decoded tensor's mean is the
  input (unbiased; a deterministic quantiser's bias adds up over the steps). The draws are
  SplitMix64 of a counter seeded by the caller's ``key`` and a CRC-32 of the tensor's bytes: the
  same tensor under the same key makes the same payload on every machine.
* ``quad`` -- ``tern``'s rotation with four levels: ``r_i`` becomes ``+-0.4528 s`` or
  ``+-1.510 s`` (the Lloyd-Max quantiser of a Gaussian; outer where ``|r_i| > 0.9816 rms(r)``),
  ``s`` the least-squares bf16 scale of the block. Payload: the scales, then 2-bit codes (bit 0
  outer, bit 1 negative) four per byte, ``34 n_blocks`` bytes: 2.125 bits per element, 7.53x
  smaller than bf16, relative error about 0.34. ``act=quad,grad=tern-sr`` is 8.31x smaller than
  bf16 for the two kinds together.
* ``oct`` -- ``quad`` with eight levels: ``r_i`` becomes ``+-c s`` with ``c`` in ``OCT_LEVELS`` (the
  8-level Lloyd-Max quantiser of a Gaussian, thresholds ``OCT_THRESHOLDS`` x ``rms(r)``), ``s`` the
  least-squares bf16 scale of the block. Payload: the scales, then 3-bit codes (bits 0-1 the
  magnitude, bit 2 negative) packed little-endian bit after bit, ``50 n_blocks`` bytes: 3.125 bits
  per element, 5.12x smaller than bf16, relative error about 0.19.
* ``tern-dither`` -- for activation gradients, under 1 bit per element and unbiased: ``tern``'s
  rotation, then of each block a random ``TD_KEPT`` (55) of the 128 rotated coordinates are kept
  (the first 55 of a random permutation: each coordinate with probability 55/128), each sent as a
  ternary digit with subtractive dither: with ``a`` the kept coordinates' largest ``|r_i|`` rounded
  up to bf16 and ``u`` uniform on ``(-a/2, a/2)``, the digit is ``t = round((r_i + u) / a)`` in
  ``{-1, 0, 1}`` and the receiver, who draws the same ``u``, decodes ``(t a - u) 128 / 55`` (0 for
  the coordinates not kept). ``t a - u - r_i`` is uniform on ``(-a/2, a/2)`` whatever ``r_i``, so
  the decoded tensor's mean is the input, with a variance of ``(128/55 - 1) r_i^2 + (128/55) a^2 /
  12`` per coordinate: about 2.6 times the tensor's energy (``tern-sr``: about 1.2 at 1.725 bits).
  The permutations and the dither are SplitMix64 draws of a 64-bit seed made from the caller's
  ``key`` and a CRC-32 of the tensor (as ``tern-sr``'s); the seed opens the payload, so a receiver
  needs nothing but the frame. Payload: the seed (8 bytes), the blocks' bf16 levels, then 11 bytes
  of digits (five per byte) per block, ``8 + 13 n_blocks`` bytes: 0.8125 bits per element, 19.7x
  smaller than bf16. ``act=oct,grad=tern-dither`` is 3.94 bits for the two kinds: 8.13x smaller
  than bf16. The decoder checks the levels and every byte (< 243).
* ``quad-pc`` -- for activations whose energy sits in a few directions (a transformer's residual
  stream: on the tiny model at the stage boundary the channel means hold 26-92 % of it and four
  directions 99 % of what is left): a tensor of ``R`` rows of ``C`` channels (its last dimension,
  :func:`channel_count`) is sent as its channel means, ``k = min(PC_RANK, C)`` directions over the
  channels (near the top principal directions: subspace iteration from a fixed start) and each
  row's ``k`` coefficients on them, all bf16, then ``quad`` of the rest ``x - mean - coef dirs``,
  which the encoder measures against the rounded means, directions and coefficients the decoder
  will use. The low-rank part is summed one direction at a time in a fixed order, so every
  receiver decodes the same bits. Payload: the means, the directions (row by row), the
  coefficients (row by row), then ``quad``'s: ``2 C + 2 k C + 2 k R + 34 n_blocks`` bytes, 2.125 +
  16 / R + 16 k / R + 16 k / C bits per element (2.70 at R 1,024, C 128; 2.22 at R 8,192, C
  768; 3.88 at R 64, C 128), so its size depends on the channel count: ``encoded_nbytes`` takes
  ``channels`` and :func:`decode` reads it from the receiver's shape. Its error on that residual
  stream is about 0.001 of the energy (``oct``: 0.034); on Gaussian data with no such structure it
  is ``quad``'s, 0.12. ``act=quad-pc,grad=tern-dither`` is 3.52 bits at R 1,024, C 128: 9.10x
  smaller than bf16. The decoder checks the means, directions and coefficients (finite), ``quad``'s
  scales, and that the sum stays finite.

Payloads are plain bytes plus a small ``meta`` dict of ints and strings (codec, block,
element count) that the frame carries; the receiver passes the shape and dtype it
expects from its stage spec, and :func:`decode` checks the payload length against them
before touching the data. Nothing is ever pickled. Non-finite inputs (inf/NaN) are
rejected by every codec with :class:`NonFiniteError`, so a diverging run fails loudly
at the sender instead of corrupting a stage server.

:class:`ErrorFeedback` keeps the residual of lossy compression per tensor name and adds
it to the next tensor of that name before encoding (for gradient push / weight pull,
where the same tensor is sent every step and a biased rounding error would otherwise
accumulate). :class:`WireCounter` counts raw (fp32-equivalent) and wire bytes per link
class for the run report.
"""

from __future__ import annotations

import math
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import shoal.plan.compression as _plan
from shoal.errors import ShoalError
from shoal.threads import compute_pool

CODECS = ("raw", "fp16", "int8")  # dense codecs (any traffic kind)
SPARSE_CODECS = ("topk-int8", "sparse", "lowrank")  # sparse and low-rank codecs (pushes and pulls with error feedback only)
ACT_CODECS = ("tern", "tern-sr", "quad", "oct", "quad-pc", "tern-dither")  # low-bit dense codecs for activations and their gradients
ALL_CODECS = CODECS + SPARSE_CODECS + ACT_CODECS  # every codec name a frame may carry
# The sparse codec's shape is the planner's (it charges these very bytes): one definition.
TOPK_DENSITY = _plan.TOPK_DENSITY  # fraction of entries topk-int8 keeps without a :density
SPARSE_CHUNK = _plan.SPARSE_CHUNK  # elements per chunk of ``sparse`` (indices are local to a chunk)
SPARSE_INDEX_BITS = _plan.SPARSE_INDEX_BITS  # bits of an in-chunk index: log2(SPARSE_CHUNK)
SPARSE_DENSITY = _plan.SPARSE_DENSITY  # fraction of each chunk ``sparse`` keeps without a :density
SPARSE_BITS = _plan.SPARSE_BITS  # bits per kept value of ``sparse`` without a :bits
SPARSE_BIT_CHOICES = _plan.SPARSE_BIT_CHOICES  # value widths ``sparse`` packs
LOWRANK_MAX_RANK = _plan.LOWRANK_MAX_RANK  # the largest rank ``lowrank`` sends or accepts
LOWRANK_OVERSAMPLE = 8  # lowrank: extra directions the randomised SVD tracks (its accuracy on the top ``rank``)
LOWRANK_DECODE_BLOCK = 1 << 16  # lowrank: elements of a matrix decoded at once (256 KB of float32: in the cache)
LOWRANK_POWER_ITERS = 2  # lowrank: power iterations of the randomised SVD
TERN_BLOCK = _plan.TERN_BLOCK  # elements per rotated block of ``tern``
TERN_PER_BYTE = _plan.TERN_PER_BYTE  # ternary digits per byte of ``tern``
TERN_THRESHOLD = 0.612  # |r| <= this x rms(r) of its block sends 0 (the optimal ternary threshold of a Gaussian)
QUAD_THRESHOLD = 0.9816  # quad: |r| above this x rms(r) takes the outer level (Lloyd-Max, 4 levels, Gaussian)
QUAD_LEVELS = (0.4528, 1.510)  # quad: inner and outer level in units of the block's scale (Lloyd-Max)
# oct: the 8-level Lloyd-Max quantiser of a unit Gaussian: magnitude thresholds (x rms(r)) and levels
OCT_THRESHOLDS = (0.5006, 1.050, 1.748)
OCT_LEVELS = (0.2451, 0.7560, 1.344, 2.152)
TD_KEPT = _plan.TD_KEPT  # tern-dither: rotated coordinates kept per block of TERN_BLOCK
PC_RANK = _plan.PC_RANK  # quad-pc: principal directions sent per tensor
TD_SEED_BYTES = _plan.TD_SEED_BYTES  # tern-dither: the 64-bit draw seed that opens its payload
DEFAULT_BLOCK = 128  # int8 block size: 3.88x smaller than fp32, error <= absmax/254 per block
FP16_MAX = 65504.0
_INT8_LEVELS = 127  # symmetric: -127..127, so -x decodes to exactly minus the decode of x

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class CodecError(ValueError):
    """A tensor cannot be encoded, or a payload does not match what it claims to be."""


class NonFiniteError(CodecError):
    """The tensor to encode holds inf or NaN."""


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch float dtype (``"float32"``, ``"float16"``, ``"bfloat16"``)."""
    for name, dt in _TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise CodecError(f"unsupported dtype {dtype}; supported: {', '.join(_TORCH_DTYPES)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise CodecError(f"unsupported dtype {name!r}; supported: {', '.join(_TORCH_DTYPES)}") from None


def split_codec(codec: str) -> tuple[str, float]:
    """``"topk-int8:0.05"`` -> ``("topk-int8", 0.05)``; dense codecs -> ``(name, 1.0)``."""
    name, _, arg = codec.partition(":")
    if name == "sparse":
        return name, sparse_params(codec)[0]
    if name == "lowrank":
        lowrank_params(codec)
        return name, 1.0
    if name not in SPARSE_CODECS:
        if arg:
            raise CodecError(f"codec {codec!r}: only topk-int8, sparse and lowrank take arguments")
        return name, 1.0
    try:
        density = float(arg) if arg else TOPK_DENSITY
    except ValueError:
        raise CodecError(f"codec {codec!r}: the density must be a number in (0, 1]") from None
    if not 0 < density <= 1:
        raise CodecError(f"codec {codec!r}: the density must be in (0, 1], got {density}")
    return name, density


def sparse_params(codec: str) -> tuple[float, int]:
    """``"sparse:0.01:2"`` -> ``(density, bits)``, defaults for the parts left out
    (:func:`shoal.plan.compression.sparse_params`, raising :class:`CodecError`)."""
    try:
        return _plan.sparse_params(codec)
    except ShoalError as e:
        raise CodecError(str(e)) from None


def lowrank_params(codec: str) -> tuple[int, int]:
    """``"lowrank:3:4"`` -> ``(rank, bits)`` (:func:`shoal.plan.compression.lowrank_params`,
    raising :class:`CodecError`)."""
    try:
        return _plan.lowrank_params(codec)
    except ShoalError as e:
        raise CodecError(str(e)) from None


def _layout(layout, numel: int, shape) -> list[tuple[int, ...]]:
    """The checked tensor shapes of a ``lowrank`` payload: ``layout``, or ``shape`` alone."""
    shapes = [tuple(int(d) for d in s) for s in (layout if layout is not None else [shape])]
    if any(d < 0 for s in shapes for d in s):
        raise CodecError("lowrank layout has a negative dimension")
    if sum(math.prod(s) for s in shapes) != numel:
        raise CodecError(f"lowrank layout of {sum(math.prod(s) for s in shapes)} elements does not cover the "
                         f"tensor's {numel}")
    return shapes


def sparse_kept(density: float) -> int:
    """Entries ``sparse`` keeps per chunk of :data:`SPARSE_CHUNK` (the planner's ``sparse_kept_per_chunk``)."""
    return min(SPARSE_CHUNK, _plan.sparse_kept_per_chunk(density))


def sparse_nbytes(numel: int, k: int, bits: int) -> int:
    """Payload bytes of ``sparse`` for ``numel`` elements, ``k`` kept per chunk, ``bits`` per value."""
    if numel <= 0:
        return 0
    nc = -(-numel // SPARSE_CHUNK)
    kept = (nc - 1) * k + min(k, numel - (nc - 1) * SPARSE_CHUNK)
    return 2 * nc + -(-kept * (SPARSE_INDEX_BITS + bits) // 8)


def _check_codec(codec: str, block: int) -> None:
    name, _ = split_codec(codec)
    if name not in ALL_CODECS:
        raise CodecError(f"unknown codec {codec!r}; choose one of {', '.join(ALL_CODECS)}")
    if name not in ("raw", "fp16") + ACT_CODECS and not (isinstance(block, int) and 1 <= block <= 1 << 20):
        raise CodecError(f"int8 block size must be an integer in [1, 2^20], got {block!r}")


def topk_count(numel: int, density: float) -> int:
    """Entries a top-k codec of ``density`` keeps of ``numel`` (at least one of a non-empty tensor)."""
    return min(numel, max(1, math.ceil(density * numel))) if numel > 0 else 0


def encoded_nbytes(codec: str, numel: int, block: int = DEFAULT_BLOCK, k: int | None = None,
                   channels: int | None = None, layout=None) -> int:
    """Exact payload size in bytes of a tensor of ``numel`` elements under ``codec``
    (top-k: ``k`` kept entries, default from the codec's density; ``quad-pc``: ``channels``, the
    tensor's :func:`channel_count`, which its size depends on; ``lowrank``: ``layout``, the
    shapes it holds, default one vector)."""
    _check_codec(codec, block)
    name, density = split_codec(codec)
    if name == "lowrank":
        rank, bits = lowrank_params(codec)
        return _plan.lowrank_nbytes(_layout(layout, numel, (numel,)), rank, bits)
    if name == "raw":
        return 4 * numel
    if name == "fp16":
        return 2 * numel
    if name == "topk-int8":
        k = topk_count(numel, density) if k is None else k
        return 5 * k + 4 * _n_blocks(k, block)
    if name == "sparse":
        _, bits = sparse_params(codec)
        return sparse_nbytes(numel, sparse_kept(density) if k is None else k, bits)
    if name == "quad-pc":
        if channels is None:
            raise CodecError("quad-pc's size depends on the tensor's channel count (its last dimension): pass channels")
        try:
            return _plan.act_nbytes(name, numel, channels)
        except ShoalError as e:
            raise CodecError(str(e)) from None
    if name in ACT_CODECS:
        return _plan.act_nbytes(name, numel)
    return numel + 4 * _n_blocks(numel, block)


def channel_count(shape: tuple[int, ...] | list[int] | torch.Size) -> int:
    """The channel count ``quad-pc`` uses for a tensor of ``shape``: its last dimension (the model
    dimension of a ``(B, T, d)`` activation); a tensor of fewer than two dimensions is one channel."""
    return int(shape[-1]) if len(shape) >= 2 and int(shape[-1]) > 0 else 1


def wire_fraction(codec: str, block: int = DEFAULT_BLOCK) -> float:
    """Bytes on the wire per fp32 byte for large tensors (the planner's compression factor)."""
    _check_codec(codec, block)
    name, density = split_codec(codec)
    if name == "topk-int8":
        return density * (5 + 4 / block) / 4
    if name == "sparse":
        _, bits = sparse_params(codec)
        return (sparse_kept(density) * (SPARSE_INDEX_BITS + bits) / 8 + 2) / SPARSE_CHUNK / 4
    if name == "lowrank":  # a transformer block of the narrowest built-in width (depends on the shapes)
        return _plan.bytes_per_element(codec, 4) / 4
    if name in ACT_CODECS:  # quad-pc: the planner's rate (quad and 128-channel coefficients)
        return _plan.bytes_per_element(name, 4) / 4
    return {"raw": 1.0, "fp16": 0.5}.get(name, (1 + 4 / block) / 4)


def _n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _as_float32(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    """A flat float32 numpy view/copy of ``tensor`` (bfloat16 goes through torch)."""
    if isinstance(tensor, np.ndarray):
        if tensor.dtype not in (np.float32, np.float16, np.float64):
            raise CodecError(f"unsupported array dtype {tensor.dtype}; expected a float array")
        return np.ascontiguousarray(tensor, dtype=np.float32).reshape(-1)
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
    dtype_name(tensor.dtype)  # rejects int and other dtypes
    return tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()


def encode(
    tensor: torch.Tensor | np.ndarray, codec: str = "raw", block: int = DEFAULT_BLOCK, key: int = 0,
    layout=None,
) -> tuple[bytes, dict[str, Any]]:
    """Encode a float tensor; returns ``(payload, meta)``.

    ``layout`` (``lowrank`` only): the shapes of the tensors the flat ``tensor`` holds, in order
    (default: ``tensor``'s own shape).

    ``key`` seeds the draws of the stochastic codecs (``tern-sr``, ``tern-dither``) together with the tensor's
    own bytes, so the same tensor under the same key always makes the same payload; the runtime
    passes one per (run seed, stage, step, micro-batch, direction). Other codecs ignore it.

    ``meta`` holds ``codec``, ``numel`` and (int8) ``block``: ints and strings only, to
    be carried in the frame next to the payload. Raises :class:`NonFiniteError` if the
    tensor holds inf or NaN and :class:`CodecError` for an fp16 overflow, an unknown
    codec or an unsupported dtype.
    """
    _check_codec(codec, block)
    channels = channel_count(tensor.shape) if isinstance(tensor, (torch.Tensor, np.ndarray)) else 1
    x = _as_float32(tensor)
    if not np.isfinite(x).all():
        bad = int((~np.isfinite(x)).sum())
        raise NonFiniteError(
            f"tensor holds {bad} non-finite value(s) (inf/NaN) out of {x.size}; refusing to "
            "send it (check the learning rate / loss scale of the run)"
        )
    meta: dict[str, Any] = {"codec": codec, "numel": int(x.size)}
    if codec == "raw":
        return x.astype("<f4", copy=False).tobytes(), meta
    if codec == "fp16":
        if x.size and float(np.abs(x).max()) > FP16_MAX:
            raise CodecError(
                f"tensor has values up to {float(np.abs(x).max()):.3g}, beyond the fp16 range "
                f"(+-{FP16_MAX}); use the int8 or raw codec for it"
            )
        return x.astype("<f2").tobytes(), meta
    name, density = split_codec(codec)
    if name == "tern":
        return _tern_encode(x), meta
    if name == "tern-sr":
        return _tern_sr_encode(x, key), meta
    if name == "quad":
        return _quad_encode(x), meta
    if name == "oct":
        return _oct_encode(x), meta
    if name == "quad-pc":
        return _quad_pc_encode(x, channels), meta
    if name == "tern-dither":
        return _tern_dither_encode(x, key), meta
    if name == "sparse":
        _, bits = sparse_params(codec)
        k = sparse_kept(density)
        meta.update(codec="sparse", k=k, bits=bits)
        return _sparse_encode(x, k, bits), meta
    if name == "lowrank":
        rank, bits = lowrank_params(codec)
        meta.update(codec="lowrank", rank=rank, bits=bits)
        return _lowrank_encode(x, _layout(layout, x.size, tuple(tensor.shape)), rank, bits), meta
    meta["block"] = block
    if name == "topk-int8":
        meta["codec"] = name
        k = topk_count(x.size, density)
        # The k largest magnitudes; indices ascending, so a receiver can check them cheaply.
        idx = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k:]) if k < x.size else np.arange(x.size)
        meta["k"] = int(k)
        scales, q = _quantise_int8(x[idx], block)
        return (idx.astype("<i4").tobytes() + scales.astype("<f4", copy=False).tobytes() + q.tobytes(), meta)
    scales, q = _quantise_int8(x, block)
    return scales.astype("<f4", copy=False).tobytes() + q.tobytes(), meta


def _quantise_int8(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-block float32 scales and int8 codes of the flat float32 array ``x``."""
    n = x.size
    nb = _n_blocks(n, block)
    padded = np.zeros(nb * block, dtype=np.float32)
    padded[:n] = x
    blocks = padded.reshape(nb, block)
    absmax = np.abs(blocks).max(axis=1)
    scales = (absmax / np.float32(_INT8_LEVELS)).astype(np.float32)
    # An all-zero block keeps scale 0 and codes 0; divide by 1 there to avoid 0/0.
    safe = np.where(scales > 0, scales, np.float32(1.0))
    q = np.rint(blocks / safe[:, None])
    np.clip(q, -_INT8_LEVELS, _INT8_LEVELS, out=q)
    return scales, q.astype(np.int8).reshape(-1)[:n]


def decode(
    payload: bytes | bytearray | memoryview,
    meta: dict[str, Any],
    shape: tuple[int, ...] | list[int] | torch.Size,
    dtype: torch.dtype | str = torch.float32,
    layout=None,
) -> torch.Tensor:
    """Decode a payload made by :func:`encode` into a tensor of ``shape`` and ``dtype``
    (``layout``: a ``lowrank`` payload's tensor shapes, from the receiver's own stage).

    ``shape`` and ``dtype`` come from the receiver (its stage spec), not from the sender;
    the payload length is checked against them and the codec before any data is read,
    so a malformed or mismatched frame raises :class:`CodecError` and changes nothing.
    """
    if not isinstance(meta, dict):
        raise CodecError("codec meta must be a dict")
    codec = meta.get("codec")
    block = meta.get("block", DEFAULT_BLOCK)
    if not isinstance(codec, str):
        raise CodecError(f"codec meta has no codec name: {meta!r}")
    _check_codec(codec, block)
    dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    dtype_name(dt)
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise CodecError(f"negative dimension in shape {shape}")
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if meta.get("numel", numel) != numel:
        raise CodecError(f"payload holds {meta.get('numel')} elements but shape {shape} needs {numel}")
    k = None
    if codec == "sparse":
        k, bits = meta.get("k"), meta.get("bits")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= SPARSE_CHUNK:
            raise CodecError(f"sparse payload keeps {k!r} entries per chunk; expected an integer in [1, {SPARSE_CHUNK}]")
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SPARSE_BIT_CHOICES:
            raise CodecError(f"sparse payload has {bits!r} bits per value; expected one of {SPARSE_BIT_CHOICES}")
        codec = f"sparse::{bits}"
    elif codec == "topk-int8":
        k = meta.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= numel:
            raise CodecError(f"topk-int8 payload keeps {k!r} entries; expected an integer in [0, {numel}]")
    elif codec == "lowrank":
        rank, bits = meta.get("rank"), meta.get("bits")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= LOWRANK_MAX_RANK:
            raise CodecError(f"lowrank payload has rank {rank!r}; expected an integer in [1, {LOWRANK_MAX_RANK}]")
        if not isinstance(bits, int) or isinstance(bits, bool) or bits not in _plan.LOWRANK_BIT_CHOICES:
            raise CodecError(f"lowrank payload has {bits!r} bits per code; expected one of {_plan.LOWRANK_BIT_CHOICES}")
        layout = _layout(layout, numel, shape)
        codec = f"lowrank:{rank}:{bits}"
    expected = encoded_nbytes(codec, numel, block, k, channel_count(shape), layout)
    buf = memoryview(payload).cast("B")
    if len(buf) != expected:
        raise CodecError(
            f"{codec} payload for shape {shape} must be {expected} bytes, got {len(buf)}"
        )
    if codec == "raw":
        x = np.frombuffer(buf, dtype="<f4")
    elif codec == "fp16":
        x = np.frombuffer(buf, dtype="<f2").astype(np.float32)
    elif codec.startswith("sparse"):
        return _sparse_decode(buf, numel, k, meta["bits"]).reshape(shape).to(dt)
    elif codec.startswith("lowrank"):
        return _lowrank_decode(buf, layout, meta["rank"], meta["bits"]).reshape(shape).to(dt)
    elif codec == "quad":
        return _quad_decode(buf, numel).reshape(shape).to(dt)
    elif codec == "oct":
        return _oct_decode(buf, numel).reshape(shape).to(dt)
    elif codec == "quad-pc":
        return _quad_pc_decode(buf, numel, channel_count(shape)).reshape(shape).to(dt)
    elif codec == "tern-dither":
        return _tern_dither_decode(buf, numel).reshape(shape).to(dt)
    elif codec in ("tern", "tern-sr"):  # one payload format, they differ in the encoder only
        return _tern_decode(buf, numel).reshape(shape).to(dt)
    elif codec == "topk-int8":
        idx = np.frombuffer(buf[: 4 * k], dtype="<i4")
        if k and (idx[0] < 0 or idx[-1] >= numel or (k > 1 and not (np.diff(idx) > 0).all())):
            raise CodecError("topk-int8 payload has indices out of range or not strictly ascending")
        x = np.zeros(numel, dtype=np.float32)
        x[idx] = _dequantise_int8(buf[4 * k:], k, block)
    else:
        x = _dequantise_int8(buf, numel, block)
    # copy: frombuffer views are read-only and tied to the payload's lifetime
    return torch.from_numpy(np.array(x, dtype=np.float32)).reshape(shape).to(dt)


def _bf16_scales(buf: memoryview, count: int, bad: str) -> np.ndarray:
    """The first ``count`` little-endian bf16 values of ``buf`` as float32 (the per-block or
    per-chunk scales of ``sparse``, ``tern``, ``tern-sr``, ``quad``, ``oct`` and ``tern-dither`` payloads);
    :class:`CodecError` ``bad`` if any is negative or not finite."""
    scales = (np.frombuffer(buf[: 2 * count], dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise CodecError(bad)
    return scales


def _unrotate(r: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat float32 tensor of ``numel`` elements whose rotated blocks are the rows of ``r``
    (the inverse of :func:`_rotated_blocks`: ``H`` is its own inverse and ``D`` its own)."""
    return (_fwht(r) * _TERN_SIGNS).reshape(-1)[:numel].contiguous()


def _sparse_encode(x: np.ndarray, k: int, bits: int) -> bytes:
    """The ``sparse`` payload of the flat float32 array ``x`` (vectorised over chunks, in torch)."""
    n = x.size
    if n == 0:
        return b""
    C = SPARSE_CHUNK
    k = min(k, C)
    flat = torch.from_numpy(x)
    full = n // C
    parts = []  # (chunk rows, kept indices): the whole chunks as a view, a shorter last one apart
    if full:
        rows = flat[: full * C].view(full, C)
        _, idx = torch.topk(rows.abs(), k, dim=1, sorted=False)
        parts.append((rows, idx))
    if n > full * C:
        rows = flat[full * C:].view(1, -1)
        _, idx = torch.topk(rows.abs(), min(k, rows.shape[1]), dim=1, sorted=False)
        parts.append((rows, idx))
    levels = 1 << (bits - 1)
    scales, words = [], []
    for rows, i in parts:
        i, _ = torch.sort(i, dim=1)  # ascending in each chunk: the decoder checks it
        v = torch.gather(rows, 1, i)
        absv = v.abs()
        top = absv.amax(dim=1, keepdim=True)
        safe = torch.where(top > 0, top, torch.ones_like(top))
        j = torch.clamp(torch.round(absv * levels / safe) - 1, 0, levels - 1)  # nearest of top (j+1)/L
        c = (j + 1) / levels
        # Least-squares scale for these levels (one pass: the codes stay the first choice's).
        s = (absv * c).sum(dim=1) / (c * c).sum(dim=1)
        # bf16, not fp16: a late round's pseudo-gradients (small learning rate, few inner steps)
        # can sit below fp16's normal range, and bf16's 8-bit mantissa is far finer than the
        # 2-bit levels it scales.
        s16 = s.to(torch.bfloat16)
        if not bool(torch.isfinite(s16).all()):
            raise CodecError(f"sparse: a chunk scale of {float(s.max()):.3g} is beyond the bf16 range; "
                             "use the int8 or raw codec for this tensor")
        scales.append(s16)
        neg = (v < 0).to(torch.int64)
        code = (j.to(torch.int64) | (neg << (bits - 1))) if bits > 1 else neg
        words.append((i | (code << SPARSE_INDEX_BITS)).reshape(-1))
    scales, words = torch.cat(scales), torch.cat(words)
    width = SPARSE_INDEX_BITS + bits
    # Each word's low ``width`` bits, in entry order, little-endian bit after bit.
    wbytes = words.to(torch.int32).numpy().astype("<u4", copy=False).view(np.uint8).reshape(-1, 4)
    bitmat = np.unpackbits(wbytes, axis=1, bitorder="little")[:, :width]
    packed = np.packbits(bitmat.reshape(-1), bitorder="little")
    return scales.view(torch.int16).numpy().astype("<i2", copy=False).tobytes() + packed.tobytes()


def _sparse_decode(buf: memoryview, numel: int, k: int, bits: int) -> torch.Tensor:
    """The float32 tensor of a ``sparse`` payload whose length was checked; every index is
    checked against its chunk before anything is written."""
    C = SPARSE_CHUNK
    if numel == 0:
        return torch.zeros(0)
    nc = -(-numel // C)
    last = numel - (nc - 1) * C
    k_last = min(k, last)
    kept = (nc - 1) * k + k_last
    width = SPARSE_INDEX_BITS + bits
    scales = _bf16_scales(buf, nc, "sparse payload has a negative or non-finite chunk scale")
    bitv = np.unpackbits(np.frombuffer(buf[2 * nc:], dtype=np.uint8), bitorder="little")
    if bitv[kept * width:].any():
        raise CodecError("sparse payload has bits set past its last entry")
    bitmat = np.zeros((kept, 32), dtype=np.uint8)
    bitmat[:, :width] = bitv[: kept * width].reshape(kept, width)
    words = torch.from_numpy(np.packbits(bitmat, axis=1, bitorder="little").view("<u4").reshape(-1).astype(np.int64))
    idx = words & (C - 1)
    code = words >> SPARSE_INDEX_BITS
    # Chunk of each entry; indices strictly ascending inside a chunk and below its length.
    full = idx[: (nc - 1) * k].view(nc - 1, k)
    tail = idx[(nc - 1) * k:]
    if (nc > 1 and k > 1 and not bool((full[:, 1:] > full[:, :-1]).all())) or (
            k_last > 1 and not bool((tail[1:] > tail[:-1]).all())) or (k_last and int(tail[-1]) >= last):
        raise CodecError("sparse payload has in-chunk indices not strictly ascending or past the tensor's end")
    chunk = torch.cat([torch.arange(nc - 1).repeat_interleave(k), torch.full((k_last,), nc - 1)])
    levels = 1 << (bits - 1)
    mag = (code & (levels - 1)).to(torch.float32) + 1 if bits > 1 else torch.ones(kept)
    sign = 1.0 - 2.0 * ((code >> (bits - 1)) & 1).to(torch.float32)
    vals = sign * (torch.from_numpy(scales)[chunk] * (mag / levels))
    out = torch.zeros(numel)
    out[chunk * C + idx] = vals  # every position checked above to lie inside the tensor
    return out


_CODEC_POOL: ThreadPoolExecutor | None = None  # the codec threads (None: the caller's thread)
_CODEC_THREADS = 1  # their number (set_codec_threads)
_CODEC_LOCK = threading.Lock()


def set_codec_threads(n: int) -> None:
    """Encode and decode a ``lowrank`` frame's matrices on ``n`` threads (1: in the caller's
    thread, the default). Each matrix's factors come from a generator of its own and its decode
    is elementwise, so payloads and decoded bits are the same for every ``n``; torch releases the
    GIL in its kernels. A stage server runs its merge threads' count (a round's last push decode
    and the pull's encoding hold the merge: ``shoal.plan.cost.merge_cpu_time``)."""
    global _CODEC_POOL, _CODEC_THREADS
    with _CODEC_LOCK:
        old, _CODEC_POOL = _CODEC_POOL, (compute_pool(n, "shoal-codec")
                                         if n > 1 else None)
        _CODEC_THREADS = max(1, n)
    if old is not None:
        old.shutdown(wait=False)


def codec_threads() -> int:
    """The threads :func:`set_codec_threads` set (1: none of their own)."""
    return _CODEC_THREADS


def _codec_map(fn, items: list) -> list:
    """``[fn(x) for x in items]``, on the codec threads where there are several (in order)."""
    pool = _CODEC_POOL
    if pool is None or len(items) < 2:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))


def _top_factors(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` with ``A B^T`` the best rank-``rank`` approximation of the matrix ``x`` (near it,
    for a large one): an exact SVD of a small matrix; else a randomised range finder from a
    fixed start (its own generator: the run's random stream is not touched) with
    :data:`LOWRANK_POWER_ITERS` power iterations, then the SVD of the small projection (float64
    for the exact one, whose cost is nothing; float32 for a large one)."""
    m, n = x.shape
    q = rank + LOWRANK_OVERSAMPLE
    if min(m, n) <= 2 * q:
        u, s, vh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)
    else:
        g = torch.Generator().manual_seed(0x10A4)
        y = x @ torch.randn(n, q, generator=g, dtype=x.dtype)
        for _ in range(LOWRANK_POWER_ITERS):
            # x^T Q as (Q^T x)^T: torch multiplies a transposed view by a thin matrix ten times
            # slower (a gpt-1.3b 8192 x 2048 matrix: 0.16 s against 0.014 s on one core)
            y = x @ torch.linalg.qr((torch.linalg.qr(y).Q.T @ x).T).Q
        basis = torch.linalg.qr(y).Q
        ub, s, vh = torch.linalg.svd(basis.T @ x, full_matrices=False)
        u = basis @ ub
    root = s[:rank].clamp_min(0).sqrt()
    return u[:, :rank] * root, vh[:rank].T * root


def _lowrank_quantise(f: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column fp32 absmax scales and signed ``bits``-bit codes of the factor ``f``."""
    top = (1 << (bits - 1)) - 1
    scale = (f.abs().amax(dim=0) / top).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.clamp(torch.round(f / safe), -top, top).to(torch.int64)


def _pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Codes (column after column) as bytes: int8, or 4-bit ``code + 8`` two per byte, low nibble first."""
    flat = codes.T.reshape(-1).numpy()
    if bits == 8:
        return flat.astype(np.int8).tobytes()
    v = (flat + 8).astype(np.uint8)
    if v.size % 2:
        v = np.append(v, np.uint8(0))
    return (v[0::2] | (v[1::2] << 4)).astype(np.uint8).tobytes()


def _unpack_codes(buf: memoryview, rows: int, rank: int, bits: int) -> torch.Tensor:
    """The ``rows x rank`` float32 codes :func:`_pack_codes` wrote."""
    count = rows * rank
    if bits == 8:
        v = np.frombuffer(buf, dtype=np.int8)[:count].astype(np.float32)
    else:
        b = np.frombuffer(buf, dtype=np.uint8)
        v = np.empty(2 * b.size, dtype=np.float32)
        v[0::2] = (b & 15).astype(np.float32) - 8
        v[1::2] = (b >> 4).astype(np.float32) - 8
        v = v[:count]
    return torch.from_numpy(np.ascontiguousarray(v)).reshape(rank, rows).T


def _lowrank_encode(x: np.ndarray, shapes: list[tuple[int, ...]], rank: int, bits: int) -> bytes:
    """The ``lowrank`` payload of the flat float32 array ``x`` holding tensors of ``shapes``; its
    matrices on the codec threads (:func:`set_codec_threads`), each with a generator of its own,
    so the payload does not depend on their number."""
    flat = torch.from_numpy(x)
    mats, rest, at = [], [], 0
    for shape in shapes:
        size = math.prod(shape)
        part = flat[at:at + size]
        at += size
        if _plan.lowrank_matrix(shape, rank, bits):
            mats.append((part, shape))
        else:
            rest.append(part)

    def one(item: tuple[torch.Tensor, tuple[int, ...]]) -> bytes:
        part, shape = item
        a, b = _top_factors(part.reshape(*_plan.lowrank_rows_cols(shape)), rank)
        (sa, ca), (sb, cb) = _lowrank_quantise(a, bits), _lowrank_quantise(b, bits)
        return b"".join([sa.numpy().astype("<f4").tobytes(), sb.numpy().astype("<f4").tobytes(),
                         _pack_codes(ca, bits), _pack_codes(cb, bits)])

    out = _codec_map(one, mats)
    if rest:
        scales, q = _quantise_int8(torch.cat(rest).numpy(), DEFAULT_BLOCK)
        out += [scales.astype("<f4", copy=False).tobytes(), q.tobytes()]
    return b"".join(out)


def _lowrank_decode(buf: memoryview, shapes: list[tuple[int, ...]], rank: int, bits: int) -> torch.Tensor:
    """The flat float32 tensor of a ``lowrank`` payload whose length was checked; its matrices on
    the codec threads (:func:`set_codec_threads`), each by elementwise float32 arithmetic, so the
    bits do not depend on their number."""
    # per matrix: (m, n, its codes' offset in the payload, scales of A, scales of B, its place in the output)
    mats: list[tuple[int, int, int, torch.Tensor, torch.Tensor, int]] = []
    rest_places: list[tuple[int, int]] = []  # (place in the output, size) of the int8 part's tensors
    rest_at, at, place = 0, 0, 0
    for shape in shapes:  # the scales checked and each matrix's codes located, in payload order
        size = math.prod(shape)
        if not _plan.lowrank_matrix(shape, rank, bits):
            rest_places.append((place, size))
            rest_at += size
            place += size
            continue
        m, n = _plan.lowrank_rows_cols(shape)
        scales = np.frombuffer(buf[at:at + 8 * rank], dtype="<f4")
        if not np.isfinite(scales).all() or (scales < 0).any():
            raise CodecError("lowrank payload has a negative or non-finite factor scale")
        at += 8 * rank
        mats.append((m, n, at, torch.from_numpy(scales[:rank].copy()), torch.from_numpy(scales[rank:].copy()), place))
        at += math.ceil(rank * m * bits / 8) + math.ceil(rank * n * bits / 8)
        place += size
    out = torch.empty(place)  # each matrix decoded into its place: no concatenation afterwards

    def one(job: tuple[int, int, int, torch.Tensor, torch.Tensor, int]) -> None:
        m, n, c, sa, sb, start = job
        la, lb = math.ceil(rank * m * bits / 8), math.ceil(rank * n * bits / 8)
        a = _unpack_codes(buf[c:c + la], m, rank, bits) * sa
        b = _unpack_codes(buf[c + la:c + la + lb], n, rank, bits) * sb
        mat = out[start:start + m * n].view(m, n)
        # One outer product at a time, elementwise: the same bits on every machine and thread
        # count. A block of rows at a time, so that the sum stays in the cache between terms.
        rows = max(1, LOWRANK_DECODE_BLOCK // n)
        term = torch.empty(min(rows, m), n) if rank > 1 else None
        for r0 in range(0, m, rows):
            blk = mat[r0:r0 + rows]
            torch.mul(a[r0:r0 + rows, 0:1], b[:, 0], out=blk)
            for j in range(1, rank):
                t = term[:blk.shape[0]]
                torch.mul(a[r0:r0 + rows, j:j + 1], b[:, j], out=t)
                blk.add_(t)

    _codec_map(one, mats)
    if rest_at:
        rest = torch.from_numpy(np.require(_dequantise_int8(buf[at:], rest_at, DEFAULT_BLOCK), requirements="W"))
        r = 0
        for start, size in rest_places:
            out[start:start + size] = rest[r:r + size]
            r += size
    return out


def _tern_signs() -> torch.Tensor:
    """The fixed signs ``D`` of ``tern``'s rotation: the top bit of SplitMix64 of each position, so
    every sender and receiver derives the same ones without a random generator's version."""
    z = np.arange(1, TERN_BLOCK + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return torch.from_numpy(1.0 - 2.0 * (z >> np.uint64(63)).astype(np.float32))


_TERN_SIGNS = _tern_signs()
_TERN_TABLE = None  # byte -> its five digits, built on first decode


def _fwht(rows: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each row (length a power of two); its own inverse.
    Butterflies of elementwise adds and subtracts, so every machine gets the same bits."""
    n = rows.shape[1]
    x = rows
    h = 1
    while h < n:
        x = x.view(-1, n // (2 * h), 2, h)
        x = torch.stack((x[:, :, 0] + x[:, :, 1], x[:, :, 0] - x[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(-1, n) * (1.0 / math.sqrt(n))


def _rotated_blocks(x: np.ndarray) -> tuple[int, torch.Tensor]:
    """The number of ``TERN_BLOCK``-element blocks of the flat float32 array ``x`` (the last one
    padded with zeros) and the blocks rotated, ``H D x`` (rows of the returned tensor): what
    ``tern``, ``tern-sr``, ``quad``, ``oct`` and ``tern-dither`` quantise."""
    nb = -(-x.size // TERN_BLOCK)
    padded = torch.zeros(nb * TERN_BLOCK)
    padded[:x.size] = torch.from_numpy(x)
    return nb, _fwht(padded.view(nb, TERN_BLOCK) * _TERN_SIGNS)


def _rotated_rms(x: np.ndarray) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_rotated_blocks` with each coordinate's magnitude and each block's RMS (a column),
    what ``tern`` and ``oct`` set their thresholds by."""
    nb, r = _rotated_blocks(x)
    return nb, r, r.abs(), r.square().mean(dim=1, keepdim=True).sqrt()


def _tern_encode(x: np.ndarray) -> bytes:
    """The ``tern`` payload of the flat float32 array ``x``."""
    if x.size == 0:
        return b""
    nb, r, absr, rms = _rotated_rms(x)
    keep = absr > TERN_THRESHOLD * rms
    cnt = keep.sum(dim=1)
    level = torch.where(keep, absr, torch.zeros_like(absr)).sum(dim=1) / cnt.clamp_min(1)
    # bf16, not fp16: activation gradients are often below fp16's smallest normal (6e-5)
    level16 = level.to(torch.bfloat16)
    if not (bool(torch.isfinite(level16).all()) and bool(torch.isfinite(rms).all())):
        raise CodecError("tern: the tensor's values (near the float32 limit) overflow its rotation or the "
                         "bf16 range of a block level; use the int8 or raw codec for this tensor")
    digits = (keep.to(torch.uint8) + (keep & (r < 0)).to(torch.uint8)).reshape(-1).numpy()  # 0, 1 (+a), 2 (-a)
    return _pack_tern(level16, digits)


def _pack_tern(level16: torch.Tensor, digits: np.ndarray) -> bytes:
    """The ``tern`` payload of bf16 block levels and digits 0, 1 (+a), 2 (-a), one per rotated coordinate."""
    pad = -digits.size % TERN_PER_BYTE
    if pad:
        digits = np.concatenate([digits, np.zeros(pad, dtype=np.uint8)])
    d = digits.reshape(-1, TERN_PER_BYTE)
    packed = d[:, TERN_PER_BYTE - 1].copy()
    for j in range(TERN_PER_BYTE - 2, -1, -1):  # Horner: every partial value stays below 243
        packed *= 3
        packed += d[:, j]
    return level16.view(torch.int16).numpy().astype("<i2", copy=False).tobytes() + packed.tobytes()


_MASK64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on uint64s (wrapping arithmetic): a fixed, well-mixed hash."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sr_key(*parts: int) -> int:
    """One 64-bit rounding key of the integers ``parts`` (e.g. run seed, stage, step, micro-batch,
    direction), for :func:`encode`'s ``key``: each part hashed into the running key in turn."""
    k = np.uint64(0x6A09E667F3BCC909)
    for p in parts:
        k = _splitmix64(np.array([k ^ np.uint64(int(p) & _MASK64)], dtype=np.uint64)
                        + np.uint64(0x9E3779B97F4A7C15))[0]
    return int(k)


def _data_seed(key: int, x: np.ndarray) -> int:
    """The draw seed of a stochastic codec: ``key`` and a checksum of ``x``'s bytes (read in place)."""
    return sr_key(key, zlib.crc32(np.ascontiguousarray(x)))


def _uniform24(key: int, x: np.ndarray, n: int) -> torch.Tensor:
    """``n`` integers uniform in [0, 2^24), fixed by ``key`` and the bytes of ``x``: SplitMix64 of a
    counter (:func:`_draws`), so every machine draws the same ones without a random generator's version."""
    return torch.from_numpy((_draws(_data_seed(key, x), 0, n) >> np.uint64(40)).astype(np.int32))



def _bf16_level_up(top: torch.Tensor, codec: str, headroom: float) -> torch.Tensor:
    """Blocks' largest ``|r|`` rounded up to bf16 (one step of its last bit where bf16 rounded
    down), so that no coordinate exceeds its block's level; a level whose ``headroom`` multiple
    overflows is refused in one line (the encoder's arithmetic needs that room)."""
    level16 = top.to(torch.bfloat16)
    if not bool(torch.isfinite(level16.to(torch.float32) * headroom).all()):
        raise CodecError(f"{codec}: the tensor's values (near the float32 limit) overflow its rotation or the "
                         "bf16 range of a block level; use the int8 or raw codec for this tensor")
    up = level16.to(torch.float32) < top
    return torch.where(up, (level16.view(torch.int16) + 1).view(torch.bfloat16), level16)

def _tern_sr_encode(x: np.ndarray, key: int) -> bytes:
    """The ``tern-sr`` payload of the flat float32 array ``x``: ``tern``'s rotation and format, each
    coordinate rounded at random to 0 or to the block's level (its largest ``|r|``, rounded up to
    bf16) with the probabilities that make the decoded block's mean ``r`` exactly (to 2^-24)."""
    n = x.size
    if n == 0:
        return b""
    nb, r = _rotated_blocks(x)
    absr = r.abs()
    level16 = _bf16_level_up(absr.amax(dim=1), "tern-sr", 2)  # every |r| / level <= 1
    level = level16.to(torch.float32)
    prob = absr / torch.where(level > 0, level, torch.ones_like(level))[:, None]  # in [0, 1]
    u = _uniform24(key, x, nb * TERN_BLOCK).view(nb, TERN_BLOCK).to(torch.float32)  # exact: below 2^24
    keep = u < prob * (1 << 24)  # P(keep) = ceil(prob 2^24) / 2^24 (a power-of-two product: exact)
    digits = (keep.to(torch.uint8) + (keep & (r < 0)).to(torch.uint8)).reshape(-1).numpy()
    return _pack_tern(level16, digits)


def _tern_decode(buf: memoryview, numel: int) -> torch.Tensor:
    """The float32 tensor of a ``tern`` payload whose length was checked."""
    global _TERN_TABLE
    if numel == 0:
        return torch.zeros(0)
    G = TERN_BLOCK
    nb = -(-numel // G)
    levels = _bf16_scales(buf, nb, "tern payload has a negative or non-finite block level")
    packed = np.frombuffer(buf[2 * nb:], dtype=np.uint8)
    if (packed >= 3 ** TERN_PER_BYTE).any():
        raise CodecError(f"tern payload has a byte of {int(packed.max())}; five ternary digits are < 243")
    if _TERN_TABLE is None:  # byte -> its five digits as values 0, +1, -1
        b = np.arange(3 ** TERN_PER_BYTE)
        digit = np.stack([(b // 3 ** j) % 3 for j in range(TERN_PER_BYTE)], axis=1)
        _TERN_TABLE = np.array([0.0, 1.0, -1.0], dtype=np.float32)[digit]
    vals = _TERN_TABLE[packed].reshape(-1)
    if vals[nb * G:].any():
        raise CodecError("tern payload has digits set past its last block")
    return _unrotate(torch.from_numpy(vals[: nb * G].reshape(nb, G)) * torch.from_numpy(levels)[:, None], numel)


def _quad_encode(x: np.ndarray) -> bytes:
    """The ``quad`` payload of the flat float32 array ``x``: per rotated block one bf16 scale, then
    a 2-bit code per coordinate (bit 0: outer level, bit 1: negative), four per byte."""
    n = x.size
    if n == 0:
        return b""
    nb, r = _rotated_blocks(x)
    absr = r.abs()
    rms = r.square().mean(dim=1, keepdim=True).sqrt()
    outer = absr > QUAD_THRESHOLD * rms
    c = torch.where(outer, QUAD_LEVELS[1], QUAD_LEVELS[0])
    scale = ((absr * c).sum(dim=1) / (c * c).sum(dim=1)).to(torch.bfloat16)  # least squares for these codes
    if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(rms).all())):
        raise CodecError("quad: the tensor's values (near the float32 limit) overflow its rotation or the "
                         "bf16 range of a block scale; use the int8 or raw codec for this tensor")
    code = (outer.to(torch.uint8) | ((r < 0).to(torch.uint8) << 1)).reshape(-1, 4).numpy()
    packed = code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)
    return scale.view(torch.int16).numpy().astype("<i2", copy=False).tobytes() + packed.tobytes()


_QUAD_TABLE = None  # byte -> its four values in units of the scale, built on first decode


def _quad_decode(buf: memoryview, numel: int) -> torch.Tensor:
    """The float32 tensor of a ``quad`` payload whose length was checked (every byte is valid)."""
    global _QUAD_TABLE
    if numel == 0:
        return torch.zeros(0)
    G = TERN_BLOCK
    nb = -(-numel // G)
    scales = _bf16_scales(buf, nb, "quad payload has a negative or non-finite block scale")
    if _QUAD_TABLE is None:
        b = np.arange(256)
        code = np.stack([(b >> (2 * j)) & 3 for j in range(4)], axis=1)
        mag = np.array(QUAD_LEVELS, dtype=np.float32)[code & 1]
        _QUAD_TABLE = np.where(code & 2, -mag, mag).astype(np.float32)
    vals = _QUAD_TABLE[np.frombuffer(buf[2 * nb:], dtype=np.uint8)].reshape(nb, G)
    return _unrotate(torch.from_numpy(vals) * torch.from_numpy(scales)[:, None], numel)


def _oct_encode(x: np.ndarray) -> bytes:
    """The ``oct`` payload of the flat float32 array ``x``: per rotated block one bf16 scale, then a
    3-bit code per coordinate (bits 0-1: magnitude level, bit 2: negative), packed little-endian
    bit after bit (eight codes in three bytes)."""
    if x.size == 0:
        return b""
    nb, r, absr, rms = _rotated_rms(x)
    mag = torch.zeros_like(absr, dtype=torch.uint8)
    for t in OCT_THRESHOLDS:
        mag += (absr > t * rms).to(torch.uint8)
    c = torch.tensor(OCT_LEVELS)[mag.long()]
    scale = ((absr * c).sum(dim=1) / (c * c).sum(dim=1)).to(torch.bfloat16)  # least squares for these codes
    if not (bool(torch.isfinite(scale).all()) and bool(torch.isfinite(rms).all())):
        raise CodecError("oct: the tensor's values (near the float32 limit) overflow its rotation or the "
                         "bf16 range of a block scale; use the int8 or raw codec for this tensor")
    code = (mag | ((r < 0).to(torch.uint8) << 2)).reshape(-1).numpy()
    bits = np.unpackbits(code[:, None], axis=1, bitorder="little")[:, :3]
    packed = np.packbits(bits.reshape(-1), bitorder="little")
    return scale.view(torch.int16).numpy().astype("<i2", copy=False).tobytes() + packed.tobytes()


def _oct_decode(buf: memoryview, numel: int) -> torch.Tensor:
    """The float32 tensor of an ``oct`` payload whose length was checked (every code is valid)."""
    if numel == 0:
        return torch.zeros(0)
    G = TERN_BLOCK
    nb = -(-numel // G)
    scales = _bf16_scales(buf, nb, "oct payload has a negative or non-finite block scale")
    bits = np.unpackbits(np.frombuffer(buf[2 * nb:], dtype=np.uint8), bitorder="little").reshape(-1, 3)
    code = bits[:, 0] | (bits[:, 1] << 1) | (bits[:, 2] << 2)
    mag = np.array(OCT_LEVELS, dtype=np.float32)[code & 3]
    vals = np.where(code & 4, -mag, mag).reshape(nb, G)
    return _unrotate(torch.from_numpy(vals) * torch.from_numpy(scales)[:, None], numel)


def _pc_low_rank(coef: torch.Tensor, dirs: torch.Tensor) -> torch.Tensor:
    """``coef @ dirs`` as one multiply-add per direction in a fixed order (elementwise float32
    operations, so that every machine decodes the same bits, as the rotation's butterflies do)."""
    out = torch.zeros(coef.shape[0], dirs.shape[1])
    for j in range(dirs.shape[0]):
        out += coef[:, j:j + 1] * dirs[j]
    return out


def _pc_directions(xc: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` orthonormal directions (rows, over the channels) close to the top principal
    directions of the centred rows ``xc``: a few steps of subspace iteration from a fixed start,
    then the best ``k`` of that subspace. The decoder only reads what is sent, so any directions
    decode correctly; better ones leave less for ``quad``."""
    R, C = xc.shape
    m = min(C, k + 4)  # a few spare columns make the iteration converge on the top k
    top = float(xc.abs().max())
    if top == 0.0:
        return torch.zeros(k, C)
    y = xc / top  # the iteration's products stay far from the float32 range
    q = torch.linalg.qr(torch.randn(C, m, generator=torch.Generator().manual_seed(0))).Q
    for _ in range(4):
        q = torch.linalg.qr(y.T @ (y @ q)).Q
    b = y @ q
    _, w = torch.linalg.eigh(b.T @ b)  # ascending
    d = (q @ w[:, -k:].flip(1)).T.contiguous()
    return d if bool(torch.isfinite(d).all()) else torch.zeros(k, C)


def _quad_pc_encode(x: np.ndarray, channels: int) -> bytes:
    """The ``quad-pc`` payload of the flat float32 array ``x`` of ``channels`` channels (the
    fastest varying index): the channel means, ``k`` directions over the channels and each row's
    ``k`` coefficients on them (bf16, in that order), then the ``quad`` payload of the rest."""
    if x.size == 0:
        return b""
    rows = torch.from_numpy(x).view(-1, channels)
    k = min(PC_RANK, channels)
    # float64 sums: a float32 running sum over many rows would lose the means' low bits
    mean16 = rows.to(torch.float64).mean(dim=0).to(torch.bfloat16)
    xc = rows - mean16.to(torch.float32)
    dirs16 = _pc_directions(xc, k).to(torch.bfloat16)
    dirs = dirs16.to(torch.float32)
    coef16 = (xc @ dirs.T).to(torch.bfloat16)
    if not (bool(torch.isfinite(mean16).all()) and bool(torch.isfinite(coef16).all())):
        raise CodecError("quad-pc: a channel mean or a coefficient overflows bf16; use the int8 or raw codec "
                         "for this tensor")
    # what quad sends is measured against the decoder's own reconstruction (rounded coefficients
    # and directions), so their rounding costs nothing but a larger rest
    rest = (xc - _pc_low_rank(coef16.to(torch.float32), dirs)).reshape(-1).numpy()
    side = torch.cat([mean16, dirs16.reshape(-1), coef16.reshape(-1)])
    return side.view(torch.int16).numpy().astype("<i2", copy=False).tobytes() + _quad_encode(rest)


def _quad_pc_decode(buf: memoryview, numel: int, channels: int) -> torch.Tensor:
    """The float32 tensor of a ``quad-pc`` payload whose length was checked: the ``quad`` part
    decoded, plus each row's coefficients times the directions, plus the channel means."""
    if numel == 0:
        return torch.zeros(0)
    C, R, k = channels, numel // channels, min(PC_RANK, channels)
    n_side = C + k * C + k * R
    side = torch.from_numpy((np.frombuffer(buf[: 2 * n_side], dtype="<u2").astype(np.uint32)
                             << np.uint32(16)).view(np.float32))
    if not bool(torch.isfinite(side).all()):
        raise CodecError("quad-pc payload has a non-finite channel mean, direction or coefficient")
    mean, dirs, coef = side[:C], side[C:C + k * C].view(k, C), side[C + k * C:].view(R, k)
    out = _quad_decode(buf[2 * n_side:], numel).view(R, C) + _pc_low_rank(coef, dirs) + mean
    if not bool(torch.isfinite(out).all()):
        raise CodecError("quad-pc payload decodes to values beyond the float32 range")
    return out.reshape(-1)


def _draws(seed: int, start: int, n: int) -> np.ndarray:
    """``n`` uint64 draws, SplitMix64 of the counters ``start`` .. ``start + n - 1`` under ``seed``."""
    ctr = np.arange(start, start + n, dtype=np.uint64)
    return _splitmix64(ctr * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed))


def _td_positions(seed: int, nb: int) -> torch.Tensor:
    """The rotated coordinates ``tern-dither`` keeps, ``(nb, TD_KEPT)`` in-block indices: the first
    ``TD_KEPT`` of a random permutation of each block (drawn from ``seed``), so every coordinate is
    kept with probability ``TD_KEPT / TERN_BLOCK``."""
    z = (_draws(seed, 0, nb * TERN_BLOCK) >> np.uint64(1)).astype(np.int64)
    order = torch.argsort(torch.from_numpy(z).view(nb, TERN_BLOCK), dim=1, stable=True)
    return order[:, :TD_KEPT].contiguous()


def _td_dither(seed: int, level: torch.Tensor) -> torch.Tensor:
    """The dither of ``tern-dither``, ``(nb, TD_KEPT)``: per kept coordinate one of the 2^24
    midpoints of ``(-a / 2, a / 2)`` (``a`` its block's level), drawn from ``seed``; encoder and
    decoder compute it with the same float32 operations."""
    nb = level.shape[0]
    k = torch.from_numpy((_draws(seed, nb * TERN_BLOCK, nb * TD_KEPT) >> np.uint64(40)).astype(np.int32))
    return level[:, None] * (((2 * k.view(nb, TD_KEPT).to(torch.float32) + 1) / (1 << 24) - 1) / 2)


def _tern_dither_encode(x: np.ndarray, key: int) -> bytes:
    """The ``tern-dither`` payload of the flat float32 array ``x``: the draw seed, the blocks' bf16
    levels, then the kept coordinates' ternary digits, five per byte (``TD_KEPT / 5`` bytes a block)."""
    n = x.size
    if n == 0:
        return b""
    seed = _data_seed(key, x)
    nb, r = _rotated_blocks(x)
    kept = torch.gather(r, 1, _td_positions(seed, nb))
    # every |r| <= a: r + u stays inside (-1.5 a, 1.5 a), where rounding to {-a, 0, a} with the
    # dither subtracted is unbiased
    level16 = _bf16_level_up(kept.abs().amax(dim=1), "tern-dither", 4)
    level = level16.to(torch.float32)
    safe = torch.where(level > 0, level, torch.ones_like(level))[:, None]
    t = torch.clamp(torch.floor((kept + _td_dither(seed, level)) / safe + 0.5), -1, 1)
    digits = torch.where(t < 0, 2, t).to(torch.uint8).reshape(-1).numpy()  # 0, 1 (+a), 2 (-a)
    head = np.array([seed], dtype="<u8").tobytes()
    return head + _pack_tern(level16, digits)


_TD_VALUES = np.array([0.0, 1.0, -1.0], dtype=np.float32)


def _tern_dither_decode(buf: memoryview, numel: int) -> torch.Tensor:
    """The float32 tensor of a ``tern-dither`` payload whose length was checked: each kept rotated
    coordinate is ``(t a - u) TERN_BLOCK / TD_KEPT`` (its digit times the level, the dither
    subtracted, over the keep probability), the others 0."""
    if numel == 0:
        return torch.zeros(0)
    G = TERN_BLOCK
    nb = -(-numel // G)
    seed = int(np.frombuffer(buf[:TD_SEED_BYTES], dtype="<u8")[0])
    level = torch.from_numpy(_bf16_scales(buf[TD_SEED_BYTES:], nb,
                                          "tern-dither payload has a negative or non-finite block level"))
    packed = np.frombuffer(buf[TD_SEED_BYTES + 2 * nb:], dtype=np.uint8)
    if (packed >= 3 ** TERN_PER_BYTE).any():
        raise CodecError(f"tern-dither payload has a byte of {int(packed.max())}; five ternary digits are < 243")
    digits = np.stack([(packed // 3 ** j) % 3 for j in range(TERN_PER_BYTE)], axis=1).reshape(nb, TD_KEPT)
    t = torch.from_numpy(_TD_VALUES[digits])
    vals = (t * level[:, None] - _td_dither(seed, level)) * (G / TD_KEPT)
    r = torch.zeros(nb, G)
    r.scatter_(1, _td_positions(seed, nb), vals)
    return _unrotate(r, numel)


def _dequantise_int8(buf: memoryview, numel: int, block: int) -> np.ndarray:
    """The ``numel`` float32 values of a blockwise int8 payload (scales, then codes)."""
    nb = _n_blocks(numel, block)
    scales = np.frombuffer(buf[: 4 * nb], dtype="<f4")
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise CodecError("int8 payload has a negative or non-finite block scale")
    q = np.frombuffer(buf[4 * nb :], dtype=np.int8)
    padded = np.zeros(nb * block, dtype=np.float32)
    padded[:numel] = q
    return (padded.reshape(nb, block) * scales[:, None]).reshape(-1)[:numel]


def roundtrip(
    tensor: torch.Tensor, codec: str, block: int = DEFAULT_BLOCK
) -> tuple[torch.Tensor, int]:
    """``decode(encode(tensor))`` in the tensor's dtype and the payload size in bytes."""
    payload, meta = encode(tensor, codec, block)
    return decode(payload, meta, tensor.shape, tensor.dtype), len(payload)


class ErrorFeedback:
    """Error-feedback wrapper for lossy codecs, keyed by tensor name.

    For a tensor ``g`` named ``name`` it encodes ``g + r`` where ``r`` is the residual
    left by the previous encode of that name, then keeps ``r' = (g + r) - decode(...)``.
    The sum of what was sent therefore tracks the sum of what should have been sent, with
    an error bounded by one step's quantisation error instead of one that grows with the
    number of steps. Use one instance per (sender, receiver) stream: a worker's gradient
    push, or a server's weight pull towards one worker. Thread-safe.
    """

    def __init__(self, codec: str = "int8", block: int = DEFAULT_BLOCK):
        _check_codec(codec, block)
        self.codec = codec  # codec used for every encode
        self.block = block  # int8 block size
        self._residual: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def encode(self, name: str, tensor: torch.Tensor, layout=None) -> tuple[bytes, dict[str, Any]]:
        """Encode ``tensor`` plus the residual kept for ``name``; update the residual
        (``layout``: the shapes a flat ``lowrank`` tensor holds, see :func:`encode`)."""
        x = tensor.detach().to("cpu", torch.float32)
        with self._lock:
            old = self._residual.pop(name, None)
            try:
                r = old if old is not None and old.shape == x.shape else None  # (a new shape: afresh)
                corrected = x if r is None else x + r
                del r  # (a whole stage's residual: not held beside the encode's work)
                payload, meta = encode(corrected, self.codec, self.block, layout=layout)
            except BaseException:
                if old is not None:
                    self._residual[name] = old
                raise
            del old
            if self.codec != "raw":
                sent = decode(payload, meta, corrected.shape, torch.float32, layout=layout)
                # corrected - sent, in sent's memory (a + (-b) is a - b, bit for bit)
                self._residual[name] = sent.neg_().add_(corrected)
            return payload, meta

    def residual(self, name: str) -> torch.Tensor | None:
        """The residual currently kept for ``name`` (None if none)."""
        with self._lock:
            r = self._residual.get(name)
            return None if r is None else r.clone()

    def take(self, name: str) -> torch.Tensor | None:
        """The residual kept for ``name``, forgotten here (None if none): no copy of it is made."""
        with self._lock:
            return self._residual.pop(name, None)

    def state(self) -> dict[str, torch.Tensor]:
        """Every residual kept, by name (a snapshot: later encodes replace, never modify, them)."""
        with self._lock:
            return dict(self._residual)

    def load(self, residuals: dict[str, torch.Tensor]) -> None:
        """Start from ``residuals`` (as :meth:`state` gave them, e.g. from a checkpoint)."""
        with self._lock:
            self._residual = {n: r.detach().to("cpu", torch.float32).clone() for n, r in residuals.items()}

    def reset(self, name: str | None = None) -> None:
        """Forget the residual of ``name``, or of every tensor."""
        with self._lock:
            if name is None:
                self._residual.clear()
            else:
                self._residual.pop(name, None)


@dataclass
class CompressionConfig:
    """Which codec each kind of traffic uses (the run's or plan's compression choice)."""

    activations: str = "raw"  # forward activations between stages
    act_grads: str = "raw"  # backward gradients w.r.t. activations between stages
    grad_push: str = "raw"  # worker -> stage server parameter gradients
    weight_pull: str = "raw"  # stage server -> worker weights
    block: int = DEFAULT_BLOCK  # int8 block size
    error_feedback: bool = True  # keep residuals for lossy grad_push / weight_pull

    def __post_init__(self) -> None:
        for kind in ("activations", "act_grads", "grad_push", "weight_pull"):
            _check_codec(getattr(self, kind), self.block)

    def codec_for(self, kind: str) -> str:
        """The codec of traffic ``kind`` (one of the field names above)."""
        if kind not in ("activations", "act_grads", "grad_push", "weight_pull"):
            raise CodecError(f"unknown traffic kind {kind!r}")
        return getattr(self, kind)

    def sync_fractions(self) -> tuple[float, float]:
        """``(act_compression, grad_compression)`` as bytes on the wire per fp32 byte.

        These are the factors of :class:`shoal.plan.types.SyncPolicy` relative to fp32;
        the planner multiplies raw fp32 sizes by them.
        """
        act = max(wire_fraction(self.activations, self.block), wire_fraction(self.act_grads, self.block))
        grad = max(wire_fraction(self.grad_push, self.block), wire_fraction(self.weight_pull, self.block))
        return act, grad


class WireCounter:
    """Counts raw (fp32-equivalent) and on-the-wire bytes per link class. Thread-safe."""

    def __init__(self) -> None:
        self._counts: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def add(self, link_class: str, numel: int, wire_bytes: int) -> None:
        """Record one tensor of ``numel`` elements sent as ``wire_bytes`` on ``link_class``."""
        with self._lock:
            c = self._counts.setdefault(link_class, [0, 0, 0])
            c[0] += 4 * numel
            c[1] += wire_bytes
            c[2] += 1

    def add_bytes(self, link_class: str, raw_bytes: int, wire_bytes: int) -> None:
        """Record one message of ``raw_bytes`` (fp32-equivalent) sent as ``wire_bytes``."""
        with self._lock:
            c = self._counts.setdefault(link_class, [0, 0, 0])
            c[0] += raw_bytes
            c[1] += wire_bytes
            c[2] += 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{link_class: {"raw": bytes, "wire": bytes, "messages": n, "ratio": raw/wire}}``."""
        with self._lock:
            return {
                k: {"raw": raw, "wire": wire, "messages": n, "ratio": raw / wire if wire else 1.0}
                for k, (raw, wire, n) in sorted(self._counts.items())
            }
