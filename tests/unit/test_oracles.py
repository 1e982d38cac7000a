"""The test harness itself: oracles skip or fail by the CI setting and are counted in one
line (tests/oracles.py); a clone without ../shared builds its corpus and vocabulary
(tests/data_setup.py), once, however many processes ask."""
import json
import multiprocessing

import pytest

from tests import data_setup, oracles


@pytest.fixture
def fake_oracles(monkeypatch):
    """Two peers, one present and one absent, in place of the real registry."""
    fakes = {"here": oracles.Oracle("Here", "here-dist", "pip install here", lambda: "/bin/here"),
             "gone": oracles.Oracle("Gone", "gone-dist", "pip install gone", lambda: None)}
    monkeypatch.setattr(oracles, "ORACLES", fakes)
    monkeypatch.setattr(oracles, "ASKED", {name: {} for name in fakes})
    monkeypatch.setattr(oracles, "SKIPPED", {"t::b", "t::d"})
    oracles.found.cache_clear()
    yield
    oracles.found.cache_clear()


def test_an_absent_oracle_skips_or_fails_under_ci(fake_oracles, monkeypatch):
    monkeypatch.delenv(oracles.STRICT_ENV, raising=False)
    assert oracles.require("here", "t::a") == "/bin/here"
    assert oracles.require("here", "t::d") == "/bin/here"  # then skipped for another reason
    with pytest.raises(pytest.skip.Exception, match=r"Gone is not installed \(pip install gone\)"):
        oracles.require("gone", "t::b")
    monkeypatch.setenv(oracles.STRICT_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"Gone is not installed.*lets no oracle skip"):
        oracles.require("gone", "t::c")
    assert oracles.summary() == \
        "oracles ran (tests): Here (1); NOT INSTALLED (tests that asked): Gone (2)"
    with pytest.raises(KeyError, match="unknown oracle 'nope'"):
        oracles.needs("nope")


def test_the_check_names_each_missing_oracle_in_one_line(fake_oracles, capsys):
    assert oracles.main() == 1
    captured = capsys.readouterr()
    assert captured.err == "oracles not installed: Gone (pip install gone)\n"
    assert oracles.summary() == "oracles ran (tests): none; ran in no test: Here, Gone"


def _build(queue):
    data_setup.built.cache_clear()
    queue.put(str(data_setup.built()))


def test_the_built_corpus_and_vocabularies(tmp_path, monkeypatch):
    """Two processes asking at once get one complete build; it is what the tests assume
    of bpe-8k (8000 entries, <|endoftext|> id 0) and of WikiText's articles."""
    from megatron.tokenizer import build_tokenizer
    monkeypatch.setenv("MEGATRON_TEST_DATA_CACHE", str(tmp_path))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_build, args=(queue,)) for _ in range(2)]
    for proc in procs:
        proc.start()
    paths = {queue.get(timeout=300) for _ in procs}
    for proc in procs:
        proc.join()
    assert len(paths) == 1 and [p.name for p in tmp_path.iterdir()] == [data_setup._key()]
    built = tmp_path / data_setup._key()
    for name, size in (("bpe-8k", 8000), ("bpe-5k", 5000)):
        tok = build_tokenizer("GPT2BPETokenizer", str(built / name / "vocab.json"),
                              str(built / name / "merges.txt"))
        assert (tok.vocab_size, tok.eod) == (size, 0)
    articles = [json.loads(line)["text"] for line in open(built / "corpus.jsonl")]
    assert 40 <= len(articles) <= 80 and 0.9e6 < sum(map(len, articles)) < 1.3e6
    assert tok.detokenize(tok.tokenize(articles[0])) == articles[0]
