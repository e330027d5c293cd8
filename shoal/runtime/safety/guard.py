"""Screening gradient pushes for poisoned or broken work, and the ban rule.

A stage server screens every gradient push before it counts it:

* **screen** (every push, cheap): the push's norm against the stage's robust centre
  (the median norm of recent honest pushes) and its direction against the sum of the
  step's other honest pushes. A flag is only a suspicion: with two workers per stage there
  is no honest majority to vote with, so a flag never bans by itself in an exact run.
* **verify** (exact fp32 runs): a flagged push, a worker's first push at this stage, and
  a seeded random fraction (``--spot-check``) are recomputed by the stage server itself,
  which holds the step's weights, inputs and output gradients, and compared within a
  tolerance. A mismatch bans the worker; a match clears it. The server is the arbiter
  because a second worker's opinion cannot break a tie between two workers.
* **redundant computation** (exact sync, fp32 or bf16): a drawn push is computed again by
  another worker of the stage (:func:`pick_checker`) instead of by the server; the two are
  compared (:func:`dup_disagree`) and only a disagreement costs the server a recomputation,
  which decides who lied (:func:`dup_verdict`).
* **drift** (exact sync): per worker, its pushes' deviations from the other workers' are
  summed over the steps (:func:`drift_z`); a consistent bias makes it a suspect whose every
  push is checked (:func:`drift_suspect`), never a ban by itself.

Local mode (``--sync local``) has no recomputation (a pseudo-gradient is many inner
steps of a replica), so a merge screens each round's pseudo-gradients against the round
itself: a contributor whose per-step norm or whose direction disagrees with the majority
(:func:`screen_round`) is banned and left out of the merge. The tensors are measured by
:func:`shoal.runtime.safety.verify.round_measures` (decoded tensors, whatever the wire codec).

Everything here that decides is a small pure function, tested directly
(``tests/test_guard.py``); the server calls them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.plan.types import SCREEN_REF_MBS, SCREEN_REF_TOKENS


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds of the push screen and the ban rule (why each value: see the comments)."""

    # Honest per-micro-batch gradient norms of a stage spread widely: up to 9.2x above and
    # 20x below the median of the recent pushes (bench/bench_screen.py, tiny, 20 steps; see
    # bench/results/screen.md). A flag costs one recomputation, never a ban by itself, so
    # the ratio trades server compute for sensitivity: 10 flags a -20x push of a typical
    # micro-batch and few honest ones.
    norm_ratio: float = 10.0
    # Recent honest per-push norms the centre is the median of: enough to ride out one odd
    # micro-batch, few enough to follow the norm as training lowers it.
    history: int = 32
    # Cosine to the last committed gradient of the stage below this flags a push. Measured
    # honest micro-batches sit near 0 (lowest -0.24, bench/results/screen.md): a plain sign
    # flip is not visible this way on small models, only pushes aimed against the last step.
    # Again only a suspicion (a recomputation decides).
    min_cosine: float = -0.5
    # Relative L2 error a recomputation may differ by. Only fp32 pushes in raw frames are
    # recomputed; a worker's kernels may still differ from the server's (GPU vs CPU, a
    # cached forward), by ~1e-6 relative; measured honest CPU runs: 0 (bench/results/screen.md).
    # 1e-3 leaves a wide margin and still catches any scaling by more than 0.1 %.
    rel_tol: float = 1e-3
    # Without an exact recomputation (bf16/fp16 runs, lossy codecs), a worker is banned once
    # this many of its pushes in a row were flagged: a scaled-up liar's pushes nearly all
    # flag, honest ones seldom (a judgement from the fp32 figures; not measured in bf16).
    strikes_to_ban: int = 3
    # Recompute every worker's first push at a stage: catches a worker that lies from the
    # start, before any history exists (step 0 has no centre yet).
    verify_first: bool = True
    # Off only where pushes are made up on purpose (unit tests of the task pool and the wire).
    enabled: bool = True
    # Adaptive spot checks (exact runs): a worker's first this-many pushes at a stage are all
    # recomputed (a new worker has no record), then its pushes are drawn at a rate that falls
    # as its record of passed recomputations grows (:func:`verify_rate`).
    verify_first_n: int = 2
    # The rate after a worker's first pushes is trust_pushes / (trust_pushes + passed checks),
    # never below --spot-check: about 0.67 after 2 passed checks, 0.25 after 12, 0.1 after 36.
    # A worker lying from its k-th push on is thus caught within a few pushes; an honest one
    # costs about sqrt(2 trust_pushes N) recomputations over its first N pushes.
    trust_pushes: float = 4.0
    # Every screen flag in a worker's record (even one its recomputation cleared) multiplies its
    # rate by 1 + flags: a worker whose pushes look odd is checked more.
    flag_weight: float = 1.0
    # Recompute every push of the run's last step: a worker that lied on every push since its
    # last check cannot finish the run unseen (a failed check there undoes all its unchecked work).
    verify_last_step: bool = True
    # At the last step's commit, also recompute the newest unverified pushes of every worker
    # that pushed nothing in that step (safety/endcheck.py): a worker that lies on every push
    # from some step on is caught even if it takes no task of the last step.
    end_check: bool = True
    # The end check keeps a sample of each record's gradient, not all of it: about one
    # coordinate in this many of every tensor, at positions drawn from a secret seed after the
    # push (safety/endcheck.py; a lie touching m coordinates escapes with probability about
    # (1 - 1/k)^m). 1 keeps every coordinate.
    end_sample_every: int = 64
    # Tensors of at most this many elements (norms, biases) are kept whole: a lie confined to
    # them is caught surely, for at most 16 KiB per tensor.
    end_sample_whole: int = 4096
    # Local mode (--sync local): contributors a merge needs for the round's own centre (the
    # coordinate-wise median of its pseudo-gradients) to outvote one dishonest replica.
    # With fewer, only the norm is screened, against the stage's earlier honest rounds.
    local_quorum: int = 3
    # Local mode: cosine of a pseudo-gradient to the round's coordinate-wise median below
    # this flags it. Honest replicas start from the same weights and see the same data
    # distribution, so they point the same way (lowest measured in honest runs: see
    # docs/poisoning.md); a sign flip points away.
    local_min_cosine: float = 0.0
    # Local mode: a pseudo-gradient whose norm per unit of learning rate exceeds this many
    # times what AdamW can move the stage's weights (:func:`adamw_move_bound`) is flagged in
    # any round, with or without a quorum. Honest replicas measured at most 0.855 of the bound
    # (the suite's local-mode runs; a first step), the -20x replica 10.3x; the margin
    # covers inner steps the server did not count (their lr missing from the sum: 2x at H = 2
    # if one of two is missed) and int8 error feedback.
    local_bound_margin: float = 4.0
    # Local mode, every merge: the server computes its own gradient at the round's starting
    # weights on at most this many micro-batches of the first step it commits after its
    # previous merge, in the background while the round's other steps run
    # (:func:`shoal.runtime.safety.verify.reference_gradient`), so no lone contributor is merged
    # unchecked, and colluders that are most of a round (its median) are judged too. 0: off.
    local_ref_mbs: int = SCREEN_REF_MBS
    # ... and on at most this many tokens (a causal prefix of each sequence beyond them): what
    # the planner prices on one server core (shoal.plan.cost.reference_cpu_time). 0: off.
    local_ref_tokens: int = SCREEN_REF_TOKENS
    # A pseudo-gradient whose cosine to that gradient is below this many times 1/sqrt(n) (n:
    # the stage's weights) is flagged (in every merge). A sign flip or a negative scale
    # points against it; a random direction has a cosine of about N(0, 1/n) to any fixed
    # vector. Honest replicas point along it: 0.0068-0.20 in the tiny model's rounds (n =
    # 0.66M-1.33M, H = 2-4, 1-2 contributors; docs/faults.md), as low as 1.4x a 4-sigma
    # threshold (0.0049), so the threshold is 0: against the gradient. Noise then flags in
    # half the rounds (caught within k rounds with probability 1 - 2^-k), never an honest replica seen.
    local_ref_sigmas: float = 0.0
    # A flagged pseudo-gradient is banned only below minus this cosine; between it and the flag
    # threshold it is held out of the merge (its worker stays). Sign flips and x-2 measured
    # -0.12 to -0.17; an honest replica moved into the stage mid-round measured -0.002.
    local_ref_ban: float = 0.05
    # Redundant computation (exact sync, fp32 or bf16, raw frames): a push drawn for a random
    # check (not a first, flagged or last-step one) is computed again by another worker of the
    # stage instead of by the server, which recomputes only when the two disagree. False: the
    # server recomputes every drawn push itself (as before).
    redundant: bool = True
    # Two fp32 results of one micro-batch from the same kernels are bitwise equal, so any
    # difference counts as a disagreement (0); it costs one server recomputation, never a ban
    # by itself (different hardware, GPU against CPU, then only shifts the work to the server).
    dup_rel_tol: float = 0.0
    # bf16: two workers' results of one micro-batch differ by rounding (measured: see
    # docs/poisoning.md); a relative L2 difference above this is a disagreement. The poisons
    # of the bench differ by 0.5 (bias) to 21 (x-20).
    dup_rel_tol_lowp: float = 0.1
    # bf16: relative L2 error a worker's result may have against the server's fp32
    # recomputation before it is judged a lie (after a disagreement, or a drawn push no other
    # worker can check). Honest bf16 results measured far below it (docs/poisoning.md); the
    # bench's bias is 0.5.
    lowp_rel_tol: float = 0.25
    # Drift test (every run but local mode): per worker, sampled coordinates of the deviation
    # of each push from the step's mean of the other workers' pushes are summed over its pushes;
    # this many coordinates per stage (drawn with the server's secret).
    drift_coords: int = 4096
    # A worker's drift statistic (:func:`drift_z`) above this makes it a suspect: its pushes
    # are then all recomputed (or checked twice) until it falls back. Never a ban by itself.
    # Gradient coordinates are correlated, so honest statistics spread wider than N(0, 1):
    # up to 11.15 measured (a bf16 run of 4 workers; docs/poisoning.md); the bench's bias
    # reached 15.6 after two biased steps.
    drift_z: float = 12.0
    # Pushes a worker needs in its record before its drift is judged (one deviation's
    # self-normalised sum carries no information: every coordinate's z is +-1).
    drift_min_pushes: int = 3
    # Routine server recomputations (a worker's first pushes, random draws no other worker can
    # check) run beside the steps on a thread of their own, the push counting as unverified
    # until judged (safety/deferred.py): beside a GPU worker one took 37-70 s of server CPU and
    # held up its step (bench/results/gpu-runtime.md). Flags (but a push flagged only as too
    # small), drift suspects and the last step stay inline.
    deferred_checks: bool = True
    # Deferred checks a server holds at once (each keeps the push and a copy of the stage's
    # weights); a push drawn while they are full counts as unverified unchecked, like an undrawn one.
    deferred_pending: int = 2
    # Off only in benches that measure the framework's own CPU (RECOMPUTE_ENV): the servers then
    # recompute no push (first, flagged or drawn), which are compute, not protocol.
    recompute: bool = True


DEFAULT = GuardConfig()
# Test hook: a fixed spot-check rate for workers past their first ``verify_first_n`` pushes
# (e.g. 0: only first, flagged and last-step pushes are recomputed, so poisoned pushes are
# committed unverified and a ban must undo them). Members started by ``shoal launch`` inherit it.
SPOT_RATE_ENV = "SHOAL_TEST_SPOT_RATE"
# Bench and test hook: "0" judges every server recomputation before its push counts (the
# behaviour before deferred checks), so a bench compares both in one run
# (bench/bench_deferred_checks.py) and a test can fix when a worker's first pushes are judged.
DEFERRED_ENV = "SHOAL_DEFERRED_CHECKS"
# Bench hook: "0" makes the stage servers recompute no push at all, so a bench of the
# framework's CPU (bench/bench_runtime_cpu.py --models) does not count a screen's
# recomputations of an early run's falling gradient norms as protocol. Never for training.
RECOMPUTE_ENV = "SHOAL_BENCH_RECOMPUTE"


def guard_config(env: dict[str, str]) -> GuardConfig:
    """The stage servers' screen thresholds: the defaults, with the bench hooks read from ``env``."""
    cfg = DEFAULT if env.get(DEFERRED_ENV, "1") != "0" else dataclasses.replace(DEFAULT, deferred_checks=False)
    if env.get(RECOMPUTE_ENV, "1") == "0":
        cfg = dataclasses.replace(cfg, recompute=False)
    return cfg


def robust_centre(history: list[float]) -> float | None:
    """The median of recent honest per-push norms (None: no history yet)."""
    good = [n for n in history if math.isfinite(n) and n > 0]
    return statistics.median(good) if good else None


def screen(norm: float, cosine: float | None, centre: float | None, cfg: GuardConfig = DEFAULT) -> str:
    """Why a push of gradient norm ``norm`` looks wrong ("" when it does not).

    ``cosine``: its cosine to the sum of the step's other honest pushes (None: none yet);
    ``centre``: :func:`robust_centre` of the stage (None: no history yet).
    """
    if not math.isfinite(norm):
        return f"norm {norm} is not finite"
    if centre is not None and centre > 0:
        if norm > cfg.norm_ratio * centre:
            return f"norm {norm:.4g} is {norm / centre:.1f}x the stage's median {centre:.4g}"
        if norm < centre / cfg.norm_ratio:
            return f"norm {norm:.4g} is {centre / max(norm, 1e-30):.1f}x below the stage's median {centre:.4g}"
    if cosine is not None and cosine < cfg.min_cosine:
        return f"direction: cosine {cosine:.2f} to the step's other pushes"
    return ""


def low_only(norm: float, cosine: float | None, centre: float | None, cfg: GuardConfig = DEFAULT) -> bool:
    """Whether a push's only flag is a norm ``cfg.norm_ratio`` times *below* the centre.

    Such a push is no evidence of poisoning: honest norms fall that far as training settles
    (and after a re-plan changes who pushes what), and a too-small gradient can only slow
    training. Without a recomputation it neither strikes nor stays out of the centre, or
    the centre would stay where the norms were and ban every honest worker after it
    (seen in a bf16 run: the lone worker of a stage, 10.5x below a stale median).
    """
    if centre is None or centre <= 0 or not math.isfinite(norm) or norm >= centre / cfg.norm_ratio:
        return False
    return not (cosine is not None and cosine < cfg.min_cosine)


def spot_pick(seed: int, salt: str, stage: int, step: int, mb: int, fraction: float) -> bool:
    """Whether micro-batch ``mb`` of ``step`` at ``stage`` is spot-checked (a seeded draw)."""
    if fraction <= 0:
        return False
    if fraction >= 1:
        return True
    h = hashlib.sha256(f"{seed}/{salt}/{stage}/{step}/{mb}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64 < fraction


def push_spot_checked(seed: int, salt: str, stage: int, step: int, mbs, fraction: float) -> bool:
    """Whether a push covering micro-batches ``mbs`` is spot-checked: one seeded draw per
    push, keyed by its first micro-batch, so a ``fraction`` of pushes is recomputed
    whatever the number of micro-batches each covers (a push pre-summed over M
    micro-batches costs M recomputations; one draw per micro-batch would recompute it
    with probability 1 - (1 - fraction)^M)."""
    return bool(mbs) and spot_pick(seed, salt, stage, step, min(mbs), fraction)


def verify_rate(checked_ok: int, flags: int, floor: float, cfg: GuardConfig = DEFAULT,
                forced: float | None = None) -> float:
    """The probability that a worker's next push at a stage is recomputed, from its record there (pure).

    ``checked_ok``: its pushes whose recomputation matched; ``flags``: its pushes the screen
    flagged; ``floor``: the run's ``--spot-check`` fraction, the least rate (0: no random
    checks at all, only first and flagged pushes). A new worker is checked on every push until
    ``cfg.verify_first_n`` passed, then at ``trust_pushes / (trust_pushes + checked_ok)`` times
    ``1 + flag_weight * flags``, never below ``floor`` nor above 1. ``forced``: the rate
    after the first pushes instead (the ``SPOT_RATE_ENV`` test hook).
    """
    if floor <= 0:
        return 0.0
    if checked_ok < cfg.verify_first_n:
        return 1.0
    if forced is not None:
        return forced
    rate = cfg.trust_pushes / (cfg.trust_pushes + checked_ok) * (1.0 + cfg.flag_weight * max(0, flags))
    return min(1.0, max(floor, rate))


def server_check_note(local: bool, spot_check: float, precision: str, worker_kind: str) -> str:
    """A warning for a run whose stage servers will hold steps to recompute pushes of a worker
    on an accelerator ("" : none; pure). A server recomputes on its CPU: on the first lent H200
    one gpt-125m push of 8 micro-batches took a server 37-70 s against 0.2 s on the GPU
    (bench/results/gpu-runtime.md). Routine checks (first pushes, draws) run beside the steps
    (safety/deferred.py), but the last step's pushes (spot checks on) and, in fp32, pushes the
    screen flags are recomputed before they count. Local mode screens rounds without recomputing."""
    if local or not worker_kind.startswith(("cuda", "mps", "xpu")):
        return ""
    if precision != "fp32" and spot_check <= 0:
        return ""
    device = worker_kind.split(":", 1)[-1].strip()
    held = ("the pushes the screen flags and the last step's" if precision == "fp32" and spot_check > 0 else
            "the pushes the screen flags" if precision == "fp32" else "the last step's pushes")
    way_out = ("--precision bf16 with --spot-check 0" if precision == "fp32" else "--spot-check 0")
    return (f"spot checks: stage servers recompute pushes on their CPUs; routine checks run beside the steps, but "
            f"{held} are recomputed before they count, which beside {device} workers can take a minute or more "
            f"a push: give {way_out}, or run --sync local (screened without recomputing)")


def needs_verify(flag: str, first_push: bool, spot: bool, exact: bool, cfg: GuardConfig = DEFAULT) -> bool:
    """Whether the server recomputes a push: only in exact runs, when flagged, first or drawn."""
    return exact and cfg.recompute and (bool(flag) or (first_push and cfg.verify_first) or spot)


def rel_error(sq_diff: float, sq_ref: float) -> float:
    """Relative L2 error ||push - recomputed|| / ||recomputed|| from squared sums."""
    if sq_ref <= 0:
        return 0.0 if sq_diff <= 0 else math.inf
    return math.sqrt(sq_diff / sq_ref)


def ban_reason(flag: str, verified_error: float | None, strikes: int, cfg: GuardConfig = DEFAULT,
               lowp: bool = False) -> str:
    """The ban rule: why a worker is banned for the run after one push ("" : not banned).

    ``verified_error``: relative error of the push against the server's recomputation
    (None: not recomputed); ``strikes``: its consecutive flagged pushes, this one included.
    A recomputation decides when there is one (exact runs: within ``rel_tol``; ``lowp``, a
    bf16 push against the server's fp32 recomputation: within ``lowp_rel_tol``): a flag
    alone never bans there. Otherwise ``strikes_to_ban`` flags ban.
    """
    if verified_error is not None:
        tol = cfg.lowp_rel_tol if lowp else cfg.rel_tol
        if verified_error > tol or not math.isfinite(verified_error):
            return (f"its gradient differs from the recomputed one by {verified_error:.3g} "
                    f"(relative L2, tolerance {tol:g})" + (f"; screen: {flag}" if flag else ""))
        return ""
    if flag and strikes >= cfg.strikes_to_ban:
        return f"{strikes} pushes in a row flagged by the screen, the last: {flag}"
    return ""


def undo_version(unverified_since: dict[str, int], worker: str) -> int | None:
    """The newest weight version that none of ``worker``'s unverified committed pushes reached
    (pure): the step of its first committed push that was never recomputed (version ``s`` is
    the weights before step ``s`` was applied); None when everything it committed was checked."""
    return unverified_since.get(worker)


def keep_version(unverified_since: list[dict[str, int]], banned: set[str] = frozenset()) -> int | None:
    """The oldest version a ban may have to roll the run back to (pure): the earliest step any
    worker not yet banned has an unverified committed push in, over every stage's record.
    Each stage keeps a checkpoint at or before it (None: nothing unverified)."""
    steps = [s for rec in unverified_since for w, s in rec.items() if w not in banned]
    return min(steps) if steps else None


def ban_undo_cap(firsts: list[int], committed: int) -> int | None:
    """The version a ban rolls the run back to at most (pure; None: nothing to undo).

    ``firsts``: the steps the records name (each the first step whose commit summed an
    unverified push of the worker); ``committed``: the steps the coordinator has decided.
    A step equal to ``committed`` is one being committed: a server summed the push into it
    and its report may still come (a deferred check can ban that late), so that step is
    rolled back too rather than decided with the push in it."""
    return min(firsts) if firsts and min(firsts) <= committed else None


def undo_target(cap: int, held: list[list[int]]) -> int:
    """The version a ban's roll-back restarts every stage from (pure): the newest one at or
    before ``cap`` that every stage's server holds a checkpoint of (``held``: each server's
    checkpoint versions); version 0 (the seeded initial weights) always qualifies."""
    common = set.intersection(*(set(v) for v in held)) if held else set()
    return max([v for v in common if v <= cap] + [0])


def adam_ratio_bound(beta1: float, beta2: float, steps: int = 100_000) -> float:
    """The most one bias-corrected Adam step can move a weight, in units of the learning rate (pure).

    ``|m_t / sqrt(v_t)| <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_{k<t} (b1^2 / b2)^k)`` by
    Cauchy-Schwarz on the moment sums, times the bias corrections
    ``sqrt(1 - b2^t) / (1 - b1^t)``; the maximum over t (1 at t = 1; 1.165 at (0.9, 0.95)).
    Holds for any gradients (clipping and loss scaling included); epsilon only lowers it.
    Infinite when ``b1^2 >= b2`` (no bound).
    """
    r = beta1 * beta1 / beta2
    if r >= 1.0:
        return math.inf
    best, acc = 0.0, 0.0
    for t in range(1, steps + 1):
        acc += r ** (t - 1)
        c = (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(acc) * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        if c > best:
            best = c
        elif t > 10 and r ** t < 1e-12 and beta1 ** t < 1e-12:
            break  # every factor has converged and is falling
    return best


def adamw_move_bound(n_params: int, weight_norm: float, weight_decay: float, beta1: float, beta2: float) -> float:
    """The largest norm per unit of learning rate that inner AdamW steps can give a
    pseudo-gradient of ``n_params`` weights (pure): each step moves every weight by at most
    ``lr * (adam_ratio_bound + weight_decay * |w|)``, so the summed move over steps of summed
    learning rate ``L`` has norm at most ``L * (bound * sqrt(n) + weight_decay * ||w||)``
    (``weight_norm``: the weights' norm, the merged weights the round started from)."""
    return adam_ratio_bound(beta1, beta2) * math.sqrt(max(0, n_params)) + weight_decay * weight_norm


def screen_round(norms: dict[str, float], cosines: dict[str, float | None], history: list[float],
                 cfg: GuardConfig = DEFAULT, bounds: dict[str, float] | None = None,
                 ref_cosines: dict[str, float | None] | None = None, n_params: int = 1) -> dict[str, str]:
    """Local mode: which contributors of one merge are banned, and why (pure): the bans of
    :func:`round_verdict` for pushes that carry nothing across rounds."""
    return round_verdict(norms, cosines, history, cfg, bounds, ref_cosines, n_params)[0]


def round_verdict(norms: dict[str, float], cosines: dict[str, float | None], history: list[float],
                  cfg: GuardConfig = DEFAULT, bounds: dict[str, float] | None = None,
                  ref_cosines: dict[str, float | None] | None = None, n_params: int = 1, carried: bool = False,
                  strikes: dict[str, int] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Local mode: ``(bans, holds)`` of one merge's contributors, each with why (pure).

    ``norms``: each contributor's pseudo-gradient norm per unit of learning rate
    (:func:`shoal.runtime.safety.verify.round_measures`); ``cosines``: its cosine to the round's
    coordinate-wise median (None: fewer than ``cfg.local_quorum`` contributors);
    ``history``: those norms of the stage's earlier honest contributions.

    With a quorum the round's own median norm is the centre (10x above or below flags),
    the direction is screened too, and a flag is a majority's verdict; at most a minority
    is ever banned (a round where half or more disagree has no majority to trust). Below a
    quorum only a norm 10x *above* ``history``'s median flags (AdamW steps shrink as
    training settles, so a small norm is no evidence without the round's own majority);
    ``bounds``: per contributor, :func:`adamw_move_bound` of the stage (left out: not
    applicable, e.g. top-k pushes whose error feedback carries residuals across rounds, or
    no counted inner step). A norm over ``cfg.local_bound_margin`` times it flags in any
    round, the first included, and needs no majority: no AdamW replica can move that far.
    ``ref_cosines``: each contributor's cosine to the server's own gradient
    (:func:`shoal.runtime.safety.verify.screen_measures`); below ``-cfg.local_ref_ban`` (and
    the ``cfg.local_ref_sigmas`` threshold) flags in any round, the first included, and needs
    no majority: colluders that are most of a round set its median, not that gradient. For the
    same reason a contributor whose cosine to it is positive is not flagged for its direction
    to the median.

    ``carried``: the pushes carry what earlier rounds left (``sparse`` and ``lowrank`` keep their
    residuals, :func:`shoal.runtime.sync.codecs.keeps_residual`), so a push's norm is not made of
    this round's learning rate alone: a round in which a replica stepped less, or its kept
    residual was re-weighted up, reads several times its usual norm per unit of it (an honest
    replica of the suite's sparse run read 11.3x the stage's history). Below a quorum such a
    push's norm flag against ``history`` (no majority's verdict) then holds it out of the merge
    and bans its worker only at its ``cfg.strikes_to_ban``-th flagged round in a row (``strikes``:
    each contributor's flagged rounds in a row before this one): a scaled liar flags every
    round, so it is held out of each merge until it is banned.
    """
    beyond = {}
    for w, n in norms.items():
        bound = (bounds or {}).get(w)
        if bound is not None and bound > 0 and math.isfinite(n) and n > cfg.local_bound_margin * bound:
            beyond[w] = (f"norm {n:.4g} per unit of learning rate is more than {cfg.local_bound_margin:g}x "
                         f"what AdamW steps can move the stage ({bound:.4g})")
    if len(beyond) == len(norms) > 1:
        beyond = {}  # every replica past a hard bound says more about the bound than about them
    # The others are judged among themselves: replicas past the bound set no centre.
    norms = {w: n for w, n in norms.items() if w not in beyond}
    quorum = len(norms) >= cfg.local_quorum
    centre = robust_centre(list(norms.values())) if quorum else robust_centre(history)
    local_cfg = GuardConfig(norm_ratio=cfg.norm_ratio, min_cosine=cfg.local_min_cosine)
    flags, against, holds = {}, {}, {}
    least = cfg.local_ref_sigmas / math.sqrt(max(1, n_params))
    for w, n in norms.items():
        why = screen(n, cosines.get(w) if quorum else None, centre, local_cfg)
        ref = (ref_cosines or {}).get(w)
        if why.startswith("direction") and ref is not None and ref > max(least, 0.0):
            # The server's own gradient vouches for its direction: a median against it is
            # colluders that are most of the round (tests/test_local_screen.py saw that median
            # ban the one honest replica), and a direction the server's gradient flags is held
            # or banned by that gradient anyway.
            why = ""
        if why and (quorum or not math.isfinite(n) or n > centre):  # below a quorum: only too large
            struck = carried and not quorum and math.isfinite(n)  # (a flag that holds before it bans)
            if struck and (strikes or {}).get(w, 0) + 1 < cfg.strikes_to_ban:
                holds[w] = why
            else:
                flags[w] = f"{why}, {cfg.strikes_to_ban} rounds in a row" if struck else why
        if ref is not None and ref < min(least, -cfg.local_ref_ban):
            against[w] = f"direction: cosine {ref:.4f} to the server's own gradient at the round's start"
    if quorum and 2 * len(flags) >= len(norms):
        flags = {}
    # Against the server's own gradient is no verdict of a majority either: colluders that are
    # most of a round's contributors set its median, not the server's gradient.
    flags.update({w: why for w, why in against.items() if w not in flags})
    flags.update(beyond)  # past the bound is no verdict of a majority: no replica can get there
    return ({w: f"pseudo-gradient {why}" for w, why in flags.items()},
            {w: f"pseudo-gradient {why}" for w, why in holds.items() if w not in flags})


def direction_holds(ref_cosines: dict[str, float | None], n_contributors: int, cfg: GuardConfig = DEFAULT,
                    n_params: int = 1, banned: Iterable[str] = ()) -> dict[str, str]:
    """Local mode: contributors left out of this merge but not banned (pure).

    A cosine to the server's own gradient under the flag threshold (``local_ref_sigmas``)
    but not under ``-local_ref_ban`` is no proof of malice (an honest replica that moved
    into the stage mid-round pointed at -0.002), yet nothing vouches for it either: it is
    held out of the merge, so no lone contributor is merged unchecked, and its worker stays.
    With a quorum too: a round's median is no voucher when colluders are most of the round.
    ``n_contributors`` is kept for the callers' record (the rule no longer depends on it).
    """
    least = cfg.local_ref_sigmas / math.sqrt(max(1, n_params))
    return {w: f"cosine {ref:.4f} to the server's own gradient at the round's start"
            for w, ref in (ref_cosines or {}).items()
            if w not in set(banned) and ref is not None and ref < least}


def pick_checker(candidates: dict[str, int], target: str, seed: int, salt: str, step: int, mb: int,
                 banned: Iterable[str] = (), min_ok: int = 0) -> str | None:
    """The worker that computes a redundant check of ``target``'s push (pure; None: none fits).

    ``candidates``: the stage's live workers and their passed server recomputations; the
    target itself, banned workers and workers with fewer than ``min_ok`` passes are left out
    (a newcomer does not vouch for anyone). Among the rest one is drawn with the server's
    secret ``salt``, so a worker cannot know who checks it (nor arrange to check a colluder).
    """
    out = set(banned)
    pool = sorted(w for w, ok in candidates.items() if w != target and w not in out and ok >= min_ok)
    if not pool:
        return None
    h = hashlib.sha256(f"{seed}/{salt}/dup/{step}/{mb}/{target}".encode()).digest()
    return pool[int.from_bytes(h[:8], "big") % len(pool)]


def dup_disagree(bitwise_equal: bool, rel: float, exact: bool, cfg: GuardConfig = DEFAULT) -> bool:
    """Whether two workers' results of the same micro-batches disagree (pure): in fp32
    (``exact``) unless bitwise equal (``cfg.dup_rel_tol`` 0), else above ``cfg.dup_rel_tol_lowp``."""
    if bitwise_equal:
        return False
    if not math.isfinite(rel):
        return True
    return rel > (cfg.dup_rel_tol if exact else cfg.dup_rel_tol_lowp)


def dup_verdict(errors: dict[str, float], exact: bool, other: dict[str, str], step: int, mbs,
                cfg: GuardConfig = DEFAULT) -> dict[str, str]:
    """After a disagreement, who lied (pure): each worker whose result is off the server's own
    recomputation by more than the tolerance (``rel_tol`` in fp32, ``lowp_rel_tol`` in bf16),
    with the ban's reason; both may have, or neither (rounding: nobody is banned).

    ``errors``: worker -> relative L2 error against the recomputation; ``other``: worker -> the
    worker it disagreed with.
    """
    tol = cfg.rel_tol if exact else cfg.lowp_rel_tol
    return {w: (f"redundant computation: its gradient of step {step} mbs {list(mbs)} disagreed with "
                f"{other[w]}'s, and differs from the server's recomputation by {e:.3g} "
                f"(relative L2, tolerance {tol:g})")
            for w, e in sorted(errors.items()) if not math.isfinite(e) or e > tol}


def drift_z(sums: Iterable[float], squares: Iterable[float]) -> float:
    """A worker's drift statistic over its pushes, from per-coordinate sums (pure).

    ``sums``: per sampled coordinate, the sum over its pushes of its deviation from the step's
    mean of the other workers' pushes; ``squares``: the sum of those deviations squared. Each
    coordinate's self-normalised sum ``z = S / sqrt(Q)`` has ``E[z^2] = 1`` exactly when an
    honest worker's deviations are independent across steps and symmetric (given their sizes,
    their signs are fair coins), whatever their scale as training goes on, and
    ``P(|z| > t) <= 2 exp(-t^2 / 2)`` (Hoeffding). A consistent bias ``b`` against noise of
    spread ``s`` makes ``E[z^2]`` grow like ``1 + n b^2 / (b^2 + s^2)`` over ``n`` pushes. The
    statistic is ``(sum z^2 - m) / sqrt(2 m)`` over the ``m`` coordinates with a deviation:
    about N(0, 1) for an honest worker when coordinates are independent, growing like ``n``
    (its z-score per coordinate like ``sqrt(n)``) for a biased one. 0 with no coordinate.
    """
    total, m = 0.0, 0
    for s, q in zip(sums, squares, strict=True):
        if q > 0 and math.isfinite(q) and math.isfinite(s):
            total += s * s / q
            m += 1
    return (total - m) / math.sqrt(2 * m) if m else 0.0


def drift_suspect(z: float, pushes: int, cfg: GuardConfig = DEFAULT) -> bool:
    """Whether a worker's drift makes it a suspect (pure): ``z`` (:func:`drift_z`) above
    ``cfg.drift_z`` after at least ``cfg.drift_min_pushes`` pushes. A suspect is checked on
    every push; only a failed check bans."""
    return pushes >= cfg.drift_min_pushes and math.isfinite(z) and z > cfg.drift_z
