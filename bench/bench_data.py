"""Data benchmark: ``shoal data prepare`` throughput and peak memory, and sampler speed.

Real text (``--real MB``, default 256): the Python sources, C headers and text documents of
this machine's Python installation (``.venv`` site-packages, ``/usr/lib/python3*``) and
``/usr/share/doc``, read in sorted order until ``MB`` MiB, written at bench time into a temp
folder twice: as one JSONL file (one record per source file; non-UTF-8 bytes become lone
surrogate escapes, as in scraped text) and as a folder of ~32 MiB ``.txt`` files. Each is
prepared with the default tokenizer (``--tokenizer train``: byte-level BPE, 2048 tokens,
trained on the first 8 MiB) by ``shoal data prepare`` in a child process; its CPU time
(user + system, all threads) and peak RSS come from ``os.wait4``.

Synthetic text (``--sizes 200,1000``): that many MiB of generated ASCII words, optionally
with ``--tokenizer bytes`` (one token per byte). Then micro-batches per second of the
in-memory sampler (the bundled corpus as a tensor) against the shard sampler.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_data.py [--real 256] [--sizes 200,1000]
        [--tokenizer train|bytes] [--keep DIR]

Targets (issue 25, docs/data.md): >= 10 MiB of input per CPU-second with the default
tokenizer, peak RSS <= 512 MiB at every size; shard sampling no slower than in-memory
sampling by more than a small factor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

# Real text: where to look, and which files are text.
REAL_ROOTS = (Path(sys.prefix) / "lib", Path("/usr/lib/python3"), Path("/usr/lib/python3.11"),
              Path("/usr/share/doc"))
REAL_SUFFIXES = (".py", ".pyi", ".h", ".c", ".txt", ".md", ".rst")


def real_files(limit: int):
    """Text files under REAL_ROOTS in sorted order (no NUL byte), until ``limit`` bytes."""
    total = 0
    for root in REAL_ROOTS:
        for dirpath, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(files):
                if not name.endswith(REAL_SUFFIXES):
                    continue
                path = Path(dirpath) / name
                try:
                    data = path.read_bytes()
                except OSError:
                    continue
                if not data or b"\x00" in data:
                    continue
                yield path, data
                total += len(data)
                if total >= limit:
                    return


def write_real(root: Path, mb: int) -> tuple[Path, Path, int]:
    """The real corpus as ``real.jsonl`` and as a folder of ~32 MiB text files; its files."""
    jsonl, folder = root / "real.jsonl", root / "real_txt"
    folder.mkdir()
    n, part, size = 0, None, 0
    with open(jsonl, "w", encoding="utf-8") as jf:
        for path, data in real_files(mb << 20):
            text = data.decode("utf-8", errors="surrogateescape")
            jf.write(json.dumps({"text": text, "path": str(path)}) + "\n")
            if part is None or size >= 32 << 20:
                if part is not None:
                    part.close()
                part = open(folder / f"part{n // 1000:03d}_{n:06d}.txt", "wb")  # noqa: SIM115 -- closed above/below
                size = 0
            part.write(data + b"\n")
            size += len(data) + 1
            n += 1
    if part is not None:
        part.close()
    return jsonl, folder, n


def run_prepare(inputs: list[str], out: Path, extra: list[str]) -> dict:
    """``shoal data prepare`` in a child: wall, CPU seconds and peak RSS from os.wait4."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "data", "prepare", *inputs, "--out", str(out),
                             *extra, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read().decode(), proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(stderr)
    manifest = json.loads((out / "manifest.json").read_text())
    mb = sum(s["bytes"] for s in manifest["sources"]) / 2**20
    cpu = usage.ru_utime + usage.ru_stime
    return {"mb": mb, "wall_s": wall, "cpu_s": cpu, "mb_per_cpu_s": mb / cpu, "peak_rss_mb": usage.ru_maxrss / 1024,
            "tokens": manifest["tokens"], "repaired": manifest["repaired"], "out": out, "stdout": stdout}


def bench_real(root: Path, mb: int) -> list[dict]:
    jsonl, folder, files = write_real(root, mb)
    print(f"real text: {files} files from {', '.join(str(r) for r in REAL_ROOTS)}")
    print(f"{'input':<28} {'MiB':>7} {'wall s':>7} {'CPU s':>7} {'MiB/CPU-s':>10} {'peak RSS MiB':>13} "
          f"{'tokens':>11} {'repaired':>9}")
    rows = []
    for label, inputs in ((f"JSONL ({jsonl.name})", [str(jsonl)]), (f"text folder ({folder.name}/)", [str(folder)])):
        r = run_prepare(inputs, root / f"data_{len(rows)}", [])
        rows.append(r)
        print(f"{label:<28} {r['mb']:>7.1f} {r['wall_s']:>7.1f} {r['cpu_s']:>7.1f} {r['mb_per_cpu_s']:>10.2f} "
              f"{r['peak_rss_mb']:>13.0f} {r['tokens']:>11} {r['repaired']:>9}", flush=True)
        shutil.rmtree(r["out"])
    return rows


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
    r = run_prepare([str(src)], root / f"data{mb}", tok)
    shutil.rmtree(src)
    return r


def reads_per_s(data, seconds: float = 3.0, b: int = 8, t: int = 128) -> float:
    from shoal.data import get_micro_batch

    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        get_micro_batch(data, "train", 0, n, 0, b, t)
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", type=int, default=256, help="MiB of real text to prepare (0: none)")
    ap.add_argument("--sizes", default="", help="MiB of synthetic text, comma-separated (e.g. 200,1000)")
    ap.add_argument("--tokenizer", default="train", choices=("train", "bytes"), help="for the synthetic text")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temp folder)")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="shoal-bench-data-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
        if args.real:
            bench_real(root, args.real)
        rows = []
        if args.sizes:
            print(f"\nsynthetic text ({args.tokenizer} tokenizer)")
            print(f"{'input MiB':>10} {'wall s':>8} {'CPU s':>7} {'MiB/CPU-s':>10} {'peak RSS MiB':>13}")
            for mb in (int(s) for s in args.sizes.split(",")):
                r = bench_prepare(root, mb, args.tokenizer)
                rows.append(r)
                print(f"{mb:>10} {r['wall_s']:>8.1f} {r['cpu_s']:>7.1f} {r['mb_per_cpu_s']:>10.2f} "
                      f"{r['peak_rss_mb']:>13.0f}", flush=True)
        print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        if not rows:
            return 0

        from shoal.data import DataConfig, load_data
        from shoal.data.prepare import PrepareConfig, prepare
        from shoal.data.text import default_corpus_path

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
        label = f"memmap shards ({rows[-1]['mb']:.0f} MiB input)"
        print(f"{label:<40} {big.extra['tokens']:>12} {r:>9.0f} {r / base:>6.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
