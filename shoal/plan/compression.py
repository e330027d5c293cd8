"""Wire sizes of the compression codecs, per traffic kind, as the planner and simulator see them.

Pure functions only (no torch): the runtime's codecs live in :mod:`shoal.net.compress`; this
module computes how many bytes each one puts on the wire so the cost model and the simulator
can charge them. Sizes are per tensor element; ``raw`` is the compute dtype's width
(``Workload.dtype_bytes``: 2 for fp16/bf16, 4 for fp32).

Codecs (see ``docs/sync-policies.md``):

* ``none`` -- the compute dtype: ``raw`` bytes per element;
* ``fp16`` -- 2 bytes per element (no saving when the compute dtype already is 16-bit);
* ``int8`` -- blockwise absmax int8: 1 byte per element plus one fp32 scale per block of
  ``INT8_BLOCK`` elements: ``1 + 4 / INT8_BLOCK`` bytes per element;
* ``topk-int8[:rho]`` -- the ``rho`` fraction of largest-magnitude entries (default
  ``TOPK_DENSITY``), each as an int32 index plus an int8 value, plus one fp32 scale per block
  of kept values: ``rho (4 + 1 + 4 / INT8_BLOCK)`` bytes per element; only for pushes and
  pulls (pseudo-gradients and weight deltas, with error feedback), never for activations;
* ``sparse[:rho[:bits]]`` -- chunked top-k for pseudo-gradients: each chunk of ``SPARSE_CHUNK``
  elements keeps its ``ceil(rho * SPARSE_CHUNK)`` largest entries, each as a
  ``SPARSE_INDEX_BITS``-bit index inside its chunk plus a ``bits``-bit value, with one bf16 scale
  per chunk: ``(ceil(rho C) (SPARSE_INDEX_BITS + bits) / 8 + 2) / C`` bytes per element (defaults
  ``SPARSE_DENSITY`` and ``SPARSE_BITS``); pushes and pulls only, with error feedback.
* ``lowrank[:rank[:bits]]`` -- low-rank pseudo-gradients: each weight matrix of a stage (``m`` rows
  by ``n``, a tensor of more dimensions as its first by the rest) as the ``rank`` leading singular
  directions of its change, two factors of ``bits``-bit codes with one fp32 scale per factor column:
  ``8 rank + ceil(rank m bits / 8) + ceil(rank n bits / 8)`` bytes (:func:`lowrank_nbytes`); tensors
  where that saves little (vectors, tiny matrices: :func:`lowrank_matrix`) go as ``int8``. Per
  element it depends on the shapes: a transformer block of width ``d`` is ``16 d`` rows and columns
  over ``12 d^2`` weights, ``rank bits / (6 d)`` bytes per weight (:func:`lowrank_rate`): 1,313x
  smaller than bf16 at ``d`` 2,048, rank 3, 4 bits. Pushes and pulls only, with error feedback.
* ``tern`` -- rotated blockwise ternary for activations and activation gradients: each block of
  ``TERN_BLOCK`` elements is rotated (random signs, then a Walsh-Hadamard transform) and each
  rotated coordinate sent as one of ``{-a, 0, +a}``, five per byte, with one bf16 ``a`` per block:
  ``(2 + TERN_BLOCK / 5) / TERN_BLOCK`` bytes per element (1.725 bits, 9.28x smaller than bf16);
  act and grad only (no error feedback: every micro-batch's tensor is new);
* ``tern-sr`` -- ``tern``'s format and size with stochastic (unbiased) rounding: each rotated
  coordinate becomes 0 or the block's largest magnitude at random, so that its mean is the
  coordinate: an unbiased activation gradient; grad only (its error is 6.8x tern's, a price only
  worth paying where bias adds up over steps);
* ``quad`` -- ``tern``'s rotation with four levels (2 bits, the Lloyd-Max levels of a Gaussian)
  and one bf16 scale per block: ``(2 + TERN_BLOCK / 4) / TERN_BLOCK`` bytes per element (2.125
  bits, 7.53x smaller than bf16); with ``tern-sr`` gradients the pair is 8.31x smaller.
* ``oct`` -- ``quad`` with eight levels (3 bits): ``(2 + 3 TERN_BLOCK / 8) / TERN_BLOCK`` bytes per
  element (3.125 bits, 5.12x smaller than bf16);
* ``tern-dither`` -- unbiased activation gradients under 1 bit: of each rotated block a random
  ``TD_KEPT`` of its ``TERN_BLOCK`` coordinates, one ternary digit each with subtractive dither
  (five per byte), one bf16 level per block and an 8-byte seed per tensor: ``TD_SEED_BYTES + (2 +
  TD_KEPT / 5) n_blocks`` bytes (0.8125 bits per element in a large tensor); grad only.
  ``act=oct,grad=tern-dither`` is 8.13x smaller than bf16.
* ``quad-pc`` -- activations as ``C`` channel means, ``PC_RANK`` principal directions and ``quad``:
  a tensor of ``R`` rows of ``C`` channels (its last dimension; fewer than two dimensions: one
  channel) is sent as its channel means, ``k = min(PC_RANK, C)`` directions over the channels and
  each row's ``k`` coefficients on them (all bf16), then ``quad`` of what they leave:
  ``2 C + 2 k C + 2 k R + (2 + TERN_BLOCK / 4) n_blocks`` bytes, 2.125 + 16 / R + 16 k / R +
  16 k / C bits per element (2.70 at R 1,024, C 128). The cost model and the simulator charge
  these bytes at the activation's shape (a micro-batch's tokens by the model's width,
  ``ModelProfile.act_shape``); without a shape, ``quad`` plus a 128-channel tensor's coefficients
  (2.625 bits). ``act=quad-pc,grad=tern-dither`` is 3.52 bits at R 1,024, C 128: 9.1x smaller
  than bf16.

Traffic kinds: ``act`` (activations sent forward), ``grad`` (activation gradients sent
backward), ``push`` (gradient or pseudo-gradient pushes to the server), ``pull`` (weight pulls
from the server).
"""

from __future__ import annotations

import math

from shoal.errors import ShoalError

INT8_BLOCK = 128  # elements per int8 scale (the runtime codec's default block, shoal.net.compress.DEFAULT_BLOCK)
TOPK_DENSITY = 0.1  # fraction of entries a top-k codec keeps unless the spec says otherwise
KINDS = ("act", "grad", "push", "pull")  # traffic kinds with their own codec
CODECS = ("none", "fp16", "int8", "topk-int8", "sparse", "lowrank", "tern", "tern-sr", "quad", "oct", "quad-pc",
          "tern-dither")  # codec names (the sparse ones take arguments)
_SPARSE_KINDS = ("push", "pull")  # kinds where a top-k codec is allowed
SPARSE_CHUNK = 4096  # elements per chunk of the ``sparse`` codec (indices are local to a chunk)
SPARSE_INDEX_BITS = 12  # bits of one in-chunk index: log2(SPARSE_CHUNK)
SPARSE_DENSITY = 0.01  # fraction of each chunk ``sparse`` keeps unless the spec says otherwise
# The codec of a sparse run's dense last round (shoal.runtime.sync.codecs.dense_round): int8
# (block scales) is 4x fewer bytes than fp32 for a one-off that costs each worker its whole stage
# over its uplink, and moved the final weights' validation loss by at most 1e-4 in-process
# (bench/results/sparse-sync.md).
DENSE_ROUND_CODEC = "int8"
SPARSE_BITS = 2  # bits per kept value of ``sparse`` unless the spec says otherwise
LOWRANK_RANK = 3  # singular directions per matrix ``lowrank`` sends unless the spec says otherwise
LOWRANK_BITS = 4  # bits per factor entry of ``lowrank`` unless the spec says otherwise
LOWRANK_BIT_CHOICES = (4, 8)  # factor widths the lowrank codec packs
LOWRANK_MAX_RANK = 64  # the largest rank a lowrank codec (and a decoder) accepts
SPARSE_BIT_CHOICES = (1, 2, 3, 4, 8)  # value widths the sparse codec can pack
_ACT_KINDS = ("act", "grad")  # kinds where the activation codecs (ACT_ONLY) are allowed
ACT_ONLY = ("tern", "tern-sr", "quad", "oct", "quad-pc", "tern-dither")  # codecs for activations and their gradients only (no error feedback)
UNBIASED_FIRST = {"tern-sr": 0, "tern-dither": 0}  # at equal bytes a planner prefers these (rank 0, others 1): unbiased gradients
TERN_BLOCK = 128  # elements per rotated block of ``tern`` (a power of two: the Walsh-Hadamard size)
TERN_PER_BYTE = 5  # ternary digits packed in one byte (3^5 = 243 <= 256)
QUAD_BLOCK_BYTES = TERN_BLOCK // 4  # bytes of one ``quad`` block's 2-bit codes
OCT_BLOCK_BYTES = 3 * TERN_BLOCK // 8  # bytes of one ``oct`` block's 3-bit codes
TD_KEPT = 55  # ``tern-dither``: rotated coordinates kept per block (five ternary digits a byte: 11 bytes)
TD_SEED_BYTES = 8  # ``tern-dither``: the 64-bit seed of its draws, once per tensor
SR_ONLY = ("tern-sr", "tern-dither")  # stochastic (unbiased) codecs: activation gradients only
PC_RANK = 4  # quad-pc: principal directions sent per tensor (the tiny model's residual stream: 99 % of the centred energy)


def tern_nbytes(numel: int) -> int:
    """Exact payload bytes of ``tern`` for ``numel`` elements: one bf16 level per block, then the
    rotated blocks' ternary digits (the last block padded to a whole block), five per byte."""
    if numel <= 0:
        return 0
    nb = -(-numel // TERN_BLOCK)
    return 2 * nb + -(-nb * TERN_BLOCK // TERN_PER_BYTE)


def act_nbytes(codec: str, numel: int, channels: int = 1) -> int:
    """Exact payload bytes of an activation codec (``tern``, ``tern-sr``, ``quad``, ``oct``,
    ``quad-pc``, ``tern-dither``) for ``numel`` elements; ``quad`` and ``oct``: one bf16 scale per
    block, then its 2-bit or 3-bit codes; ``quad-pc``: ``channels`` (the tensor's last dimension; 1
    for a tensor of fewer than two dimensions) bf16 means, ``k = min(PC_RANK, channels)`` bf16
    directions of ``channels`` each and ``k`` bf16 coefficients per row, then ``quad``'s bytes;
    ``tern-dither``: an 8-byte seed, then per block a bf16 level and 55 ternary digits (11 bytes)."""
    if numel <= 0:
        return 0
    nb = -(-numel // TERN_BLOCK)
    if codec == "quad-pc":
        if channels < 1 or numel % channels:
            raise ShoalError(f"quad-pc: {channels} channels do not divide a tensor of {numel} elements")
        k = min(PC_RANK, channels)
        return 2 * channels + 2 * k * channels + 2 * k * (numel // channels) + (2 + QUAD_BLOCK_BYTES) * nb
    if codec == "quad":
        return (2 + QUAD_BLOCK_BYTES) * nb
    if codec == "oct":
        return (2 + OCT_BLOCK_BYTES) * nb
    if codec == "tern-dither":
        return TD_SEED_BYTES + (2 + TD_KEPT // TERN_PER_BYTE) * nb
    return tern_nbytes(numel)


def parse_codec(text: str, kind: str = "push") -> str:
    """Validate one codec name (``topk-int8`` may carry ``:density``) for traffic ``kind``."""
    name, _, arg = text.strip().partition(":")
    if name not in CODECS:
        raise ShoalError(f"unknown codec {text!r} for {kind}; choose one of: {', '.join(CODECS)} "
                         "(topk-int8 takes an optional :DENSITY, e.g. topk-int8:0.05)")
    if name in ACT_ONLY:
        if kind not in _ACT_KINDS:
            raise ShoalError(f"codec {text!r} is for activations and their gradients (act, grad), not {kind}; "
                             "use int8 or sparse there")
        if name in SR_ONLY and kind != "grad":
            raise ShoalError(f"codec {text!r} rounds at random (unbiased, for activation gradients: grad); "
                             "for activations use tern, quad or oct (measured: tern-sr activations cost +24 % loss)")
        if arg:
            raise ShoalError(f"codec {text!r}: {name} takes no arguments")
    elif name == "sparse":
        if kind not in _SPARSE_KINDS:
            raise ShoalError(f"codec {text!r} drops most entries; use it only for push or pull, not {kind}")
        sparse_params(text)
    elif name == "lowrank":
        if kind not in _SPARSE_KINDS:
            raise ShoalError(f"codec {text!r} sends a few directions of each matrix; use it only for push or pull, "
                             f"not {kind}")
        lowrank_params(text)
    elif name == "topk-int8":
        if kind not in _SPARSE_KINDS:
            raise ShoalError(f"codec {text!r} drops most entries; use it only for push or pull, not {kind}")
        if arg:
            try:
                rho = float(arg)
            except ValueError:
                raise ShoalError(f"codec {text!r}: density must be a number in (0, 1], e.g. topk-int8:0.05") from None
            if not 0 < rho <= 1:
                raise ShoalError(f"codec {text!r}: density must be in (0, 1], got {rho}")
    elif arg:
        raise ShoalError(f"codec {text!r}: only topk-int8, sparse and lowrank take arguments")
    return text.strip()


def parse_compression(spec: str) -> dict[str, str]:
    """``"int8"`` (every kind) or ``"act=fp16,grad=int8,push=topk-int8,pull=int8"`` (kinds not
    named stay ``none``) -> ``{kind: codec}`` for all of :data:`KINDS`. ``"sparse[:DENSITY[:BITS]]"``
    alone is the local-mode setting ``push=sparse...,pull=sparse...`` (activations uncompressed);
    ``"tern"`` alone is ``act=tern,grad=tern`` (pushes and pulls uncompressed); ``"lowrank..."``
    alone is ``push=lowrank...,pull=lowrank...``."""
    out = dict.fromkeys(KINDS, "none")
    spec = (spec or "").strip()
    if not spec:
        return out
    if "=" not in spec:
        codec = spec
        if codec.split(":")[0] in ("sparse", "lowrank"):  # the whole setting: pushes and pulls, dense activations
            out["push"] = out["pull"] = parse_codec(codec, "push")
            return out
        if codec.split(":")[0] == "tern":  # the activation setting: tern both ways, dense pushes and pulls
            out["act"] = out["grad"] = parse_codec(codec, "act")
            return out
        if codec.startswith("topk-int8"):
            raise ShoalError(f"--compression {spec!r}: top-k only applies to push and pull; "
                             "write e.g. act=int8,grad=int8,push=topk-int8,pull=int8")
        for k in KINDS:
            out[k] = parse_codec(codec, k)
        return out
    for part in spec.split(","):
        kind, eq, codec = part.partition("=")
        kind = kind.strip()
        if not eq or kind not in KINDS:
            raise ShoalError(f"--compression {spec!r}: expected KIND=CODEC pairs with KIND in "
                             f"{', '.join(KINDS)}, e.g. act=fp16,grad=int8,push=topk-int8,pull=int8")
        out[kind] = parse_codec(codec, kind)
    return out


# Seconds of one core per element to (encode, decode) a local-mode push or pull of the codec,
# the whole stage in one frame, on one torch thread on the 2-core box: ``lowrank`` from
# bench/results/codec-threads.md (2026-12-04, ``bench_codec_threads.py``: a 101 M parameter
# gpt-1.3b stage 10.7 + 3.8 ns, a 50.6 M gpt-350m stage 10.9 + 4.7 ns; the larger of the two),
# the others from bench/results/merge-memory.md (2026-12-03, a 25 M parameter gpt-350m stage).
# Names not listed cost what int8 does.
CODEC_CPU_S = {"none": (6.0e-9, 10.3e-9), "lowrank": (10.9e-9, 4.7e-9), "sparse": (9.1e-9, 2.8e-9),
               "int8": (16.1e-9, 8.5e-9)}


def codec_cpu_s(codec: str) -> tuple[float, float]:
    """``(encode, decode)`` seconds of one core per element of a stage pushed or pulled with ``codec`` (pure)."""
    name = codec.split(":")[0]
    return CODEC_CPU_S.get("none" if name in ("raw", "fp32") else name, CODEC_CPU_S["int8"])


# Seconds of one core per element to (encode, decode) an activation or its gradient with the codec:
# a worker encodes its output after its compute and decodes its input (checked finite) before it;
# a stage server decodes each lossy result and relay it takes to check it. One torch thread on the
# 2-core box, a gpt-1.3b boundary tensor (1,024 rows of 2,048 bf16 channels):
# bench/results/act-codec-cpu.md (2026-12-07, bench_act_codec_cpu.py). Names not listed cost
# what int8 does.
ACT_CODEC_CPU_S = {"none": (0.0, 2.9e-9), "fp16": (2.7e-9, 4.4e-9), "int8": (3.1e-9, 3.5e-9),
                   "tern": (15.1e-9, 11.4e-9), "tern-sr": (16.4e-9, 11.7e-9), "quad": (16.3e-9, 14.3e-9),
                   "oct": (23.5e-9, 21.0e-9), "quad-pc": (42.3e-9, 20.2e-9), "tern-dither": (47.0e-9, 47.5e-9)}


def act_codec_cpu_s(codec: str) -> tuple[float, float]:
    """``(encode, decode)`` seconds of one core per element of an activation or activation
    gradient sent with ``codec`` (pure; ``ACT_CODEC_CPU_S``)."""
    name = codec.split(":")[0]
    return ACT_CODEC_CPU_S.get("none" if name in ("raw", "fp32") else name, ACT_CODEC_CPU_S["int8"])


def codec_threaded(codec: str) -> bool:
    """Whether a stage server encodes and decodes ``codec``'s frames on its merge threads (pure):
    ``lowrank``, one matrix a thread (``shoal.net.compress.set_codec_threads``)."""
    return codec.split(":")[0] == "lowrank"


def pull_compressed(codec: str) -> bool:
    """Whether a local-mode pull of ``codec`` is a compressed frame the server decodes again after
    encoding it (to apply or keep what the workers decode), not the weights as they are (pure)."""
    return codec.split(":")[0] not in ("none", "raw", "fp32")


def sparse_params(codec: str) -> tuple[float, int]:
    """``"sparse:0.01:2"`` -> ``(density, bits)`` with the defaults for parts left out."""
    parts = codec.strip().split(":")
    if parts[0] != "sparse" or len(parts) > 3:
        raise ShoalError(f"codec {codec!r}: expected sparse[:DENSITY[:BITS]], e.g. sparse:0.015625:2")
    try:
        rho = float(parts[1]) if len(parts) > 1 and parts[1] else SPARSE_DENSITY
        bits = int(parts[2]) if len(parts) > 2 and parts[2] else SPARSE_BITS
    except ValueError:
        raise ShoalError(f"codec {codec!r}: expected sparse[:DENSITY[:BITS]] with DENSITY a number in "
                         "(0, 1] and BITS an integer, e.g. sparse:0.015625:2") from None
    if not 0 < rho <= 1:
        raise ShoalError(f"codec {codec!r}: density must be in (0, 1], got {rho}")
    if bits not in SPARSE_BIT_CHOICES:
        raise ShoalError(f"codec {codec!r}: bits must be one of {SPARSE_BIT_CHOICES}, got {bits}")
    return rho, bits


def lowrank_params(codec: str) -> tuple[int, int]:
    """``"lowrank:3:4"`` -> ``(rank, bits)`` with the defaults for parts left out."""
    parts = codec.strip().split(":")
    if parts[0] != "lowrank" or len(parts) > 3:
        raise ShoalError(f"codec {codec!r}: expected lowrank[:RANK[:BITS]], e.g. lowrank:3:4")
    try:
        rank = int(parts[1]) if len(parts) > 1 and parts[1] else LOWRANK_RANK
        bits = int(parts[2]) if len(parts) > 2 and parts[2] else LOWRANK_BITS
    except ValueError:
        raise ShoalError(f"codec {codec!r}: expected lowrank[:RANK[:BITS]] with integers, e.g. lowrank:3:4") from None
    if not 1 <= rank <= LOWRANK_MAX_RANK:
        raise ShoalError(f"codec {codec!r}: rank must be in [1, {LOWRANK_MAX_RANK}], got {rank}")
    if bits not in LOWRANK_BIT_CHOICES:
        raise ShoalError(f"codec {codec!r}: bits must be one of {LOWRANK_BIT_CHOICES}, got {bits}")
    return rank, bits


def lowrank_rows_cols(shape) -> tuple[int, int]:
    """A tensor of ``shape`` as the matrix ``lowrank`` factors: its first dimension by the rest
    (``(1, n)`` for a vector or a scalar)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        return 1, max(1, math.prod(shape))
    return shape[0], math.prod(shape[1:])


def lowrank_matrix(shape, rank: int, bits: int) -> bool:
    """Whether ``lowrank`` sends a tensor of ``shape`` as factors (pure): at least two
    dimensions and factors under a quarter of its int8 bytes; anything else goes as int8."""
    m, n = lowrank_rows_cols(shape)
    factors = 8 * rank + math.ceil(rank * m * bits / 8) + math.ceil(rank * n * bits / 8)
    return len(tuple(shape)) >= 2 and 4 * factors < m * n


def lowrank_nbytes(shapes, rank: int, bits: int) -> int:
    """Exact payload bytes of ``lowrank`` over tensors of ``shapes`` (a stage, in name order):
    each matrix's two scale vectors and packed factors, then every other tensor's elements
    together in blockwise int8."""
    total, rest = 0, 0
    for shape in shapes:
        m, n = lowrank_rows_cols(shape)
        if lowrank_matrix(shape, rank, bits):
            total += 8 * rank + math.ceil(rank * m * bits / 8) + math.ceil(rank * n * bits / 8)
        else:
            rest += math.prod(tuple(int(s) for s in shape))
    return total + rest + 4 * -(-rest // INT8_BLOCK)


def lowrank_rate(codec: str, width: int) -> float:
    """Wire bytes per weight of ``lowrank`` on a transformer block of ``width`` (pure): its four
    matrices (``d x 3d``, ``d x d``, ``d x 4d``, ``4d x d``) as factors and its 13 ``d`` norm and
    bias entries in int8 -- the rate of every stage but the embedding's (which costs less)."""
    rank, bits = lowrank_params(codec)
    d = max(8, int(width))
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] + [(d,)] * 13
    return lowrank_nbytes(shapes, rank, bits) / (12 * d * d + 13 * d)


def sparse_kept_per_chunk(rho: float) -> int:
    """Entries the ``sparse`` codec keeps in each chunk of :data:`SPARSE_CHUNK` elements."""
    return max(1, math.ceil(rho * SPARSE_CHUNK - 1e-9))


def bytes_per_element(codec: str, raw_bytes: int, rows: int = 0, channels: int = 0) -> float:
    """Wire bytes per tensor element of ``codec`` for a tensor held in ``raw_bytes``-wide floats.

    ``rows`` x ``channels``: an activation's shape (tokens of a micro-batch, the model's width),
    for ``quad-pc``, whose per-row coefficients and per-tensor means and directions cost more
    per element on narrow tensors; 0: a 128-channel tensor of many rows. ``lowrank`` is priced
    on a transformer block of width ``channels`` (0: 128, the narrowest built-in model)."""
    name, _, arg = codec.partition(":")
    if name == "none":
        return float(raw_bytes)
    if name == "fp16":
        return 2.0
    if name == "int8":
        return 1.0 + 4.0 / INT8_BLOCK
    if name == "topk-int8":
        rho = float(arg) if arg else TOPK_DENSITY
        return rho * (4.0 + 1.0 + 4.0 / INT8_BLOCK)
    if name == "sparse":
        rho, bits = sparse_params(codec)
        k = sparse_kept_per_chunk(rho)
        return (k * (SPARSE_INDEX_BITS + bits) / 8.0 + 2.0) / SPARSE_CHUNK
    if name == "lowrank":
        return lowrank_rate(codec, channels or TERN_BLOCK)
    if name == "tern-dither":  # a large tensor's rate: the 8-byte seed is once per tensor
        return (act_nbytes(name, 1 << 20) - TD_SEED_BYTES) / (1 << 20)
    if name == "quad-pc" and rows > 0 and channels > 0:
        return act_nbytes(name, rows * channels, channels) / (rows * channels)
    if name == "quad-pc":  # quad, plus the coefficients of a 128-channel tensor (means, directions: per tensor)
        return act_nbytes("quad", TERN_BLOCK * TERN_PER_BYTE) / (TERN_BLOCK * TERN_PER_BYTE) + 2 * PC_RANK / TERN_BLOCK
    if name in ACT_ONLY:
        return act_nbytes(name, TERN_BLOCK * TERN_PER_BYTE) / (TERN_BLOCK * TERN_PER_BYTE)
    raise ShoalError(f"unknown codec {codec!r}; choose one of: {', '.join(CODECS)}")


def wire_ratio(codec: str, raw_bytes: int, rows: int = 0, channels: int = 0) -> float:
    """Bytes on the wire / bytes in the compute dtype for ``codec`` (1.0 for ``none``); ``rows``
    and ``channels`` as in :func:`bytes_per_element`."""
    return bytes_per_element(codec, raw_bytes, rows, channels) / raw_bytes
