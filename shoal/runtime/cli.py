"""``shoal coordinator | server | worker | launch``: the runtime's processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from shoal.errors import ShoalError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the join token (default: env SHOAL_TOKEN)")
    p.add_argument("--log-level", default="INFO", help="logging level (INFO, DEBUG, WARNING)")


def _run_args(p: argparse.ArgumentParser, launch: bool = False) -> None:
    p.add_argument("--model", default="tiny", help="model preset")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages S")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step M")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument("--ckpt-every", type=int, default=1, help="servers checkpoint every K steps")
    p.add_argument("--dead-after", type=float, default=3.0, help="seconds of silence before a member is dead")
    p.add_argument("--min-lease", type=float, default=2.0, help="shortest task lease in seconds")
    p.add_argument("--unordered-grads", action="store_true",
                   help="workers push one summed gradient per step (less traffic; parity only up to "
                        "float summation order) instead of one per micro-batch")
    p.add_argument("--data", choices=("corpus", "synthetic"), default="corpus",
                   help="micro-batches from the corpus (like shoal train) or synthetic tokens")


def register(subparsers) -> None:
    """Add the runtime subcommands."""
    p = subparsers.add_parser("coordinator", help="run the coordinator of a swarm")
    p.add_argument("--listen", default="127.0.0.1:7070", help="HOST:PORT to listen on (port 0: any)")
    p.add_argument("--min-workers", type=int, default=1, help="workers needed before step 0")
    p.add_argument("--out", default=None, help="run folder for metrics, events and final weights")
    p.add_argument("--address-file", default=None, help="write the listening address here")
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
    p.add_argument("--ckpt-dir", default="shoal_ckpt", help="checkpoint root (one folder per stage)")
    p.add_argument("--name", default="server", help="label in events")
    _common(p)
    _emulation_args(p)
    p.set_defaults(func=run_server_cmd)

    p = subparsers.add_parser("worker", help="run a worker that joins a coordinator")
    p.add_argument("--join", required=True, help="coordinator HOST:PORT")
    p.add_argument("--name", default="worker", help="label in events and metrics")
    p.add_argument("--flops", type=float, default=None, help="FLOP/s to report (default: measure)")
    p.add_argument("--inject", default="", help="test faults: nan_grad,bad_shape (once each), hang_fwd|hang_bwd|hang_before_push|hang_mid_push[:step=N][:mark=PATH]")
    p.add_argument("--codec", default="raw", help="tensor codec: raw, fp16, int8")
    p.add_argument("--slow", type=float, default=0.0, help="extra seconds per task (tests, demos)")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="lossy --codec: do not carry each gradient push's quantisation error into the next")
    p.add_argument("--no-graph-cache", action="store_true",
                   help="always recompute the forward in backward tasks (saves activation memory)")
    _common(p)
    _emulation_args(p)
    p.set_defaults(func=run_worker_cmd)

    p = subparsers.add_parser("status", help="print a running swarm's status (JSON)")
    p.add_argument("--join", required=True, help="coordinator HOST:PORT")
    _common(p)
    p.set_defaults(func=run_status_cmd)

    p = subparsers.add_parser("launch", help="run a whole swarm as local processes")
    p.add_argument("--scenario", default=None, help="scenario name or file (worker count and speeds)")
    p.add_argument("--workers", type=int, default=None,
                   help="workers to start (default 2, or every worker device of --scenario)")
    p.add_argument("--emulate-speedup", type=float, default=1.0,
                   help="with --scenario: compute time scale of the emulated devices")
    p.add_argument("--out", required=True, help="run folder")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    _run_args(p, launch=True)
    p.set_defaults(func=run_launch_cmd)


def _emulation_args(p: argparse.ArgumentParser) -> None:
    try:
        from shoal.emulate.hooks import add_emulation_args
    except ImportError:  # emulation is optional
        return
    add_emulation_args(p)


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


def _spec(args):
    from shoal.model.config import get_preset
    from shoal.net import shoal_pb2 as pb
    from shoal.train.optim import OptimConfig

    cfg = get_preset(args.model)
    for name in ("stages", "steps", "micro_batches", "micro_batch_size", "seq_len"):
        if getattr(args, name) <= 0:
            raise ShoalError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.stages > cfg.n_total_layers:
        raise ShoalError(f"--stages {args.stages} exceeds the {cfg.n_total_layers} layers of {cfg.name}")
    if args.seq_len > cfg.max_seq_len:
        raise ShoalError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    OptimConfig(lr=args.lr, min_lr=min_lr, warmup_steps=args.warmup, weight_decay=args.weight_decay,
                grad_clip=args.grad_clip).validate()
    return pb.RunSpec(
        version=1, model=args.model, stages=args.stages, steps=args.steps, micro_batches=args.micro_batches,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, seed=args.seed, lr=args.lr,
        min_lr=min_lr, warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        ckpt_every=args.ckpt_every, dead_after_s=args.dead_after, min_lease_s=args.min_lease,
        max_message_bytes=256 * 1024 * 1024, data=args.data, ordered_grads=not args.unordered_grads)


def run_coordinator_cmd(args) -> int:
    from shoal.runtime.common import set_threads
    from shoal.runtime.coordinator import run_coordinator

    _logging(args.log_level)
    set_threads()
    spec = _spec(args)
    summary = asyncio.run(run_coordinator(spec, _token(args), args.listen, min_workers=args.min_workers,
                                          out=args.out, address_file=args.address_file,
                                          emulated=_emulated_scenario(args)))
    print(json.dumps({k: summary[k] for k in ("steps", "final_loss", "requeues", "tokens_per_s")}))
    return 0


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


def _played_device(args) -> str:
    """The scenario device a server or worker plays (its ``--emulate-device``), or ""."""
    return (getattr(args, "emulate_device", None) or "") if getattr(args, "emulate_scenario", None) else ""


def run_server_cmd(args) -> int:
    from shoal.runtime.server import serve

    check_address("--join", args.join)
    _logging(args.log_level)
    dial, _, on_servers = _emulation(args)
    serve(args.join, args.listen, _token(args), args.ckpt_dir, name=args.name, dial=dial,
          on_servers=on_servers, device=_played_device(args))
    return 0


def run_worker_cmd(args) -> int:
    from shoal.net.compress import CODECS
    from shoal.runtime.worker import WorkerOptions, work

    check_address("--join", args.join)
    if args.codec not in CODECS:
        raise ShoalError(f"--codec must be one of {', '.join(CODECS)}, got {args.codec!r}")
    _logging(args.log_level)
    dial, pacer, on_servers = _emulation(args)
    work(args.join, _token(args), WorkerOptions(name=args.name, flops=args.flops, inject=args.inject,
                                                codec=args.codec, slow_s=args.slow,
                                                graph_cache=not args.no_graph_cache,
                                                error_feedback=not args.no_error_feedback,
                                                device=_played_device(args)),
         dial=dial, pacer=pacer, on_servers=on_servers)
    return 0


def run_status_cmd(args) -> int:
    from shoal.runtime.launch import swarm_status

    check_address("--join", args.join)
    print(json.dumps(swarm_status(args.join, _token(args)), indent=1, sort_keys=True))
    return 0


def run_launch_cmd(args) -> int:
    from shoal.runtime.launch import LaunchConfig, launch

    cfg = LaunchConfig(
        out=args.out, model=args.model, stages=args.stages, workers=args.workers, steps=args.steps,
        micro_batches=args.micro_batches, micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
        seed=args.seed, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, ckpt_every=args.ckpt_every, dead_after_s=args.dead_after,
        min_lease_s=args.min_lease, data=args.data, timeout_s=args.timeout, scenario=args.scenario,
        ordered_grads=not args.unordered_grads, emulate_speedup=args.emulate_speedup)
    summary = launch(cfg, on_event=lambda r: print(_fmt(r), flush=True))
    print(json.dumps({k: summary.get(k) for k in ("steps", "final_loss", "requeues", "tokens_per_s",
                                                  "wall_time_s")}))
    return 0


def _fmt(r: dict) -> str:
    if r.get("event") == "step":
        return f"step {r['step']}  loss {r['loss']:.4f}  {r['tokens_per_s']:.0f} tok/s  requeues {r.get('requeues', 0)}"
    return "event " + json.dumps(r, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m shoal.runtime.cli`` (how launch starts its processes)."""
    parser = argparse.ArgumentParser(prog="shoal-runtime")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ShoalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
