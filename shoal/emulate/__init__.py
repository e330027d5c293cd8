"""Emulation of an internet swarm on one machine: link shaping, compute pacing, churn.

* :mod:`shoal.emulate.links` -- an in-process TCP relay that gives each outbound
  connection the scenario's one-way latency, jitter and per-device bandwidth.
* :mod:`shoal.emulate.pacing` -- pads each task's compute to the time the scenario
  device would take.
* :mod:`shoal.emulate.churn` -- leave/join schedules from session lengths or a trace,
  and a driver that replays them by killing and starting workers.
"""
