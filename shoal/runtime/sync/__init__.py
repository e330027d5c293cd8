"""Sync policies: local-mode (DiLoCo-style) rounds and the wire codecs of each traffic kind."""
