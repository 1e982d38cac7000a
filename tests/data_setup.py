"""What the tests train on, and the reference files some of them compare against.

The corpus and the byte-level BPE vocabulary come from ../shared/data when it is there
(MEGATRON_SHARED_DATA names another place): the WikiText validation articles
(wikitext/wiki.valid.jsonl) and bpe-8k. A user's clone has no ../shared, so the tests then
build their own as the quick start does: the standard library's text
(tools/stdlib_corpus.py), joined into articles of about WikiText's size, and a byte-level
BPE of bpe-8k's size trained on it (tools/train_tokenizer.py). They are built in a few
seconds, once per machine, into a cache keyed by what they are made from
(~/.cache/megatron-gpt/test-data, or MEGATRON_TEST_DATA_CACHE): under a temporary name,
then renamed, so tests and spawned ranks that ask at once never see half a build. A second
vocabulary (5000 entries, same corpus) is always built, for tests that need two.

Only comparisons against the reference files themselves (WikiText numbers, Megatron's
fixtures) skip when ../shared/data is absent, through reference_file(), saying why.
"""
import contextlib
import functools
import hashlib
import importlib.metadata
import io
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", ROOT.parent / "shared" / "data"))
VOCAB_SIZE = 8000  # bpe-8k's, which the tests' shapes assume
OTHER_VOCAB_SIZE = 5000
CORPUS_MB = 1.1  # wiki.valid.jsonl: 60 articles, 1.1 MB
ARTICLE_CHARS = 10000  # texts are joined up to at least this: ~60 articles, as WikiText
TOOLS = ("stdlib_corpus.py", "train_tokenizer.py")


def reference_file(*parts) -> Path:
    """Path of a reference file in ../shared/data; skips the test when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"compares with the reference file {path}, which is absent "
                    "(../shared/data; MEGATRON_SHARED_DATA)")
    return path


def corpus_file() -> Path:
    """Loose JSON articles, {"text": ...} per line: WikiText's or the built one."""
    wiki = SHARED_DATA / "wikitext" / "wiki.valid.jsonl"
    return wiki if wiki.is_file() else built() / "corpus.jsonl"


def bpe_dir() -> Path:
    """A directory with a GPT-2-format vocab.json (8000 entries, <|endoftext|> id 0) and
    merges.txt: bpe-8k or the built one."""
    shared = SHARED_DATA / "bpe-8k"
    return shared if (shared / "vocab.json").is_file() else built() / "bpe-8k"


def other_bpe_dir() -> Path:
    """A second GPT-2-format vocabulary (5000 entries), always the built one."""
    return built() / "bpe-5k"


def corpus_text(chars: int) -> str:
    """The first articles of corpus_file(), whole lines, about `chars` characters."""
    out, size = [], 0
    with open(corpus_file(), encoding="utf-8") as f:
        for line in f:
            for text_line in json.loads(line)["text"].split("\n"):
                out.append(text_line)
                size += len(text_line) + 1
                if size >= chars:
                    return "\n".join(out) + "\n"
    return "\n".join(out) + "\n"


def _key() -> str:
    """What the built files are made of: the tools, this Python's standard library, the
    `tokenizers` release and the sizes."""
    digest = hashlib.sha256(repr((sys.version, importlib.metadata.version("tokenizers"),
                                  VOCAB_SIZE, OTHER_VOCAB_SIZE, CORPUS_MB, ARTICLE_CHARS)).encode())
    for tool in TOOLS:
        digest.update((ROOT / "tools" / tool).read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def built() -> Path:
    """The cache directory holding corpus.jsonl, bpe-8k/ and bpe-5k/, built if absent."""
    cache = Path(os.environ.get("MEGATRON_TEST_DATA_CACHE")
                 or Path.home() / ".cache" / "megatron-gpt" / "test-data")
    final = cache / _key()
    if (final / "bpe-5k" / "merges.txt").is_file():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
    try:
        _quietly(_build, tmp)
        os.rename(tmp, final)
    except OSError:
        if not (final / "bpe-5k" / "merges.txt").is_file():  # not another process's build
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _quietly(build, out: Path) -> None:
    """Runs build(out) with the tools' progress lines kept out of the output of the test that
    first asked for the data (tests compare what a command printed); shown if it fails."""
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            build(out)
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise


def _build(out: Path) -> None:
    from tools import stdlib_corpus, train_tokenizer
    texts = out / "texts.jsonl"
    assert stdlib_corpus.main(["--output", str(texts), "--max-mb", str(CORPUS_MB)]) == 0
    articles, current = [], []
    with open(texts, encoding="utf-8") as f:
        for line in f:
            current.append(json.loads(line)["text"])
            if sum(map(len, current)) >= ARTICLE_CHARS:
                articles.append("\n\n".join(current))
                current = []
    articles += ["\n\n".join(current)] if current else []
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": a}) + "\n" for a in articles)
    texts.unlink()
    for name, size in (("bpe-8k", VOCAB_SIZE), ("bpe-5k", OTHER_VOCAB_SIZE)):
        assert train_tokenizer.main(["--input", str(out / "corpus.jsonl"), "--vocab-size",
                                     str(size), "--output-dir", str(out / name)]) == 0
