"""Roles: the coordinator, the stage server and the worker (and the coordinator's planning bridge and final artifacts)."""
