"""The runtime on a prepared data folder and from a Hugging Face model, as real processes:
``shoal launch --data DIR`` equals ``shoal train --local --data DIR`` step by step, its
export holds the final weights, raw text is prepared into the run folder, and
``--init-from`` starts every stage from the exported weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from shoal.data.prepare import PrepareConfig, prepare
from shoal.hf.convert import load_hf_dir
from shoal.runtime.roles.artifacts import load_final_weights
from shoal.train.local import TrainConfig, train_local
from shoal.train.metrics import read_jsonl
from tests.helpers.members import member_env, run_cli, start_member

pytestmark = pytest.mark.integration

RUN = dict(model="tiny", steps=3, micro_batches=2, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=1)
TOL = 1e-5


def _text(path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = ["stage", "server", "worker", "lease", "task", "pool", "relay", "gradient", "step", "swarm"]
    path.write_text("".join(" ".join(words[i] for i in rng.integers(0, 10, 11)) + ".\n" for _ in range(3000)))


def _launch(out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "shoal.runtime.processes.cli", "launch", "--stages", "2", "--workers", "2", "--out", str(out),
           "--dead-after", "3", "--min-lease", "1.5", "--timeout", "500", *extra]
    for k, v in RUN.items():
        if k == "model" and "--init-from" in extra:
            continue
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = run_cli(cmd[3:], dict(os.environ, OMP_NUM_THREADS="1"), timeout=560, module="shoal.runtime.processes.cli")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


@pytest.mark.timeout(600)
def test_launch_on_prepared_data_equals_local_and_exports(tmp_path):
    _text(tmp_path / "t.txt", 0)
    data = tmp_path / "data"
    prepare(PrepareConfig(inputs=(str(tmp_path / "t.txt"),), out=str(data), vocab_size=500, quiet=True))
    local = train_local(TrainConfig(**RUN, data=(str(data),), out=str(tmp_path / "local"), eval_every=0,
                                    eval_batches=1), quiet=True)
    out = tmp_path / "run"
    _launch(out, "--data", str(data))
    recs = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r, ref in zip(recs, local.records, strict=True):
        assert abs(r["loss"] - ref["loss"]) <= TOL, (r["loss"], ref["loss"])
    weights = load_final_weights(out)
    ref_w = local.model.state_dict()
    assert max(float((weights[k] - ref_w[k]).abs().max()) for k in ref_w) <= TOL
    # The run folder names the data and carries its tokenizer.
    assert json.loads((out / "config.json").read_text())["config"]["data"] == [str(data.resolve())]
    assert (out / "tokenizer.json").read_text() == (data / "tokenizer.json").read_text()
    # Export of the distributed run: its newest committed step, the final weights.
    from shoal.cli import main

    assert main(["export", str(out), "--out", str(tmp_path / "hf")]) == 0
    _, exported = load_hf_dir(tmp_path / "hf")
    assert all(torch.equal(exported[k], weights[k]) for k in weights)


@pytest.mark.timeout(600)
def test_launch_raw_text_and_init_from(tmp_path):
    """Raw text is prepared into RUN/data; every stage server starts from the HF weights; the
    coordinator plans the folder's model (not an even split for want of a preset's name)."""
    from shoal.hf.convert import write_hf_dir
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_model

    _text(tmp_path / "t.txt", 1)
    cfg = get_preset("tiny")
    start = build_model(cfg, seed=11)  # weights no seed-0 run would have
    write_hf_dir(tmp_path / "hf", start.state_dict(), cfg)
    out = tmp_path / "run"
    _launch(out, "--data", str(tmp_path / "t.txt"), "--init-from", str(tmp_path / "hf"))
    assert (out / "data" / "manifest.json").exists()
    local = train_local(TrainConfig(**{**RUN, "model": "tiny"}, data=(str(out / "data"),), init_from=str(tmp_path / "hf"),
                                    out=str(tmp_path / "local"), eval_every=0, eval_batches=1), quiet=True)
    recs = read_jsonl(out / "metrics.jsonl")
    for r, ref in zip(recs, local.records, strict=True):
        assert abs(r["loss"] - ref["loss"]) <= TOL, (r["loss"], ref["loss"])
    plans = [e for e in read_jsonl(out / "journal.jsonl") if e.get("kind") == "plan"]
    assert plans and plans[0]["method"] == "shoal", plans
    planned = json.loads((out / "scenario.json").read_text())["workload"]
    assert planned["config"]["d_model"] == cfg.d_model and planned["config"]["n_layers"] == cfg.n_layers


def _start_coordinator(tmp_path, data, env, start):
    """A coordinator on loopback training RUN on ``data``; returns (process, join address)."""
    run = [f"--{k.replace('_', '-')}={v}" for k, v in RUN.items()]
    addr_file = tmp_path / "coord.address"
    coord = start(["coordinator", "--insecure", "--listen", "127.0.0.1:0", "--stages", "2", "--min-workers", "2",
                   "--dead-after", "3.0", "--min-lease", "1.5", "--data", str(data), "--out", str(tmp_path / "run"),
                   "--address-file", str(addr_file), *run], "coordinator")
    deadline = time.time() + 150
    while not addr_file.exists():
        assert coord.poll() is None and time.time() < deadline, (tmp_path / "coordinator.log").read_text()[-3000:]
        time.sleep(0.1)
    return coord, addr_file.read_text().strip()


@pytest.mark.timeout(600)
def test_workers_without_data_train_bitwise_as_local(tmp_path):
    """Stage servers own the data: each holds its own copy (at its own path), the
    coordinator's folder is moved away once it started, and the workers run in an empty
    folder with an empty HOME, so no worker can read any token from disk. The run still
    equals ``shoal train --local`` bit for bit (tasks carry their tokens)."""
    _text(tmp_path / "t.txt", 2)
    data = tmp_path / "coord" / "data"
    prepare(PrepareConfig(inputs=(str(tmp_path / "t.txt"),), out=str(data), vocab_size=500, quiet=True))
    copies = [tmp_path / f"host{i}" / "prepared" for i in range(2)]
    for c in copies:
        shutil.copytree(data, c)
    local = train_local(TrainConfig(**RUN, data=(str(data),), out=str(tmp_path / "local"), eval_every=0,
                                    eval_batches=1), quiet=True)
    env = member_env(SHOAL_TOKEN="data-test-token")
    procs = []

    def start(args, name, env=env):
        p = start_member(args, tmp_path / f"{name}.log", env)
        procs.append(p)
        return p

    try:
        coord, join = _start_coordinator(tmp_path, data, env, start)
        data.rename(tmp_path / "coord" / "away")  # from here on, only the servers' copies exist
        for i in range(2):
            start(["server", "--insecure", "--join", join, "--ckpt-dir", str(tmp_path / f"ckpt{i}"),
                   "--name", f"s{i}", "--data", str(copies[i])], f"server{i}")
        bare = tmp_path / "bare"
        bare.mkdir()
        # Forked from a fresh interpreter in an empty folder with an empty HOME (no token cache).
        wenv = dict(env, HOME=str(bare), SHOAL_FORK_SERVER="0", XDG_CACHE_HOME=str(bare))
        for i in range(2):
            with open(tmp_path / f"worker{i}.log", "w") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "shoal.runtime.processes.cli", "worker",
                                               "--insecure", "--join", join, "--name", f"w{i}", "--flops", "1e9"],
                                              cwd=bare, env=wenv, stdout=log, stderr=subprocess.STDOUT))
        coord.wait(timeout=400)
        assert coord.returncode == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = tmp_path / "run"
    recs = read_jsonl(out / "metrics.jsonl")
    assert [r["loss"] for r in recs] == [r["loss"] for r in local.records]
    weights = load_final_weights(out)
    ref_w = local.model.state_dict()
    assert not [k for k in ref_w if not torch.equal(weights[k], ref_w[k])]
    # The run's final state stays viewable: a static dashboard page in the run folder.
    page = (out / "dashboard.html").read_text()
    state = json.loads(page.split("window.SHOAL_STATE = ", 1)[1].split(";\n", 1)[0])
    assert state["run"]["done"] and state["run"]["committed"] == RUN["steps"]
    assert json.loads((out / "summary.json").read_text())["dashboard"] == "dashboard.html"


@pytest.mark.timeout(300)
def test_server_with_other_data_is_refused_in_one_line(tmp_path):
    """A stage server whose --data is not the run's prepared data (another manifest hash),
    or that has none, is refused at Join with one line that says what to do."""
    _text(tmp_path / "t.txt", 3)
    _text(tmp_path / "u.txt", 4)
    data, other = tmp_path / "data", tmp_path / "other"
    prepare(PrepareConfig(inputs=(str(tmp_path / "t.txt"),), out=str(data), vocab_size=500, quiet=True))
    prepare(PrepareConfig(inputs=(str(tmp_path / "u.txt"),), out=str(other), vocab_size=500, quiet=True))
    env = member_env(SHOAL_TOKEN="data-test-token")
    procs = []

    def start(args, name, env=env):
        p = start_member(args, tmp_path / f"{name}.log", env)
        procs.append(p)
        return p

    try:
        _, join = _start_coordinator(tmp_path, data, env, start)
        runs = {}
        for name, extra in (("other", ["--data", str(other)]), ("none", [])):
            runs[name] = run_cli(["server", "--insecure", "--join", join, "--ckpt-dir", str(tmp_path / "ckpt"),
                                  "--name", name, *extra], env, timeout=120, module="shoal.runtime.processes.cli")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for name, proc in runs.items():
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (name, proc.returncode, proc.stderr[-2000:])
        assert lines[0].startswith("error: the coordinator at") and "--data DIR" in lines[0], lines
    assert "is not the run's prepared data" in runs["other"].stderr
    assert "start the server with --data DIR" in runs["none"].stderr
    events = read_jsonl(next((tmp_path / "run").rglob("events.jsonl")))
    assert [e["device"] for e in events if e["event"] == "refused"] == ["other", "none"]
