"""The runtime: the real swarm over gRPC, in rooms that follow the data flow.

* ``processes/`` starts roles (``shoal launch``, the role commands, the fork server);
* ``roles/`` the coordinator, the stage server and the worker;
* ``sync/`` the sync policies (local-mode rounds) and the wire codecs;
* ``pool/`` the task pool's states and decisions, no I/O;
* ``transport/`` framing of weights and gradients, retries;
* ``safety/`` screening, recomputation checks, journal, standbys, fault injection;
* ``ui/`` the dashboard, ``shoal status`` tables and step statistics;
* ``common.py`` and ``measure.py`` are shared by every role.

Imports point down that list (processes -> roles -> sync -> pool/transport/safety/ui ->
common); nothing below imports a room above it.
"""
