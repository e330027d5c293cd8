"""The memoised encoder of ``shoal data prepare`` gives exactly the tokenizer's ids."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from shoal.data import encode
from shoal.data.encode import (
    PIECE,
    WHITESPACE,
    BatchEncoder,
    MemoEncoder,
    make_encoder,
    memo_eligible,
    piece_starts,
)
from shoal.data.text import read_text
from shoal.data.tokens import EOT_TOKEN, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
# Characters that may be \s in the tokenizer's regex engine: White_Space is a subset of these.
_MAYBE_SPACE = [chr(c) for c in range(0x110000)
                if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) in ("Zs", "Zl", "Zp", "Cc", "Cf")]


def _awkward_docs() -> list:
    """Documents that probe every cut rule: code, prose, contractions, every space-like
    character next to letters, digits, punctuation and other spaces, long unbroken runs."""
    code = [read_text(p) for p in sorted((REPO / "shoal" / "data").glob("*.py"))]
    prose = ("It's the cat's toy; they'll say 'I'd've' -- don't.  Numbers: 3.14, 1e-9, 0x1F, 1,000,000.\n"
             "Ünïcödé — 日本語のテキスト, emoji 🐟🐠, combining e\u0301 and Ω. Tabs\tand\r\nCRLF\n\n\n  end  ")
    spaces = "".join(f"a{c}b {c}1{c}{c}.{c} {c}'s{c}x\n" for c in _MAYBE_SPACE)
    odd = ["", " ", "\n", "x", "'", "''s", "a" * 5000, "(" * 3000 + "a", "é" * 2000, "\u3000" * 50 + "x",
           "a'" * 100, "1a" * 300, " \n \n x", "word" + "\x00\x1f" * 10, "<|end" + "oftext|> inside a word",
           "<|endoftext|>", "a<|endoftext|>b", " x  <|endoftext|>  y\n<|endoftext|><|endoftext|>  ", "<|endoftext|"]
    docs: list = []
    for d in [*code, prose, spaces, *odd, prose.upper(), spaces[::-1]]:
        docs += [d, None]
    return docs


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    text = "".join(d for d in _awkward_docs() if d)
    return train_tokenizer(text, 600)


def test_whitespace_class_is_the_pre_tokenizers():
    """``WHITESPACE`` holds exactly the characters the ByteLevel regex treats as \\s: such a
    character stands alone between two dots, two letters and two digits; any other
    character joins the dots (punctuation), the letters or the digits."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    listed = set()
    for part in WHITESPACE.split("\u2000-\u200a"):
        listed |= set(part)
    listed |= {chr(c) for c in range(0x2000, 0x200B)}
    for c in _MAYBE_SPACE:
        if c == " ":
            continue  # the pattern's optional leading space: checked through the cut tests
        alone = all(len(pre.pre_tokenize_str(f"{x}{c}{x}")) == 3 for x in ".a1")
        assert alone == (c in listed), (hex(ord(c)), alone)
    assert " " in listed


def test_memo_encoder_equals_the_tokenizer(trained):
    eot = trained.token_to_id(EOT_TOKEN)
    assert memo_eligible(trained)
    docs = _awkward_docs()
    want = BatchEncoder(trained, eot).encode(docs)
    # One document at a time against tokenizer.encode itself, too.
    direct = []
    for d in docs:
        direct += [eot] if d is None else trained.encode(d, add_special_tokens=False).ids
    assert want.tolist() == direct
    memo = MemoEncoder(trained, eot)
    assert memo.split_added  # documents holding <|endoftext|> go in pieces too
    assert np.array_equal(memo.encode(docs), want)
    # Again: now every piece comes from the memo.
    encoded = memo.pieces_encoded
    assert np.array_equal(memo.encode(docs), want) and memo.pieces_encoded == encoded
    # A memo small enough to be reset between runs gives the same ids.
    small = MemoEncoder(trained, eot, max_pieces=50, max_ids=200)
    for i in range(0, len(docs), 7):
        part = docs[i : i + 7]
        assert np.array_equal(small.encode(part), BatchEncoder(trained, eot).encode(part)), i


def test_memo_encoder_falls_back_when_pieces_do_not_align(trained):
    """If the tokens of joined pieces do not end where the pieces end (here: made so by
    wrong byte lengths), the chunk is encoded whole: the ids stay exact."""
    eot = trained.token_to_id(EOT_TOKEN)
    docs = _awkward_docs()[:6]
    memo = MemoEncoder(trained, eot)
    memo.token_bytes[:] = 1
    assert np.array_equal(memo.encode(docs), BatchEncoder(trained, eot).encode(docs))


def test_other_tokenizers_are_encoded_whole(trained):
    vocab = {EOT_TOKEN: 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    plain = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    plain.decoder = decoders.ByteLevel()
    assert not memo_eligible(plain) and isinstance(make_encoder(plain, 0), BatchEncoder)
    assert isinstance(make_encoder(trained, 0), MemoEncoder)


def _pieces(text: str) -> list[str]:
    data = text.encode()
    if not data:
        return []
    starts = piece_starts(data, np.zeros(1, dtype=np.int64)).tolist()
    return [data[s:e].decode() for s, e in zip(starts, [*starts[1:], len(data)], strict=True)]


def test_numpy_cuts_are_the_patterns():
    """piece_starts cuts every document exactly where PIECE.findall does (every space-like
    character, non-ASCII text, long runs), and a document start always starts a piece."""
    docs = [d for d in _awkward_docs() if d is not None]
    for d in docs:
        assert _pieces(d) == PIECE.findall(d), d[:60]
    joined = [d for d in docs if d]
    data = "".join(joined).encode()
    sizes = np.array([len(d.encode()) for d in joined])
    starts = piece_starts(data, np.cumsum(sizes) - sizes).tolist()
    got = [data[s:e].decode() for s, e in zip(starts, [*starts[1:], len(data)], strict=True)]
    assert got == [p for d in joined for p in PIECE.findall(d)]


def test_key_table_finds_adds_and_grows():
    """The packed-key table gives every distinct piece one slot, new slots counted on from
    the next free one, and a repeated piece the slot it got first, in a table far too small
    at first (it grows); checked against a dict."""
    rng = np.random.default_rng(0)
    words = [bytes(rng.integers(0, 3, int(rng.integers(1, 25))).astype(np.uint8)) for _ in range(3000)]
    text = b"".join(words)
    starts = np.cumsum([0] + [len(w) for w in words[:-1]])
    lens = np.array([len(w) for w in words])
    table = encode._KeyTable(4)
    slot_of: dict[bytes, int] = {}
    for lo in range(0, len(words), 700):
        hi = lo + 700
        known = {w for w in words[lo:hi] if w in slot_of}
        slots, added = table.find_or_add(encode._pack(text, starts[lo:hi], lens[lo:hi]), lens[lo:hi], len(slot_of))
        # The added keys are this block's new ones, each once, with the next slots in order.
        fresh = [words[lo + i] for i in added.tolist()]
        assert sorted(fresh) == sorted(set(words[lo:hi]) - known)
        for i, w in enumerate(fresh):
            slot_of[w] = len(slot_of)
            assert slots[added[i]] == slot_of[w]
        assert slots.tolist() == [slot_of[w] for w in words[lo:hi]]
    assert table.count == len(slot_of) and len(table.rows) > 16


def test_long_documents_go_in_blocks(trained, monkeypatch):
    """Blocks of pieces smaller than a piece (a 5000-letter run) and than most documents
    give the same ids."""
    monkeypatch.setattr(encode, "_BLOCK_BYTES", 64)
    eot = trained.token_to_id(EOT_TOKEN)
    docs = _awkward_docs()
    assert np.array_equal(MemoEncoder(trained, eot).encode(docs), BatchEncoder(trained, eot).encode(docs))
