"""Find and read the training text: the bundled corpus, or the user's files, folders, globs.

Every source is read as UTF-8 (undecodable bytes are replaced, so any text file works);
``.gz`` files are decompressed. The documents are joined in a fixed order (the order of
the paths given, and sorted file names inside a folder or glob) so that the same sources
always give the same corpus and hence the same cache key.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
from importlib import resources
from pathlib import Path

from shoal.errors import ShoalError

# Suffixes that count as text when a folder or glob is expanded (explicit files are
# always read, whatever their name).
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".txt.gz", ".md.gz")

# Separator between documents: a blank line keeps files from running into each other.
DOC_SEPARATOR = "\n\n"


def default_corpus_path() -> Path:
    """Path of the bundled Shakespeare corpus (see ``shoal/data/corpus/SOURCE.md``)."""
    return Path(str(resources.files("shoal.data") / "corpus" / "shakespeare.txt.gz"))


def _is_text_name(path: Path) -> bool:
    name = path.name.lower()
    return any(name.endswith(s) for s in TEXT_SUFFIXES)


def _hidden(path: Path, root: Path) -> bool:
    # Skip .git, .venv, .cache and the like inside a folder the user names.
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def expand_paths(paths, wanted, kinds: str, hint: str) -> list[Path]:
    """Expand files, folders (recursively, skipping hidden entries) and globs into files.

    Folders and globs keep the files for which ``wanted(path)`` is true, in sorted order; a
    file named explicitly is always kept. The same file named twice (by a folder and a
    glob, say) is kept once. ``kinds`` names the wanted files and ``hint`` says what to
    pass instead, both for the one-line :class:`ShoalError` on a path that does not exist,
    a folder without such files, or a glob that matches nothing.
    """
    files: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and wanted(f) and not _hidden(f, p))
            if not found:
                raise ShoalError(f"data folder {raw!r} holds no {kinds}; {hint}")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        elif any(ch in raw for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True))
            found = [m for m in matches if m.is_file() and wanted(m)]
            if not found:
                raise ShoalError(f"data pattern {raw!r} matches no {kinds}; {hint}")
            files.extend(found)
        else:
            raise ShoalError(f"data path {raw!r} does not exist; pass a file, a folder or a glob")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def resolve_sources(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """Expand files, folders (recursively, skipping hidden entries) and globs into text files.

    An empty ``paths`` means the bundled corpus. Raises :class:`ShoalError` for a path
    that does not exist, a folder without text files, or a glob that matches nothing.
    """
    if not paths:
        return [default_corpus_path()]
    return expand_paths(paths, _is_text_name, f"text files ({', '.join(TEXT_SUFFIXES)})",
                        "pass the files themselves or a folder with .txt files")


def read_text(path: Path) -> str:
    """The text of one file (gzip-decompressed if it ends in ``.gz``)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError) as exc:
        raise ShoalError(f"cannot read data file {str(path)!r}: {exc}") from None
    # Normalise line ends so the same text saved on Windows gives the same tokens.
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n")


def read_corpus(paths: tuple[str, ...] | list[str]) -> str:
    """The whole corpus as one string; raises :class:`ShoalError` if it has no text."""
    sources = resolve_sources(paths)
    docs = [read_text(p) for p in sources]
    text = DOC_SEPARATOR.join(d for d in docs if d.strip())
    if not text.strip():
        where = ", ".join(str(p) for p in sources[:3]) + (" ..." if len(sources) > 3 else "")
        raise ShoalError(f"the training corpus is empty ({where}); pass files that contain text")
    return text


def corpus_hash(text: str) -> str:
    """Hex SHA-256 of the corpus text: the cache key of everything derived from it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
