"""``--tensorboard DIR``: every training command writes its step metrics as TensorBoard event
files, read back here with TensorBoard's own reader."""

from __future__ import annotations

import os

import pytest

from shoal.cli import build_parser, main
from shoal.train.metrics import read_jsonl
from shoal.train.tensorboard import scalars_of
from tests.helpers.members import run_cli

RUN = ["--model", "tiny", "--steps", "3", "--micro-batches", "2", "--micro-batch-size", "2", "--seq-len", "32",
       "--warmup", "1"]


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``logdir``, as TensorBoard itself reads the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _same(series: list[tuple[int, float]], records: list[dict], field: str) -> None:
    want = [(r["step"], r[field]) for r in records if field in r]
    assert [s for s, _ in series] == [s for s, _ in want]
    for (_, got), (_, ref) in zip(series, want, strict=True):
        assert got == pytest.approx(ref, rel=1e-6), (field, got, ref)


def test_scalars_of_a_step_record():
    rec = {"step": 4, "loss": 2.5, "val_loss": 2.7, "lr": 1e-3, "grad_norm": None, "tokens": 512,
           "step_time_s": 0.5, "tokens_per_s": 1024.0, "time_s": 9.0, "requeues": 2, "flop_share": 0.31,
           "skipped": False, "tasks_per_worker": {"w0": 3},
           "split": {"0": {"total_s": 0.5, "compute_s": 0.3, "transfer_s": 0.1, "sync_s": 0.05, "waiting_s": 0.05}},
           "bytes_by_kind": {"act": 1000, "grad": 2000}}
    assert scalars_of(rec) == {
        "train/loss": 2.5, "val/loss": 2.7, "train/lr": 1e-3, "speed/tokens_per_s": 1024.0,
        "speed/flop_share": 0.31, "time/step_s": 0.5, "faults/requeues": 2.0,
        "time/stage0/total_s": 0.5, "time/stage0/compute_s": 0.3, "time/stage0/transfer_s": 0.1,
        "time/stage0/sync_s": 0.05, "time/stage0/waiting_s": 0.05, "bytes/act": 1000.0, "bytes/grad": 2000.0}


@pytest.mark.parametrize("argv", (["train", "--local"], ["launch", "--out", "x"], ["coordinator"], ["demo"]),
                         ids=lambda a: a[0])
def test_every_training_command_takes_tensorboard(argv):
    assert build_parser().parse_args([*argv, "--tensorboard", "tb"]).tensorboard == "tb"


def test_coordinator_tensorboard_needs_a_run_folder(capsys):
    assert main(["coordinator", "--tensorboard", "tb"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tensorboard") and "--out" in err and err.count("\n") == 1


def test_train_local_writes_tensorboard(tmp_path):
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert main(["train", "--local", *RUN, "--eval-every", "2", "--eval-batches", "1", "--out", str(out),
                 "--tensorboard", str(tb), "--quiet"]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    got = _scalars(tb)
    assert {"train/loss", "val/loss", "train/lr", "train/grad_norm", "speed/tokens_per_s", "time/step_s"} <= set(got)
    for tag, field in (("train/loss", "loss"), ("val/loss", "val_loss"), ("train/lr", "lr"),
                       ("speed/tokens_per_s", "tokens_per_s"), ("time/step_s", "step_time_s")):
        _same(got[tag], records, field)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_launch_writes_tensorboard(tmp_path):
    """A swarm's coordinator adds the stage split, bytes by kind, re-queues and the FLOP share."""
    out, tb = tmp_path / "run", tmp_path / "tb"
    proc = run_cli(["launch", "--stages", "2", "--workers", "2", "--out", str(out), "--timeout", "500",
                    "--no-dashboard", *RUN, "--tensorboard", str(tb)],
                   dict(os.environ, OMP_NUM_THREADS="1"), timeout=560, module="shoal.runtime.processes.cli")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    got = _scalars(tb)
    for tag, field in (("train/loss", "loss"), ("speed/tokens_per_s", "tokens_per_s"), ("faults/requeues", "requeues"),
                       ("speed/flop_share", "flop_share")):
        _same(got[tag], records, field)
    last = records[-1]
    assert 0 < last["flop_share"] < 1 and set(last["split"]) == {"0", "1"}
    for stage in ("0", "1"):
        for part in ("compute_s", "transfer_s", "sync_s", "waiting_s"):
            tag = f"time/stage{stage}/{part}"
            assert got[tag][-1] == (2, pytest.approx(last["split"][stage][part], rel=1e-6)), tag
    assert last["bytes_by_kind"] and all(n > 0 for n in last["bytes_by_kind"].values())
    for kind, n in last["bytes_by_kind"].items():
        assert got[f"bytes/{kind}"][-1] == (2, pytest.approx(n, rel=1e-6)), kind
