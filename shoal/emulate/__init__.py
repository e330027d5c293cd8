"""Emulation of an internet swarm on one machine: link shaping, compute pacing, churn.

* :mod:`shoal.emulate.links` -- an in-process TCP relay that gives each outbound
  connection the scenario's one-way latency, jitter and per-device bandwidth.
* :mod:`shoal.emulate.pacing` -- pads each task's compute to the time the scenario
  device would take; scales the scenario for the planner and simulator to match.
* :mod:`shoal.emulate.churn` -- leave/join schedules from session lengths or a trace,
  and a driver that replays them by killing (SIGKILL) and starting workers.
* :mod:`shoal.emulate.hooks` -- ``--emulate-*`` flags -> the runtime's dial and pacer hooks.
* Measurements: ``python -m shoal.emulate.measure`` (link and pacing accuracy);
  ``bench/bench_compress.py`` (codecs: bytes and loss) and ``bench/bench_churn.py``
  (throughput under churn) live beside the other benchmarks; see docs/emulation.md.
"""
