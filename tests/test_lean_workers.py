"""Lean local-mode workers (--lean-workers) on a real swarm: backward sums each step's
gradients in .grad, the inner AdamW keeps bf16 moments, and a refused result's gradient --
in the sum already -- never reaches a reported sum: the step's sum is dropped and what the
server holds of it is redone (shoal.runtime.sync.lean)."""

from __future__ import annotations

import json
import math
import re

import pytest

from shoal.train.metrics import read_jsonl

RUN = dict(model="tiny", micro_batches=6, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_lean_workers_train_and_redo_a_refused_results_step(tmp_path):
    """Two stages, two lean workers, H = 2, each worker's first result with an output made
    malformed (--inject bad_shape): the last stage's worker has that task's gradient in its
    sum when the server refuses the result, so it drops the step's sum (its log says so) and
    the step's micro-batches it ran are redone. Every merge still covers each micro-batch of
    its round once (the contributors' counts, as the workers reported them, add up to H x M),
    the inner optimizers keep bf16 moments, and the run trains: finite losses that fall."""
    from shoal.runtime.processes.launch import LaunchConfig, launch

    steps, h = 4, 2
    out = tmp_path / "run"
    launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=2, workers=2, dead_after_s=5.0, min_lease_s=1.5,
                        timeout_s=280, sync="local", sync_every=h, lean=True,
                        worker_args=[["--inject", "bad_shape"], ["--inject", "bad_shape"]]))
    logs = {k: (out / "logs" / f"worker{k}.log").read_text() for k in range(2)}
    every = "".join(logs.values())
    assert "is a lean worker: bf16 inner AdamW moments" in every
    dropped = re.findall(r"drops its gradient sum of step (\d+) \(lean worker: a result it holds was refused\)", every)
    assert dropped, every[-3000:]
    assert "dropped its lean sum of the gradients of step" in every  # released at the flush: redone
    servers = "".join(p.read_text() for p in (out / "logs").glob("server*.log"))
    assert "rejected a result" in servers
    for k in range(2):
        text = (out / "logs" / f"server{k}.log").read_text()
        merges = [json.loads(m.group(1)) for m in re.finditer(r"local merge (\{.*\})$", text, re.M)]
        assert [m["version"] for m in merges] == [2, 4], merges
        for m in merges:
            covered = 0
            for mid in m["contributors"]:
                name = mid.rsplit("-", 1)[1]
                sent = re.findall(rf"sent its pseudo-gradient for v{m['version']} covering (\d+) micro-batches",
                                  logs[int(name[1:])])
                assert sent, (name, m)
                assert m["contributors"][mid] == int(sent[-1])
                covered += int(sent[-1])
            assert covered == h * RUN["micro_batches"], m  # each micro-batch of the round once
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses


def test_the_run_spec_carries_lean_workers_to_every_role():
    """--lean-workers travels in the run spec: the workers read it (sync_of_spec) and the
    coordinator places them by it (spec_sync_policy: 12 bytes a parameter); exact sync refuses it."""
    from shoal.errors import ShoalError
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.roles.planning import spec_sync_policy
    from shoal.train.outer import SyncConfig, sync_of_spec

    spec = pb.RunSpec(sync_mode="local", sync_every=4, sync_lean=True)
    assert sync_of_spec(spec).lean and spec_sync_policy(spec).lean
    assert not spec_sync_policy(pb.RunSpec(sync_mode="local", sync_every=4)).lean
    with pytest.raises(ShoalError, match="--lean-workers applies to --sync local"):
        SyncConfig(mode="exact", lean=True).validate()
