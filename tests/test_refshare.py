"""The screen's reference gradient shared by a host's stage servers of one layer range
(``shoal.runtime.safety.refshare``): real processes meet in a folder; one computes, the others
read its file; a claimer killed with -9 costs a wait, never the round."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shoal.runtime.safety.refshare import ReferenceShare, claim_alive, reference_stem, superseded

# One server's end, in a process of its own: waits for GO (if given), gets the reference of
# STEM (its compute sleeps SLEEP s, or forever with SLEEP < 0) and prints how, and its sum.
CHILD = r"""
import asyncio, json, os, sys, time
import torch
from shoal.runtime.safety.refshare import ReferenceShare
folder, stem, sleep, go = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
while go and not os.path.exists(go):
    time.sleep(0.01)
like = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
async def compute():
    open(os.path.join(folder, f"computing-{os.getpid()}"), "w").close()
    if sleep < 0:
        while True:
            await asyncio.sleep(1)
    await asyncio.sleep(sleep)
    g = torch.Generator().manual_seed(os.getpid())
    return {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}, {"server": str(os.getpid())}
ref, meta, how = asyncio.run(ReferenceShare(folder).get(stem, like, compute))
print(json.dumps({"how": how, "sum": float(sum(t.double().sum() for t in ref.values())), "by": meta.get("server")}))
"""


def _child(folder: Path, stem: str, sleep: float, go: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(folder), stem, str(sleep), str(go or "")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_reference_stem_names_the_weights():
    a = reference_stem(0, 4, 0, 6, "ab" * 32)
    assert a == "ref-e0-v4-l0-6-" + "ab" * 8
    assert len({a, reference_stem(1, 4, 0, 6, "ab" * 32), reference_stem(0, 5, 0, 6, "ab" * 32),
                reference_stem(0, 4, 0, 3, "ab" * 32), reference_stem(0, 4, 0, 6, "cd" * 32)}) == 5


@pytest.mark.timeout(120)
def test_three_servers_compute_one_reference_between_them(tmp_path):
    """Three processes ask for the same round at once: one computes, two read its file, all
    three hold the same tensors; the claim is gone afterwards and the file stays for late peers."""
    go = tmp_path / "go"
    procs = [_child(tmp_path, "ref-x", 0.5, go) for _ in range(3)]
    time.sleep(0.5)
    go.touch()
    res = [_result(p) for p in procs]
    assert sorted(r["how"] for r in res) == ["computed", "shared", "shared"]
    assert len({r["sum"] for r in res}) == 1 and len({r["by"] for r in res}) == 1
    assert len(list(tmp_path.glob("computing-*"))) == 1
    assert not (tmp_path / "ref-x.claim").exists() and (tmp_path / "ref-x.safetensors").exists()
    # a late server of the same round reads the file without computing
    assert _result(_child(tmp_path, "ref-x", 0.5))["how"] == "shared"
    assert len(list(tmp_path.glob("computing-*"))) == 1


@pytest.mark.timeout(120)
def test_a_claimer_killed_with_9_costs_a_wait_not_the_round(tmp_path):
    """The claimer's compute never ends; once it has claimed the round a second server waits on
    it; kill -9 of the claimer: the waiter sees its process gone, claims the round and computes."""
    a = _child(tmp_path, "ref-k", -1)
    claim = tmp_path / "ref-k.claim"
    deadline = time.monotonic() + 30
    while not list(tmp_path.glob("computing-*")):  # the state: A claimed and is computing
        assert a.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    assert claim.read_text().split()[0] == str(a.pid) and claim_alive(claim)
    b = _child(tmp_path, "ref-k", 0.1)
    time.sleep(1.0)
    assert b.poll() is None  # B waits on A's claim
    os.kill(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    got = _result(b)
    assert got["how"] == "computed" and got["by"] == str(b.pid)
    assert len(list(tmp_path.glob("computing-*"))) == 2


def test_a_file_that_does_not_fit_the_stage_is_not_used(tmp_path):
    """A shared file with another stage's shapes (or names) is left aside: the server computes its own."""
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2, 2), "b": torch.ones(5)}, str(tmp_path / "ref-y.safetensors"))
    save_file({"z": torch.ones(3, 4), "b": torch.ones(5)}, str(tmp_path / "ref-w.safetensors"))
    like = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    calls = []

    async def compute():
        calls.append(1)
        return {"a": torch.full((3, 4), 2.0), "b": torch.full((5,), 2.0)}, {}

    for stem in ("ref-y", "ref-w"):
        ref, _, how = asyncio.run(ReferenceShare(tmp_path).get(stem, like, compute))
        assert how == "own" and float(ref["a"][0, 0]) == 2.0
    assert len(calls) == 2


def test_superseded_rounds_by_hand():
    names = ["ref-e0-v2-l0-6-ab.safetensors", "ref-e0-v4-l0-6-cd.safetensors", "ref-e1-v2-l0-6-ab.safetensors",
             "ref-e0-v2-l0-3-ab.safetensors", "ref-e0-v2-l0-6-ab.claim", "other.safetensors"]
    assert superseded(names, "ref-e0-v4-l0-6-cd") == ["ref-e0-v2-l0-6-ab.safetensors"]
    assert superseded(names, "ref-e1-v4-l0-6-cd") == names[:3]
    assert superseded(names, "ref-e0-v4-l0-3-ee") == ["ref-e0-v2-l0-3-ab.safetensors"]
    assert superseded(names, "not-a-stem") == []


def test_a_server_removes_what_it_wrote_and_what_its_round_supersedes(tmp_path):
    """Each round's file replaces earlier rounds' of its layer range, a dead peer's too (other
    layer ranges stay); close removes the last one this server wrote."""
    folder = tmp_path / "r"
    folder.mkdir()
    dead = folder / "ref-e0-v1-l0-6-ee.safetensors"  # left by a server killed after writing it
    other = folder / "ref-e0-v1-l0-3-ee.safetensors"
    dead.write_bytes(b"x")
    other.write_bytes(b"x")
    share = ReferenceShare(folder)
    like = {"a": torch.zeros(2)}

    async def compute():
        return {"a": torch.ones(2)}, {}

    for v in (2, 4):
        assert asyncio.run(share.get(reference_stem(0, v, 0, 6, "ab" * 32), like, compute))[2] == "computed"
    assert sorted(p.name for p in folder.iterdir()) == [other.name, reference_stem(0, 4, 0, 6, "ab" * 32)
                                                        + ".safetensors"]
    share.close()
    assert [p.name for p in folder.iterdir()] == [other.name]


def test_a_claim_of_another_host_is_waited_on_for_a_while_only(tmp_path):
    """A claim that names another host (a --ckpt-dir on a network folder) cannot be checked
    for life: the server waits on it for foreign_wait_s, then computes its own."""
    (tmp_path / "ref-f.claim").write_text("1 some-other-host")
    assert claim_alive(tmp_path / "ref-f.claim")
    like = {"a": torch.zeros(2)}

    async def compute():
        return {"a": torch.ones(2)}, {}

    t0 = time.monotonic()
    ref, _, how = asyncio.run(ReferenceShare(tmp_path, foreign_wait_s=0.3).get("ref-f", like, compute))
    assert how == "own" and time.monotonic() - t0 >= 0.3 and torch.equal(ref["a"], torch.ones(2))
    # a claim file that is not whole (not this code's: its claims appear whole) is alive while there
    (tmp_path / "ref-h.claim").write_text("")
    assert claim_alive(tmp_path / "ref-h.claim")
    assert not claim_alive(tmp_path / "ref-none.claim")
    # a claim of this host whose process is gone is claimed over at once
    (tmp_path / "ref-g.claim").write_text(f"999999999 {socket.gethostname()}")
    assert not claim_alive(tmp_path / "ref-g.claim")
    assert asyncio.run(ReferenceShare(tmp_path).get("ref-g", like, compute))[2] == "computed"
