"""Exact means bitwise equal to `shoal train --local` as a user runs it, whatever the machine's
thread settings: the local trainer computes every op on one intra-op thread (micro-batches side
by side, gradients summed in micro-batch order), and the global gradient norm is a correctly
rounded sum of per-parameter norms, so the layer split does not change it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.train.local import CPU_FP32, Precision, micro_batch_threads

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(model="tiny", micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)
DEFAULT_SHAPES = dict(model="tiny")  # M=4, B=8, T=128: where 3 intra-op threads change the first step


def test_micro_batch_threads_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert micro_batch_threads(cpu, 4, 1, cores=2) == 2
    assert micro_batch_threads(cpu, 4, 1, cores=16) == 4  # at most 4 (activation memory)
    assert micro_batch_threads(cpu, 3, 1, cores=16) == 3  # at most one per micro-batch
    assert micro_batch_threads(cpu, 4, 1, cores=1) == 1
    assert micro_batch_threads(cpu, 4, 2, cores=16) == 1  # SHOAL_TORCH_THREADS > 1: ops in parallel instead
    assert micro_batch_threads(cuda, 4, 1, cores=16) == 1


def _steps(parallel: int, steps: int = 3) -> tuple[list, dict]:
    from shoal.data import load_data
    from shoal.model.transformer import build_stage
    from shoal.train.config import TrainConfig
    from shoal.train.local import train_step
    from shoal.train.optim import make_optimizer

    cfg = TrainConfig(**SMALL, steps=steps)
    mc = cfg.model_config()
    data = load_data(cfg.data_config(), mc.vocab_size)
    model = build_stage(mc, 0, mc.n_total_layers, cfg.seed)
    opt = make_optimizer(model.named_parameters(), cfg.optim_config())
    prec = Precision(CPU_FP32.device, parallel=parallel)
    outs = [train_step(model, opt, data, cfg, cfg.optim_config(), t, prec) for t in range(steps)]
    return [(o.loss, o.grad_norm) for o in outs], {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_parallel_micro_batches_equal_sequential_bitwise():
    """Three micro-batches computed at once (one intra-op thread each) give the sequential
    step bit for bit: same losses, same norms, same weights."""
    torch.set_num_threads(1)
    seq, w_seq = _steps(parallel=1)
    par, w_par = _steps(parallel=3)
    assert par == seq
    assert all(torch.equal(w_par[k], w_seq[k]) for k in w_seq)


def test_the_warm_up_before_the_first_threaded_step_changes_nothing(tmp_path, monkeypatch):
    """``warm_kernels`` runs as ``train --local`` starts its threaded steps (and not with one
    micro-batch thread), and leaves the weights, their gradients and the random state as
    they were: the run's steps are those of a run without it."""
    from shoal.model.transformer import build_stage
    from shoal.train import local
    from shoal.train.config import TrainConfig

    mc = TrainConfig(**SMALL, steps=1).model_config()
    model = build_stage(mc, 0, mc.n_total_layers, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    local.warm_kernels(model, Precision(CPU_FP32.device, parallel=2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())

    calls = []
    real = local.warm_kernels
    monkeypatch.setattr(local, "warm_kernels", lambda m, prec, n: calls.append(prec.parallel) or real(m, prec, n))
    for cores in (2, 1):
        monkeypatch.setattr(local, "cpu_cores", lambda c=cores: c)
        local.train_local(TrainConfig(**SMALL, steps=1, eval_every=0, out=str(tmp_path / f"c{cores}")), quiet=True)
    assert calls == [2]


def test_norm_does_not_depend_on_the_layer_split():
    """The coordinator's global norm from every stage's per-parameter norms equals the local
    trainer's, bit for bit, for every split into stages (a plain sum of stage sums does not,
    in general: float addition is not associative)."""
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.runtime.common import even_split, synthetic_micro_batch
    from shoal.train.optim import grad_sq_norm, param_sq_norms, total_sq_norm

    cfg = get_preset("tiny")
    model = build_stage(cfg, 0, cfg.n_total_layers, 0)
    x, y = synthetic_micro_batch(0, 0, 0, 2, 32, cfg.vocab_size)
    model(x, y).backward()
    local = grad_sq_norm(model.parameters())
    by_layer = {}
    for name, p in model.named_parameters():
        by_layer.setdefault(int(name.split(".")[1]), []).append(p)
    for stages in range(1, cfg.n_total_layers + 1):
        parts = [param_sq_norms([p for i in range(a, b) for p in by_layer[i]])
                 for a, b in even_split(cfg.n_total_layers, stages)]
        assert total_sq_norm(x for part in parts for x in part) == local
    # a grouping a plain sum gets wrong, and the correctly rounded one does not
    assert (1.0 + 1e-16) + 1e-16 != 1.0 + (1e-16 + 1e-16)
    assert total_sq_norm([1.0, 1e-16, 1e-16]) == total_sq_norm([1e-16, 1e-16, 1.0]) == math.fsum([1.0, 2e-16])
    assert math.isnan(total_sq_norm([1.0, math.nan])) and total_sq_norm([1.0, math.inf]) == math.inf
    assert total_sq_norm([1e308, 1e308]) == math.inf


def test_local_trainer_ignores_the_machines_core_count(tmp_path, monkeypatch):
    """On a machine with 3 cores and no SHOAL_TORCH_THREADS, `shoal train --local` computes
    exactly what one thread computes (several CPU kernels split their float sums by thread
    count: 3 intra-op threads change the very first gradient)."""
    from shoal.train.local import TrainConfig, train_local

    monkeypatch.setenv("SHOAL_TORCH_THREADS", "1")
    one = train_local(TrainConfig(**DEFAULT_SHAPES, steps=2, out=str(tmp_path / "one"), eval_every=0, eval_batches=1),
                      quiet=True)
    monkeypatch.delenv("SHOAL_TORCH_THREADS")
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    try:
        three = train_local(TrainConfig(**DEFAULT_SHAPES, steps=2, out=str(tmp_path / "three"), eval_every=0,
                                        eval_batches=1), quiet=True)
    finally:
        torch.set_num_threads(1)
    assert [(r["loss"], r["grad_norm"]) for r in three.records] == [(r["loss"], r["grad_norm"]) for r in one.records]
    w1, w3 = one.model.state_dict(), three.model.state_dict()
    assert all(torch.equal(w1[k], w3[k]) for k in w1)


def _user_env() -> dict[str, str]:
    """A user's shell: none of the test suite's thread settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("SHOAL_TORCH_THREADS", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _shoal(args: list[str], timeout: float) -> None:
    p = subprocess.run([sys.executable, "-m", "shoal.cli", *args], env=_user_env(), capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_launch_equals_train_local_as_a_user_runs_them(tmp_path):
    """`shoal train --local --steps 3` and `shoal launch --stages 2 --workers 3 --steps 3`, both
    with every other flag at its default and the environment of a user's shell: the same
    losses, gradient norms and final weights, bit for bit (bench/bench_exact.py runs the
    30-step grid)."""
    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.train.checkpoint import load_checkpoint

    _shoal(["train", "--local", "--steps", "3", "--out", str(tmp_path / "local"), "--quiet"], timeout=200)
    _shoal(["launch", "--steps", "3", "--stages", "2", "--workers", "3", "--out", str(tmp_path / "swarm"),
            "--no-dashboard", "--timeout", "300"], timeout=360)
    local = load_checkpoint(tmp_path / "local" / "checkpoint").model_state
    swarm = load_final_weights(tmp_path / "swarm")
    assert set(local) == set(swarm)
    differ = [k for k in local if not torch.equal(local[k], swarm[k])]

    def metrics(d: Path) -> list:
        return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]

    # (Everything a rare mismatch needs to be traced: which layers, by how much, from which step.)
    assert not differ, (sorted({k.split(".")[1] for k in differ}), len(differ), len(local),
                        max(float((local[k] - swarm[k]).abs().max()) for k in local),
                        metrics(tmp_path / "swarm"), metrics(tmp_path / "local"))
    assert metrics(tmp_path / "swarm") == metrics(tmp_path / "local")


# Run in a user's environment (no OMP_NUM_THREADS before torch loads): a thread that has not set
# its own torch thread count computes oneMKL products on every core, and a product whose sum is
# long and whose result is small (a weight gradient: tokens x features) is split over them.
_THREADS_PROBE = r"""
import asyncio, sys, torch
from concurrent.futures import ThreadPoolExecutor
from shoal.runtime.loopwatch import watched
from shoal.threads import compute_pool
from shoal.train.local import set_torch_threads

set_torch_threads()
g = torch.Generator().manual_seed(0)
shapes = [(64, 4096, 64), (128, 1024, 384), (352, 1024, 128)]
pairs = [(torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)) for m, k, n in shapes]
products = lambda: [a @ b for a, b in pairs]
main = products()
same = lambda got: all(torch.equal(x, y) for x, y in zip(got, main))
with compute_pool(2, "probe") as pool:
    pooled = same(pool.submit(products).result())
async def member():
    return same(await asyncio.get_running_loop().run_in_executor(None, products))
executor = asyncio.run(watched(member(), "probe"))
with ThreadPoolExecutor(1) as pool:
    plain = same(pool.submit(products).result())
print(pooled, executor, plain)
"""


@pytest.mark.timeout(120)
def test_compute_threads_multiply_as_the_process_does():
    """In a user's environment, a product computed in a :func:`shoal.threads.compute_pool`
    thread (the local trainer's micro-batches, a server's recomputations and merges) and in a
    member's event-loop executor (a worker's tasks, a server's sums) has the main thread's bits
    (the intra-op count the entry point set). A plain thread's, for contrast, is printed: on a
    machine of one core it is the same, elsewhere not."""
    p = subprocess.run([sys.executable, "-c", _THREADS_PROBE], env=_user_env(), capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stderr[-2000:]
    pooled, executor, plain = p.stdout.split()
    assert (pooled, executor) == ("True", "True"), p.stdout
