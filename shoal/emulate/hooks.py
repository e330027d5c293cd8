"""Turn a runtime process into an emulated scenario device: flags -> dial + pacer hooks.

The runtime's worker and server commands call :func:`add_emulation_args` on their
parser and :func:`hooks_from_args` after parsing; a launcher (the demo) builds the
flags with :meth:`EmulationConfig.to_args`. The returned :class:`Emulation` holds

* ``dial`` -- a :class:`~shoal.emulate.links.ScenarioDial` for the channel factory's
  ``dial`` hook (every outbound gRPC channel goes through a shaping relay);
* ``pacer`` -- a :class:`~shoal.emulate.pacing.ComputePacer` for the worker's
  ``pacer`` hook (None for a device without compute, e.g. a server host).

Peers on ephemeral ports: with ``--emulate-stage-servers host-a,host-b`` the runtime
calls ``emulation.dial.set_stage_address(stage, address)`` when it learns where stage
``stage``'s server listens (one line); or pass ``resolve(address) -> device id | None``;
``--emulate-default-peer`` shapes every other address (coordinator included) as a link
to that device.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.emulate.links import ScenarioDial
from shoal.emulate.pacing import ComputePacer
from shoal.errors import ShoalError


@dataclass
class EmulationConfig:
    """How one process emulates its scenario device."""

    scenario: str  # scenario name or file (shoal.plan.scenario.load_scenario)
    device: str  # id of the device this process plays
    speedup: float = 1.0  # compute time scale: pad to flops / (device_flops * speedup)
    latency_scale: float = 1.0  # multiplies every scenario latency
    bandwidth_scale: float = 1.0  # multiplies every scenario bandwidth
    jitter_s: float = 0.0  # std-dev of per-chunk delay variation, seconds
    peers: dict[str, str] = field(default_factory=dict)  # known peer address -> device id
    seed: int = 0  # jitter random seed
    stage_servers: list[str] = field(default_factory=list)  # stage index -> server host device id
    default_peer: str | None = None  # device behind any other address (None: leave unshaped)

    def validate(self) -> None:
        """Raise :class:`ShoalError` for a non-positive scale or negative jitter."""
        for name in ("speedup", "latency_scale", "bandwidth_scale"):
            v = getattr(self, name)
            if not v > 0:
                raise ShoalError(f"--emulate-{name.replace('_', '-')} must be positive, got {v}")
        if self.jitter_s < 0:
            raise ShoalError(f"--emulate-jitter must be >= 0 seconds, got {self.jitter_s}")

    def to_args(self) -> list[str]:
        """The command-line flags that :func:`config_from_args` reads back."""
        args = ["--emulate-scenario", self.scenario, "--emulate-device", self.device,
                "--emulate-speedup", repr(self.speedup),
                "--emulate-latency-scale", repr(self.latency_scale),
                "--emulate-bandwidth-scale", repr(self.bandwidth_scale),
                "--emulate-jitter", repr(self.jitter_s), "--emulate-seed", str(self.seed)]
        if self.peers:
            args += ["--emulate-peers", json.dumps(self.peers, sort_keys=True)]
        if self.stage_servers:
            args += ["--emulate-stage-servers", ",".join(self.stage_servers)]
        if self.default_peer:
            args += ["--emulate-default-peer", self.default_peer]
        return args


def add_emulation_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--emulate-*`` flags (all optional; emulation is off without a scenario)."""
    g = parser.add_argument_group("emulation (behave as a scenario device)")
    g.add_argument("--emulate-scenario", default=None, help="scenario name or file to emulate")
    g.add_argument("--emulate-device", default=None, help="device id this process plays")
    g.add_argument("--emulate-speedup", type=float, default=1.0,
                   help="compute time scale: tasks take flops / (device FLOP/s * speedup)")
    g.add_argument("--emulate-latency-scale", type=float, default=1.0, help="multiplies latencies")
    g.add_argument("--emulate-bandwidth-scale", type=float, default=1.0, help="multiplies bandwidths")
    g.add_argument("--emulate-jitter", type=float, default=0.0, help="delay jitter std-dev in seconds")
    g.add_argument("--emulate-seed", type=int, default=0, help="jitter seed")
    g.add_argument("--emulate-peers", default=None,
                   help='JSON object {"host:port": "device id"} of known peers')
    g.add_argument("--emulate-stage-servers", default="",
                   help="comma-separated device ids of the server host of stage 0, 1, ...")
    g.add_argument("--emulate-default-peer", default=None,
                   help="device id assumed behind any other address (default: leave it unshaped)")


def config_from_args(args: argparse.Namespace) -> EmulationConfig | None:
    """The emulation config of parsed flags, or None when ``--emulate-scenario`` is absent."""
    if not getattr(args, "emulate_scenario", None):
        return None
    if not args.emulate_device:
        raise ShoalError("--emulate-scenario needs --emulate-device (the device id this process plays)")
    peers: dict[str, str] = {}
    if args.emulate_peers:
        try:
            peers = json.loads(args.emulate_peers)
        except json.JSONDecodeError as exc:
            raise ShoalError(f"--emulate-peers is not a JSON object: {exc}") from None
        if not isinstance(peers, dict) or not all(isinstance(v, str) for v in peers.values()):
            raise ShoalError('--emulate-peers must be a JSON object {"host:port": "device id"}')
    cfg = EmulationConfig(args.emulate_scenario, args.emulate_device, args.emulate_speedup,
                          args.emulate_latency_scale, args.emulate_bandwidth_scale,
                          args.emulate_jitter, peers, args.emulate_seed,
                          [d for d in getattr(args, "emulate_stage_servers", "").split(",") if d],
                          getattr(args, "emulate_default_peer", None))
    cfg.validate()
    return cfg


class Emulation:
    """The hooks of one emulated process; :meth:`close` stops the relays."""

    def __init__(self, cfg: EmulationConfig, scenario=None,
                 resolve: Callable[[str], str | None] | None = None):
        cfg.validate()
        if scenario is None:
            from shoal.plan.scenario import load_scenario

            scenario = load_scenario(cfg.scenario)
        self.cfg = cfg  # the settings
        self.scenario = scenario  # the scenario being emulated
        self.device = scenario.device(cfg.device)  # raises ShoalError for an unknown id
        self.dial = ScenarioDial(scenario, cfg.device, cfg.peers, latency_scale=cfg.latency_scale,
                                 bandwidth_scale=cfg.bandwidth_scale, jitter_s=cfg.jitter_s,
                                 seed=cfg.seed, resolve=resolve, default_peer=cfg.default_peer,
                                 stage_servers=cfg.stage_servers)  # channel dial hook
        self.pacer = (ComputePacer(self.device.flops, cfg.speedup)
                      if self.device.flops > 0 else None)  # worker pacer hook

    def stats(self) -> dict:
        """Relay byte counters and pacing totals, for logs and the run report."""
        out = {"device": self.device.id, "links": self.dial.shaper.stats()}
        if self.pacer is not None:
            out["pacing"] = vars(self.pacer.stats).copy()
        return out

    def close(self) -> None:
        self.dial.close()


def hooks_from_args(args: argparse.Namespace, scenario=None,
                    resolve: Callable[[str], str | None] | None = None) -> Emulation | None:
    """An :class:`Emulation` from parsed ``--emulate-*`` flags, or None if they are absent."""
    cfg = config_from_args(args)
    return None if cfg is None else Emulation(cfg, scenario, resolve)
