"""The runtime on a prepared data folder and from a Hugging Face model, as real processes:
``shoal launch --data DIR`` equals ``shoal train --local --data DIR`` step by step, its
export holds the final weights, raw text is prepared into the run folder, and
``--init-from`` starts every stage from the exported weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from shoal.data.prepare import PrepareConfig, prepare
from shoal.hf.convert import load_hf_dir
from shoal.runtime.roles.artifacts import load_final_weights
from shoal.train.local import TrainConfig, train_local
from shoal.train.metrics import read_jsonl
from tests.helpers.members import run_cli

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
    """Raw text is prepared into RUN/data; every stage server starts from the HF weights."""
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
