"""The compression measurement trains through the codecs and counts every byte; a
compressed run must land near the uncompressed one *relative to how far training moved
the model*, so a run that did not train (e.g. an lr of 1e-12) fails."""

import math

import pytest
from helpers.compress_pipeline import CONFIGS, BenchConfig, run

SMALL = dict(micro_batches=2, micro_batch_size=2, seq_len=32, eval_batches=2)


@pytest.mark.timeout(180)
def test_bench_run_counts_bytes_and_tracks_raw_loss():
    cfg = BenchConfig(steps=8, lr=3e-3, warmup=1, **SMALL)
    untrained = run(BenchConfig(steps=0, **SMALL), CONFIGS["raw"])["val_loss"]
    raw = run(cfg, CONFIGS["raw"])
    q = run(cfg, CONFIGS["int8-all"])
    for kind in ("activations", "act_grads", "grad_push", "weight_pull"):
        assert raw["bytes"][kind]["ratio"] == 1.0
        assert q["bytes"][kind]["ratio"] >= 3.5
        assert q["bytes"][kind]["raw"] == raw["bytes"][kind]["raw"]
    # 8 steps x 2 micro-batches x B*T*d activations of 4 bytes
    assert raw["bytes"]["activations"]["raw"] == 8 * 2 * 2 * 32 * 128 * 4
    assert math.isfinite(q["val_loss"])
    # training moved the loss by a margin (measured 0.69 nats at these settings)
    gain = untrained - raw["val_loss"]
    assert gain >= 0.3, (untrained, raw["val_loss"])
    # int8 everywhere stays within 5 % of that effect of the raw run (measured 0.5 %)
    assert abs(q["val_loss"] - raw["val_loss"]) <= 0.05 * gain, (q["val_loss"], raw["val_loss"], gain)
