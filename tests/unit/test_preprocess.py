"""tools/: preprocess_data (Megatron byte-compatibility, workers, bad lines), merge,
train_tokenizer, inspect_dataset."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer
from tests import oracles
from tests.data_setup import ROOT, bpe_dir, corpus_file, reference_file
from tools import inspect_dataset, merge_preprocessed_data, preprocess_data, train_tokenizer

COMPAT = ("megatron-compat", "meg-gpt2-openwebtext_text_document")


def tiny_vocab():
    """Megatron-DeepSpeed's gpt2-tiny files, which its dataset fixture was tokenized with."""
    return (str(reference_file("gpt2-tiny", "gpt2-tiny-vocab.json")),
            str(reference_file("gpt2-tiny", "gpt2-tiny-merges.txt")))


def our_vocab():
    """The tests' GPT-2-format vocabulary (tests/data_setup.py)."""
    return str(bpe_dir() / "vocab.json"), str(bpe_dir() / "merges.txt")


def gpt2_flags(vocab=None):
    vocab_file, merge_file = vocab or our_vocab()
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
            "--merge-file", merge_file]


def preprocess(input_path, prefix, *flags):
    """Run the tool in-process; returns its exit status."""
    argv = ["--input", str(input_path), "--output-prefix", str(prefix), "--log-interval", "0"]
    return preprocess_data.main(argv + list(flags))


def write_jsonl(path, objects):
    path.write_text("".join(json.dumps(o) + "\n" for o in objects), encoding="utf-8")
    return path


def read_bytes(prefix):
    return tuple(Path(f"{prefix}.{ext}").read_bytes() for ext in ("bin", "idx"))


def docs_of(prefix):
    ds = MMapIndexedDataset(str(prefix))
    return [np.concatenate([ds[i] for i in range(ds.doc_idx[d], ds.doc_idx[d + 1])]).tolist()
            for d in range(len(ds.doc_idx) - 1)]


@pytest.fixture(scope="module")
def compat_jsonl(tmp_path_factory):
    """The Megatron-written dataset's documents decoded back to loose JSON."""
    prefix = str(reference_file(*COMPAT[:-1], COMPAT[-1] + ".idx"))[:-4]
    tokenizer = build_tokenizer("GPT2BPETokenizer", *tiny_vocab())
    ds = MMapIndexedDataset(prefix)
    path = tmp_path_factory.mktemp("compat") / "owt.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i in range(len(ds)):
            assert ds[i][-1] == tokenizer.eod
            f.write(json.dumps({"text": tokenizer.detokenize(ds[i][:-1].tolist())}) + "\n")
    return path, prefix


def test_reproduces_megatron_files_byte_for_byte(tmp_path, compat_jsonl):
    path, reference = compat_jsonl
    assert preprocess(path, tmp_path / "owt", *gpt2_flags(tiny_vocab()), "--append-eod") == 0
    assert read_bytes(tmp_path / "owt_text_document") == read_bytes(reference)


@oracles.needs("transformers")
def test_pretrained_from_hf_reproduces_megatron_files(tmp_path, compat_jsonl):
    """--tokenizer-type PretrainedFromHF through a real ``transformers`` tokenizer directory."""
    vocab_file, merge_file = tiny_vocab()
    hf_dir = tmp_path / "gpt2-tiny-hf"  # a Hugging Face GPT-2 tokenizer directory
    hf_dir.mkdir()
    shutil.copy(vocab_file, hf_dir / "vocab.json")
    shutil.copy(merge_file, hf_dir / "merges.txt")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
         "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    path, reference = compat_jsonl
    assert preprocess(path, tmp_path / "owt", "--tokenizer-type", "PretrainedFromHF",
                      "--tokenizer-name-or-path", str(hf_dir), "--append-eod") == 0
    assert read_bytes(tmp_path / "owt_text_document") == read_bytes(reference)
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)
    wrapped = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=str(hf_dir))
    assert (wrapped.vocab_size, wrapped.eod) == (ours.vocab_size, ours.eod) == (5000, 4999)
    ids = docs_of(reference)[0][:-1]
    assert wrapped.detokenize(ids) == ours.detokenize(ids)


def test_output_independent_of_workers(tmp_path):
    lines = corpus_file().read_text(encoding="utf-8").splitlines()
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines[:24]) + "\n", encoding="utf-8")
    outputs = []
    for workers, chunk in ((1, None), (2, 5), (2, None)):
        prefix = tmp_path / f"w{workers}c{chunk}"
        flags = ["--workers", str(workers)] + (["--chunk-size", str(chunk)] if chunk else [])
        assert preprocess(source, prefix, *gpt2_flags(), "--append-eod", *flags) == 0
        outputs.append(read_bytes(f"{prefix}_text_document"))
    assert outputs[0] == outputs[1] == outputs[2]


def test_keys_eod_and_empty_documents(tmp_path):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *our_vocab())
    rows = [{"text": "Hello world.", "title": "Greeting"}, {"text": "", "title": "Empty"},
            {"text": "Second  doc\n", "title": "", "extra": 1}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    assert preprocess(source, tmp_path / "o", *gpt2_flags(), "--json-keys", "text", "title",
                      "--append-eod") == 0
    eod = tokenizer.eod
    assert docs_of(tmp_path / "o_text_document") == [
        tokenizer.tokenize("Hello world.") + [eod], tokenizer.tokenize("Second  doc\n") + [eod]]
    assert docs_of(tmp_path / "o_title_document") == [
        tokenizer.tokenize("Greeting") + [eod], tokenizer.tokenize("Empty") + [eod]]
    assert preprocess(source, tmp_path / "n", *gpt2_flags()) == 0
    assert docs_of(tmp_path / "n_text_document")[0] == tokenizer.tokenize("Hello world.")


def test_null_tokenizer_input(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "70000"}])
    assert preprocess(source, tmp_path / "o", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "100000", "--append-eod") == 0
    ds = MMapIndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.dtype == np.int32
    assert docs_of(tmp_path / "o_text_document") == [[1, 2, 3, 100000], [70000, 100000]]


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "ok", \n', "invalid JSON"),
    (b'{"text": "ok"}\n["a list"]\n', "expected a JSON object, got list"),
    (b'{"text": "ok"}\n{"body": "no text"}\n', "missing key 'text'"),
    (b'{"text": "ok"}\n{"text": 5}\n', "key 'text' is int, not a string"),
    (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', "not valid UTF-8"),
    (b'{"text": "ok"}\n{"text": "a \\ud800 b"}\n', "key 'text' holds an unpaired surrogate"),
]


@pytest.mark.parametrize("content,reason", BAD_LINES)
def test_bad_line_is_one_clear_error_and_leaves_nothing(tmp_path, capsys, content, reason):
    source = tmp_path / "in.jsonl"
    source.write_bytes(content + b'{"text": "after"}\n')
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert preprocess(source, out_dir / "o", *gpt2_flags()) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {source}:2: {reason}"), err
    assert err.endswith(" (use --skip-bad-lines to skip such lines)") and "\n" not in err, err
    assert list(out_dir.iterdir()) == []


def test_skip_bad_lines_and_existing_output_untouched(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "one"}\nnot json\n\n{"text": "two"}\n{"x": 1}\n')
    assert preprocess(source, tmp_path / "o", *gpt2_flags(), "--skip-bad-lines") == 0
    assert "Skipped 2 malformed lines" in capsys.readouterr().err
    tokenizer = build_tokenizer("GPT2BPETokenizer", *our_vocab())
    assert docs_of(tmp_path / "o_text_document") == [tokenizer.tokenize(t) for t in ("one", "two")]
    before = read_bytes(tmp_path / "o_text_document")
    assert preprocess(source, tmp_path / "o", *gpt2_flags(), "--workers", "2") == 1
    assert read_bytes(tmp_path / "o_text_document") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl", "o_text_document.bin", "o_text_document.bin.sha256", "o_text_document.idx"]


def test_flag_errors(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    assert preprocess(tmp_path / "none.jsonl", tmp_path / "o", *gpt2_flags()) == 2
    assert "--input: file not found" in capsys.readouterr().err
    assert preprocess(source, tmp_path / "no" / "o", *gpt2_flags()) == 2
    assert "does not exist" in capsys.readouterr().err
    assert preprocess(source, tmp_path / "o", "--tokenizer-type", "GPT2BPETokenizer") == 2
    assert "--vocab-file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        preprocess(source, tmp_path / "o", *gpt2_flags(), "--dataset-impl", "lazy")
    assert info.value.code == 2
    if "nltk" not in sys.modules:
        try:
            import nltk  # noqa: F401
        except ImportError:
            assert preprocess(source, tmp_path / "o", *gpt2_flags(), "--split-sentences") == 2
            assert "needs the 'nltk' package" in capsys.readouterr().err
    assert list(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_progress_line(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(5)])
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "o"), "--log-interval",
            "2", "--chunk-size", "1"] + gpt2_flags()
    assert preprocess_data.main(argv) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("Processed")]
    assert len(lines) == 2 and lines[0].startswith("Processed 2 documents")
    assert all("MB/s" in ln and "tokens/s" in ln for ln in lines)


def test_scripts_run_from_anywhere(tmp_path):
    """`python tools/x.py` works without installing; the second name is the same tool."""
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "Script mode works."}] * 3)
    outputs = []
    for name in ("preprocess_data.py", "preprocess_data_many_cores.py"):
        prefix = tmp_path / name.split(".")[0]
        cmd = [sys.executable, str(ROOT / "tools" / name), "--input", str(source),
               "--output-prefix", str(prefix), "--workers", "2", "--append-eod"] + gpt2_flags()
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ""})
        assert done.returncode == 0, done.stderr
        outputs.append(read_bytes(f"{prefix}_text_document"))
    assert outputs[0] == outputs[1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input",
                           str(bad), "--output-prefix", str(tmp_path / "b")] + gpt2_flags(),
                          cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{bad}:1: invalid JSON" in done.stderr


def test_merge_equals_preprocessing_the_concatenation(tmp_path, capsys):
    lines = corpus_file().read_text(encoding="utf-8").splitlines()
    parts = [lines[:5], lines[5:6], lines[6:12]]
    prefixes = []
    for i, part in enumerate(parts):
        source = tmp_path / f"p{i}.jsonl"
        source.write_text("\n".join(part) + "\n", encoding="utf-8")
        assert preprocess(source, tmp_path / f"p{i}", *gpt2_flags(), "--append-eod") == 0
        prefixes.append(str(tmp_path / f"p{i}_text_document"))
    whole = tmp_path / "all.jsonl"
    whole.write_text("\n".join(lines[:12]) + "\n", encoding="utf-8")
    assert preprocess(whole, tmp_path / "all", *gpt2_flags(), "--append-eod") == 0
    merged = str(tmp_path / "merged")
    assert merge_preprocessed_data.main(["--datasets", *prefixes, "--output-prefix", merged]) == 0
    assert read_bytes(merged) == read_bytes(tmp_path / "all_text_document")
    source = write_jsonl(tmp_path / "n.jsonl", [{"text": "1 2"}])
    assert preprocess(source, tmp_path / "n", "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", "70000") == 0
    capsys.readouterr()
    assert merge_preprocessed_data.main(["--datasets", prefixes[0], str(tmp_path / "n_text_document"),
                                         "--output-prefix", str(tmp_path / "bad")]) == 1
    assert "different dtypes" in capsys.readouterr().err
    assert not list(tmp_path.glob("bad*"))


def test_train_tokenizer(tmp_path):
    lines = corpus_file().read_text(encoding="utf-8").splitlines()
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(lines[:8]) + "\n", encoding="utf-8")
    text_file = tmp_path / "more.txt"
    text_file.write_text("Plain text lines.\nCafé naïve 中文 😀\n", encoding="utf-8")
    outputs = []
    for run in ("a", "b"):
        argv = ["--input", str(source), str(text_file), "--vocab-size", "600",
                "--output-dir", str(tmp_path / run)]
        assert train_tokenizer.main(argv) == 0
        outputs.append([(tmp_path / run / name).read_bytes() for name in ("vocab.json", "merges.txt")])
    assert outputs[0] == outputs[1]  # deterministic
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(tmp_path / "a" / "vocab.json"),
                                str(tmp_path / "a" / "merges.txt"))
    assert tokenizer.vocab_size == 600 and tokenizer.eod == 0
    sample = "The lobster's claws , 24 cm — Café 中文 😀\n\tdone"
    ids = tokenizer.tokenize(sample)
    assert tokenizer.detokenize(ids) == sample
    assert len(ids) < len(sample.encode("utf-8"))  # merges were learned and used
    assert train_tokenizer.main(["--input", str(source), "--vocab-size", "100",
                                 "--output-dir", str(tmp_path / "c")]) == 1
    assert not (tmp_path / "c").exists()


def test_inspect_dataset(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "Inspect me please."}, {"text": "x"}])
    assert preprocess(source, tmp_path / "o", *gpt2_flags(), "--append-eod") == 0
    vocab, merges = our_vocab()
    argv = [str(tmp_path / "o_text_document"), "--vocab-file", vocab, "--merge-file", merges]
    assert inspect_dataset.main(argv) == 0
    out = capsys.readouterr().out
    assert "dtype: uint16" in out and "documents: 2" in out and "sequences: 2" in out
    assert "'Inspect me please.<|endoftext|>'" in out
    assert inspect_dataset.main([str(tmp_path / "missing")]) == 1
    assert "dataset file not found" in capsys.readouterr().err


def test_split_sentences_layout(tmp_path, monkeypatch):
    """Each sentence is one sequence, a document groups them, eod ends the last one."""
    class Splitter:
        @staticmethod
        def tokenize(text):
            return [s for s in text.split("|")]

    monkeypatch.setattr(preprocess_data, "load_sentence_splitter", lambda: Splitter())
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "One.| Two.|"}, {"text": "Three."}])
    assert preprocess(source, tmp_path / "o", *gpt2_flags(), "--split-sentences",
                      "--append-eod") == 0
    tokenizer = build_tokenizer("GPT2BPETokenizer", *our_vocab())
    ds = MMapIndexedDataset(str(tmp_path / "o_text_sentence"))
    assert ds.doc_idx.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(len(ds))] == [
        tokenizer.tokenize("One."), tokenizer.tokenize(" Two.") + [tokenizer.eod],
        tokenizer.tokenize("Three.") + [tokenizer.eod]]
