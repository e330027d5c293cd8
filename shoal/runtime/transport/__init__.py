"""Transport: framing of weights and gradients on the wire, and retries of calls."""
