"""``--sync auto``: the planner chooses the sync policy under a quality budget.

The budget (:class:`QualityBudget`) says what may change the training's result: the longest
interval between merges ``H`` (``--max-sync-every``), the codecs allowed on pseudo-gradient
pushes and pulls and on activations and their gradients (``--allow-codecs``), whether local
mode and pipeline replicas are allowed at all, and whether a round may be applied while the
next computes (delayed application; ``--no-overlap``: not). Exact sync is always allowed.

Candidates, each placed once by shoal's allocator and then priced by the cost model:

* exact sync, one pipeline;
* local mode, one pipeline; and local mode with pipeline replicas inside network clusters
  (:mod:`shoal.plan.replicas`), each with the allowed codec of fewest bytes per kind (fewer
  bytes never make a step slower in the cost model; the budget has already said which codecs
  the user accepts) and placed at the largest allowed ``H``, then re-priced at every smaller
  allowed ``H``.

  Where the codec of fewest bytes for pushes or pulls is ``sparse`` or ``lowrank``, each allowed
  codec closer to exact training (``int8``, ``lowrank``: :data:`SYNC_CODEC_ORDER`) is also
  priced there (:func:`lighter`), and so are ``int8`` activations and gradients where theirs
  are lossier (``quad-pc``, ``tern-dither``: :data:`ACT_CODEC_ORDER`): where the links do not
  limit the step, fewer bytes buy no speed and cost loss (bench/results/sparse-sync.md,
  compress_bench.md), and the lossier activation codecs cost the workers' and servers' CPU.
  Each is also priced with the steps waiting for every round (``overlap=False``): delayed
  application costs loss too.

The choice is the candidate of most predicted tokens/s (long run, churn included where the
scenario has churn); among those within ``TIE`` (0.1 %) of it, the one closest to exact
training: exact sync first, then the smallest ``H``, then no delayed application, then the
codecs of least measured loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from shoal.errors import ShoalError
from shoal.plan.compression import KINDS, UNBIASED_FIRST, bytes_per_element, parse_codec
from shoal.plan.cost import CostOptions, predict, scenario_profile
from shoal.plan.types import Plan, Scenario, SyncPolicy

SYNC_EVERY_CHOICES = (4, 8, 16, 32, 64, 128)  # the H values auto considers (up to the budget's maximum)
DEFAULT_MAX_SYNC_EVERY = 32  # the budget's default largest H (local mode's default H)
# codecs the default budget allows (sparse, lowrank: push and pull only; quad-pc: activations,
# tern-dither: their gradients, the pair measured within 1 % of raw activations: ACT_LOSS_COST)
DEFAULT_CODECS = ("none", "int8", "sparse", "lowrank", "quad-pc", "tern-dither")
# candidates within this share of the best tokens/s count as equal and the more exact one wins: only
# rounding, since the cost model's differences between H values are small but real (a round in
# flight slows the activations on the workers' links, cost.round_chunk_delays)
TIE = 0.001


@dataclass(frozen=True)
class QualityBudget:
    """What ``--sync auto`` may change about training (see the module docstring)."""

    max_sync_every: int = DEFAULT_MAX_SYNC_EVERY  # the largest H (steps between merges) allowed; 1: exact sync only
    codecs: tuple[str, ...] = DEFAULT_CODECS  # codecs allowed (each used only for the kinds it supports)
    local: bool = True  # local mode (DiLoCo-style rounds) allowed
    replicas: bool = True  # pipeline replicas inside network clusters allowed (local mode)
    pin_sync_every: int | None = None  # H pinned by the user (--sync-every): only this H
    pin_codecs: dict[str, str] | None = None  # codec per kind pinned by the user (--compression)
    overlap: bool = True  # delayed application allowed (--no-overlap: local mode's steps wait for each round)
    lean: bool = True  # lean local-mode workers allowed (SyncPolicy.lean), chosen where they let more devices train

    def sync_every_choices(self) -> list[int]:
        """The H values the budget allows, smallest first."""
        if self.pin_sync_every is not None:
            return [self.pin_sync_every] if self.pin_sync_every <= self.max_sync_every else []
        return [h for h in SYNC_EVERY_CHOICES if h <= self.max_sync_every]

    def codec_for(self, kind: str, dtype_bytes: int, width: int = 0) -> str:
        """The allowed codec of fewest bytes for traffic ``kind`` (a pinned one if given) on a
        model of ``width`` (what ``lowrank`` costs per weight; 0: the narrowest built-in)."""
        if self.pin_codecs is not None:
            return self.pin_codecs[kind]
        ok = []
        for c in self.codecs:
            try:
                ok.append(parse_codec(c, kind))
            except ShoalError:
                continue  # not for this kind (e.g. sparse for activations)
        if not ok:
            return "none"
        return min(ok, key=lambda c: (bytes_per_element(c, dtype_bytes, 0, width), UNBIASED_FIRST.get(c.split(":")[0], 1),
                                      c))

    def allows(self, policy: SyncPolicy, replicas: bool = False) -> bool:
        """Whether ``policy`` (with replicas or not) is inside the budget."""
        if not policy.local:
            return not replicas
        if not self.local or (replicas and not self.replicas):
            return False
        if policy.sync_every not in self.sync_every_choices() or (policy.overlap and not self.overlap):
            return False
        if policy.lean and not self.lean:
            return False
        codecs = {"act": policy.act_codec, "grad": policy.grad_codec, "push": policy.push_codec,
                  "pull": policy.pull_codec}
        if self.pin_codecs is not None:
            return codecs == self.pin_codecs
        allowed = {c.split(":")[0] for c in self.codecs} | {"none"}
        return all(c.split(":")[0] in allowed for c in codecs.values())


def parse_allowed_codecs(text: str) -> tuple[str, ...]:
    """``"none,int8,sparse:0.01:2"`` -> the codec names, each checked for the kinds it serves
    (``tern``, ``quad``, ``oct`` and ``quad-pc`` for activations, ``tern-sr`` and ``tern-dither`` for their gradients,
    the others for pushes, where they all are allowed)."""
    kind = {"tern": "act", "quad": "act", "oct": "act", "quad-pc": "act", "tern-sr": "grad",
            "tern-dither": "grad"}  # a kind each may serve
    out = tuple(parse_codec(c.strip(), kind.get(c.strip(), "push")) for c in text.split(",") if c.strip())
    if not out:
        raise ShoalError(f"--allow-codecs {text!r}: give at least one codec, e.g. none,int8,sparse")
    return out


def _long_run_tokens_per_s(plan: Plan, scenario: Scenario) -> float:
    """Tokens/s at the plan's long-run step (churn included where the scenario has it)."""
    t = plan.predicted.get("expected_step_time_s", plan.predicted.get("step_time_s", math.inf))
    if not 0 < t < math.inf:
        return 0.0
    return plan.micro_batches * plan.micro_batch_size * scenario.workload.seq_len / t


# Push and pull codecs from closest to exact training to farthest, by their measured loss at
# equal tokens (bench/results/sparse-sync.md): int8 costs nothing measurable, lowrank well under
# sparse. Among candidates of equal speed the earlier wins.
SYNC_CODEC_ORDER = ("none", "int8", "lowrank", "sparse")


# Activation and activation-gradient codecs closest to exact training first: the rest (quad-pc,
# tern-dither, ...) are lossier (bench/results/compress_bench.md).
ACT_CODEC_ORDER = ("none", "fp16", "int8")


def _act_rank(codec: str) -> int:
    name = codec.split(":")[0]
    return ACT_CODEC_ORDER.index(name) if name in ACT_CODEC_ORDER else len(ACT_CODEC_ORDER)


def lighter(policy: SyncPolicy, budget: QualityBudget) -> list[SyncPolicy]:
    """``policy`` with each allowed push/pull codec closer to exact training than its own
    (``SYNC_CODEC_ORDER``) on the kinds whose codec is lossier (``lowrank``, ``sparse``,
    ``topk-int8``), and each of these (and ``policy``) with ``int8`` activations and gradients
    where theirs are lossier and the budget allows ``int8``; none where the budget pins the
    codecs: where the links do not limit the step, fewer bytes buy no speed and cost loss."""
    if budget.pin_codecs is not None:
        return []
    allowed = {c.split(":")[0]: c for c in budget.codecs}
    out = []
    for name in SYNC_CODEC_ORDER[1:]:
        if name not in allowed:
            continue
        c = parse_codec(allowed[name], "push")
        push = c if _loss_rank(policy.push_codec) > _loss_rank(c) >= 1 else policy.push_codec
        pull = c if _loss_rank(policy.pull_codec) > _loss_rank(c) >= 1 else policy.pull_codec
        if (push, pull) != (policy.push_codec, policy.pull_codec):
            out.append(replace(policy, push_codec=push, pull_codec=pull))
    if "int8" in allowed:
        act = "int8" if _act_rank(policy.act_codec) > _act_rank("int8") else policy.act_codec
        grad = "int8" if _act_rank(policy.grad_codec) > _act_rank("int8") else policy.grad_codec
        if (act, grad) != (policy.act_codec, policy.grad_codec):
            out += [replace(p, act_codec=act, grad_codec=grad) for p in (policy, *out)]
    return out


def _loss_rank(codec: str) -> int:
    name = codec.split(":")[0]
    return SYNC_CODEC_ORDER.index(name) if name in SYNC_CODEC_ORDER else len(SYNC_CODEC_ORDER)


# What the lossy sync codecs measurably cost (bench/results/sparse-sync.md: the real runtime,
# `tiny`, H = 4, 120 steps, the mean over seeds): the final weights' validation loss above
# uncompressed local mode's at equal tokens, (pipeline replicas, one pipeline); lowrank's one
# pipeline: 1.0 % over 22 runs before kept residuals were re-weighted, 0.81 % over 10 after;
# 2026-12-07, H = 16, three seeds each: replicas of one stage +0.59 to +1.23 % with the steps
# waiting for each round, +0.31 to +0.86 % with delayed application; of two stages (int8
# activations) +0.42 to +0.68 % and +0.15 to +1.88 %. Longer runs cost more: 600 steps of
# two-stage replicas at H = 16 with int8 activations ended +1.3 to +2.5 % (three seeds),
# LOWRANK_LONG_LOSS_COST; with quad-pc activations and tern-dither gradients (gaming-world's
# choice) +3.3 to +4.5 % (the activation pair alone +1.3 to +1.9 %, ACT_LONG_LOSS_COST).
SPARSE_LOSS_COST = (0.031, 0.033)
LOWRANK_LOSS_COST = (0.002, 0.019)
LOWRANK_LONG_LOSS_COST = (0.013, 0.025)


def quality_note(policy: SyncPolicy) -> str | None:
    """One line on the measured loss cost of ``policy``'s codecs where it is large enough to
    weigh against their speed (pure): sparse or lowrank pushes or pulls; None otherwise."""
    if not policy.local:
        return None
    names = {c.split(":")[0] for c in (policy.push_codec, policy.pull_codec)}
    name = "sparse" if "sparse" in names else "lowrank" if "lowrank" in names else None
    if name is None:
        return None
    lo, hi = SPARSE_LOSS_COST if name == "sparse" else LOWRANK_LOSS_COST
    longer = ""
    if name == "lowrank":
        a, b = LOWRANK_LONG_LOSS_COST
        longer = f", {a:.1%}-{b:.1%} after 600 steps"
    return (f"quality: {name} pushes and pulls ended {lo:.1%}-{hi:.1%} above uncompressed local mode's loss at equal "
            f"tokens in measured runs (tiny, 120 steps, the mean over seeds{longer}: bench/results/sparse-sync.md); "
            "--allow-codecs none,int8 leaves them out")


# What the lossy activation codecs measurably cost (bench/results/compress_bench.md, 2026-12-02:
# tiny, a two-stage pipeline, 150 steps, quad-pc activations with tern-dither gradients): the
# final loss above raw activations' at equal tokens, the mean over seeds 0-4 and over seeds 0-9.
ACT_LOSS_COST = (0.0041, 0.0099)
# The same pair over 600 steps of two-stage replicas at H = 16 (bench/results/sparse-sync.md,
# 2026-12-07): +1.3 to +1.9 % over uncompressed local mode, three seeds.
ACT_LONG_LOSS_COST = (0.013, 0.019)


def act_note(policy: SyncPolicy) -> str | None:
    """One line on the measured loss cost of ``policy``'s activation codecs where they are lossier
    than ``int8`` (pure); None otherwise."""
    if max(_act_rank(policy.act_codec), _act_rank(policy.grad_codec)) <= _act_rank("int8"):
        return None
    lo, hi = ACT_LOSS_COST
    a, b = ACT_LONG_LOSS_COST
    return (f"quality: act={policy.act_codec},grad={policy.grad_codec} (quad-pc with tern-dither measured) ended "
            f"{lo:+.1%} to {hi:+.1%} above raw activations' loss at equal tokens (tiny, two stages, 150 steps, the "
            f"mean over 5 and 10 seeds: bench/results/compress_bench.md), {a:+.1%} to {b:+.1%} after 600 steps "
            "(sparse-sync.md); --allow-codecs none,int8,sparse,lowrank leaves them out")


# What delayed application measurably costs (bench/results/local-runtime.md, 2026-12-04: the real
# runtime, `tiny`, H = 4, int8): the loss at equal tokens against the same runs with the steps
# waiting for each round, the means of three runs each: 96 steps of one stage x 4 replicas
# (+1.0 %; +1.3 % pooled over eight), of two stages x 2 workers (-0.6 %); shoal demo's 24 steps +0.9-1.3 %.
OVERLAP_LOSS_COST = (-0.006, 0.013)


# What lean workers measurably cost (bench/results/lean-workers.md, 2026-12-06: the real runtime,
# the built-in corpus, H = 4, 60 steps): the validation loss of the final merged weights against
# standard local-mode workers' at equal tokens, the lowest and highest of eleven seed runs' ratios
# (tiny on 1 stage x 2 workers and 2 stages x 4 workers, small on 1 x 2; +0.3 % on their mean;
# two runs of standard local mode alone differ by up to 0.9 %).
LEAN_LOSS_COST = (-0.002, 0.016)


def lean_note(policy: SyncPolicy) -> str | None:
    """One line on the measured loss cost of lean workers where ``policy`` has them (pure);
    None otherwise."""
    if not (policy.local and policy.lean):
        return None
    lo, hi = LEAN_LOSS_COST
    return (f"quality: lean workers (12 bytes a parameter: bf16 inner moments, sums in arrival order) ended "
            f"{lo:+.1%} to {hi:+.1%} against standard local-mode workers' loss at equal tokens (tiny and small, "
            "60 steps: bench/results/lean-workers.md); --no-lean leaves them out")


def overlap_note(policy: SyncPolicy) -> str | None:
    """One line on the measured loss cost of delayed application where ``policy`` has it (pure);
    None otherwise."""
    if not (policy.local and policy.overlap):
        return None
    lo, hi = OVERLAP_LOSS_COST
    return (f"quality: rounds overlapped with the next round (delayed application) ended {lo:+.1%} to {hi:+.1%} "
            "against the loss of the same runs waiting for each round, at equal tokens (tiny, H=4, 24-96 steps: "
            "bench/results/local-runtime.md); --no-overlap waits")


def _lossy_rank(policy: SyncPolicy) -> int:
    """How far ``policy``'s codecs are from exact training (``SYNC_CODEC_ORDER`` for pushes and
    pulls, ``ACT_CODEC_ORDER`` for activations and their gradients)."""
    return (_loss_rank(policy.push_codec) + _loss_rank(policy.pull_codec) + _act_rank(policy.act_codec)
            + _act_rank(policy.grad_codec))


def candidates(scenario: Scenario, budget: QualityBudget, seed: int = 0,
               options: CostOptions | None = None, stages: int | None = None,
               on_progress: Callable[[str], None] | None = None) -> list[tuple[Plan, bool]]:
    """Every plan ``--sync auto`` weighs: ``(plan, has replicas)``, each priced; ``stages``
    forces that many stages (one pipeline: replicas choose their own shapes); ``on_progress``
    is told what is being planned before each placement (seconds each on a large swarm)."""
    from shoal.plan.api import make_plan

    say = on_progress or (lambda _what: None)
    say("placing exact sync")
    out: list[tuple[Plan, bool]] = [(make_plan(scenario, seed=seed, options=options, stages=stages), False)]
    hs = budget.sync_every_choices()
    if not budget.local or not hs:
        return out
    db = scenario.workload.dtype_bytes
    width = scenario_profile(scenario).act_shape[1]
    codecs = {k: budget.codec_for(k, db, width) for k in KINDS}
    base = SyncPolicy(mode="local", sync_every=max(hs), act_codec=codecs["act"], grad_codec=codecs["grad"],
                      push_codec=codecs["push"], pull_codec=codecs["pull"], overlap=budget.overlap)
    shapes = [(replace(base, overlap_uploads=True), False)]
    if budget.replicas and stages is None:
        rep = replace(base, overlap_uploads=False)  # see shoal.plan.cli.policy_from_args
        if budget.allows(rep, replicas=True):
            shapes.append((rep, True))
    if budget.lean:  # workers of 12 B a parameter: a stage of more layers fits a card
        shapes += [(replace(pol, lean=True), reps) for pol, reps in shapes]
    for pol, reps in shapes:
        say(("placing pipeline replicas" if reps else "placing one pipeline")
            + (" of lean workers" if pol.lean else "") + " in local mode")
        try:
            placed = make_plan(scenario, seed=seed, sync=pol, options=options, replicas=reps, stages=stages)
        except ShoalError:
            continue  # e.g. no replica fits this scenario
        for h in hs:
            p = placed if h == pol.sync_every else replace(placed, sync=replace(pol, sync_every=h), predicted={})
            if p is not placed:
                predict(p, scenario, options)
            # Delayed application costs loss too (up to 1.3 % at 96 steps, 0.9-1.3 % at 24
            # steps of the demo, bench/results/local-runtime.md): each policy is also priced
            # with the steps waiting, which win where the overlap buys no speed (choose)
            for sync in [p.sync, *lighter(p.sync, budget)]:
                waits = [replace(p, sync=replace(sync, overlap=False), predicted={})] if sync.overlap else []
                for q in (p if sync is p.sync else replace(p, sync=sync, predicted={}), *waits):
                    if not q.predicted:
                        predict(q, scenario, options)
                    out.append((q, reps))
    return out


def choose(cands: list[tuple[Plan, bool]], scenario: Scenario) -> Plan:
    """The candidate of most long-run tokens/s; within ``TIE`` of it, exact sync first, then the
    smallest H, then steps that wait for each round (no delayed application), then workers that
    are not lean (``SyncPolicy.lean``), then the push and pull codecs closest to exact training
    (``SYNC_CODEC_ORDER``)."""
    scored = [(_long_run_tokens_per_s(p, scenario), p) for p, _ in cands]
    best = max(t for t, _ in scored)
    if best <= 0:
        raise ShoalError(f"no plan of scenario {scenario.name} trains at all")
    near = [p for t, p in scored if t >= (1.0 - TIE) * best]
    return min(near, key=lambda p: (p.sync.local, p.sync.sync_every, p.sync.local and p.sync.overlap,
                                    p.sync.local and p.sync.lean, _lossy_rank(p.sync),
                                    -_long_run_tokens_per_s(p, scenario)))


def plan_auto(scenario: Scenario, budget: QualityBudget | None = None, seed: int = 0,
              options: CostOptions | None = None, stages: int | None = None,
              on_progress: Callable[[str], None] | None = None) -> Plan:
    """The plan ``--sync auto`` picks (see the module docstring); it carries ``planning_time_s``
    of the whole search and its prediction. ``stages``: one pipeline of that many stages
    (``shoal demo``'s ``--stages``); ``on_progress``: see :func:`candidates`."""
    import time

    t0 = time.perf_counter()
    budget = budget or QualityBudget()
    plan = choose(candidates(scenario, budget, seed, options, stages, on_progress), scenario)
    predict(plan, scenario, options)
    plan.planning_time_s = time.perf_counter() - t0
    return plan
