"""Token ids of text for ``shoal data prepare``: the tokenizer's batch encoder, memoised.

Text is mostly made of pieces that recur (words, operators, indentation). For a
byte-level BPE tokenizer (GPT-2's pre-tokenizer: no normaliser, ``ByteLevel`` with its
regex, a BPE model) the ids of a text are the ids of its pre-tokens, each encoded on its
own, so text can be cut wherever that pre-tokenizer always cuts and the ids of each piece
reused. :class:`MemoEncoder` cuts every document into such pieces with one regular
expression, looks them up in a bounded memo, and sends only the pieces it has not seen
to the tokenizer's parallel batch encoder (``encode_batch_fast``), joined into large
texts. The ids are exactly those of ``tokenizer.encode`` on the whole document (tested
against it); the tokenizer does a small fraction of the work it would do alone.

Where the pre-tokenizer always cuts (GPT-2's pattern
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``):
no pre-token holds a non-space character followed by a space, and none holds two of an
ASCII letter, ASCII digit and ASCII punctuation next to each other except a contraction
(``'s``), which starts at an apostrophe. So a piece boundary goes before every whitespace
character that follows a non-whitespace one, and between adjacent ASCII characters of
different classes, except after an apostrophe; any other character (non-ASCII, a control
character, the apostrophe) glues to its neighbours. Whitespace is the pattern's ``\\s``
(Unicode White_Space), spelled out below and checked against the tokenizer in the tests.

Any other tokenizer (a normaliser, another pre-tokenizer, BPE dropout...) is encoded
whole with ``encode_batch_fast`` (:class:`BatchEncoder`); so is a document holding the
text of an added token such as ``<|endoftext|>``, which the tokenizer matches before
pre-tokenizing.
"""

from __future__ import annotations

import json
import re

import numpy as np

# Unicode White_Space: what the ByteLevel pre-tokenizer's regex engine calls \s.
WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_LETTER, _DIGIT = "A-Za-z", "0-9"
_PUNCT = "!-&(-/:-@\\[-`{-~"  # ASCII punctuation and symbols but the apostrophe
_GLUE = f"[^{WHITESPACE}{_LETTER}{_DIGIT}{_PUNCT}]"  # joins its neighbours: ', non-ASCII, controls
_ATOM = f"(?:[{_LETTER}]++|[{_DIGIT}]++|[{_PUNCT}]++)"
# One piece: leading whitespace, then ASCII runs of one class glued by _GLUE characters;
# or whitespace at the end of a text.
PIECE = re.compile(f"[{WHITESPACE}]*+(?:[{_LETTER}]++|[{_DIGIT}]++|[{_PUNCT}]++|{_GLUE}++{_ATOM}?+)"
                   f"(?:{_GLUE}++{_ATOM}?+)*+|[{WHITESPACE}]++")

# Text per encoder input when the unseen pieces are sent to the tokenizer: a few per
# core keep the batch encoder's threads busy, and each is large enough to amortise a call.
_GROUP_CHARS = 1 << 16
# Bounds of the memo (the process's memory): pieces remembered, and their token ids.
MAX_PIECES = 1 << 19
MAX_IDS = 1 << 22


def memo_eligible(tok) -> bool:
    """Whether ``tok`` encodes piece by piece as :class:`MemoEncoder` assumes."""
    spec = json.loads(tok.to_str())
    pre, model = spec.get("pre_tokenizer") or {}, spec.get("model") or {}
    return (spec.get("normalizer") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
            and model.get("type") == "BPE" and model.get("dropout") is None
            and not model.get("continuing_subword_prefix") and not model.get("end_of_word_suffix"))


class BatchEncoder:
    """Any tokenizer: each document encoded whole by the parallel batch encoder."""

    def __init__(self, tok, eot: int):
        self.tok, self.eot = tok, eot

    def encode(self, docs: list) -> np.ndarray:
        """Ids of ``docs`` (strings, and ``None`` for an end-of-text token) as one int64 array."""
        from shoal.data.tokens import _chunks as split_lines

        parts: list[str] = []
        layout: list[int] = []  # per doc: number of encoder inputs, or -1 for an EOT
        for d in docs:
            if d is None:
                layout.append(-1)
            else:
                cs = split_lines(d) if len(d) > 4096 else ([d] if d else [])
                parts.extend(cs)
                layout.append(len(cs))
        encs = self.tok.encode_batch_fast(parts, add_special_tokens=False) if parts else []
        lists: list = []
        i = 0
        for n in layout:
            if n < 0:
                lists.append((self.eot,))
            else:
                lists.extend(e.ids for e in encs[i : i + n])
                i += n
        out = np.empty(sum(len(x) for x in lists), dtype=np.int64)
        pos = 0
        for x in lists:
            out[pos : pos + len(x)] = x
            pos += len(x)
        return out


_WS_SET = frozenset(re.sub("\u2000-\u200a", "".join(map(chr, range(0x2000, 0x200B))), WHITESPACE))
# Class of an ASCII character for the cut rule: letter, digit, punctuation (apostrophe: glue).
_ASCII_CLASS = {c: ("l" if c.isalpha() else "d" if c.isdigit() else "p")
                for c in map(chr, range(0x21, 0x7F)) if c != "'"}


def _joins(a: str, b: str) -> bool:
    """Whether the pre-tokenizer always cuts between character ``a`` and a following ``b``."""
    if b in _WS_SET:
        return a not in _WS_SET
    ca, cb = _ASCII_CLASS.get(a), _ASCII_CLASS.get(b)
    return ca is not None and cb is not None and ca != cb


class _Misaligned(Exception):
    """The tokens of joined pieces did not end where the pieces end."""


class _Slots(dict):
    """piece -> slot; an unknown piece gets the next free slot and is listed in ``new``."""

    def __init__(self):
        super().__init__()
        self.new: list[str] = []  # pieces given a slot since the last take_new()

    def __missing__(self, key: str) -> int:
        slot = self[key] = len(self)
        self.new.append(key)
        return slot


class _Memo:
    """Pieces and their token ids: a dict to a slot, the ids of all slots in one array."""

    def __init__(self, max_pieces: int, max_ids: int):
        self.max_pieces, self.max_ids = max_pieces, max_ids
        self.reset()

    def reset(self) -> None:
        """Forget every piece."""
        self.slot = _Slots()  # piece -> slot
        self.starts = np.zeros(1 << 16, dtype=np.int32)  # slot -> first id in self.ids
        self.lens = np.zeros(1 << 16, dtype=np.int32)  # slot -> number of ids
        self.ids = np.zeros(1 << 20, dtype=np.int32)
        self.slots, self.fill = 0, 0

    def full(self) -> bool:
        """Past its bounds (checked before a lookup, so that slots stay valid while used)."""
        return self.slots > self.max_pieces or self.fill > self.max_ids

    def lookup(self, keys: list) -> tuple[np.ndarray, list[str]]:
        """Slot of each key, and the keys new to the memo (in slot order), which have no
        ids yet: :meth:`add` them before the next lookup."""
        slots = np.fromiter(map(self.slot.__getitem__, keys), dtype=np.int64, count=len(keys))
        new, self.slot.new = self.slot.new, []
        return slots, new

    def add(self, n: int, ids: np.ndarray, counts: np.ndarray) -> None:
        """Give the next ``n`` slots their ids: slot ``i`` the next ``counts[i]`` of ``ids``."""
        while self.slots + n > len(self.starts):
            self.starts = np.resize(self.starts, 2 * len(self.starts))
            self.lens = np.resize(self.lens, 2 * len(self.lens))
        while self.fill + len(ids) > len(self.ids):
            self.ids = np.resize(self.ids, 2 * len(self.ids))
        self.ids[self.fill : self.fill + len(ids)] = ids
        self.starts[self.slots : self.slots + n] = self.fill + np.cumsum(counts) - counts
        self.lens[self.slots : self.slots + n] = counts
        self.slots += n
        self.fill += len(ids)

    def expand(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of ``slots`` one after another, and the number of ids of each slot."""
        starts, lens = self.starts[slots], self.lens[slots]
        ends = np.cumsum(lens)
        total = int(ends[-1]) if len(ends) else 0
        return self.ids[np.repeat(starts - (ends - lens), lens) + np.arange(total)], lens


class MemoEncoder:
    """A byte-level BPE tokenizer's ids, piece by piece through a bounded memo (see above)."""

    def __init__(self, tok, eot: int, max_pieces: int = MAX_PIECES, max_ids: int = MAX_IDS):
        self.tok, self.eot = tok, eot
        self.batch = BatchEncoder(tok, eot)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        # Bytes of text behind each id: one per character of a byte-level token.
        self.token_bytes = np.zeros(vocab, dtype=np.int64)
        for t, i in tok.get_vocab(with_added_tokens=False).items():
            if i < vocab:
                self.token_bytes[i] = len(t)
        self.eot_text = tok.id_to_token(eot)
        added = [t.content for t in tok.get_added_tokens_decoder().values()]
        self.added = re.compile("|".join(map(re.escape, added))) if added else None
        self.pieces = _Memo(max_pieces, max_ids)
        self.pieces_seen = 0  # pieces looked up
        self.pieces_encoded = 0  # pieces sent to the tokenizer

    def encode(self, docs: list) -> np.ndarray:
        """Ids of ``docs`` (strings, and ``None`` for an end-of-text token) as one integer array."""
        out, run = [], []
        for d in docs:
            if d is not None and self.added is not None and self.added.search(d):
                if run:
                    out.append(self._encode_run(run))
                    run = []
                out.append(self.batch.encode([d]))
            else:
                run.append(d)
        if run:
            out.append(self._encode_run(run))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _encode_run(self, docs: list) -> np.ndarray:
        memo = self.pieces
        if memo.full():
            memo.reset()
        keys: list = []
        findall = PIECE.findall
        eot = self.eot_text
        for d in docs:
            if d is None:
                keys.append(eot)  # a piece of its own: no document in a run holds this text
            else:
                keys += findall(d)
        self.pieces_seen += len(keys)
        slots, new = memo.lookup(keys)
        if new:
            try:
                self._learn_pieces(new)
            except _Misaligned:
                memo.reset()
                return self.batch.encode(docs)
        return memo.expand(slots)[0]

    def _learn_pieces(self, new: list[str]) -> None:
        """Encode the fine pieces ``new`` (joined into large texts) and remember their ids.

        Two pieces are joined directly where the pre-tokenizer cuts between them anyway;
        elsewhere the end-of-text token's text goes between them (the tokenizer splits
        there first) and its id is dropped from the result.
        """
        eot = self.eot_text
        groups, texts = [], []
        group: list[str] = []
        parts: list[str] = []
        size, prev = 0, ""
        for w in new:
            if w == eot:  # a document end: its slot goes in a group of its own
                if group:
                    groups.append(group)
                    texts.append("".join(parts))
                    group, parts, size = [], [], 0
                groups.append([eot])
                texts.append("")
                continue
            if parts and not _joins(prev, w[0]):
                parts.append(eot)
            parts.append(w)
            group.append(w)
            prev = w[-1]
            size += len(w)
            if size >= _GROUP_CHARS:
                groups.append(group)
                texts.append("".join(parts))
                group, parts, size = [], [], 0
        if group:
            groups.append(group)
            texts.append("".join(parts))
        encs = self.tok.encode_batch_fast(texts, add_special_tokens=False)
        self.pieces_encoded += len(new)
        for g, e in zip(groups, encs, strict=True):
            if g[0] == eot:
                self.pieces.add(1, np.array([self.eot]), np.array([1]))
                continue
            ids = np.asarray(e.ids, dtype=np.int64)
            ids = ids[ids != self.eot]
            token_end = np.cumsum(self.token_bytes[ids])
            piece_end = np.cumsum(np.fromiter(map(len, map(str.encode, g)), dtype=np.int64, count=len(g)))
            last = np.searchsorted(token_end, piece_end)  # index of each piece's last token
            if last[-1] >= len(ids) or not np.array_equal(token_end[last], piece_end):
                raise _Misaligned
            self.pieces.add(len(g), ids, np.diff(last, prepend=-1))


def make_encoder(tok, eot: int) -> MemoEncoder | BatchEncoder:
    """The fastest exact encoder for ``tok``: memoised pieces when it allows, else whole documents."""
    return MemoEncoder(tok, eot) if memo_eligible(tok) else BatchEncoder(tok, eot)
