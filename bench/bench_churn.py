"""Churn benchmark: throughput with a quarter of the workers SIGKILLed vs without churn.

``python bench/bench_churn.py`` runs the same local swarm twice (tiny model,
2 stages, 8 workers each padded by ``--slow`` seconds per task so that task time, not
the shared CPU, sets the pace): once without churn and once with
``kill_fraction_schedule(workers, 0.25)`` replayed by a :class:`ChurnDriver` once step
``--kill-after`` has committed. It prints tokens/s over the steps after the kill in both
runs, their ratio (target >= 0.75) and whether the two runs' losses agree step by step
(synchronous training is exact, so any lost or double-counted micro-batch would show).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from shoal.emulate.churn import ChurnDriver, kill_fraction_schedule
from shoal.train.metrics import read_jsonl


def _run(out: Path, workers: int, steps: int, slow: float, kill_after: int | None,
         fraction: float, seed: int) -> tuple[list[dict], list[tuple]]:
    from shoal.runtime.processes.launch import LaunchConfig, Swarm

    cfg = LaunchConfig(out=str(out), model="tiny", stages=2, workers=workers, steps=steps,
                       micro_batches=8, micro_batch_size=2, seq_len=32, seed=seed, warmup=2,
                       data="synthetic", worker_args=[["--slow", repr(slow)]] * workers,
                       dead_after_s=3.0, min_lease_s=1.5, timeout_s=900)
    done: list[tuple] = []
    with Swarm(cfg) as sw:
        sw.start()
        driver = None
        if kill_after is not None:
            while len(read_jsonl(out / "metrics.jsonl")) <= kill_after:
                if sw.coord.poll() is not None:
                    break
                time.sleep(0.05)
            ids = [str(i) for i in range(workers)]
            sched = kill_fraction_schedule(ids, fraction, at_s=0.0, seed=seed)
            driver = ChurnDriver(sched, lambda d: sw.kill_worker(int(d)), lambda d: sw.start_worker(int(d)))
            driver.start()
        sw.wait()
        if driver is not None:
            driver.join(5)
            done = driver.done
    return read_jsonl(out / "metrics.jsonl"), done


def _tokens_per_s(recs: list[dict], first_step: int) -> float:
    body = [r for r in recs if r["step"] > first_step]
    return sum(r["tokens"] for r in body) / sum(r["step_time_s"] for r in body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--slow", type=float, default=0.3, help="seconds added to every task")
    ap.add_argument("--kill-after", type=int, default=1, help="kill once this step has committed")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shoal-churn-bench-") as tmp:
        base, _ = _run(Path(tmp) / "base", a.workers, a.steps, a.slow, None, a.fraction, a.seed)
        churn, done = _run(Path(tmp) / "churn", a.workers, a.steps, a.slow, a.kill_after, a.fraction, a.seed)
    tb, tc = _tokens_per_s(base, a.kill_after), _tokens_per_s(churn, a.kill_after)
    same = len(base) == len(churn) and all(
        abs(x["loss"] - y["loss"]) <= 1e-5 for x, y in zip(base, churn, strict=False))
    print(f"tiny, 2 stages, {a.workers} workers, --slow {a.slow}, M=8, {a.steps} steps; "
          f"killed {len(done)} workers ({a.fraction:.0%}) after step {a.kill_after}")
    print("| run | tokens/s after the kill step | median step time | steps |")
    print("|---|---|---|---|")
    for name, recs, tps in (("no churn", base, tb), ("churn", churn, tc)):
        med = statistics.median(r["step_time_s"] for r in recs if r["step"] > a.kill_after)
        print(f"| {name} | {tps:.1f} | {med:.2f} s | {len(recs)} |")
    print(f"throughput ratio churn / no churn: {tc / tb:.2f} (target >= 0.75); "
          f"losses identical step by step: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
