"""Fault injection for ``shoal launch --fault SPEC`` (repeatable).

Grammar (one fault per ``--fault``; workers are named ``w0``, ``w1``, ... and servers
``s0``, ``s1``, ... in start order, as in ``events.jsonl``):

* ``kill:worker[:wN]:step=N`` -- kill -9 the worker once N steps are committed (default:
  the last worker started).
* ``kill:server[:sN]:step=N`` -- kill -9 the server once N steps are committed and start
  a replacement on the same checkpoint folder (default: the server of the last stage).
* ``poison:wN:scale=F[:kind=K][:from=S]`` -- that worker pushes poisoned gradients from
  step S on (default 0; honest before): ``kind=scale`` (default) its true gradients times F,
  ``kind=noise`` Gaussian noise of F times their norm instead (F default 1), ``kind=bias``
  its true gradients plus F (default 0.5) times their per-element RMS along a sign vector
  fixed for the run (a consistent small bias).
* ``slow:wN:factor=F`` -- that worker takes F times its compute time for every task.
* ``stop:wN:step=N`` -- that worker takes no task of step N or later: at the first such lease
  it leaves the run (the task is redone by the others), e.g. a liar that keeps out of the
  last step's full recomputation.
* ``flap:wN:period=S:down=S:for=S`` -- that worker reaches the stage servers through a
  link that resets every connection for ``down`` seconds every ``period`` seconds, for
  ``for`` seconds from its start (:class:`shoal.emulate.flap.FlapProxy`).
* ``corrupt-ckpt:K[:step=N]`` -- once N (default 2) steps are committed and stage K has a
  checkpoint, kill -9 the server of stage K, corrupt its newest checkpoint and start a
  replacement: it finds the checksum mismatch, sets the file aside and the run rolls back
  to the previous checkpoint. A run that can write no checkpoint before its last step
  (:func:`ckpt_may_come`: neither the step rule nor the time rule) is refused at the start;
  one whose only checkpoint may come from the time rule waits for it (the launcher says so
  if the run ends first).

Triggers are on run state (steps committed, read from the run's ``metrics.jsonl``), not
on wall-clock guesses. :func:`parse_fault` is the one parser; :func:`check_faults`
checks a list of faults against the swarm's size.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ShoalError

GRAMMAR = ("kill:worker|server[:NAME]:step=N, kill:coordinator:step=N, poison:wN:scale=F[:kind=scale|noise|bias]"
           "[:from=STEP], "
           "slow:wN:factor=F, stop:wN:step=N, "
           "flap:wN:period=S:down=S:for=S, corrupt-ckpt:STAGE[:step=N]")


@dataclass(frozen=True)
class KillFault:
    """kill -9 a member once ``step`` steps are committed."""

    role: str  # "worker" or "server"
    name: str | None  # "w1" / "s0" (None: the last worker started / the last stage's server)
    step: int  # steps committed when it is killed


POISON_KINDS = ("scale", "noise", "bias")


@dataclass(frozen=True)
class PoisonFault:
    """A dishonest worker: pushes poisoned gradients from step ``start`` on (:func:`poison`)."""

    worker: str  # "wN"
    scale: float  # scale: gradient multiplier; noise: noise norm / true norm; bias: bias / per-element RMS
    kind: str = "scale"  # one of POISON_KINDS
    start: int = 0  # first step whose pushes are poisoned (honest before)


@dataclass(frozen=True)
class SlowFault:
    """A slow worker: every task takes ``factor`` times its compute time."""

    worker: str  # "wN"
    factor: float  # >= 1


@dataclass(frozen=True)
class StopFault:
    """A worker that takes no task of step ``step`` or later: it leaves the run at the first."""

    worker: str  # "wN"
    step: int  # the first step it takes no task of


@dataclass(frozen=True)
class FlapFault:
    """A worker whose links to the stage servers reset periodically."""

    worker: str  # "wN"
    period_s: float  # a flap every this many seconds
    down_s: float  # connections are reset and refused this long per flap
    for_s: float  # flapping stops after this long (from the worker's start)


@dataclass(frozen=True)
class CorruptCkptFault:
    """Corrupt the newest checkpoint of a stage under a replacement server."""

    stage: int  # stage whose checkpoint is corrupted
    step: int  # steps committed when it happens


Fault = KillFault | PoisonFault | SlowFault | StopFault | FlapFault | CorruptCkptFault

_WORKER = re.compile(r"w\d+")
_SERVER = re.compile(r"s\d+")


def _options(spec: str, parts: list[str], allowed: dict[str, type]) -> dict:
    """``key=value`` items of a spec, converted; one line on anything else."""
    out: dict = {}
    for item in parts:
        key, eq, value = item.partition("=")
        if not eq or key not in allowed:
            raise ShoalError(f"--fault {spec!r}: unexpected {item!r}; expected "
                             f"{', '.join(k + '=' for k in allowed)} (grammar: {GRAMMAR})")
        if key in out:
            raise ShoalError(f"--fault {spec!r}: {key}= given twice")
        try:
            v = allowed[key](value)
        except ValueError:
            raise ShoalError(f"--fault {spec!r}: {key}={value!r} is not a{'n integer' if allowed[key] is int else ' number'}"
                             ) from None
        if isinstance(v, float) and not math.isfinite(v):
            raise ShoalError(f"--fault {spec!r}: {key}={value} is not finite")
        out[key] = v
    return out


def _need(spec: str, opts: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in opts]
    if missing:
        raise ShoalError(f"--fault {spec!r}: missing {', '.join(k + '=' for k in missing)} (grammar: {GRAMMAR})")


def _worker(spec: str, parts: list[str]) -> str:
    if not parts or not _WORKER.fullmatch(parts[0]):
        raise ShoalError(f"--fault {spec!r}: name the worker as wN (w0, w1, ...) after the kind")
    return parts[0]


def parse_fault(spec: str) -> Fault:
    """One ``--fault SPEC`` as a typed fault; a one-line :class:`ShoalError` when malformed."""
    parts = spec.strip().split(":")
    kind, rest = parts[0], parts[1:]
    if kind == "kill":
        if not rest or rest[0] not in ("worker", "server", "coordinator"):
            raise ShoalError(f"--fault {spec!r}: kill needs a role: "
                             "kill:worker|server[:NAME]:step=N or kill:coordinator:step=N")
        role, rest = rest[0], rest[1:]
        name = None
        if rest and "=" not in rest[0] and role != "coordinator":
            name, rest = rest[0], rest[1:]
            if not (_WORKER if role == "worker" else _SERVER).fullmatch(name):
                raise ShoalError(f"--fault {spec!r}: name the {role} as {'wN' if role == 'worker' else 'sN'}")
        opts = _options(spec, rest, {"step": int})
        _need(spec, opts, "step")
        if opts["step"] < 0:
            raise ShoalError(f"--fault {spec!r}: step= must be >= 0")
        return KillFault(role, name, opts["step"])
    if kind == "poison":
        worker = _worker(spec, rest)
        opts = _options(spec, rest[1:], {"scale": float, "kind": str, "from": int})
        how = opts.get("kind", "scale")
        if how not in POISON_KINDS:
            raise ShoalError(f"--fault {spec!r}: kind={how!r} is not one of {', '.join(POISON_KINDS)}")
        if how == "scale":
            _need(spec, opts, "scale")
        if opts.get("from", 0) < 0:
            raise ShoalError(f"--fault {spec!r}: from= must be >= 0 (the first poisoned step)")
        return PoisonFault(worker, opts.get("scale", {"scale": 1.0, "noise": 1.0, "bias": 0.5}[how]), how,
                           opts.get("from", 0))
    if kind == "slow":
        worker = _worker(spec, rest)
        opts = _options(spec, rest[1:], {"factor": float})
        _need(spec, opts, "factor")
        if opts["factor"] < 1:
            raise ShoalError(f"--fault {spec!r}: factor= must be >= 1 (how many times slower)")
        return SlowFault(worker, opts["factor"])
    if kind == "stop":
        worker = _worker(spec, rest)
        opts = _options(spec, rest[1:], {"step": int})
        _need(spec, opts, "step")
        if opts["step"] < 0:
            raise ShoalError(f"--fault {spec!r}: step= must be >= 0 (the first step it takes no task of)")
        return StopFault(worker, opts["step"])
    if kind == "flap":
        worker = _worker(spec, rest)
        opts = _options(spec, rest[1:], {"period": float, "down": float, "for": float})
        _need(spec, opts, "period", "down", "for")
        if not 0 < opts["down"] < opts["period"] or opts["for"] <= 0:
            raise ShoalError(f"--fault {spec!r}: need 0 < down < period and for > 0 (seconds)")
        return FlapFault(worker, opts["period"], opts["down"], opts["for"])
    if kind == "corrupt-ckpt":
        if not rest or not rest[0].isdigit():
            raise ShoalError(f"--fault {spec!r}: corrupt-ckpt needs a stage number: corrupt-ckpt:STAGE[:step=N]")
        opts = _options(spec, rest[1:], {"step": int})
        step = opts.get("step", 2)
        if step < 1:
            raise ShoalError(f"--fault {spec!r}: step= must be >= 1 (a checkpoint must exist)")
        return CorruptCkptFault(int(rest[0]), step)
    raise ShoalError(f"--fault {spec!r}: unknown kind {kind!r}; use {GRAMMAR}")


def check_faults(faults: list[Fault], *, workers: int, stages: int, steps: int, ckpt_every: int | None = None,
                 ckpt_every_s: float | None = None) -> None:
    """One-line errors for faults that name members or stages the swarm does not have, or that
    could do nothing (a corrupt-ckpt in a run that writes no checkpoint before its last step:
    ``ckpt_every`` is the servers' step rule, ``ckpt_every_s`` their time rule, None or 0:
    off, as :func:`shoal.runtime.common.ckpt_due` applies them). With the time rule on, a
    run too short for it may still write none: the launcher then says the fault never fired."""
    for f in faults:
        worker = getattr(f, "worker", None) or (f.name if isinstance(f, KillFault) and f.role == "worker" else None)
        if worker is not None and int(worker[1:]) >= workers:
            raise ShoalError(f"--fault names {worker}, but the swarm starts w0..w{workers - 1}")
        if isinstance(f, KillFault) and f.role == "server" and f.name and int(f.name[1:]) >= stages:
            raise ShoalError(f"--fault names {f.name}, but the swarm starts s0..s{stages - 1}")
        if isinstance(f, CorruptCkptFault) and f.stage >= stages:
            raise ShoalError(f"--fault corrupt-ckpt:{f.stage}: the run has stages 0..{stages - 1}")
        if isinstance(f, CorruptCkptFault) and ckpt_every is not None and not ckpt_may_come(ckpt_every, ckpt_every_s,
                                                                                          steps):
            rules = (f"--ckpt-every {ckpt_every}: no checkpoints at all, the time rule included" if ckpt_every <= 0
                     else f"--ckpt-every {ckpt_every}, and no time rule: --ckpt-every-s {ckpt_every_s or 0:g}")
            raise ShoalError(f"--fault corrupt-ckpt:{f.stage}: the servers write no checkpoint before the last of the "
                             f"{steps} steps ({rules}), so there is none to corrupt; give --ckpt-every K with "
                             f"0 < K < {steps}" + ("" if ckpt_every <= 0 else " or --ckpt-every-s T > 0"))
        step = getattr(f, "step", None)
        if step is not None and step >= steps:
            raise ShoalError(f"--fault at step={step} never fires: the run has {steps} steps")


def ckpt_may_come(ckpt_every: int, ckpt_every_s: float | None, steps: int) -> bool:
    """Whether a run of ``steps`` steps may write a checkpoint before its last step (pure):
    the step rule does when ``0 < ckpt_every < steps``; the time rule may (if the run lasts
    ``ckpt_every_s`` seconds) unless it is off or ``ckpt_every`` is 0 (no checkpoints at all)."""
    if ckpt_every <= 0:
        return False
    return ckpt_every < steps or (ckpt_every_s is not None and ckpt_every_s > 0 and steps > 1)


def worker_fault_args(faults: list[Fault], worker: str) -> list[str]:
    """The ``shoal worker`` flags that make worker ``worker`` misbehave as ``faults`` say."""
    args: list[str] = []
    for f in faults:
        if isinstance(f, PoisonFault) and f.worker == worker:
            args += ["--fault-poison", repr(f.scale)]
            if f.kind != "scale":
                args += ["--fault-poison-kind", f.kind]
            if f.start:
                args += ["--fault-poison-from", str(f.start)]
        elif isinstance(f, SlowFault) and f.worker == worker:
            args += ["--fault-slow", repr(f.factor)]
        elif isinstance(f, StopFault) and f.worker == worker:
            args += ["--fault-stop-from", str(f.step)]
    return args


def poisons(kind: str, scale: float, start: int, step: int) -> bool:
    """Whether a worker with poison fault (``kind``, ``scale``, from ``start``) lies at ``step``."""
    return step >= start and (kind != "scale" or scale != 1.0)


def poison(g, name: str, step: int, kind: str, scale: float):
    """A poisoned gradient (or pseudo-gradient) tensor ``g`` of parameter ``name`` at ``step``.

    ``scale``: ``g`` times ``scale``; ``noise``: Gaussian noise of ``scale`` times ``g``'s
    norm in its place (seeded by step and name); ``bias``: ``g`` plus ``scale`` times its
    per-element RMS along a sign vector fixed for the run (seeded by the name only), the
    small consistent push in one direction that no single check sees as large.
    """
    import torch

    if kind == "scale":
        return g * scale
    salt = name if kind == "bias" else f"{name}/{step}"
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(salt.encode()).digest()[:7], "big"))
    r = torch.randn(g.shape, generator=gen, dtype=torch.float32).to(g.dtype).to(g.device)
    norm = float(g.float().norm())
    if kind == "noise":
        rn = float(r.float().norm())
        return r * (scale * norm / rn) if rn > 0 else g.clone()
    rms = norm / max(1, g.numel()) ** 0.5
    return g + torch.sign(r) * (scale * rms)


def corrupt_file(path: Path) -> None:
    """Flip bytes in the middle of a safetensors file's tensor data (its header stays readable)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    mid = header + (len(data) - header) // 2
    for i in range(mid, min(mid + 16, len(data))):
        data[i] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)


def newest_ckpt(folder: Path) -> Path | None:
    """The newest ``v<N>.safetensors`` in a stage's checkpoint folder (None: none)."""
    found = []
    for p in folder.glob("v*.safetensors"):
        m = re.fullmatch(r"v(\d+)\.safetensors", p.name)
        if m:
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None
