"""Stage checkpoints are run-scoped, complete before they count, checked on load, and
fail loudly: corrupted and truncated files fall back to the previous checkpoint, a
reused run folder keeps (and never loads) the earlier run's files, a read-only or full
disk is a one-line error with the committed checkpoints intact."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from swarm_reference import RUN, assert_equal_weights, failure_free_weights, launch_config

from shoal.errors import ShoalError
from shoal.model.config import get_preset
from shoal.model.transformer import build_stage
from shoal.runtime.common import (
    ckpt_dir,
    clean_stray_temps,
    list_ckpts,
    load_stage_ckpt,
    read_stage_ckpt,
    save_stage_ckpt,
)
from shoal.train.metrics import read_jsonl
from shoal.train.optim import OptimConfig, make_optimizer

LAYERS = (0, 3)


def _stage(seed: int):
    cfg = get_preset("tiny")
    m = build_stage(cfg, *LAYERS, seed=seed)
    opt = make_optimizer(m.named_parameters(), OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1,
                                                           weight_decay=0.1, grad_clip=1.0))
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    return m, opt


def _corrupt(path: Path) -> None:
    """Flip bytes in the tensor data (the header stays valid JSON)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 64, len(data) - 32):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_round_trip_and_checks(tmp_path):
    m, opt = _stage(0)
    path = save_stage_ckpt(tmp_path, 0, 1, m, opt, run_id="runA", layers=LAYERS)
    assert path == ckpt_dir(tmp_path, 0, "runA") / "v1.safetensors"
    assert "runA" in str(path)
    m2, opt2 = _stage(1)
    load_stage_ckpt(tmp_path, 0, 1, m2, opt2, run_id="runA", layers=LAYERS)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    # another run's file, a wrong stage or layer range: refused by its contents
    other = ckpt_dir(tmp_path, 0, "runB")
    other.mkdir(parents=True)
    (other / "v1.safetensors").write_bytes(path.read_bytes())
    with pytest.raises(ShoalError, match="run_id='runA', expected 'runB'"):
        read_stage_ckpt(tmp_path, 0, 1, run_id="runB", layers=LAYERS)
    with pytest.raises(ShoalError, match="first"):
        read_stage_ckpt(tmp_path, 0, 1, run_id="runA", layers=(1, 3))
    _corrupt(path)
    with pytest.raises(ShoalError, match="checksum"):
        read_stage_ckpt(tmp_path, 0, 1, run_id="runA", layers=LAYERS)
    _truncate(path)
    with pytest.raises(ShoalError, match="unreadable"):
        read_stage_ckpt(tmp_path, 0, 1, run_id="runA", layers=LAYERS)
    with pytest.raises(ShoalError, match="not a plain name"):
        ckpt_dir(tmp_path, 0, "../x")


def test_pruning_and_temp_cleaning_stay_in_their_run(tmp_path):
    m, opt = _stage(0)
    for v in range(1, 4):
        save_stage_ckpt(tmp_path, 0, v, m, opt, run_id="old", layers=LAYERS)
    for v in range(1, 7):
        save_stage_ckpt(tmp_path, 0, v, m, opt, run_id="new", layers=LAYERS, keep=2)
    assert list_ckpts(tmp_path, 0, "old") == [1, 2, 3]
    assert list_ckpts(tmp_path, 0, "new") == [5, 6]
    (ckpt_dir(tmp_path, 0, "new") / ".v7.tmp").write_bytes(b"half")
    (ckpt_dir(tmp_path, 0, "old") / ".v4.tmp").write_bytes(b"half")
    assert clean_stray_temps(tmp_path, 0, "new") == 1
    assert (ckpt_dir(tmp_path, 0, "old") / ".v4.tmp").exists()
    # A temporary file names its writer: a live other process's is left alone (a server that
    # just gave the stage up may still be writing it); a dead one's and our own are stray.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        d = ckpt_dir(tmp_path, 0, "new")
        for pid in (live.pid, dead.pid, os.getpid()):
            (d / f".v8.{pid}.tmp").write_bytes(b"half")
        assert clean_stray_temps(tmp_path, 0, "new") == 2
        assert [p.name for p in d.glob(".v*.tmp")] == [f".v8.{live.pid}.tmp"]
    finally:
        live.kill()
        live.wait()
    assert clean_stray_temps(tmp_path, 0, "new") == 1


@contextlib.contextmanager
def _mounted_tmpfs(path: Path, *opts: str):
    """A tmpfs at ``path`` (needs root and mount rights; skips otherwise)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small or read-only file system")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_is_one_line_and_keeps_the_committed_checkpoint(tmp_path):
    m, opt = _stage(0)
    with _mounted_tmpfs(tmp_path / "small", "size=12m") as root:
        save_stage_ckpt(root, 0, 1, m, opt, run_id="r", layers=LAYERS)  # ~8 MB: fits once
        with pytest.raises(ShoalError) as err:
            save_stage_ckpt(root, 0, 2, m, opt, run_id="r", layers=LAYERS)
        msg = str(err.value)
        assert "No space left" in msg and "\n" not in msg
        assert list_ckpts(root, 0, "r") == [1]
        assert not list(ckpt_dir(root, 0, "r").glob(".v*.tmp"))
        read_stage_ckpt(root, 0, 1, run_id="r", layers=LAYERS)


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_read_only_checkpoint_folder_fails_the_run_in_one_line(tmp_path):
    """A server that cannot write its checkpoint fails the run: launch ends with one line."""
    from shoal.runtime.processes.launch import launch

    out = tmp_path / "run"
    with _mounted_tmpfs(out / "server_ckpt", "ro,size=1m"), pytest.raises(ShoalError) as err:
        launch(launch_config(out, steps=2, timeout_s=300))
    msg = str(err.value)
    assert "Read-only file system" in msg and "cannot write the stage" in msg, msg
    assert "\n" not in msg


def test_read_only_run_folder_is_one_line(tmp_path):
    """`shoal launch --out` on a read-only folder: `error: ...`, exit 2, no traceback."""
    with _mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        r = subprocess.run([sys.executable, "-m", "shoal.runtime.processes.cli", "launch", "--out", str(ro / "run"),
                            "--model", "tiny", "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: run folder") and "not writable" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_reused_folder_and_damaged_latest_checkpoints(tmp_path, tmp_path_factory):
    """Run 1 (another seed) leaves its checkpoints in the folder. Run 2 reuses it; at the
    third commit its stage-1 server is killed, stage 1's newest checkpoint is corrupted and
    stage 0's newest truncated, and a new server joins: both fall back to the previous
    checkpoint (with a log line), run 1's files are untouched and never loaded, and the
    final weights equal the failure-free run's."""
    from shoal.runtime.processes.launch import Swarm, launch

    reference = failure_free_weights(tmp_path_factory)
    out = tmp_path / "run"
    launch(launch_config(out, seed=11, steps=3))
    ckpts = out / "server_ckpt"
    first_run = _hashes(ckpts)
    (run1,) = [p.name for p in ckpts.iterdir()]
    run1_files = _hashes(out / "runs" / run1[4:])  # its journal, events, metrics, summary, weights
    assert {"journal.jsonl", "metrics.jsonl", "summary.json"} <= set(run1_files)
    assert first_run and all(k.startswith(run1) for k in first_run)

    from shoal.runtime.safety.standby import KILL_AT_COMMIT_ENV

    with Swarm(launch_config(out)) as sw:
        # Stage 1's server kills itself (kill -9) the moment step 2's decision lands, before it
        # applies or checkpoints it: a trigger on the run's state, not on how fast the test
        # notices the third commit (a loaded machine would finish all 6 steps first).
        sw.env[KILL_AT_COMMIT_ENV] = "1:3"
        sw.start()  # out/metrics.jsonl now links to run 2's own file
        sw.env.pop(KILL_AT_COMMIT_ENV)  # the replacement started below must live
        while all(s.poll() is None for s in sw.servers):
            time.sleep(0.05)
        runs = [e["run_id"] for e in read_jsonl(out / "events.jsonl") if e["event"] == "run"]
        run2 = f"run-{runs[-1]}"
        assert run2 != run1
        # Stage 0's server applies step 2 and writes its checkpoint; stage 1 has no server, so
        # nothing commits after it and no process writes stage 1's files while we damage them.
        while max(list_ckpts(ckpts, 0, run2[4:]), default=0) < 3:
            time.sleep(0.05)
        newest = {s: max(list_ckpts(ckpts, s, run2[4:])) for s in (0, 1)}
        assert newest == {0: 3, 1: 2}, newest
        _corrupt(ckpts / run2 / "stage1" / f"v{newest[1]}.safetensors")
        _truncate(ckpts / run2 / "stage0" / f"v{newest[0]}.safetensors")
        sw.start_server()
        summary = sw.wait()
    assert summary["steps"] == RUN["steps"] and summary["run_id"] == run2[4:]
    logs = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    assert "fails its checksum" in logs and "unreadable" in logs
    assert "using the previous checkpoint" in logs
    assert {k: v for k, v in _hashes(ckpts).items() if k.startswith(run1)} == first_run
    assert _hashes(out / "runs" / run1[4:]) == run1_files
    assert run1 not in logs
    assert_equal_weights(out, reference)
