"""Analytic per-layer profile of the model: parameters, FLOPs, activations, memory.

The planner and the simulator reason with these numbers, so they are exact for
:mod:`shoal.model.transformer` (the tests compare them with the real modules):

* parameters: embedding ``V*d``; block ``4*d^2 + 3*d*f + 2*d``; head ``d*V + d``.
* forward FLOPs per token (a multiply-add is 2 FLOPs; element-wise work is ignored):
  block ``2*(4*d^2 + 3*d*f) + 4*T*d`` -- the last term is attention's ``QK^T`` and ``AV``
  over the full sequence of ``T`` tokens; head ``2*d*V``; embedding 0 (a lookup).
  Backward costs twice the forward (input and weight gradients); the embedding's is 0.
* output activation of a layer for one micro-batch of ``B`` sequences: ``B*T*d``
  elements (the head outputs a scalar loss; its input gradient is ``B*T*d`` again).
* activations saved for backward, per micro-batch, in bytes with ``b`` bytes per element:
  block ``B*T*(b*(12*d + 4*f + 2) + 4*H)`` (attention keeps an fp32 log-sum-exp per
  head), head ``B*T*(b*(3*d + 1) + 4*V + 8) + 4`` (one fp32 log-softmax shared by the
  loss, int64 targets, the scalar loss), embedding ``8*B*T`` (int64 ids). Below fp32
  (``b < 4``) each RMSNorm also keeps its fp32 input copy and fp32 statistic:
  ``(4-b)*(d+1)`` more bytes per token and norm (two norms per block, one in the head).
  These match what autograd keeps for our implementation (measured with
  ``torch.autograd.graph.saved_tensors_hooks`` in ``tests/test_profile.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from shoal.errors import ShoalError
from shoal.model.config import ModelConfig, layer_kind

ADAMW_STATE_BYTES_PER_PARAM = 8  # two fp32 moments per parameter
# What a worker holds on its device per parameter, whatever the compute dtype: autocast computes
# in fp16/bf16 from fp32 weights (4 bytes), backward leaves an fp32 gradient (4) and the step's
# gradients are summed apart from it (4: shoal.runtime.sync.ordered's folds), so that the sum
# is exact in any order of arrival. Counted in the compute dtype (4 bytes at fp16) instead,
# gpt-1.3b would seem to fit a 24 GB card whole in local mode; it needs 31 GB
# (bench/results/worker-memory.md).
WORKER_BYTES_PER_PARAM = 12
# What a stage server process really holds (peak resident memory, measured on real runs:
# bench/bench_server_memory.py, bench/results/server-memory.md): beyond its fp32 weights,
# summed gradient and AdamW state (16 bytes a parameter), the one shared serialisation of its
# weights for pulls, the step's pushes held until the commit, the end check's copy of the
# weights and, in local mode, the outer momentum, the screen's reference gradient, the merged
# update and its pull codec's reconstruction. Measured on gpt-125m stages (2 workers, M = 2):
# 56 bytes a parameter in exact sync (57 the most of one server); the figure leaves a margin
# over the largest (the peaks move between runs with when pushes, pulls and checkpoints meet).
SERVER_BYTES_PER_PARAM = 64
# In local mode a server holds no AdamW state and no step's pushes: 26-33.5 bytes a parameter on
# gpt-125m stages, 33 for a replica plan's server with no merge memory (two replicas of a 60-116 M
# parameter model) and 36-37 at most of one, with one push decoded at a time. What grows with its
# workers is bounded: a push of 16 MB or more is received into a file (shoal.net.stream.Spool:
# page cache, not the process), two are decoded at once on arrival
# (shoal.runtime.sync.local.DECODE_SLOTS: one more float32 copy of the stage, 4 bytes a
# parameter), pushes beyond the merge memory wait as frames or on disk, replica parts come one at
# a time, and the merge memory itself is what the host has free beyond a fifth of its RAM
# (shoal.runtime.sync.held). 37 + 4 + 1 of margin. With the screen's reference gradient on 4
# micro-batches (4 threads: a real run's; the runs above had 1-2), 31 a parameter beyond 553 MB
# (replica servers of 31-116 M parameters, M = 8; the most of one 28.2 beyond 1 GiB): the
# reference holds one copy of the stage however many threads compute it (each parameter's
# gradient added into one sum as autograd makes it), and what each round frees on its threads
# goes back to the system (shoal.memory.release_free). With a copy a thread the same servers
# took 35 beyond 748 MB, and without the release 56, above this figure. At gpt-1.3b's width
# (d2048: its matrices above shoal.memory's heap threshold, so freed copies leave the process)
# 25.4 beyond 568 MB, about 27 at most with two pushes decoding and a 512-token reference
# (bench/results/server-memory.md, 2026-12-06 02:47): the figure keeps its margin at both widths.
LOCAL_SERVER_BYTES_PER_PARAM = 42
# The interpreter, torch, gRPC and their threads, and what a stage's workers hold on it at once
# (their streams' buffers, the screen's samples of their pushes): 0.35-0.5 GB beside the
# per-parameter figure with a worker a stage, up to 1 GB with 4 or 8 (d768xL4 and d768xL8
# stages, bench_server_memory --workers-per-stage, 2026-12-05), the same for either size.
SERVER_PROCESS_BYTES = 2**30


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer for one micro-batch of ``B`` sequences of ``T`` tokens."""

    index: int  # global layer index (0 = embedding, n_layers + 1 = head)
    kind: str  # "embedding", "block" or "head"
    params: int  # number of parameters
    param_bytes: int  # bytes of the parameters in the compute dtype
    fwd_flops_per_token: int  # forward FLOPs per token
    bwd_flops_per_token: int  # backward FLOPs per token
    out_act_bytes: int  # bytes of the output activation (and of its gradient) per micro-batch
    saved_act_bytes: int  # bytes autograd keeps for backward, per micro-batch


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer profile of a model at a given sequence length and micro-batch size."""

    cfg: ModelConfig  # the model
    seq_len: int  # tokens per sequence (T)
    micro_batch_size: int  # sequences per micro-batch (B)
    dtype_bytes: int  # bytes per element of weights and activations in compute
    layers: tuple[LayerProfile, ...]  # one entry per layer, in order

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size

    @property
    def act_shape(self) -> tuple[int, int]:
        """(rows, channels) of an activation between stages: a micro-batch's tokens, the width
        (what an activation codec's per-row and per-channel parts are priced on)."""
        return self.tokens_per_micro_batch, self.cfg.d_model

    def _range(self, first: int, last: int) -> tuple[LayerProfile, ...]:
        if not 0 <= first < last <= len(self.layers):
            raise ShoalError(f"stage [{first}, {last}) is outside [0, {len(self.layers)})")
        return self.layers[first:last]

    @cached_property
    def _prefix(self) -> dict[str, list[int]]:
        """Prefix sums (integers, so exact) of the per-layer figures the range queries add up:
        the planner asks for tens of thousands of ranges per plan."""
        out: dict[str, list[int]] = {}
        for name, value in (("params", lambda x: x.params), ("param_bytes", lambda x: x.param_bytes),
                            ("fwd", lambda x: x.fwd_flops_per_token), ("bwd", lambda x: x.bwd_flops_per_token),
                            ("worker", lambda x: WORKER_BYTES_PER_PARAM * x.params + x.saved_act_bytes),
                            ("saved", lambda x: x.saved_act_bytes)):
            acc = [0]
            for layer in self.layers:
                acc.append(acc[-1] + value(layer))
            out[name] = acc
        return out

    def _sum(self, name: str, first: int, last: int) -> int:
        if not 0 <= first < last <= len(self.layers):
            raise ShoalError(f"stage [{first}, {last}) is outside [0, {len(self.layers)})")
        acc = self._prefix[name]
        return acc[last] - acc[first]

    def params(self, first: int, last: int) -> int:
        """Parameters of stage ``[first, last)``."""
        return self._sum("params", first, last)

    def param_bytes(self, first: int, last: int) -> int:
        """Bytes of the stage's parameters in the compute dtype (one weight pull)."""
        return self._sum("param_bytes", first, last)

    def fwd_flops(self, first: int, last: int) -> float:
        """Forward FLOPs of the stage for one micro-batch."""
        return float(self._sum("fwd", first, last) * self.tokens_per_micro_batch)

    def bwd_flops(self, first: int, last: int) -> float:
        """Backward FLOPs of the stage for one micro-batch."""
        return float(self._sum("bwd", first, last) * self.tokens_per_micro_batch)

    def out_act_bytes(self, first: int, last: int) -> int:
        """Bytes the stage sends forward per micro-batch (0 if it ends with the head)."""
        last_layer = self._range(first, last)[-1]
        return 0 if last_layer.kind == "head" else last_layer.out_act_bytes

    def in_act_bytes(self, first: int, last: int) -> int:
        """Bytes the stage receives per micro-batch: token ids for stage 0, else hidden states."""
        self._range(first, last)
        if first == 0:
            return self.tokens_per_micro_batch * 8
        return self.layers[first - 1].out_act_bytes

    def saved_act_bytes(self, first: int, last: int) -> int:
        """Bytes autograd keeps for one micro-batch's backward through stage ``[first, last)``."""
        return self._sum("saved", first, last)

    def worker_memory(self, first: int, last: int) -> int:
        """Bytes a worker needs on its device: fp32 weights, their gradient and the step's sum of
        gradients (:data:`WORKER_BYTES_PER_PARAM`), saved activations of one micro-batch."""
        return self._sum("worker", first, last)

    def server_memory(self, first: int, last: int, local: bool = False) -> int:
        """Bytes a stage server process of layers ``[first, last)`` needs at its peak
        (:data:`SERVER_BYTES_PER_PARAM` a parameter in exact sync,
        :data:`LOCAL_SERVER_BYTES_PER_PARAM` in local mode, measured, and the process itself)."""
        per = LOCAL_SERVER_BYTES_PER_PARAM if local else SERVER_BYTES_PER_PARAM
        return SERVER_PROCESS_BYTES + self.params(first, last) * per


def profile_model(
    cfg: ModelConfig, seq_len: int | None = None, micro_batch_size: int = 1, dtype_bytes: int = 4
) -> ModelProfile:
    """Profile every layer of ``cfg`` for micro-batches of ``micro_batch_size`` x ``seq_len``."""
    t = cfg.max_seq_len if seq_len is None else seq_len
    if t <= 0 or t > cfg.max_seq_len:
        raise ShoalError(f"sequence length {t} must be in [1, {cfg.max_seq_len}] for model {cfg.name}")
    if micro_batch_size <= 0:
        raise ShoalError(f"micro-batch size must be positive, got {micro_batch_size}")
    if dtype_bytes not in (2, 4):
        raise ShoalError(f"dtype_bytes must be 2 (fp16/bf16) or 4 (fp32), got {dtype_bytes}")
    d, f, v, h, b = cfg.d_model, cfg.ffn_hidden, cfg.vocab_size, cfg.n_heads, micro_batch_size
    bt = b * t
    norm_fp32 = (4 - dtype_bytes) * (d + 1)  # per token and RMSNorm: its fp32 copy and statistic
    layers = []
    for i in range(cfg.n_total_layers):
        kind = layer_kind(cfg, i)
        if kind == "embedding":
            params, fwd, saved = v * d, 0, bt * 8
        elif kind == "block":
            params = 4 * d * d + 3 * d * f + 2 * d
            fwd = 2 * (4 * d * d + 3 * d * f) + 4 * t * d
            saved = bt * (dtype_bytes * (12 * d + 4 * f + 2) + 4 * h + 2 * norm_fp32)
        else:
            params, fwd = d * v + d, 2 * d * v
            saved = bt * (dtype_bytes * (3 * d + 1) + 4 * v + 8 + norm_fp32) + 4
        bwd = 0 if kind == "embedding" else 2 * fwd
        layers.append(
            LayerProfile(
                index=i,
                kind=kind,
                params=params,
                param_bytes=params * dtype_bytes,
                fwd_flops_per_token=fwd,
                bwd_flops_per_token=bwd,
                out_act_bytes=bt * d * dtype_bytes,
                saved_act_bytes=saved,
            )
        )
    return ModelProfile(cfg, t, b, dtype_bytes, tuple(layers))
