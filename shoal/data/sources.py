"""Input files of ``shoal data prepare``: plain text, JSONL and Parquet, read in bounded chunks.

Each reader is a generator of ``(pieces, cursor, repaired)``: ``pieces`` is a list of
strings and ``None`` markers (``None`` = end of a document), ``cursor`` the position
*after* them, so a reader restarted at that cursor yields exactly the chunks that followed,
and ``repaired`` the number of characters in them that could not be encoded and were
replaced with U+FFFD (invalid UTF-8 bytes; lone surrogates from JSON ``\ud800`` escapes).
Chunks are about :data:`CHUNK_BYTES` of text, which bounds the memory of the whole pipeline
whatever the size of the input.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shoal.data.text import TEXT_SUFFIXES, expand_paths
from shoal.errors import ShoalError

# Text per chunk: large enough to batch the encoder, small enough to bound memory.
CHUNK_BYTES = 1 << 20
# Suffixes (lower case) that select a reader; any other explicitly named file is text.
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# Bytes inspected to reject a binary file named as text.
_SNIFF_BYTES = 8192

Cursor = dict  # {"pos": byte offset or row index, "line": records read so far}


@dataclass(frozen=True)
class Source:
    """One input file and how to read it."""

    path: Path  # the file
    kind: str  # "text", "jsonl" or "parquet"


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _wanted(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)


def _check_not_binary(src: Source) -> None:
    if src.kind == "parquet":
        return
    try:
        opener = gzip.open if src.path.name.endswith(".gz") else open
        with opener(src.path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except (OSError, EOFError) as exc:
        raise ShoalError(f"cannot read data file {str(src.path)!r}: {exc}") from None
    if b"\x00" in head:
        raise ShoalError(f"data file {str(src.path)!r} looks binary (it holds NUL bytes); pass text, .jsonl or .parquet files")


def resolve_inputs(paths: list[str] | tuple[str, ...]) -> list[Source]:
    """Expand files, folders (recursive, hidden entries skipped) and globs into sources.

    Folders and globs take files ending in a text, JSONL or Parquet suffix, in sorted
    order; a file named explicitly is always taken. Raises :class:`ShoalError` for a
    missing path, a folder or glob without such files, or a binary file.
    """
    if not paths:
        raise ShoalError("no input given; pass text files, folders, globs, .jsonl or .parquet files")
    kinds = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES)
    files = expand_paths(paths, _wanted, f"input files ({kinds})",
                         "pass text, .jsonl or .parquet files")
    out = []
    for f in files:
        src = Source(f, _kind(f))
        _check_not_binary(src)
        out.append(src)
    return out


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _open_binary(path: Path, pos: int) -> io.BufferedIOBase:
    f = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # noqa: SIM115 -- returned open
    if pos:
        f.seek(pos)  # gzip: decompresses up to pos (only when resuming)
    return f


_REPLACEMENT_UTF8 = "\ufffd".encode()
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_utf8(raw: bytes) -> tuple[str, int]:
    """``raw`` as text with each invalid UTF-8 sequence replaced by U+FFFD, and the number replaced."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        # Every U+FFFD beyond those the bytes spelled out is a replacement.
        return text, text.count("\ufffd") - raw.count(_REPLACEMENT_UTF8)


def repair_surrogates(text: str) -> tuple[str, int]:
    """``text`` with lone surrogates (which UTF-8 cannot encode) replaced by U+FFFD, and their number."""
    if text.isascii():
        return text, 0
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return _SURROGATE.subn("\ufffd", text)


def _clean(raw: bytes) -> tuple[str, int]:
    # Undecodable bytes are replaced (and counted); Windows line ends become "\n".
    text, repaired = decode_utf8(raw)
    return text.replace("\r\n", "\n"), repaired


def _utf8_cut(block: bytes) -> int:
    """Length of the longest prefix of ``block`` that does not end inside a UTF-8 character."""
    cut = len(block)
    for back in range(1, 4):
        if cut - back < 0:
            break
        b = block[cut - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if b & 0x80 and back < (2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4):
            return cut - back  # lead byte whose character is incomplete
        break
    return cut


def read_text_chunks(path: Path, cursor: Cursor) -> Iterator[tuple[list, Cursor, int]]:
    """One document per file, cut after a newline every ~CHUNK_BYTES."""
    pos = int(cursor.get("pos", 0))
    rest = b""  # read but not yet yielded (kept instead of seeking back: gzip seeks are slow)
    with _open_binary(path, pos) as f:
        while True:
            block = rest + f.read(CHUNK_BYTES - len(rest))
            if not block:
                yield [None], {"pos": pos, "line": 0, "done": True}, 0
                return
            rest = b""
            if len(block) == CHUNK_BYTES:
                nl = block.rfind(b"\n")
                cut = nl + 1 if nl >= 0 else _utf8_cut(block)
                block, rest = block[:cut], block[cut:]
            pos += len(block)
            text, repaired = _clean(block)
            yield [text], {"pos": pos, "line": 0}, repaired


def read_jsonl_chunks(path: Path, cursor: Cursor, field: str) -> Iterator[tuple[list, Cursor, int]]:
    """One document per JSON line (its ``field``), ~CHUNK_BYTES of lines per chunk."""
    pos, line = int(cursor.get("pos", 0)), int(cursor.get("line", 0))
    with _open_binary(path, pos) as f:
        pieces: list = []
        size = repaired = 0
        for raw in f:
            line += 1
            pos += len(raw)
            if not raw.strip():
                continue
            try:
                text, bad = decode_utf8(raw)
                rec = json.loads(text)
            except ValueError:
                raise ShoalError(f"{path}:{line}: not a JSON line; each line of a .jsonl file must be one JSON object") from None
            if not isinstance(rec, dict) or field not in rec:
                raise ShoalError(f"{path}:{line}: no field {field!r}; name the text field with --field")
            text = rec[field]
            if not isinstance(text, str):
                raise ShoalError(f"{path}:{line}: field {field!r} is not a string")
            text, lone = repair_surrogates(text)
            repaired += bad + lone
            pieces += [text.replace("\r\n", "\n"), None]
            size += len(raw)
            if size >= CHUNK_BYTES:
                yield pieces, {"pos": pos, "line": line}, repaired
                pieces, size, repaired = [], 0, 0
        yield pieces, {"pos": pos, "line": line, "done": True}, repaired


def read_parquet_chunks(path: Path, cursor: Cursor, field: str) -> Iterator[tuple[list, Cursor, int]]:
    """One document per row (its ``field`` column), in record batches."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ShoalError("reading .parquet needs pyarrow; install it (pip install pyarrow==26.0.1)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 -- pyarrow raises several types for a bad file
        raise ShoalError(f"cannot read Parquet file {str(path)!r}: {exc}") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ShoalError(f"{path}: no column {field!r} (columns: {', '.join(names)}); name the text column with --field")
    row = int(cursor.get("pos", 0))
    seen = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        n = batch.num_rows
        if seen + n <= row:
            seen += n
            continue
        values = batch.column(0).to_pylist()[row - seen if row > seen else 0:]
        seen += n
        pieces: list = []
        for v in values:
            if v is None:
                continue
            if not isinstance(v, str):
                raise ShoalError(f"{path}: column {field!r} is not text")
            pieces += [v.replace("\r\n", "\n"), None]
        row = seen
        yield pieces, {"pos": row, "line": row}, 0  # Arrow strings are valid UTF-8
    yield [], {"pos": row, "line": row, "done": True}, 0


def read_chunks(src: Source, cursor: Cursor, field: str) -> Iterator[tuple[list, Cursor, int]]:
    """The chunk reader of ``src``'s kind, started at ``cursor``."""
    if src.kind == "jsonl":
        return read_jsonl_chunks(src.path, cursor, field)
    if src.kind == "parquet":
        return read_parquet_chunks(src.path, cursor, field)
    return read_text_chunks(src.path, cursor)
