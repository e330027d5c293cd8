"""Local-update mode (DiLoCo inside each stage): settings and the outer step's pure math.

Each worker trains its own replica of its stage with an inner AdamW; every ``sync_every``
steps it sends its *pseudo-gradient* (weights at the last sync minus its weights now) with
the number of micro-batches it covered. The stage server averages the pseudo-gradients,
weighted by those counts (:func:`merge_weights`, :func:`merge_pseudo_grads`), and applies
one outer Nesterov-momentum step to the last merged weights (:func:`outer_nesterov_step`).
These functions hold no state of their own so they can be tested by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.errors import ShoalError

if TYPE_CHECKING:  # the CLI registers --sync flags from here: no torch at import
    import torch

SYNC_MODES = ("exact", "local")


@dataclass(frozen=True)
class SyncConfig:
    """How the runtime keeps the workers of a stage in step (``--sync`` and friends)."""

    mode: str = "exact"  # "exact": one shared AdamW step per step; "local": DiLoCo inside each stage
    sync_every: int = 32  # local mode: steps between merges (H); the last step always merges
    outer_lr: float = 1.0  # local mode: learning rate of the outer Nesterov step (1 with momentum 0: the replicas' mean)
    outer_momentum: float = 0.0  # local mode: momentum of the outer Nesterov step (0: plain averaging; see bench/results/sparse-sync.md)
    overlap: bool = True  # local mode: a round's merge runs while the next round computes (delayed application)
    lean: bool = False  # local mode: workers hold 12 B a parameter (step's gradients summed by backward, bf16 inner moments)

    @property
    def local(self) -> bool:
        """Whether workers train local replicas between merges."""
        return self.mode == "local"

    def validate(self, precision: str = "fp32") -> SyncConfig:
        """Raise a one-line :class:`ShoalError` on a bad value; returns ``self``."""
        if self.mode not in SYNC_MODES:
            raise ShoalError(f"--sync must be one of {', '.join(SYNC_MODES)}, got {self.mode!r}")
        if self.sync_every < 1:
            raise ShoalError(f"--sync-every must be at least 1, got {self.sync_every}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ShoalError(f"--outer-lr must be a finite number > 0, got {self.outer_lr}")
        if not (math.isfinite(self.outer_momentum) and 0 <= self.outer_momentum < 1):
            raise ShoalError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.lean and not self.local:
            raise ShoalError("--lean-workers applies to --sync local (exact sync's workers hold no optimizer)")
        if self.local and precision == "fp16":
            raise ShoalError("--sync local does not support --precision fp16 (no per-replica loss scaling); "
                             "use bf16 or fp32")
        return self


def is_sync_step(step: int, sync_every: int, total_steps: int) -> bool:
    """Whether the commit of ``step`` (0-based) ends a round: every H steps and at the last step."""
    return (step + 1) % sync_every == 0 or step + 1 >= total_steps


def round_closed_by(decided: int, sync_every: int, total_steps: int) -> int:
    """The version of the newest round that ends at or before step ``decided`` (its last step
    plus one; 0 when none has ended): with delayed application a worker that sees the decision
    of ``decided`` has closed that round (pure)."""
    if decided < 0:
        return 0
    if is_sync_step(decided, sync_every, total_steps):
        return decided + 1
    return (decided + 1) // sync_every * sync_every


def merge_weights(counts: Mapping[str, int]) -> dict[str, float]:
    """Weight of each contributor: its micro-batches over all of them (contributors with 0 drop out).

    A lone contributor gets exactly 1.0, so the merge of one pseudo-gradient is that
    pseudo-gradient bit for bit.
    """
    total = sum(n for n in counts.values() if n > 0)
    if total <= 0:
        return {}
    return {k: n / total for k, n in sorted(counts.items()) if n > 0}


def merge_pseudo_grads(deltas: Mapping[str, Mapping[str, torch.Tensor]],
                       counts: Mapping[str, int]) -> dict[str, torch.Tensor] | None:
    """Micro-batch-weighted mean of pseudo-gradients, per parameter (None: no contributor).

    ``deltas[worker][param]`` is that worker's anchor minus its weights now; ``counts``
    the micro-batches it covered in the round. Contributors are added in name order so
    every server computes the same bits.
    """
    return weighted_sum(deltas, merge_weights({k: counts.get(k, 0) for k in deltas}))


SUM_CHUNK = 1 << 20  # elements one thread of a parallel weighted sum adds at a time


def weighted_sum(deltas: Mapping[str, Mapping[str, torch.Tensor]],
                 weights: Mapping[str, float], pool: Executor | None = None) -> dict[str, torch.Tensor] | None:
    """``sum_w weights[w] * deltas[w]`` per parameter, contributors in ``weights``' order
    (:func:`merge_weights`: name order), a weight of 1.0 as a plain copy (None: no weights).

    With a ``pool`` each contributor's tensors are added by its threads in chunks of
    :data:`SUM_CHUNK` elements (torch releases the GIL): every element still gets the same
    operations in the same contributor order, so the result is the same bits on any number
    of threads. Each contributor is read once (a held push may decode on read)."""
    if not weights:
        return None
    out: dict[str, torch.Tensor] = {}
    for wid, w in weights.items():
        d = deltas[wid]
        if pool is None:
            for name, t in d.items():
                term = t * w if w != 1.0 else t.clone()
                if name in out:
                    out[name].add_(term)
                else:
                    out[name] = term
            continue
        import torch

        jobs = []
        for name, t in d.items():
            first = name not in out
            if first:
                out[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
            src, dst = t.reshape(-1), out[name].view(-1)
            jobs += [(src[a:a + SUM_CHUNK], dst[a:a + SUM_CHUNK], first) for a in range(0, src.numel(), SUM_CHUNK)]
        for f in [pool.submit(_add_chunk, src, dst, w, first) for src, dst, first in jobs]:
            f.result()
    return out


def _add_chunk(src: torch.Tensor, dst: torch.Tensor, w: float, first: bool) -> None:
    """One chunk of :func:`weighted_sum`: the same operations as its serial loop."""
    import torch

    if first:
        if w != 1.0:
            torch.mul(src, w, out=dst)
        else:
            dst.copy_(src)
    else:
        dst.add_(src * w if w != 1.0 else src)


def merge_per_layer(deltas: Mapping[Hashable, Mapping[str, torch.Tensor]], counts: Mapping[Hashable, int],
                    release: Callable[[Hashable], None] | None = None) -> dict[str, torch.Tensor]:
    """Merge pseudo-gradients of replicas whose stages split the layers differently.

    ``deltas[replica][name]``: a replica stage's pseudo-gradient per parameter, named as the
    model names it (``layers.<i>.<...>``: global, the same in every split), ``counts[replica]``
    the micro-batches it covered. Each parameter is the micro-batch-weighted mean over the
    replicas that hold it (:func:`merge_pseudo_grads`' arithmetic per parameter, replicas added
    in sorted order), so a replica of layers ``[0, 6)`` and one split ``[0, 3)`` + ``[3, 6)``
    merge layer by layer; a parameter only one replica holds is its delta bit for bit; a
    replica of 0 micro-batches drops out. Returns every parameter a contributing replica holds
    (take a stage's own names from it); a :class:`ShoalError` if two replicas disagree on a shape.

    Each replica's tensors are read once, one at a time, and folded into the sum, so a replica
    that decodes its tensors where they are read (a stage server's framed or spilled part) is
    never whole in memory beside it; ``release(replica)`` is called once its tensors are read.
    """
    live = [k for k in sorted(deltas) if counts.get(k, 0) > 0]
    holders: dict[str, dict[Hashable, int]] = {}
    for k in live:
        for name in deltas[k]:
            holders.setdefault(name, {})[k] = counts[k]
    shares = {name: merge_weights(h) for name, h in holders.items()}
    out: dict[str, torch.Tensor] = {}
    for k in live:
        d = deltas[k]
        for name in d:
            x = d[name]
            if name in out and tuple(out[name].shape) != tuple(x.shape):
                raise ShoalError(f"parameter {name}: replica {k} holds shape {tuple(x.shape)}, others "
                                 f"{tuple(out[name].shape)}; replicas of different models cannot merge")
            share = shares[name][k]
            term = x * share if share != 1.0 else x.clone()
            if name in out:
                out[name].add_(term)
            else:
                out[name] = term
            del x, term
        if release is not None:
            release(k)
    return out


def merges_weights(lr: float, mu: float) -> bool:
    """Whether the outer step is the replicas' plain weighted mean (outer lr 1, momentum 0).

    Then the merge averages the replicas' weights themselves (the workers send them):
    ``p - (p - p')`` is not ``p'`` in floats where ``p - p'`` is rounded (a weight whose step
    is larger than half of it), and those last bits would grow over the next AdamW steps.
    """
    return lr == 1.0 and mu == 0.0


def outer_nesterov_step(params: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor],
                        momentum: dict[str, torch.Tensor], lr: float, mu: float) -> None:
    """One outer Nesterov step in place: ``m = mu m + d``; ``p -= lr (d + mu m)``.

    ``momentum`` starts empty (zeros) and is updated in place. With ``mu = 0`` and
    ``lr = 1`` this is ``p -= d``: the merged weights are the replicas' weighted mean.
    """
    import torch

    with torch.no_grad():
        for name, p in params.items():
            d = delta[name]
            if mu > 0:
                m = momentum.get(name)
                if m is None:
                    m = momentum[name] = torch.zeros_like(d)
                m.mul_(mu).add_(d)
                update = d + mu * m
            else:
                update = d
            if lr == 1.0:
                p.sub_(update)
            else:
                p.sub_(update, alpha=lr)


def outer_nesterov_update(delta: Mapping[str, torch.Tensor], momentum: dict[str, torch.Tensor], lr: float,
                          mu: float) -> dict[str, torch.Tensor]:
    """The outer Nesterov step as an update to subtract, ``lr (d + mu m)`` after ``m = mu m + d``
    (``momentum`` updated in place), for a server that sends the update itself to its workers
    (sparse pulls) instead of applying it exactly (:func:`outer_nesterov_step`)."""
    import torch

    out = {}
    with torch.no_grad():
        for name, d in delta.items():
            if mu > 0:
                m = momentum.get(name)
                if m is None:
                    m = momentum[name] = torch.zeros_like(d)
                m.mul_(mu).add_(d)
                update = d + mu * m
            else:
                update = d.clone()
            out[name] = update if lr == 1.0 else update.mul_(lr)
    return out


def add_sync_args(p, auto: bool = False) -> None:
    """The ``--sync`` flags of ``shoal launch`` and ``shoal coordinator`` (argparse); ``auto``:
    ``shoal demo``'s, where ``--sync auto`` (the planner's choice) is the default."""
    d = SyncConfig()
    g = p.add_argument_group("sync policy (docs/sync-policies.md)")
    if auto:
        g.add_argument("--sync", default="auto", choices=("auto", "exact", "local"),
                       help="auto (default: the planner chooses exact or local, H, the codecs and, without "
                            "--stages, the shape: one pipeline's depth or pipeline replicas; --sync-every "
                            "and --compression pin them), exact (one shared AdamW step per step) or local (each "
                            "worker trains its own replica; merges every --sync-every steps)")
        g.add_argument("--sync-every", type=int, default=None,
                       help=f"local: steps between merges H (default {d.sync_every}; auto: the planner's choice)")
    else:
        g.add_argument("--sync", default=d.mode, help="exact (one shared AdamW step per step) or local "
                                                      "(each worker trains its own replica; merges every --sync-every steps)")
        g.add_argument("--sync-every", type=int, default=d.sync_every, help="local: steps between merges H")
    g.add_argument("--outer-lr", type=float, default=d.outer_lr, help="local: outer Nesterov learning rate")
    g.add_argument("--outer-momentum", type=float, default=d.outer_momentum,
                   help="local: outer Nesterov momentum (0: plain weighted averaging)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="local: the steps wait for each round's merge instead of running the next round while "
                        "it is in flight (delayed application, the default; where --sync auto is taken, it may "
                        "choose only waiting steps)")
    g.add_argument("--lean-workers", dest="lean", action="store_true",
                   help="local: each worker holds 12 bytes a parameter instead of 20 (backward sums the step's "
                        "gradients in place, in the order the tasks come; the inner AdamW keeps bf16 moments), "
                        "so a larger stage fits a card (docs/sync-policies.md)")


def sync_from_args(args, precision: str = "fp32") -> SyncConfig:
    """The checked :class:`SyncConfig` of parsed ``--sync`` flags."""
    return SyncConfig(mode=args.sync, sync_every=args.sync_every, outer_lr=args.outer_lr,
                      outer_momentum=args.outer_momentum, overlap=getattr(args, "overlap", True),
                      lean=bool(getattr(args, "lean", False))).validate(precision)


def sync_of_spec(spec) -> SyncConfig:
    """The :class:`SyncConfig` a run spec carries (an empty mode is exact)."""
    return SyncConfig(mode=spec.sync_mode or "exact", sync_every=spec.sync_every or 1,
                      outer_lr=spec.outer_lr or 1.0, outer_momentum=spec.outer_momentum,
                      overlap=bool(spec.sync_overlap), lean=bool(spec.sync_lean))
