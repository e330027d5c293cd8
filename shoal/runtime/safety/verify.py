"""The tensor side of push screening (see :mod:`shoal.runtime.safety.guard` for the decisions).

The stage server recomputes a micro-batch's parameter gradient itself, from the weights
of the step, the micro-batch's input (tokens at stage 0, the relayed activation
otherwise) and its output gradient (or the loss at the last stage), with the formula
the workers use, and compares a push with it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from shoal.net.wire import tensor_of
from shoal.plan.types import SCREEN_SAMPLE
from shoal.runtime.common import micro_batch
from shoal.threads import compute_pool

PRODUCT_BLOCK = 1 << 18  # elements sum_product multiplies at once (1 MB of products: in the cache)
# Micro-batches a stage server recomputes at once at most, one thread each (torch releases the
# GIL in its kernels): a push's check then takes about 1/threads of one core's time on an idle
# host, for as many more micro-batches' gradients in memory (recompute_sum).
RECOMPUTE_THREADS = 4
_RECOMPUTE_POOL: ThreadPoolExecutor | None = None


def sum_product(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum(a * b)`` of two tensors of one shape, as a Python float.

    The products are formed in fp32, :data:`PRODUCT_BLOCK` elements at a time into one buffer
    that stays in the cache, each block added by torch's cascade summation and the blocks'
    sums in fp64: error near 1e-7 relative over tens of millions of elements, no fp64 copy of
    the tensors and no product tensor of their size (4.5x faster than ``(a * b).sum()`` on a
    gpt-1.3b matrix, whose product was fresh memory: bench/results/merge-threads.md). The
    blocks depend only on the size, so the result is the same bits on any thread.
    """
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    n = x.numel()
    if n <= PRODUCT_BLOCK:
        return float((x.float() * y.float()).sum())
    buf = torch.empty(PRODUCT_BLOCK, dtype=torch.float32)
    total = 0.0
    for i in range(0, n, PRODUCT_BLOCK):
        xs, ys = x[i:i + PRODUCT_BLOCK].float(), y[i:i + PRODUCT_BLOCK].float()
        out = buf[:xs.numel()]
        torch.mul(xs, ys, out=out)
        total += float(out.sum())
    return total


def norm_and_dot(a: torch.Tensor, b: torch.Tensor | None,
                 add: tuple[torch.Tensor, float, bool] | None = None) -> tuple[float, float]:
    """``(sum(a * a), sum(a * b))`` in one read of ``a`` (``b`` None: 0 for the product), with
    :func:`sum_product`'s blocks and arithmetic: the same floats as calling it. ``add = (dst, w,
    first)``: also ``dst += w * a`` (``first``: ``dst = w * a``) in that read, with
    :func:`shoal.train.outer.weighted_sum`'s operations on each element (the same bits)."""
    x = a.detach().reshape(-1)
    y = None if b is None else b.detach().reshape(-1)
    n = x.numel()
    blocks = n > PRODUCT_BLOCK
    buf = torch.empty(PRODUCT_BLOCK, dtype=torch.float32) if blocks else None
    # w times a block (fresh memory for each block would cost page faults)
    term = torch.empty(min(n, PRODUCT_BLOCK), dtype=torch.float32) if add is not None else None
    sq = dt = 0.0
    for i in range(0, n, PRODUCT_BLOCK):
        xs = x[i:i + PRODUCT_BLOCK].float()
        ys = None if y is None else y[i:i + PRODUCT_BLOCK].float()
        if not blocks:  # sum_product's one-block form
            sq = float((xs * xs).sum())
            dt = 0.0 if ys is None else float((xs * ys).sum())
        else:
            p = buf[:xs.numel()]
            torch.mul(xs, xs, out=p)
            sq += float(p.sum())
            if ys is not None:
                torch.mul(xs, ys, out=p)
                dt += float(p.sum())
        if add is not None:
            dst, w, first = add
            o = dst.view(-1)[i:i + PRODUCT_BLOCK]
            if first:
                if w != 1.0:
                    torch.mul(xs, w, out=o)
                else:
                    o.copy_(xs)
            elif w != 1.0:
                t = term[:xs.numel()]
                torch.mul(xs, w, out=t)  # (rounded to float32 before the add, as weighted_sum does)
                o.add_(t)
            else:
                o.add_(xs)
    return sq, dt


def _norm_and_dot_job(job: tuple) -> tuple[float, float]:
    """:func:`norm_and_dot` of one ``(tensor, reference or None, add or None)``."""
    return norm_and_dot(*job)


def push_norm_and_dot(d: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor] | None,
                      pool: Executor | None = None, add: tuple[dict, float] | None = None) -> tuple[float, float]:
    """``(sq_norm(d), dot(d, ref))`` in one read of the push ``d`` (:func:`norm_and_dot` a
    tensor; ``ref`` None: 0 for the product; a ``pool`` takes a tensor a thread, the sums still
    added in name order): the same two floats as those functions. ``add = (out, w)``: also
    ``out[name] += w * d[name]`` in that read (a name not in ``out`` yet starts there), as
    :func:`shoal.train.outer.weighted_sum` adds a contributor."""
    ref = ref or {}
    jobs = []
    for k, t in d.items():
        into = None
        if add is not None:
            out, w = add
            first = k not in out
            if first:
                out[k] = torch.empty_like(t, memory_format=torch.contiguous_format)
            into = (out[k], w, first)
        jobs.append((t, ref.get(k), into))
    sq = dt = 0.0
    for a, b in (pool.map if pool is not None else map)(_norm_and_dot_job, jobs):
        sq, dt = sq + a, dt + b
    return sq, dt


def sq_norm(grads: Mapping[str, torch.Tensor], pool: Executor | None = None) -> float:
    """Squared L2 norm over every tensor of a push (see :func:`sum_product`); with a ``pool`` a
    thread a tensor, the tensors' sums still added in name order (the same bits)."""
    if pool is None:
        return float(sum(sum_product(g, g) for g in grads.values()))
    return float(sum(pool.map(lambda g: sum_product(g, g), grads.values())))


def dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Inner product of two pushes over their common tensors (see :func:`sum_product`)."""
    return float(sum(sum_product(a[k], b[k]) for k in a if k in b))


def sq_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Squared L2 norm of a - b (the difference taken in fp32; see :func:`sum_product`).

    A large tensor's difference is taken a :data:`PRODUCT_BLOCK` at a time, each block squared
    and summed as :func:`sum_product` sums it: the same bits as the whole difference's
    ``sum_product``, without a difference tensor of the push's size (fresh memory for every
    recomputed push of a large stage)."""
    total = 0.0
    diff = sq = None
    for k in a:
        x, y = a[k].detach().reshape(-1), b[k].detach().reshape(-1)
        if x.numel() <= PRODUCT_BLOCK:
            d = x.float() - y.float()
            total += sum_product(d, d)
            continue
        if diff is None:
            diff, sq = torch.empty(PRODUCT_BLOCK, dtype=torch.float32), torch.empty(PRODUCT_BLOCK, dtype=torch.float32)
        part = 0.0
        for i in range(0, x.numel(), PRODUCT_BLOCK):
            xs, ys = x[i:i + PRODUCT_BLOCK].float(), y[i:i + PRODUCT_BLOCK].float()
            d, p = diff[:xs.numel()], sq[:xs.numel()]
            torch.sub(xs, ys, out=d)
            torch.mul(d, d, out=p)
            part += float(p.sum())
        total += part
    return total


def recompute_grads(module: torch.nn.Module, spec, step: int, mb: int, *, first: bool, last: bool,
                    inp: torch.Tensor | None, out_grad: torch.Tensor | None,
                    loss_scale: float = 1.0, prefix: int | None = None) -> dict[str, torch.Tensor]:
    """Parameter gradients of micro-batch ``mb`` of ``step`` at one stage, fp32 on the CPU.

    Uses ``torch.autograd.grad`` so the module's ``.grad`` fields (the commit's) are not
    touched. The same formula as a worker's ``BWD``/``FWDBWD`` task. ``prefix``: only the
    first ``prefix`` positions of each sequence (attention is causal, so their outputs do not
    depend on the rest): the terms of those positions in the micro-batch's gradient.
    """
    names = [n for n, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    inp, out_grad = tensor_of(inp), tensor_of(out_grad)  # (a relay kept undecoded is decoded here, in a thread)
    tokens, targets = micro_batch(spec, step, mb)
    if prefix is not None:
        tokens, targets = tokens[:, :prefix], targets[:, :prefix]
        inp = None if inp is None else inp[:, :prefix]
        out_grad = None if out_grad is None else out_grad[:, :prefix]
    x = tokens if first else inp.detach()
    with torch.enable_grad():
        if last:
            loss = module(x, targets) / spec.micro_batches
            if loss_scale != 1.0:
                loss = loss * loss_scale
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        else:
            out = module(x)
            grads = torch.autograd.grad(out, params, grad_outputs=out_grad, allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, params, grads, strict=True)}


def load_weights(module: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """``module`` with its parameters set to ``weights`` (a copy of a stage's weights of some
    version, by parameter name): what a check recomputes a past push on."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(weights[n])
    return module


def recompute_threads() -> int:
    """Threads a push's recomputation runs on: :data:`RECOMPUTE_THREADS`, at most this
    process's CPUs."""
    from shoal.train.local import cpu_cores

    return max(1, min(RECOMPUTE_THREADS, cpu_cores()))


def recompute_pool() -> ThreadPoolExecutor:
    """The threads pushes are recomputed on (:func:`recompute_threads`), apart from the event
    loop's executor, whose thread waits for them."""
    global _RECOMPUTE_POOL
    if _RECOMPUTE_POOL is None:
        _RECOMPUTE_POOL = compute_pool(recompute_threads(), "shoal-recompute")
    return _RECOMPUTE_POOL


def recompute_sum(module: torch.nn.Module, spec, step: int,
                  inputs: Iterable[tuple[int, torch.Tensor | None, torch.Tensor | None]], *, first: bool, last: bool,
                  loss_scale: float = 1.0, threads: int | None = None) -> dict[str, torch.Tensor]:
    """The sum of :func:`recompute_grads` over ``inputs`` (micro-batch, stage input, output
    gradient; inputs and gradients taken in fp32, as a bf16 run's are recomputed), what a
    push of those micro-batches holds.

    ``threads`` micro-batches at a time (default :func:`recompute_threads`, on
    :func:`recompute_pool`), summed in the order of ``inputs`` as autograd makes each
    parameter's gradient (:func:`summed_grads`): the same bits as one at a time, one float32
    copy of the stage for the sum however many threads run."""
    items = [(mb, None if inp is None else tensor_of(inp).float(), None if og is None else tensor_of(og).float(), None)
             for mb, inp, og in inputs]
    width = recompute_threads() if threads is None else max(1, threads)
    if width <= 1 or len(items) <= 1:
        return summed_grads(module, spec, step, items, first=first, last=last, loss_scale=loss_scale)
    if width == recompute_threads():
        return summed_grads(module, spec, step, items, first=first, last=last, loss_scale=loss_scale,
                            pool=recompute_pool())
    with compute_pool(width, "shoal-recompute") as pool:
        return summed_grads(module, spec, step, items, first=first, last=last, loss_scale=loss_scale, pool=pool)


def reference_inputs(inputs: list[tuple[int, torch.Tensor | None, torch.Tensor | None]], micro_batch_size: int,
                     seq_len: int, max_mbs: int, max_tokens: int, spread: bool = True
                     ) -> list[tuple[int, torch.Tensor | None, torch.Tensor | None, int | None]]:
    """What the screen's reference gradient is computed on (pure): the first micro-batches of
    ``inputs`` (micro-batch, stage input, output gradient), at most ``max_mbs`` of them and
    ``max_tokens`` tokens. ``spread``: the budget is shared by every taken micro-batch, each cut
    to a causal prefix of its sequences where it does not fit whole (more sequences, each
    shorter); else whole micro-batches first, the last one cut (``prefix``: None for a whole
    micro-batch; at least one position). The planner prices the same count
    (``shoal.plan.cost.reference_tokens``)."""
    taken = inputs[:max(0, max_mbs)]
    if not taken or max_tokens <= 0:
        return []
    whole = micro_batch_size * seq_len
    if spread:
        share = max_tokens // len(taken)
        prefix = None if share >= whole else max(1, share // micro_batch_size)
        return [(mb, inp, out_grad, prefix) for mb, inp, out_grad in taken]
    out = []
    left = max_tokens
    for mb, inp, out_grad in taken:
        if left <= 0:
            break
        prefix = None if whole <= left else max(1, left // micro_batch_size)
        out.append((mb, inp, out_grad, prefix))
        left -= whole if prefix is None else prefix * micro_batch_size
    return out


class _OrderedSum:
    """The sum of several micro-batches' gradients, taken a parameter at a time as autograd
    makes each (a hook on every parameter, :func:`summed_grads`), in micro-batch order
    whichever thread gets there first: the same bits as summing whole gradients in order, but
    no thread ever holds a whole gradient of the stage (one float32 copy for the sum, not one a
    thread)."""

    def __init__(self, count: int):
        self.sum: dict[str, torch.Tensor] = {}
        self.added: list[set[str]] = [set() for _ in range(count)]  # per micro-batch: parameters it added
        self.finished = [False] * count  # per micro-batch: its backward has ended (a parameter it never added counts as 0)
        self.cv = threading.Condition()

    def add(self, i: int, name: str, g: torch.Tensor) -> None:
        with self.cv:
            # micro-batch i adds a parameter after every earlier micro-batch has added it or ended
            self.cv.wait_for(lambda: all(name in self.added[j] or self.finished[j] for j in range(i)))
            cur = self.sum.get(name)
            if cur is None:
                self.sum[name] = g
            elif cur.is_contiguous():
                cur.add_(g)
            else:  # (a view autograd handed out, e.g. a broadcast: not written into)
                self.sum[name] = cur + g
            self.added[i].add(name)
            self.cv.notify_all()

    def finish(self, i: int) -> None:
        with self.cv:
            self.finished[i] = True
            self.cv.notify_all()


_SUMMING = threading.local()  # on a thread summing gradients: (its _OrderedSum, its micro-batch's index)


def summed_grads(module: torch.nn.Module, spec, step: int,
                 inputs: list[tuple[int, torch.Tensor | None, torch.Tensor | None, int | None]], *,
                 first: bool, last: bool, loss_scale: float = 1.0, pool: Executor | None = None
                 ) -> dict[str, torch.Tensor]:
    """The sum of :func:`recompute_grads` over ``inputs`` (micro-batch, stage input, output
    gradient, causal prefix or None), in their order. Each micro-batch runs on a thread of
    ``pool`` (torch releases the GIL in its kernels), or in turn on this thread without one;
    either way each parameter's gradient is added into one sum as autograd makes it
    (:class:`_OrderedSum`): the same bits as summing whole gradients in order, and one float32
    copy of the stage however many threads run (not one a thread)."""
    names = {id(p): n for n, p in module.named_parameters()}
    total = _OrderedSum(len(inputs))

    def hook_for(name: str):
        def hook(g: torch.Tensor) -> torch.Tensor:
            job = getattr(_SUMMING, "job", None)
            if job is None or job[0] is not total:  # (another computation on these weights: not ours)
                return g
            total.add(job[1], name, g)
            return g.new_zeros(()).expand_as(g)  # what autograd hands back instead: no memory
        return hook

    def one(i: int) -> None:
        mb, inp, out_grad, prefix = inputs[i]
        _SUMMING.job = (total, i)
        try:
            recompute_grads(module, spec, step, mb, first=first, last=last, inp=inp, out_grad=out_grad,
                            loss_scale=loss_scale, prefix=prefix)
        finally:
            _SUMMING.job = None
            total.finish(i)

    handles = [p.register_hook(hook_for(names[id(p)])) for p in module.parameters()]
    try:
        if pool is None or len(inputs) <= 1:
            for i in range(len(inputs)):
                one(i)
        else:
            futures = [pool.submit(one, i) for i in range(len(inputs))]
            wait(futures)  # (all of them, even past a failure: none is left running on the module)
            for f in futures:
                f.result()
    finally:
        for h in handles:
            h.remove()
    return {n: total.sum[n] if n in total.sum else torch.zeros_like(p) for n, p in module.named_parameters()}


def reference_gradient(module: torch.nn.Module, spec, step: int,
                       inputs: list[tuple[int, torch.Tensor | None, torch.Tensor | None, int | None]], *,
                       first: bool, last: bool, pool: Executor | None = None) -> dict[str, torch.Tensor]:
    """Local mode: the server's own gradient at the merged weights (``module``) on ``inputs``
    (:func:`reference_inputs` of one step the server holds), with the workers' formula, summed
    (:func:`summed_grads`; a micro-batch a thread of ``pool``, which the planner prices on as
    many cores: ``shoal.plan.cost.reference_cores``)."""
    return summed_grads(module, spec, step, inputs, first=first, last=last, pool=pool)


def reference_cosines(ref: dict[str, torch.Tensor], deltas: dict[str, dict[str, torch.Tensor]],
                      pool: Executor | None = None) -> dict[str, float | None]:
    """Local mode: each pseudo-gradient's cosine to the server's own gradient ``ref``
    (:func:`reference_gradient`, at the merged weights the round started from). An honest
    replica's pseudo-gradient (anchor minus its weights after AdamW steps down the loss)
    points along it; a flipped, scaled-negative or noise one does not. None: a zero norm.
    Each pseudo-gradient is read once for its norm and its product with ``ref``
    (:func:`norm_and_dot`); a ``pool`` takes a tensor a thread, the sums still added in name
    order (the same bits)."""
    ref_sq = sq_norm(ref, pool)
    out: dict[str, float | None] = {}
    for w in sorted(deltas):  # one at a time: a push held as frames is decoded for this read only
        d = deltas[w]
        sq, dt = push_norm_and_dot(d, ref, pool)
        denom = math.sqrt(sq * ref_sq)
        out[w] = dt / denom if denom > 0 else None
        del d
    return out


MEDIAN_SAMPLE = SCREEN_SAMPLE  # coordinates a round's median is taken over at most (round_measures)
MEDIAN_BLOCK = 1 << 16  # coordinates whose median is taken at once


def sample_positions(total: int, k: int, seed: int) -> torch.Tensor | None:
    """``k`` coordinates of a ``total``-coordinate stage drawn from ``seed``, sorted (None: all,
    where ``total <= k``). The server's seed is secret, so a worker cannot aim at the sample."""
    if total <= k:
        return None
    gen = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    return torch.randint(total, (k,), generator=gen).sort().values


def pick(d, pos: torch.Tensor | None) -> torch.Tensor:
    """The stage ``d`` flattened in name order, at the coordinates ``pos`` (all: None), fp32."""
    parts, at = [], 0
    for n in sorted(d):
        t = d[n].detach().reshape(-1)
        k = t.numel()
        if pos is None:
            parts.append(t.float())
        else:
            lo, hi = int(torch.searchsorted(pos, at)), int(torch.searchsorted(pos, at + k))
            parts.append(t[pos[lo:hi] - at].float())
        at += k
    return torch.cat(parts)


def round_measures(deltas, lr_sums: dict[str, float], quorum: int, *, sample: int = MEDIAN_SAMPLE,
                   seed: int = 0, pool: Executor | None = None) -> tuple[dict[str, float], dict[str, float | None]]:
    """:func:`screen_measures` without a reference gradient: (norms, cosines to the median)."""
    norms, cos, _, _ = screen_measures(deltas, lr_sums, quorum, sample=sample, seed=seed, pool=pool)
    return norms, cos


def screen_measures(deltas, lr_sums: dict[str, float], quorum: int, *, ref: Mapping[str, torch.Tensor] | None = None,
                    sum_weights: Mapping[str, float] | None = None, sample: int = MEDIAN_SAMPLE, seed: int = 0,
                    pool: Executor | None = None
                    ) -> tuple[dict[str, float], dict[str, float | None], dict[str, float | None],
                               dict[str, torch.Tensor] | None]:
    """Local mode: each contributor's pseudo-gradient norm per unit of learning rate (its
    norm over the summed learning rates of its inner steps: an AdamW step moves each weight
    by about the learning rate, so this is steady across workers that took different numbers
    of steps and across the schedule), and its cosine to the coordinate-wise median of the
    round's pseudo-gradients (None: fewer than ``quorum`` contributors).

    ``deltas`` is read one contributor at a time (a :class:`shoal.runtime.sync.held.HeldPushes`
    decodes a push held as frames for that read only). The median is over every coordinate of
    a stage of at most ``sample`` of them, and over ``sample`` coordinates drawn from ``seed``
    (:func:`sample_positions`) of a larger one, so what it holds is ``contributors x sample``
    numbers, not every contributor's stage; over 4 M random coordinates a cosine moves by about
    1/2,000. A ``pool`` takes each norm a tensor a thread (:func:`sq_norm`).

    With ``ref`` (the screen's reference gradient) the third dict holds each one's cosine to it,
    the floats :func:`reference_cosines` gives, from the same read of the push
    (:func:`push_norm_and_dot`); without, it is empty.

    With ``sum_weights`` (:func:`shoal.train.outer.merge_weights` of the round, in name order)
    the fourth item is :func:`shoal.train.outer.weighted_sum` of the pushes with them, the same
    bits, from that read too (the merge takes it where the screen leaves every contributor
    in); None without, or where a push is not float32.
    """
    workers = sorted(deltas)
    need = len(workers) >= quorum
    sq: dict[str, float] = {}
    stacked: torch.Tensor | None = None  # contributor x coordinate, filled a row at a time
    pos: torch.Tensor | None = None
    dots: dict[str, float] = {}
    summed: dict[str, torch.Tensor] | None = {} if sum_weights else None
    if summed is not None and list(sum_weights) != sorted(sum_weights):
        raise ValueError("screen_measures: sum_weights must be in name order (merge_weights)")
    for i, w in enumerate(workers):
        d = deltas[w]
        if summed is not None and any(t.dtype != torch.float32 for t in d.values()):
            summed = None  # (weighted_sum keeps a push's own dtype: left to it)
        add = (summed, sum_weights[w]) if summed is not None and w in sum_weights else None
        if ref is None and add is None:
            sq[w] = sq_norm(d, pool)
        else:
            sq[w], dots[w] = push_norm_and_dot(d, ref, pool, add)
        if need:
            if i == 0:
                pos = sample_positions(sum(t.numel() for t in d.values()), sample, seed)
            row = pick(d, pos)
            if stacked is None:
                stacked = torch.empty(len(workers), row.numel(), dtype=torch.float32)
            stacked[i] = row
            del row
        del d
    norms = {w: math.sqrt(sq[w]) / max(lr_sums.get(w, 0.0), 1e-12) for w in workers}
    ref_cos: dict[str, float | None] = {}
    if ref is not None:
        ref_sq = sq_norm(ref, pool)
        for w in workers:
            denom = math.sqrt(sq[w] * ref_sq)
            ref_cos[w] = dots[w] / denom if denom > 0 else None
    if summed is not None and set(sum_weights) - set(workers):
        summed = None  # a weight without a push: not this round's sum
    if not need:
        return norms, dict.fromkeys(workers), ref_cos, summed
    # the median a block of coordinates at a time (a whole one would copy the matrix), sums in fp64
    med = torch.empty(stacked.shape[1], dtype=torch.float32)
    for c in range(0, stacked.shape[1], MEDIAN_BLOCK):
        med[c:c + MEDIAN_BLOCK] = stacked[:, c:c + MEDIAN_BLOCK].median(dim=0).values
    med64 = med.double()
    centre_sq = float(med64.dot(med64))
    med_dots = [float(stacked[i].double().dot(med64)) for i in range(len(workers))]
    # over a sample, each norm is the sample's too, so the cosine is the sample's own
    own = sq if pos is None else {w: float(stacked[i].double().pow(2).sum()) for i, w in enumerate(workers)}
    cos: dict[str, float | None] = {}
    for i, w in enumerate(workers):
        denom = math.sqrt(own[w] * centre_sq)
        cos[w] = med_dots[i] / denom if denom > 0 else None
    return norms, cos, ref_cos, summed


@dataclass
class DupCheck:
    """A redundant check under way: ``target``'s push of ``mbs`` computed again by ``checker``."""

    check_id: int
    step: int
    epoch: int
    target: str  # the worker whose push is checked
    mbs: tuple[int, ...]  # the micro-batches that push covers
    grads: dict[str, torch.Tensor]  # the push as the server counted it
    checker: str  # the worker computing it again
    todo: list[int] = field(default_factory=list)  # micro-batches not leased to the checker yet
    leased: dict[int, int] = field(default_factory=dict)  # lease id -> micro-batch
    results: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # mb -> checker's gradient
    judging: bool = False  # every result is in; the comparison runs
    created: float = 0.0  # monotonic time it was made or last leased or answered (a checker that stops asking lets it go)
    exact: bool = True  # fp32 exact run: bitwise agreement expected (else bf16 tolerances)


def sum_in_order(per_mb: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-micro-batch gradients summed in micro-batch order (a worker's pre-summed push of
    0..k, and the server's sum, add in that order: equal inputs give bitwise equal sums)."""
    total: dict[str, torch.Tensor] = {}
    for mb in sorted(per_mb):
        for n, g in per_mb[mb].items():
            if n in total:
                total[n].add_(g.float() if g.dtype != total[n].dtype else g)
            else:
                total[n] = g.clone()
    return total


def compare_pushes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """Whether two pushes are bitwise equal, and their relative L2 difference against ``b``."""
    if set(a) != set(b):
        return False, math.inf
    equal = all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    if equal:
        return True, 0.0
    if any(a[k].shape != b[k].shape for k in a):
        return False, math.inf
    ref = sq_norm(b)
    diff = sq_diff(a, b)
    if ref <= 0:
        return False, 0.0 if diff <= 0 else math.inf
    return False, math.sqrt(diff / ref)


def drift_indices(params: dict[str, torch.Tensor], m: int, secret: str) -> dict[str, torch.Tensor]:
    """``m`` coordinates of a stage's weights drawn with ``secret`` (a worker cannot know
    them), spread over the tensors in proportion to their sizes: flat indices per tensor."""
    sizes = {n: p.numel() for n, p in params.items()}
    total = sum(sizes.values())
    if total <= 0 or m <= 0:
        return {}
    gen = torch.Generator().manual_seed(int.from_bytes(secret.encode()[:7].ljust(7, b"\0"), "big"))
    flat = torch.randperm(total, generator=gen)[:min(m, total)].sort().values
    out, start = {}, 0
    for n, k in sizes.items():
        lo = int(torch.searchsorted(flat, start))
        hi = int(torch.searchsorted(flat, start + k))
        if hi > lo:
            out[n] = flat[lo:hi] - start
        start += k
    return out


def drift_sample(grads: dict[str, torch.Tensor], idx: dict[str, torch.Tensor]) -> torch.Tensor:
    """A push's values at the sampled coordinates (fp64, fixed order)."""
    parts = [grads[n].detach().reshape(-1)[i].double() if n in grads else torch.zeros(len(i), dtype=torch.float64)
             for n, i in idx.items()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def drift_deviations(samples: list[tuple[str, int, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each worker's deviation in one step from the other workers' mean, per micro-batch (pure
    tensors): ``samples`` are (worker, micro-batches covered, sampled values) of one step's
    pushes. A worker's pushes of the step are taken together (one deviation per worker and
    step, so its deviations are independent across steps), and compared with the *other*
    workers' pushes only (its own would hide part of its bias); a worker alone in the step
    has no deviation."""
    per: dict[str, tuple[int, torch.Tensor]] = {}
    for w, k, v in samples:
        k0, v0 = per.get(w, (0, None))
        per[w] = (k0 + k, v if v0 is None else v0 + v)
    out = []
    for w, (k, v) in sorted(per.items()):
        n_o = sum(k2 for w2, (k2, _) in per.items() if w2 != w)
        if n_o <= 0 or k <= 0:
            continue
        mean_o = sum(v2 for w2, (_, v2) in per.items() if w2 != w) / n_o
        out.append((w, v / k - mean_o))
    return out
