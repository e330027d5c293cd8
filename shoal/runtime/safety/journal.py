"""The coordinator's journal and the run-scoped files of a run folder.

Every run gets its own folder ``OUT/runs/<run id>/`` holding what the coordinator
writes: ``journal.jsonl`` (below), ``events.jsonl``, ``metrics.jsonl`` and, once the
run is done, ``summary.json``, ``config.json``, ``tokenizer.json`` and ``checkpoint/``.
``OUT/<name>`` for each of those is a relative symbolic link to the newest run's file,
so readers of ``OUT/metrics.jsonl`` or ``shoal generate --from OUT`` see the run that
last started, and a second run in the same ``OUT`` deletes nothing of the first (a
plain file or folder found where a link goes is moved to ``OUT/runs/previous-<time>/``).

The journal is append-only JSON lines, each flushed and fsynced before the
coordinator acts on it:

* ``run``: the run spec (protobuf JSON form), the coordinator's options and clock;
* ``plan``: the stages' layer ranges (a resumed run keeps them: checkpoints hold them);
* ``epoch``: a roll-back (epoch, the version every stage restarts from);
* ``commit``: a committed step with its metrics record, its decision (``ckpt``: every stage
  checkpoints the version it makes), (fp16) loss-scale state and ``unverified``: the names of
  the workers with a push in it that was never recomputed (a later ban of one undoes it);
* ``servers``: the name of the server serving each stage ("" while vacant), on every change;
* ``ban``: a worker a stage server banned (its name and why): banned for the whole run;
* ``resume``: a coordinator took the run over from this journal;
* ``done`` / ``failed``: how the run ended.

:func:`resume_state` folds those records into what a restarted coordinator needs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.errors import ShoalError

RUNS = "runs"  # OUT/runs/<run id>/ holds each run's files
JOURNAL = "journal.jsonl"
LINKED = ("journal.jsonl", "events.jsonl", "metrics.jsonl")  # linked from OUT when the run starts
FINAL = ("summary.json", "config.json", "tokenizer.json", "checkpoint")  # linked when the run is done


def run_dir(out: str | Path, run_id: str) -> Path:
    """The folder of run ``run_id`` inside the run folder ``out``."""
    return Path(out) / RUNS / run_id


def point_link(out: str | Path, name: str, run_id: str) -> None:
    """Make ``OUT/name`` a relative link to ``runs/<run_id>/name`` (replaced atomically).

    A plain file or folder already there (an older layout, or the local trainer's files)
    is moved to ``OUT/runs/previous-<mtime>/name``, never deleted.
    """
    out = Path(out)
    link = out / name
    target = Path(RUNS) / run_id / name
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    if link.exists() and not link.is_symlink():
        keep = out / RUNS / f"previous-{int(link.stat().st_mtime)}"
        keep.mkdir(parents=True, exist_ok=True)
        os.replace(link, keep / name)
    tmp = out / f".{name}.link-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


class Journal:
    """Append-only JSON-lines journal; every record is flushed and fsynced."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        # A torn last line (the coordinator died mid-write) must not glue onto the next record.
        if self._f.tell() > 0 and not self.path.read_bytes().endswith(b"\n"):
            self._f.write("\n")

    def write(self, kind: str, **fields) -> None:
        """Append one record and make it durable before returning."""
        self._f.write(json.dumps({"kind": kind, "wall": time.time(), **fields}, sort_keys=True) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_journal(path: str | Path) -> list[dict]:
    """Every complete record of a journal (a torn or garbled line is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "kind" in rec:
            records.append(rec)
    return records


@dataclass
class ResumeState:
    """What a coordinator taking a run over needs from its journal."""

    spec: dict  # the run spec in protobuf JSON form
    options: dict  # the first coordinator's options (listen, address, min_workers, ...)
    t0: float  # the run's clock (events' and metrics' time_s)
    layers: list[tuple[int, int]] | None = None  # the stages' layer ranges (None: never planned)
    epoch: int = 0  # the newest epoch any coordinator used
    committed: int = 0  # steps committed (the next step to run)
    records: list[dict] = field(default_factory=list)  # metrics record of each committed step, in order
    scale_at: dict[int, tuple[float, int]] = field(default_factory=dict)  # fp16: step -> (scale, good)
    stage_servers: list[str] = field(default_factory=list)  # newest name of each stage's server ("": vacant)
    bans: dict[str, str] = field(default_factory=dict)  # banned worker name -> why
    # (epoch, step) -> (lr, clip coefficient, skip, next loss scale) of the newest committed steps
    decisions: dict[tuple[int, int], tuple[float, float, bool, float]] = field(default_factory=dict)
    checkpointed: set[tuple[int, int]] = field(default_factory=set)  # (epoch, step) of those decided to checkpoint
    # worker name -> the first step that still holds an unverified push of it (a ban rolls back to it)
    unverified: dict[str, int] = field(default_factory=dict)
    state: str = "running"  # running | done | failed
    error: str = ""  # a failed run's one line


DECISIONS_KEPT = 64  # newest committed steps whose decisions a resumed coordinator keeps (a standby's log bound)


def resume_state(records: list[dict]) -> ResumeState:
    """Fold journal records (oldest first) into a :class:`ResumeState`."""
    if not records or records[0].get("kind") != "run":
        raise ShoalError("the journal does not start with its run record; it is not a shoal run journal")
    first = records[0]
    st = ResumeState(spec=first["spec"], options=first.get("options", {}), t0=float(first.get("t0", 0.0)))
    by_step: dict[int, dict] = {}
    for rec in records:
        kind = rec["kind"]
        st.epoch = max(st.epoch, int(rec.get("epoch", 0)))
        if kind == "plan":
            st.layers = [(int(a), int(b)) for a, b in rec["layers"]]
        elif kind == "epoch":
            # A roll-back: steps after its version are committed again.
            st.committed = int(rec["version"])
            st.unverified = {w: s for w, s in st.unverified.items() if s < st.committed}  # redone from there
            if rec.get("undo"):  # a ban's roll-back: the undone steps' records are the redone ones
                by_step = {k: r for k, r in by_step.items() if k < st.committed}
        elif kind == "commit":
            step = int(rec["step"])
            st.committed = step + 1
            by_step.setdefault(step, rec["record"])  # the first commit of a step is the one written
            for name in rec.get("unverified") or []:
                st.unverified[str(name)] = min(step, st.unverified.get(str(name), step))
            if rec.get("scale") is not None:
                st.scale_at[step + 1] = (float(rec["scale"][0]), int(rec["scale"][1]))
            if rec.get("decision") is not None:
                lr, coef, skip, nls = rec["decision"]
                st.decisions[(int(rec.get("epoch", 0)), step)] = (float(lr), float(coef), bool(skip), float(nls))
                if rec.get("ckpt"):
                    st.checkpointed.add((int(rec.get("epoch", 0)), step))
                # a standby logs at most STANDBY_LOG_STEPS: older decisions are never replayed
                for old in [k for k in st.decisions if k[1] <= step - DECISIONS_KEPT]:
                    del st.decisions[old]
                    st.checkpointed.discard(old)
        elif kind == "servers":
            st.stage_servers = [str(n) for n in rec.get("names", [])]
        elif kind == "ban":
            st.bans[str(rec["name"])] = str(rec.get("why", ""))
        elif kind == "listen":
            st.options["address"] = rec["address"]  # the newest address members dial
            st.options["bound"] = rec.get("listen", "")  # and what it was bound to (the port chosen)
        elif kind == "done":
            st.state = "done"
        elif kind == "failed":
            st.state, st.error = "failed", rec.get("why", "")
        elif kind == "resume":
            st.state, st.error = "running", ""
    st.records = [by_step[s] for s in sorted(by_step)]
    return st


def find_run(folder: str | Path, run_id: str | None = None) -> tuple[Path, str]:
    """``(OUT, run id)`` of the run ``--resume FOLDER [--run-id ID]`` names.

    ``FOLDER`` is a run folder (``--out``; its newest run unless ``run_id``) or one run's
    own folder ``OUT/runs/<id>``. Anything else is a one-line error.
    """
    p = Path(folder).expanduser()
    if not p.is_dir():
        raise ShoalError(f"--resume {folder}: no such folder; give the --out folder of an earlier run")
    if (p / JOURNAL).is_file() and p.parent.name == RUNS and not (p / RUNS).is_dir():
        if run_id and run_id != p.name:
            raise ShoalError(f"--resume {folder} is run {p.name}, not --run-id {run_id}")
        return p.parent.parent, p.name
    runs = sorted(d.name for d in (p / RUNS).iterdir() if (d / JOURNAL).is_file()) if (p / RUNS).is_dir() else []
    if not runs:
        raise ShoalError(f"--resume {folder}: no run journal in it (runs/<id>/{JOURNAL}); "
                         f"give the --out folder of a run started by this version of shoal")
    if run_id is None:
        return p, runs[-1]  # run ids start with their UTC start time: the last sorts newest
    if run_id not in runs:
        raise ShoalError(f"--resume {folder}: no run {run_id!r} in it (runs: {', '.join(runs)})")
    return p, run_id


def load_resume(folder: str | Path, run_id: str | None = None) -> tuple[Path, str, ResumeState]:
    """The run ``--resume`` names and its journal's state; a finished run is a one-line error."""
    out, rid = find_run(folder, run_id)
    state = resume_state(read_journal(run_dir(out, rid) / JOURNAL))
    steps = int(state.spec.get("steps", 0))
    if state.state == "done":
        raise ShoalError(f"run {rid} in {out} is finished ({state.committed} of {steps} steps); "
                         f"nothing to resume (start a new run)")
    return out, rid, state
