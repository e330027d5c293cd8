"""Byte-level BPE tokenizer and token ids, trained and encoded once, cached on disk.

The cache key is the SHA-256 of the corpus text, the vocabulary size and
:data:`RECIPE_VERSION` (bumped whenever the tokenizer recipe or the encoding changes).
Each entry is a folder ``<cache>/data/<hash16>-v<vocab>-r<recipe>/`` holding
``tokenizer.json`` (HF ``tokenizers``) and ``ids.npy`` (the whole corpus encoded, uint16
or int32). Files are written to a temporary name and renamed, so processes that load the
same data at the same time never see a half-written file; at worst both compute it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shoal.data.text import corpus_hash, read_corpus
from shoal.errors import ShoalError

if TYPE_CHECKING:
    import torch

# Bump when the tokenizer training or the encoding changes: old cache entries are ignored.
RECIPE_VERSION = 2
# Marks document boundaries; id 0 in every tokenizer we train.
EOT_TOKEN = "<|endoftext|>"
# Lines per chunk fed to the trainer/encoder: big enough to batch, small enough to parallelise.
_LINES_PER_CHUNK = 256
# Smallest vocabulary: the 256 byte symbols plus the end-of-text token.
MIN_VOCAB_SIZE = 257


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from and how it is split."""

    paths: tuple[str, ...] = ()  # a prepared data folder, or text files/folders/globs; empty = bundled corpus
    val_fraction: float = 0.05  # fraction of the tokens (the last ones) held out for validation
    cache_dir: str | None = None  # tokenizer/token cache; None = $SHOAL_CACHE_DIR or ~/.cache/shoal

    def validate(self) -> None:
        """Raise :class:`ShoalError` if a field is out of range."""
        if not 0.0 < self.val_fraction < 1.0:
            raise ShoalError(f"val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass
class TokenData:
    """The tokenized corpus split into training and validation token streams."""

    train: torch.Tensor  # 1-D int64 ids, the first (1 - val_fraction) (or a shards.TokenStream)
    val: torch.Tensor  # 1-D int64 token ids, the rest (or a shards.TokenStream)
    tokenizer: Tokenizer  # the byte-level BPE tokenizer that produced the ids
    vocab_size: int  # the model's vocabulary size (every id is below it)
    corpus_hash: str = ""  # SHA-256 of the corpus text
    cache_path: str = ""  # folder of the cache entry
    extra: dict = field(default_factory=dict)  # free-form facts for logs (tokens, source count)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids))


def resolve_cache_dir(cache_dir: str | None) -> Path:
    """The cache root: the explicit setting, else ``$SHOAL_CACHE_DIR``, else ``~/.cache/shoal``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SHOAL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "shoal"


def _cuttable(before: str, after: str) -> bool:
    return before.endswith("\n") and not before[-2:-1].isspace() and len(before) > 1 and not after[:1].isspace()


def _chunks(text: str) -> list[str]:
    """Split ``text`` into pieces of about ``_LINES_PER_CHUNK`` lines for batched work.

    A piece ends with a lone newline between two non-space characters. The byte-level
    pre-tokenizer makes that newline a piece of its own in any case, so encoding the pieces
    one by one gives exactly the ids of encoding the whole text (a longer whitespace run
    would be split differently at the end of a piece), and the pieces concatenate back.
    """
    lines = text.splitlines(keepends=True)
    chunks, start = [], 0
    for i in range(_LINES_PER_CHUNK, len(lines), _LINES_PER_CHUNK):
        if i <= start:
            continue
        # Move the cut forward to "<non-space>\n<non-space>".
        j = i
        while j < len(lines) and not _cuttable(lines[j - 1], lines[j]):
            j += 1
        if j < len(lines):
            chunks.append("".join(lines[start:j]))
            start = j
    chunks.append("".join(lines[start:]))
    return [c for c in chunks if c]


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with at most ``vocab_size`` tokens on ``text``.

    Deterministic for a given text and size. A small corpus may yield fewer tokens than
    asked; the ids are then still below ``vocab_size``.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ShoalError(f"vocab_size must be at least {MIN_VOCAB_SIZE} for a byte-level tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOT_TOKEN],
        show_progress=False,
    )
    chunks = _chunks(text)
    tok.train_from_iterator(chunks, trainer, length=len(chunks))
    return tok


def encode_corpus(tok: Tokenizer, text: str) -> np.ndarray:
    """All token ids of ``text`` as a 1-D int64 array."""
    encs = tok.encode_batch(_chunks(text))
    total = sum(len(e.ids) for e in encs)
    out = np.empty(total, dtype=np.int64)
    pos = 0
    for e in encs:
        out[pos : pos + len(e.ids)] = e.ids
        pos += len(e.ids)
    return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _storage_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def load_tokens(
    text: str, vocab_size: int, cache_dir: str | None, text_hash: str | None = None
) -> tuple[Tokenizer, np.ndarray, Path]:
    """Tokenizer and token ids of ``text``, from the cache or computed and cached."""
    text_hash = text_hash or corpus_hash(text)
    key = f"{text_hash[:16]}-v{vocab_size}-r{RECIPE_VERSION}"
    entry = resolve_cache_dir(cache_dir) / "data" / key
    tok_path, ids_path = entry / "tokenizer.json", entry / "ids.npy"
    if tok_path.exists() and ids_path.exists():
        try:
            tok = Tokenizer.from_file(str(tok_path))
            ids = np.load(ids_path, allow_pickle=False).astype(np.int64)
            return tok, ids, entry
        except Exception:  # noqa: BLE001 -- a corrupt or truncated entry is rebuilt below
            pass
    tok = train_tokenizer(text, vocab_size)
    ids = encode_corpus(tok, text)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        _atomic_write_bytes(tok_path, tok.to_str().encode("utf-8"))
        _atomic_save_npy(ids_path, ids.astype(_storage_dtype(vocab_size)))
        _atomic_write_bytes(
            entry / "meta.json",
            json.dumps({"vocab_size": vocab_size, "tokens": int(ids.size), "recipe": RECIPE_VERSION}).encode(),
        )
    except OSError as exc:
        raise ShoalError(f"cannot write the data cache at {str(entry)!r} ({exc}); set SHOAL_CACHE_DIR to a writable folder") from None
    return tok, ids, entry


def split_ids(ids: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split token ids into (train, val): the last ``val_fraction`` of the tokens is val."""
    n = int(ids.size)
    n_val = max(2, int(round(n * val_fraction)))
    if n - n_val < 2:
        raise ShoalError(f"the corpus has only {n} tokens: too few to split into training and validation; add text")
    return ids[: n - n_val], ids[n - n_val :]


def load_data(cfg: DataConfig, vocab_size: int) -> TokenData:
    """Read, tokenize (cached) and split the corpus of ``cfg`` for a model of ``vocab_size``.

    A single path that is a prepared data folder (``shoal data prepare``) is read from its
    memory-mapped shards instead; raw text is read and tokenized in memory.
    """
    cfg.validate()
    if vocab_size < MIN_VOCAB_SIZE:
        raise ShoalError(f"vocab_size must be at least {MIN_VOCAB_SIZE} for a byte-level tokenizer, got {vocab_size}")
    from shoal.data.shards import is_prepared, load_prepared

    if len(cfg.paths) == 1 and is_prepared(cfg.paths[0]):
        return load_prepared(cfg.paths[0], vocab_size, cfg.val_fraction)
    text = read_corpus(cfg.paths)
    text_hash = corpus_hash(text)
    import torch  # here, not at the top: `shoal data prepare` uses this module without torch

    tok, ids, entry = load_tokens(text, vocab_size, cfg.cache_dir, text_hash)
    train, val = split_ids(ids, cfg.val_fraction)
    return TokenData(
        train=torch.from_numpy(np.ascontiguousarray(train)),
        val=torch.from_numpy(np.ascontiguousarray(val)),
        tokenizer=tok,
        vocab_size=vocab_size,
        corpus_hash=text_hash,
        cache_path=str(entry),
        extra={"tokens": int(ids.size), "chars": len(text)},
    )
