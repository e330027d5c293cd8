"""Reference trainer: learning, exact resume, checkpoints, generate, CLI errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shoal.errors import ShoalError
from shoal.model.config import get_preset
from shoal.model.transformer import build_stage
from shoal.train.checkpoint import (
    load_checkpoint,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    save_checkpoint,
)
from shoal.train.generate import generate_text
from shoal.train.local import TrainConfig, evaluate, resume_config, train_local, val_micro_batches
from shoal.train.metrics import read_jsonl
from shoal.train.optim import OptimConfig, apply_update, make_optimizer
from tests.helpers.members import run_cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SHOAL_TORCH_THREADS": "1"}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    # Same folder as tests/test_data.py uses: the corpus is tokenized once per session.
    d = tmp_path_factory.getbasetemp() / "shoal-cache"
    d.mkdir(exist_ok=True)
    return str(d)


def _cfg(tmp_path: Path, cache_dir: str, **kw) -> TrainConfig:
    base = dict(model="tiny", steps=6, micro_batches=2, micro_batch_size=2, seq_len=32, eval_every=3,
                eval_batches=2, cache_dir=cache_dir, out=str(tmp_path / "run"), warmup=2)
    base.update(kw)
    return TrainConfig(**base)


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    # Forked from the session's warm process (tests/helpers/members.py): no torch import per command.
    return run_cli(list(args), ENV, timeout)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("short")
    cfg = _cfg(out, cache_dir)
    return cfg, train_local(cfg, quiet=True)


def test_records_and_run_folder(short_run):
    cfg, res = short_run
    out = Path(cfg.out)
    recs = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(cfg.steps))
    assert recs == res.records
    for r in recs:
        assert r["tokens"] == cfg.micro_batches * cfg.micro_batch_size * cfg.seq_len
        assert r["grad_norm"] > 0 and r["lr"] > 0
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 5]
    for name in ("tokenizer.json", "config.json", "checkpoint/model.safetensors",
                 "checkpoint/optimizer.safetensors", "checkpoint/state.json"):
        assert (out / name).is_file(), name
    state = json.loads((out / "checkpoint/state.json").read_text())
    assert state["step"] == cfg.steps and len(state["metrics"]) == cfg.steps
    assert TrainConfig.from_dict(state["config"]) == cfg
    weights = load_file(str(out / "checkpoint/model.safetensors"))
    for name, p in res.model.named_parameters():
        assert torch.equal(weights[name], p.detach())


def test_loss_is_mean_of_micro_batches_and_val_is_fixed(short_run, cache_dir):
    cfg, res = short_run
    from shoal.data import load_data

    data = load_data(cfg.data_config(), 2048)
    batches = val_micro_batches(data, cfg.seed, cfg.eval_batches, cfg.micro_batch_size, cfg.seq_len)
    assert abs(evaluate(res.model, batches) - res.records[-1]["val_loss"]) < 1e-6
    # Step 0's logged loss = mean loss of its micro-batches under the initial weights.
    from shoal.data import get_micro_batch

    model = build_stage(get_preset("tiny"), 0, 6, cfg.seed)
    with torch.no_grad():
        losses = [float(model(*get_micro_batch(data, "train", cfg.seed, 0, mb, 2, 32))) for mb in range(2)]
    assert abs(sum(losses) / 2 - res.records[0]["loss"]) < 1e-5


def test_existing_run_needs_resume(short_run):
    cfg, _ = short_run
    with pytest.raises(ShoalError, match="already holds a run"):
        train_local(cfg, quiet=True)


def test_generate_is_seeded(short_run):
    cfg, _ = short_run
    a = generate_text(cfg.out, "ROMEO:", tokens=12, temperature=1.0, seed=1)
    b = generate_text(cfg.out, "ROMEO:", tokens=12, temperature=1.0, seed=1)
    assert a == b and a.startswith("ROMEO:") and len(a) > len("ROMEO:")
    greedy = generate_text(cfg.out, "ROMEO:", tokens=5, temperature=0.0, top_k=0)
    assert greedy == generate_text(cfg.out, "ROMEO:", tokens=5, temperature=0.0, seed=9)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_loss_falls_on_default_corpus(tmp_path, cache_dir):
    cfg = _cfg(tmp_path, cache_dir, steps=40, micro_batch_size=8, seq_len=64, eval_every=0,
               eval_batches=4, warmup=5)
    recs = train_local(cfg, quiet=True).records
    first = recs[0]["loss"]
    last = sum(r["loss"] for r in recs[-5:]) / 5
    assert first > 7.0  # about ln(2048) = 7.62 at initialisation
    assert last < first - 1.0, (first, last)
    assert recs[-1]["val_loss"] < first - 1.0


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_resume_in_new_processes_is_exact(tmp_path, cache_dir):
    # Both sides run as a user runs them (`shoal train --local` in a process of its own): the
    # uninterrupted run, and one stopped after step n and resumed in a new process. On a
    # difference the message gives both runs' per-step loss and gradient norm, so it names
    # the first step that differs.
    n = 3
    common = ["train", "--local", "--model", "tiny", "--steps", str(2 * n), "--micro-batches", "2",
              "--micro-batch-size", "2", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "2",
              "--warmup", "2", "--cache-dir", cache_dir, "--quiet"]
    ref, out = tmp_path / "a" / "run", tmp_path / "b" / "run"
    full = _cli(*common, "--out", str(ref))
    assert full.returncode == 0, full.stderr
    first = _cli(*common, "--out", str(out), "--stop-after", str(n))
    assert first.returncode == 0, first.stderr
    assert load_checkpoint(out / "checkpoint").state["step"] == n
    second = _cli("train", "--local", "--resume", str(out), "--quiet")
    assert second.returncode == 0, second.stderr
    want, got = read_jsonl(ref / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    table = [(r["step"], r["loss"], q["loss"], r["grad_norm"], q["grad_norm"]) for r, q in zip(want, got, strict=False)]
    assert [r["step"] for r in got] == list(range(2 * n))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want], table
    expect = load_file(str(ref / "checkpoint/model.safetensors"))
    weights = load_file(str(out / "checkpoint/model.safetensors"))
    assert expect.keys() == weights.keys()
    assert [k for k in expect if not torch.equal(expect[k], weights[k])] == [], table


def test_resume_config_rejects_changed_math(short_run):
    cfg, _ = short_run
    with pytest.raises(ShoalError, match="cannot be changed"):
        resume_config(cfg.out, lr=1.0)
    with pytest.raises(ShoalError, match="fewer than"):
        resume_config(cfg.out, steps=2)
    assert resume_config(cfg.out, steps=10).steps == 10


def _stepped_model():
    cfg = get_preset("tiny")
    model = build_stage(cfg, 0, 3, seed=1)
    opt = make_optimizer(model.named_parameters(), OptimConfig())
    x = torch.randint(0, cfg.vocab_size, (2, 8))
    for _ in range(2):
        model(x).pow(2).mean().backward()
        apply_update(opt, 1e-3, 1.0)
    return model, opt


def test_checkpoint_round_trip_is_exact(tmp_path):
    model, opt = _stepped_model()
    named = list(model.named_parameters())
    save_checkpoint(tmp_path / "ck", model.state_dict(), optimizer_state_by_name(opt, named), {"step": 2})
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.state == {"step": 2}
    fresh = build_stage(get_preset("tiny"), 0, 3, seed=5)
    fresh.load_state_dict(ck.model_state)
    opt2 = make_optimizer(fresh.named_parameters(), OptimConfig())
    load_optimizer_state_by_name(opt2, fresh.named_parameters(), ck.optimizer_state)
    # One more identical update on both gives identical weights.
    x = torch.randint(0, 2048, (2, 8), generator=torch.Generator().manual_seed(1))
    for m, o in ((model, opt), (fresh, opt2)):
        m(x).pow(2).mean().backward()
        apply_update(o, 1e-3, 0.5)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_checkpoint_writes_tied_and_strided_tensors_and_copies_only_those(tmp_path):
    from shoal.train.checkpoint import _plain

    w = torch.randn(6, 4)
    tensors = {"a": w, "tied": w, "half": w[:3], "t": w.t(), "b": torch.randn(5), "empty": torch.empty(0)}
    plain = _plain(tensors)
    assert plain["a"].data_ptr() == w.data_ptr() and plain["b"].data_ptr() == tensors["b"].data_ptr()
    for k in ("tied", "half", "t"):  # the second name of a storage, and a transposed view: copies
        assert plain[k].data_ptr() != w.data_ptr() and plain[k].is_contiguous()
    save_checkpoint(tmp_path / "ck", tensors, {}, {"step": 0})
    back = load_checkpoint(tmp_path / "ck").model_state
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(back[k], v), k


def test_checkpoint_replace_and_recover(tmp_path):
    model, opt = _stepped_model()
    sd, os_ = model.state_dict(), optimizer_state_by_name(opt, model.named_parameters())
    save_checkpoint(tmp_path / "ck", sd, os_, {"step": 1})
    save_checkpoint(tmp_path / "ck", sd, os_, {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert load_checkpoint(tmp_path / "ck").state["step"] == 2
    # A crash after the old folder was moved aside and before the new one was renamed in.
    os.replace(tmp_path / "ck", tmp_path / ".ck.old-x")
    assert load_checkpoint(tmp_path / "ck").state["step"] == 2
    with pytest.raises(ShoalError, match="no checkpoint"):
        load_checkpoint(tmp_path / "elsewhere")


def test_stage_checkpoints_together_form_the_full_model(tmp_path):
    cfg = get_preset("tiny")
    full = build_stage(cfg, 0, 6, seed=2).state_dict()
    parts = {}
    for first, last in ((0, 2), (2, 6)):
        stage = build_stage(cfg, first, last, seed=2)
        save_checkpoint(tmp_path / f"s{first}", stage.state_dict(), {}, {"step": 0})
        parts.update(load_checkpoint(tmp_path / f"s{first}").model_state)
    assert parts.keys() == full.keys()
    assert all(torch.equal(parts[k], full[k]) for k in full)


@pytest.mark.parametrize("field, value, message", [
    ("micro_batch_size", 0, "--micro-batch-size must be positive"),
    ("micro_batches", -1, "--micro-batches must be positive"),
    ("steps", 0, "--steps must be positive"),
    ("seq_len", 10_000, "exceeds"),
    ("model", "gpt-9", "unknown model preset"),
    ("stop_after", 99, "--stop-after"),
    ("val_fraction", 1.5, "--val-fraction"),
    ("lr", -1.0, "--lr"),
])
def test_config_validation(tmp_path, field, value, message):
    with pytest.raises(ShoalError, match=message):
        replace(_cfg(tmp_path, str(tmp_path)), **{field: value}).validate()


def _small_text(tmp_path: Path) -> Path:
    p = tmp_path / "small.txt"
    p.write_text("".join(f"line {i} of a very small corpus\n" for i in range(60)))
    return p


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["missing", "empty", "seq_too_long", "preset", "batch", "generate"])
def test_cli_bad_input_is_one_line_error(tmp_path, case):
    base = ["train", "--local", "--steps", "2", "--cache-dir", str(tmp_path / "c"), "--out", str(tmp_path / "r")]
    if case == "missing":
        args, expect = base + ["--data", str(tmp_path / "nope.txt")], "does not exist"
    elif case == "empty":
        (tmp_path / "empty.txt").write_text("")
        args, expect = base + ["--data", str(tmp_path / "empty.txt")], "empty"
    elif case == "seq_too_long":
        args, expect = base + ["--data", str(_small_text(tmp_path)), "--seq-len", "200"], "too long"
    elif case == "preset":
        args, expect = base + ["--model", "nonesuch"], "unknown model preset"
    elif case == "batch":
        args, expect = base + ["--micro-batch-size", "0"], "must be positive"
    else:
        args, expect = ["generate", "--from", str(tmp_path / "norun"), "--prompt", "x"], "does not exist"
    res = _cli(*args)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], res.stderr


def test_resume_refuses_changed_corpus(tmp_path):
    text = _small_text(tmp_path)
    cfg = _cfg(tmp_path, str(tmp_path / "c"), data=(str(text),), steps=2, stop_after=1, seq_len=8,
               micro_batch_size=1, micro_batches=1, eval_batches=1)
    train_local(cfg, quiet=True)
    text.write_text(text.read_text() + "a new line\n")
    with pytest.raises(ShoalError, match="training text changed"):
        train_local(resume_config(cfg.out), resume=True, quiet=True)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sigint_finishes_the_step_checkpoints_and_resumes(tmp_path, cache_dir):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "shoal.cli", "train", "--local", "--steps", "100000", "--micro-batches", "1",
            "--micro-batch-size", "1", "--seq-len", "8", "--eval-every", "0", "--eval-batches", "1",
            "--log-every", "1", "--cache-dir", cache_dir, "--out", str(out)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted after step" in stdout
    done = load_checkpoint(out / "checkpoint").state["step"]
    assert 3 <= done < 100000
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(done))
    res = _cli("train", "--local", "--resume", str(out), "--stop-after", str(done + 2), "--quiet")
    assert res.returncode == 0, res.stderr
    assert load_checkpoint(out / "checkpoint").state["step"] == done + 2
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(done + 2))


def test_cli_needs_local_and_fixed_flags_on_resume(short_run, capsys):
    from shoal.cli import main

    assert main(["train", "--steps", "2"]) == 2
    assert "--local" in capsys.readouterr().err
    cfg, _ = short_run
    assert main(["train", "--local", "--resume", cfg.out, "--lr", "0.1"]) == 2
    assert "--lr cannot be changed when resuming" in capsys.readouterr().err
    assert main(["train", "--local", "--resume", cfg.out, "--out", "/elsewhere"]) == 2
    assert "different folders" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_cli_generate_prints_prompt_and_sample(short_run):
    cfg, _ = short_run
    res = _cli("generate", "--from", cfg.out, "--prompt", "KING:", "--tokens", "8", "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("KING:") and len(res.stdout.strip()) > len("KING:")
    # The same sample as in this process: seeded, and independent of the process.
    assert res.stdout.strip() == generate_text(cfg.out, "KING:", tokens=8, seed=3).strip()
