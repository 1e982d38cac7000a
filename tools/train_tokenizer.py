"""Train a byte-level BPE vocabulary and write it in GPT-2's file format.

    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8000 --output-dir my-bpe

writes ``my-bpe/vocab.json`` and ``my-bpe/merges.txt``, loadable with
``--tokenizer-type GPT2BPETokenizer``. ``<|endoftext|>`` gets id 0. Inputs are
loose JSON (``.jsonl``/``.json``: the ``--json-keys`` strings of each line) or
plain text (any other extension, e.g. ``.txt``: each line is one text).
Training uses the ``tokenizers`` package, pre-tokenising as GPT-2 does; the
same inputs give the same files.
"""
import argparse
import json
import os
import sys
from typing import Iterator, List

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from megatron.files import write_text_durably  # noqa: E402
from megatron.tokenizer.gpt2_bpe import EOD_TOKEN  # noqa: E402

MIN_VOCAB = 257  # 256 byte symbols + <|endoftext|>
JSON_SUFFIXES = (".jsonl", ".json")


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="loose JSON (.jsonl/.json) or plain text files")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose strings are read from JSON inputs")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help=f"entries in vocab.json (>= {MIN_VOCAB})")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="a pair must occur this often to be merged")
    parser.add_argument("--output-dir", required=True)
    return parser.parse_args(argv)


def iter_texts(paths: List[str], json_keys: List[str]) -> Iterator[str]:
    """Every training text, file by file, line by line."""
    for path in paths:
        is_json = path.endswith(JSON_SUFFIXES)
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not is_json:
                    yield line
                    continue
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    texts = [obj[key] for key in json_keys]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: not a JSON object with keys "
                                     f"{json_keys} ({exc})") from None
                yield from (t for t in texts if isinstance(t, str))


def train(paths: List[str], json_keys: List[str], vocab_size: int, min_frequency: int):
    """A trained ``tokenizers.Tokenizer`` (byte-level BPE, GPT-2 pre-tokenisation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(iter_texts(paths, json_keys), trainer=trainer)
    return tokenizer


def gpt2_files(tokenizer) -> tuple:
    """(vocab.json text, merges.txt text) of a trained BPE tokenizer."""
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    vocab_text = json.dumps(vocab, ensure_ascii=False)
    merges_text = "#version: 0.2\n" + "".join(f"{m}\n" for m in merges)
    return vocab_text, merges_text


def check_args(args) -> None:
    for path in args.input:
        if not os.path.isfile(path):
            raise ValueError(f"--input: file not found: {path}")
    if args.vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs "
                         f">= {MIN_VOCAB} (256 bytes + {EOD_TOKEN})")
    if args.min_frequency < 0:
        raise ValueError(f"--min-frequency must be >= 0, got {args.min_frequency}")


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        check_args(args)
        tokenizer = train(args.input, args.json_keys, args.vocab_size, args.min_frequency)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    vocab_text, merges_text = gpt2_files(tokenizer)
    os.makedirs(args.output_dir, exist_ok=True)
    write_text_durably(os.path.join(args.output_dir, "vocab.json"), vocab_text)
    write_text_durably(os.path.join(args.output_dir, "merges.txt"), merges_text)
    print(f"Wrote {args.output_dir}/vocab.json ({tokenizer.get_vocab_size()} entries) and "
          f"{args.output_dir}/merges.txt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
