"""shoal: train transformer language models on a shoal of heterogeneous, unreliable devices."""

__version__ = "0.1.0"
