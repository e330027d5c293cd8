"""CPU of a task's result on its way through a worker and two stage servers, by how it is held.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_result_copies.py [--mb 1.4 4] [--reps 200]

A forward result of ``--mb`` MB (a raw fp32 activation) is framed by the worker, received by
its stage server, checked and relayed, received by the next stage's server and granted there
as the next task's input, once as parsed protobuf messages (each step copies the payload:
``encode_tensor`` into a ``pb.Tensor``, into the ``TaskResult``, serialised; ``FromString``,
the payload read out, put into a ``Relay``, serialised; ``FromString``, read out, put into a
``Task``, that copied into the ``LeaseReply``, serialised) and once as shoal holds it now
(``shoal.net.wire.Framed``: the worker's frame a view of the tensor, serialised with one copy;
each server splits the message with its frame a view of the received bytes and serialises
the relay, and the grant (``shoal.runtime.transport.frames.GrantReply``), with one copy).
Chunking and gRPC, the same either way, are left out. Prints the process CPU per result
(the messages are checked equal between the two ways), with the allocator settings shoal's
processes run with (``shoal.memory.tune_malloc``; ``SHOAL_MALLOC=system``: the C library's
defaults, under which each copy of a large payload faults in fresh pages). The runtime takes
the second way from ``shoal.net.wire.FRAMED_MIN_BYTES`` (256 KiB) on, where it is the faster.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from shoal.memory import tune_malloc  # noqa: E402
from shoal.net import shoal_pb2 as pb  # noqa: E402
from shoal.net.wire import (  # noqa: E402
    Framed,
    decode_tensor,
    encode_frame,
    encode_tensor,
    one_frame,
    payload_frame,
    put_frame,
    serialize_message,
    split_framed,
)
from shoal.runtime.roles.server import RESULT_FRAME as OUTPUT  # noqa: E402
from shoal.runtime.transport.frames import TASK_INPUT, GrantReply, grant_reply_bytes  # noqa: E402
from shoal.runtime.transport.relays import RELAY_FRAMES  # noqa: E402

TENSOR = RELAY_FRAMES["Relay"]


def _grant_head() -> pb.LeaseReply:
    return pb.LeaseReply(has_task=True, version=1, epoch=0, step=1, ask_id=3, credit=1,
                         task=pb.Task(step=1, mb=2, stage=1, direction=pb.FWD, lease_id=9, deadline_s=5.0))


def parsed_path(out: torch.Tensor) -> tuple[bytes, bytes, bytes]:
    """The result as parsed messages: (worker's bytes, relay's bytes, the grant's bytes)."""
    r = pb.TaskResult(worker="w", step=1, mb=2, direction=pb.FWD, epoch=0, lease_id=7)
    r.output.CopyFrom(encode_tensor("out", out))
    up = r.SerializeToString()
    got = pb.TaskResult.FromString(up)
    frame = payload_frame(got.output)
    decode_tensor(frame, shape=tuple(out.shape), dtype="float32", copy=False)
    frame.name = "act"
    relay = pb.Relay(step=got.step, mb=got.mb, epoch=0, direction=pb.FWD, relay_id=1)
    put_frame(relay.tensor, frame)
    across = relay.SerializeToString()
    nxt = payload_frame(pb.Relay.FromString(across).tensor)
    decode_tensor(nxt, shape=tuple(out.shape), dtype="float32", copy=False)
    nxt.name = "input"
    task = pb.Task()
    task.CopyFrom(_grant_head().task)
    put_frame(task.input, nxt)
    reply = _grant_head()
    reply.task.CopyFrom(task)
    return up, across, reply.SerializeToString()


def framed_path(out: torch.Tensor) -> tuple[bytes, bytes, bytes]:
    """The same as shoal holds it now (Framed messages, frames as views)."""
    head = pb.TaskResult(worker="w", step=1, mb=2, direction=pb.FWD, epoch=0, lease_id=7)
    up = serialize_message(Framed(head, "output", [encode_frame("out", out, view=True)]))
    got = split_framed(up, pb.TaskResult, OUTPUT)
    frame = one_frame(got, "output")
    decode_tensor(frame, shape=tuple(out.shape), dtype="float32", copy=False)
    frame.name = "act"
    relay = Framed(pb.Relay(step=got.step, mb=got.mb, epoch=0, direction=pb.FWD, relay_id=1), "tensor", [frame])
    across = serialize_message(relay)
    nxt = one_frame(split_framed(across, pb.Relay, TENSOR), "tensor")
    decode_tensor(nxt, shape=tuple(out.shape), dtype="float32", copy=False)
    nxt.name = "input"
    return up, across, grant_reply_bytes(GrantReply(_grant_head(), {TASK_INPUT: nxt}))


def cpu_per_call(fn, out: torch.Tensor, reps: int) -> float:
    """Process CPU seconds per call of ``fn(out)``, after a warm-up."""
    for _ in range(5):
        fn(out)
    t0 = time.process_time()
    for _ in range(reps):
        fn(out)
    return (time.process_time() - t0) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[0.13, 0.25, 0.5, 1.4, 4.0], help="result sizes, MB")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two ways")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tuned = tune_malloc()
    print(f"a result through a worker, its server's relay and the next server's grant, {args.reps} results a "
          f"round, {args.rounds} rounds alternating; CPU ms per result, the least round (chunking and gRPC left "
          f"out); {'shoal' if tuned else 'the C library'}'s allocator settings\n")
    print("| result | parsed messages | Framed (now) | ratio |")
    print("|---|---|---|---|")
    for mb in args.mb:
        out = torch.randn(int(mb * 1e6 / 4))
        a, b = parsed_path(out), framed_path(out)
        # the same bytes on the wire either way (fields in another order, so compare parsed)
        assert pb.TaskResult.FromString(a[0]) == pb.TaskResult.FromString(b[0])
        assert pb.Relay.FromString(a[1]) == pb.Relay.FromString(b[1])
        granted = pb.LeaseReply.FromString(b[2])
        assert granted == pb.LeaseReply.FromString(a[2])
        assert torch.equal(decode_tensor(granted.task.input, shape=tuple(out.shape), dtype="float32"), out)
        old, new = [], []
        for _ in range(args.rounds):
            old.append(cpu_per_call(parsed_path, out, args.reps))
            new.append(cpu_per_call(framed_path, out, args.reps))
        o, n = min(old), min(new)
        print(f"| {mb:g} MB | {1e3 * o:.3f} ms | {1e3 * n:.3f} ms | {n / o:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
