"""Screening local-mode (``--sync local``) pseudo-gradients: a real swarm with a poisoned
replica against the same swarm honest (the decisions are tested in tests/test_guard.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shoal.train.metrics import read_jsonl

# One stage, three workers: a merge screens once three replicas contribute (guard.local_quorum).
# Six micro-batches a step, so a worker slow to start still covers some of the first round.
RUN = dict(model="tiny", micro_batches=6, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2, steps=9,
           stages=1, workers=3, dead_after_s=10.0, min_lease_s=5.0, timeout_s=200, sync="local", sync_every=3,
           outer_lr=0.7, outer_momentum=0.9)


def _screens(out: Path) -> list[dict]:
    """The ``screen`` figures of every local merge: {member id: [norm per unit of lr, cosine]}."""
    text = "".join(p.read_text() for p in sorted((out / "logs").glob("server*.log")))
    return [json.loads(m.group(1))["screen"] for m in re.finditer(r"local merge (\{.*\})$", text, re.M)]


def _bounds(out: Path) -> list[float]:
    """The AdamW move bound each merge screened against (per unit of learning rate)."""
    text = "".join(p.read_text() for p in sorted((out / "logs").glob("server*.log")))
    return [float(m.group(1)) for m in re.finditer(r"AdamW move bound (\S+) per unit", text)]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_poisoned_replica_is_banned_and_honest_run_bans_nobody(tmp_path):
    """w1 sends its pseudo-gradients times -20: the first merge bans it and leaves its
    contribution out; the run keeps 3/4 of the honest run's loss drop (the honest run bans
    nobody)."""
    from shoal.runtime.processes.launch import LaunchConfig, launch

    honest = tmp_path / "honest"
    ref = launch(LaunchConfig(out=str(honest), **RUN))
    assert not [e for e in read_jsonl(honest / "events.jsonl") if e["event"] == "ban"]
    screens = _screens(honest)
    assert screens and len(screens[-1]) == 3, screens  # by the end every replica contributes
    # honest replicas stay well inside what AdamW can move them (the bound needs no quorum)
    bound = min(_bounds(honest))
    assert all(norm < bound for s in screens for norm, *_ in s.values()), (bound, screens)
    print("honest screen figures (norm per unit of learning rate, cosine to the round's median):", screens)
    # The server's own gradient is computed at each round's starting merge on the round's first
    # step (in threads, once both are there: with delayed application the merge comes later),
    # on 4 micro-batches of 64 tokens (within SCREEN_REF_TOKENS).
    text = "".join(p.read_text() for p in sorted((honest / "logs").glob("server*.log")))
    refs = [(int(s), int(t)) for s, t in re.findall(r"reference gradient: step (\d+), (\d+) tokens", text)]
    h = RUN["sync_every"]
    assert refs == [(s, 4 * 2 * 32) for s in range(0, RUN["steps"], h)], refs

    out = tmp_path / "poisoned"
    summary = launch(LaunchConfig(out=str(out), **RUN, faults=["poison:w1:scale=-20"]))
    assert summary["steps"] == RUN["steps"]
    bans = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "ban"]
    assert [b["device"] for b in bans] == ["w1"], bans
    # Banned at the first merge, with or without a quorum there: -20x is past what AdamW can
    # move a replica. Its pseudo-gradient is in no merge (below).
    assert bans[0]["step"] < RUN["sync_every"] and "pseudo-gradient" in bans[0]["why"], bans
    # the banned worker is told: by the coordinator's next heartbeat, or (a run that goes on
    # at once with delayed application may end before that heartbeat) by its server refusing
    # its next call as banned
    told = (out / "logs" / "worker1.log").read_text()
    assert "w1 is banned from the run" in told or "refused: banned from this run" in told, told[-2000:]
    # the banned replica's pseudo-gradient is in no merge
    text = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    merges = [json.loads(m.group(1)) for m in re.finditer(r"local merge (\{.*\})$", text, re.M)]
    assert merges and all(not any(mid.endswith("-w1") for mid in m["contributors"]) for m in merges)
    print(f"ban: {bans[0]}; final loss {summary['final_loss']:.4f}, honest {ref['final_loss']:.4f}")
    # The ban undoes the damage: the run keeps most of the honest run's loss drop. Two replicas
    # instead of three, and a schedule the box's load picks, move the final loss by a few per
    # cent (7.64 -> 6.37-6.59 over runs here and on CI); with the screen switched off the
    # -20x pseudo-gradient is merged and the loss ends above where it started (10.9).
    drop, honest_drop = summary["losses"][0] - summary["final_loss"], ref["losses"][0] - ref["final_loss"]
    assert drop >= 0.75 * honest_drop, (summary["losses"], ref["losses"],
                                        [m["contributors"] for m in merges])


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_colluders_that_are_most_of_a_round_are_judged_by_the_servers_gradient(tmp_path):
    """One stage, three workers, w1 and w2 sending flipped pseudo-gradients: in a round of
    all three they are its majority, so the round's coordinate-wise median is theirs and
    their cosines to it look honest. The server's own gradient still judges them: neither
    flipped pseudo-gradient is in any merge, at least one of them is banned, w0 never is."""
    from shoal.runtime.processes.launch import LaunchConfig, launch

    out = tmp_path / "colluding"
    summary = launch(LaunchConfig(out=str(out), **RUN, faults=["poison:w1:scale=-1", "poison:w2:scale=-1"]))
    assert summary["steps"] == RUN["steps"]
    bans = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "ban"]
    text = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    merges = [json.loads(m.group(1)) for m in re.finditer(r"local merge (\{.*\})$", text, re.M)]
    print("bans:", [(b["device"], b["step"], b["why"]) for b in bans])
    print("screens:", [m["screen"] for m in merges])
    # the case: a round in which all three contributed (the liars were its majority)
    assert any(len(m["screen"]) == 3 for m in merges), [m["screen"] for m in merges]
    assert {b["device"] for b in bans} <= {"w1", "w2"} and bans, bans
    assert merges and all(not any(mid.endswith(("-w1", "-w2")) for mid in m["contributors"]) for m in merges), [
        m["contributors"] for m in merges]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_scaled_sparse_replica_is_held_out_then_banned(tmp_path):
    """``sparse`` pushes carry what earlier rounds left, so below a quorum a norm flag against
    the stage's history holds a push out of the merge and bans its worker only at its
    strikes_to_ban-th flagged round in a row (guard.round_verdict): one stage, two workers,
    w1 honest in its first round, then sending its pseudo-gradients times 20. Each of its
    flagged rounds is held out of the merge, the third bans it; w0 is never banned."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.runtime.safety.guard import DEFAULT

    run = {**RUN, "workers": 2, "micro_batches": 4, "sync_every": 2, "steps": 12, "compression": "sparse"}
    out = tmp_path / "scaled"
    summary = launch(LaunchConfig(out=str(out), **run, faults=["poison:w1:scale=20:from=2"]))
    assert summary["steps"] == run["steps"]
    bans = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "ban"]
    assert [b["device"] for b in bans] == ["w1"], bans
    assert f"{DEFAULT.strikes_to_ban} rounds in a row" in bans[0]["why"], bans
    text = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    # (a merge's step is its round's last: the merge of step s makes version s + 1; w1 lies
    # in the rounds whose last step is 2 or later: those that make version 4 and later)
    holds = [int(s) for s in re.findall(r"holds \S+-w1's pseudo-gradient out of the merge of step (\d+): "
                                        r"pseudo-gradient norm", text)]
    assert len(holds) == DEFAULT.strikes_to_ban - 1 and all(s + 1 >= 4 for s in holds), (holds, bans)
    assert bans[0]["step"] > max(holds), (holds, bans)
    # no poisoned pseudo-gradient is in a merge: w1 contributes only to the round before
    merges = [json.loads(m.group(1)) for m in re.finditer(r"local merge (\{.*\})$", text, re.M)]
    late = [m for m in merges if m["version"] >= 4]
    assert late and all(not any(mid.endswith("-w1") for mid in m["contributors"]) for m in late), [
        (m["version"], m["contributors"]) for m in merges]
    assert summary["final_loss"] < summary["losses"][0], summary["losses"]
