"""CPU cost of one relay between stage servers, by how it travels (shoal's handlers, not bare gRPC).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_relay_cost.py [--relays 500] [--rounds 2]

A real stage server (stage 0 of the tiny model, B=1 T=16: an 8 KiB output gradient) serves
on loopback in this process; a peer with a server's credential relays the same output
gradient to it over and over (the receiver drops each as a duplicate after the first, as it
drops a resend), and the process's CPU time per relay is printed (both ends together):
on the peer's open ``RelayStream`` (``RelayLink``), as a ``SubmitRelayStream`` call each
(the streamed call, one chunk), and as a ``SubmitRelay`` unary call each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from shoal.net import shoal_pb2 as pb  # noqa: E402
from shoal.net import shoal_pb2_grpc as pbg  # noqa: E402
from shoal.net.auth import Identity, run_public_key  # noqa: E402
from shoal.net.channel import open_channel  # noqa: E402
from shoal.net.stream import send  # noqa: E402
from shoal.net.wire import encode_tensor  # noqa: E402
from shoal.runtime.roles.server import StageServer  # noqa: E402
from shoal.runtime.safety.guard import GuardConfig  # noqa: E402
from shoal.runtime.transport.relays import RelayLink  # noqa: E402

TOKEN, SECRET = "relay-bench-token", b"relay-bench-secret"
CHUNK = 1 << 20


async def _server(tmp: str) -> tuple[StageServer, object]:
    srv = StageServer("127.0.0.1:9", "127.0.0.1:0", TOKEN, tmp, name="s-bench")
    srv.spec = pb.RunSpec(version=1, run_id="relay-bench", model="tiny", stages=2, steps=3, micro_batches=2,
                          micro_batch_size=1, seq_len=16, seed=0, lr=1e-3, min_lr=1e-4, warmup=1,
                          weight_decay=0.1, grad_clip=1.0, ckpt_every=0, dead_after_s=30.0, min_lease_s=5.0,
                          data="synthetic", ordered_grads=True, chunk_bytes=CHUNK)
    srv.stage, srv.epoch = 0, 0
    srv.guard_cfg = GuardConfig(enabled=False)
    await srv._load(0, 0, 3, 0, 0)
    srv.ready = True
    srv.channels.identity.run_key = run_public_key(SECRET)
    return srv, await srv.start_rpc()


async def _main(relays: int, rounds: int) -> None:
    grad = encode_tensor("grad", torch.randn(1, 16, 128, generator=torch.Generator().manual_seed(0)))
    with tempfile.TemporaryDirectory(prefix="shoal-relay-") as tmp:
        srv, rpc = await _server(tmp)
        try:
            async with open_channel(srv.address, TOKEN, identity=Identity.joined(TOKEN, SECRET, "s-peer",
                                                                                  "server")) as ch:
                stub = pbg.StageServerStub(ch)
                link = RelayLink(stub.RelayStream, CHUNK)

                def msg() -> pb.Relay:
                    return pb.Relay(step=0, mb=0, epoch=0, direction=pb.BWD, tensor=grad)

                ways = {"open RelayStream (RelayLink)": lambda: link.relay(msg()),
                        "SubmitRelayStream call each": lambda: send(stub.SubmitRelayStream, msg(), CHUNK),
                        "SubmitRelay unary call each": lambda: stub.SubmitRelay(msg())}
                print(f"one relay of an 8 KiB output gradient, {relays} relays per way and round, "
                      "CPU of both ends (one process)\n")
                print("| way | " + " | ".join(f"round {r + 1} CPU-ms" for r in range(rounds)) + " |")
                print("|---|" + "---|" * rounds)
                results: dict[str, list[float]] = {w: [] for w in ways}
                for _ in range(rounds):
                    for way, fn in ways.items():
                        for _ in range(50):  # warm-up (and the first relay is the one kept)
                            rep = await fn()
                        if not rep.accepted:
                            raise SystemExit(f"{way}: relay refused: {rep.reason}")
                        c0 = time.process_time()
                        for _ in range(relays):
                            await fn()
                        results[way].append((time.process_time() - c0) / relays * 1e3)
                for way, vals in results.items():
                    print(f"| {way} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
                link.close()
        finally:
            await rpc.stop(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--relays", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    asyncio.run(_main(args.relays, args.rounds))


if __name__ == "__main__":
    main()
