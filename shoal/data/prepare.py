"""``shoal data prepare``: stream any amount of text into fixed-size token shards.

A prepared data folder holds

* ``tokenizer.json`` -- the byte-level BPE tokenizer (trained on a sample, or the user's);
* ``shard_00000.bin`` ... -- raw little-endian token ids (uint16 if the vocabulary fits,
  else uint32), :data:`DEFAULT_SHARD_TOKENS` tokens each except the last; documents are
  separated by the end-of-text token;
* ``index.json`` -- the shards in order with their token counts;
* ``manifest.json`` -- written last, so its presence means the folder is complete: the
  source files (path, size, SHA-256), tokenizer (origin, SHA-256, vocabulary), dtype,
  totals, and the number of characters replaced with U+FFFD because they could not be
  encoded (``repaired``).

Text is encoded chunk by chunk (:mod:`shoal.data.encode`: the tokenizer's parallel batch
encoder, memoised for byte-level BPE), so memory is bounded by one shard buffer, one ~1 MB
chunk of text, the tokenizer and the encoder's bounded memo, whatever the input size; this
module does not import torch. While it runs, ``progress.json`` records after every finished shard where the
reading stopped and the tokens read past the last shard (``carry-<k>.bin``); running the
same command again continues from there and produces byte-identical shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shoal.data.encode import make_encoder
from shoal.data.sources import Source, file_sha256, read_chunks, resolve_inputs
from shoal.errors import ShoalError

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
PROGRESS_FILE = "progress.json"
FORMAT_VERSION = 1
# Tokens per shard: 32 MB of uint16 -- few files, and a shard is never read whole anyway.
DEFAULT_SHARD_TOKENS = 1 << 24
# Text the tokenizer is trained on (the first bytes of the input stream).
DEFAULT_SAMPLE_BYTES = 8 << 20


@dataclass(frozen=True)
class PrepareConfig:
    """What ``shoal data prepare`` reads and how it writes the shards."""

    inputs: tuple[str, ...]  # text files, folders, globs, .jsonl or .parquet files
    out: str  # the data folder to write
    tokenizer: str = "train"  # "train" (byte-level BPE on a sample) or a tokenizer.json path
    vocab_size: int = 2048  # vocabulary of a trained tokenizer (ignored for a given one)
    field: str = "text"  # text field of JSONL records and Parquet rows
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # tokens per shard file
    sample_bytes: int = DEFAULT_SAMPLE_BYTES  # text the tokenizer is trained on
    quiet: bool = False  # no progress bar

    def validate(self) -> None:
        """Raise :class:`ShoalError` for an out-of-range field."""
        from shoal.data.tokens import MIN_VOCAB_SIZE

        if self.tokenizer == "train" and self.vocab_size < MIN_VOCAB_SIZE:
            raise ShoalError(f"--vocab must be at least {MIN_VOCAB_SIZE} for a byte-level tokenizer, got {self.vocab_size}")
        if self.shard_tokens < 1024:
            raise ShoalError(f"--shard-tokens must be at least 1024, got {self.shard_tokens}")
        if self.sample_bytes <= 0:
            raise ShoalError(f"--sample-mb must be positive, got {self.sample_bytes / 2**20}")


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a complete prepared data folder."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / MANIFEST_FILE).is_file()


# --data values of the runtime that are not paths: the bundled corpus, random tokens.
RUNTIME_DATA_KEYWORDS = ("corpus", "synthetic")


def resolve_run_data(values: list[str] | tuple[str, ...] | str | None, run_dir: str | Path | None,
                     vocab_size: int, quiet: bool = False) -> str:
    """The data source of a run as one string: ``"corpus"``, ``"synthetic"`` or the absolute
    path of a prepared folder. Raw text inputs are prepared into ``RUN_DIR/data`` first (a
    re-run continues or reuses that folder)."""
    if isinstance(values, str):
        values = [values]
    values = list(values or ["corpus"])
    if len(values) == 1 and values[0] in RUNTIME_DATA_KEYWORDS:
        return values[0]
    if any(v in RUNTIME_DATA_KEYWORDS for v in values):
        raise ShoalError("--data corpus and --data synthetic stand alone; do not mix them with paths")
    if len(values) == 1 and is_prepared(values[0]):
        return str(Path(values[0]).expanduser().resolve())
    if run_dir is None:
        raise ShoalError("--data with raw text needs a run folder (--out) to prepare it in; "
                         "or prepare it once with: shoal data prepare INPUT... --out DIR, then --data DIR")
    target = Path(run_dir).expanduser() / "data"
    if not quiet:
        print(f"preparing {' '.join(values)} into {target}", file=sys.stderr, flush=True)
    prepare(PrepareConfig(inputs=tuple(values), out=str(target), vocab_size=vocab_size, quiet=quiet))
    return str(target.resolve())


def storage_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (little-endian, as written to the shards)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_name(k: int) -> str:
    """File name of shard ``k``."""
    return f"shard_{k:05d}.bin"


def _atomic_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_json(path: Path, obj: dict) -> None:
    _atomic_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _sample_text(sources: list[Source], field: str, limit: int) -> list[str]:
    """The first ``limit`` bytes of text of the input stream (documents in order)."""
    out, size = [], 0
    for src in sources:
        for pieces, _, _ in read_chunks(src, {}, field):
            for p in pieces:
                if p:
                    out.append(p)
                    size += len(p.encode("utf-8"))
                    if size >= limit:
                        return out
    return out


def _load_or_train_tokenizer(cfg: PrepareConfig, sources: list[Source], out: Path):
    """The tokenizer of this folder: already saved (resume), the user's, or trained on a sample."""
    from tokenizers import Tokenizer

    from shoal.data.tokens import EOT_TOKEN, train_tokenizer

    saved = out / TOKENIZER_FILE
    if saved.exists():
        return Tokenizer.from_file(str(saved))
    if cfg.tokenizer == "train":
        sample = "\n\n".join(_sample_text(sources, cfg.field, cfg.sample_bytes))
        if not sample.strip():
            raise ShoalError("the inputs hold no text; pass files that contain text")
        tok = train_tokenizer(sample, cfg.vocab_size)
    else:
        path = Path(cfg.tokenizer).expanduser()
        if not path.is_file():
            raise ShoalError(f"--tokenizer {cfg.tokenizer!r} is neither 'train' nor a tokenizer.json file")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises its own exception type
            raise ShoalError(f"cannot load tokenizer {str(path)!r}: {str(exc).splitlines()[0]}") from None
        if tok.token_to_id(EOT_TOKEN) is None:
            tok.add_special_tokens([EOT_TOKEN])
    _atomic_bytes(saved, tok.to_str().encode("utf-8"))
    return tok


def tokenizer_eot_id(tok) -> int:
    """Id of the end-of-text token that separates documents."""
    from shoal.data.tokens import EOT_TOKEN

    eot = tok.token_to_id(EOT_TOKEN)
    if eot is None:
        raise ShoalError(f"the tokenizer has no {EOT_TOKEN} token")
    return int(eot)


class _ShardWriter:
    """Cuts the token stream into fixed-size shard files (atomic writes)."""

    def __init__(self, out: Path, shard_tokens: int, dtype: np.dtype, shards: int, carry: np.ndarray):
        self.out, self.n, self.dtype = out, shard_tokens, dtype
        self.shards = shards  # finished shard files
        self.buf = np.empty(shard_tokens, dtype=dtype)
        self.fill = len(carry)
        self.buf[: self.fill] = carry

    def add(self, ids: np.ndarray) -> bool:
        """Append ids; return whether a shard file was finished."""
        wrote = False
        i = 0
        while i < len(ids):
            take = min(self.n - self.fill, len(ids) - i)
            self.buf[self.fill : self.fill + take] = ids[i : i + take]
            self.fill += take
            i += take
            if self.fill == self.n:
                _atomic_bytes(self.out / shard_name(self.shards), self.buf.tobytes())
                self.shards += 1
                self.fill = 0
                wrote = True
        return wrote

    def carry(self) -> np.ndarray:
        return self.buf[: self.fill]

    def finish(self) -> None:
        if self.fill:
            _atomic_bytes(self.out / shard_name(self.shards), self.buf[: self.fill].tobytes())
            self.shards += 1
            self.fill = 0


class _Progress:
    """Bytes read of the total, tokens written, rate and time left, on stderr."""

    def __init__(self, total: int, done: int, quiet: bool):
        self.progress = None
        if quiet:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(TextColumn("prepare"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                                 TextColumn("{task.fields[tokens]} tokens"), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=Console(stderr=True), refresh_per_second=2)
        self.task = self.progress.add_task("prepare", total=total, completed=done, tokens="0")
        self.progress.start()

    def update(self, done: int, tokens: int) -> None:
        """``done`` bytes of the input read so far, ``tokens`` written."""
        if self.progress is not None:
            self.progress.update(self.task, completed=done, tokens=_count(tokens))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _count(n: int) -> str:
    """``n`` in a few characters: 987, 12.3k, 4.56M, 1.23G."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _source_records(sources: list[Source]) -> list[dict]:
    return [{"path": str(s.path.resolve()), "kind": s.kind, "bytes": s.path.stat().st_size,
             "sha256": file_sha256(s.path)} for s in sources]


def _bytes_done(src: Source, cursor: dict, size: int) -> int:
    """Bytes of ``src`` consumed at ``cursor`` (for the progress bar only)."""
    if cursor.get("done"):
        return size
    if src.kind == "parquet" or src.path.name.endswith(".gz"):
        return 0  # positions there are rows or decompressed bytes: counted when the file ends
    return min(size, int(cursor.get("pos", 0)))


def prepare(cfg: PrepareConfig) -> dict:
    """Write (or finish writing) the data folder ``cfg.out``; return its manifest."""
    cfg.validate()
    out = Path(cfg.out).expanduser()
    sources = resolve_inputs(cfg.inputs)
    records = _source_records(sources)
    inputs_key = hashlib.sha256(json.dumps([(r["path"], r["sha256"]) for r in records]).encode()).hexdigest()
    settings = {"inputs_key": inputs_key, "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size,
                "field": cfg.field, "shard_tokens": cfg.shard_tokens, "sample_bytes": cfg.sample_bytes,
                "format": FORMAT_VERSION}
    if (out / MANIFEST_FILE).exists():
        manifest = json.loads((out / MANIFEST_FILE).read_text())
        if manifest.get("settings") == settings:
            return manifest  # already complete for these inputs
        raise ShoalError(f"{str(out)!r} already holds prepared data of other inputs or settings; pick another --out")
    progress_path = out / PROGRESS_FILE
    state = {"settings": settings, "source": 0, "cursor": {}, "shards": 0}
    if progress_path.exists():
        saved = json.loads(progress_path.read_text())
        if saved.get("settings") != settings:
            raise ShoalError(f"{str(out)!r} holds an unfinished preparation of other inputs or settings; "
                             "delete it or re-run with the same inputs")
        state = saved
    elif out.exists() and any(p.name != TOKENIZER_FILE and not p.name.startswith(".") for p in out.iterdir()):
        raise ShoalError(f"--out {str(out)!r} is not empty; pick a new folder")
    out.mkdir(parents=True, exist_ok=True)

    tok = _load_or_train_tokenizer(cfg, sources, out)
    if not progress_path.exists():
        # From here on a re-run must find the same inputs and settings (the tokenizer is kept).
        _atomic_json(progress_path, state)
    vocab = tok.get_vocab_size()
    dtype = storage_dtype(vocab)
    eot = tokenizer_eot_id(tok)
    encoder = make_encoder(tok, eot)
    carry = np.zeros(0, dtype=dtype)
    if state["shards"] or state["source"] or state["cursor"]:
        carry = np.fromfile(out / f"carry-{state['shards']}.bin", dtype=dtype)
    writer = _ShardWriter(out, cfg.shard_tokens, dtype, int(state["shards"]), carry)
    sizes = [r["bytes"] for r in records]
    done_bytes = sum(sizes[: state["source"]]) + (_bytes_done(sources[state["source"]], state["cursor"], sizes[state["source"]])
                                                   if state["source"] < len(sources) else 0)
    bar = _Progress(sum(sizes), done_bytes, cfg.quiet)
    docs = int(state.get("docs", 0))
    repaired = int(state.get("repaired", 0))
    tokens = writer.shards * cfg.shard_tokens + writer.fill
    try:
        for si in range(int(state["source"]), len(sources)):
            src = sources[si]
            start = state["cursor"] if si == state["source"] else {}
            before = _bytes_done(src, start, sizes[si])
            for pieces, cursor, bad in read_chunks(src, start, cfg.field):
                ids = encoder.encode(pieces)
                docs += sum(1 for p in pieces if p is None)
                repaired += bad
                tokens += len(ids)
                if writer.add(ids):
                    # Carry first, then the state that names it: a crash in between redoes
                    # this chunk, which rewrites the same bytes.
                    _atomic_bytes(out / f"carry-{writer.shards}.bin", writer.carry().tobytes())
                    _atomic_json(progress_path, {"settings": settings, "source": si, "cursor": cursor,
                                                 "shards": writer.shards, "docs": docs, "repaired": repaired})
                    for old in out.glob("carry-*.bin"):
                        if old.name != f"carry-{writer.shards}.bin":
                            old.unlink(missing_ok=True)
                now = _bytes_done(src, cursor, sizes[si])
                done_bytes += now - before
                before = now
                bar.update(done_bytes, tokens)
        writer.finish()
    finally:
        bar.close()
    counts = [int(os.path.getsize(out / shard_name(k)) // dtype.itemsize) for k in range(writer.shards)]
    if sum(counts) <= docs:  # nothing but end-of-text tokens
        raise ShoalError("the inputs hold no text; pass files that contain text")
    _atomic_json(out / INDEX_FILE, {"shards": [{"file": shard_name(k), "tokens": c} for k, c in enumerate(counts)]})
    tok_bytes = (out / TOKENIZER_FILE).read_bytes()
    manifest = {
        "format": FORMAT_VERSION, "settings": settings, "sources": records,
        "tokenizer": {"origin": cfg.tokenizer if cfg.tokenizer == "train" else str(Path(cfg.tokenizer).resolve()),
                      "sha256": hashlib.sha256(tok_bytes).hexdigest(), "vocab_size": vocab, "eot_id": eot},
        "dtype": dtype.str, "shard_tokens": cfg.shard_tokens, "shards": len(counts), "tokens": sum(counts),
        "documents": docs, "repaired": repaired,
        "content_hash": _content_hash(out, counts, tok_bytes),
    }
    _atomic_json(out / MANIFEST_FILE, manifest)
    progress_path.unlink(missing_ok=True)
    for old in out.glob("carry-*.bin"):
        old.unlink(missing_ok=True)
    return manifest


def _content_hash(out: Path, counts: list[int], tok_bytes: bytes) -> str:
    """SHA-256 over the tokenizer and every shard: the identity of the prepared data."""
    h = hashlib.sha256(tok_bytes)
    for k in range(len(counts)):
        with open(out / shard_name(k), "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()
