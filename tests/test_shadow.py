"""Shadow workers (shoal.runtime.roles.shadow): the same plan and the same bytes per task
kind as real workers, with no model run."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.runtime.roles.shadow import SHADOW_VALUE, shadow_grads, shadow_loss, shadow_tensor


def test_shadow_tensors_are_fixed_shared_and_true_shaped():
    a = shadow_tensor((2, 4, 8), "bfloat16")
    assert a.shape == (2, 4, 8) and a.dtype == torch.bfloat16 and a is shadow_tensor((2, 4, 8), "bfloat16")
    params = {"w": torch.empty(3, 5, device="meta"), "b": torch.empty(5, device="meta")}
    g = shadow_grads(params)
    assert {n: t.shape for n, t in g.items()} == {"w": (3, 5), "b": (5,)}
    assert all(t.dtype == torch.float32 and torch.all(t == SHADOW_VALUE) for t in g.values())
    assert g["w"] is shadow_grads(params)["w"]  # one set per stage and process
    assert shadow_loss(256) == pytest.approx(5.545, abs=1e-3)


def _stage_push_bytes(layers, cfg) -> list[tuple[int, int]]:
    """(frames, bytes) of one whole-stage gradient push's frames, per stage."""
    from shoal.model.transformer import build_stage
    from shoal.net.wire import encode_tensor, frame_size

    out = []
    for first, last in layers:
        with torch.device("meta"):
            stage = build_stage(cfg, first, last, init=False)
        frames = [encode_tensor(n, torch.zeros(tuple(p.shape))) for n, p in stage.named_parameters()]
        out.append((len(frames), sum(frame_size(f) for f in frames)))
    return out


def _whole_stages(count: dict, per_stage: list[tuple[int, int]]) -> bool:
    """Whether ``count`` (messages = frames, wire bytes) is a whole number of whole-stage
    transfers (a push or a pull of every parameter of a stage, two stages)."""
    (n0, b0), (n1, b1) = per_stage
    for a in range(count["messages"] // n0 + 1):
        rest = count["messages"] - a * n0
        if rest % n1 == 0 and a * b0 + (rest // n1) * b1 == count["wire"]:
            return True
    return False


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_shadow_and_real_workers_make_the_same_plan_and_bytes(tmp_path):
    """The demo scenario with real workers, then with shadow workers: the same plan (layers and
    worker -> stage), every activation and activation-gradient frame of the same size, and
    pushes and pulls whole true-shaped stage gradients and weights; the shadow run's losses are
    the fixed shadow loss (no model ran)."""
    from shoal.model.config import get_preset
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    runs = {}
    for shadow in (False, True):
        out = tmp_path / ("shadow" if shadow else "real")
        cfg = LaunchConfig(out=str(out), model="tiny", stages=2, workers=4, steps=3, micro_batches=4,
                           micro_batch_size=2, seq_len=32, seed=1, data=("synthetic",), scenario="demo",
                           emulate_speedup=3e-4, dead_after_s=3.0, min_lease_s=1.5, timeout_s=400,
                           shadow=shadow, dashboard=None)
        summary = launch(cfg)
        events = read_jsonl(out / "events.jsonl")
        plan = next(e for e in events if e["event"] == "replan")
        runs[shadow] = (summary, plan, out)
    (real, real_plan, _), (shadow, shadow_plan, shadow_out) = runs[False], runs[True]
    assert real["steps"] == shadow["steps"] == 3
    assert (real_plan["layers"], real_plan["assignment"]) == (shadow_plan["layers"], shadow_plan["assignment"])
    payload = 2 * 32 * get_preset("tiny").d_model * 4  # one (B, T, d) fp32 tensor
    for kind in ("activations", "activation_grads"):
        for run in (real, shadow):  # every frame one such tensor and its head (name, dtype, shape: < 64 bytes)
            c = run["bytes"][kind]
            assert c["messages"] > 0 and 0 < c["wire"] - c["messages"] * payload < 64 * c["messages"], (kind, c)
    per_stage = _stage_push_bytes(real["layers"], get_preset("tiny"))
    for kind in ("grad_push", "weight_pull"):
        assert _whole_stages(real["bytes"][kind], per_stage), (kind, real["bytes"][kind], per_stage)
        assert _whole_stages(shadow["bytes"][kind], per_stage), (kind, shadow["bytes"][kind], per_stage)
    vocab = get_preset("tiny").vocab_size
    assert all(loss == pytest.approx(shadow_loss(vocab)) for loss in shadow["losses"])
    assert not all(loss == pytest.approx(shadow_loss(vocab)) for loss in real["losses"])
    logs = "".join(p.read_text() for p in (shadow_out / "logs").glob("worker*.log"))
    assert "Traceback" not in logs
    assert json.loads((shadow_out / "summary.json").read_text())["steps"] == 3


# ---------------------------------------------------------------- shadow processes' links and CPU

def test_shadow_runs_refuse_local_mode_with_one_line(capsys):
    """A shadow worker's stage is meta tensors (shapes only): local mode's replica cannot be
    kept, so every entry refuses the pair up front instead of the workers dying mid-run."""
    from shoal.demo.cli import DemoConfig
    from shoal.errors import ShoalError
    from shoal.runtime.processes.cli import main as cli_main
    from shoal.runtime.processes.launch import LaunchConfig

    with pytest.raises(ShoalError, match="--shadow runs exact sync only"):
        LaunchConfig(out="x", shadow=True, scenario="demo", sync="local").validate()
    with pytest.raises(ShoalError, match="--shadow runs exact sync only"):
        DemoConfig(shadow=True, sync="local").validate()
    DemoConfig(shadow=True, sync="exact").validate()
    assert cli_main(["coordinator", "--model", "tiny", "--shadow", "--sync", "local", "--insecure",
                     "--listen", "127.0.0.1:0"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --shadow runs exact sync only")


def test_relay_read_size_follows_the_slowest_bucket():
    from shoal.emulate.links import CHUNK, MAX_CHUNK, PACE_S, read_size

    assert read_size([None, None]) == MAX_CHUNK  # unshaped: the most per step
    assert read_size([125e6]) == int(125e6 * PACE_S)  # 1 Gb/s: 1 ms of link time a step
    assert read_size([125e6, 2.5e6]) == CHUNK  # slow links keep the finest pacing
    assert read_size([1.25e10]) == MAX_CHUNK


def _scenario():
    from shoal.plan.types import Device, Link, Network, Scenario, Workload

    mk = lambda i: Device(id=f"d{i}", kind="rtx4090", flops=1e12, memory=24e9, region="eu",  # noqa: E731
                          up=1e6, down=4e6)
    return Scenario(name="t", devices=[mk(0), mk(1)], network=Network(intra={"eu": Link(0.001, 1e9)}, inter={}),
                    workload=Workload(model="tiny", seq_len=32, global_batch=8, micro_batch_size=2))


def test_sibling_dials_each_have_their_own_link_on_one_thread():
    """Shadow workers of one process each play their own device: a sibling dial has its own
    buckets and relays (the first dial's do not carry its bytes), relayed by the first dial's
    thread, and learns the peers the first dial learns."""
    from shoal.emulate.links import ScenarioDial
    from shoal.emulate.measure import connect
    from shoal.emulate.measure import serve as tcp_serve

    class Echo(__import__("socketserver").BaseRequestHandler):
        def handle(self):
            while data := self.request.recv(65536):
                self.request.sendall(data)

    srv, addr = tcp_serve(Echo)
    first = ScenarioDial(_scenario(), "d0", {})
    try:
        second = first.sibling(7)
        assert second.shaper._thread is first.shaper._thread
        assert second.shaper.up_bucket is not first.shaper.up_bucket
        assert second.shaper.up_bucket.rate == first.shaper.up_bucket.rate == 1e6
        first.set_peer(addr, "d1")
        assert second.link_for(addr) is not None  # learnt from the first dial
        relay = second(addr)
        assert relay not in (addr, first(addr))  # its own relay
        s = connect(relay)
        s.sendall(b"x" * 1000)
        got = b""
        while len(got) < 1000:
            got += s.recv(4096)
        s.close()
        assert second.shaper.stats()["up_bytes"] == 1000 and first.shaper.stats()["up_bytes"] == 0
    finally:
        first.close()
        srv.shutdown()
    assert not first.shaper._thread.is_alive()


def test_relay_lets_go_of_a_connection_its_target_closed():
    """A target that closes a connection ends the relay of it, although the client keeps
    its end open (as a gRPC channel does): the relay holds no sockets of closed connections."""
    import socketserver

    from shoal.emulate.links import LinkShaper
    from shoal.emulate.measure import connect
    from shoal.emulate.measure import serve as tcp_serve

    class Closer(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(1)
            self.request.close()

    srv, addr = tcp_serve(Closer)
    try:
        with LinkShaper() as sh:
            s = connect(sh.proxy_for(addr, latency_s=0.001))
            s.sendall(b"x")
            assert s.recv(1) == b""  # the target's close reached the client
            import time

            deadline = time.monotonic() + 30
            while sh._tasks and time.monotonic() < deadline:  # a state, waited for: not a timing
                time.sleep(0.01)
            assert not sh._tasks, sh._tasks
            s.close()
    finally:
        srv.shutdown()


def test_shadow_push_frames_and_pull_check():
    from shoal.net import shoal_pb2 as pb
    from shoal.net.wire import encode_frame, encode_tensor
    from shoal.runtime.roles.shadow import raw_full_pull, shadow_frames, shadow_pull_ok

    params = {"w": torch.empty(3, 5, device="meta"), "b": torch.empty(5, device="meta")}
    g = shadow_grads(params)
    two = {n: t.clone().add_(t) for n, t in g.items()}
    frames = shadow_frames(two, 2, "raw", True)
    assert [f.name for f in frames] == ["w", "b"]
    assert frames == [encode_frame(n, t, "raw") for n, t in two.items()]  # what a fresh encode gives
    assert [f.to_pb() for f in frames] == [encode_tensor(n, t, "raw") for n, t in two.items()]
    assert shadow_frames(two, 2, "raw", True) is frames  # encoded once per process
    rep = pb.WeightsReply(params=[encode_tensor(n, torch.zeros(tuple(p.shape))) for n, p in params.items()])
    assert raw_full_pull(rep) and shadow_pull_ok(rep, params)
    assert not shadow_pull_ok(pb.WeightsReply(params=list(rep.params)[:1]), params)
    short = pb.WeightsReply(params=[encode_tensor("w", torch.zeros(3, 5)), encode_tensor("b", torch.zeros(4))])
    assert not shadow_pull_ok(short, params)
    assert not raw_full_pull(pb.WeightsReply(compress_delta=True))


def test_a_shadow_group_member_heartbeats_at_the_normal_period_while_unassigned():
    """A lone worker waiting for its first assignment heartbeats 5 times a second; a member
    of a shadow group (hundreds in a swarm, joining a few at a time) at the normal period."""
    import asyncio

    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.common import heartbeat_period
    from shoal.runtime.roles.worker import UNASSIGNED_HEARTBEAT_S, Worker, WorkerOptions

    w = Worker("127.0.0.1:1", "tok", WorkerOptions(name="w", shadow=True, flops=1e12))
    w.spec = pb.RunSpec(dead_after_s=10.0, min_lease_s=10.0)
    assert w.stage < 0 and w._beat_period() == UNASSIGNED_HEARTBEAT_S
    w.join_gate = asyncio.Semaphore(8)
    assert w._beat_period() == heartbeat_period(10.0, 10.0) == 1.0
