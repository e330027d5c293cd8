"""The worker's task computation and pacing charge, driven in-process (no sockets)."""

from __future__ import annotations

import torch

from shoal.model.transformer import build_stage
from shoal.net import shoal_pb2 as pb
from shoal.net.wire import encode_tensor
from shoal.runtime.common import model_config
from shoal.runtime.roles.worker import Worker, WorkerOptions, task_flops

M, B, T = 2, 2, 16


def test_task_flops_charges_recompute_only_when_it_happened():
    assert task_flops(pb.FWD, 3.0, 6.0, False) == 3.0
    assert task_flops(pb.FWDBWD, 3.0, 6.0, False) == 9.0
    assert task_flops(pb.BWD, 3.0, 6.0, False) == 9.0
    assert task_flops(pb.BWD, 3.0, 6.0, True) == 12.0


def _worker(graph_cache: bool) -> Worker:
    w = Worker("unused:0", "tok", WorkerOptions(graph_cache=graph_cache))
    w.spec = pb.RunSpec(model="tiny", stages=2, steps=2, micro_batches=M, micro_batch_size=B, seq_len=T,
                        seed=0, data="synthetic")
    w.cfg = model_config(w.spec)
    w._switch(1, 1, 2)  # a middle stage (one block): takes an input, returns one
    init = build_stage(w.cfg, 1, 2, seed=0)
    with torch.no_grad():
        for n, p in init.named_parameters():
            w.params[n].copy_(p)
    return w


def test_backward_reports_whether_it_recomputed():
    torch.manual_seed(0)
    x = torch.randn(B, T, model_config(pb.RunSpec(model="tiny")).d_model)
    g = torch.randn_like(x)
    res = {}
    for cache in (True, False):
        w = _worker(cache)
        fwd = pb.Task(step=0, mb=1, direction=pb.FWD, epoch=0, input=encode_tensor("x", x))
        _, _, grads, recomputed = w._compute(fwd)
        assert grads is None and not recomputed
        bwd = pb.Task(step=0, mb=1, direction=pb.BWD, epoch=0, input=encode_tensor("x", x),
                      out_grad=encode_tensor("g", g))
        in_grad, _, grads, recomputed = w._compute(bwd)
        assert recomputed is (not cache)
        assert w.graph_hits == (1 if cache else 0)
        res[cache] = (in_grad, grads)
    # The cached graph gives the same gradients as the recompute.
    assert torch.equal(res[True][0], res[False][0])
    for n in res[True][1]:
        assert torch.equal(res[True][1][n], res[False][1][n])


def test_lossy_gradient_pushes_use_error_feedback():
    from shoal.net.wire import decode_tensor

    assert Worker("unused:0", "tok", WorkerOptions()).ef is None  # raw: unchanged
    assert Worker("unused:0", "tok", WorkerOptions(codec="int8", error_feedback=False)).ef is None
    w = Worker("unused:0", "tok", WorkerOptions(codec="int8"))
    assert w.ef is not None and w.ef.codec == "int8"
    torch.manual_seed(0)
    g = torch.randn(4, 300)
    sent = torch.zeros_like(g)
    for _ in range(20):  # the same gradient pushed 20 times: sums track 20 g closely
        sent += decode_tensor(encode_tensor("p", g, "int8", ef=w.ef), dtype="float32")
    plain = 20 * decode_tensor(encode_tensor("p", g, "int8"), dtype="float32")
    err_ef = float((sent - 20 * g).abs().max())
    err_plain = float((plain - 20 * g).abs().max())
    assert err_ef < err_plain / 5, (err_ef, err_plain)
    assert float(w.ef.residual("p").abs().max()) > 0


def test_worker_push_path_carries_error_feedback():
    """Through Worker._push itself (a stand-in server records the pushes, no sockets):
    20 int8 pushes of the same gradient sum to 20 g far more closely than without error
    feedback, so the push path really hands its residuals to the codec."""
    import asyncio

    from shoal.net.stream import assemble
    from shoal.net.wire import decode_tensor

    class Recorder:
        def __init__(self):
            self.pushes = []

        async def PushGradsStream(self, chunks, timeout=None):
            # The worker streams its pushes in chunks: reassemble them as a server does.
            self.pushes.append(assemble(chunks, pb.GradPush, 1 << 24))
            return pb.PushReply(accepted=True, gen=0)

    torch.manual_seed(0)
    g = torch.randn(4, 300)

    def pushed_sum(error_feedback: bool) -> torch.Tensor:
        w = Worker("unused:0", "tok", WorkerOptions(codec="int8", error_feedback=error_feedback))
        w.spec, w.member_id, w.server = pb.RunSpec(ordered_grads=False), "A", Recorder()

        async def run():
            for step in range(20):
                w.acc_key, w.acc, w.acc_mbs = (0, step, 0), {"p": g.clone()}, [0]
                await w._push()

        asyncio.run(run())
        assert len(w.server.pushes) == 20 and w.acc_key is None
        return sum(decode_tensor(m.grads[0], dtype="float32") for m in w.server.pushes)

    err_ef = float((pushed_sum(True) - 20 * g).abs().max())
    err_plain = float((pushed_sum(False) - 20 * g).abs().max())
    assert err_ef < err_plain / 5, (err_ef, err_plain)


def test_idle_pull_only_for_a_served_version_the_worker_lacks():
    from shoal.runtime.roles.worker import idle_pull

    rep = pb.LeaseReply(has_task=False, version=3, step=3, epoch=1)
    assert idle_pull(rep, version=2, epoch=1)  # a newer version is served: pull while idle
    assert idle_pull(rep, version=3, epoch=0)  # same number, another epoch (a roll-back)
    assert not idle_pull(rep, version=3, epoch=1)  # already held
    assert not idle_pull(pb.LeaseReply(version=2, step=3, epoch=1), version=1, epoch=1)  # committing
    assert not idle_pull(pb.LeaseReply(version=-1, step=0, epoch=1), version=-1, epoch=-1)  # loading
