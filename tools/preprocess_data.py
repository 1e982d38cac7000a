"""Tokenize loose JSON (one object per line) into MMIDIDX ``.bin``/``.idx`` datasets.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 8

writes ``my-gpt2_text_document.{bin,idx}`` (one pair per ``--json-keys`` key;
``_sentence`` instead of ``_document`` with ``--split-sentences``). Worker
processes encode large chunks of lines and send back compact numpy arrays; the
parent writes them in input order, so the output is the same for any number of
workers. Files are written under temporary names and renamed at the end.
"""
import argparse
import collections
import importlib.util
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, _REPO_ROOT)

import numpy as np

from megatron.data.indexed_dataset import (best_fitting_dtype, data_file_path,
                                           index_file_path, MMapIndexedDatasetBuilder)
from megatron.tokenizer import build_tokenizer, TOKENIZER_TYPES

CHUNK_BYTES = 1 << 20  # default chunk: as many lines as fill about 1 MiB


class InputError(Exception):
    """A problem with the input or the flags: reported as one line, no traceback."""


@dataclass
class EncoderOptions:
    """What a worker needs to encode lines (picklable)."""
    tokenizer_kwargs: dict
    json_keys: List[str]
    append_eod: bool
    split_sentences: bool
    skip_bad_lines: bool
    dtype: str


@dataclass
class ChunkResult:
    """Encoded lines of one chunk. ``arrays[key]`` is (tokens, sequence lengths,
    sequences per document); ``error`` is (line number, reason) of the first bad line."""
    arrays: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    docs: int = 0
    bytes: int = 0
    tokens: int = 0
    skipped: List[Tuple[int, str]] = field(default_factory=list)
    error: Optional[Tuple[int, str]] = None


class BadLine(Exception):
    """A line that is not a JSON object with string values for every key."""


def load_sentence_splitter():
    """NLTK's Punkt English sentence splitter (needs ``nltk`` and its punkt data)."""
    if importlib.util.find_spec("nltk") is None:
        raise InputError("--split-sentences needs the 'nltk' package (pip install nltk)")
    import nltk
    try:
        from nltk.tokenize import PunktTokenizer  # nltk >= 3.9
        return PunktTokenizer("english")
    except ImportError:
        pass
    except LookupError:
        raise InputError("--split-sentences: NLTK's punkt data is missing; run "
                         "python -m nltk.downloader punkt_tab") from None
    try:
        return nltk.data.load("tokenizers/punkt/english.pickle")
    except LookupError:
        raise InputError("--split-sentences: NLTK's punkt data is missing; run "
                         "python -m nltk.downloader punkt") from None


class Encoder:
    """Turns chunks of raw JSON lines into token arrays."""

    def __init__(self, options: EncoderOptions):
        self.options = options
        self.tokenizer = build_tokenizer(**options.tokenizer_kwargs)
        self.splitter = load_sentence_splitter() if options.split_sentences else None
        self.dtype = np.dtype(options.dtype)

    def texts(self, line: bytes) -> List[str]:
        """The ``--json-keys`` strings of one line, or BadLine."""
        try:
            obj = json.loads(line)
        except UnicodeDecodeError:
            raise BadLine("not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise BadLine(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
            raise BadLine(f"invalid JSON ({exc})") from None
        except RecursionError:
            raise BadLine("invalid JSON (nested too deeply)") from None
        if not isinstance(obj, dict):
            raise BadLine(f"expected a JSON object, got {type(obj).__name__}")
        texts = []
        for key in self.options.json_keys:
            if key not in obj:
                raise BadLine(f"missing key {key!r} (see --json-keys)")
            if not isinstance(obj[key], str):
                raise BadLine(f"key {key!r} is {type(obj[key]).__name__}, not a string")
            texts.append(obj[key])
        return texts

    def encode_text(self, text: str) -> List[List[int]]:
        """Token ids of each non-empty sentence of one document (eod appended if asked)."""
        sentences = self.splitter.tokenize(text) if self.splitter else [text]
        doc = [ids for ids in map(self.tokenizer.tokenize, sentences) if ids]
        if doc and self.options.append_eod:
            doc[-1].append(self.tokenizer.eod)
        return doc

    def encode_line(self, line: bytes) -> List[List[List[int]]]:
        """One document (a list of sentences' ids) per ``--json-keys`` key, or BadLine."""
        docs = []
        for key, text in zip(self.options.json_keys, self.texts(line)):
            try:
                docs.append(self.encode_text(text))
            except UnicodeEncodeError:
                raise BadLine(f"key {key!r} holds an unpaired surrogate (a lone \\ud800-"
                              "\\udfff escape), which is not text") from None
        return docs

    def encode_chunk(self, chunk: Tuple[int, List[bytes]]) -> ChunkResult:
        """Encode the lines of ``chunk`` = (number of its first line, lines)."""
        first_lineno, lines = chunk
        flat = [([], [], []) for _ in self.options.json_keys]  # tokens, lengths, seqs per doc
        result = ChunkResult()
        for lineno, line in enumerate(lines, start=first_lineno):
            if not line.strip():
                continue
            try:
                docs = self.encode_line(line)
            except BadLine as exc:
                if not self.options.skip_bad_lines:
                    result.error = (lineno, str(exc))
                    return result
                result.skipped.append((lineno, str(exc)))
                continue
            result.docs += 1
            result.bytes += len(line)
            for (tokens, lengths, per_doc), doc in zip(flat, docs):
                for ids in doc:
                    tokens.extend(ids)
                    lengths.append(len(ids))
                if doc:
                    per_doc.append(len(doc))
        for key, (tokens, lengths, per_doc) in zip(self.options.json_keys, flat):
            result.tokens += len(tokens)
            result.arrays[key] = (np.array(tokens, dtype=self.dtype),
                                  np.array(lengths, dtype=np.int64),
                                  np.array(per_doc, dtype=np.int64))
        return result


_WORKER_ENCODER: Optional[Encoder] = None


def _init_worker(options: EncoderOptions) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(options)


def _encode_in_worker(chunk: Tuple[int, List[bytes]]) -> ChunkResult:
    return _WORKER_ENCODER.encode_chunk(chunk)


def read_chunks(path: str, chunk_lines: Optional[int]) -> Iterator[Tuple[int, List[bytes]]]:
    """(first line number, lines) of ``chunk_lines`` lines, or of about 1 MiB if None."""
    lineno = 1
    with open(path, "rb", buffering=1 << 20) as f:
        while True:
            if chunk_lines is None:
                lines = f.readlines(CHUNK_BYTES)
            else:
                lines = [line for _, line in zip(range(chunk_lines), f)]
            if not lines:
                return
            yield lineno, lines
            lineno += len(lines)


def encode_all(options: EncoderOptions, chunks, workers: int) -> Iterator[ChunkResult]:
    """Encoded chunks in input order: in this process (1 worker) or a Pool."""
    if workers == 1:
        encoder = Encoder(options)
        yield from map(encoder.encode_chunk, chunks)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(options,)) as pool:
        pending = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 3 * workers:  # bounded read-ahead
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """Counts documents, bytes and tokens; logs a line to stderr every ``interval`` docs."""

    def __init__(self, interval: int):
        self.interval = interval
        self.start = time.time()
        self.docs = self.bytes = self.tokens = 0
        self.skipped: List[Tuple[int, str]] = []
        self._next_log = interval

    def update(self, result: ChunkResult) -> None:
        self.docs += result.docs
        self.bytes += result.bytes
        self.tokens += result.tokens
        self.skipped.extend(result.skipped)
        if self.interval > 0 and self.docs >= self._next_log:
            self._next_log = (self.docs // self.interval + 1) * self.interval
            print(f"Processed {self.line()}", file=sys.stderr, flush=True)

    def line(self) -> str:
        elapsed = max(time.time() - self.start, 1e-9)
        return (f"{self.docs} documents, {self.tokens} tokens in {elapsed:.1f} s "
                f"({self.docs / elapsed:.1f} docs/s, {self.bytes / elapsed / 1e6:.2f} MB/s, "
                f"{self.tokens / elapsed:.0f} tokens/s)")


def output_prefixes(args) -> Dict[str, str]:
    """``--json-keys`` key -> output prefix."""
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}


def write_datasets(args, options: EncoderOptions) -> Progress:
    """Encode the input and write one dataset per key; on any error remove the partial files."""
    builders = {key: MMapIndexedDatasetBuilder(data_file_path(prefix), options.dtype)
                for key, prefix in output_prefixes(args).items()}
    progress = Progress(args.log_interval)
    try:
        chunks = read_chunks(args.input, args.chunk_size)
        for result in encode_all(options, chunks, args.workers):
            if result.error is not None:
                lineno, reason = result.error
                raise InputError(f"{args.input}:{lineno}: {reason} "
                                 "(use --skip-bad-lines to skip such lines)")
            for key, (tokens, lengths, per_doc) in result.arrays.items():
                builders[key].add_docs(tokens, lengths, per_doc)
            progress.update(result)
        for key, prefix in output_prefixes(args).items():
            builders[key].finalize(index_file_path(prefix))
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    return progress


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="loose JSON file, one object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract; each gives its own output dataset")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences (needs nltk)")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="count and skip malformed lines instead of stopping")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None,
                       help="vocabulary file (--vocab is Megatron's older spelling)")
    group.add_argument("--merge-file", default=None)
    group.add_argument("--tokenizer-name-or-path", default=None,
                       help="local directory for PretrainedFromHF")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece .model or tiktoken BPE file, or HuggingFaceTokenizer's directory")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document id to every document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True)
    group.add_argument("--dataset-impl", default="mmap", choices=["mmap"])
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="encoding processes")
    group.add_argument("--chunk-size", type=int, default=None,
                       help="lines per worker task (default: about 1 MiB of lines)")
    group.add_argument("--log-interval", type=int, default=10000,
                       help="documents between progress lines (0: none)")
    return parser.parse_args(argv)


def check_args(args) -> None:
    """Early, one-line errors for flag values the parser cannot check."""
    if not os.path.isfile(args.input):
        raise InputError(f"--input: file not found: {args.input}")
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise InputError(f"--output-prefix: directory {out_dir} does not exist; create it first")
    if args.workers < 1:
        raise InputError(f"--workers must be >= 1, got {args.workers}")
    if args.chunk_size is not None and args.chunk_size < 1:
        raise InputError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    if args.log_interval < 0:
        raise InputError(f"--log-interval must be >= 0, got {args.log_interval}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise InputError(f"--json-keys has duplicates: {args.json_keys}")
    for prefix in output_prefixes(args).values():
        for path in (data_file_path(prefix), index_file_path(prefix)):
            if os.path.isdir(path):
                raise InputError(f"--output-prefix {args.output_prefix}: the output {path} is a "
                                 f"directory; choose another prefix or move the directory away")


def make_options(args) -> EncoderOptions:
    """Validate the tokenizer (and splitter) here, once, before starting workers."""
    kwargs = dict(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                  merge_file=args.merge_file, tokenizer_name_or_path=args.tokenizer_name_or_path,
                  vocab_size=args.vocab_size, tokenizer_model=args.tokenizer_model)
    tokenizer = build_tokenizer(**kwargs)
    if args.split_sentences:
        load_sentence_splitter()
    dtype = np.dtype(best_fitting_dtype(tokenizer.vocab_size)).name
    return EncoderOptions(kwargs, list(args.json_keys), args.append_eod,
                          args.split_sentences, args.skip_bad_lines, dtype)


def main(argv=None) -> int:
    """Run the tool; returns the exit status (0 ok, 1 bad input data, 2 bad flags)."""
    args = get_args(argv)
    try:
        check_args(args)
        options = make_options(args)
    except (InputError, ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        progress = write_datasets(args, options)
    except (InputError, OSError) as exc:  # bad input line, full disk, unwritable output
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"Done: {progress.line()}", file=sys.stderr)
    if progress.skipped:
        lineno, reason = progress.skipped[0]
        print(f"Skipped {len(progress.skipped)} malformed lines (first: "
              f"{args.input}:{lineno}: {reason})", file=sys.stderr)
    for prefix in output_prefixes(args).values():
        print(f"Wrote {data_file_path(prefix)} and {index_file_path(prefix)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
