"""Local mode with sparse pushes and pulls: the pull is the merged sparse update, applied by the
server to its own weights and by every worker to its replica, bit for bit; a real swarm."""

from __future__ import annotations

import json
import re

import pytest
import torch

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import WireError
from shoal.runtime.sync.codecs import (
    STAGE_FRAME,
    UpdatePulls,
    apply_pull,
    parse_run_compression,
    split_stage_frame,
    uses_update_pulls,
)
from shoal.train.outer import outer_nesterov_step, outer_nesterov_update


def _local_worker(compression: str, name: str):
    from shoal.runtime.common import model_config
    from shoal.runtime.roles.worker import Worker, WorkerOptions

    w = Worker("unused:0", "tok", WorkerOptions(name=name))
    w.spec = pb.RunSpec(model="tiny", stages=2, steps=40, micro_batches=2, micro_batch_size=2, seq_len=16, seed=0,
                        data="synthetic", sync_mode="local", sync_every=4, outer_lr=0.7, outer_momentum=0.9)
    parse_run_compression(compression).to_spec(w.spec)
    w.cfg = model_config(w.spec)
    w.member_id = name
    w._switch(1, 1, 2)
    return w


def test_outer_update_is_the_outer_step():
    torch.manual_seed(0)
    p = {"a": torch.randn(50)}
    d = {"a": torch.randn(50)}
    m1: dict = {}
    m2: dict = {}
    q = {"a": p["a"].clone()}
    for _ in range(3):
        outer_nesterov_step(q, d, m1, 0.7, 0.9)
        u = outer_nesterov_update(d, m2, 0.7, 0.9)
        p["a"] -= u["a"]
        assert torch.equal(m1["a"], m2["a"])
    assert torch.allclose(p["a"], q["a"], atol=1e-6)


@pytest.mark.parametrize("codec", ["sparse", "lowrank"])
def test_update_pulls_keep_every_replica_equal_to_the_server_bitwise(codec):
    """Workers pull merges 0..6 as the production code applies them (Worker._apply_weights
    onto the anchor): one every merge (update frames only), one that skips merges (fp32 once,
    then updates again), a joiner. After every pull each holds the server's weights bit for
    bit; the server's weights moved by exactly the decoded updates."""
    assert uses_update_pulls(_local_worker(codec, "x").spec)
    steady, skipper = _local_worker(codec, "steady"), _local_worker(codec, "skipper")
    joiner = None
    server = {n: torch.randn_like(p) for n, p in steady.params.items()}
    up = UpdatePulls(codec)
    momentum: dict = {}
    kinds = []
    torch.manual_seed(1)
    for v in range(7):
        if v > 0:
            # the round's merged pseudo-gradient (what the workers would push), its outer update
            delta = {n: 1e-3 * torch.randn_like(p) for n, p in server.items()}
            before = {n: t.clone() for n, t in server.items()}
            update = outer_nesterov_update(delta, momentum, 0.7, 0.9)
            up.merge(server, update, (v - 1, 0, 1), (v, 0, 1), 1, 2)
            rep = pb.WeightsReply.FromString(up.delta_bytes)
            # one frame for the whole stage; the server moved by exactly its decoded update
            assert rep.compress_delta and [(f.name, f.codec) for f in rep.params] == [(STAGE_FRAME, codec)]
            dec = split_stage_frame(rep.params[0], server)
            for n, d in dec.items():
                assert torch.equal(server[n], before[n] + d)
            numel = sum(t.numel() for t in server.values())
            if codec == "sparse":
                assert sum(int((d != 0).sum()) for d in dec.values()) <= -(-numel // 4096) * 41
            else:  # every matrix's update is of rank 3 at most
                assert all(torch.linalg.matrix_rank(d) <= 3 for d in dec.values() if d.dim() == 2 and min(d.shape) > 8)
        up.sync((v, 0, 1), 1, 2)
        pullers = [steady] + ([skipper] if v % 3 == 0 else [])
        if v == 4:
            joiner = _local_worker(codec, "joiner")
            pullers.append(joiner)
        for w in pullers:
            rep = pb.WeightsReply.FromString(up.reply(*w.pull_held, server))
            kinds.append((v, w.opts.name, "update" if rep.compress_delta else "full"))
            w._apply_weights(rep)
            w.version = rep.version
            w.anchor = {n: p.detach().clone() for n, p in w.params.items()}
            with torch.no_grad():  # inner steps move the replica; the anchor stays
                for p in w.params.values():
                    p.add_(0.01)
            for n, t in w.anchor.items():
                assert torch.equal(t, server[n]), (v, w.opts.name, n)
    assert all(k == "update" for v, who, k in kinds if who == "steady" and v > 0)
    assert (0, "steady", "full") in kinds and (3, "skipper", "full") in kinds and (4, "joiner", "full") in kinds
    assert (6, "skipper", "full") in kinds  # it missed merges 4 and 5: its chain does not match
    # a full pull is fp32; an update pull is >= 100x smaller than the stage in bf16
    full = pb.WeightsReply.FromString(up.reply("", -1, server))
    assert {f.codec for f in full.params} == {"raw"}
    numel = sum(t.numel() for t in server.values())
    upd = sum(len(f.data) for f in pb.WeightsReply.FromString(up.delta_bytes).params)
    assert 2 * numel / upd >= 100, 2 * numel / upd  # payload only; the frame adds ~80 bytes of header
    # an update against a version the worker does not hold is refused, never applied
    with pytest.raises(WireError, match="does not hold"):
        apply_pull(pb.WeightsReply.FromString(up.delta_bytes), steady.params, steady.anchor, (up.chain, 2))


def test_update_pulls_carry_the_server_residual():
    """Error feedback on the server: the weights move by the sum of the updates minus the
    residual still held, and a merge without contributors still sends part of it."""
    up = UpdatePulls("sparse")
    w = {"a": torch.zeros(3 * 4096), "b": torch.zeros(10)}
    total = torch.zeros(3 * 4096, dtype=torch.float64)
    torch.manual_seed(2)
    up.sync((0, 0, 0), 0, 1)
    for v in range(1, 30):
        u = {"a": 1e-3 * torch.randn(3 * 4096) + 1e-3, "b": torch.zeros(10)}
        total += u["a"].double()
        up.merge(w, u, (v - 1, 0, 0), (v, 0, 0), 0, 1)
        r = up.ef.residual(STAGE_FRAME).double()[: 3 * 4096]  # "a" comes first in the stage frame
        assert torch.allclose(-w["a"].double(), total + r, atol=1e-5)  # r: what -u did not carry yet
    r_before = up.ef.residual(STAGE_FRAME).norm()
    up.merge(w, None, (29, 0, 0), (30, 0, 0), 0, 1)
    assert up.ef.residual(STAGE_FRAME).norm() < r_before
    # The run's last, dense round: what the pulls still owed goes into the weights, and the
    # chain ends (a worker holding v30 gets the weights in fp32, not an update).
    chain = up.chain
    up.flush(w)
    assert torch.allclose(-w["a"].double(), total, atol=1e-5) and up.ef.residual(STAGE_FRAME) is None
    full = pb.WeightsReply.FromString(up.reply(chain, 30, w))
    assert not full.compress_delta and {f.codec for f in full.params} == {"raw"}


def test_replica_keeps_what_its_push_left_and_the_last_round_is_dense():
    """keeps_residual: a sparse push's pseudo-gradient is not topped up from an error-feedback
    buffer; what it leaves is kept for the replica (pushed + kept = the pseudo-gradient). The
    run's last round (dense_round) pushes the whole pseudo-gradient in int8 (DENSE_ROUND_CODEC)."""
    from shoal.net.wire import decode_tensor
    from shoal.runtime.sync.codecs import dense_round, keeps_residual

    assert keeps_residual("sparse:0.01:2") and not keeps_residual("int8") and not keeps_residual("raw")
    assert [dense_round(v, 40, "sparse") for v in (4, 39, 40)] == [False, False, True]
    assert not dense_round(40, 40, "int8")
    w = _local_worker("sparse", "w")
    torch.manual_seed(3)
    w.anchor = {n: p.detach().clone() for n, p in w.params.items()}
    with torch.no_grad():
        for p in w.params.values():
            p.add_(1e-3 * torch.randn_like(p))
    deltas = {n: w.anchor[n] - p.detach() for n, p in w.params.items()}
    for round_v in (4, 8):  # the second push again carries no residual of the first
        msg = pb.GradPush.FromString(w._pseudo_message(0, round_v - 1, 0, round_v)[1])  # as sent
        assert [(f.name, f.codec) for f in msg.grads] == [(STAGE_FRAME, "sparse")] and not msg.local_weights
        sent = split_stage_frame(msg.grads[0], w.params)
        epoch, kept_round, kept, _ = w.pseudo_kept
        assert (epoch, kept_round) == (0, round_v) and w.pseudo_ef.residual(STAGE_FRAME) is None
        for n, d in deltas.items():
            assert torch.allclose(sent[n] + kept[n], d, atol=1e-7)
        assert sum(int((t != 0).sum()) for t in sent.values()) < sum(t.numel() for t in deltas.values()) // 50
    msg = pb.GradPush.FromString(w._pseudo_message(0, 39, 0, 40)[1])  # steps=40: the last round, as sent
    assert {f.codec for f in msg.grads} == {"int8"} and len(msg.grads) == len(deltas) and not msg.local_weights
    for f in msg.grads:  # the whole pseudo-gradient (what the replica kept included), int8's error only
        d = deltas[f.name]
        assert torch.allclose(decode_tensor(f), d, atol=float(d.abs().max()) / 100 + 1e-12), f.name


def test_residual_reweight_is_the_ratio_of_counts_clamped():
    from shoal.runtime.sync.codecs import RESIDUAL_REWEIGHT_MAX, residual_reweight

    assert residual_reweight(6, 10) == 0.6 and residual_reweight(10, 8) == 1.25 and residual_reweight(7, 7) == 1.0
    assert residual_reweight(16, 1) == RESIDUAL_REWEIGHT_MAX and residual_reweight(1, 16) == 1 / RESIDUAL_REWEIGHT_MAX
    assert residual_reweight(0, 5) == 1.0 and residual_reweight(5, 0) == 1.0


@pytest.mark.parametrize("codec", ["lowrank", "sparse"])
def test_a_kept_residual_is_merged_at_the_share_it_was_made_at(codec):
    """The worker's own push path (_pseudo_message, _local_restart) over rounds whose shares of
    the round's 16 micro-batches move (6, 10, 9, 7): with the kept residual re-weighted, what the
    merge takes from this worker (share x what was sent, summed over rounds) is its progress at
    each round's share, less only the last residual at the last share; without it, each residual
    counts at the next round's share instead."""
    w = _local_worker(codec, "w")
    torch.manual_seed(4)
    counts = [6, 10, 9, 7]
    merged = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in w.params.items()}
    meant = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in w.params.items()}
    w.anchor = {n: p.detach().clone() for n, p in w.params.items()}
    kept_at = []  # (share, kept residual) of each round
    for r, n_mbs in enumerate(counts):
        round_v = 4 * (r + 1)
        progress = {n: 1e-3 * torch.randn_like(p) for n, p in w.params.items()}
        with torch.no_grad():
            for n, p in w.params.items():
                p.sub_(progress[n])  # the replica's inner steps: the pseudo-gradient grows by progress
        w.local_round_mbs = n_mbs
        msg = pb.GradPush.FromString(w._pseudo_message(0, round_v - 1, 0, round_v)[1])  # as sent
        sent = split_stage_frame(msg.grads[0], w.params)
        share = n_mbs / 16
        for n in merged:
            merged[n] += share * sent[n].double()
            meant[n] += share * progress[n].double()
        _, _, kept, kept_mbs = w.pseudo_kept
        assert kept_mbs == n_mbs
        kept_at.append((share, kept))
        # the pull of that round's merge: the replica restarts from the merged weights (here the
        # anchor moved by nothing) less what its push did not carry
        w.version, w.weights_epoch = round_v, 0
        with torch.no_grad():
            for n, p in w.params.items():
                p.copy_(w.anchor[n])
        w._local_restart(*w._anchor_copies())
        assert w.pseudo_carried[0] == n_mbs
    share, kept = kept_at[-1]
    miss = 0.0
    for n in merged:
        want = meant[n] - share * kept[n].double()
        assert torch.allclose(merged[n], want, atol=1e-6), (n, float((merged[n] - want).abs().max()))
        # unweighted, each residual would count at the next round's share (6/16 at 10/16, ...)
        unweighted = want + sum((s1 - s0) * k0[n].double() for (s0, k0), (s1, _) in zip(kept_at[:-1], kept_at[1:], strict=True))
        miss = max(miss, float((merged[n] - unweighted).abs().max()))
    assert miss > 1e-4  # the tolerance above is a hundredth of the difference it checks for


def test_a_resumed_server_sends_what_its_pulls_still_owed(tmp_path):
    """The server's pull residual is checkpointed: saved by save_stage_ckpt, restored by the
    server's own load (StageServer._make), a fresh UpdatePulls continues with the same frames
    bit for bit as one that never stopped."""
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.common import save_stage_ckpt
    from shoal.runtime.roles.server import StageServer
    from shoal.train.optim import OptimConfig, make_optimizer

    module = build_stage(get_preset("tiny"), 0, 2, seed=1)
    opt = make_optimizer(module.named_parameters(), OptimConfig())
    params = dict(module.named_parameters())
    torch.manual_seed(3)
    updates = [{n: 1e-3 * torch.randn_like(p) for n, p in params.items()} for _ in range(4)]
    up = UpdatePulls("sparse")
    with torch.no_grad():
        for v in range(1, 3):
            up.merge(params, updates[v - 1], (v - 1, 0, 0), (v, 0, 0), 0, 2)
    assert up.ef.state() and up.ef.residual(STAGE_FRAME).norm() > 0
    save_stage_ckpt(tmp_path, 0, 2, module, opt, run_id="r1", layers=(0, 2), pull_ef=up.ef.state())
    srv = StageServer("127.0.0.1:1", "127.0.0.1:0", "tok", str(tmp_path))
    srv.spec = pb.RunSpec(model="tiny", stages=1, steps=8, seed=1, lr=3e-3, run_id="r1", sync_mode="local")
    _, module2, _, _, _, pull_ef = srv._make(0, 0, 2, 2)
    resumed = UpdatePulls("sparse")
    resumed.ef.load(pull_ef)
    params2 = dict(module2.named_parameters())
    fresh = UpdatePulls("sparse")  # without the residual the frames differ: the test can fail
    fresh_params = {n: p.detach().clone() for n, p in params2.items()}

    def frames(u: UpdatePulls) -> list[bytes]:
        return [f.SerializeToString() for f in pb.WeightsReply.FromString(u.delta_bytes).params]

    with torch.no_grad():
        fresh.merge(fresh_params, updates[2], (2, 0, 0), (3, 0, 0), 0, 2)
        for v in range(3, 5):
            up.merge(params, updates[v - 1], (v - 1, 0, 0), (v, 0, 0), 0, 2)
            resumed.merge(params2, updates[v - 1], (v - 1, 0, 0), (v, 0, 0), 0, 2)
            assert frames(up) == frames(resumed)
            if v == 3:
                assert frames(fresh) != frames(up)
    assert all(torch.equal(params[n], params2[n]) for n in params)


def _digests(out):
    """{(stage, version): server digest} and the workers' {(version): {digests}} from the logs."""
    merges = {}
    for p in (out / "logs").glob("server*.log"):
        for m in re.finditer(r"local merge (\{.*\})", p.read_text()):
            d = json.loads(m.group(1))
            merges[(d["stage"], d["version"])] = d["digest"]
    pulled: dict[int, set[str]] = {}
    for p in (out / "logs").glob("worker*.log"):
        for m in re.finditer(r"pulled merged weights v(\d+) digest ([0-9a-f]+)", p.read_text()):
            pulled.setdefault(int(m.group(1)), set()).add(m.group(2))
    return merges, pulled


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["sparse", "lowrank"])
def test_local_sparse_swarm_replicas_equal_server_and_bytes(tmp_path, monkeypatch, codec):
    """``--sync local --sync-every 2 --compression sparse`` (and ``lowrank``) on S=2, W=4: every
    worker's pulled weights after a merge have the digest the server logged for that merge
    (bitwise equal), pushes and post-start pulls are frames of the codec, and the loss goes down.
    The ``lowrank`` run gives its servers no merge memory (``--merge-memory-gb 0``): every push
    waits as its frames and is decoded again where the screen and the merge read it, those of
    the dense last round (``int8``) on disk: received into files (the spool, here from 0.25 MB
    on, in chunks of that size), not written again."""
    from shoal.runtime.processes.launch import LaunchConfig, launch
    from shoal.train.metrics import read_jsonl

    run = dict(model="tiny", micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=3e-3, warmup=2)
    out = tmp_path / "run"
    if codec == "lowrank":
        monkeypatch.setenv("SHOAL_SPOOL_MB", "0.25")
    summary = launch(LaunchConfig(out=str(out), **run, steps=8, stages=2, workers=4, dead_after_s=3.0,
                                  min_lease_s=1.5, timeout_s=280, ckpt_every=0, sync="local", sync_every=2,
                                  compression=codec, merge_memory_gb=0.0 if codec == "lowrank" else None,
                                  chunk_mb=0.25 if codec == "lowrank" else None))
    recs = read_jsonl(out / "metrics.jsonl")
    assert len(recs) == 8 and recs[-1]["loss"] < recs[0]["loss"]
    merge_logs = [json.loads(m) for p in (out / "logs").glob("server*.log")
                  for m in re.findall(r"local merge (\{.*\})", p.read_text())]
    assert len(merge_logs) == 8  # 4 rounds x 2 stages
    assert all(m["merge_s"] > 0 for m in merge_logs)  # the screen and the merge, timed (cost.merge_cpu_time)
    # the merge takes the weighted sum the screen's read of the pushes made (verify.screen_measures)
    # wherever the screen left every push in (one it holds out makes other shares: summed again);
    # the digests below hold for those merges too
    assert any(m["screen_sum"] for m in merge_logs), merge_logs
    missed = [m for m in merge_logs if not m["screen_sum"] and set(m["screen"]) == set(m["shares"])]
    assert not missed, missed
    framed = [m.get("framed", 0) for m in merge_logs]
    if codec == "lowrank":  # every push received held as frames (the screen may leave one out of the merge)
        assert all(f >= max(1, len(m["contributors"])) for f, m in zip(framed, merge_logs, strict=True)), merge_logs
        # the last round's dense (int8) pushes on disk, the rounds' lowrank frames in memory
        assert all((m.get("spilled", 0) == m["framed"]) == (m["version"] == 8) for m in merge_logs), merge_logs
        assert all(m.get("spooled", 0) == m.get("spilled", 0) for m in merge_logs), merge_logs
    else:
        # (held decoded while the host keeps a fifth of its RAM free; when a suite's other tests
        # leave it less, as frames: sparse ones in memory, the dense last round's int8 on disk)
        assert all(not m.get("spilled") or m["version"] == 8 for m in merge_logs), merge_logs
    merges, pulled = _digests(out)
    assert {v for _, v in merges} == {2, 4, 6, 8}
    server_digests = {v: {d for (s, vv), d in merges.items() if vv == v} for v in (2, 4, 6)}
    checked = 0
    for v, ds in pulled.items():
        if v in server_digests:
            assert ds <= server_digests[v], (v, ds, server_digests[v])
            checked += len(ds)
    assert checked >= 4, pulled
    by_codec = summary["bytes_by_codec"]
    # Rounds 2-6 push sparse frames; the last (8) is dense (dense_round): int8, one a worker.
    sent = [int(v) for p in (out / "logs").glob("worker*.log")
            for v in re.findall(r"sent its pseudo-gradient for v(\d+)", p.read_text())]
    assert set(by_codec["grad_push"]) == {codec, "int8"}, by_codec["grad_push"]
    # (a push retried or not taken is counted again, never logged as sent)
    assert by_codec["grad_push"][codec]["messages"] >= len([v for v in sent if v < 8]) > 0, (by_codec, sent)
    for kind in ("grad_push", "weight_pull"):  # the rounds' frames: >= 100x fewer bytes than the stage in bf16
        c = by_codec[kind][codec]
        assert c["wire"] * 100 <= c["raw"] / 2, (kind, c)
    from shoal.model.config import get_preset
    from shoal.model.transformer import build_stage

    cfg = get_preset("tiny")
    with torch.device("meta"):
        model_bytes = 4 * sum(p.numel() for p in build_stage(cfg, 0, cfg.n_total_layers, init=False).parameters())
    dense = by_codec["grad_push"]["int8"]  # ("raw": the fp32 bytes it stands for)
    assert 0 < dense["raw"] <= sent.count(8) * model_bytes and dense["wire"] < dense["raw"] / 3.5, (dense, sent)
    assert by_codec["weight_pull"][codec]["messages"] > 0
    # the last round's whole pseudo-gradients are judged as such: no honest worker is banned
    assert not [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "ban"]
    print(json.dumps(by_codec, indent=1))
    # Exported after the dense last round: no caveat. The same weights read as a run still going
    # (its journal's spec says 100 steps): the export says they trail the replicas.
    from shoal.hf.export import export_hf

    assert export_hf(out, tmp_path / "hf")["caveat"] == ""
    journal = out / "journal.jsonl"
    lines = journal.read_text().splitlines()
    first = json.loads(lines[0])
    first["spec"]["steps"] = 100
    journal.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    caveat = export_hf(out, tmp_path / "hf2")["caveat"]
    assert caveat.startswith("step 8 is before the run's last, dense round (100)"), caveat


def test_stage_frame_splits_by_the_receivers_own_shapes():
    """One sparse frame for a stage: split by the receiver's parameters in name order; a frame
    of another stage (other element count) is a WireError, never a partial write."""
    from shoal.runtime.sync.codecs import stage_frame

    torch.manual_seed(3)
    t = {"layers.1.b": torch.randn(7), "layers.1.w": torch.randn(40, 300), "layers.2.w": torch.randn(5, 5)}
    frame = stage_frame(t, "sparse:1:8")  # keeps every entry: the split is checkable value by value
    got = split_stage_frame(frame, t)
    assert list(got) == sorted(t)
    for n in t:
        assert got[n].shape == t[n].shape
        assert torch.allclose(got[n], t[n], atol=max(float(v.abs().max()) for v in t.values()) / 100)  # per-chunk scales
    with pytest.raises(WireError):
        split_stage_frame(frame, {k: v for k, v in t.items() if k != "layers.2.w"})


def test_export_caveat_only_for_sparse_local_runs_before_their_end():
    from shoal.hf.export import export_caveat

    assert export_caveat({"sync_mode": "local", "compress_push": "sparse:0.01:2", "steps": 40}, 39)
    assert not export_caveat({"sync_mode": "local", "compress_push": "sparse", "steps": 40}, 40)
    assert not export_caveat({"sync_mode": "local", "compress_push": "int8", "steps": 40}, 10)
    assert not export_caveat({"compress_push": "sparse", "steps": 40}, 10)  # exact sync
    assert not export_caveat({}, 3)
