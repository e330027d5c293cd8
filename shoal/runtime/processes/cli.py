"""``shoal coordinator | server | worker | launch``: the runtime's processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from pathlib import Path

from shoal.errors import ShoalError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the join token (default: env SHOAL_TOKEN)")
    p.add_argument("--log-level", default="INFO", help="logging level (INFO, DEBUG, WARNING)")
    _tls_args(p)


def _tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("encryption (mutual TLS with the run's certificates; see `shoal keys`)")
    g.add_argument("--tls-dir", default=None,
                   help="folder with ca.pem, member.pem and member.key (made by `shoal keys`; "
                        "default: env SHOAL_TLS_DIR)")
    g.add_argument("--tls-ca", default=None, help="CA certificate (PEM) every peer's certificate chains to")
    g.add_argument("--tls-cert", default=None, help="this member's certificate (PEM)")
    g.add_argument("--tls-key", default=None, help="this member's private key (PEM)")
    g.add_argument("--insecure", action="store_true",
                   help="plain text instead of TLS (refused unless every address is loopback)")


def _tls(args, *addresses: str | None):
    """The run's TLS config from the flags, or None for ``--insecure`` (loopback only)."""
    import os

    from shoal.net.tls import check_plaintext, load_tls

    tls_dir = args.tls_dir or (None if (args.tls_ca or args.tls_cert or args.tls_key)
                               else os.environ.get("SHOAL_TLS_DIR") or None)
    tls = load_tls(tls_dir, args.tls_ca, args.tls_cert, args.tls_key)
    if tls is not None and args.insecure:
        raise ShoalError("--insecure with TLS files: pass one or the other")
    if tls is None and not args.insecure:
        raise ShoalError("no TLS keys: pass --tls-dir DIR (made by `shoal keys --out DIR`), or --insecure "
                         "for plain text on loopback")
    if tls is None:
        for address in addresses:
            if address:
                check_plaintext(address, "--insecure:")
    return tls


def _measure_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("measurement (real runs plan on what members measure; these override it)")
    g.add_argument("--region", default="", help="network region of this host (default: clustered by latency)")
    g.add_argument("--up-mbps", type=float, default=0.0, help="uplink capacity in Mbit/s (default: measured)")
    g.add_argument("--down-mbps", type=float, default=0.0, help="downlink capacity in Mbit/s (default: measured)")
    g.add_argument("--probe-mb", type=float, default=16.0,
                   help="MB of the largest timed link transfer when measuring (each way, per peer; transfers "
                        "grow from 1 MB until they last 0.2 s and 8 round trips)")


def _measure_opts(args) -> dict:
    """Declared region and capacities (bytes/s) and the probe size from the measurement flags."""
    for name in ("up_mbps", "down_mbps"):
        if getattr(args, name) < 0:
            raise ShoalError(f"--{name.replace('_', '-')} must be >= 0 (0: measure it), got {getattr(args, name)}")
    if not 0 < args.probe_mb <= 64:
        raise ShoalError(f"--probe-mb must be in (0, 64], got {args.probe_mb}")
    return {"region": args.region, "up_bps": args.up_mbps * 1e6 / 8, "down_bps": args.down_mbps * 1e6 / 8,
            "probe_bytes": int(args.probe_mb * 1024 * 1024)}


def _run_args(p: argparse.ArgumentParser, launch: bool = False) -> None:
    from shoal.train.flags import (
        add_data_args,
        add_device_args,
        add_tensorboard_arg,
        add_workload_args,
    )

    add_workload_args(p)
    add_device_args(p, device=launch)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages S")
    p.add_argument("--replicas", default="", metavar="SPEC",
                   help="--sync local: run several pipeline replicas, each with its own stage servers and "
                        "workers, merged per layer at every round; SPEC is each replica's stage count or its "
                        "stages' layer counts joined by +, optionally with its micro-batches per step and its "
                        "regions (2,2 or 1,2+4 or 1:3,2:1 or 1:3@eu,2:1@us+asia), or a plan file of shoal plan "
                        "--json with replicas; sets --stages "
                        "to their sum (docs/replicas.md)")
    p.add_argument("--ckpt-every", type=int, default=None,
                   help="servers checkpoint every K steps, written off their event loop (default 10, "
                        "1 with --standbys; 0: never, --ckpt-every-s included; a stage server's loss rolls "
                        "back to the last checkpoint)")
    p.add_argument("--ckpt-every-s", type=float, default=None, metavar="T",
                   help="servers also checkpoint once T seconds of committed work are in no checkpoint "
                        "(default 60; 0: off): a total stop (every process killed) redoes at most about "
                        "T s of committed work, or K steps if that is less, plus the step in flight")
    p.add_argument("--dead-after", type=float, default=3.0, help="seconds of silence before a member is dead")
    p.add_argument("--shadow", action="store_true",
                   help="an emulation (exact sync only) whose workers run no model (shadow workers: each "
                        "waits its emulated device's task time and sends fixed tensors of the true shapes); losses are meaningless")
    p.add_argument("--min-lease", type=float, default=2.0, help="shortest task lease in seconds")
    p.add_argument("--unordered-grads", action="store_true",
                   help="workers push one summed gradient per step (less traffic; parity only up to "
                        "float summation order) instead of one per micro-batch")
    add_data_args(p, runtime=True)
    add_tensorboard_arg(p)
    from shoal.train.outer import add_sync_args

    add_sync_args(p)
    from shoal.runtime.sync.codecs import add_compression_arg

    add_compression_arg(p)
    p.add_argument("--chunk-mb", type=float, default=None,
                   help="MB per chunk of streamed weight pulls, gradient pushes, results and relays "
                        "(default 1; members may override it)")
    p.add_argument("--spot-check", type=float, default=0.05, metavar="F",
                   help="least fraction of gradient pushes a stage server recomputes to catch poisoned work "
                        "(exact fp32 runs; new workers and workers with flagged pushes are checked more, the "
                        "last step whole; 0: only flagged and first pushes)")
    p.add_argument("--server-checks", action="store_true",
                   help="exact sync: the stage servers recompute the drawn pushes themselves, in the background, "
                        "instead of drawing another worker to compute them again (whose result, a gradient of the "
                        "stage a micro-batch, the step's commit waits for: minutes over a slow uplink for a large "
                        "stage); fewer pushes get checked where the servers' CPUs are slow")


_ADVERTISE_HELP = ("HOST:PORT other machines dial to reach this process (needed with --listen 0.0.0.0:PORT "
                   "or [::]:PORT; HOST alone or port 0 takes the bound port)")


def register(subparsers) -> None:
    """Add the runtime subcommands."""
    p = subparsers.add_parser("coordinator", help="run the coordinator of a swarm")
    p.add_argument("--listen", default=None,
                   help="HOST:PORT to listen on (port 0: any; default 127.0.0.1:7070, with --resume the "
                        "address the run's coordinator was bound to, so its members find it again)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="take over the run in this --out folder (its newest, or --run-id): same settings, "
                        "continues from the last step every stage committed; run flags are ignored")
    p.add_argument("--run-id", default=None, help="with --resume: the run to take over (default: the newest)")
    p.add_argument("--min-workers", type=int, default=1, help="workers needed before step 0")
    p.add_argument("--out", default=None, help="run folder for metrics, events and final weights")
    p.add_argument("--address-file", default=None, help="write the advertised address here")
    p.add_argument("--dashboard", default=None, metavar="HOST:PORT",
                   help="serve the live web dashboard here (port 0: any free; a non-loopback host "
                        "needs the run token in the URL: ?token=...)")
    p.add_argument("--stall-timeout", type=float, default=900.0,
                   help="fail the run after this many seconds without a committed step (0: never)")
    p.add_argument("--advertise", default=None, help=_ADVERTISE_HELP)
    p.add_argument("--server-token-file", default=None,
                   help="file holding the server token that stage servers and standbys join with (default: env "
                        "SHOAL_SERVER_TOKEN, else a new one written to OUT/runs/RUN_ID/server_token); the join "
                        "token admits workers only")
    g = p.add_argument_group("emulated runs (plan on the scenario the processes emulate)")
    g.add_argument("--emulate-scenario", default=None, help="scenario name or file the processes emulate")
    g.add_argument("--emulate-speedup", type=float, default=1.0, help="the processes' compute time scale")
    g.add_argument("--emulate-latency-scale", type=float, default=1.0, help="the processes' latency scale")
    g.add_argument("--emulate-bandwidth-scale", type=float, default=1.0, help="the processes' bandwidth scale")
    _run_args(p)
    _common(p)
    p.set_defaults(func=run_coordinator_cmd)

    p = subparsers.add_parser("server", help="run a stage server that joins a coordinator")
    p.add_argument("--join", required=True, help="coordinator HOST:PORT")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: any)")
    p.add_argument("--advertise", default=None, help=_ADVERTISE_HELP)
    p.add_argument("--ckpt-dir", default="shoal_ckpt", help="checkpoint root (one folder per stage)")
    p.add_argument("--name", default="server", help="label in events")
    p.add_argument("--data", default="", metavar="DIR",
                   help="the run's prepared data folder on this host (a copy; its manifest hash must match the "
                        "run's); needed when the run trains on prepared data: stage servers send workers their tokens")
    _measure_args(p)
    _dial_map_arg(p)
    p.add_argument("--chunk-mb", type=float, default=None,
                   help="MB per chunk of the weights and relays this server sends (default: the run's)")
    p.add_argument("--standby", action="store_true",
                   help="join as a hot standby: copy a stage's checkpoints after every commit and take "
                        "the stage over when its server dies (no shared disk needed)")
    _merge_memory_arg(p)
    p.add_argument("--server-token-file", default=None,
                   help="file holding the run's server token (default: env SHOAL_SERVER_TOKEN); a server "
                        "joins with it, the join token admits workers only")
    _common(p)
    _emulation_args(p)
    p.set_defaults(func=run_server_cmd)

    p = subparsers.add_parser("worker", help="run a worker that joins a coordinator")
    p.add_argument("--join", required=True, help="coordinator HOST:PORT")
    p.add_argument("--name", default="worker", help="label in events and metrics")
    p.add_argument("--flops", type=float, default=None, help="FLOP/s to report (default: measure)")
    p.add_argument("--inject", default="",
                   help="test faults: nan_grad,bad_shape,oom (once each), push_fail (first push attempt lost), "
                        "push_lost (first push's reply lost), push_abandon (first push never lands), "
                        "pseudo_abandon (first pseudo-gradient of a local round never lands), "
                        "hang_fwd|hang_bwd|hang_before_push|hang_mid_push[:step=N][:mark=PATH]")
    p.add_argument("--codec", default="raw", help="tensor codec: raw, fp16, int8")
    p.add_argument("--chunk-mb", type=float, default=None,
                   help="MB per chunk of the results and gradient pushes this worker sends (default: the run's)")
    p.add_argument("--slow", type=float, default=0.0, help="extra seconds per task (tests, demos)")
    p.add_argument("--fault-poison", type=float, default=1.0, metavar="SCALE",
                   help="fault injection: push the true gradients times SCALE (a dishonest worker; 1: honest)")
    p.add_argument("--fault-poison-kind", choices=("scale", "noise", "bias"), default="scale",
                   help="fault injection: scale (gradients times SCALE), noise (Gaussian noise of SCALE times "
                        "their norm instead) or bias (plus SCALE times their per-element RMS along a fixed sign vector)")
    p.add_argument("--fault-poison-from", type=int, default=0, metavar="STEP",
                   help="fault injection: poison the pushes of STEP and later only (honest before)")
    p.add_argument("--fault-slow", type=float, default=1.0, metavar="FACTOR",
                   help="fault injection: take FACTOR times the compute time of every task")
    p.add_argument("--fault-stop-from", type=int, default=-1, metavar="STEP",
                   help="fault injection: take no task of STEP or later (leave the run at the first)")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="lossy --codec: do not carry each gradient push's quantisation error into the next")
    p.add_argument("--no-graph-cache", action="store_true",
                   help="always recompute the forward in backward tasks (saves activation memory)")
    p.add_argument("--memory-gb", type=float, default=None, metavar="GB",
                   help="memory of its device this worker may use (default: all of it; e.g. a GPU shared with "
                        "other work): the planner places it by this, and it keeps forward graphs for its own "
                        "backward tasks only within it")
    p.add_argument("--prefetch", action="store_true",
                   help="exact sync: ask for the next task while computing this one, so the lease round trip "
                        "and the next input overlap compute (on a session: within the server's credit window, and a "
                        "task held ahead is taken back for an idle worker that would finish it sooner)")
    p.add_argument("--session", action=argparse.BooleanOptionalAction, default=None,
                   help="one session stream with the stage server for leases, results and renewals instead of a "
                        "gRPC call each (with --prefetch: grants ahead within a credit window, taken back for idle "
                        "workers); default: on in exact sync, off in local mode")
    p.add_argument("--shadow", action="store_true",
                   help="a shadow worker (runs of `--shadow` only): run no model; wait the emulated device's task "
                        "time (the scenario device it plays, else --flops) and send fixed tensors of the true shapes")
    p.add_argument("--count", type=int, default=1,
                   help="with --shadow: run this many shadow workers in this one process (names NAME-0, NAME-1, ...)")
    p.add_argument("--join-timeout", type=float, default=30.0,
                   help="seconds to keep retrying a coordinator that does not answer yet before giving up "
                        "(default: 30)")
    _measure_args(p)
    _dial_map_arg(p)
    from shoal.train.flags import add_device_args

    add_device_args(p, loss_scale=False, precision_help="refuse to join a run of another precision "
                                                        "(default: compute in the run's precision)")
    _common(p)
    _emulation_args(p)
    _hide(p, "--inject")
    _hide(p, "--fault-")
    p.set_defaults(func=run_worker_cmd)

    p = subparsers.add_parser("status", help="print a running swarm's status as tables")
    p.add_argument("--join", required=True, help="coordinator HOST:PORT")
    p.add_argument("--json", action="store_true", help="print the status as JSON instead")
    _common(p)
    p.set_defaults(func=run_status_cmd)

    p = subparsers.add_parser("keys", help="make a run CA and member certificate for TLS")
    p.add_argument("--out", required=True, help="folder to write ca.pem, ca.key, member.pem, member.key into")
    p.add_argument("--hosts", default="",
                   help="comma-separated host names and IPs members are dialled at (loopback is always in)")
    p.set_defaults(func=run_keys_cmd)

    p = subparsers.add_parser("launch", help="run a whole swarm as local processes")
    p.add_argument("--scenario", default=None, help="scenario name or file (worker count and speeds)")
    p.add_argument("--workers", type=int, default=None,
                   help="workers to start (default 2, or every worker device of --scenario)")
    p.add_argument("--standbys", type=int, default=0,
                   help="hot standby servers to start, each on its own checkpoint folder (stage k mod S)")
    p.add_argument("--emulate-speedup", type=float, default=1.0,
                   help="with --scenario: compute time scale of the emulated devices")
    p.add_argument("--out", default=None, help="run folder (required unless --resume)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the newest run in this folder (or --run-id) from its journal, with its "
                        "settings, from the last step every stage committed; run flags are ignored")
    p.add_argument("--run-id", default=None, help="with --resume: the run to continue (default: the newest)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--dashboard", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the coordinator serves the live dashboard (default: loopback, any free port)")
    p.add_argument("--no-dashboard", action="store_true", help="no web dashboard")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="inject a fault (repeatable): kill:worker|server[:NAME]:step=N, poison:wN:scale=F, "
                        "slow:wN:factor=F, stop:wN:step=N, flap:wN:period=S:down=S:for=S, corrupt-ckpt:STAGE[:step=N] "
                        "(see docs/faults.md)")
    p.add_argument("--insecure", action="store_true",
                   help="plain text between the members (default: TLS with keys made in RUN/tls)")
    p.add_argument("--no-fork-server", action="store_true",
                   help="start every member as a fresh interpreter (default: fork them from one process "
                        "that imported torch once; env SHOAL_FORK_SERVER=0 does the same)")
    p.add_argument("--session", action=argparse.BooleanOptionalAction, default=None,
                   help="workers keep one session stream with their stage server instead of a gRPC call per "
                        "lease, result and renewal (default: on in exact sync, off in local mode)")
    p.add_argument("--shadow-per-process", type=int, default=64,
                   help="with --shadow: at most this many shadow workers (playing one device) per process")
    _merge_memory_arg(p)
    _run_args(p, launch=True)
    p.set_defaults(func=run_launch_cmd)


def _merge_memory_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--merge-memory-gb", type=float, default=None, metavar="GB",
                   help="GB of pseudo-gradients a local-mode merge holds in memory at a stage server; beyond it "
                        "pushes wait as their compressed frames (large ones, int8 or raw, on disk) and are "
                        "decoded again where read; a replica "
                        "plan's peer parts have as much again (beyond it: their frames, raw ones on disk) "
                        "(default: a quarter of the host's RAM, at most half of what is free)")


def _dial_map_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dial-map", action="append", default=[], metavar="ADDR=VIA",
                   help="connect to VIA whenever a peer's address is ADDR (port forwards, tunnels, "
                        "test proxies); repeatable")


def dial_map(pairs: list[str]) -> dict[str, str]:
    """``["ADDR=VIA", ...]`` -> {ADDR: VIA}; a malformed pair is a one-line error."""
    out = {}
    for pair in pairs:
        addr, sep, via = pair.partition("=")
        if not sep or ":" not in addr or ":" not in via:
            raise ShoalError(f"--dial-map {pair!r}: want HOST:PORT=HOST:PORT")
        out[addr] = via
    return out


def _with_dial_map(args, dial):
    """The emulation ``dial`` hook (or none) behind the ``--dial-map`` rewrites."""
    mapping = dial_map(getattr(args, "dial_map", []) or [])
    if not mapping:
        return dial

    def rewrite(address: str) -> str:
        address = mapping.get(address, address)
        return dial(address) if dial else address

    return rewrite


def _emulation_args(p: argparse.ArgumentParser) -> None:
    try:
        from shoal.emulate.hooks import add_emulation_args
    except ImportError:  # emulation is optional
        return
    add_emulation_args(p)
    _hide(p, "--emulate-")


def _hide(p: argparse.ArgumentParser, prefix: str) -> None:
    """Keep the flags starting with ``prefix`` out of ``--help`` (and docs/cli.md); still accepted.

    Test and emulation harness flags (``shoal launch`` and the tests pass them to the
    members they start) are not something a person joining a run types; docs/faults.md and
    docs/emulation.md describe them."""
    for action in p._actions:
        if any(o.startswith(prefix) for o in action.option_strings):
            action.help = argparse.SUPPRESS


def _emulation(args):
    """(dial, pacer, on_servers) hooks from --emulate-* flags, or Nones."""
    try:
        from shoal.emulate.hooks import hooks_from_args
    except ImportError:
        return None, None, None
    em = hooks_from_args(args)
    if em is None:
        return None, None, None

    def on_servers(addresses: list[str]) -> None:
        for stage, addr in enumerate(addresses):
            if addr:
                em.dial.set_stage_address(stage, addr)

    return em.dial, em.pacer, on_servers


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def check_address(flag: str, value: str) -> str:
    """``value`` if it is ``HOST:PORT`` (port 1-65535), else a one-line error naming ``flag``."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShoalError(f"{flag} must be HOST:PORT (e.g. 127.0.0.1:7000), got {value!r}")
    return value


def _token(args) -> str:
    from shoal.net.channel import load_token

    return load_token(token_file=getattr(args, "token_file", None))


def _server_token(args, required: bool) -> str:
    from shoal.net.channel import load_server_token

    return load_server_token(getattr(args, "server_token_file", None), required=required)


def _spec(args):
    from shoal.model.config import get_preset
    from shoal.net import shoal_pb2 as pb
    from shoal.net.stream import chunk_bytes_from_mb
    from shoal.runtime.processes.launch import resolve_ckpt_every, resolve_ckpt_every_s
    from shoal.train.flags import workload_from_args
    from shoal.train.optim import OptimConfig

    w = workload_from_args(args)
    init_from = getattr(args, "init_from", None)
    if init_from:
        from shoal.hf.convert import read_hf_model_config

        if getattr(args, "model", None) is not None:
            raise ShoalError("--init-from sets the model shape from its config.json; drop --model")
        init_from = str(Path(init_from).expanduser().resolve())
        cfg = read_hf_model_config(init_from)
    else:
        cfg = get_preset(w.model)
    for name in ("steps", "micro_batches", "micro_batch_size", "seq_len"):
        if getattr(w, name) <= 0:
            raise ShoalError(f"--{name.replace('_', '-')} must be positive, got {getattr(w, name)}")
    replicas = None
    if getattr(args, "replicas", ""):
        from shoal.runtime.sync.replicas import (
            parse_replica_plan,
            read_replica_workers,
            resolve_replicas,
        )

        args.replica_workers = read_replica_workers(args.replicas)  # a plan file's worker placement
        args.replicas = resolve_replicas(args.replicas, w.micro_batches, cfg.n_total_layers)
        replicas = parse_replica_plan(args.replicas, w.micro_batches, cfg.n_total_layers)
        args.stages = sum(replicas[0])
    if args.stages <= 0:
        raise ShoalError(f"--stages must be positive, got {args.stages}")
    if args.stages > cfg.n_total_layers:
        raise ShoalError(f"--stages {args.stages} exceeds the {cfg.n_total_layers} layers of {cfg.name}")
    if w.seq_len > cfg.max_seq_len:
        raise ShoalError(f"--seq-len {w.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    min_lr = w.lr / 10 if w.min_lr is None else w.min_lr
    loss_scale = args.loss_scale or 0.0
    if args.loss_scale is not None and not (math.isfinite(args.loss_scale) and args.loss_scale >= 1):
        raise ShoalError(f"--loss-scale must be a finite number >= 1, got {args.loss_scale}")
    OptimConfig(lr=w.lr, min_lr=min_lr, warmup_steps=w.warmup, weight_decay=w.weight_decay,
                grad_clip=w.grad_clip).validate()
    from shoal.data.prepare import resolve_run_data
    from shoal.runtime.common import data_identity

    data = resolve_run_data(args.data, getattr(args, "out", None), cfg.vocab_size)
    from shoal.train.outer import sync_from_args

    sync = sync_from_args(args, args.precision or "fp32")
    from shoal.runtime.sync.codecs import parse_run_compression

    compression = parse_run_compression(args.compression)
    from shoal.runtime.roles.shadow import check_shadow_sync

    check_shadow_sync(getattr(args, "shadow", False), sync.local)
    spec = pb.RunSpec(
        version=1, model=cfg.name if init_from else w.model, stages=args.stages, steps=w.steps, micro_batches=w.micro_batches,
        micro_batch_size=w.micro_batch_size, seq_len=w.seq_len, seed=w.seed, lr=w.lr,
        min_lr=min_lr, warmup=w.warmup, weight_decay=w.weight_decay, grad_clip=w.grad_clip,
        ckpt_every=resolve_ckpt_every(args.ckpt_every), ckpt_every_s=resolve_ckpt_every_s(args.ckpt_every_s),
        dead_after_s=args.dead_after, min_lease_s=args.min_lease,
        max_message_bytes=256 * 1024 * 1024, data=data, data_hash=data_identity(data),
        ordered_grads=not args.unordered_grads,
        chunk_bytes=chunk_bytes_from_mb(args.chunk_mb),
        precision=args.precision or "fp32", loss_scale_init=loss_scale,
        init_from=init_from or "", model_config_json=json.dumps(cfg.to_dict()) if init_from else "",
        sync_mode=sync.mode, sync_every=sync.sync_every, outer_lr=sync.outer_lr, outer_momentum=sync.outer_momentum,
        sync_overlap=sync.overlap, sync_lean=sync.lean,
        guard_spot_check=_spot_check(args.spot_check), guard_server_checks=bool(getattr(args, "server_checks", False)),
        shadow=bool(getattr(args, "shadow", False)))
    compression.to_spec(spec)
    if replicas is not None:
        from shoal.runtime.sync.replicas import check_replica_run

        spec.replica_stages.extend(replicas[0])
        spec.replica_mbs.extend(replicas[1])
        spec.replica_layers.extend(replicas[2])
        from shoal.runtime.sync.replicas import parse_replica_regions

        spec.replica_regions.extend(parse_replica_regions(args.replicas))
        check_replica_run(spec, cfg.n_total_layers)
    return spec


# Coordinator options a run's journal keeps, with their flag defaults: `--resume` takes
# the journal's value for each one left at its default.
_KEPT_OPTIONS = {"min_workers": 1, "stall_timeout": 900.0, "advertise": None, "emulate_scenario": None,
                 "emulate_speedup": 1.0, "emulate_latency_scale": 1.0, "emulate_bandwidth_scale": 1.0,
                 "tensorboard": None}


def _resume_args(args):
    """``--resume``: the run's journal state, with ``args`` completed from it (out, listen, options)."""
    from shoal.runtime.safety.journal import load_resume

    out, _, state = load_resume(args.resume, args.run_id)
    if args.out and Path(args.out).resolve() != out.resolve():
        raise ShoalError(f"--out {args.out} and --resume {args.resume} name different run folders; drop --out")
    args.out = str(out)
    for k, default in _KEPT_OPTIONS.items():
        if getattr(args, k) == default and k in state.options:
            setattr(args, k, state.options[k])
    if args.listen is None:
        args.listen = state.options.get("bound") or "127.0.0.1:7070"
    return state


def _spot_check(f: float) -> float:
    """``--spot-check`` checked: a fraction in [0, 1]."""
    if not (math.isfinite(f) and 0.0 <= f <= 1.0):
        raise ShoalError(f"--spot-check must be a fraction between 0 and 1, got {f}")
    return f


def run_coordinator_cmd(args) -> int:
    from shoal.net.channel import check_listen

    if args.run_id and not args.resume:
        raise ShoalError("--run-id names the run to take over: use it with --resume RUN_DIR")
    state = _resume_args(args) if args.resume else None
    args.listen = args.listen or "127.0.0.1:7070"
    check_listen(args.listen, args.advertise)  # before the heavy imports: a refusal is instant
    from shoal.runtime.common import set_threads
    from shoal.runtime.roles.coordinator import run_coordinator

    _logging(args.log_level)
    set_threads()
    if state is not None:
        from google.protobuf import json_format

        from shoal.net import shoal_pb2 as pb

        spec = json_format.ParseDict(state.spec, pb.RunSpec())
        if not spec.data_hash:  # a run journaled before data hashes: the folder is still on this host
            from shoal.runtime.common import data_identity

            spec.data_hash = data_identity(spec.data)
    else:
        spec = _spec(args)
    if args.tensorboard and not args.out:
        raise ShoalError("--tensorboard mirrors the run's metrics.jsonl: give the run folder too (--out DIR)")
    if args.tensorboard:
        args.tensorboard = str(Path(args.tensorboard).expanduser().resolve())
    options = {k: getattr(args, k) for k in _KEPT_OPTIONS}
    if getattr(args, "replica_workers", None):
        options["replica_workers"] = args.replica_workers  # the planner's placement of a replica plan file
    tls = _tls(args, args.listen, args.advertise)
    from shoal.runtime.loopwatch import watched

    summary = asyncio.run(watched(run_coordinator(spec, _token(args), args.listen, min_workers=args.min_workers,
                                                  out=args.out, address_file=args.address_file,
                                                  emulated=_emulated_scenario(args), dashboard=_dashboard(args),
                                                  stall_fail_s=args.stall_timeout,
                                                  advertise=args.advertise, resume=state, options=options, tls=tls,
                                                  server_token=_server_token(args, required=False)), "coordinator"))
    print(json.dumps({k: summary[k] for k in ("steps", "final_loss", "requeues", "tokens_per_s")}))
    return 0


def _dashboard(args) -> str | None:
    """The coordinator's ``--dashboard`` bind address, checked (None: no dashboard)."""
    if not args.dashboard:
        return None
    from shoal.runtime.ui.dashboard import parse_bind

    parse_bind(args.dashboard)
    return args.dashboard


def _emulated_scenario(args):
    """The coordinator's ``--emulate-*`` scenario, scaled as the processes run it (or None)."""
    if not args.emulate_scenario:
        return None
    from shoal.emulate.pacing import emulated_scenario
    from shoal.plan.scenario import load_scenario

    for name in ("speedup", "latency_scale", "bandwidth_scale"):
        if not getattr(args, f"emulate_{name}") > 0:
            raise ShoalError(f"--emulate-{name.replace('_', '-')} must be positive")
    return emulated_scenario(load_scenario(args.emulate_scenario), args.emulate_speedup,
                             args.emulate_latency_scale, args.emulate_bandwidth_scale)


def _memory_bytes(gb: float | None) -> float:
    """``--memory-gb`` in bytes (0: the device's own figure)."""
    if gb is None:
        return 0.0
    if not (math.isfinite(gb) and gb > 0):
        raise ShoalError(f"--memory-gb must be a positive number of GB, got {gb}")
    return gb * 1e9


def _played_device(args) -> str:
    """The scenario device a server or worker plays (its ``--emulate-device``), or ""."""
    return (getattr(args, "emulate_device", None) or "") if getattr(args, "emulate_scenario", None) else ""


def run_server_cmd(args) -> int:
    from shoal.net.channel import check_listen, split_address
    from shoal.net.stream import chunk_bytes_from_mb

    check_listen(args.listen, args.advertise)  # before the heavy imports: a refusal is instant
    split_address(args.join)
    chunk = chunk_bytes_from_mb(args.chunk_mb, default=0)
    from shoal.runtime.sync.held import merge_memory_bytes

    merge_memory_bytes(args.merge_memory_gb)
    from shoal.runtime.roles.server import serve

    check_address("--join", args.join)
    _measure_opts(args)  # its one-line errors come before any about keys
    tls = _tls(args, args.join, args.listen, args.advertise)
    _logging(args.log_level)
    dial, _, on_servers = _emulation(args)
    dial = _with_dial_map(args, dial)
    serve(args.join, args.listen, _token(args), args.ckpt_dir, name=args.name, dial=dial,
          on_servers=on_servers, device=_played_device(args), **_measure_opts(args),
          advertise=args.advertise, chunk_bytes=chunk, tls=tls, standby=args.standby, data=args.data,
          server_token=_server_token(args, required=True), merge_memory=merge_memory_bytes(args.merge_memory_gb))
    return 0


def run_worker_cmd(args) -> int:
    from shoal.net.channel import split_address
    from shoal.net.compress import CODECS
    from shoal.net.stream import chunk_bytes_from_mb
    from shoal.runtime.roles.worker import WorkerOptions, work
    from shoal.train.precision import resolve_device

    resolve_device(args.device)  # a bad --device is an error before anything else
    check_address("--join", args.join)
    if not args.join_timeout > 0:
        raise ShoalError(f"--join-timeout must be a positive number of seconds, got {args.join_timeout}")
    if args.codec not in CODECS:
        raise ShoalError(f"--codec must be one of {', '.join(CODECS)}, got {args.codec!r}")
    _measure_opts(args)  # its one-line errors come before any about keys
    tls = _tls(args, args.join)
    _logging(args.log_level)
    split_address(args.join)
    chunk = chunk_bytes_from_mb(args.chunk_mb, default=0)
    dial, pacer, on_servers = _emulation(args)
    dial = _with_dial_map(args, dial)
    if args.count != 1 and not args.shadow:
        raise ShoalError("--count runs several workers in one process: shadow workers only; add --shadow")
    if args.count < 1:
        raise ShoalError(f"--count must be at least 1, got {args.count}")
    if args.shadow and not args.flops and pacer is None:
        raise ShoalError("--shadow needs the device's speed: --flops F or --emulate-device (with its scenario)")
    work(args.join, _token(args), WorkerOptions(name=args.name, flops=args.flops, inject=args.inject,
                                                codec=args.codec, slow_s=args.slow,
                                                fault_poison=args.fault_poison, fault_slow=args.fault_slow,
                                                fault_poison_kind=args.fault_poison_kind,
                                                fault_poison_from=args.fault_poison_from,
                                                fault_stop_from=args.fault_stop_from,
                                                graph_cache=not args.no_graph_cache, prefetch=args.prefetch,
                                                session=args.session, shadow=args.shadow,
                                                error_feedback=not args.no_error_feedback,
                                                device=_played_device(args), **_measure_opts(args),
                                                compute_device=args.device or "auto",
                                                torch_device=args.device or "auto",
                                                precision=args.precision,
                                                join_timeout_s=args.join_timeout,
                                                chunk_bytes=chunk, memory=_memory_bytes(args.memory_gb)),
         dial=dial, pacer=pacer, on_servers=on_servers, tls=tls, count=args.count)
    return 0


def run_status_cmd(args) -> int:
    from shoal.runtime.processes.launch import swarm_status

    check_address("--join", args.join)
    status = swarm_status(args.join, _token(args), tls=_tls(args, args.join))
    if args.json:
        print(json.dumps(status, indent=1, sort_keys=True))
        return 0
    from rich.console import Console

    from shoal.runtime.ui.status_table import status_tables

    Console().print(status_tables(status))
    return 0


def run_launch_cmd(args) -> int:
    from shoal.runtime.processes.launch import LaunchConfig, launch, stop_on_signals
    from shoal.train.flags import workload_from_args

    w = workload_from_args(args)
    if args.init_from and args.model is not None:
        raise ShoalError("--init-from sets the model shape from its config.json; drop --model")
    if args.run_id and not args.resume:
        raise ShoalError("--run-id names the run to continue: use it with --resume RUN_DIR")
    if not args.out and not args.resume:
        raise ShoalError("give the run folder: --out DIR (or --resume DIR to continue a run)")
    if args.out and args.resume and Path(args.out).resolve() != Path(args.resume).resolve():
        raise ShoalError(f"--out {args.out} and --resume {args.resume} name different run folders; drop --out")
    cfg = LaunchConfig(
        out=args.resume or args.out, resume=bool(args.resume), run_id=args.run_id, model=w.model, stages=args.stages, replicas=args.replicas, workers=args.workers, steps=w.steps,
        micro_batches=w.micro_batches, micro_batch_size=w.micro_batch_size, seq_len=w.seq_len,
        seed=w.seed, lr=w.lr, min_lr=w.min_lr, warmup=w.warmup, weight_decay=w.weight_decay,
        grad_clip=w.grad_clip, ckpt_every=args.ckpt_every, ckpt_every_s=args.ckpt_every_s,
        dead_after_s=args.dead_after, min_lease_s=args.min_lease, data=tuple(args.data or ("corpus",)), init_from=args.init_from,
        timeout_s=args.timeout, scenario=args.scenario,
        ordered_grads=not args.unordered_grads, emulate_speedup=args.emulate_speedup,
        dashboard=None if args.no_dashboard else args.dashboard, chunk_mb=args.chunk_mb, tensorboard=args.tensorboard,
        device=args.device or "auto", precision=args.precision or "fp32", loss_scale=args.loss_scale,
        sync=args.sync, sync_every=args.sync_every, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        overlap=args.overlap, lean=args.lean,
        compression=args.compression, faults=list(args.fault), spot_check=args.spot_check,
        server_checks=args.server_checks, standbys=args.standbys,
        tls=not args.insecure, fork_server=not args.no_fork_server, session=args.session,
        shadow=args.shadow, shadow_per_process=args.shadow_per_process, merge_memory_gb=args.merge_memory_gb)
    if cfg.dashboard:
        from shoal.runtime.ui.dashboard import parse_bind

        parse_bind(cfg.dashboard)

    stop_on_signals()

    def started(swarm) -> None:
        keys = f" --tls-dir {swarm.tls_dir}" if swarm.tls_dir else " --insecure"
        print(f"coordinator at {swarm.address}; join token in {swarm.token_file} (mode 0600): "
              f"add members with --join {swarm.address} --token-file {swarm.token_file}{keys}", flush=True)
        if swarm.dashboard_url:
            print(f"dashboard: {swarm.dashboard_url}", flush=True)

    summary = launch(cfg, on_event=lambda r: print(_fmt(r), flush=True), on_start=started)
    page = Path(cfg.out) / "dashboard.html"
    if page.exists():
        print(f"the run's final state (static dashboard): {page}", flush=True)
    print(json.dumps({k: summary.get(k) for k in ("steps", "final_loss", "requeues", "tokens_per_s",
                                                  "wall_time_s")}))
    return 0


def run_keys_cmd(args) -> int:
    """``shoal keys``: write a fresh run CA and member certificate."""
    from shoal.net.tls import make_keys

    hosts = tuple(h.strip() for h in args.hosts.split(",") if h.strip())
    out = make_keys(args.out, hosts)
    print(f"keys in {out}: give every member --tls-dir {out} (copy it to each machine; "
          f"ca.key is only needed to sign more certificates)")
    return 0


def _fmt(r: dict) -> str:
    if r.get("event") == "step":
        return f"step {r['step']}  loss {r['loss']:.4f}  {r['tokens_per_s']:.0f} tok/s  requeues {r.get('requeues', 0)}"
    return "event " + json.dumps(r, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m shoal.runtime.processes.cli`` (how launch starts its processes)."""
    from shoal.memory import tune_malloc

    tune_malloc()  # (large buffers reused, not faulted in afresh: shoal/memory.py)
    parser = argparse.ArgumentParser(prog="shoal-runtime")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    prof = _profile_member(args.command)
    try:
        return int(args.func(args) or 0)
    except ShoalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if prof is not None:
            prof()


class _Snapshot:
    """A profile's stats dict in the shape ``pstats.Stats.add`` reads."""

    def __init__(self, stats: dict):
        self.stats = stats

    def create_stats(self) -> None:
        pass


def _profile_member(command: str):
    """With ``SHOAL_PROFILE=DIR``: profile this member with cProfile, its main thread and every
    thread started after this call (executor threads: compute, serialisation, checks), and dump
    ``DIR/COMMAND-PID-N.prof`` (all threads' calls merged; N counts the dumps) on exit and on SIGUSR1 (a member killed
    at the run's end never exits by itself). Returns the dump function, or None when profiling
    is off."""
    folder = os.environ.get("SHOAL_PROFILE")
    if not folder:
        return None
    import cProfile
    import pstats
    import signal
    import threading
    import time

    Path(folder).mkdir(parents=True, exist_ok=True)
    # Each thread's own CPU time, not wall time: a thread waiting in a queue or a poll is free.
    prof = cProfile.Profile(time.thread_time)
    others: list[cProfile.Profile] = []
    run = threading.Thread.run

    def profiled_run(self):
        p = cProfile.Profile(time.thread_time)
        others.append(p)
        p.enable()
        try:
            run(self)
        finally:
            p.disable()

    threading.Thread.run = profiled_run

    dumps = [0]

    def dump(*_):
        dumps[0] += 1
        prof.disable()
        stats = pstats.Stats(prof)
        for p in list(others):
            p.snapshot_stats()  # read without disabling (create_stats would): the thread may run
            if p.stats:
                stats.add(_Snapshot(p.stats))
        # Numbered: the difference of two dumps is what the member did between them.
        stats.dump_stats(str(Path(folder) / f"{command}-{os.getpid()}-{dumps[0]}.prof"))
        prof.enable()

    signal.signal(signal.SIGUSR1, dump)
    prof.enable()
    return dump


if __name__ == "__main__":
    sys.exit(main())
