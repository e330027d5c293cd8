"""The scenario the coordinator plans and repairs on, one device per member.

Planner devices are keyed by *member id* (a worker that is killed and rejoins is a new
member: the repair sees one device leave and another join). What a member's device
looks like depends on the run:

* plain run: a loopback device with the FLOP/s the worker measured (:func:`loopback_device`);
* emulated run (the processes play devices of a scenario, see ``shoal.emulate``): a copy
  of the scenario device the member plays, in the scenario as the processes experience
  it (``shoal.emulate.pacing.emulated_scenario``: FLOP/s and links scaled), so the
  planner and the repair see the links the run really has (:func:`played_device`,
  :func:`member_network`).
"""

from __future__ import annotations

from dataclasses import replace

from shoal.plan.types import Device, Link, Network, Scenario, Workload

LOOPBACK_REGION = "local"  # region of every member of a plain run
LOOPBACK_LINK = Link(latency=1e-4, bandwidth=1e9)  # 127.0.0.1 as the planner sees it


def loopback_device(member_id: str, role: str, flops: float) -> Device:
    """A member of a plain run: loopback links, the measured FLOP/s (0 for a server)."""
    if role == "server":
        return Device(id=member_id, kind="server", flops=0.0, memory=0.0, region=LOOPBACK_REGION,
                      up=1e9, down=1e9, can_host_server=True)
    return Device(id=member_id, kind="worker", flops=flops, memory=64e9, region=LOOPBACK_REGION,
                  up=1e9, down=1e9)


def played_device(emulated: Scenario, member_id: str, role: str, device_id: str) -> Device:
    """The scenario device ``device_id`` as member ``member_id`` (ShoalError if unknown).

    A member does only its role: a server process computes nothing (FLOP/s 0) and a
    worker process never hosts a stage server, whatever else its device could do.
    """
    d = replace(emulated.device(device_id), id=member_id)
    if role == "server":
        return replace(d, flops=0.0, can_host_server=True)
    return replace(d, can_host_server=False)


def member_network(emulated: Scenario, plays: dict[str, str]) -> Network:
    """The emulated network with its per-device-pair links moved to member ids.

    ``plays`` maps member id -> scenario device id. Two members playing the same device
    (a replacement server on the same host) talk over the device's loopback.
    """
    net = emulated.network
    overrides: dict[tuple[str, str], Link] = {}
    members = sorted(plays)
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            da, db = plays[a], plays[b]
            if da == db:
                overrides[(a, b)] = net.loopback
            elif (pair := (da, db) if da < db else (db, da)) in net.overrides:
                overrides[(a, b)] = net.overrides[pair]
    return replace(net, overrides=overrides)


def planning_scenario(devices: dict[str, Device], workload: Workload, emulated: Scenario | None = None,
                      plays: dict[str, str] | None = None) -> Scenario:
    """The scenario of the members in ``devices`` (member id -> device) training ``workload``.

    Without ``emulated``: every member on loopback links. With it: the emulated network,
    ``plays`` (member id -> scenario device id) placing each member in it.
    """
    if emulated is None:
        network = Network(intra={LOOPBACK_REGION: LOOPBACK_LINK}, inter={})
        return Scenario(name="live", devices=list(devices.values()), network=network, workload=workload)
    return Scenario(name=emulated.name, devices=list(devices.values()),
                    network=member_network(emulated, plays or {}), workload=workload)
