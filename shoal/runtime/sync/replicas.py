"""Pipeline replicas in local mode: several pipelines of the model train at once, each with its
own stage servers and workers, and the stage servers merge per layer at every round.

A run with replicas (``--replicas``, ``RunSpec.replica_stages`` / ``replica_mbs``) numbers its
stages replica by replica: replica 0's stages first, then replica 1's, and so on. Relays go to
the stage before or after, so activations never leave a replica. Replica ``r`` serves its own
share of each step's micro-batches (ids ``[lo_r, hi_r)``). At the end of a round each stage
server first merges its own workers (:mod:`shoal.runtime.sync.local`) into its *part*: their
merged weights (outer lr 1, momentum 0, raw pushes) or their merged pseudo-gradient, with the
micro-batches they covered. It sends the part's tensors to every stage server of another
replica that holds any of its layers and waits for theirs; every server then computes the same
per-layer merge over the parts of its layers (:func:`merge_parts`: the micro-batch-weighted
mean over the replicas holding a parameter by :func:`shoal.train.outer.merge_per_layer`,
parts added in stage order), so every replica's copy of a layer is the same bits.

The pure decisions are functions here; :class:`ReplicaServerMixin` is a mixin of
:class:`shoal.runtime.roles.server.StageServer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import shutil
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net.stream import receive, send
from shoal.net.wire import (
    Framed,
    WireError,
    decode_tensor,
    encode_frame,
    encode_tensor,
    message_nbytes,
    message_pieces,
    serialize_framed,
    split_framed,
)
from shoal.runtime.sync.codecs import dense_round
from shoal.runtime.sync.held import spill_file
from shoal.train.outer import merge_per_layer, merge_weights, merges_weights, weighted_sum

log = logging.getLogger("shoal.replicas")


@dataclass(frozen=True)
class Slot:
    """One stage of a replica plan: which replica, which layers, which micro-batches."""

    replica: int  # index of its replica
    first: int  # first layer it holds
    last: int  # one past its last layer
    mb_lo: int  # first micro-batch id of each step its replica serves
    mb_hi: int  # one past the last


def parse_replicas(text: str, micro_batches: int, n_layers: int) -> tuple[list[int], list[int]]:
    """``--replicas SPEC``: (stages per replica, micro-batches per replica); see
    :func:`parse_replica_plan`."""
    stages, mbs, _ = parse_replica_plan(text, micro_batches, n_layers)
    return stages, mbs


def parse_replica_plan(text: str, micro_batches: int, n_layers: int) -> tuple[list[int], list[int], list[int]]:
    """``--replicas SPEC``: each replica's stages, comma-separated, as a stage count (layers split
    evenly) or as its stages' layer counts joined by ``+`` (``2+4``: layers [0,2) and [2,6)), each
    optionally with its micro-batches per step after a colon (``2,2``; ``1,2+4``; ``1:3,2:1``), and
    optionally with its network regions after an ``@`` (:func:`parse_replica_regions`).
    Without counts the step's ``micro_batches`` are split evenly (earlier replicas take the
    remainder). Returns (stages per replica, micro-batches per replica, every stage's layer count
    in stage order); a one-line ShoalError when bad."""
    from shoal.runtime.common import even_split

    items = [x.strip().partition("@")[0].strip() for x in text.split(",") if x.strip()]  # (regions: below)
    hint = ("give each replica's stage count or its stages' layer counts, e.g. --replicas 2,2 or "
            "--replicas 1,2+4 or --replicas 1:3,2:1 (stages:micro-batches)")
    if len(items) < 2:
        raise ShoalError(f"--replicas {text!r}: a replica plan has at least two replicas; {hint}")
    stages, mbs, layers = [], [], []
    for it in items:
        s, _, m = it.partition(":")
        try:
            counts = [int(x) for x in s.split("+")] if "+" in s else None
            n = len(counts) if counts is not None else int(s)
            mbs.append(int(m) if m else -1)
        except ValueError:
            raise ShoalError(f"--replicas {text!r}: {it!r} is not STAGES, L1+L2+... or either with "
                             f":MICRO_BATCHES; {hint}") from None
        if n < 1 or n > n_layers:
            raise ShoalError(f"--replicas {text!r}: each replica needs 1 to {n_layers} stages (the model's layers)")
        if counts is not None and (min(counts) < 1 or sum(counts) != n_layers):
            raise ShoalError(f"--replicas {text!r}: the layer counts {s} must each be >= 1 and sum to the "
                             f"model's {n_layers} layers")
        stages.append(n)
        layers += counts if counts is not None else [b - a for a, b in even_split(n_layers, n)]
    if all(m == -1 for m in mbs):
        base, extra = divmod(micro_batches, len(stages))
        mbs = [base + (1 if r < extra else 0) for r in range(len(stages))]
    elif any(m == -1 for m in mbs):
        raise ShoalError(f"--replicas {text!r}: give every replica's micro-batches or none; {hint}")
    if any(m < 1 for m in mbs) or sum(mbs) != micro_batches:
        raise ShoalError(f"--replicas {text!r}: the replicas' micro-batches {mbs} must each be >= 1 and sum to "
                         f"--micro-batches {micro_batches}")
    return stages, mbs, layers


def parse_replica_regions(text: str) -> list[str]:
    """Each replica's regions of ``--replicas SPEC``, replica order: what follows an item's ``@``,
    regions joined by ``+`` (``1:2@asia,1:6@eu+us``), "" for an item without; empty when no item
    names any (the coordinator then gives regions to replicas by its own rule)."""
    out = []
    for it in (x.strip() for x in text.split(",") if x.strip()):
        _, at, reg = it.partition("@")
        names = [g.strip() for g in reg.split("+")] if at else []
        if at and not all(names):
            raise ShoalError(f"--replicas {text!r}: {it!r} names no region after '@' (e.g. 1:2@eu or 1:2@eu+us)")
        out.append("+".join(names))
    return out if any(out) else []


def replicas_of_plan(plan: dict, micro_batches: int, n_layers: int) -> str:
    """The ``--replicas`` SPEC of a plan written by ``shoal plan --json`` (its replicas' layer
    splits, micro-batch shares and clusters' regions); a one-line ShoalError when the plan does
    not fit the run."""
    reps = plan.get("replicas") or []
    if len(reps) < 2:
        raise ShoalError("the plan file has fewer than two pipeline replicas; make one with "
                         "shoal plan --sync local --replicas --json FILE")
    if int(plan.get("micro_batches", 0)) != micro_batches:
        raise ShoalError(f"the plan has {plan.get('micro_batches')} micro-batches per step, the run "
                         f"{micro_batches}: give --micro-batches {plan.get('micro_batches')}")
    items = []
    for r in reps:
        cuts = [(int(st["layers"][0]), int(st["layers"][1])) for st in r["stages"]]
        if cuts[0][0] != 0 or cuts[-1][1] != n_layers or any(cuts[i][1] != cuts[i + 1][0] for i in range(len(cuts) - 1)):
            raise ShoalError(f"a replica of the plan splits layers as {cuts}, not the run model's {n_layers} "
                             "layers; plan the run's model")
        # (a one-stage replica is "1": a lone number is a stage count)
        split = "+".join(str(b - a) for a, b in cuts) if len(cuts) > 1 else "1"
        cluster = str(r.get("cluster") or "")
        items.append(f"{split}:{int(r['micro_batches'])}" + (f"@{cluster}" if cluster else ""))
    return ",".join(items)


def replica_workers_of_plan(plan: dict) -> dict[str, int]:
    """Device id -> the run's stage index of the workers a plan written by ``shoal plan --json``
    places (pure): replicas in order, each replica's stages in order (the SPEC's stage order)."""
    out, k = {}, 0
    for r in plan.get("replicas") or []:
        for st in r.get("stages") or []:
            for w in st.get("workers") or []:
                out.setdefault(str(w), k)
            k += 1
    return out


def _plan_file(text: str) -> dict:
    """The plan file ``--replicas`` names (a one-line ShoalError when it cannot be read)."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(text).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise ShoalError(f"--replicas {text}: cannot read the plan file ({exc})") from None


def read_replica_workers(text: str) -> dict[str, int]:
    """``--replicas``: the planner's worker placement of a plan file ({} for a SPEC)."""
    return replica_workers_of_plan(_plan_file(text)) if text.endswith(".json") else {}


def resolve_replicas(text: str, micro_batches: int, n_layers: int) -> str:
    """``--replicas``: a SPEC as given, or the SPEC of a plan file (a path ending in ``.json``)."""
    if not text.endswith(".json"):
        return text
    return replicas_of_plan(_plan_file(text), micro_batches, n_layers)


def replica_slots(stages: list[int], mbs: list[int], n_layers: int, layers: list[int] | None = None) -> list[Slot]:
    """The stages of a replica plan in stage-index order (replica 0's first); ``layers``: every
    stage's layer count (None: each replica's layers split evenly, the coordinator's split)."""
    from shoal.runtime.common import even_split

    out, lo, k = [], 0, 0
    for r, (s, m) in enumerate(zip(stages, mbs, strict=True)):
        if layers:
            a = 0
            for n in layers[k:k + s]:
                out.append(Slot(r, a, a + n, lo, lo + m))
                a += n
        else:
            for a, b in even_split(n_layers, s):
                out.append(Slot(r, a, b, lo, lo + m))
        k += s
        lo += m
    return out


def slots_of_spec(spec, n_layers: int) -> list[Slot] | None:
    """The replica stages a run spec describes (None: one pipeline, no replicas)."""
    if not spec.replica_stages:
        return None
    return replica_slots(list(spec.replica_stages), list(spec.replica_mbs), n_layers, list(spec.replica_layers))


def check_replica_run(spec, n_layers: int) -> None:
    """A one-line ShoalError where a run spec's replicas cannot run (local mode only, the
    stage count their sum)."""
    if not spec.replica_stages:
        return
    if (spec.sync_mode or "exact") != "local":
        raise ShoalError("--replicas needs --sync local (replicas merge at the rounds of local mode)")
    if len(spec.replica_mbs) != len(spec.replica_stages) or sum(spec.replica_mbs) != spec.micro_batches:
        raise ShoalError("the replicas' micro-batches must sum to --micro-batches")
    if sum(spec.replica_stages) != spec.stages:
        raise ShoalError(f"--replicas has {sum(spec.replica_stages)} stages in all, the run {spec.stages}")
    if spec.replica_regions and len(spec.replica_regions) != len(spec.replica_stages):
        raise ShoalError("give every replica's regions (@REGION) or none")
    if any(s > n_layers for s in spec.replica_stages):
        raise ShoalError(f"a replica has more stages than the model's {n_layers} layers")
    if spec.replica_layers:
        counts, k = list(spec.replica_layers), 0
        ok = len(counts) == spec.stages and min(counts) >= 1
        for n in spec.replica_stages:
            ok = ok and sum(counts[k:k + n]) == n_layers
            k += n
        if not ok:
            raise ShoalError(f"the replicas' layer counts must each be >= 1 and cover the model's {n_layers} "
                             "layers in every replica")


def overlaps(a: Slot, b: Slot) -> bool:
    """Whether two stages hold a common layer (first and last stages also share the embedding
    or the head: they hold layer 0 or the last layer too)."""
    return a.first < b.last and b.first < a.last


def peers(slots: list[Slot], k: int) -> list[int]:
    """Stages of other replicas holding any of stage ``k``'s layers, in stage order."""
    return [j for j, s in enumerate(slots) if s.replica != slots[k].replica and overlaps(s, slots[k])]


def assign_replica_workers(flops: Mapping[str, float], regions: Mapping[str, str], slots: list[Slot],
                           current: Mapping[str, int] | None = None,
                           homes: Sequence[str] | None = None,
                           fits: Mapping[str, Collection[int]] | None = None) -> dict[str, int]:
    """Worker -> stage of a replica plan, keeping each replica inside few network regions (pure).

    A stage's work is its layers times its replica's micro-batches. With at least as many
    regions as replicas, whole regions go to replicas (largest region first, each to the
    replica with the least capacity per unit of work, every replica getting one before any
    gets a second), so activations, which never leave a replica, stay inside a region; inside
    a replica, workers are balanced over its stages (:func:`shoal.runtime.common.assign_workers`).
    Kept assignments (``current``) stay; a new worker joins a replica that already works in its
    region when there is one. Any stage still without a worker then takes one from a stage that
    has two (across regions, as a last resort). With fewer regions than replicas it is plain
    balancing over all stages. Deterministic for equal inputs.

    A region goes first to a replica it has workers enough to staff (a worker per stage), then
    the least loaded, then the deepest. ``homes`` (a plan's clusters: each replica's regions
    joined by ``+``, "" for none) names the replica of those regions first; a kept worker's
    replica still wins for its region, and the other regions go by the rule above to the
    replicas no region was named for. ``fits``: the stages each worker's memory can hold
    (:func:`shoal.runtime.common.assign_workers`); a worker is only ever placed inside its set.
    """
    from shoal.runtime.common import assign_workers

    costs = [float((s.last - s.first) * (s.mb_hi - s.mb_lo)) for s in slots]
    names = sorted({regions.get(w, "") for w in flops})
    n_rep = max(s.replica for s in slots) + 1
    if len(names) < n_rep:
        return assign_workers(dict(flops), costs, dict(current or {}), fits)
    out = {w: k for w, k in (current or {}).items() if w in flops and 0 <= k < len(slots)}
    rep_cost = [sum(c for c, s in zip(costs, slots, strict=True) if s.replica == r) for r in range(n_rep)]
    depth = [sum(1 for s in slots if s.replica == r) for r in range(n_rep)]

    def rep_load(r: int) -> float:
        return sum(flops[w] for w, k in out.items() if slots[k].replica == r) / max(rep_cost[r], 1e-12)

    home: dict[str, int] = {}  # region -> the replica its workers join
    for w, k in sorted(out.items()):
        home.setdefault(regions.get(w, ""), slots[k].replica)
    for r, names in enumerate(list(homes or [])[:n_rep]):
        for g in (names.split("+") if names else []):
            home.setdefault(g, r)
    new = [w for w in flops if w not in out]
    by_region: dict[str, list[str]] = {}
    for w in new:
        by_region.setdefault(regions.get(w, ""), []).append(w)
    def held(g: str) -> list[int]:
        """The replicas every new worker of region ``g`` fits some stage of (memory)."""
        return [r for r in range(n_rep)
                if fits is None or all(w not in fits or any(slots[k].replica == r for k in fits[w])
                                       for w in by_region[g])]

    # Regions whose memory holds fewer replicas choose first (all alike without ``fits``).
    for reg in sorted(by_region, key=lambda g: (len(held(g)), -sum(flops[w] for w in by_region[g]), g)):
        if reg not in home:
            taken = {slots[k].replica for k in out.values()} | set(home.values())
            empty = [r for r in range(n_rep) if r not in taken]
            ok = held(reg)
            # a replica its workers' memory holds, one the region can staff whole, the least
            # loaded, the deepest (larger regions come first: deep replicas need more workers),
            # the most work
            pool = [r for r in empty if r in ok] or ok or empty or list(range(n_rep))
            home[reg] = min(pool, key=lambda r: (depth[r] > len(by_region[reg]), rep_load(r),
                                                 -depth[r], -rep_cost[r], r))
        r = home[reg]
        mine = [k for k, s in enumerate(slots) if s.replica == r]
        sub = assign_workers({w: flops[w] for w in flops if w in by_region[reg] or out.get(w) in mine},
                             [costs[k] for k in mine],
                             {w: mine.index(k) for w, k in out.items() if k in mine},
                             None if fits is None else {w: [mine.index(k) for k in ks if k in mine]
                                                        for w, ks in fits.items()})
        for w, j in sub.items():
            out[w] = mine[j]
    return assign_workers(dict(flops), costs, out, fits)


def planned_assignment(placement: Mapping[str, int], devices: Mapping[str, str], n_stages: int,
                       fits: Mapping[str, Collection[int]] | None = None) -> dict[str, int]:
    """Member -> stage of the members whose device a plan places (``placement``: device id ->
    stage; ``devices``: member -> the device it plays), where the stage exists and the member's
    memory holds it (pure). The rest are left to :func:`assign_replica_workers`."""
    out = {}
    for mid, dev in devices.items():
        k = placement.get(dev)
        if k is not None and 0 <= k < n_stages and (fits is None or mid not in fits or k in fits[mid]):
            out[mid] = k
    return out


def replica_regions(assign: Mapping[str, int], regions: Mapping[str, str], slots: list[Slot]) -> list[str]:
    """Each replica's region: the one most of its workers are in (ties: name order; "" without
    workers), for placing its stage servers (pure)."""
    n_rep = max(s.replica for s in slots) + 1
    out = []
    for r in range(n_rep):
        seen: dict[str, int] = {}
        for w, k in assign.items():
            if slots[k].replica == r:
                seen[regions.get(w, "")] = seen.get(regions.get(w, ""), 0) + 1
        out.append(min(seen, key=lambda g: (-seen[g], g)) if seen else "")
    return out


def place_replica_servers(current: list[str], server_region: Mapping[str, str], want: list[str]) -> list[str]:
    """Stage -> server member for a replica plan (pure): ``current`` (stage -> server) permuted so
    that as many stages as possible get a server in ``want[stage]``'s region (its replica's).
    A stage whose server is already in that region keeps it; the rest take, in stage order, a
    free server of their region (name order), and the stages left take the servers left."""
    out: list[str | None] = [sid if server_region.get(sid) == want[k] else None for k, sid in enumerate(current)]
    free = sorted(sid for sid in current if sid not in out)
    for k, sid in enumerate(out):
        if sid is None:
            pick = next((f for f in free if server_region.get(f) == want[k]), None)
            if pick is not None:
                out[k] = pick
                free.remove(pick)
    for k, sid in enumerate(out):
        if sid is None:
            out[k] = current[k] if current[k] in free else free[0]
            free.remove(out[k])
    return out


PART_TENSORS = pb.ReplicaPart.DESCRIPTOR.fields_by_name["tensors"].number  # (kept out of protobuf when received)


class FramedPart(Mapping[str, torch.Tensor]):
    """A peer's part kept as it came, its wire frames, each tensor decoded where it is read.

    A server waits for the parts of every peer replica holding its layers before it merges:
    decoded, that is one float32 copy of its stage per peer (nine for a stage ten replicas
    share). Frames of a compressed part are a fraction of that (``lowrank`` about 1/1,000);
    :func:`merge_parts` reads each tensor once, so a merge over framed parts holds one decoded
    tensor beside its sum. A frame decodes to the same bits every time."""

    def __init__(self, frames: Sequence, shapes: Mapping[str, tuple[int, ...]]):
        self._frames = {t.name: t for t in frames}  # name -> its wire frame
        self._shapes = {n: tuple(shapes[n]) for n in self._frames}  # name -> the receiver's shape of it

    def __getitem__(self, name: str) -> torch.Tensor:
        return decode_tensor(self._frames[name], shape=self._shapes[name], dtype="float32", finite=True)

    def __iter__(self):
        return iter(self._frames)

    def __len__(self) -> int:
        return len(self._frames)


class SpilledPart(Mapping[str, torch.Tensor]):
    """A peer's part beyond the server's merge memory whose frames are no smaller than its
    tensors (a raw part: the run's last, dense round, or weights), on disk: received into a
    file (:meth:`spooled`, a large part) or written there as it came; mapped where the merge
    reads it and let go after (:meth:`release`: its pages leave the process). A server then
    holds one such part at a time however many peers share its layers. The file goes when the
    part does."""

    def __init__(self, msg: pb.ReplicaPart | Framed, shapes: Mapping[str, tuple[int, ...]],
                 folder: str | Path | None):
        # a received part's frames are views of the bytes that came: written as they are
        self.path = None if folder is None else spill_file(self, message_pieces(msg, PART_TENSORS), folder, "part-")
        self._names = [t.name for t in msg.tensors]  # its tensors' names, in order
        self._shapes = {n: tuple(shapes[n]) for n in self._names}
        self._part: FramedPart | None = None  # read back while the merge reads it
        self._map: mmap.mmap | None = None  # the written file, mapped while the merge reads it
        self._received: Framed | None = None  # a spooled part: the message, its frames views of its file

    @classmethod
    def spooled(cls, msg: Framed, shapes: Mapping[str, tuple[int, ...]]) -> SpilledPart:
        """A part received into a file (``msg.spool``): on disk already, not written again."""
        part = cls(msg, shapes, None)
        part._received = msg
        return part

    def _read(self) -> FramedPart:
        if self._part is None:
            if self._received is not None:
                msg = self._received
            else:
                with open(self.path, "rb") as f:
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                msg = split_framed(memoryview(self._map), pb.ReplicaPart, PART_TENSORS)
            self._part = FramedPart(msg.tensors, self._shapes)
        return self._part

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read()[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def release(self) -> None:
        """Let go of the pages read (they stay in the page cache; the file stays until the part goes)."""
        self._part = None
        if self._received is not None and self._received.spool is not None:
            self._received.spool.release()
        if self._map is not None:
            with contextlib.suppress(BufferError, ValueError):  # (a view of it still alive: unmapped with it)
                self._map.close()
            self._map = None


def merge_parts(parts: Mapping[int, tuple[int, bool, Mapping[str, torch.Tensor]]],
                anchor: Mapping[str, torch.Tensor]) -> tuple[bool, dict[str, torch.Tensor]]:
    """The per-layer merge of the replicas' parts for the parameters in ``anchor`` (this stage's
    merged weights of the round's start).

    ``parts[stage] = (micro-batches, weights?, tensors)``; a part of 0 micro-batches drops out.
    When every part holds weights the result is their micro-batch-weighted mean per parameter
    (weights=True); else each weights part becomes the pseudo-gradient ``anchor - w`` and the
    result is the weighted mean of pseudo-gradients (weights=False), for the outer step. Parts
    are added in stage order, each weighted by its micro-batches over those of the parts holding
    that parameter (:func:`shoal.train.outer.merge_per_layer`), so every server holding a
    parameter computes the same bits. Each part's tensors are read once, one at a time, and
    folded into the sum (a :class:`FramedPart` decodes only then). A
    parameter no part holds is left out; a :class:`ShoalError` if a part's shape differs from
    ``anchor``'s.
    """
    live = {k: p for k, p in sorted(parts.items()) if p[0] > 0}
    if not live:
        return True, {}
    all_weights = all(w for _, w, _ in live.values())
    views = {k: _PartView(t, anchor, w and not all_weights) for k, (_, w, t) in live.items()}

    def release(k: int) -> None:
        if hasattr(live[k][2], "release"):
            live[k][2].release()  # (a spilled part read back: one in memory at a time)

    return all_weights, merge_per_layer(views, {k: p[0] for k, p in live.items()}, release)


class _PartView(Mapping[str, torch.Tensor]):
    """A part's tensors of the parameters in ``anchor``, read where they are read, checked
    against ``anchor``'s shapes and, ``as_delta``, turned from weights into ``anchor - w``."""

    def __init__(self, part: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], as_delta: bool):
        self._part, self._anchor, self._as_delta = part, anchor, as_delta

    def __getitem__(self, name: str) -> torch.Tensor:
        x, a = self._part[name], self._anchor[name]
        if tuple(x.shape) != tuple(a.shape):
            raise ShoalError(f"parameter {name}: a part holds shape {tuple(x.shape)}, this stage "
                             f"{tuple(a.shape)}; replicas of different models cannot merge")
        return a - x if self._as_delta else x

    def __iter__(self):
        return (name for name in self._part if name in self._anchor)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def flush_part(tensors: Mapping[str, torch.Tensor], weights: bool,
               residual: Mapping[str, torch.Tensor], in_place: bool = False) -> dict[str, torch.Tensor]:
    """A stage's part of the run's last, dense round with what its earlier compressed parts left
    (``residual``, pseudo-gradient units: anchor minus weights): added to a pseudo-gradient part,
    taken off a weights part (the weights it should have moved to). Pure, unless ``in_place``:
    then written into ``tensors``' own (contiguous) tensors, the same bits without one more
    float32 copy of the stage beside the part (for a part this server summed itself)."""
    out = {}
    for name, t in tensors.items():
        r = residual.get(name)
        if r is None:
            out[name] = t
        elif in_place and t.is_contiguous():
            out[name] = t.sub_(r) if weights else t.add_(r)
        else:
            out[name] = t - r if weights else t + r
    return out


def own_part(got: Mapping[str, Mapping[str, torch.Tensor]], replicas: Mapping[str, Mapping[str, torch.Tensor]],
             counts: Mapping[str, int], lr: float, mu: float, pool: Executor | None = None,
             presum: dict[str, torch.Tensor] | None = None) -> tuple[int, bool, dict[str, torch.Tensor]]:
    """A stage's part of the replicas' merge from its own workers' round: (micro-batches, weights?,
    tensors), the weighted mean of their weights (outer lr 1, momentum 0, every contributor sent
    its weights) or of their pseudo-gradients (summed on ``pool``'s threads: the same bits;
    ``presum``: that sum already taken, by the screen's read of the pushes with these shares)."""
    shares = merge_weights({w: counts.get(w, 0) for w in got})
    if not shares:
        return 0, False, {}
    n = sum(counts.get(w, 0) for w in shares)
    if merges_weights(lr, mu) and set(shares) <= set(replicas):
        return n, True, weighted_sum({w: replicas[w] for w in shares}, shares, pool)
    return n, False, presum if presum is not None else weighted_sum(got, shares, pool)


@functools.lru_cache(maxsize=64)
def stage_names(cfg, first: int, last: int) -> frozenset[str]:
    """Parameter names of layers ``[first, last)`` of model ``cfg`` (built on the meta device)."""
    from shoal.model.transformer import build_stage

    with torch.device("meta"):
        module = build_stage(cfg, first, last, init=False)
    return frozenset(n for n, _ in module.named_parameters())


PART_RETRY_S = 0.1  # pause between tries of a part a peer could not take yet


class ReplicaServerMixin:
    """Stage-server state and handlers of replica plans (no effect without replicas)."""

    replica_parts: dict | None = None
    replica_held: dict | None = None
    part_gate: asyncio.Semaphore | None = None  # one peer's part received at a time
    server_ids: list[str] | tuple = ()  # member id of each stage's server (the coordinator's heartbeats)

    @property
    def slots(self) -> list[Slot] | None:
        return slots_of_spec(self.spec, self.cfg.n_total_layers) if self.spec is not None else None

    def _mb_range(self) -> range:
        """Micro-batch ids of each step this stage serves (its replica's; all without replicas)."""
        if self.spec.replica_stages and 0 <= self.stage < self.spec.stages:
            s = self.slots[self.stage]
            return range(s.mb_lo, s.mb_hi)
        return range(self.spec.micro_batches)

    def _replica_reset(self) -> None:
        """A (re)load: no part received yet, and a fresh residual for compressed parts."""
        from shoal.net.compress import ErrorFeedback
        from shoal.runtime.sync.codecs import compression_of_spec

        # (epoch, round) -> stage -> part received from a peer
        self.replica_parts = {}
        # (epoch, round) -> the memory account of its parts held decoded (beyond it: frames)
        self.replica_held = {}
        shutil.rmtree(self._parts_folder(), ignore_errors=True)  # (what an earlier process here left)
        # Pseudo-gradient parts go in the run's push codec, with error feedback kept here across
        # rounds (what a part did not carry goes with the next one), as the cost model prices them.
        codec = compression_of_spec(self.spec).wire("push") if self.spec is not None else "raw"
        self.part_ef = ErrorFeedback(codec) if codec != "raw" else None

    def _encode_part(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, pb.Tensor], dict[str, torch.Tensor]]:
        """A pseudo-gradient part in the push codec: each tensor's frame (the same bytes to every
        peer) and what it decodes to, which this server merges too (every server the same bits)."""
        frames, decoded = {}, {}
        for name in sorted(tensors):
            frames[name] = f = encode_tensor(name, tensors[name], self.part_ef.codec, ef=self.part_ef)
            decoded[name] = decode_tensor(f, shape=tuple(tensors[name].shape), dtype="float32", finite=True)
        return frames, decoded

    async def ReplicaPartStream(self, request_iterator, context):
        """A peer replica stage's part of a round's merge, taken one at a time: a part being
        received is its chunks, their join and the parsed message, and a dense round's raw
        parts from every peer at once would hold that for each (the senders wait on their
        streams meanwhile, and retry a call that times out)."""
        if self.part_gate is None:
            self.part_gate = asyncio.Semaphore(1)
        async with self.part_gate:
            return await self._take_part(request_iterator, context)

    async def _take_part(self, request_iterator, context):
        try:
            # (frames kept out of protobuf: a raw part's payloads stay views of the bytes received)
            # a large part is received into a file of the parts' folder (page cache, not this process)
            msg = await receive(request_iterator, pb.ReplicaPart, self.max_bytes("grads"), frames_field=PART_TENSORS,
                                spool=self._parts_folder())
        except WireError as exc:
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}")
        if context is not None:
            from shoal.net.auth import check_caller

            await check_caller(context, msg.member_id)
        slots = self.slots if self.spec is not None and self.version >= 0 else None
        if slots is None or self.stage < 0:
            return pb.PushReply(accepted=False, reason="not ready")
        if msg.epoch > self.epoch:
            return pb.PushReply(accepted=False, reason="not ready")
        if msg.epoch < self.epoch or msg.round <= self.local_merged:
            return pb.PushReply(accepted=True, reason="old; dropped")
        if msg.stage not in peers(slots, self.stage):
            return pb.PushReply(accepted=False, reason=f"stage {msg.stage} holds none of stage {self.stage}'s layers")
        ids = self.server_ids
        if msg.stage >= len(ids) or ids[msg.stage] != msg.member_id:
            # Only the server the coordinator gave that stage (as our newest heartbeat says) speaks for it;
            # a replacement we have not heard of yet is retried.
            return pb.PushReply(accepted=False, reason="not ready")
        key = (msg.epoch, msg.round)
        held = self.replica_held.get(key)
        if held is None:
            held = self.replica_held[key] = self._new_round_pushes()
        shapes = {t.name: tuple(self.params[t.name].shape) for t in msg.tensors if t.name in self.params}
        nbytes = 4 * sum(self.params[n].numel() for n in shapes)
        dense = held.room(nbytes, 0)  # within the merge memory and the host's reserve
        # Beyond it: compressed frames stay in memory, raw ones go to disk (merge_parts reads them once).
        spill = not dense and message_nbytes(msg) >= nbytes // 2

        def check() -> Mapping[str, torch.Tensor]:
            tensors = self._decode_part(msg, dense)
            if dense:
                return tensors
            if spill:
                if getattr(msg, "spool", None) is not None:
                    return SpilledPart.spooled(msg, shapes)
                try:
                    return SpilledPart(msg, shapes, self._parts_folder())
                except OSError as exc:  # (a full or read-only disk: held in memory, as before)
                    log.warning("%s keeps stage %d's part in memory: cannot write it to %s: %s", self.name,
                                msg.stage, self._parts_folder(), exc)
            return FramedPart(msg.tensors, shapes)

        try:
            tensors = await asyncio.get_running_loop().run_in_executor(None, check)
        except WireError as exc:
            log.warning("%s rejected a replica part of stage %d: %s", self.name, msg.stage, exc)
            return pb.PushReply(accepted=False, reason=f"rejected: {exc}")
        if msg.epoch != self.epoch or msg.round <= self.local_merged:
            return pb.PushReply(accepted=True, reason="old; dropped")
        if dense:
            held.put(str(msg.stage), tensors)
        self.replica_parts.setdefault(key, {})[msg.stage] = (int(msg.mbs), bool(msg.weights), tensors)
        async with self.cond:
            self.cond.notify_all()
        return pb.PushReply(accepted=True)

    def _parts_folder(self) -> Path:
        """Where this server spills peers' raw parts beyond its merge memory (its checkpoints' disk)."""
        root = getattr(self, "ckpt_root", "") or tempfile.gettempdir()
        return Path(root) / "replica-parts" / self.name

    def _decode_part(self, msg: pb.ReplicaPart, keep: bool = True) -> dict[str, torch.Tensor]:
        """A part's tensors, each checked against this stage's parameter of its name (``keep``
        False: checked one at a time and dropped, for a part held as its frames)."""
        out, seen = {}, set()
        for t in msg.tensors:
            if t.name not in self.params or t.name in seen:
                raise WireError(f"unexpected tensor {t.name!r}")
            seen.add(t.name)
            x = decode_tensor(t, shape=tuple(self.params[t.name].shape), dtype="float32", finite=True)
            if keep:
                out[t.name] = x
        return out

    async def _send_part(self, peer: int, msg: pb.ReplicaPart, data: bytes, frames: list, epoch: int) -> None:
        """Send a part (``data``: ``msg``, its head, serialised with ``frames``, its ``(kind,
        frame)`` pairs) to stage ``peer``'s server until it is taken or the epoch moves on."""
        while self.epoch == epoch and not self.done:
            addr = self.servers[peer] if peer < len(self.servers) else ""
            if addr:
                try:
                    rep = await send(self._stub(addr).ReplicaPartStream, msg, self.chunk_bytes, traffic=self.traffic,
                                     data=data, sender=self.member_id, frames=frames)
                    if rep.accepted:
                        return
                    if rep.reason != "not ready":
                        log.warning("%s: stage %d refused our replica part: %s", self.name, peer, rep.reason)
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(PART_RETRY_S)

    async def _replica_merge(self, counts: dict[str, int], version: int, epoch: int) -> tuple[str, dict] | None:
        """Merge this stage's workers into its part, exchange parts with the peer replicas' servers
        and apply the per-layer merge (None: the epoch moved on meanwhile)."""
        from shoal.runtime.common import tensors_digest
        from shoal.runtime.sync.local import merge_pool
        from shoal.train.outer import outer_nesterov_step

        slots = self.slots
        loop = asyncio.get_running_loop()
        presum = self._presummed(merge_weights({w: counts.get(w, 0) for w in self.local_got}))
        n, weights, tensors = await loop.run_in_executor(
            None, own_part, self.local_got.snapshot(), dict(self.local_replicas), counts, self.spec.outer_lr,
            self.spec.outer_momentum, merge_pool(), presum)
        del presum  # (the part itself, or summed again: not a second copy of the stage beside the part's)
        mine = peers(slots, self.stage)
        cfg = self.cfg
        frames = None
        if self.part_ef is not None and dense_round(version, self.spec.steps, self.part_ef.codec):
            # The run's last round is dense: the part goes raw with what earlier parts left.
            if n > 0:
                # (in place: the part is this merge's own sum, not a tensor anything else holds)
                tensors = flush_part(tensors, weights, self.part_ef.state(), in_place=True)
            self.part_ef.reset()
        elif n > 0 and not weights and self.part_ef is not None:
            frames, tensors = await loop.run_in_executor(None, self._encode_part, tensors)

        # One message, serialised once, for all the peers that hold the same layers (every peer,
        # where the replicas split alike): a raw part is a float32 copy of the stage, and a dense
        # round's would otherwise be two per peer.
        wants: dict[frozenset, list[int]] = {}
        for p in mine:
            wants.setdefault(stage_names(cfg, slots[p].first, slots[p].last), []).append(p)

        def framed() -> dict[frozenset, tuple[pb.ReplicaPart, bytes, list]]:
            out = {}
            for held in wants:
                head = pb.ReplicaPart(member_id=self.member_id, epoch=epoch, round=version, stage=self.stage, mbs=n,
                                      weights=weights)
                # a raw part's payloads are views of its tensors, copied once into the message
                items = [frames[name] if frames is not None else encode_frame(name, tensors[name], "raw", view=True)
                         for name in sorted(tensors) if name in held]
                out[held] = (head, serialize_framed(head, PART_TENSORS, items),
                             [("replica_merge", f) for f in items])
            return out

        msgs = await loop.run_in_executor(None, framed)
        sends = [asyncio.ensure_future(self._send_part(p, *msgs[held], epoch)) for held, ps in wants.items() for p in ps]
        del msgs
        since, warned = time.monotonic(), False
        try:
            key = (epoch, version)
            while set(mine) - set(self.replica_parts.get(key, {})):
                if self.epoch != epoch:
                    return None
                if not warned and time.monotonic() - since > self.flush_grace_s:
                    warned = True
                    log.warning("%s waits for the replica parts of stages %s for v%d", self.name,
                                sorted(set(mine) - set(self.replica_parts.get(key, {}))), version)
                async with self.cond:
                    await self.cond.wait(0.5)
            await asyncio.gather(*sends)
        finally:
            for t in sends:
                t.cancel()
        if self.epoch != epoch:
            return None
        parts = dict(self.replica_parts.pop(key, {}))
        parts[self.stage] = (n, weights, tensors)
        self.replica_parts = {k: v for k, v in self.replica_parts.items() if k[1] > version}
        self.replica_held = {k: v for k, v in self.replica_held.items() if k[1] > version}

        def apply() -> tuple[str, dict]:
            anchor = {name: p.detach() for name, p in self.params.items()}
            all_weights, merged = merge_parts(parts, anchor)
            with torch.no_grad():
                if all_weights:
                    for name, x in merged.items():
                        self.params[name].data.copy_(x)
                elif merged:
                    outer_nesterov_step({k: p.data for k, p in self.params.items() if k in merged}, merged,
                                        self.outer_m, self.spec.outer_lr, self.spec.outer_momentum)
            total = sum(p[0] for p in parts.values())
            shares = {str(k): p[0] / total for k, p in sorted(parts.items())} if total else {}
            return tensors_digest({k: p.detach() for k, p in self.params.items()}), shares

        async with self._wlock:
            if self.epoch != epoch:
                return None
            out = await loop.run_in_executor(None, apply)
            self._wcache = None
            self.local_merged = version
            return out
