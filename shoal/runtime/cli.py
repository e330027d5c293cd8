"""``shoal coordinator | server | worker | launch``: the runtime's processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from shoal.errors import ShoalError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", help="file holding the join token (default: env SHOAL_TOKEN)")
    p.add_argument("--log-level", default="INFO", help="logging level (INFO, DEBUG, WARNING)")


def _run_args(p: argparse.ArgumentParser, launch: bool = False) -> None:
    from shoal.train.flags import add_data_args, add_workload_args

    add_workload_args(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages S")
    p.add_argument("--ckpt-every", type=int, default=1, help="servers checkpoint every K steps")
    p.add_argument("--dead-after", type=float, default=3.0, help="seconds of silence before a member is dead")
    p.add_argument("--min-lease", type=float, default=2.0, help="shortest task lease in seconds")
    p.add_argument("--unordered-grads", action="store_true",
                   help="workers push one summed gradient per step (less traffic; parity only up to "
                        "float summation order) instead of one per micro-batch")
    add_data_args(p, runtime=True)


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
    p.add_argument("--inject", default="", help="test faults, once each: nan_grad,bad_shape")
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


def _token(args) -> str:
    from shoal.net.channel import load_token

    return load_token(token_file=getattr(args, "token_file", None))


def _spec(args):
    from shoal.model.config import get_preset
    from shoal.net import shoal_pb2 as pb
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
    if args.stages <= 0:
        raise ShoalError(f"--stages must be positive, got {args.stages}")
    if args.stages > cfg.n_total_layers:
        raise ShoalError(f"--stages {args.stages} exceeds the {cfg.n_total_layers} layers of {cfg.name}")
    if w.seq_len > cfg.max_seq_len:
        raise ShoalError(f"--seq-len {w.seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    min_lr = w.lr / 10 if w.min_lr is None else w.min_lr
    OptimConfig(lr=w.lr, min_lr=min_lr, warmup_steps=w.warmup, weight_decay=w.weight_decay,
                grad_clip=w.grad_clip).validate()
    from shoal.data.prepare import resolve_run_data

    data = resolve_run_data(args.data, getattr(args, "out", None), cfg.vocab_size)
    return pb.RunSpec(
        version=1, model=cfg.name if init_from else w.model, stages=args.stages, steps=w.steps, micro_batches=w.micro_batches,
        micro_batch_size=w.micro_batch_size, seq_len=w.seq_len, seed=w.seed, lr=w.lr,
        min_lr=min_lr, warmup=w.warmup, weight_decay=w.weight_decay, grad_clip=w.grad_clip,
        ckpt_every=args.ckpt_every, dead_after_s=args.dead_after, min_lease_s=args.min_lease,
        max_message_bytes=256 * 1024 * 1024, data=data, ordered_grads=not args.unordered_grads,
        init_from=init_from or "", model_config_json=json.dumps(cfg.to_dict()) if init_from else "")


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

    _logging(args.log_level)
    dial, _, on_servers = _emulation(args)
    serve(args.join, args.listen, _token(args), args.ckpt_dir, name=args.name, dial=dial,
          on_servers=on_servers, device=_played_device(args))
    return 0


def run_worker_cmd(args) -> int:
    from shoal.runtime.worker import WorkerOptions, work

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

    print(json.dumps(swarm_status(args.join, _token(args)), indent=1, sort_keys=True))
    return 0


def run_launch_cmd(args) -> int:
    from shoal.runtime.launch import LaunchConfig, launch
    from shoal.train.flags import workload_from_args

    w = workload_from_args(args)
    if args.init_from and args.model is not None:
        raise ShoalError("--init-from sets the model shape from its config.json; drop --model")
    cfg = LaunchConfig(
        out=args.out, model=w.model, stages=args.stages, workers=args.workers, steps=w.steps,
        micro_batches=w.micro_batches, micro_batch_size=w.micro_batch_size, seq_len=w.seq_len,
        seed=w.seed, lr=w.lr, min_lr=w.min_lr, warmup=w.warmup, weight_decay=w.weight_decay,
        grad_clip=w.grad_clip, ckpt_every=args.ckpt_every, dead_after_s=args.dead_after,
        min_lease_s=args.min_lease, data=tuple(args.data or ("corpus",)), init_from=args.init_from, timeout_s=args.timeout, scenario=args.scenario,
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
