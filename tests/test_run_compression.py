"""Per-traffic-kind compression of a run (``--compression``): the top-k codec, error feedback on
a toy problem, compressed weight pulls (shared reconstruction, deltas, joiners), the run-spec
setting, and a real local-mode swarm with ``--compression int8`` against exact training."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from shoal.errors import ShoalError
from shoal.net import shoal_pb2 as pb
from shoal.net.compress import (
    CodecError,
    ErrorFeedback,
    decode,
    encode,
    encoded_nbytes,
    topk_count,
    wire_fraction,
)
from shoal.net.wire import (
    WireError,
    decode_tensor,
    encode_tensor,
    frame_capacity,
    payload_frame,
    put_frame,
)
from shoal.runtime.sync.codecs import (
    PullDeltas,
    RunCompression,
    apply_pull,
    compression_of_spec,
    parse_run_compression,
    received_activation,
)

# ---------------------------------------------------------------------------- top-k codec


def test_topk_keeps_the_largest_entries_exactly_where_they_are():
    x = torch.tensor([0.1, -5.0, 0.0, 2.0, -0.2, 3.0, 0.05, -1.0, 0.3, 0.0])
    payload, meta = encode(x, "topk-int8:0.3")
    assert meta["codec"] == "topk-int8" and meta["k"] == 3
    assert len(payload) == encoded_nbytes("topk-int8:0.3", 10) == 5 * 3 + 4  # 3 indices, 3 codes, 1 scale
    y = decode(payload, meta, (10,))
    # kept: -5 (index 1), 3 (index 5), 2 (index 3); int8 with scale 5/127 is within half a step
    kept = torch.tensor([False, True, False, True, False, True, False, False, False, False])
    assert torch.equal(y[~kept], torch.zeros(7))
    assert torch.allclose(y[kept], x[kept], atol=5 / 127 / 2 + 1e-7)
    assert y[1] == -5.0  # the block's absmax is exact


def test_topk_sizes_and_density():
    assert topk_count(1000, 0.1) == 100 and topk_count(5, 0.01) == 1 and topk_count(0, 0.5) == 0
    assert topk_count(7, 1.0) == 7
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    payload, meta = encode(x, "topk-int8")  # default density 0.1
    assert meta["k"] == 100 and len(payload) == 5 * 100 + 4 * 1
    assert wire_fraction("topk-int8:0.1") == pytest.approx(0.1 * (5 + 4 / 128) / 4)
    # a density of 1 keeps everything: int8 quality at every index
    y = decode(*encode(x, "topk-int8:1"), (1000,))
    assert float((y - x).abs().max()) <= float(x.abs().max()) / 127


@pytest.mark.parametrize("bad", ["topk-int8:0", "topk-int8:1.5", "topk-int8:x", "int8:0.1", "zstd"])
def test_topk_bad_codec_names(bad):
    with pytest.raises(CodecError):
        encode(torch.ones(4), bad)


def test_topk_decode_rejects_malformed_payloads():
    x = torch.arange(1.0, 11.0)
    payload, meta = encode(x, "topk-int8:0.3")
    with pytest.raises(CodecError, match="bytes"):
        decode(payload[:-1], meta, (10,))
    with pytest.raises(CodecError, match="keeps"):
        decode(payload, {**meta, "k": 11}, (10,))
    # indices out of range or repeated are refused before any value is written
    idx = bytearray(payload)
    idx[0:4] = (10).to_bytes(4, "little")
    with pytest.raises(CodecError, match="indices"):
        decode(bytes(idx), meta, (10,))
    dup = bytearray(payload)
    dup[4:8] = dup[0:4]
    with pytest.raises(CodecError, match="indices"):
        decode(bytes(dup), meta, (10,))
    # through the frame layer it is a WireError naming the tensor
    frame = encode_tensor("w", x, "topk-int8:0.3")
    assert frame.codec == "topk-int8"
    frame.data = frame.data[:-2]
    with pytest.raises(WireError, match="'w'"):
        decode_tensor(frame, shape=(10,), dtype="float32")


# ---------------------------------------------------------------------------- error feedback, toy problem


@pytest.mark.parametrize("codec", ["int8", "topk-int8:0.05"])
def test_error_feedback_converges_on_a_quadratic(codec):
    """Gradient descent on f(w) = |w - t|^2 / 2 with compressed gradients and error feedback
    (lr 0.1, 400 steps): w reaches t to 1e-5 relative, as uncompressed descent does."""
    t = torch.randn(512, generator=torch.Generator().manual_seed(0))
    ef = ErrorFeedback(codec)
    w = torch.zeros(512)
    for _ in range(400):
        payload, meta = ef.encode("w", w - t)
        w = w - 0.1 * decode(payload, meta, (512,))
    assert float((w - t).norm() / t.norm()) < 1e-5


def test_topk_error_feedback_sends_the_small_coordinates_eventually():
    """A constant gradient [1, 0.01 x 9] sent 300 times with top-1 of 10: without error
    feedback the small coordinates are never sent (sum [300, 0 ...]); with it, each of them is
    sent once its residual outgrows the large one, and what was sent sums to 300 x the
    gradient minus a residual that stays bounded (below 1.5 per entry, not growing with steps)."""
    g = torch.tensor([1.0] + [0.01] * 9)
    ef = ErrorFeedback("topk-int8:0.1")
    sent_ef, sent_plain = torch.zeros(10), torch.zeros(10)
    for _ in range(300):
        sent_ef += decode(*ef.encode("g", g), (10,))
        sent_plain += decode(*encode(g, "topk-int8:0.1"), (10,))
    assert torch.equal(sent_plain[1:], torch.zeros(9))
    assert torch.allclose(sent_ef + ef.residual("g"), 300 * g, atol=1e-3)
    assert float(ef.residual("g").abs().max()) < 1.5 and float(sent_ef[1:].min()) > 0.5


def test_error_feedback_residual_is_the_unsent_part_by_hand():
    ef = ErrorFeedback("topk-int8:0.5")
    payload, meta = ef.encode("x", torch.tensor([4.0, 1.0]))  # keeps 4 (exact: the block's absmax)
    assert torch.equal(decode(payload, meta, (2,)), torch.tensor([4.0, 0.0]))
    assert torch.equal(ef.residual("x"), torch.tensor([0.0, 1.0]))
    payload, meta = ef.encode("x", torch.tensor([0.0, 2.0]))  # 0 + 0, 2 + 1: keeps 3
    assert torch.equal(decode(payload, meta, (2,)), torch.tensor([0.0, 3.0]))
    assert torch.equal(ef.residual("x"), torch.zeros(2))


# ---------------------------------------------------------------------------- compressed pulls


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(300, generator=g), "b.w": torch.randn(7, 33, generator=g)}


def _pull(pd: PullDeltas, held: tuple[str, int], base) -> tuple[pb.WeightsReply, dict]:
    rep = pb.WeightsReply.FromString(pd.reply(*held))
    return rep, apply_pull(rep, {n: t for n, t in base.items()} if base else _weights(0), base, held)


@pytest.mark.parametrize("codec", ["int8", "topk-int8:0.2", "fp16"])
def test_pull_deltas_keep_every_replica_equal_to_the_reconstruction(codec):
    """Three workers pull a moving W through versions 0..5: one every version (deltas), one
    that skips versions (full pulls), a joiner at version 3. All hold R bit for bit; R stays
    within one codec error of W (error feedback on the server side)."""
    torch.manual_seed(0)
    w = _weights(1)
    pd = PullDeltas(codec)
    held: dict[str, tuple[tuple[str, int], dict | None]] = {"steady": (("", -1), None), "skipper": (("", -1), None)}
    kinds = []
    for version in range(6):
        pd.advance((version, 0, 0), 0, 2, w)
        pullers = ["steady"] + (["skipper"] if version % 2 == 0 else []) + (["joiner"] if version == 3 else [])
        for name in pullers:
            h, base = held.get(name, (("", -1), None))
            rep, new = _pull(pd, h, base)
            kinds.append((version, name, "delta" if rep.compress_delta else "full"))
            for n in new:
                assert torch.equal(new[n], pd.recon[n]), (version, name, n)
            held[name] = ((rep.compress_chain, rep.version), new)
        # W moves on by a small step, like an optimizer update
        w = {n: t + 0.01 * torch.randn_like(t) for n, t in w.items()}
    assert all(k[2] == "delta" for k in kinds if k[1] == "steady" and k[0] > 0)
    assert (4, "skipper", "full") in kinds and (3, "joiner", "full") in kinds
    assert kinds[0] == (0, "steady", "full")
    # R stays within one codec error of the W it was last advanced to
    pd.advance((6, 0, 0), 0, 2, w)
    for n in w:
        scale = float((w[n] - pd.recon[n]).abs().max())
        assert scale < 0.05, (n, scale)


def test_sparse_pull_deltas_are_one_stage_frame_and_deliver_what_they_drop():
    """Sparse pulls of exact weights (replica plans): the chain starts with the weights in fp32,
    each delta is one ``*stage`` frame of the whole stage that a worker applies to the same
    bits as the server's reconstruction, and with W standing still the later deltas bring R to
    W (what one delta dropped goes with the next)."""
    from shoal.runtime.sync.codecs import STAGE_FRAME

    g = torch.Generator().manual_seed(3)
    w = {"a": torch.randn(20000, generator=g), "b.w": torch.randn(64, 129, generator=g)}
    pd = PullDeltas("sparse:0.05:2")
    pd.advance((0, 0, 0), 0, 2, w)
    rep = pb.WeightsReply.FromString(pd.reply("", -1))
    held = apply_pull(rep, w, None, ("", -1))
    assert {f.codec for f in rep.params} == {"raw"} and all(torch.equal(held[n], w[n]) for n in w)
    chain = rep.compress_chain
    moved = {n: t + 0.1 * torch.randn_like(t) for n, t in w.items()}
    gaps = []
    for v in range(1, 40):
        pd.advance((v, 0, 0), 0, 2, moved)
        rep, held = _pull(pd, (chain, v - 1), held)
        assert rep.compress_delta and [f.name for f in rep.params] == [STAGE_FRAME]
        assert all(torch.equal(held[n], pd.recon[n]) for n in w)
        gaps.append(max(float((moved[n] - held[n]).abs().max()) for n in w))
    whole = sum(t.numel() for t in w.values()) * 2
    assert rep.ByteSize() * 10 < whole  # a delta: a few % of the stage in bf16
    assert gaps[-1] < 0.05 * gaps[0], gaps


def test_pull_chain_start_is_compressed_and_later_fulls_are_fp32():
    w = _weights(2)
    pd = PullDeltas("int8")
    pd.advance((0, 0, 0), 0, 2, w)
    rep = pb.WeightsReply.FromString(pd.reply("", -1))
    assert not rep.compress_delta and {f.codec for f in rep.params} == {"int8"}
    n_int8 = rep.ByteSize()
    pd.advance((1, 0, 0), 0, 2, {n: t + 0.1 for n, t in w.items()})
    delta = pb.WeightsReply.FromString(pd.reply(rep.compress_chain, 0))
    assert delta.compress_delta and delta.compress_base == 0 and {f.codec for f in delta.params} == {"int8"}
    full = pb.WeightsReply.FromString(pd.reply("", -1))
    assert not full.compress_delta and {f.codec for f in full.params} == {"raw"}
    assert full.ByteSize() > 2.5 * n_int8  # 4 vs ~1 byte per element plus int8 meta
    # a delta against anything but (chain, base) is refused, not applied
    with pytest.raises(WireError, match="does not hold"):
        apply_pull(delta, w, w, ("other-chain", 0))
    with pytest.raises(WireError, match="does not hold"):
        apply_pull(delta, w, w, (rep.compress_chain, 1))
    # a new epoch starts a new chain: the old chain's holders get a full pull
    pd.advance((1, 1, 0), 0, 2, w)
    again = pb.WeightsReply.FromString(pd.reply(rep.compress_chain, 0))
    assert not again.compress_delta and again.compress_chain != rep.compress_chain


def test_pull_reconstruction_tracks_the_weights_without_drift():
    """W moves by many small steps smaller than one int8 step: without server-side feedback R
    would never move; with it R - W stays below one quantisation step of the delta's range."""
    w = {"a": torch.linspace(-1, 1, 1024)}
    pd = PullDeltas("int8")
    pd.advance((0, 0, 0), 0, 1, w)
    for v in range(1, 50):
        w = {"a": w["a"] + 1e-4}
        pd.advance((v, 0, 0), 0, 1, w)
    gap = float((pd.recon["a"] - w["a"]).abs().max())
    assert gap < 1e-4, gap  # 49 steps of 1e-4 moved W by 4.9e-3; R followed


# ---------------------------------------------------------------------------- the run setting


def test_run_compression_parse_and_spec_round_trip():
    assert parse_run_compression(None).off and parse_run_compression("none").off
    c = parse_run_compression("int8")
    assert (c.act, c.grad, c.push, c.pull) == ("int8",) * 4 and c.wire("act") == "int8"
    c = parse_run_compression("act=fp16,push=topk-int8:0.05")
    assert (c.act, c.grad, c.push, c.pull) == ("fp16", "none", "topk-int8:0.05", "none")
    assert c.wire("grad") == "raw" and c.text() == "act=fp16,grad=none,push=topk-int8:0.05,pull=none"
    spec = pb.RunSpec()
    c.to_spec(spec)
    assert spec.compress_act == "fp16" and spec.compress_grad == "" and compression_of_spec(spec) == c
    assert compression_of_spec(pb.RunSpec()) == RunCompression()
    assert parse_run_compression(c.text()) == c


@pytest.mark.parametrize("bad, msg", [("act=topk-int8", "only for push or pull"), ("zip", "unknown codec"),
                                      ("acts=int8", "KIND=CODEC"), ("topk-int8", "top-k only applies")])
def test_run_compression_bad_text_is_one_line(bad, msg):
    with pytest.raises(ShoalError, match=msg) as e:
        parse_run_compression(bad)
    assert "\n" not in str(e.value)


def test_launch_cli_bad_compression_exits_2(tmp_path, capsys):
    from shoal.cli import main

    assert main(["launch", "--out", str(tmp_path / "r"), "--compression", "act=topk-int8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "only for push or pull" in err and err.count("\n") == 1


def test_received_activation_hands_lossy_frames_on_and_raw_ones_as_their_bytes():
    """A lossy result or relay goes on as received; a raw one goes on as its own bytes under the
    server's name (byte for byte the frame that decoding and encoding it again made), and its
    tensor is a view of those bytes, not a copy. Its size for timeouts and threads is read from
    its shape, not its payload."""
    t = torch.randn(2, 3, 4)
    lossy = encode_tensor("out", t, "int8")
    got, kept = received_activation(payload_frame(lossy), "act", shape=(2, 3, 4), dtype="float32", finite=True)
    assert torch.equal(got, decode_tensor(lossy))
    sent = pb.Relay()
    put_frame(sent.tensor, kept)
    assert sent.tensor == lossy  # as received, its own name included
    assert frame_capacity(lossy) == 4 * t.numel() > len(lossy.data)
    for dtype, x in (("float32", t), ("bfloat16", t.bfloat16())):
        raw = encode_tensor("out", x)
        assert frame_capacity(raw) == frame_capacity(payload_frame(raw)) == len(raw.data)
        got, kept = received_activation(payload_frame(raw), "act", shape=(2, 3, 4), dtype=dtype, finite=True)
        assert torch.equal(got, x)
        assert got.data_ptr() == np.frombuffer(kept.data, dtype=np.uint8).ctypes.data  # a view of the kept bytes
        sent = pb.Relay()
        put_frame(sent.tensor, kept)
        assert sent.tensor.SerializeToString() == encode_tensor("act", x).SerializeToString()
    with pytest.raises(WireError, match="shape"):
        received_activation(payload_frame(encode_tensor("out", t)), "act", shape=(2, 3, 5), dtype="float32",
                            finite=True)
    bad = t.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(WireError, match="inf or NaN"):
        received_activation(payload_frame(encode_tensor("out", bad)), "act", shape=(2, 3, 4), dtype="float32",
                            finite=True)
    assert torch.isnan(received_activation(payload_frame(encode_tensor("out", bad)), "grad", shape=(2, 3, 4),
                                           dtype="float32", finite=False)[0]).any()
    into = pb.Tensor(name="old", shape=[9])
    put_frame(into, lossy)
    assert into == lossy


def test_a_lossy_relay_is_kept_undecoded_until_a_check_reads_it():
    """A peer server's relay (``checked``) of a lossy frame has only its header checked: the
    server hands the bytes on as received and decodes them only for a check's recomputation
    (wire.tensor_of, once, the same bits as decoding on arrival); a wrong shape or dtype is
    still refused at once. Raw relays are unchanged (a view of their bytes)."""
    from shoal.net.wire import Undecoded, tensor_of

    t = torch.randn(2, 3, 4)
    lossy = encode_tensor("out", t, "int8")
    got, kept = received_activation(payload_frame(lossy), "input", shape=(2, 3, 4), dtype="float32", finite=True,
                                    checked=True)
    assert isinstance(got, Undecoded) and got._tensor is None  # nothing decoded on arrival
    sent = pb.Relay()
    put_frame(sent.tensor, kept)
    assert sent.tensor == lossy
    once = tensor_of(got)
    assert torch.equal(once, decode_tensor(lossy)) and tensor_of(got) is once
    for shape, dtype, what in (((2, 3, 5), "float32", "shape"), ((2, 3, 4), "bfloat16", "dtype")):
        with pytest.raises(WireError, match=what):
            received_activation(payload_frame(lossy), "input", shape=shape, dtype=dtype, finite=True, checked=True)
    raw, _ = received_activation(payload_frame(encode_tensor("out", t)), "input", shape=(2, 3, 4), dtype="float32",
                                 finite=True, checked=True)
    assert isinstance(raw, torch.Tensor) and torch.equal(raw, t) and tensor_of(raw) is raw and tensor_of(None) is None


# ---------------------------------------------------------------------------- a real swarm

RUN = dict(model="tiny", micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_local_h4_int8_swarm_tracks_exact_training(tmp_path):
    """``--sync local --sync-every 4 --compression int8`` on S=2, W=4 (two replicas per stage),
    12 steps. Exact training is the local trainer (exact swarms reproduce it bitwise,
    tests/test_runtime.py); the untrained model is the same run at lr 1e-12 (same batches).
    Bounds that can fail: the last 3 steps' mean loss is within 3 % of exact's and closer to
    it than the untrained model's by a factor of 4; every tensor on the wire in both
    directions uses int8 (no fp32 activation, gradient or pull frame after the first pulls)."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.local import TrainConfig, train_local
    from shoal.train.metrics import read_jsonl

    steps = 12
    exact = train_local(TrainConfig(**RUN, steps=steps, out=str(tmp_path / "ref"), eval_every=0, eval_batches=1),
                        quiet=True)
    # lr 1e-12 (0 is refused): the weights do not move, so these are the untrained model's losses
    untrained = train_local(TrainConfig(**{**RUN, "lr": 1e-12}, steps=steps, out=str(tmp_path / "lr0"), eval_every=0,
                                        eval_batches=1), quiet=True)
    out = tmp_path / "run"
    summary = launch(LaunchConfig(out=str(out), **RUN, steps=steps, stages=2, workers=4, dead_after_s=3.0,
                                  min_lease_s=1.5, timeout_s=280, ckpt_every=0, sync="local", sync_every=4,
                                  compression="int8"))
    recs = read_jsonl(out / "metrics.jsonl")
    assert len(recs) == steps

    def tail(losses: list[float]) -> float:
        return sum(losses[-3:]) / 3

    got = tail([r["loss"] for r in recs])
    ref = tail([r["loss"] for r in exact.records])
    base = tail([r["loss"] for r in untrained.records])
    print(f"final loss (mean of last 3): local H=4 int8 {got:.4f}, exact {ref:.4f}, untrained {base:.4f}")
    assert math.isfinite(got) and base - ref > 0.2, (base, ref)  # the run is long enough to learn something
    assert abs(got - ref) <= 0.03 * ref, (got, ref, base)
    assert abs(got - ref) * 4 < base - ref, (got, ref, base)
    # what crossed the wire: every activation and activation-gradient frame int8 (workers and
    # relaying servers), every push int8, pulls int8 apart from fp32 full pulls of joiners
    by_codec = summary["bytes_by_codec"]
    for kind in ("activations", "activation_grads", "grad_push"):
        assert set(by_codec[kind]) == {"int8"}, (kind, by_codec[kind])
    assert by_codec["weight_pull"]["int8"]["messages"] > 0
    by_role = summary["bytes_by_role"]
    assert by_role["server"]["activations"]["wire"] * 3.5 < by_role["server"]["activations"]["raw"]
    # the replicas of a stage hold the same weights after every merged pull (logged digests)
    pulled: dict[int, set[str]] = {}
    for p in (out / "logs").glob("worker*.log"):
        for m in re.finditer(r"pulled merged weights v(\d+) digest ([0-9a-f]+)", p.read_text()):
            if int(m.group(1)) > 0:
                pulled.setdefault(int(m.group(1)), set()).add(m.group(2))
    assert pulled and all(len(d) <= 2 for d in pulled.values()), pulled  # one digest per stage
    json.dumps(summary)  # the summary stays plain data


# ---------------------------------------------------------------------------- the worker's side, in-process


def _local_worker(compression: str):
    from shoal.runtime.common import model_config
    from shoal.runtime.roles.worker import Worker, WorkerOptions

    w = Worker("unused:0", "tok", WorkerOptions())
    w.spec = pb.RunSpec(model="tiny", stages=2, steps=8, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                        data="synthetic", sync_mode="local", sync_every=4, outer_lr=0.7, outer_momentum=0.9)
    parse_run_compression(compression).to_spec(w.spec)
    w.cfg = model_config(w.spec)
    w.member_id = "A"
    w._switch(1, 1, 2)
    return w


def test_worker_pseudo_gradients_carry_error_feedback_across_rounds():
    """Two rounds of a replica that moved by the same delta each round, pushed with top-k 10 %:
    the decoded pushes sum to the two deltas minus the residual the worker keeps, and the second
    push carries part of what the first dropped."""
    from shoal.net.wire import decode_tensor

    w = _local_worker("act=int8,grad=int8,push=topk-int8:0.1,pull=int8")
    assert w.pseudo_ef is not None and w.pseudo_ef.codec == "topk-int8:0.1"
    torch.manual_seed(0)
    moves = {n: 0.01 * torch.randn_like(p) for n, p in w.params.items()}
    sent = {n: torch.zeros_like(p) for n, p in w.params.items()}
    for round_v in (4, 8):
        w.anchor = {n: p.detach().clone() for n, p in w.params.items()}
        with torch.no_grad():
            for n, p in w.params.items():
                p.sub_(moves[n])  # the replica moved by -move: its pseudo-gradient is +move
        _, data, _ = w._pseudo_message(0, round_v - 1, 1, round_v)
        msg = pb.GradPush.FromString(data)  # the push as sent
        assert msg.local_round == round_v
        for frame in msg.grads:
            assert frame.codec == "topk-int8"
            sent[frame.name] += decode_tensor(frame, dtype="float32").reshape(sent[frame.name].shape)
    for n in w.params:
        assert torch.allclose(sent[n] + w.pseudo_ef.residual(n), 2 * moves[n], atol=1e-6), n
    # the same worker without compression sends raw fp32 pseudo-gradients, as before
    assert _local_worker("none").pseudo_ef is None


def test_worker_delta_pull_onto_its_anchor_matches_the_server_reconstruction():
    """Local mode: the replica has moved on since its last pull; a delta pull is added to the
    anchor (the weights pulled last), not to the moved replica, giving exactly the server's R."""
    w = _local_worker("int8")
    pd = PullDeltas("int8")
    server_w = {n: torch.randn_like(p) for n, p in w.params.items()}
    pd.advance((0, 0, 1), 1, 2, server_w)
    w._apply_weights(pb.WeightsReply.FromString(pd.reply("", -1)))
    w.anchor = {n: p.detach().clone() for n, p in w.params.items()}
    assert w.pull_held == (pd.chain, 0)
    with torch.no_grad():
        for p in w.params.values():
            p.add_(1.0)  # inner steps moved the replica
    pd.advance((4, 0, 1), 1, 2, {n: t + 0.05 for n, t in server_w.items()})
    rep = pb.WeightsReply.FromString(pd.reply(*w.pull_held))
    assert rep.compress_delta
    w._apply_weights(rep)
    for n, p in w.params.items():
        assert torch.equal(p.detach(), pd.recon[n]), n
    assert w.pull_held == (pd.chain, 4)
    # a delta it cannot apply (it holds another version) is refused and the next pull is full
    with pytest.raises(WireError):
        w._apply_weights(rep)
    assert w.pull_held == ("", -1)
