"""GPT-2 byte-level BPE, reading GPT-2's ``vocab.json`` + ``merges.txt``.

Encoding follows the GPT-2 recipe: split the text with GPT-2's pre-tokenisation
regex, map each word's UTF-8 bytes to printable characters (``bytes_to_unicode``),
then apply the BPE merges. The merge order reproduces the ``tokenizers``
package exactly: the lowest-ranked mergeable pair is merged first, ties going to
the leftmost pair; characters missing from the vocabulary are dropped.

Speed: a space followed by a non-space character always starts a new
pre-token, so the text is first cut before each such space (a fast stdlib
``re`` split) into pieces that encode independently. Each piece is looked up in
a cache, in C (``map``), and only unseen pieces go through the GPT-2 regex and
the (also cached) per-word BPE.
"""
import heapq
import itertools
import json
import os
import re
from typing import Dict, List, Sequence, Tuple

import regex

from megatron.tokenizer.abstract import AbstractTokenizer
from megatron.tokenizer.unicode_tables import LETTERS, NUMBERS

EOD_TOKEN = "<|endoftext|>"

# The characters the `regex` package's \s matches (Unicode White_Space); the
# stdlib's \s differs (it adds \x1c-\x1f), so the set is spelled out.
WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# GPT-2's pre-tokenisation: contractions, letters, numbers, other symbols (each
# optionally led by one space), then whitespace runs. Letters and numbers are
# Unicode 16.0's, spelled out (see unicode_tables.py), as `tokenizers` has them.
_LETTER, _NUMBER = f"[{LETTERS}]", f"[{NUMBERS}]"
PRETOKENIZE_PATTERN = (f"'s|'t|'re|'ve|'m|'ll|'d| ?{_LETTER}+| ?{_NUMBER}+"
                       f"| ?[^{WHITESPACE}{LETTERS}{NUMBERS}]+"
                       f"|[{WHITESPACE}]+(?![^{WHITESPACE}])|[{WHITESPACE}]+")

# Zero-width cut before every space that is followed by a non-space: such a
# space always begins a pre-token, so the pieces between cuts encode alone.
PIECE_SPLIT = re.compile(f"(?= [^{WHITESPACE}])")

MergeMap = Dict[Tuple[int, int], Tuple[int, int]]


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's map from each byte value to a printable, non-space character.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to
    code points 256, 257, ... in byte order.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(mapping.items()))


def _check_file(path, flag: str) -> str:
    if path is None:
        raise ValueError(f"GPT2BPETokenizer needs {flag} (a GPT-2 format file)")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag}: file not found: {path}")
    return path


def load_vocab(path: str) -> Dict[str, int]:
    """Read a GPT-2 ``vocab.json`` (token -> id)."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"--vocab-file {path}: not a JSON token->id map ({exc})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"--vocab-file {path}: expected a JSON object of token -> integer id")
    return vocab


def load_merges(path: str) -> List[Tuple[str, str]]:
    """Read a GPT-2 ``merges.txt``: one ``left right`` pair per line, best first.

    Lines starting with ``#version`` are skipped (as ``tokenizers`` does).
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"--merge-file {path}: not a UTF-8 text file of merges (byte "
                         f"{exc.start}: {exc.reason}); pass the merges.txt that goes with "
                         f"--vocab-file") from None
    if lines and lines[-1] == "":
        lines.pop()
    merges = []
    for lineno, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if line.startswith("#version"):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise ValueError(f"--merge-file {path}:{lineno}: expected 'left right', got {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def build_merge_map(vocab: Dict[str, int], merges: List[Tuple[str, str]],
                    merge_file: str = "merges") -> MergeMap:
    """(left id, right id) -> (rank, merged id); a later duplicate pair wins."""
    merge_map = {}
    for rank, (left, right) in enumerate(merges):
        try:
            key = (vocab[left], vocab[right])
            merge_map[key] = (rank, vocab[left + right])
        except KeyError as exc:
            raise ValueError(f"--merge-file {merge_file}: merge {left!r} {right!r} uses "
                             f"{exc.args[0]!r}, which is not in the vocabulary") from None
    return merge_map


def bpe_merge(ids: List[int], merges: MergeMap) -> List[int]:
    """Apply BPE merges to a list of symbol ids, lowest rank (then leftmost) first."""
    n = len(ids)
    if n < 2:
        return ids
    ids = list(ids)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        m = merges.get((ids[i], ids[i + 1]))
        if m is not None:
            heap.append((m[0], i, m[1]))
    heapq.heapify(heap)
    while heap:
        _, pos, new_id = heapq.heappop(heap)
        right = nxt[pos]
        if not alive[pos] or right == -1:
            continue
        m = merges.get((ids[pos], ids[right]))
        if m is None or m[1] != new_id:
            continue  # stale entry: the pair changed since it was queued
        ids[pos] = new_id
        alive[right] = False
        after = nxt[right]
        nxt[pos] = after
        if after != -1:
            prv[after] = pos
        before = prv[pos]
        if before != -1:
            m = merges.get((ids[before], new_id))
            if m is not None:
                heapq.heappush(heap, (m[0], before, m[1]))
        if after != -1:
            m = merges.get((new_id, ids[after]))
            if m is not None:
                heapq.heappush(heap, (m[0], pos, m[1]))
    return [t for t, keep in zip(ids, alive) if keep]


class GPT2BPETokenizer(AbstractTokenizer):
    """GPT-2 byte-level BPE from a ``vocab.json`` and a ``merges.txt``.

    ``<|endoftext|>`` must be in the vocabulary (at any id); it is ``eod``.
    ``cache_size`` bounds each of the two caches (pieces, words); a full one is emptied.
    """

    def __init__(self, vocab_file, merge_file, cache_size: int = 1 << 19):
        super().__init__("GPT2 BPE")
        vocab_file = _check_file(vocab_file, "--vocab-file")
        merge_file = _check_file(merge_file, "--merge-file")
        self._vocab = load_vocab(vocab_file)
        if EOD_TOKEN not in self._vocab:
            raise ValueError(f"--vocab-file {vocab_file}: {EOD_TOKEN} is not in the vocabulary")
        self._eod = self._vocab[EOD_TOKEN]
        self._merges = build_merge_map(self._vocab, load_merges(merge_file), merge_file)
        self._size = max(self._vocab.values()) + 1
        self._pattern = regex.compile(PRETOKENIZE_PATTERN)
        byte_map = bytes_to_unicode()
        # str.translate table: Latin-1 code point (= byte) -> GPT-2 character.
        self._byte_table = {b: ch for b, ch in byte_map.items()}
        self._id_bytes = self._build_id_bytes(byte_map)
        self._cache: Dict[str, Tuple[int, ...]] = {}  # piece -> ids
        self._word_cache: Dict[str, Tuple[int, ...]] = {}  # pre-token -> ids
        self._cache_size = cache_size

    def _build_id_bytes(self, byte_map: Dict[int, str]) -> List[bytes]:
        """Bytes of each id for decoding (a token with unmapped chars gives its UTF-8)."""
        char_to_byte = {ch: b for b, ch in byte_map.items()}
        id_bytes = [b""] * self._size
        for token, idx in self._vocab.items():
            try:
                id_bytes[idx] = bytes(char_to_byte[ch] for ch in token)
            except KeyError:
                id_bytes[idx] = token.encode("utf-8")
        return id_bytes

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def eod(self) -> int:
        return self._eod

    def pretokenize(self, text: str) -> List[str]:
        """GPT-2's pre-tokens of ``text`` (before the byte map and BPE)."""
        return self._pattern.findall(text)

    def encode_word(self, word: str) -> Tuple[int, ...]:
        """BPE ids of one pre-tokenised word (uncached)."""
        mapped = word.encode("utf-8").decode("latin-1").translate(self._byte_table)
        vocab = self._vocab
        ids = [vocab[ch] for ch in mapped if ch in vocab]
        return tuple(bpe_merge(ids, self._merges))

    def encode_piece(self, piece: str) -> Tuple[int, ...]:
        """Ids of a piece of text (regex pre-tokenisation, per-word cache)."""
        cache = self._word_cache
        ids: List[int] = []
        for word in self._pattern.findall(piece):
            word_ids = cache.get(word)
            if word_ids is None:
                word_ids = cache[word] = self.encode_word(word)
            ids.extend(word_ids)
        return tuple(ids)

    def tokenize(self, text: str) -> List[int]:
        cache = self._cache
        if len(cache) > self._cache_size:
            cache.clear()
        if len(self._word_cache) > self._cache_size:
            self._word_cache.clear()
        pieces = PIECE_SPLIT.split(text)
        found = list(map(cache.get, pieces))
        if None in found:
            for i, ids in enumerate(found):
                if ids is None:
                    piece = pieces[i]
                    ids = cache.get(piece)
                    if ids is None:
                        ids = cache[piece] = self.encode_piece(piece)
                    found[i] = ids
        return list(itertools.chain.from_iterable(found))

    def detokenize(self, ids: Sequence[int]) -> str:
        id_bytes = self._id_bytes
        size = self._size
        data = b"".join([id_bytes[i] for i in ids if 0 <= i < size])
        return data.decode("utf-8", errors="replace")
