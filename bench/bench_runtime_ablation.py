"""Does TLS or the spot-check sample explain the swarm's per-task cost? ``launch`` S=1 W=1
(bench_runtime's RUN, 8 steps) with TLS on/off and ``--spot-check`` 0.05/0, twice each.

    OMP_NUM_THREADS=1 SHOAL_TORCH_THREADS=1 .venv/bin/python bench/bench_runtime_ablation.py
"""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import RUN, _steady  # noqa: E402

from shoal.runtime.processes.launch import LaunchConfig, launch  # noqa: E402
from shoal.train.metrics import read_jsonl  # noqa: E402


def main() -> None:
    """Print one line per run: mean and median step after warm-up, tokens/s."""
    for rep in range(2):
        for tls in (True, False):
            for spot in (0.05, 0.0):
                with tempfile.TemporaryDirectory(prefix="shoal-ablation-") as tmp:
                    out = Path(tmp) / "run"
                    launch(LaunchConfig(out=str(out), stages=1, workers=1, steps=8, timeout_s=600, tls=tls,
                                        spot_check=spot, **RUN))
                    m, med, tok = _steady(read_jsonl(out / "metrics.jsonl"))
                print(f"rep {rep} tls={tls} spot_check={spot}: mean step {m * 1000:.0f} ms, "
                      f"median {med * 1000:.0f} ms, {tok:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
