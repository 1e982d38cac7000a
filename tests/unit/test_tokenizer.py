"""Tokenizers: GPT-2 BPE matches the `tokenizers` package id for id; the others' semantics."""
import json
import os
import random

import pytest
import regex

from megatron.tokenizer import (build_tokenizer, ByteLevelTokenizer, GPT2BPETokenizer,
                                NullTokenizer, padded_vocab_size)
from megatron.tokenizer.gpt2_bpe import bytes_to_unicode, WHITESPACE
from megatron.tokenizer.unicode_tables import LETTERS, NUMBERS
from tests.data_setup import bpe_dir, reference_file

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCABS = {  # name: (vocab.json, merges.txt, eod) of the tests' BPE, Megatron-DeepSpeed's
    "bpe-8k": (lambda: (bpe_dir() / "vocab.json", bpe_dir() / "merges.txt"), 0),
    "gpt2-tiny": (lambda: (reference_file("gpt2-tiny", "gpt2-tiny-vocab.json"),
                           reference_file("gpt2-tiny", "gpt2-tiny-merges.txt")), 4999),
}

UNICODE_SAMPLE = (
    "Héllo wörld! Ça va? naïve café, Ångström, straße, ñandú.\n"
    "中文字符和日本語のテキスト、한국어 문장。\n"
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 and ✓ ★.\n"
    "Whitespace:   three spaces,\ttab,\t\ttwo tabs, \n\n\n newlines,  \r\n CRLF, "
    "\u00a0nbsp, \u3000ideographic, trailing   \n"
    "Digits: 0 12 345 6789 3.14159 1,000,000 ١٢٣ ½ Ⅻ ²\n"
    "Contractions: it's don't we're they've I'm you'll he'd IT'S Don'T 'twas ''quoted''\n"
    "Symbols: @-@ <unk> <|endoftext|> --- ... !!! ??? $100 #tag ~/path\\file\n"
    "Combining: e\u0301 a\u0308 \u0915\u094d\u0937 \x00\x1f\x7f end"
)


def hf_tokenizer(vocab_path, merges_path):
    """The reference: `tokenizers` byte-level BPE from the same files."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module", params=sorted(VOCABS))
def pair(request):
    """(our tokenizer, reference tokenizer, expected eod) for one vocabulary."""
    files, eod = VOCABS[request.param]
    vocab, merges = files()
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    return ours, hf_tokenizer(vocab, merges), eod


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(50304, 128, 1) == 50304
    assert padded_vocab_size(1, 1, 1) == 1
    with pytest.raises(ValueError, match="tensor-model-parallel-size"):
        padded_vocab_size(100, 128, 0)


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="'Nope'.*GPT2BPETokenizer.*NullTokenizer"):
        build_tokenizer("Nope")
    with pytest.raises(ValueError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer")
    missing = tmp_path / "vocab.json"
    with pytest.raises(FileNotFoundError, match=f"--vocab-file.*{missing}"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(missing), merge_file="x")
    missing.write_text(json.dumps({"a": 0, "<|endoftext|>": 1}))
    with pytest.raises(FileNotFoundError, match="--merge-file.*nomerges"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(missing),
                        merge_file=str(tmp_path / "nomerges"))


def test_bad_vocabulary_files(tmp_path):
    vocab, merges = tmp_path / "v.json", tmp_path / "m.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    merges.write_text("#version: 0.2\na b\n")
    with pytest.raises(ValueError, match="<|endoftext|>"):
        GPT2BPETokenizer(vocab, merges)
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    merges.write_text("#version: 0.2\na b\nthree parts here\n")
    with pytest.raises(ValueError, match=r"m.txt:3"):
        GPT2BPETokenizer(vocab, merges)
    merges.write_text("a c\n")
    with pytest.raises(ValueError, match="'c'.*not in the vocabulary"):
        GPT2BPETokenizer(vocab, merges)


def test_eod_id(pair):
    ours, _, eod = pair
    assert ours.eod == eod
    assert ours.vocab["<|endoftext|>"] == eod
    assert ours.inv_vocab[eod] == "<|endoftext|>"


def test_wikitext_test_split_matches_reference(pair):
    ours, ref, _ = pair
    text = reference_file("wikitext", "wiki.test.tokens").read_text(encoding="utf-8")
    ids = ours.tokenize(text)
    assert ids == ref.encode(text).ids
    assert ours.detokenize(ids) == text
    assert ours.tokenize(text) == ids  # again, now from the cache


def test_unicode_sample_matches_reference(pair):
    ours, ref, _ = pair
    ids = ours.tokenize(UNICODE_SAMPLE)
    assert ids == ref.encode(UNICODE_SAMPLE).ids
    assert ours.detokenize(ids) == UNICODE_SAMPLE
    for line in UNICODE_SAMPLE.splitlines(keepends=True):
        assert ours.tokenize(line) == ref.encode(line).ids, repr(line)


def test_random_unicode_matches_reference(pair):
    ours, ref, _ = pair
    rng = random.Random(1234)
    atoms = list(" \t\n\r\x0b\x0c\x1c\x85\xa0\u2009\u2028\u3000") + [
        "  ", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'", "é", "中", "😀", "1", "٣",
        "a", "Z", "the", " of", ",", ".", "@-@", "\u0301", "\ufeff", "\U00010400"]
    for _ in range(1500):
        pieces = [rng.choice(atoms) if rng.random() < 0.75 else chr(rng.randint(0, 0x2FFFF))
                  for _ in range(rng.randint(1, 14))]
        text = "".join(p for p in pieces if not 0xD800 <= ord(p[0]) <= 0xDFFF)
        assert ours.tokenize(text) == ref.encode(text).ids, repr(text)


def test_decode_matches_reference(pair):
    ours, ref, _ = pair
    rng = random.Random(7)
    for _ in range(500):  # arbitrary id sequences, incl. invalid UTF-8 byte runs
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 8))]
        assert ours.detokenize(ids) == ref.decode(ids), ids


def test_whitespace_class_is_regex_whitespace():
    """The split fast path spells out `regex`'s \\s; it must be exactly that set."""
    everything = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    expected = "".join(regex.findall(r"\s", everything))
    spelled = "".join(regex.findall(f"[{WHITESPACE}]", everything))
    assert spelled == expected


def write_vocab(tmp_path, tokens, merges):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({t: i for i, t in enumerate(tokens)}), encoding="utf-8")
    merge_file = tmp_path / "merges.txt"
    merge_file.write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges), encoding="utf-8")
    return vocab, merge_file


def test_merge_order_and_unknown_chars_follow_reference(tmp_path):
    # "aa a" outranks "a a": merging lowest rank first (as `tokenizers` does) turns
    # "aaaa" into [aaa, a]; GPT-2's merge-every-occurrence loop would give [aa, aa].
    vocab, merges = write_vocab(tmp_path, ["a", "aa", "aaa", "b", "Ġ", "<|endoftext|>"],
                                ["aa a", "a a"])
    ours, ref = GPT2BPETokenizer(vocab, merges), hf_tokenizer(vocab, merges)
    for text in ["aaaa", "aaaaa", "ab aaa", "a\u00e9a", "xyz", "", "  a", "aaaaaaaaa b"]:
        assert ours.tokenize(text) == ref.encode(text).ids, repr(text)
    assert ours.tokenize("aaaa") == [2, 0]
    assert ours.tokenize("axa") == [1]  # 'x' is unknown: dropped, neighbours merge


def test_small_cache_still_correct():
    vocab, merges = bpe_dir() / "vocab.json", bpe_dir() / "merges.txt"
    ours, ref = GPT2BPETokenizer(vocab, merges, cache_size=5), hf_tokenizer(vocab, merges)
    for _ in range(2):
        assert ours.tokenize(UNICODE_SAMPLE) == ref.encode(UNICODE_SAMPLE).ids


def _code_points_regex_classifies_otherwise():
    ours = regex.compile(f"[{LETTERS}]|[{NUMBERS}]")
    theirs = regex.compile(r"[\p{L}\p{N}]")
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    mine = {m.start() for m in ours.finditer(text)}
    other = {m.start() for m in theirs.finditer(text)}
    return sorted(ord(text[i]) for i in mine ^ other)


def test_pretokenization_matches_reference_per_code_point(pair):
    """Character classes agree with `tokenizers`, also on the code points where the
    installed `regex` release's Unicode version disagrees with our Unicode 16 tables."""
    ours, ref, _ = pair
    code_points = _code_points_regex_classifies_otherwise()
    rng = random.Random(3)
    code_points += [rng.randrange(0x110000) for _ in range(3000)]
    table = bytes_to_unicode()
    for cp in code_points:
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        text = f"a{c}a 1{c}1 {c}{c} x{c}'s{c} {c}"
        mapped = ["".join(table[b] for b in w.encode("utf-8")) for w in ours.pretokenize(text)]
        assert mapped == [w for w, _ in ref.pre_tokenizer.pre_tokenize_str(text)], hex(cp)


def test_bytes_to_unicode_is_a_bijection_onto_printables():
    mapping = bytes_to_unicode()
    assert sorted(mapping) == list(range(256))
    assert len(set(mapping.values())) == 256
    assert all(ch.isprintable() and not ch.isspace() for ch in mapping.values())
    assert mapping[ord("A")] == "A" and mapping[ord(" ")] == "\u0120"


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tok, NullTokenizer)
    assert tok.vocab_size == 101 and tok.eod == 100
    assert tok.tokenize("5 17  3\n99") == [5, 17, 3, 99]
    assert tok.detokenize([5, 17, 100]) == "5 17 100"
    with pytest.raises(ValueError, match="'x1' is not an integer"):
        tok.tokenize("1 x1")
    with pytest.raises(ValueError, match="outside 0..100"):
        tok.tokenize("101")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")


def test_byte_level_tokenizer():
    tok = build_tokenizer("ByteLevelTokenizer")
    assert isinstance(tok, ByteLevelTokenizer)
    assert tok.vocab_size == 257 and tok.eod == 256
    text = "héllo 😀\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod]) == text
    assert len(tok.vocab) == 257 and tok.vocab["<|endoftext|>"] == 256


def test_pretrained_from_hf_errors(tmp_path):
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="transformers"):
            build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path))
    else:
        with pytest.raises(FileNotFoundError, match="--tokenizer-name-or-path"):
            build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--tokenizer-name-or-path"):
        build_tokenizer("PretrainedFromHF")
