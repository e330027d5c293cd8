"""Read what members traced during a test's run (``SHOAL_TRACE=DIR``, :func:`shoal.runtime.common.trace`)."""

from __future__ import annotations

import json
from pathlib import Path


def accepted_gradients(folder: Path) -> dict[tuple[str, int], list[int]]:
    """Per (worker, step), the micro-batches of its results that carried gradients, in the order
    the server accepted them (each worker's ``result_ack`` events, in its own trace file's order)."""
    acked: dict[tuple[str, int], list[int]] = {}
    for f in Path(folder).glob("trace-*.jsonl"):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            if e["ev"] == "result_ack" and e["ok"] and e["grads"]:
                acked.setdefault((e["who"], e["step"]), []).append(e["mb"])
    return acked
