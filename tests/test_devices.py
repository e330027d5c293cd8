"""Devices and precision on a machine without a GPU: nothing in the model is pinned to the
CPU (meta device), stages move between devices and dtypes, bad --device flags are one-line
errors, fp16 loss scaling skips overflowed steps, and (integration) a bf16 swarm equals
the local bf16 trainer while a worker that runs out of memory leaves cleanly."""

from __future__ import annotations

import copy

import pytest
import torch

from shoal.cli import main as shoal_main
from shoal.errors import ShoalError
from shoal.model.config import PRESETS, get_preset
from shoal.model.transformer import build_stage
from shoal.runtime.roles.worker import graph_room, oom_message
from shoal.train.local import TrainConfig, train_local
from shoal.train.precision import (
    LossScaleConfig,
    autocast,
    next_loss_scale,
    resolve_device,
    wire_dtype,
)

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_runs_forward_and_backward_on_meta(name):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = build_stage(cfg, 0, cfg.n_total_layers, init=False)
    ids = torch.zeros((2, 16), dtype=torch.long, device="meta")
    loss = model(ids, ids)
    assert loss.device.type == "meta" and loss.shape == ()
    loss.backward()
    params = list(model.parameters())
    assert params and all(p.grad is not None and p.grad.device.type == "meta" for p in params)
    # a middle stage takes hidden states and gives hidden states, on meta too
    with torch.device("meta"):
        mid = build_stage(cfg, 1, 2, init=False)
    h = torch.zeros((2, 16, cfg.d_model), device="meta", requires_grad=True)
    out = mid(h)
    assert out.device.type == "meta" and out.shape == h.shape
    out.sum().backward()
    assert h.grad is not None and h.grad.shape == h.shape


@pytest.mark.timeout(60)
def test_a_stage_moved_between_devices_and_dtypes_keeps_its_outputs():
    cfg = get_preset("tiny")
    stage = build_stage(cfg, 1, 3, seed=3)
    x = torch.randn(2, 16, cfg.d_model, generator=torch.Generator().manual_seed(1))
    ref = stage(x).detach()
    # to meta and back: the structure (and rotary tables) follow the tensors' device
    moved = copy.deepcopy(stage).to("meta")
    assert all(p.device.type == "meta" for p in moved.parameters())
    assert moved(x.to("meta")).shape == ref.shape
    moved.to_empty(device="cpu").load_state_dict(stage.state_dict())
    assert torch.equal(moved(x).detach(), ref)
    # through float64 and back: exactly the same outputs
    round_trip = copy.deepcopy(stage).to(torch.float64).to(torch.float32)
    assert torch.equal(round_trip(x).detach(), ref)
    if not NO_CUDA:
        on_gpu = copy.deepcopy(stage).to("cuda")
        assert torch.allclose(on_gpu(x.cuda()).cpu(), ref, atol=1e-4)


@pytest.mark.timeout(60)
def test_autocast_keeps_the_residual_stream_in_the_compute_dtype():
    cfg = get_preset("tiny")
    first, rest = build_stage(cfg, 0, 2, seed=0), build_stage(cfg, 2, cfg.n_total_layers, seed=0)
    whole = build_stage(cfg, 0, cfg.n_total_layers, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    with autocast(cpu, "bf16"):
        h = first(ids)
        assert h.dtype == torch.bfloat16  # what travels between stages
        split = rest(h, ids)
        joined = whole(ids, ids)
    assert wire_dtype("bf16") == "bfloat16"
    assert torch.equal(split, joined)  # a stage boundary changes nothing
    with autocast(cpu, "fp32"):
        assert first(ids).dtype == torch.float32


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_cuda_device_without_cuda_is_a_one_line_error(capsys, tmp_path):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("cuda", "cuda:1"):
        with pytest.raises(ShoalError, match="--device cpu"):
            resolve_device(bad)
    with pytest.raises(ShoalError, match="cuda:N"):
        resolve_device("cuda:x")
    with pytest.raises(ShoalError, match="unknown device"):
        resolve_device("tpu")
    for argv in (["train", "--local", "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "t")],
                 ["launch", "--device", "cuda:0", "--steps", "1", "--out", str(tmp_path / "l")],
                 ["worker", "--join", "127.0.0.1:9", "--device", "cuda"]):
        assert shoal_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --device cuda") and "\n" not in err, err
    assert not (tmp_path / "l" / "logs").exists()  # launch started nothing


def test_next_loss_scale_halves_on_overflow_and_grows_after_good_steps():
    cfg = LossScaleConfig(init_scale=8.0, growth_interval=3, min_scale=2.0)
    assert next_loss_scale(8.0, 1, True, cfg) == (4.0, 0)
    assert next_loss_scale(2.0, 0, True, cfg) == (2.0, 0)  # never below min_scale
    assert next_loss_scale(8.0, 0, False, cfg) == (8.0, 1)
    assert next_loss_scale(8.0, 2, False, cfg) == (16.0, 0)


def test_oom_message_names_stage_layers_and_micro_batch():
    msg = oom_message(1, 3, 6, 8, 128, "cuda:0", "bf16")
    assert "stage 1" in msg and "layers [3, 6)" in msg and "micro-batch size 8" in msg and "\n" not in msg


LOCAL = dict(model="tiny", micro_batches=2, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2,
             eval_every=0, eval_batches=1)


@pytest.mark.timeout(120)
def test_graph_room_keeps_forward_graphs_only_in_the_memory_beyond_the_plan_and_held_gradients():
    gb = 1e9
    # a 24 GB card whose stage needs 17 GB: 7 GB left, 1.2 GB a micro-batch's activations
    assert graph_room(24 * gb, 17 * gb, 0.0, 1.2 * gb, most=64) == 5
    # two whole-stage gradients held for the step (2.8 GB each) leave room for one graph
    assert graph_room(24 * gb, 17 * gb, 5.6 * gb, 1.2 * gb, most=64) == 1
    # no room (or less than a graph): none kept, every backward task recomputes its forward
    assert graph_room(24 * gb, 23.5 * gb, 0.0, 1.2 * gb, most=64) == 0
    assert graph_room(16 * gb, 17 * gb, 0.0, 1.2 * gb, most=64) == 0
    # plenty (a CPU worker's RAM): at most `most` (twice the step's micro-batches)
    assert graph_room(500 * gb, 1 * gb, 0.0, 0.01 * gb, most=16) == 16
    assert graph_room(1 * gb, 2 * gb, 0.0, 0.0, most=16) == 16  # a stage that saves nothing


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    # 2**40 overflows fp16 activation gradients at once: the first steps are skipped.
    res = train_local(TrainConfig(**LOCAL, steps=3, out=str(tmp_path / "a"), precision="fp16",
                                  loss_scale=2.0**40), quiet=True)
    recs = res.records
    assert [r["loss_scale"] for r in recs] == [2.0**40, 2.0**39, 2.0**38]
    assert all(r["skipped"] and r["grad_norm"] is None for r in recs)
    init = build_stage(get_preset("tiny"), 0, get_preset("tiny").n_total_layers, seed=0).state_dict()
    assert all(torch.equal(v, init[k]) for k, v in res.model.state_dict().items())  # no update applied
    # a sane scale trains, and its first steps match fp32 closely
    fp16 = train_local(TrainConfig(**LOCAL, steps=3, out=str(tmp_path / "b"), precision="fp16",
                                   loss_scale=1024.0), quiet=True).records
    fp32 = train_local(TrainConfig(**LOCAL, steps=3, out=str(tmp_path / "c")), quiet=True).records
    assert not any(r["skipped"] for r in fp16)
    for a, b in zip(fp16, fp32, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 0.01


# ------------------------------------------------------------------------------ swarm

STEPS = 30
RUN = dict(LOCAL, steps=STEPS)


def _local(tmp_path_factory, precision: str, **kw) -> list[dict]:
    out = tmp_path_factory.mktemp(f"local-{precision}")
    return train_local(TrainConfig(**RUN | kw, out=str(out), precision=precision), quiet=True).records


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_bf16_swarm_equals_local_bf16_and_an_oom_worker_leaves_cleanly(tmp_path, tmp_path_factory):
    from shoal.runtime.processes.launch import LaunchConfig, Swarm
    from shoal.train.metrics import read_jsonl

    run = {k: v for k, v in RUN.items() if k not in ("eval_every", "eval_batches")}
    cfg = LaunchConfig(**run, out=str(tmp_path / "run"), stages=2, workers=3, precision="bf16", device="cpu",
                       dead_after_s=3.0, min_lease_s=1.5, timeout_s=350,
                       worker_args=[[], [], ["--inject", "oom"]])
    with Swarm(cfg) as swarm:
        swarm.start()
        summary = swarm.wait()
        oom_rc = swarm.workers[2].returncode
    assert summary["steps"] == STEPS
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    ref_bf16, ref_fp32 = _local(tmp_path_factory, "bf16"), _local(tmp_path_factory, "fp32")
    worst = max(abs(r["loss"] - b["loss"]) for r, b in zip(recs, ref_bf16, strict=True))
    drift = max(abs(r["loss"] - f["loss"]) / f["loss"] for r, f in zip(recs, ref_fp32, strict=True))
    print(f"bf16 swarm vs local bf16: max |dloss| {worst:.2e}; vs local fp32: max rel {drift:.3%}")
    assert worst <= 1e-3
    assert drift <= 0.02
    # the worker whose (injected) allocation failed said why in one line and left with exit 2
    log = (tmp_path / "run" / "logs" / "worker2.log").read_text()
    assert oom_rc == 2, log[-2000:]
    err = [ln for ln in log.splitlines() if ln.startswith("error: ")]
    assert len(err) == 1 and "out of memory on cpu computing stage" in err[0], log[-2000:]
    assert "micro-batch size 2 x 32 tokens in bf16" in err[0] and "re-queued" in err[0]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_fp16_swarm_skips_overflowed_steps_at_every_stage_like_local(tmp_path, tmp_path_factory):
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.runtime.roles.artifacts import load_final_weights
    from shoal.train.metrics import read_jsonl

    steps, scale = 4, 2.0**21  # overflows on the first steps, then trains
    out = tmp_path_factory.mktemp("local-fp16")
    ref = train_local(TrainConfig(**LOCAL, steps=steps, out=str(out), precision="fp16", loss_scale=scale),
                      quiet=True)
    run = {k: v for k, v in LOCAL.items() if k not in ("eval_every", "eval_batches")}
    launch(LaunchConfig(**run, steps=steps, out=str(tmp_path / "run"), stages=2, workers=2, precision="fp16",
                        loss_scale=scale, device="cpu", dead_after_s=3.0, min_lease_s=1.5, timeout_s=250))
    recs = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped"] for r in recs] == [r["skipped"] for r in ref.records]
    assert [r["loss_scale"] for r in recs] == [r["loss_scale"] for r in ref.records]
    assert any(r["skipped"] for r in recs) and not all(r["skipped"] for r in recs)
    for r, b in zip(recs, ref.records, strict=True):
        assert abs(r["loss"] - b["loss"]) <= 1e-3
    weights = load_final_weights(tmp_path / "run")
    worst = max(float((weights[k] - v).abs().max()) for k, v in ref.model.state_dict().items())
    assert worst <= 1e-3, worst

