"""Roles and credentials that cannot be minted: the join token admits workers only, servers
join with the operator's server token, credentials are signatures only the coordinator can
make, member ids are random, every reported number is checked, and mutual TLS refuses a
client without a certificate of the run's CA.

Each attack runs against a real coordinator on a loopback gRPC server, as a peer holding the
join token (and the run's CA) would make it."""

from __future__ import annotations

import asyncio
import math
import re

import grpc
import pytest

from shoal.net import shoal_pb2 as pb
from shoal.net import shoal_pb2_grpc as pbg
from shoal.net.auth import CRED_HEADER, MEMBER_HEADER, ROLE_HEADER, Identity, member_credential
from shoal.net.channel import bind, make_server, open_channel
from shoal.net.tls import TlsConfig, load_tls, make_keys
from shoal.runtime.roles.coordinator import Coordinator, bad_number, report_error

TOKEN, SERVER_TOKEN = "join-token-1", "server-token-1"


def _spec(**kw) -> pb.RunSpec:
    base = dict(model="tiny", stages=2, steps=4, micro_batches=4, micro_batch_size=2, seq_len=32, seed=0, lr=1e-3,
                min_lr=1e-4, warmup=1, weight_decay=0.1, grad_clip=1.0, dead_after_s=30, min_lease_s=5,
                data="synthetic", ordered_grads=True, run_id="roles")
    base.update(kw)
    return pb.RunSpec(**base)


def test_reported_numbers_are_checked():
    spec = _spec()
    ok = pb.StepReport(member_id="s", stage=1, step=0, sq_norm=2.0, param_sq_norms=[1.0, 1.0], losses=[7.0] * 4,
                       tasks_per_worker={"w": 4})
    assert report_error(spec, ok, last=True) is None
    for bad, why in (
        (dict(sq_norm=math.nan), "sq_norm = nan: must be finite"),
        (dict(sq_norm=math.inf), "sq_norm = inf: must be finite"),
        (dict(sq_norm=-1.0), "sq_norm = -1.0: must be >= 0"),
        (dict(param_sq_norms=[1.0, math.nan]), "param_sq_norms = nan"),
        (dict(losses=[7.0, 7.0, math.nan, 7.0]), "losses = nan"),
        (dict(losses=[7.0] * 3), "losses: 3 values, the run has 4"),
        (dict(step=4), "step = 4: the run has steps 0..3"),
        (dict(step=-2), "step = -2: must be >= -1"),
        (dict(requeues=-5), "requeues = -5"),
        (dict(tasks_per_worker={"w": -3}), "tasks_per_worker[w] = -3: must be >= 0"),
    ):
        r = pb.StepReport()
        r.CopyFrom(ok)
        for k, v in bad.items():
            r.ClearField(k)
            if isinstance(v, list):
                getattr(r, k).extend(v)
            elif isinstance(v, dict):
                getattr(r, k).update(v)
            else:
                setattr(r, k, v)
        got = report_error(spec, r, last=True)
        assert got is not None and got.startswith(why), (bad, got)
    # fp16: an overflow is an infinite or NaN norm, reported so that every stage skips the step.
    assert report_error(_spec(precision="fp16"), pb.StepReport(stage=0, step=0, sq_norm=math.inf), last=False) is None
    assert report_error(_spec(precision="fp16"), pb.StepReport(stage=0, step=0, sq_norm=-math.inf),
                        last=False) is not None
    # nested messages: a heartbeat's dashboard figures and a measurement's links
    hb = pb.MemberRequest(member_id="w", stats=pb.MemberStats(compute_s=math.nan))
    assert bad_number(hb) == "stats.compute_s = nan: must be finite"
    m = pb.MeasureReport(member_id="w", links=[pb.LinkProbe(target="c", rtt_s=0.001, up_bps=-1.0)])
    assert bad_number(m) == "links[0].up_bps = -1.0: must be >= 0"
    assert bad_number(pb.JoinRequest(role="worker", flops=math.inf)) == "flops = inf: must be finite"


async def _coordinator(spec: pb.RunSpec, tls=None):
    """A coordinator serving on loopback, as run_coordinator starts it (no run folder)."""
    coord = Coordinator(spec, TOKEN, min_workers=2, server_token=SERVER_TOKEN, tls=tls)
    server = make_server(TOKEN, run_key=lambda: coord.run_key)
    pbg.add_CoordinatorServicer_to_server(coord, server)
    port = bind(server, "127.0.0.1:0", tls)
    await server.start()
    return coord, server, f"127.0.0.1:{port}"


async def _join(address: str, role: str, name: str, server_token: str = "", tls=None) -> tuple[Identity, pb.JoinReply]:
    ident = Identity(TOKEN, server_token=server_token)
    async with open_channel(address, TOKEN, tls=tls, identity=ident) as ch:
        rep = await pbg.CoordinatorStub(ch).Join(pb.JoinRequest(role=role, name=name, flops=1e9, schema=1,
                                                                address="127.0.0.1:1", ckpt_version=-1,
                                                                ckpt_stage=-1), timeout=10)
    return ident, rep


@pytest.mark.timeout(60)
def test_join_token_admits_workers_only_and_credentials_cannot_be_minted():
    async def main():
        coord, server, addr = await _coordinator(_spec())
        try:
            # The join token alone, or a wrong server token, cannot make a server (or a standby).
            for st in ("", "guess"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _join(addr, "server", "mallory", server_token=st)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "server token" in err.value.details()
            assert not any(m.role == "server" for m in coord.members.values())
            s0, rep0 = await _join(addr, "server", "s0", server_token=SERVER_TOKEN)
            s1, _ = await _join(addr, "server", "s1", server_token=SERVER_TOKEN)
            w, repw = await _join(addr, "worker", "w0")
            v, _ = await _join(addr, "worker", "w1")
            # Random ids; nobody receives a secret: a credential and the run's public key only.
            for ident, name in ((s0, "s0"), (s1, "s1"), (w, "w0"), (v, "w1")):
                assert re.fullmatch(rf"[sw]-[0-9a-f]{{12}}-{name}", ident.member), ident.member
            assert not rep0.run_secret and not repw.run_secret and rep0.run_key == repw.run_key == coord.run_key
            # What a worker holds (its credential, the public key) makes no other credential.
            forged = Identity(TOKEN, s0.member, "server", member_credential(w.run_key, s0.member, "server"),
                              w.run_key)
            async with open_channel(addr, TOKEN, identity=forged) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pbg.CoordinatorStub(ch).ReportStep(pb.StepReport(member_id=s0.member, stage=0, step=0,
                                                                            sq_norm=1.0), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with open_channel(addr, TOKEN, identity=w) as ch:
                c = pbg.CoordinatorStub(ch)
                # A member leaves only as itself.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.Leave(pb.MemberRequest(member_id=v.member), timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert v.member in coord.members
                # A worker cannot report a step, not even with its own credential.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.ReportStep(pb.StepReport(member_id=w.member, stage=0, step=0, sq_norm=1.0), timeout=10)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                # Its heartbeat numbers are checked.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await c.Heartbeat(pb.MemberRequest(member_id=w.member, observed_flops=math.nan), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                await c.Leave(pb.MemberRequest(member_id=w.member), timeout=10)
                assert w.member not in coord.members and v.member in coord.members
            # A stage's own server reporting a NaN norm: refused with the reason, and the run
            # fails; the step is never committed.
            stage = coord.stage_server.index(s0.member)
            async with open_channel(addr, TOKEN, identity=s0) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await pbg.CoordinatorStub(ch).ReportStep(pb.StepReport(
                        member_id=s0.member, stage=stage, step=0, epoch=coord.epoch, sq_norm=math.nan,
                        losses=[7.0] * 4 if stage == 1 else []), timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "sq_norm = nan" in err.value.details()
            assert coord.error and "sq_norm = nan" in coord.error and coord.committed == 0
            assert not coord.decisions
        finally:
            await server.stop(0)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_mutual_tls_refuses_clients_without_a_certificate_of_the_run_ca(tmp_path):
    """The server demands a client certificate of the run's CA: a client that trusts the run's
    CA but shows no certificate, and one that shows another CA's, get no call through (with
    ``require_client_auth`` off, both would)."""
    ours = load_tls(str(make_keys(tmp_path / "a")))
    theirs = load_tls(str(make_keys(tmp_path / "b")))

    class _NoCert(TlsConfig):
        def channel_credentials(self):
            return grpc.ssl_channel_credentials(root_certificates=self.ca)

    no_cert = _NoCert(ca=ours.ca, cert=b"", key=b"")
    other_cert = TlsConfig(ca=ours.ca, cert=theirs.cert, key=theirs.key)

    async def main():
        coord, server, addr = await _coordinator(_spec(), tls=ours)
        try:
            ident, _ = await _join(addr, "worker", "w0", tls=ours)  # the run's own certificate: admitted
            assert ident.credential
            for tls in (no_cert, other_cert):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _join(addr, "worker", "mallory", tls=tls)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert sorted(m.name for m in coord.members.values()) == ["w0"]
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_metadata_names_the_credential_headers():
    ident = Identity(TOKEN, "w-0123456789ab-w0", "worker", "ab", b"k", server_token="st")
    md = dict(ident.metadata())
    assert md[MEMBER_HEADER] == "w-0123456789ab-w0" and md[ROLE_HEADER] == "worker" and md[CRED_HEADER] == "ab"
    assert "x-shoal-server-token" not in md  # the server token goes with Join only
    assert dict(ident.metadata("/shoal.v1.Coordinator/Join"))["x-shoal-server-token"] == "st"
