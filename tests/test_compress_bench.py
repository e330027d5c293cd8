"""The compression measurement trains through the codecs and counts every byte."""

import math

import pytest

from shoal.emulate.compress_bench import CONFIGS, BenchConfig, run


@pytest.mark.timeout(120)
def test_bench_run_counts_bytes_and_tracks_raw_loss():
    cfg = BenchConfig(steps=2, micro_batches=2, micro_batch_size=2, seq_len=32, eval_batches=2)
    raw = run(cfg, CONFIGS["raw"])
    q = run(cfg, CONFIGS["int8-all"])
    for kind in ("activations", "act_grads", "grad_push", "weight_pull"):
        assert raw["bytes"][kind]["ratio"] == 1.0
        assert q["bytes"][kind]["ratio"] >= 3.5
        assert q["bytes"][kind]["raw"] == raw["bytes"][kind]["raw"]
    # 2 steps x 2 micro-batches x B*T*d activations of 4 bytes
    assert raw["bytes"]["activations"]["raw"] == 2 * 2 * 2 * 32 * 128 * 4
    assert math.isfinite(q["val_loss"])
    assert abs(q["val_loss"] - raw["val_loss"]) / raw["val_loss"] < 0.02
