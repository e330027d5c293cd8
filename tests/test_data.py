"""Data pipeline: corpus reading, cached tokenizer, split, deterministic micro-batches."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.data import DataConfig, get_micro_batch, load_data, resolve_sources
from shoal.data.text import read_corpus
from shoal.errors import ShoalError

REPO = Path(__file__).resolve().parents[1]
SMALL_TEXT = "".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, {i % 7} times. Café naïve — ünïcödé.\n"
    for i in range(400)
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    # One folder per pytest session shared by every test file, so the default corpus is
    # tokenized once per session.
    d = tmp_path_factory.getbasetemp() / "shoal-cache"
    d.mkdir(exist_ok=True)
    return str(d)


@pytest.fixture(scope="session")
def shakespeare(cache_dir):
    return load_data(DataConfig(cache_dir=cache_dir), 2048)


@pytest.fixture()
def small_corpus(tmp_path) -> Path:
    p = tmp_path / "small.txt"
    p.write_text(SMALL_TEXT, encoding="utf-8")
    return p


def test_default_corpus_tokenizer_round_trip(shakespeare):
    data = shakespeare
    assert data.tokenizer.get_vocab_size() == 2048
    assert data.train.dtype == torch.int64 and data.val.dtype == torch.int64
    assert int(data.train.max()) < 2048 and int(data.train.min()) >= 0
    text = gzip.decompress((REPO / "shoal/data/corpus/shakespeare.txt.gz").read_bytes()).decode()
    sample = text[100_000:120_000]
    assert data.decode(data.encode(sample)) == sample
    odd = "Ünïcödé — 日本語 \t tabs\n\nand emoji 🐟 end"
    assert data.decode(data.encode(odd)) == odd
    # BPE compresses English: clearly fewer tokens than characters.
    assert len(data.encode(sample)) < 0.5 * len(sample)


def test_split_is_last_fraction(shakespeare):
    n_train, n_val = shakespeare.train.numel(), shakespeare.val.numel()
    total = n_train + n_val
    assert total == shakespeare.extra["tokens"]
    assert abs(n_val - 0.05 * total) <= 1


def test_cache_is_reused_and_keyed(small_corpus, tmp_path):
    cache = tmp_path / "cache"
    cfg = DataConfig(paths=(str(small_corpus),), cache_dir=str(cache))
    a = load_data(cfg, 300)
    entries = sorted((cache / "data").iterdir())
    assert len(entries) == 1
    assert {p.name for p in entries[0].iterdir()} >= {"tokenizer.json", "ids.npy"}
    # A second load reads the entry (same ids), it does not make a new one.
    stamp = (entries[0] / "ids.npy").stat().st_mtime_ns
    b = load_data(cfg, 300)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert (entries[0] / "ids.npy").stat().st_mtime_ns == stamp
    # Another vocabulary size or other text is another entry.
    load_data(cfg, 320)
    small_corpus.write_text(SMALL_TEXT + "more\n", encoding="utf-8")
    load_data(cfg, 300)
    assert len(list((cache / "data").iterdir())) == 3
    ids = np.load(entries[0] / "ids.npy")
    assert ids.size == a.train.numel() + a.val.numel()


def test_cache_dir_from_environment(small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "envcache"))
    load_data(DataConfig(paths=(str(small_corpus),)), 300)
    assert len(list((tmp_path / "envcache" / "data").iterdir())) == 1


def test_folders_and_globs(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bee\n")
    (folder / "sub" / "a.md").write_text("ay\n")
    (folder / "image.png").write_bytes(b"\x89PNG")
    (folder / ".git").mkdir()
    (folder / ".git" / "notes.txt").write_text("hidden\n")
    (folder / "odd[1].txt").write_text("odd\n")
    files = resolve_sources((str(folder),))
    assert [f.name for f in files] == ["b.txt", "odd[1].txt", "a.md"]
    # A name with glob characters that exists is that file, not a pattern.
    assert resolve_sources((str(folder / "odd[1].txt"),)) == [folder / "odd[1].txt"]
    assert [f.name for f in resolve_sources((str(folder / "**" / "*.md"),))] == ["a.md"]
    # The same file through two routes is read once.
    assert len(resolve_sources((str(folder), str(folder / "b.txt")))) == 3
    assert read_corpus((str(folder),)) == "bee\n\n\nodd\n\n\nay\n"


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: str(d / "missing.txt"), "does not exist"),
        (lambda d: (d / "empty.txt").write_text("  \n") and str(d / "empty.txt"), "empty"),
        (lambda d: (d / "imgs").mkdir() or (d / "imgs" / "x.bin").write_bytes(b"1") and str(d / "imgs"), "no text files"),
        (lambda d: str(d / "*.nothing"), "matches no text files"),
    ],
)
def test_bad_corpus_paths(tmp_path, setup, message):
    path = setup(tmp_path)
    with pytest.raises(ShoalError, match=message) as info:
        load_data(DataConfig(paths=(path,), cache_dir=str(tmp_path / "c")), 300)
    assert "\n" not in str(info.value)


def test_bad_data_config(small_corpus, tmp_path):
    with pytest.raises(ShoalError, match="val_fraction"):
        load_data(DataConfig(paths=(str(small_corpus),), val_fraction=0.0), 300)
    with pytest.raises(ShoalError, match="vocab_size"):
        load_data(DataConfig(paths=(str(small_corpus),), cache_dir=str(tmp_path)), 100)


def test_micro_batch_shape_and_shift(shakespeare):
    x, y = get_micro_batch(shakespeare, "train", 0, 5, 2, 4, 64)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Each row is a real window of the split.
    train = shakespeare.train
    for row in x:
        starts = (train[: train.numel() - 64] == row[0]).nonzero().flatten()
        assert any(torch.equal(train[s : s + 64], row) for s in starts.tolist())


def test_windows_hold_the_micro_batch(shakespeare):
    """A task's token windows (drawn directly, as a stage server draws one per task) are the
    micro-batch's inputs with the targets' last token: corpus and synthetic data."""
    from shoal.data import get_window
    from shoal.net import shoal_pb2 as pb
    from shoal.runtime.common import micro_batch, split_window, token_window

    for split, step, mb in [("train", 0, 0), ("train", 9, 5), ("val", 0, 2)]:
        x, y = get_micro_batch(shakespeare, split, 3, step, mb, 4, 64)
        w = get_window(shakespeare, split, 3, step, mb, 4, 64)
        assert w.dtype == torch.int64 and torch.equal(w, torch.cat([x, y[:, -1:]], dim=1))
    spec = pb.RunSpec(model="tiny", micro_batch_size=3, seq_len=16, seed=4, data="synthetic")
    for step, mb in [(0, 0), (5, 2)]:
        x, y = micro_batch(spec, step, mb)
        w = token_window(spec, step, mb)
        assert w.dtype == torch.int32 and w.shape == (3, 17)
        got = split_window(w, 10**6)
        assert torch.equal(got[0], x) and torch.equal(got[1], y)


def test_micro_batch_is_keyed_by_all_arguments(shakespeare):
    base = get_micro_batch(shakespeare, "train", 1, 2, 3, 4, 32)[0]
    assert torch.equal(base, get_micro_batch(shakespeare, "train", 1, 2, 3, 4, 32)[0])
    for args in [("train", 2, 2, 3), ("train", 1, 3, 3), ("train", 1, 2, 4), ("val", 1, 2, 3)]:
        assert not torch.equal(base, get_micro_batch(shakespeare, *args, 4, 32)[0])
    # Global RNG state does not matter.
    torch.manual_seed(123)
    assert torch.equal(base, get_micro_batch(shakespeare, "train", 1, 2, 3, 4, 32)[0])


def _digest(data) -> str:
    h = hashlib.sha256()
    for step in range(3):
        for mb in range(2):
            for split in ("train", "val"):
                x, y = get_micro_batch(data, split, 7, step, mb, 3, 48)
                h.update(x.numpy().tobytes() + y.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_micro_batches_equal_across_processes(shakespeare, cache_dir):
    code = (
        "import sys, hashlib\n"
        "from shoal.data import DataConfig, load_data\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_data import _digest\n"
        "print(_digest(load_data(DataConfig(cache_dir=sys.argv[1]), 2048)))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "99"}
    out = subprocess.run(
        [sys.executable, "-c", code, cache_dir, str(Path(__file__).parent)],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )
    assert out.stdout.strip() == _digest(shakespeare)


@pytest.mark.parametrize(
    "split, b, t, message",
    [
        ("train", 0, 16, "micro-batch size must be positive"),
        ("train", 2, 0, "sequence length must be positive"),
        ("val", 2, 10**7, "too long for the val split"),
        ("test", 2, 16, "unknown data split"),
    ],
)
def test_micro_batch_bad_input(shakespeare, split, b, t, message):
    with pytest.raises(ShoalError, match=message):
        get_micro_batch(shakespeare, split, 0, 0, 0, b, t)


def test_seq_len_longer_than_small_corpus(small_corpus, tmp_path):
    data = load_data(DataConfig(paths=(str(small_corpus),), cache_dir=str(tmp_path)), 300)
    n_val = data.val.numel()
    get_micro_batch(data, "val", 0, 0, 0, 1, n_val - 1)
    with pytest.raises(ShoalError, match="too long"):
        get_micro_batch(data, "val", 0, 0, 0, 1, n_val)


def test_cached_ids_equal_encoding_the_whole_text(shakespeare):
    # The corpus is encoded in pieces for speed; that must not change a single id.
    from shoal.data.tokens import _chunks, encode_corpus

    text = gzip.decompress((REPO / "shoal/data/corpus/shakespeare.txt.gz").read_bytes()).decode()
    sample = text[:300_000] + "tail  \n\n  \n x\n" * 300 + text[-50_000:]
    assert len(_chunks(sample)) > 10 and "".join(_chunks(sample)) == sample
    assert encode_corpus(shakespeare.tokenizer, sample).tolist() == shakespeare.tokenizer.encode(sample).ids
    n = shakespeare.train.numel()
    assert shakespeare.train[:3000].tolist() == shakespeare.tokenizer.encode(text[:20_000]).ids[:3000]
    assert n > 1_000_000


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_tokenizer_training_is_deterministic_across_processes(tmp_path):
    from shoal.data import train_tokenizer

    code = (
        "import sys\nfrom shoal.data import train_tokenizer\n"
        "print(train_tokenizer(open(sys.argv[1]).read(), 400).to_str())\n"
    )
    p = tmp_path / "t.txt"
    p.write_text(SMALL_TEXT)
    out = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60, check=True)
    assert out.stdout.strip() == train_tokenizer(SMALL_TEXT, 400).to_str()
