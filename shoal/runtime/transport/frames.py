"""Framing of a stage's weights and gradients on the wire, and retries of calls to a peer
that may still be starting."""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from shoal.net import shoal_pb2 as pb
from shoal.net.wire import WireError, decode_tensor, encode_tensor, serialize_framed


def serialise_weights(head: pb.WeightsReply, params: dict[str, torch.Tensor]) -> bytes:
    """``head`` with every parameter framed, serialised (runs in a thread)."""
    return serialize_framed(head, pb.WeightsReply.DESCRIPTOR.fields_by_name["params"].number,
                            [encode_tensor(name, p.detach()) for name, p in params.items()])


def decode_grads(r: pb.GradPush, params: dict[str, torch.Tensor], finite: bool = True) -> dict[str, torch.Tensor]:
    """Every gradient of a push, checked against its parameter (shape, dtype and, unless an fp16
    run may overflow, finiteness); all or nothing."""
    grads = {}
    for g in r.grads:
        if g.name not in params or g.name in grads:
            raise WireError(f"unexpected gradient {g.name!r}")
        grads[g.name] = decode_tensor(g, shape=tuple(params[g.name].shape), dtype="float32", finite=finite)
    if len(grads) != len(params):
        raise WireError(f"push has {len(grads)} of {len(params)} gradients")
    return grads


async def retry(fn, budget_s: float = 30.0, delay: float = 0.1):
    """Call ``fn`` until it succeeds (the peer may still be starting), for ``budget_s`` at most."""
    end = time.monotonic() + budget_s
    while True:
        try:
            return await fn()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            await asyncio.sleep(delay)
