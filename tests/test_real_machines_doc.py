"""docs/real-machines.md runs as written: its commands, in order, on three hosts made of
network namespaces with the guide's addresses (A 10.77.0.1: coordinator + server, B
10.77.0.2: server, C 10.77.0.3: workers), each host in a folder of its own.

The guide marks its blocks: ``<!-- run: HOST -->`` (run to completion), ``<!-- run: HOST
background -->`` (a long-running role), ``<!-- run: HOST when-training -->`` (once a step is
committed), ``<!-- copy: PATHS to HOSTS -->`` (the user's copy between machines; the test
copies the folders itself) and ``<!-- check: HOST -->`` (after the run). The only change to
the commands is ``--steps 200`` -> ``--steps 12`` (enough steps left after the first for
``shoal status`` to reach the running coordinator). Host C never gets the data. Needs root
(``ip netns``); skipped, loudly, without.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.netns import Hosts, netns_available

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "real-machines.md"
HOSTS = {"A": "10.77.0.1", "B": "10.77.0.2", "C": "10.77.0.3"}
SHORTER = ("--steps 200", "--steps 12")  # the run the guide starts, cut to twelve steps
MARK = re.compile(r"<!-- (run|copy|check): ([^>]*?) -->\n```[a-z]*\n(.*?)```", re.S)


def guide_steps(text: str) -> list[tuple[str, str, str]]:
    """(kind, argument, block) of every marked block of the guide, in order."""
    return [(kind, arg.strip(), block) for kind, arg, block in MARK.findall(text)]


def test_the_guide_marks_every_command_block():
    """Every command block of the walk-through (before the Notes) is marked, so the test
    below runs all of them; the setup block (pip install) is the only exception."""
    text = GUIDE.read_text()
    walk = text[:text.index("## Notes")]
    blocks = re.findall(r"```[a-z]*\n(.*?)```", walk, re.S)
    marked = [b for _, _, b in guide_steps(walk)]
    unmarked = [b for b in blocks if b not in marked]
    assert len(unmarked) == 1 and "pip install" in unmarked[0], unmarked
    kinds = [(k, a.split()[0]) for k, a, _ in guide_steps(walk)]
    assert ("run", "A") in kinds and ("run", "B") in kinds and ("run", "C") in kinds
    assert sum(SHORTER[0] in b for _, _, b in guide_steps(walk)) == 1


def _corpus(folder: Path) -> None:
    """The user's own text for `shoal data prepare my-corpus/`."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(5)
    words = ["the", "swarm", "trains", "a", "model", "on", "home", "machines", "over", "links", "slow", "fast"]
    for i in range(3):
        (folder / f"part{i}.txt").write_text(
            "".join(" ".join(words[j] for j in rng.integers(0, len(words), 12)) + ".\n" for _ in range(1500)))


def _shoal_on_path(bin_dir: Path) -> None:
    """A ``shoal`` command as `pip install -e .` makes one, running this checkout."""
    bin_dir.mkdir()
    exe = bin_dir / "shoal"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -m shoal.cli \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.mark.timeout(900)
def test_real_machines_guide_runs_as_written(tmp_path):
    why = netns_available()
    if why:
        pytest.skip(f"NO NETWORK NAMESPACES HERE ({why}): the real-machines guide was not run")
    steps = guide_steps(GUIDE.read_text())
    home = {h: tmp_path / h for h in HOSTS}
    for d in home.values():
        d.mkdir()
    _corpus(home["A"] / "my-corpus")
    bin_dir = tmp_path / "bin"
    _shoal_on_path(bin_dir)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    for k in ("SHOAL_TOKEN", "SHOAL_TLS_DIR"):
        env.pop(k, None)  # the guide passes --token-file and --tls-dir itself
    links = [("A", "B", None), ("A", "C", None), ("B", "C", None)]
    roles: list[tuple[str, subprocess.Popen]] = []

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()[-3000:] if (tmp_path / f"{name}.log").exists() else ""

    with Hosts(HOSTS, links) as net:
        for i, (kind, arg, block) in enumerate(steps):
            host, *opts = arg.split()
            if kind == "copy":
                paths, targets = arg.split(" to ")
                for target in targets.split():
                    for name in paths.split():
                        src, dst = home["A"] / name, home[target] / name
                        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
                continue
            cmd = block.replace(*SHORTER)
            if kind == "check":
                continue  # after the run
            if "background" in opts:
                p = net.popen(host, ["bash", "-c", cmd], tmp_path / f"step{i}-{host}.log", cwd=home[host], env=env)
                roles.append((f"step{i}-{host}", p))
                continue
            if "when-training" in opts:
                metrics = home["A"] / "runs" / "multi" / "metrics.jsonl"
                deadline = time.time() + 600
                while not (metrics.exists() and metrics.read_text().strip()):
                    assert time.time() < deadline, {n: log(n) for n, _ in roles}
                    assert roles[0][1].poll() is None, log(roles[0][0])
                    time.sleep(0.5)
                listening = net.run("C", ["ss", "-ltnH"], timeout=30).stdout.strip()
                assert not listening, f"something listens on the worker host: {listening}"
            res = net.run(host, ["bash", "-e", "-c", cmd], timeout=600, cwd=home[host], env=env)
            assert res.returncode == 0, (cmd, res.stdout[-2000:], res.stderr[-2000:])
            if "when-training" in opts:
                assert "training" in res.stdout or "done" in res.stdout, res.stdout
        name, coordinator = roles[0]  # the first role the guide starts: the coordinator on A
        try:
            coordinator.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the guide's run did not finish: {log(name)}")
        assert coordinator.returncode == 0, log(name)
        for n, p in roles[1:]:  # servers and workers exit once the run is done
            p.wait(timeout=120)
            assert p.returncode == 0, (n, log(n))
        for kind, arg, block in steps:
            if kind == "check":
                res = net.run(arg, ["bash", "-e", "-c", block], timeout=60, cwd=home[arg], env=env)
                assert res.returncode == 0, (block, res.stderr)
    out = home["A"] / "runs" / "multi"
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == list(range(12))
    assert not (home["C"] / "data").exists()  # the workers' host never held the data
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    names = {e["device"] for e in events if e["event"] == "join"}
    assert names == {"server-a", "server-b", "w0", "w1"}, names  # --name on every member: no renames
    measured = {e["device"]: e for e in events if e["event"] == "measured"}
    assert set(measured["w0"]["links"]) == {"coordinator", "server-a", "server-b"}
