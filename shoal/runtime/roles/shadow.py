"""Shadow workers: the runtime at device speed and swarm scale without running the model.

A shadow worker (``shoal worker --shadow``, ``shoal launch --shadow``) does everything a
worker does on the wire (joins, measures its links, leases or is granted tasks, pulls and
checks weights, sends results, pushes gradients, heartbeats) but computes nothing: each
task waits the time its emulated device would take (its pacer's target for the task's
FLOPs, :mod:`shoal.emulate.pacing`; else ``--flops``) and returns fixed tensors of the
true shapes, dtypes and codecs. So the coordinator and the stage servers do their real
work (decoding, checks, relays, sums, AdamW, checkpoints) at the pace of real GPUs, and
many shadow workers fit one process (:func:`run_shadow_workers`): the stage's weights are
meta tensors (shapes only) and every shadow worker of a process shares one set of
gradient tensors per stage.

The run is marked ``RunSpec.shadow``: its losses are meaningless, and the stage servers
do not screen pushes (a fixed gradient would fail a recomputation).
"""

from __future__ import annotations

import math

import torch

_TENSORS: dict[tuple, torch.Tensor] = {}
_GRADS: dict[tuple, dict[str, torch.Tensor]] = {}
_FRAMES: dict[tuple, list] = {}

SHADOW_VALUE = 1e-3  # every element of a shadow activation or gradient (finite, small)


def check_shadow_sync(shadow: bool, local: bool) -> None:
    """A one-line error for shadow workers in local mode (``launch``, ``coordinator``, ``demo``)."""
    if shadow and local:
        from shoal.errors import ShoalError

        raise ShoalError("--shadow runs exact sync only: a shadow worker holds no weights (its stage is shapes "
                         "only), so it cannot keep local mode's replica; drop --sync local or --shadow")


def shadow_tensor(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """A fixed tensor of ``shape`` in wire dtype ``dtype`` (shared: never written to)."""
    key = (tuple(shape), dtype)
    t = _TENSORS.get(key)
    if t is None:
        t = _TENSORS[key] = torch.full(shape, SHADOW_VALUE, dtype=getattr(torch, dtype))
    return t


def shadow_grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fixed fp32 gradients of the true shapes of ``params`` (shared by the shadow workers
    of a process on the same stage; a push that sums several clones before adding)."""
    key = tuple((n, tuple(p.shape)) for n, p in params.items())
    g = _GRADS.get(key)
    if g is None:
        g = _GRADS[key] = {n: torch.full(tuple(p.shape), SHADOW_VALUE, dtype=torch.float32)
                           for n, p in params.items()}
    return dict(g)


def shadow_loss(vocab_size: int) -> float:
    """The loss a shadow last-stage task reports: that of a uniform prediction."""
    return math.log(vocab_size)


def shadow_frames(grads: dict[str, torch.Tensor], count: int, codec: str, ordered: bool) -> list:
    """The push frames of ``grads``, the sum of ``count`` shadow gradients of one stage, in
    ``codec`` (stateless codecs only): encoded once per process and kept, since every such
    sum is the same tensors (``ordered``: summed the ordered way, part of the key)."""
    from shoal.net.wire import encode_frame
    from shoal.train.precision import to_host

    key = (tuple((n, tuple(g.shape)) for n, g in grads.items()), count, codec, ordered)
    frames = _FRAMES.get(key)
    if frames is None:
        if len(_FRAMES) >= 64:
            _FRAMES.clear()
        frames = _FRAMES[key] = [encode_frame(n, to_host(g), codec) for n, g in grads.items()]
    return frames


def raw_full_pull(rep) -> bool:
    """Whether a WeightsReply is a whole-stage pull of raw frames (no delta, no codec)."""
    return not rep.compress_delta and all(not f.codec or f.codec == "raw" for f in rep.params)


def shadow_pull_ok(rep, params: dict[str, torch.Tensor]) -> bool:
    """Whether a weight pull holds exactly the tensors of ``params`` with payloads of their
    fp32 size (a whole-stage raw pull); a shadow worker decodes nothing."""
    if len(rep.params) != len(params):
        return False
    for f in rep.params:
        p = params.get(f.name)
        if p is None or tuple(f.shape) != tuple(p.shape) or len(f.data) != 4 * p.numel():
            return False
    return True
