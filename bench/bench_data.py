"""Data benchmark: ``shoal data prepare`` throughput and peak memory, and sampler speed.

For each input size, generates that many MiB of ASCII text (fast, from random words) and
runs ``shoal data prepare`` in a child process that reports its own peak RSS (VmHWM from
``/proc/self/status``). Then compares micro-batches per second of the in-memory sampler
(the bundled corpus tokenized into a tensor) with the shard sampler (the same corpus
prepared into memory-mapped shards, and the largest prepared input).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_data.py [--sizes 200,1000] [--tokenizer train|bytes]
        [--keep DIR]

``--tokenizer bytes`` uses a byte-level tokenizer without merges (one token per byte; the
encoder's floor), ``train`` the default (byte-level BPE, 2048 tokens, trained on 8 MiB).
Targets (docs/data.md): peak RSS <= 1 GB at every size; shard sampling no slower than
in-memory sampling by more than a small factor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

_PEAK = """
import sys
from shoal.cli import main
rc = main(sys.argv[1:])
print("VmHWM_KB", [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1])
sys.exit(rc)
"""


def write_corpus(path: Path, mb: int, seed: int = 0) -> None:
    """``mb`` MiB of ASCII text: four random 1 MiB blocks, repeated with a header per copy."""
    rng = np.random.default_rng(seed)
    vocab = np.array(["".join(rng.choice(list("etaoinshrdlucmfw"), int(rng.integers(1, 9)))) for _ in range(5000)])
    blocks = []
    for _ in range(4):
        text = " ".join(vocab[rng.integers(0, len(vocab), 200_000)])
        blocks.append(("\n".join(text[i : i + 90] for i in range(0, len(text), 90)) + "\n").encode())
    with open(path, "wb") as f:
        for i in range(mb):
            head = f"-- block {i} --\n".encode()
            f.write(head + blocks[i % 4][: (1 << 20) - len(head)])


def byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer without merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


def bench_prepare(root: Path, mb: int, tokenizer: str) -> dict:
    src = root / f"src{mb}"
    src.mkdir()
    write_corpus(src / "corpus.txt", mb)
    tok = ["--vocab", "2048"]
    if tokenizer == "bytes":
        byte_tokenizer(root / "bytes.json")
        tok = ["--tokenizer", str(root / "bytes.json")]
    out = root / f"data{mb}"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PEAK, "data", "prepare", str(src), "--out", str(out), *tok,
                           "--quiet"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr)
    peak = int(proc.stdout.split("VmHWM_KB")[1].split()[0]) / 1024
    shutil.rmtree(src)
    return {"mb": mb, "wall_s": wall, "mb_per_s": mb / wall, "peak_rss_mb": peak, "out": out}


def reads_per_s(data, seconds: float = 3.0, b: int = 8, t: int = 128) -> float:
    from shoal.data import get_micro_batch

    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        get_micro_batch(data, "train", 0, n, 0, b, t)
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200,1000", help="input sizes in MiB, comma-separated")
    ap.add_argument("--tokenizer", default="train", choices=("train", "bytes"))
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temp folder)")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="shoal-bench-data-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        print(f"prepare ({args.tokenizer} tokenizer), child process, peak RSS from /proc/self/status")
        print(f"{'input MiB':>10} {'wall s':>8} {'MiB/s':>7} {'peak RSS MiB':>13}")
        rows = []
        for mb in (int(s) for s in args.sizes.split(",")):
            r = bench_prepare(root, mb, args.tokenizer)
            rows.append(r)
            print(f"{r['mb']:>10} {r['wall_s']:>8.1f} {r['mb_per_s']:>7.2f} {r['peak_rss_mb']:>13.0f}", flush=True)

        from shoal.data import DataConfig, default_corpus_path, load_data
        from shoal.data.prepare import PrepareConfig, prepare

        mem = load_data(DataConfig(cache_dir=str(root / "cache")), 2048)
        corpus_dir = root / "corpus"
        prepare(PrepareConfig(inputs=(str(default_corpus_path()),), out=str(corpus_dir), quiet=True))
        shard = load_data(DataConfig(paths=(str(corpus_dir),)), 2048)
        print("\nsampler: micro-batches (B 8 x T 128) per second, one thread")
        print(f"{'source':<40} {'tokens':>12} {'reads/s':>9} {'ratio':>6}")
        base = reads_per_s(mem)
        print(f"{'in-memory tensor (bundled corpus)':<40} {mem.extra['tokens']:>12} {base:>9.0f} {1.0:>6.2f}")
        r = reads_per_s(shard)
        print(f"{'memmap shards (bundled corpus)':<40} {shard.extra['tokens']:>12} {r:>9.0f} {r / base:>6.2f}")
        big = load_data(DataConfig(paths=(str(rows[-1]["out"]),)), 2048)
        r = reads_per_s(big)
        label = f"memmap shards ({rows[-1]['mb']} MiB input)"
        print(f"{label:<40} {big.extra['tokens']:>12} {r:>9.0f} {r / base:>6.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
