"""Processes: the command-line entry of every role, `shoal launch` and the fork server that starts members."""
