"""Token ids of text for ``shoal data prepare``: the tokenizer's batch encoder, memoised.

Text is mostly made of pieces that recur (words, operators, indentation). For a
byte-level BPE tokenizer (GPT-2's pre-tokenizer: no normaliser, ``ByteLevel`` with its
regex, a BPE model) the ids of a text are the ids of its pre-tokens, each encoded on its
own, so text can be cut wherever that pre-tokenizer always cuts and the ids of each piece
reused. :class:`MemoEncoder` cuts a chunk of documents into such pieces, looks them up
in a bounded memo, and sends only the pieces it has not seen to the tokenizer's parallel
batch encoder (``encode_batch_fast``), joined into large texts. The ids are exactly those
of ``tokenizer.encode`` on each document (tested against it); the tokenizer does a small
fraction of the work it would do alone.

No Python object is made per piece that the memo knows: the chunk's UTF-8 bytes are
classified and cut with numpy (:func:`piece_starts`, the cuts of the regular expression
:data:`PIECE`), a piece of up to 24 bytes is keyed by its bytes packed into three 64-bit
words and its length (exact, no hash of the text to collide) and looked up in an
open-addressing table held in numpy arrays (:class:`_KeyTable`); only longer pieces (about
0.5 % of them in source code) go through a dict of their bytes, and only unseen pieces
become strings, for the tokenizer. The ids of the pieces then come out of one array by
a gather.

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
whole with ``encode_batch_fast`` (:class:`BatchEncoder`). The tokenizer matches added
tokens such as ``<|endoftext|>`` before pre-tokenizing and encodes the text between them on
its own, so a document holding one is encoded as those texts with the token's id between
them (whole by the batch encoder if an added token strips or binds its neighbours).
"""

from __future__ import annotations

import itertools
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

# Text per block of pieces looked up together: bounds the arrays kept per piece (~30 bytes
# per byte of text) whatever the size of a document.
_BLOCK_BYTES = 1 << 20
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
        """Ids of ``docs`` (strings, ``None`` for an end-of-text token, an int for that id) as
        one int64 array."""
        from shoal.data.tokens import _chunks as split_lines

        parts: list[str] = []
        layout: list[int] = []  # per doc: number of encoder inputs, or -1 - the id of a token
        for d in docs:
            if not isinstance(d, str):
                layout.append(-1 - (self.eot if d is None else d))
            else:
                cs = split_lines(d) if len(d) > 4096 else ([d] if d else [])
                parts.extend(cs)
                layout.append(len(cs))
        encs = self.tok.encode_batch_fast(parts, add_special_tokens=False) if parts else []
        lists: list = []
        i = 0
        for n in layout:
            if n < 0:
                lists.append((-1 - n,))
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

# Byte classes of UTF-8 text for the cut rule: glue (every byte of a non-ASCII character
# but a space, controls, the apostrophe), whitespace, ASCII letter, digit, punctuation.
_GLUE_B, _SPACE_B, _LETTER_B, _DIGIT_B, _PUNCT_B = 0, 1, 2, 3, 4
_BYTE_CLASS = np.zeros(256, dtype=np.uint8)
for _c in range(128):
    _BYTE_CLASS[_c] = (_SPACE_B if chr(_c) in _WS_SET else
                       {"l": _LETTER_B, "d": _DIGIT_B, "p": _PUNCT_B}.get(_ASCII_CLASS.get(chr(_c)), _GLUE_B))
# The non-ASCII whitespace characters as UTF-8: lead byte -> the codes of whole sequences.
_WIDE_SPACES = sorted(c.encode() for c in _WS_SET if ord(c) >= 0x80)
_WIDE2 = np.array([int.from_bytes(s, "big") for s in _WIDE_SPACES if len(s) == 2], dtype=np.int64)
_WIDE3 = np.array([int.from_bytes(s, "big") for s in _WIDE_SPACES if len(s) == 3], dtype=np.int64)
assert len(_WIDE2) + len(_WIDE3) == len(_WIDE_SPACES)
_WIDE_LEADS = np.array(sorted({s[0] for s in _WIDE_SPACES}), dtype=np.uint8)

# A piece of at most _KEY_WORDS * 8 bytes is keyed by its bytes packed into that many
# 64-bit words and its length (exact: no hashing of the text); longer ones by their bytes.
_KEY_WORDS = 3
_SHORT = 8 * _KEY_WORDS


def _joins(a: str, b: str) -> bool:
    """Whether the pre-tokenizer always cuts between character ``a`` and a following ``b``."""
    if b in _WS_SET:
        return a not in _WS_SET
    ca, cb = _ASCII_CLASS.get(a), _ASCII_CLASS.get(b)
    return ca is not None and cb is not None and ca != cb


def _cut_table() -> np.ndarray:
    # Whether a piece starts at a byte of class c after one of class a, by 5 a + c.
    out = np.zeros(25, dtype=bool)
    for a in range(5):
        for c in range(5):
            out[5 * a + c] = (c == _SPACE_B and a != _SPACE_B) or (a >= _LETTER_B and c >= _LETTER_B and a != c)
    return out


_CUT = _cut_table()


def piece_starts(data: bytes, doc_starts: np.ndarray) -> np.ndarray:
    """Byte offsets where the pieces of the UTF-8 text ``data`` start: those of ``PIECE``
    within each document, the documents starting at ``doc_starts`` (sorted, below ``len(data)``).

    A piece starts at the first byte, at a whitespace character that follows another
    character, and between two ASCII letters, digits or punctuation of different classes.
    """
    b = np.frombuffer(data, dtype=np.uint8)
    cls = _BYTE_CLASS[b]
    if not data.isascii():
        _mark_wide_spaces(b, cls)
    cut = np.empty(len(b), dtype=bool)
    cut[:1] = True
    pair = cls[:-1] * np.uint8(5)
    pair += cls[1:]
    np.take(_CUT, pair, out=cut[1:])
    cut[doc_starts] = True
    return np.flatnonzero(cut)


def _mark_wide_spaces(b: np.ndarray, cls: np.ndarray) -> None:
    """Give every byte of a non-ASCII whitespace character the whitespace class."""
    lead = np.flatnonzero(np.isin(b, _WIDE_LEADS))
    if not len(lead):
        return
    pad = np.concatenate([b, np.zeros(2, dtype=np.uint8)]).astype(np.int64)
    two = (pad[lead] << 8) | pad[lead + 1]
    three = (two << 8) | pad[lead + 2]
    for width, hits in ((2, np.isin(two, _WIDE2)), (3, np.isin(three, _WIDE3))):
        at = lead[hits]
        for k in range(width):
            cls[at + k] = _SPACE_B


# Row n: the words of a piece of n bytes keep their first n bytes.
_KEEP = np.array([[(1 << (8 * min(8, max(0, n - 8 * w)))) - 1 for w in range(_KEY_WORDS)] for n in range(_SHORT + 1)],
                 dtype=np.uint64)


def _pack(data: bytes, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``(len(starts), _KEY_WORDS)`` words holding the bytes of each piece (of at most
    ``_SHORT`` bytes), little-endian, zero past its end."""
    b = np.frombuffer(data + bytes(_SHORT), dtype=np.uint8)
    windows = np.lib.stride_tricks.as_strided(b, shape=(len(data) + 1, _SHORT), strides=(1, 1), writeable=False)
    out = windows[starts].view("<u8")
    out &= _KEEP[lens]
    return out


class _KeyTable:
    """Open-addressing hash table (linear probing) from packed short pieces to slots, on numpy
    arrays. A row is the key's words, then its length << 32 | (slot + 1); 0 there: empty."""

    def __init__(self, bits: int):
        self.bits = bits
        self.mask = (1 << bits) - 1
        self.rows = np.zeros((1 << bits, _KEY_WORDS + 1), dtype=np.uint64)
        self.count = 0

    def _home(self, words: np.ndarray, lens: np.ndarray) -> np.ndarray:
        h = lens.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for w in range(_KEY_WORDS):
            h ^= words[:, w]
            h *= np.uint64(0xBF58476D1CE4E5B9)
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def find_or_add(self, words: np.ndarray, lens: np.ndarray, next_slot: int,
                    given: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each key (``words`` of a piece of ``lens`` bytes); a key not in the
        table is added with the next slot from ``next_slot`` on (or its slot in ``given``).
        Returns the slots and, in slot order, the index of each added key."""
        out, _ = self._probe(words, lens, None, None)
        missing = np.flatnonzero(out < 0)
        if not len(missing):
            return out, missing
        if 2 * (self.count + len(missing)) > len(self.rows):  # keep it at most half full
            self._grow(self.count + len(missing))
        found, added = self._probe(words[missing], lens[missing], next_slot, None if given is None else given[missing])
        out[missing] = found
        return out, missing[added]

    def _probe(self, words: np.ndarray, lens: np.ndarray, next_slot: int | None,
               given: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        # Slots of the keys (-1 for a key not in the table when next_slot is None, else it is added).
        at = self._home(words, lens)
        kl = lens.astype(np.uint64)
        # First probe of every key at once (most end here), then the few that go on.
        row = self.rows[at]
        tag = row[:, _KEY_WORDS]
        same = (tag >> np.uint64(32)) == kl  # never at an empty row: pieces are not empty
        for w in range(_KEY_WORDS):
            same &= row[:, w] == words[:, w]
        out = np.where(same, (tag & np.uint64(0xFFFFFFFF)).astype(np.int64) - 1, -1)
        if next_slot is None:
            todo = np.flatnonzero(~same & (tag != 0))
            at = (at[todo] + 1) & self.mask
        else:
            todo = np.flatnonzero(~same)
            at = at[todo]
        added: list[np.ndarray] = []
        kw, kl = words[todo], kl[todo]
        while len(todo):
            row = self.rows[at]
            tag = row[:, _KEY_WORDS]
            empty = tag == 0
            same = (tag >> np.uint64(32)) == kl
            for w in range(_KEY_WORDS):
                same &= row[:, w] == kw[:, w]
            out[todo[same]] = (tag[same] & np.uint64(0xFFFFFFFF)).astype(np.int64) - 1
            free = np.flatnonzero(empty)
            if next_slot is None:
                same[free] = True  # not in the table: stays -1
            elif len(free):
                # The first key at each free row takes it; the others there compare with it next.
                _, first = np.unique(at[free], return_index=True)
                won = np.sort(free[first])
                k = todo[won]
                fresh = next_slot + np.arange(len(won), dtype=np.int64) if given is None else given[k]
                next_slot += len(won)
                self.rows[at[won], :_KEY_WORDS] = kw[won]
                self.rows[at[won], _KEY_WORDS] = (kl[won] << np.uint64(32)) | (fresh + 1).astype(np.uint64)
                self.count += len(won)
                out[k] = fresh
                added.append(k)
                same[won] = True
            more = ~same
            step = more & ~empty  # a key that lost a free row stays to compare with its winner
            todo, at, kw, kl = todo[more], at[more], kw[more], kl[more]
            at = np.where(step[more], (at + 1) & self.mask, at)
        return out, (np.concatenate(added) if added else np.zeros(0, dtype=np.int64))

    def _grow(self, need: int) -> None:
        rows = self.rows[self.rows[:, _KEY_WORDS] != 0]
        tag = rows[:, _KEY_WORDS]
        count = self.count
        self.__init__(max(self.bits + 1, (4 * need).bit_length()))
        self.find_or_add(rows[:, :_KEY_WORDS], (tag >> np.uint64(32)).astype(np.int64), 0,
                         (tag & np.uint64(0xFFFFFFFF)).astype(np.int64) - 1)
        assert self.count == count


class _Misaligned(Exception):
    """The tokens of joined pieces did not end where the pieces end."""


class _Memo:
    """Pieces and their token ids: short pieces in a numpy hash table, long ones in a dict,
    both to a slot; the ids of all slots in one array."""

    def __init__(self, max_pieces: int, max_ids: int):
        self.max_pieces, self.max_ids = max_pieces, max_ids
        # Twice the pieces it may hold, so that probes stay short.
        self.table_bits = max(10, (2 * max_pieces).bit_length())
        self.reset()

    def reset(self) -> None:
        """Forget every piece."""
        self.short = _KeyTable(self.table_bits)  # packed short piece -> slot
        self.long: dict[bytes, int] = {}  # longer piece -> slot
        self.starts = np.zeros(1 << 16, dtype=np.int64)  # slot -> first id in self.ids
        self.lens = np.zeros(1 << 16, dtype=np.int64)  # slot -> number of ids
        self.ids = np.zeros(1 << 20, dtype=np.int32)
        self.slots, self.fill = 0, 0

    def full(self) -> bool:
        """Past its bounds (checked before a lookup, so that slots stay valid while used)."""
        return self.slots > self.max_pieces or self.fill > self.max_ids

    def lookup(self, data: bytes, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Slot of each piece ``data[starts[i]:ends[i]]``, and the pieces new to the memo
        (in slot order), which have no ids yet: :meth:`add` them before the next lookup."""
        lens = ends - starts
        slots = np.empty(len(starts), dtype=np.int64)
        short = np.flatnonzero(lens <= _SHORT)
        found, added = self.short.find_or_add(_pack(data, starts[short], lens[short]), lens[short], self.slots)
        slots[short] = found
        at = short[added]
        new = [data[s:e].decode("utf-8") for s, e in zip(starts[at].tolist(), ends[at].tolist(), strict=True)]
        longs = np.flatnonzero(lens > _SHORT)
        if len(longs):
            table, got = self.long, []
            for s, e in zip(starts[longs].tolist(), ends[longs].tolist(), strict=True):
                key = data[s:e]
                slot = table.get(key)
                if slot is None:
                    slot = table[key] = self.slots + len(new)
                    new.append(key.decode("utf-8"))
                got.append(slot)
            slots[longs] = got
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
        added = tok.get_added_tokens_decoder()  # id -> AddedToken
        # Longest first: the tokenizer matches the leftmost longest added token.
        either = "|".join(map(re.escape, sorted((t.content for t in added.values()), key=len, reverse=True)))
        self.added = re.compile(either) if added else None
        self.added_split = re.compile(f"({either})") if added else None
        self.added_ids = {t.content: i for i, t in added.items()}
        # The tokenizer splits added tokens out of a text first and encodes the text between
        # them on its own, so a document holding one is encoded in pieces too, unless an
        # added token strips or binds its neighbours (or is not special: those are matched
        # in a second pass); then that document goes whole to the batch encoder.
        self.split_added = all(t.special and not (t.lstrip or t.rstrip or t.single_word) for t in added.values())
        self.pieces = _Memo(max_pieces, max_ids)
        self.pieces_seen = 0  # pieces looked up
        self.pieces_encoded = 0  # pieces sent to the tokenizer

    def encode(self, docs: list) -> np.ndarray:
        """Ids of ``docs`` (strings, and ``None`` for an end-of-text token) as one integer array."""
        out, run = [], []
        for d in docs:
            if d is not None and self.added is not None and self.added.search(d):
                if self.split_added:
                    parts = self.added_split.split(d)  # text, token, text, ..., text
                    run += [self.added_ids[s] if i % 2 else s for i, s in enumerate(parts)]
                    continue
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
        # docs: texts, None (an end-of-text token) and ids of added tokens.
        texts = [d.encode("utf-8") for d in docs if isinstance(d, str)]
        data = b"".join(texts)
        sizes = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        doc_ends = np.cumsum(sizes)
        doc_starts = doc_ends - sizes
        starts = piece_starts(data, doc_starts[doc_starts < len(data)])
        ends = np.append(starts[1:], len(data))
        self.pieces_seen += len(starts)
        # Pieces in blocks of about _BLOCK_BYTES, which bounds the memory of the arrays per piece.
        bounds = [*np.unique(np.searchsorted(starts, np.arange(0, len(data), _BLOCK_BYTES))).tolist(), len(starts)]
        parts, counts = [], []
        for lo, hi in itertools.pairwise(bounds):
            memo = self.pieces
            if memo.full():
                memo.reset()
            slots, new = memo.lookup(data, starts[lo:hi], ends[lo:hi])
            if new:
                try:
                    self._learn_pieces(new)
                except _Misaligned:
                    memo.reset()
                    return self.batch.encode(docs)
            ids, n = memo.expand(slots)
            parts.append(ids)
            counts.append(n)
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        # Each token between the texts after the tokens of the pieces before it.
        is_text = [isinstance(d, str) for d in docs]
        ended = np.cumsum(is_text)[np.logical_not(is_text)]
        if len(ended):
            before = np.searchsorted(starts, np.concatenate([[0], doc_ends])[ended], side="left")
            token_at = np.concatenate([[0], np.cumsum(np.concatenate(counts))]) if counts else np.zeros(1, dtype=np.int64)
            marks = [self.eot if d is None else d for d, s in zip(docs, is_text, strict=True) if not s]
            ids = np.insert(ids, token_at[before], marks)
        return ids

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
