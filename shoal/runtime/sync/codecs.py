"""Wire compression of a run, per traffic kind: the run spec's setting and the compressed weight pull.

``--compression`` (``shoal launch``, ``shoal coordinator``, ``shoal demo``) takes the planner's
syntax (:func:`shoal.plan.compression.parse_compression`): one codec for every kind
(``int8``) or one per kind (``act=int8,grad=int8,push=topk-int8:0.1,pull=int8``). It travels in
the run spec (``RunSpec.compress_*``, fields 800-803) to every member:

* ``act`` / ``grad``: workers encode the activations and activation gradients they return with
  it; a stage server keeps the frame it received and hands that same frame on (relay to the
  next or previous stage, and the task input of the worker that leases the task), so nothing
  is expanded to fp32 on the wire and every receiver decodes the same bytes;
* ``push``: workers encode gradient pushes (exact mode) and pseudo-gradients (local mode) with
  it, with error feedback kept on the worker (what a push did not carry is added to the next);
* ``pull``: :class:`PullDeltas` -- the server keeps one reconstruction ``R`` of its weights that
  every synced worker holds bit for bit; a new version is sent as the compressed difference
  ``W - R`` (``R`` then advances by exactly the decoded difference, so ``W - R`` is carried to
  the next version: error feedback on the server side). A chain of reconstructions starts at
  every (re)load and epoch with ``R`` = the weights as the dense pull codec decodes them
  (``int8`` for a top-k pull codec), sent in that codec to everyone who pulls that version; a
  worker that later does not hold the previous ``R`` (a joiner, or one that missed a version)
  gets ``R`` itself in fp32, so every replica holds the same ``R`` bit for bit.

In local mode with a ``sparse`` or ``lowrank`` pull codec (:func:`stage_codec`: one frame of the
whole stage, ``lowrank``'s matrix shapes taken from the receiver's own stage), one pipeline's
pulls are the merges themselves
(:class:`UpdatePulls`): the server encodes each merge's outer update once, with its own error
feedback, applies exactly the decoded update to its weights, and serves those frames; every
worker adds them to the merged weights it holds, so every replica holds the server's weights
bit for bit. A worker whose version does not match pulls the weights in fp32 once. A replica
plan's servers keep their exact merged weights and serve :class:`PullDeltas` of them, each
delta one ``*stage`` frame (see :func:`uses_update_pulls`).

``none`` everywhere (the default) changes nothing: frames, relays and pulls are those of an
uncompressed run byte for byte.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.plan.compression import KINDS, parse_compression

if TYPE_CHECKING:  # torch and the wire layer load only where tensors are handled (flag parsing stays light)
    import torch

    from shoal.net import shoal_pb2 as pb


def dense_codec(codec: str) -> str:
    """The codec of a whole-weights pull under pull codec ``codec``: top-k codecs keep too little
    of whole weights, so ``int8`` stands in for them; under ``sparse`` or ``lowrank`` (local mode's rounds: a
    worker pulls whole weights once, then deltas) the weights go in fp32."""
    if stage_codec(codec):
        return "raw"
    return "int8" if codec.startswith("topk-int8") else codec


def runtime_codec(codec: str) -> str:
    """The :mod:`shoal.net.compress` codec of a planner codec name (``none`` is ``raw``)."""
    return "raw" if codec in ("", "none") else codec


@dataclass(frozen=True)
class RunCompression:
    """Codec of each traffic kind, in the planner's names (``none``, ``fp16``, ``int8``, ``topk-int8[:rho]``)."""

    act: str = "none"  # activations sent forward (workers' results, servers' relays and task inputs)
    grad: str = "none"  # activation gradients sent backward (same paths as act)
    push: str = "none"  # gradient pushes (exact) and pseudo-gradient pushes (local), with error feedback
    pull: str = "none"  # weight pulls: deltas against the reconstruction the worker holds

    @property
    def off(self) -> bool:
        """No kind is compressed (the run's frames are those of an uncompressed run)."""
        return all(getattr(self, k) in ("", "none") for k in KINDS)

    def wire(self, kind: str) -> str:
        """Runtime codec of ``kind`` (``raw`` when not compressed)."""
        return runtime_codec(getattr(self, kind))

    def text(self) -> str:
        """The setting as ``--compression`` text (``none`` when off)."""
        if self.off:
            return "none"
        return ",".join(f"{k}={getattr(self, k)}" for k in KINDS)

    def to_spec(self, spec: pb.RunSpec) -> None:
        """Write the setting into a run spec (empty fields when a kind is not compressed)."""
        for k in KINDS:
            c = getattr(self, k)
            setattr(spec, f"compress_{k}", "" if c == "none" else c)


def parse_run_compression(text: str | None) -> RunCompression:
    """``--compression`` text -> :class:`RunCompression` (one-line :class:`ShoalError` if bad)."""
    if text is None or text.strip() in ("", "none"):
        return RunCompression()
    return RunCompression(**parse_compression(text))


def compression_of_spec(spec) -> RunCompression:
    """The setting a run spec carries (empty fields: ``none``)."""
    if spec is None:
        return RunCompression()
    return RunCompression(**{k: getattr(spec, f"compress_{k}", "") or "none" for k in KINDS})


def add_compression_arg(p, default: str = "none") -> None:
    """The ``--compression`` flag of ``shoal launch`` and ``shoal coordinator`` (argparse)."""
    p.add_argument("--compression", default=default, metavar="SPEC",
                   help="wire codecs: one for every kind (none, fp16, int8) or per kind, e.g. "
                        "act=int8,grad=int8,push=topk-int8:0.1,pull=int8 (kinds not named: none); "
                        "sparse[:DENSITY[:BITS]], lowrank[:RANK[:BITS]]: sparse or low-rank pushes and pulls "
                        "for --sync local (docs/sync-codecs.md); tern: "
                        "act=tern,grad=tern (9x fewer activation bytes than bf16); act=quad,grad=tern-sr: "
                        "8.3x fewer; act=quad-pc,grad=tern-dither: 9.1x fewer (at 1,024 rows of 128 channels), about 1 %% "
                        "above uncompressed loss on tiny (act=oct,grad=tern-dither: 8.1x, 1.5 %%); lossy "
                        "codecs make exact sync approximate (docs/sync-policies.md)")


def received_activation(frame, name: str, *, shape, dtype: str, finite: bool, checked: bool = False):
    """An activation or activation gradient a stage server received (a worker's result or a
    relay; a :class:`shoal.net.wire.Frame` of it, :func:`~shoal.net.wire.payload_frame`),
    checked against ``shape`` and ``dtype`` (and, ``finite``, for inf/NaN): ``(tensor, frame to
    hand on)``, the frame for :func:`shoal.net.wire.put_frame`.

    A lossy frame is decoded and handed on as received; with ``checked`` (a relay: the peer
    server that sends it decoded and checked these bytes when its worker's result came) only
    its header is checked and the tensor is a :class:`shoal.net.wire.Undecoded`, decoded if a
    check recomputes with it (:func:`shoal.net.wire.tensor_of`). A raw one is handed on as its
    bytes under ``name``; its tensor is a view of them, not a copy (only read: by recomputations
    and checks). The bits are those of decoding it and encoding the tensor again, without the
    two copies each way (about 0.3 ms a copy of a 4 MB activation)."""
    from shoal.net.wire import Undecoded, check_header, decode_tensor

    if frame.codec != "raw":
        if checked:
            check_header(frame, shape=shape, dtype=dtype)
            return Undecoded(frame, shape, dtype), frame
        return decode_tensor(frame, shape=shape, dtype=dtype, finite=finite), frame
    frame.name = name
    return decode_tensor(frame, shape=shape, dtype=dtype, finite=finite, copy=False), frame


STAGE_FRAME = "*stage"  # name of a frame holding a whole stage's tensors (sparse: one chunking, one header)


def stage_codec(codec: str) -> bool:
    """Whether pushes and pulls of ``codec`` go as one :func:`stage_frame` of the whole stage
    (pure): ``sparse`` (one chunking of the flat stage) and ``lowrank`` (the stage's matrices,
    their shapes from the receiver's own stage)."""
    return codec.startswith(("sparse", "lowrank"))


def stage_layout(codec: str, params: dict) -> list[tuple[int, ...]] | None:
    """The tensor shapes (name order) a :func:`stage_frame` of ``codec`` is encoded against:
    ``lowrank`` factors each matrix; other codecs see one flat vector (None)."""
    return [tuple(params[n].shape) for n in sorted(params)] if codec.startswith("lowrank") else None


def stage_frame(tensors: dict[str, torch.Tensor], codec: str, ef=None) -> pb.Tensor:
    """One frame of every tensor of ``tensors``, flattened in name order and concatenated, so a
    sparse codec chunks the stage as one vector (small tensors cost no header or whole chunk
    of their own); ``ef`` keeps its residual under :data:`STAGE_FRAME`."""
    import torch

    from shoal.net.wire import encode_tensor

    flat = torch.cat([tensors[n].detach().to("cpu", torch.float32).reshape(-1) for n in sorted(tensors)])
    return encode_tensor(STAGE_FRAME, flat, codec, ef=ef, layout=stage_layout(codec, tensors))


def split_stage_frame(frame: pb.Tensor, params: dict[str, torch.Tensor], finite: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a :func:`stage_frame`, checked against ``params`` (their count and shapes
    give the frame's length); a :class:`WireError` if it does not match."""
    from shoal.net.wire import decode_tensor

    names = sorted(params)
    total = sum(params[n].numel() for n in names)
    # The length comes from the receiver's own stage, so a whole large stage is within bounds.
    flat = decode_tensor(frame, shape=(total,), dtype="float32", finite=finite, max_elements=max(1, total),
                         layout=[tuple(params[n].shape) for n in names])
    out, at = {}, 0
    for n in names:
        k = params[n].numel()
        out[n] = flat[at:at + k].reshape(params[n].shape)
        at += k
    return out


def split_flat(flat: torch.Tensor, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage flattened in name order (a :func:`stage_frame`'s layout, e.g. its error-feedback
    residual) as ``{name: tensor}`` shaped like ``params``."""
    out, at = {}, 0
    for n in sorted(params):
        k = params[n].numel()
        out[n] = flat.reshape(-1)[at:at + k].reshape(params[n].shape)
        at += k
    return out


def keeps_residual(codec: str) -> bool:
    """Whether a local-mode replica keeps what its push did not carry (pure): with ``sparse``
    pushes the worker takes a round's unsent part off its replica when it restarts from the
    merged weights (replica = merged weights minus the part), instead of holding it in an
    error-feedback buffer while the replica forgets it; the next pseudo-gradient then carries
    it. At 1 % density most coordinates move only through that part, so a replica that drops it
    each round relearns it each round (bench/results/sparse-sync.md). ``lowrank`` pushes keep
    theirs the same way (measured at rank 1: 7.0 % above local mode's loss with a buffer, 1.3 % kept)."""
    return stage_codec(codec)


RESIDUAL_REWEIGHT_MAX = 2.0  # the most a kept residual is scaled up or down by (residual_reweight)


def residual_reweight(kept_mbs: int, mbs: int) -> float:
    """The factor a replica's kept residual is re-weighted by in this round's push (pure).

    The merge weights each pseudo-gradient by its share of the round's micro-batches
    (:func:`shoal.train.outer.merge_weights`), so the part a push left behind, carried into the
    next push, is merged at the next round's share instead of the share it was made at. Where a
    worker's shares move from round to round (one pipeline's leases: 6 of 16 then 10) that
    over- or under-weights the residual; scaling it by ``kept_mbs / mbs`` restores its own share
    (a round's total is the same H x M micro-batches). Measured in process with random shares,
    seeds 0-5: ``lowrank`` +0.59 % above uncompressed local mode with it, +0.95 % without
    (bench/results/sparse-sync.md). Clamped to [1/``RESIDUAL_REWEIGHT_MAX``,
    ``RESIDUAL_REWEIGHT_MAX``]: a worker that stalled most of a round and covers one
    micro-batch of it would otherwise push many rounds' worth of residual per unit of its
    learning rate, which the merge screen rightly reads as an outlier norm. 1.0 where either
    count is unknown (0: a first round, a round with nothing merged)."""
    if kept_mbs <= 0 or mbs <= 0:
        return 1.0
    return min(RESIDUAL_REWEIGHT_MAX, max(1.0 / RESIDUAL_REWEIGHT_MAX, kept_mbs / mbs))


def dense_round(round_v: int, steps: int, codec: str) -> bool:
    """Whether round ``round_v`` (the version its merge makes) of a ``steps``-step run goes dense
    (pure): the run's last round when replicas keep their residuals, so the run ends with the
    weights every replica's unsent part and the server's pull residual belong in."""
    return keeps_residual(codec) and round_v >= steps


def is_stage_frame(frames) -> bool:
    """Whether a message's frames are one :func:`stage_frame`."""
    return len(frames) == 1 and frames[0].name == STAGE_FRAME


def uses_update_pulls(spec) -> bool:
    """Whether a run's pulls are the merged sparse updates (local mode with a ``sparse`` or
    ``lowrank`` pull codec, one pipeline). Replica plans pull sparse deltas of the exact merged weights instead
    (:class:`PullDeltas`): a server's weights must not depend on how its stage is chunked, so
    that every replica's copy of a layer stays the same bits."""
    from shoal.train.outer import sync_of_spec

    return (spec is not None and sync_of_spec(spec).local and stage_codec(compression_of_spec(spec).pull)
            and not spec.replica_stages)


async def compressed_pull(server, request: pb.WeightsRequest) -> bytes | None:
    """The serialised pull of ``request`` from ``server`` (a StageServer whose run compresses pulls);
    None while the stage is being loaded (a rollback's or move's load: the weights held are
    not the version about to be served, and must not start a chain under its label).

    Under the server's weights lock, like its uncompressed cache: the bytes are exactly the
    weights of the version they are labelled with.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    async with server._wlock:
        if server.version < 0:
            return None
        up = getattr(server, "update_pulls", None)
        if up is not None:
            up.sync((server.published_version(), server.epoch, server.stage), server.first, server.last)
            return await loop.run_in_executor(None, up.reply, request.compress_chain, request.compress_version,
                                              dict(server.params))
        codec = compression_of_spec(server.spec).pull
        pd = getattr(server, "pull_deltas", None)
        if pd is None or pd.codec != runtime_codec(codec):
            pd = server.pull_deltas = PullDeltas(codec)
        key = (server.published_version(), server.epoch, server.stage)
        await loop.run_in_executor(None, pd.advance, key, server.first, server.last, dict(server.params))
        return await loop.run_in_executor(None, pd.reply, request.compress_chain, request.compress_version)


class PullDeltas:
    """Compressed weight pulls of one stage server: one shared reconstruction, one delta per version.

    ``R`` is what every synced worker holds. When the served version changes, the server
    encodes ``W - R`` once with the pull codec and adds the decoded delta to ``R`` (the same
    bytes every worker adds to its own copy, so the copies stay equal bit for bit; what the
    codec dropped stays in ``W - R`` and goes with the next delta). A worker that says it holds
    ``R`` of the version before (``WeightsRequest.compress_chain``/``compress_version``) gets the
    delta; any other gets ``R`` in full. A new chain (new id) starts at every (re)load, epoch and
    version going back: ``R`` is then the weights as the dense codec (:func:`dense_codec`)
    decodes them, and the full pull of that first version is those compressed frames; after the
    first delta a full pull is ``R`` in fp32 (it is no longer what one codec frame decodes to).
    Not thread-safe: the server calls :meth:`advance` under its weights lock and
    :meth:`reply` in a thread under the same lock.
    """

    def __init__(self, codec: str):
        self.codec = runtime_codec(codec)  # runtime codec of the deltas
        self.chain = ""  # id of the current reconstruction chain
        self.key: tuple[int, int, int] | None = None  # (version, epoch, stage) R stands for
        self.recon: dict[str, torch.Tensor] | None = None  # R, fp32 on the CPU
        self.head: tuple[int, int] = (0, 0)  # (first, last) layers of the stage
        self.base = -1  # version the delta goes from (-1: no delta yet)
        self.delta_bytes: bytes | None = None  # serialised WeightsReply of the delta
        self.full_bytes: bytes | None = None  # serialised WeightsReply of R in fp32 (made on demand)

    def advance(self, key: tuple[int, int, int], first: int, last: int, params: dict[str, torch.Tensor]) -> None:
        """Bring ``R`` to ``key`` (runs in a thread, under the server's weights lock)."""
        import torch

        from shoal.net import shoal_pb2 as pb
        from shoal.net.wire import decode_tensor, encode_tensor

        if self.key == key:
            return
        version, epoch, stage = key
        if self.recon is None or self.key is None or self.key[1:] != key[1:] or version < self.key[0]:
            self.chain = uuid.uuid4().hex
            head = pb.WeightsReply(version=version, epoch=epoch, first=first, last=last, compress_chain=self.chain)
            self.recon = {}
            for name, p in params.items():
                frame = encode_tensor(name, p.detach().to("cpu", torch.float32), dense_codec(self.codec))
                self.recon[name] = decode_tensor(frame, shape=tuple(p.shape), dtype="float32")
                head.params.append(frame)
            self.base, self.delta_bytes = -1, None
            self.key, self.head, self.full_bytes = key, (first, last), head.SerializeToString()
            return
        else:
            head = pb.WeightsReply(version=version, epoch=epoch, first=first, last=last, compress_delta=True,
                                   compress_chain=self.chain, compress_base=self.key[0])
            self.full_bytes = self.delta_bytes = None  # (the last version's pulls: not beside this one's work)
            if stage_codec(self.codec):
                # One frame of the whole stage (as a sparse push): small tensors cost no chunk of
                # their own. W - R goes straight into stage_frame's flat layout (one copy of the stage).
                names = sorted(params)
                flat = torch.empty(sum(params[n].numel() for n in names))
                at = 0
                for n in names:
                    k = params[n].numel()
                    torch.sub(params[n].detach().to("cpu", torch.float32), self.recon[n],
                              out=flat[at:at + k].view(self.recon[n].shape))
                    at += k
                frame = encode_tensor(STAGE_FRAME, flat, self.codec, layout=stage_layout(self.codec, params))
                del flat
                for name, d in split_stage_frame(frame, self.recon).items():
                    self.recon[name].add_(d)  # apply_pull's arithmetic: base + decoded
                head.params.append(frame)
            else:
                for name, p in params.items():
                    r = self.recon[name]
                    frame = encode_tensor(name, p.detach().to("cpu", torch.float32) - r, self.codec)
                    # Advance by what the workers will decode, not by the exact difference.
                    r.add_(decode_tensor(frame, shape=tuple(r.shape), dtype="float32"))
                    head.params.append(frame)
            self.base, self.delta_bytes = self.key[0], head.SerializeToString()
        self.key, self.head, self.full_bytes = key, (first, last), None

    def reply(self, have_chain: str, have_version: int) -> bytes:
        """The serialised pull for a worker holding ``R`` of ``(have_chain, have_version)``."""
        from shoal.net import shoal_pb2 as pb
        from shoal.net.wire import encode_tensor

        if self.delta_bytes is not None and have_chain == self.chain and have_version == self.base:
            return self.delta_bytes
        if self.full_bytes is None:
            head = pb.WeightsReply(version=self.key[0], epoch=self.key[1], first=self.head[0], last=self.head[1],
                                   compress_chain=self.chain)
            for name, r in self.recon.items():
                head.params.append(encode_tensor(name, r))
            self.full_bytes = head.SerializeToString()
        return self.full_bytes


class UpdatePulls:
    """One pipeline's sparse pulls in local mode: each merge's outer update, encoded once, is the pull.

    At a merge the server hands :meth:`merge` the outer update ``U`` (what exact arithmetic
    would subtract); it encodes ``-U`` plus the residual of earlier merges with the pull codec
    (error feedback on the server, :class:`shoal.net.compress.ErrorFeedback`), adds the
    *decoded* frames to its weights on the CPU in fp32, and keeps the frames as the delta from
    the previous version. A worker holding that version adds the same frames to the same bits
    (:func:`apply_pull` onto its anchor), so every replica equals the server's weights bit for
    bit; any other worker (a joiner, one that missed a merge, a new chain after a (re)load) gets
    the weights in fp32 once. Not thread-safe: the server calls it under its weights lock.
    """

    def __init__(self, codec: str):
        from shoal.net.compress import ErrorFeedback

        self.codec = runtime_codec(codec)  # runtime codec of the updates
        self.ef = ErrorFeedback(self.codec)  # what earlier merges' updates did not carry
        self.chain = ""  # id of the current chain of versions
        self.key: tuple[int, int, int] | None = None  # (version, epoch, stage) of the weights held
        self.head: tuple[int, int] = (0, 0)  # (first, last) layers of the stage
        self.base = -1  # version the delta goes from (-1: no delta)
        self.delta_bytes: bytes | None = None  # serialised WeightsReply of the last merge's update
        self.full_bytes: bytes | None = None  # serialised WeightsReply of the weights in fp32 (on demand)

    def sync(self, key: tuple[int, int, int], first: int, last: int) -> None:
        """Start a new chain unless ``key`` is the version the last merge made."""
        if key != self.key:
            self.chain, self.key, self.head = uuid.uuid4().hex, key, (first, last)
            self.base, self.delta_bytes, self.full_bytes = -1, None, None

    def merge(self, params: dict[str, torch.Tensor], update: dict[str, torch.Tensor] | None,
              old: tuple[int, int, int], new: tuple[int, int, int], first: int, last: int) -> None:
        """Apply the encoded ``-update`` (None: nothing merged, only the residual goes) to
        ``params`` in place and keep it as the pull from ``old`` to ``new``."""
        import torch

        from shoal.net import shoal_pb2 as pb
        from shoal.net.wire import encode_tensor

        self.sync(old, first, last)
        self.full_bytes = None  # (the weights before this merge: made again on demand)
        head = pb.WeightsReply(version=new[0], epoch=new[1], first=first, last=last, compress_delta=True,
                               compress_chain=self.chain, compress_base=old[0])
        with torch.no_grad():
            # stage_frame's layout of -update, built flat (one copy of the stage, not two)
            names = sorted(params)
            if update is None:
                flat = torch.zeros(sum(params[n].numel() for n in names))
            else:
                flat = torch.cat([update[n].detach().to("cpu", torch.float32).reshape(-1) for n in names]).neg_()
            frame = encode_tensor(STAGE_FRAME, flat, self.codec, ef=self.ef, layout=stage_layout(self.codec, params))
            del flat
            # The worker's arithmetic (apply_pull): its fp32 copy plus the decoded frame.
            for name, d in split_stage_frame(frame, params).items():
                params[name].copy_(params[name].detach().to("cpu", torch.float32) + d)
            head.params.append(frame)
        self.key, self.head, self.base = new, (first, last), old[0]
        self.delta_bytes, self.full_bytes = head.SerializeToString(), None

    def flush(self, params: dict[str, torch.Tensor]) -> None:
        """Add what earlier merges' pulls did not carry to ``params`` (the run's last, dense
        round) and end the chain: any later pull is the weights in fp32."""
        import torch

        r = self.ef.take(STAGE_FRAME)
        if r is not None:
            with torch.no_grad():
                for name, d in split_flat(r, params).items():
                    params[name].copy_(params[name].detach().to("cpu", torch.float32) + d)
        del r
        self.ef.reset()
        self.chain, self.base, self.delta_bytes, self.full_bytes = uuid.uuid4().hex, -1, None, None

    def reply(self, have_chain: str, have_version: int, params: dict[str, torch.Tensor]) -> bytes:
        """The serialised pull for a worker holding ``(have_chain, have_version)``: the last
        merge's update if it holds the version before, else the weights in fp32."""
        import torch

        from shoal.net import shoal_pb2 as pb
        from shoal.net.wire import encode_tensor

        if self.delta_bytes is not None and have_chain == self.chain and have_version == self.base:
            return self.delta_bytes
        if self.full_bytes is None:
            head = pb.WeightsReply(version=self.key[0], epoch=self.key[1], first=self.head[0], last=self.head[1],
                                   compress_chain=self.chain)
            for name, p in params.items():
                head.params.append(encode_tensor(name, p.detach().to("cpu", torch.float32)))
            self.full_bytes = head.SerializeToString()
        return self.full_bytes


def apply_pull(rep: pb.WeightsReply, params: dict[str, torch.Tensor], base: dict[str, torch.Tensor] | None,
               held: tuple[str, int]) -> dict[str, torch.Tensor]:
    """The checked new weights of a pull: all frames or an error, nothing applied here. A raw
    frame's tensor is a view of the pull's bytes (``decode_tensor(copy=False)``): the caller
    copies it into its own tensors, never writes it.

    ``base``: the reconstruction the worker holds (``held`` = (chain, version) of it) for a
    delta reply; a delta against anything else is a :class:`WireError` (the worker then asks
    for a full pull).
    """
    import torch

    from shoal.net.wire import WireError, decode_tensor

    if rep.compress_delta and (base is None or held != (rep.compress_chain, rep.compress_base)):
        raise WireError(f"weight delta against v{rep.compress_base} of a reconstruction this worker does not "
                        "hold; pulling in full")
    new = {}
    if rep.compress_delta and is_stage_frame(rep.params):  # a sparse update of the whole stage
        for name, t in split_stage_frame(rep.params[0], params).items():
            new[name] = base[name].to("cpu", torch.float32) + t
        return new
    for frame in rep.params:
        p = params.get(frame.name)
        if p is None or frame.name in new:
            raise WireError(f"weights of stage [{rep.first},{rep.last}): unexpected tensor {frame.name!r}")
        t = decode_tensor(frame, shape=tuple(p.shape), dtype="float32", finite=True, copy=False)
        if rep.compress_delta:
            t = base[frame.name].to("cpu", torch.float32) + t
        new[frame.name] = t
    if len(new) != len(params):
        raise WireError(f"weights hold {len(new)} of the stage's {len(params)} tensors")
    return new
