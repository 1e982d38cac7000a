"""A tiny GPT run on the test corpus (tests/data_setup.py), shared by the training tests."""
import contextlib
import os
import sys

import pytest
import torch

from tests.data_setup import ROOT, bpe_dir, corpus_file


@contextlib.contextmanager
def one_thread():
    """Run the block on one torch thread, like each spawned rank: the tiny model runs
    several times faster that way on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def bpe_flags(*extra) -> list:
    """--vocab-file and --merge-file of the test vocabulary (8000 entries)."""
    bpe = bpe_dir()
    return ["--vocab-file", str(bpe / "vocab.json"), "--merge-file", str(bpe / "merges.txt"),
            *extra]


def preprocess_wiki(out_dir, docs=None) -> str:
    """Preprocess the test corpus (WikiText's validation articles, or the built one; its
    first `docs` articles when given) with the test vocabulary; returns the data prefix."""
    sys.path.insert(0, str(ROOT))
    from tools import preprocess_data
    prefix = os.path.join(str(out_dir), "wiki")
    source = corpus_file()
    if docs is not None:
        source = os.path.join(str(out_dir), "corpus.jsonl")
        with open(corpus_file()) as full, open(source, "w") as part:
            part.writelines(line for _, line in zip(range(docs), full))
    if not os.path.exists(prefix + "_text_document.idx"):
        status = preprocess_data.main([
            "--input", str(source), "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
            *bpe_flags("--append-eod", "--workers", "1", "--log-interval", "100000")])
        assert status == 0, f"preprocessing failed with status {status}"
    return prefix + "_text_document"


def wiki_workdir(name: str, docs=None):
    """A module fixture `workdir`: (the data prefix of preprocess_wiki, the directory) in a
    fresh temporary directory `name`, shared by the module's tests."""
    @pytest.fixture(scope="module")
    def workdir(tmp_path_factory):
        out = tmp_path_factory.mktemp(name)
        return preprocess_wiki(out, docs=docs), out
    return workdir


def tiny_gpt_argv(data_prefix, cache_dir, *extra, layers=4, hidden=64, heads=4, seq=32,
                  mbs=2, gbs=8, iters=10):
    """Flags of a small deterministic run (dropout 0, CPU initialisation)."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(iters),
        "--lr", "1e-3", "--lr-warmup-fraction", "0.1", "--data-path", str(data_prefix),
        "--split", "949,50,1", "--tokenizer-type", "GPT2BPETokenizer", *bpe_flags(),
        "--make-vocab-size-divisible-by", "16", "--log-interval", "1", "--eval-interval", "1000",
        "--eval-iters", "1", "--num-workers", "0", "--data-cache-path", str(cache_dir),
        "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization",
        "--seed", "1234", *extra]


def losses(state):
    """lm losses per iteration from a TrainState (last pipeline stage)."""
    return [h["lm loss"] for h in state.history]


def assert_exits_2_with_one_line(capsys, call, words) -> None:
    """`call()` exits 2 with one line on stderr that holds every one of `words`."""
    import pytest
    with pytest.raises(SystemExit) as exc:
        call()
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, (word, err)
