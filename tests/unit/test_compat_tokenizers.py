"""Tokenizers users have (issue 11, deliverable 4): Megatron-LM's SentencePiece family with
--tokenizer-model (a model trained here, in-process), Llama3Tokenizer on a local tiktoken
BPE file, HuggingFaceTokenizer on a local directory. Each preprocesses identically with
any --workers, trains, samples and builds through tasks' tokenizer set-up."""
import base64
import io
import json
import shutil
from pathlib import Path

import pytest

import pretrain_gpt
from megatron.arguments import parse_args
from megatron.tokenizer import build_tokenizer
from megatron.training.checkpoint_setup import build_tokenizer_and_vocab
from tests import oracles
from tests.data_setup import bpe_dir
from tests.gpt_setup import one_thread
from tools import generate_samples_gpt, preprocess_data

spm = pytest.importorskip("sentencepiece")
SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Pack my box with five dozen liquor jugs.",
             "How vexingly quick daft zebras jump!",
             "Sphinx of black quartz, judge my vow."]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SENTENCES * 20), model_writer=buffer,
                                   vocab_size=60, model_type="bpe", minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(buffer.getvalue())
    return str(path)


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"qu", b"ic", b"ick"]
    path = tmp_path_factory.mktemp("tik") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(SENTENCES[i % 4:] + SENTENCES[:i % 4])})
                            + "\n" for i in range(40)))
    return path


def test_sentencepiece_family_follows_megatron(sp_model):
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    text = "The quick fox judges my box."
    plain = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model)
    assert plain.tokenize(text) == sp.encode_as_ids(text) and plain.eod == sp.eos_id()
    assert plain.vocab_size == sp.get_piece_size() and plain.detokenize(plain.tokenize(text)) == text
    llama2 = build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model)
    assert llama2.tokenize(text) == [sp.bos_id()] + sp.encode_as_ids(text)
    assert llama2.eod == sp.eos_id()
    megatron = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    size = sp.get_piece_size()  # <CLS> <SEP> <EOD> <MASK> <PAD> appended (bos/eos exist)
    assert megatron.vocab_size == size + 5 and megatron.eod == size + 2
    ids = megatron.tokenize("The fox<EOD>my box")
    assert ids == sp.encode_as_ids("The fox") + [size + 2] + sp.encode_as_ids("my box")
    assert megatron.detokenize(ids) == "The fox<EOD>my box"
    with pytest.raises(ValueError, match="--tokenizer-model"):
        build_tokenizer("Llama2Tokenizer")


def test_llama3_reads_a_local_tiktoken_file(tiktoken_file):
    tok = build_tokenizer("Llama3Tokenizer", tokenizer_model=tiktoken_file)
    assert tok.vocab_size == 262 + 256 and tok.eod == 263
    ids = tok.tokenize("the quick")
    assert ids == [262, 257, 32, 259, 261]  # <|begin_of_text|>, "the", " ", "qu", "ick"
    assert tok.detokenize(ids[1:]) == "the quick"


@oracles.needs("transformers")
def test_hugging_face_tokenizer_is_megatron_lms_name(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(bpe_dir() / "vocab.json", hf_dir / "vocab.json")
    shutil.copy(bpe_dir() / "merges.txt", hf_dir / "merges.txt")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}))
    megatron_lm = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(hf_dir))
    deepspeed = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(hf_dir))
    assert megatron_lm.tokenize("Hello world") == deepspeed.tokenize("Hello world")


def _preprocess(corpus, prefix, workers, *flags):
    argv = ["--input", str(corpus), "--output-prefix", str(prefix), "--append-eod",
            "--workers", str(workers), "--chunk-size", "3", "--log-interval", "0", *flags]
    assert preprocess_data.main(argv) == 0
    return tuple(Path(f"{prefix}_text_document.{e}").read_bytes() for e in ("bin", "idx"))


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                  "Llama2Tokenizer", "Llama3Tokenizer"])
def test_preprocessing_is_independent_of_workers(tmp_path, corpus, sp_model, tiktoken_file, kind):
    model = tiktoken_file if kind == "Llama3Tokenizer" else sp_model
    flags = ["--tokenizer-type", kind, "--tokenizer-model", model]
    assert _preprocess(corpus, tmp_path / "one", 1, *flags) == \
        _preprocess(corpus, tmp_path / "two", 2, *flags)


def test_llama2_tokenizer_trains_samples_and_sets_up_tasks(tmp_path, corpus, sp_model, capsys):
    _preprocess(corpus, tmp_path / "data", 1, "--tokenizer-type", "Llama2Tokenizer",
                "--tokenizer-model", sp_model)
    save = str(tmp_path / "ckpt")
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0",
            "--data-path", str(tmp_path / "data_text_document"), "--num-workers", "0",
            "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model,
            "--data-cache-path", str(tmp_path / "cache"), "--save", save, "--split", "1,0,0"]
    with one_thread():
        assert len(pretrain_gpt.main(argv).history) == 3
        records = generate_samples_gpt.main(["--load", save, "--prompt", "The quick",
                                             "--out-seq-length", "4", "--greedy"])
    assert records and records[0]["prompt"] == "The quick"
    # tasks/main.py builds its tokenizer from the checkpoint's stored flags the same way
    config, _ = parse_args(argv[:-4])
    assert build_tokenizer_and_vocab(config, {}).name == "Llama2Tokenizer"
