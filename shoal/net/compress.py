"""Tensor codecs for the wire: ``raw`` (fp32), ``fp16`` and ``int8`` (blockwise).

Every tensor that crosses the network (activations, their gradients, gradient pushes,
weight pulls) is encoded by one of three codecs:

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CODECS = ("raw", "fp16", "int8")  # dense codecs (any traffic kind)
SPARSE_CODECS = ("topk-int8",)  # sparse codecs (pushes and pulls with error feedback only)
ALL_CODECS = CODECS + SPARSE_CODECS  # every codec name a frame may carry
TOPK_DENSITY = 0.1  # fraction of entries topk-int8 keeps without a :density (shoal.plan.compression's)
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
    if name not in SPARSE_CODECS:
        if arg:
            raise CodecError(f"codec {codec!r}: only topk-int8 takes a :density")
        return name, 1.0
    try:
        density = float(arg) if arg else TOPK_DENSITY
    except ValueError:
        raise CodecError(f"codec {codec!r}: the density must be a number in (0, 1]") from None
    if not 0 < density <= 1:
        raise CodecError(f"codec {codec!r}: the density must be in (0, 1], got {density}")
    return name, density


def _check_codec(codec: str, block: int) -> None:
    name, _ = split_codec(codec)
    if name not in ALL_CODECS:
        raise CodecError(f"unknown codec {codec!r}; choose one of {', '.join(ALL_CODECS)}")
    if name != "raw" and name != "fp16" and not (isinstance(block, int) and 1 <= block <= 1 << 20):
        raise CodecError(f"int8 block size must be an integer in [1, 2^20], got {block!r}")


def topk_count(numel: int, density: float) -> int:
    """Entries a top-k codec of ``density`` keeps of ``numel`` (at least one of a non-empty tensor)."""
    return min(numel, max(1, math.ceil(density * numel))) if numel > 0 else 0


def encoded_nbytes(codec: str, numel: int, block: int = DEFAULT_BLOCK, k: int | None = None) -> int:
    """Exact payload size in bytes of a tensor of ``numel`` elements under ``codec``
    (top-k: ``k`` kept entries, default from the codec's density)."""
    _check_codec(codec, block)
    name, density = split_codec(codec)
    if name == "raw":
        return 4 * numel
    if name == "fp16":
        return 2 * numel
    if name == "topk-int8":
        k = topk_count(numel, density) if k is None else k
        return 5 * k + 4 * _n_blocks(k, block)
    return numel + 4 * _n_blocks(numel, block)


def wire_fraction(codec: str, block: int = DEFAULT_BLOCK) -> float:
    """Bytes on the wire per fp32 byte for large tensors (the planner's compression factor)."""
    _check_codec(codec, block)
    name, density = split_codec(codec)
    if name == "topk-int8":
        return density * (5 + 4 / block) / 4
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
    tensor: torch.Tensor | np.ndarray, codec: str = "raw", block: int = DEFAULT_BLOCK
) -> tuple[bytes, dict[str, Any]]:
    """Encode a float tensor; returns ``(payload, meta)``.

    ``meta`` holds ``codec``, ``numel`` and (int8) ``block``: ints and strings only, to
    be carried in the frame next to the payload. Raises :class:`NonFiniteError` if the
    tensor holds inf or NaN and :class:`CodecError` for an fp16 overflow, an unknown
    codec or an unsupported dtype.
    """
    _check_codec(codec, block)
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
    meta["block"] = block
    name, density = split_codec(codec)
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
) -> torch.Tensor:
    """Decode a payload made by :func:`encode` into a tensor of ``shape`` and ``dtype``.

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
    if codec == "topk-int8":
        k = meta.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= numel:
            raise CodecError(f"topk-int8 payload keeps {k!r} entries; expected an integer in [0, {numel}]")
    expected = encoded_nbytes(codec, numel, block, k)
    buf = memoryview(payload).cast("B")
    if len(buf) != expected:
        raise CodecError(
            f"{codec} payload for shape {shape} must be {expected} bytes, got {len(buf)}"
        )
    if codec == "raw":
        x = np.frombuffer(buf, dtype="<f4")
    elif codec == "fp16":
        x = np.frombuffer(buf, dtype="<f2").astype(np.float32)
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

    def encode(self, name: str, tensor: torch.Tensor) -> tuple[bytes, dict[str, Any]]:
        """Encode ``tensor`` plus the residual kept for ``name``; update the residual."""
        x = tensor.detach().to("cpu", torch.float32)
        with self._lock:
            r = self._residual.get(name)
            if r is not None and r.shape != x.shape:
                r = None  # the tensor changed shape (e.g. after a re-plan): start afresh
            corrected = x if r is None else x + r
            payload, meta = encode(corrected, self.codec, self.block)
            if self.codec != "raw":
                sent = decode(payload, meta, corrected.shape, torch.float32)
                self._residual[name] = corrected - sent
            return payload, meta

    def residual(self, name: str) -> torch.Tensor | None:
        """The residual currently kept for ``name`` (None if none)."""
        with self._lock:
            r = self._residual.get(name)
            return None if r is None else r.clone()

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
