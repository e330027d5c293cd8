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
  pulls (pseudo-gradients and weight deltas, with error feedback), never for activations.

Traffic kinds: ``act`` (activations sent forward), ``grad`` (activation gradients sent
backward), ``push`` (gradient or pseudo-gradient pushes to the server), ``pull`` (weight pulls
from the server).
"""

from __future__ import annotations

from shoal.errors import ShoalError

INT8_BLOCK = 128  # elements per int8 scale (the runtime codec's default block, shoal.net.compress.DEFAULT_BLOCK)
TOPK_DENSITY = 0.1  # fraction of entries a top-k codec keeps unless the spec says otherwise
KINDS = ("act", "grad", "push", "pull")  # traffic kinds with their own codec
CODECS = ("none", "fp16", "int8", "topk-int8")  # codec names (topk-int8 takes an optional :density)
_SPARSE_KINDS = ("push", "pull")  # kinds where a top-k codec is allowed


def parse_codec(text: str, kind: str = "push") -> str:
    """Validate one codec name (``topk-int8`` may carry ``:density``) for traffic ``kind``."""
    name, _, arg = text.strip().partition(":")
    if name not in CODECS:
        raise ShoalError(f"unknown codec {text!r} for {kind}; choose one of: {', '.join(CODECS)} "
                         "(topk-int8 takes an optional :DENSITY, e.g. topk-int8:0.05)")
    if name == "topk-int8":
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
        raise ShoalError(f"codec {text!r}: only topk-int8 takes a :DENSITY argument")
    return text.strip()


def parse_compression(spec: str) -> dict[str, str]:
    """``"int8"`` (every kind) or ``"act=fp16,grad=int8,push=topk-int8,pull=int8"`` (kinds not
    named stay ``none``) -> ``{kind: codec}`` for all of :data:`KINDS`."""
    out = dict.fromkeys(KINDS, "none")
    spec = (spec or "").strip()
    if not spec:
        return out
    if "=" not in spec:
        codec = spec
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


def bytes_per_element(codec: str, raw_bytes: int) -> float:
    """Wire bytes per tensor element of ``codec`` for a tensor held in ``raw_bytes``-wide floats."""
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
    raise ShoalError(f"unknown codec {codec!r}; choose one of: {', '.join(CODECS)}")


def wire_ratio(codec: str, raw_bytes: int) -> float:
    """Bytes on the wire / bytes in the compute dtype for ``codec`` (1.0 for ``none``)."""
    return bytes_per_element(codec, raw_bytes) / raw_bytes
