"""``shoal data prepare``: formats, exact round trip, shard sampler, bad inputs, kill -9 +
resume to identical shards, and bounded memory on a 200 MB corpus."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.cli import main
from shoal.data import TokenData, get_micro_batch, get_window, load_data
from shoal.data.prepare import PrepareConfig, prepare
from shoal.data.shards import TokenStream, load_prepared
from shoal.errors import ShoalError

WORDS = ["alpha", "beta", "gamma", "delta", "épsilon", "zeta", "ηta", "théta", "日本", "🐟", "the", "of", "and"]


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def _docs_of(out: Path) -> list[str]:
    """The documents of a prepared folder, decoded shard stream split at the EOT token."""
    from tokenizers import Tokenizer

    m = json.loads((out / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    data = load_prepared(out, m["tokenizer"]["vocab_size"])
    ids = np.concatenate([data.train.to_numpy(), data.val.to_numpy()])
    cuts = np.flatnonzero(ids == m["tokenizer"]["eot_id"])
    docs, start = [], 0
    for c in cuts:
        docs.append(tok.decode(ids[start:c].tolist()))
        start = c + 1
    assert start == len(ids), "the stream ends with an end-of-text token"
    return docs


@pytest.fixture()
def mixed_inputs(tmp_path):
    """A text file (CRLF, unicode), a gzipped text file, a JSONL file; the expected documents."""
    rng = np.random.default_rng(3)
    d = tmp_path / "in"
    d.mkdir()
    a = "".join(_words(rng, 15) + ("\r\n" if i % 3 else "\n") for i in range(3000))
    (d / "a.txt").write_bytes(a.encode())
    b = "".join(_words(rng, 9) + "\n" for i in range(500))
    (d / "b.txt.gz").write_bytes(gzip.compress(b.encode()))
    recs = [_words(rng, int(rng.integers(1, 40))) + ("\n" if i % 5 == 0 else "") for i in range(800)]
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        for i, r in enumerate(recs):
            f.write(json.dumps({"id": i, "body": r}) + "\n")
        f.write("\n")  # a blank line is skipped
    (d / ".hidden.txt").write_text("never read")
    (d / "notes.bin").write_bytes(b"\x00\x01 not an input suffix")
    return d, [a.replace("\r\n", "\n"), b, *recs]


def test_prepare_round_trip_formats_and_sampler(tmp_path, mixed_inputs, monkeypatch):
    import shoal.data.sources as sources

    monkeypatch.setattr(sources, "CHUNK_BYTES", 64 << 10)  # many chunks, cut mid-file
    d, expected = mixed_inputs
    out = tmp_path / "data"
    m = prepare(PrepareConfig(inputs=(str(d),), out=str(out), vocab_size=300, field="body",
                              shard_tokens=20_000, quiet=True))
    assert [Path(s["path"]).name for s in m["sources"]] == ["a.txt", "b.txt.gz", "c.jsonl"]
    assert m["dtype"] == "<u2" and m["documents"] == len(expected) and m["shards"] >= 5
    index = json.loads((out / "index.json").read_text())
    assert all(s["tokens"] == 20_000 for s in index["shards"][:-1])
    assert sum(s["tokens"] for s in index["shards"]) == m["tokens"]
    assert not (out / "progress.json").exists() and not list(out.glob("carry-*"))
    assert _docs_of(out) == expected

    # The shard-backed sampler draws exactly the batches of the same ids held in memory.
    data = load_data(_cfg(out), 2048)
    assert isinstance(data.train, TokenStream)
    ids = torch.from_numpy(np.concatenate([data.train.to_numpy(), data.val.to_numpy()]))
    n_val = len(data.val)
    mem = TokenData(train=ids[:-n_val], val=ids[-n_val:], tokenizer=data.tokenizer, vocab_size=2048)
    for split, step, mb in [("train", 0, 0), ("train", 7, 3), ("val", 0, 1)]:
        a = get_micro_batch(data, split, 5, step, mb, 4, 64)
        b = get_micro_batch(mem, split, 5, step, mb, 4, 64)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        w = get_window(data, split, 5, step, mb, 4, 64)  # a task's windows: the same tokens
        assert w.dtype == torch.int64 and torch.equal(w, torch.cat([a[0], a[1][:, -1:]], dim=1))
    # Windows that straddle a shard boundary read across it.
    stream = data.train
    assert np.array_equal(stream.read(19_990, 30), stream.to_numpy()[19_990:20_020])
    # Same command again: the folder is complete, nothing is rewritten.
    mtime = (out / "shard_00000.bin").stat().st_mtime_ns
    assert prepare(PrepareConfig(inputs=(str(d),), out=str(out), vocab_size=300, field="body",
                                 shard_tokens=20_000, quiet=True)) == m
    assert (out / "shard_00000.bin").stat().st_mtime_ns == mtime


def _cfg(path: Path):
    from shoal.data import DataConfig

    return DataConfig(paths=(str(path),))


def test_prepare_parquet_and_user_tokenizer(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(5)
    texts = [_words(rng, int(rng.integers(1, 30))) for _ in range(3000)]
    pq.write_table(pa.table({"n": list(range(3000)), "content": texts}), tmp_path / "t.parquet", row_group_size=700)
    first = tmp_path / "first"
    prepare(PrepareConfig(inputs=(str(tmp_path / "t.parquet"),), out=str(first), vocab_size=400,
                          field="content", quiet=True))
    assert _docs_of(first) == texts
    # A tokenizer the user brings is used as is (same ids as the first folder's).
    again = tmp_path / "again"
    m = prepare(PrepareConfig(inputs=(str(tmp_path / "t.parquet"),), out=str(again),
                              tokenizer=str(first / "tokenizer.json"), field="content", quiet=True))
    assert m["tokenizer"]["origin"].endswith("tokenizer.json")
    for a, b in zip(sorted(first.glob("shard_*")), sorted(again.glob("shard_*")), strict=True):
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("case,expect", [
    ("missing_field", "no field 'text'"),
    ("binary", "looks binary"),
    ("empty_folder", "holds no input files"),
    ("missing_path", "does not exist"),
    ("no_column", "no column 'text'"),
    ("bad_tokenizer", "neither 'train' nor a tokenizer.json"),
])
def test_prepare_bad_input_one_line_error(tmp_path, capsys, case, expect):
    if case == "missing_field":
        (tmp_path / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
        args = [str(tmp_path / "x.jsonl")]
        expect = f"x.jsonl:2: {expect}"
    elif case == "binary":
        (tmp_path / "x.txt").write_bytes(bytes(range(256)) * 10)
        args = [str(tmp_path / "x.txt")]
    elif case == "empty_folder":
        (tmp_path / "empty").mkdir()
        args = [str(tmp_path / "empty")]
    elif case == "missing_path":
        args = [str(tmp_path / "nope.txt")]
    elif case == "no_column":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "x.parquet")
        args = [str(tmp_path / "x.parquet")]
    else:
        (tmp_path / "x.txt").write_text("hello")
        args = [str(tmp_path / "x.txt"), "--tokenizer", str(tmp_path / "missing.json")]
    rc = main(["data", "prepare", *args, "--out", str(tmp_path / "out"), "--quiet", "--vocab", "300"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and expect in err, err


def test_prepare_refuses_other_inputs_in_a_finished_folder(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 200)
    (tmp_path / "b.txt").write_text("other text " * 200)
    prepare(PrepareConfig(inputs=(str(tmp_path / "a.txt"),), out=str(tmp_path / "d"), vocab_size=300, quiet=True))
    with pytest.raises(ShoalError, match="other inputs"):
        prepare(PrepareConfig(inputs=(str(tmp_path / "b.txt"),), out=str(tmp_path / "d"), vocab_size=300, quiet=True))


def _write_corpus(path: Path, mb: int, seed: int = 0) -> None:
    """``mb`` MiB of ASCII text, fast: a few random 1 MiB blocks, each copy with its own header."""
    rng = np.random.default_rng(seed)
    vocab = np.array(["".join(rng.choice(list("etaoinshrdlucmfw"), int(rng.integers(1, 9)))) for _ in range(5000)])
    blocks = []
    for _ in range(4):
        words = vocab[rng.integers(0, len(vocab), 200_000)]
        text = " ".join(words)
        lines = [text[i : i + 90] for i in range(0, len(text), 90)]
        blocks.append(("\n".join(lines) + "\n").encode()[: (1 << 20) - 40])
    with open(path, "wb") as f:
        for i in range(mb):
            head = f"-- block {i} --\n".encode()
            f.write(head + blocks[i % 4][: (1 << 20) - len(head)])


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_prepare_kill9_and_rerun_gives_identical_shards(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _write_corpus(src / "one.txt", 2, seed=1)
    _write_corpus(src / "two.txt", 1, seed=2)
    args = [str(src), "--vocab", "320", "--shard-tokens", "100000", "--sample-mb", "0.5", "--quiet"]
    ref = tmp_path / "ref"
    assert main(["data", "prepare", *args, "--out", str(ref)]) == 0

    out = tmp_path / "out"
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", "data", "prepare", *args, "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 400
    progress = out / "progress.json"
    try:
        while time.time() < deadline and proc.poll() is None:
            if progress.exists() and json.loads(progress.read_text())["shards"] >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "prepare ended before it could be killed: " + proc.stderr.read().decode()[-500:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not (out / "manifest.json").exists()
    done = json.loads(progress.read_text())["shards"]
    assert main(["data", "prepare", *args, "--out", str(out)]) == 0
    ref_shards = sorted(p.name for p in ref.glob("shard_*.bin"))
    assert sorted(p.name for p in out.glob("shard_*.bin")) == ref_shards and len(ref_shards) > done
    for name in ref_shards:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    m_ref, m_out = (json.loads((d / "manifest.json").read_text()) for d in (ref, out))
    assert m_ref["content_hash"] == m_out["content_hash"] and m_ref["tokens"] == m_out["tokens"]


_PEAK_RSS = """
import sys
from shoal.cli import main
rc = main(sys.argv[1:])
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print("VmHWM_KB", hwm, "torch", "torch" in sys.modules)
sys.exit(rc)
"""


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_prepare_200mb_default_tokenizer_bounded_memory(tmp_path):
    """200 MiB of text (size from $SHOAL_TEST_BIG_MB) with the default tokenizer (a BPE
    trained on the first 8 MiB): peak RSS <= 512 MiB, torch never imported, and the shards
    hold exactly the tokenizer's ids of the text (checked on the first chunks of each file)."""
    from tokenizers import Tokenizer

    from shoal.data.encode import BatchEncoder
    from shoal.data.sources import Source, read_chunks

    mb = int(os.environ.get("SHOAL_TEST_BIG_MB", "200"))
    src = tmp_path / "src"
    src.mkdir()
    parts = [mb // 2, mb - mb // 2]
    for i, n in enumerate(parts):
        _write_corpus(src / f"part{i}.txt", n, seed=i)
    out = tmp_path / "data"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", _PEAK_RSS, "data", "prepare", str(src), "--out", str(out)],
                          capture_output=True, text=True, timeout=880)
    wall = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak_kb = int(proc.stdout.split("VmHWM_KB")[1].split()[0])
    print(f"{mb} MiB prepared in {wall:.1f} s ({mb / wall:.1f} MiB/s), peak RSS {peak_kb / 1024:.0f} MiB")
    assert peak_kb <= 512 * 1024, peak_kb
    assert proc.stdout.split("torch")[1].split()[0] == "False"
    # The progress bar's last state: bytes, tokens, time left.
    assert "tokens" in proc.stderr and "ETA" in proc.stderr and "MB" in proc.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert m["documents"] == 2 and m["repaired"] == 0 and m["tokenizer"]["origin"] == "train"
    total = sum((src / f"part{i}.txt").stat().st_size for i in range(len(parts)))
    assert total >= mb * 1_000_000 and m["tokens"] < total / 2  # a BPE: far fewer tokens than bytes
    # Each document starts with exactly the tokenizer's ids of its first chunks.
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eot = m["tokenizer"]["eot_id"]
    data = load_prepared(out, 2048)
    ends, offset = [], 0
    for shard in data.train.maps:  # one memory-mapped shard at a time
        ends += (np.flatnonzero(shard == eot) + offset).tolist()
        offset += len(shard)
    assert offset == m["tokens"] and ends[-1] == m["tokens"] - 1 and len(ends) == 2
    stream = TokenStream(data.train.maps, 0, m["tokens"])  # train and val together
    ref = BatchEncoder(tok, eot)
    for i, start in enumerate([0, ends[0] + 1]):
        chunks = read_chunks(Source(src / f"part{i}.txt", "text"), {}, "text")
        head = np.concatenate([ref.encode(next(chunks)[0]) for _ in range(3)])
        assert np.array_equal(stream.read(start, len(head)), head), i


def test_prepare_repairs_text_that_cannot_be_encoded(tmp_path, capsys):
    """Lone surrogates (valid JSON escapes) and invalid UTF-8 bytes become U+FFFD, counted in
    the manifest; surrogate pairs and genuine U+FFFD characters are kept and not counted."""
    d = tmp_path / "in"
    d.mkdir()
    with open(d / "a.jsonl", "wb") as f:
        f.write(b'{"text": "lone \\ud800 high and \\udfff low, a pair \\ud83d\\udc1f stays"}\n')
        f.write(b'{"text": "bad byte \xff here, real \xef\xbf\xbd kept"}\n')
        f.write(json.dumps({"text": "plain words " * 40}).encode() + b"\n")
    (d / "b.txt").write_bytes(b"invalid \xc3( and \xe2\x82 cut, truncated \xf0\x9f\n" + b"more text " * 40)
    out = tmp_path / "out"
    assert main(["data", "prepare", str(d), "--out", str(out), "--vocab", "300", "--quiet"]) == 0
    assert "6 characters that could not be encoded were replaced with U+FFFD" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["repaired"] == 6 and m["documents"] == 4
    docs = _docs_of(out)
    assert docs[0] == "lone \ufffd high and \ufffd low, a pair \U0001f41f stays"
    assert docs[1] == "bad byte \ufffd here, real \ufffd kept"
    assert docs[3].startswith("invalid \ufffd( and \ufffd cut, truncated \ufffd\nmore text")


@pytest.mark.parametrize("argv", (["train", "--local"], ["launch", "--out", "x"], ["coordinator"], ["demo"]),
                         ids=lambda a: a[0])
def test_every_training_command_takes_data_and_init_from(argv):
    from shoal.cli import build_parser

    args = build_parser().parse_args([*argv, "--data", "a.txt", "b/"])
    assert args.data == ["a.txt", "b/"]
    if argv[0] != "demo":
        assert build_parser().parse_args([*argv, "--init-from", "hf"]).init_from == "hf"


def test_run_data_values(tmp_path):
    from shoal.data.prepare import resolve_run_data

    assert resolve_run_data(None, None, 2048) == "corpus"
    assert resolve_run_data(["synthetic"], None, 2048) == "synthetic"
    with pytest.raises(ShoalError, match="stand alone"):
        resolve_run_data(["corpus", "x.txt"], None, 2048)
    (tmp_path / "t.txt").write_text("words and more words\n" * 300)
    with pytest.raises(ShoalError, match="needs a run folder"):
        resolve_run_data([str(tmp_path / "t.txt")], None, 2048)
    got = resolve_run_data([str(tmp_path / "t.txt")], tmp_path / "run", 300, quiet=True)
    assert got == str((tmp_path / "run" / "data").resolve()) and (Path(got) / "manifest.json").exists()
    assert resolve_run_data([got], None, 2048) == got  # a prepared folder is used as is
