"""``--sync auto``: the planner chooses the sync policy under a quality budget.

The budget (:class:`QualityBudget`) says what may change the training's result: the longest
interval between merges ``H`` (``--max-sync-every``), the codecs allowed on pseudo-gradient
pushes and pulls and on activations and their gradients (``--allow-codecs``), and whether
local mode and pipeline replicas are allowed at all. Exact sync is always allowed.

Candidates, each placed once by shoal's allocator and then priced by the cost model:

* exact sync, one pipeline;
* local mode, one pipeline; and local mode with pipeline replicas inside network clusters
  (:mod:`shoal.plan.replicas`), each with the allowed codec of fewest bytes per kind (fewer
  bytes never make a step slower in the cost model; the budget has already said which codecs
  the user accepts) and placed at the largest allowed ``H``, then re-priced at every smaller
  allowed ``H``.

  Where the budget allows ``int8`` and the codec of fewest bytes for pushes or pulls is
  ``sparse``, each of those is also priced with ``int8`` there (:func:`lighter`): where the
  links do not limit the step, sparse buys no speed and costs loss (bench/results/sparse-sync.md).

The choice is the candidate of most predicted tokens/s (long run, churn included where the
scenario has churn); among those within ``TIE`` (0.1 %) of it, the one closest to exact
training: exact sync first, then the smallest ``H``, then the fewest sparse kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from shoal.errors import ShoalError
from shoal.plan.compression import KINDS, UNBIASED_FIRST, bytes_per_element, parse_codec
from shoal.plan.cost import CostOptions, predict
from shoal.plan.types import Plan, Scenario, SyncPolicy

SYNC_EVERY_CHOICES = (4, 8, 16, 32, 64, 128)  # the H values auto considers (up to the budget's maximum)
DEFAULT_MAX_SYNC_EVERY = 32  # the budget's default largest H (local mode's default H)
DEFAULT_CODECS = ("none", "int8", "sparse")  # codecs the default budget allows (sparse on push and pull only)
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

    def sync_every_choices(self) -> list[int]:
        """The H values the budget allows, smallest first."""
        if self.pin_sync_every is not None:
            return [self.pin_sync_every] if self.pin_sync_every <= self.max_sync_every else []
        return [h for h in SYNC_EVERY_CHOICES if h <= self.max_sync_every]

    def codec_for(self, kind: str, dtype_bytes: int) -> str:
        """The allowed codec of fewest bytes for traffic ``kind`` (a pinned one if given)."""
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
        return min(ok, key=lambda c: (bytes_per_element(c, dtype_bytes), UNBIASED_FIRST.get(c.split(":")[0], 1), c))

    def allows(self, policy: SyncPolicy, replicas: bool = False) -> bool:
        """Whether ``policy`` (with replicas or not) is inside the budget."""
        if not policy.local:
            return not replicas
        if not self.local or (replicas and not self.replicas):
            return False
        if policy.sync_every not in self.sync_every_choices():
            return False
        codecs = {"act": policy.act_codec, "grad": policy.grad_codec, "push": policy.push_codec,
                  "pull": policy.pull_codec}
        if self.pin_codecs is not None:
            return codecs == self.pin_codecs
        allowed = {c.split(":")[0] for c in self.codecs} | {"none"}
        return all(c.split(":")[0] in allowed for c in codecs.values())


def parse_allowed_codecs(text: str) -> tuple[str, ...]:
    """``"none,int8,sparse:0.01:2"`` -> the codec names, each checked for the kinds it serves
    (``tern``, ``quad`` and ``oct`` for activations, ``tern-sr`` and ``tern-dither`` for their gradients,
    the others for pushes, where they all are allowed)."""
    kind = {"tern": "act", "quad": "act", "oct": "act", "tern-sr": "grad", "tern-dither": "grad"}  # a kind each may serve
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


def lighter(policy: SyncPolicy, budget: QualityBudget) -> SyncPolicy | None:
    """``policy`` with ``int8`` instead of ``sparse`` pushes and pulls, where the budget allows
    int8 and pins no codec (None: nothing to change)."""
    if budget.pin_codecs is not None or not any(c.split(":")[0] == "int8" for c in budget.codecs):
        return None
    push = "int8" if policy.push_codec.startswith("sparse") else policy.push_codec
    pull = "int8" if policy.pull_codec.startswith("sparse") else policy.pull_codec
    if (push, pull) == (policy.push_codec, policy.pull_codec):
        return None
    return replace(policy, push_codec=push, pull_codec=pull)


# What sparse sync measurably costs (bench/results/sparse-sync.md, 2026-12-02: the real runtime,
# `tiny`, H = 4, 120 steps, seeds 0-2): the final weights' validation loss above uncompressed
# local mode's at equal tokens, pipeline replicas and one pipeline.
SPARSE_LOSS_COST = (0.032, 0.043)


def quality_note(policy: SyncPolicy) -> str | None:
    """One line on the measured loss cost of ``policy``'s codecs where it is large enough to
    weigh against their speed (pure): sparse pushes or pulls; None otherwise."""
    if not policy.local or not (policy.push_codec.startswith("sparse") or policy.pull_codec.startswith("sparse")):
        return None
    lo, hi = SPARSE_LOSS_COST
    return (f"quality: sparse pushes and pulls ended {lo:.1%}-{hi:.1%} above uncompressed local mode's loss at equal "
            "tokens in measured runs (tiny, 120 steps, 3 seeds: bench/results/sparse-sync.md); "
            "--allow-codecs none,int8 leaves them out")


def _sparse_kinds(policy: SyncPolicy) -> int:
    return sum(c.startswith("sparse") for c in (policy.push_codec, policy.pull_codec))


def candidates(scenario: Scenario, budget: QualityBudget, seed: int = 0,
               options: CostOptions | None = None, stages: int | None = None) -> list[tuple[Plan, bool]]:
    """Every plan ``--sync auto`` weighs: ``(plan, has replicas)``, each priced; ``stages``
    forces that many stages (one pipeline: replicas choose their own shapes)."""
    from shoal.plan.api import make_plan

    out: list[tuple[Plan, bool]] = [(make_plan(scenario, seed=seed, options=options, stages=stages), False)]
    hs = budget.sync_every_choices()
    if not budget.local or not hs:
        return out
    db = scenario.workload.dtype_bytes
    codecs = {k: budget.codec_for(k, db) for k in KINDS}
    base = SyncPolicy(mode="local", sync_every=max(hs), act_codec=codecs["act"], grad_codec=codecs["grad"],
                      push_codec=codecs["push"], pull_codec=codecs["pull"], overlap=True)
    shapes = [(replace(base, overlap_uploads=True), False)]
    if budget.replicas and stages is None:
        rep = replace(base, overlap_uploads=False)  # see shoal.plan.cli.policy_from_args
        if budget.allows(rep, replicas=True):
            shapes.append((rep, True))
    for pol, reps in shapes:
        try:
            placed = make_plan(scenario, seed=seed, sync=pol, options=options, replicas=reps, stages=stages)
        except ShoalError:
            continue  # e.g. no replica fits this scenario
        for h in hs:
            p = placed if h == pol.sync_every else replace(placed, sync=replace(pol, sync_every=h), predicted={})
            if p is not placed:
                predict(p, scenario, options)
            out.append((p, reps))
            light = lighter(p.sync, budget)
            if light is not None:
                q = replace(placed, sync=light, predicted={})
                predict(q, scenario, options)
                out.append((q, reps))
    return out


def choose(cands: list[tuple[Plan, bool]], scenario: Scenario) -> Plan:
    """The candidate of most long-run tokens/s; within ``TIE`` of it, exact sync first, then the
    smallest H, then the fewest sparse pushes/pulls (closest to exact training)."""
    scored = [(_long_run_tokens_per_s(p, scenario), p) for p, _ in cands]
    best = max(t for t, _ in scored)
    if best <= 0:
        raise ShoalError(f"no plan of scenario {scenario.name} trains at all")
    near = [p for t, p in scored if t >= (1.0 - TIE) * best]
    return min(near, key=lambda p: (p.sync.local, p.sync.sync_every, _sparse_kinds(p.sync),
                                    -_long_run_tokens_per_s(p, scenario)))


def plan_auto(scenario: Scenario, budget: QualityBudget | None = None, seed: int = 0,
              options: CostOptions | None = None, stages: int | None = None) -> Plan:
    """The plan ``--sync auto`` picks (see the module docstring); it carries ``planning_time_s``
    of the whole search and its prediction. ``stages``: one pipeline of that many stages
    (``shoal demo``'s ``--stages``)."""
    import time

    t0 = time.perf_counter()
    budget = budget or QualityBudget()
    plan = choose(candidates(scenario, budget, seed, options, stages), scenario)
    predict(plan, scenario, options)
    plan.planning_time_s = time.perf_counter() - t0
    return plan
