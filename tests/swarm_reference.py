"""A failure-free reference run shared by the fault tests of one pytest session.

The first test that asks runs it (2 stages, 2 workers, synthetic data); later ones, in
any module, load its final weights from the session's temporary folder.
"""

from __future__ import annotations

from pathlib import Path

RUN = dict(model="tiny", steps=6, micro_batches=4, micro_batch_size=2, seq_len=32, seed=3, lr=3e-3,
           warmup=2, data="synthetic")


def launch_config(out, **kw):
    """The reference run's settings in ``out``, changed by ``kw``."""
    from shoal.runtime.processes.launch import LaunchConfig

    # Checkpoints every step: the fault tests check roll-backs to the newest committed step.
    base = dict(RUN, out=str(out), stages=2, workers=2, dead_after_s=3.0, min_lease_s=1.5, timeout_s=400,
                ckpt_every=1)
    base.update(kw)
    return LaunchConfig(**base)


def failure_free_weights(tmp_path_factory) -> dict:
    """Final weights of the reference run (run once per session)."""
    from shoal.runtime.processes.launch import launch
    from shoal.runtime.roles.artifacts import load_final_weights

    out = Path(tmp_path_factory.getbasetemp()) / "failure_free" / "run"
    if not (out / "summary.json").exists():
        launch(launch_config(out))
    return load_final_weights(out)


def assert_equal_weights(out, reference: dict) -> None:
    """The run in ``out`` ended with exactly (torch.equal) the reference weights."""
    import torch

    from shoal.runtime.roles.artifacts import load_final_weights

    weights = load_final_weights(out)
    assert set(weights) == set(reference)
    diff = [k for k in reference if not torch.equal(weights[k], reference[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[0]}"
