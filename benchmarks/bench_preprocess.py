"""End-to-end throughput of tools/preprocess_data.py against the `tokenizers` package.

    python benchmarks/bench_preprocess.py [--workers 2] [--megabytes 20]

Builds a ~20 MB loose-JSON corpus by repeating WikiText's validation articles
(in a temporary directory), runs ``tools/preprocess_data.py`` on it as a user
would (a subprocess, GPT-2 BPE with the bpe-8k vocabulary, timed from start to
exit), then encodes the same documents one at a time on one thread with
``tokenizers`` (byte-level BPE from the same files). Prints tokens/s of both and
their ratio; the target is >= 3x.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("MEGATRON_SHARED_DATA", ROOT.parent / "shared" / "data"))
sys.path.insert(0, str(ROOT))

from megatron.data.indexed_dataset import MMapIndexedDataset  # noqa: E402

TARGET_RATIO = 3.0


def make_corpus(path: Path, megabytes: float) -> int:
    """Repeat wiki.valid.jsonl until the file holds ``megabytes`` MB; returns line count."""
    lines = (DATA / "wikitext" / "wiki.valid.jsonl").read_bytes().splitlines(keepends=True)
    written = count = 0
    with open(path, "wb") as f:
        while written < megabytes * 1e6:
            for line in lines:
                f.write(line)
                written += len(line)
                count += 1
    return count


def run_preprocess(corpus: Path, prefix: Path, workers: int) -> tuple:
    """(seconds, tokens) of one tools/preprocess_data.py run."""
    cmd = [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(corpus),
           "--output-prefix", str(prefix), "--tokenizer-type", "GPT2BPETokenizer",
           "--vocab-file", str(DATA / "bpe-8k" / "vocab.json"),
           "--merge-file", str(DATA / "bpe-8k" / "merges.txt"),
           "--append-eod", "--workers", str(workers), "--log-interval", "0"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    tokens = int(MMapIndexedDataset(f"{prefix}_text_document").sizes.sum())
    return seconds, tokens


def run_hf_tokenizers(corpus: Path) -> tuple:
    """(seconds, tokens) of `tokenizers` encoding each document on one thread (+ eod)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tokenizer = Tokenizer(models.BPE.from_file(str(DATA / "bpe-8k" / "vocab.json"),
                                               str(DATA / "bpe-8k" / "merges.txt")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    with open(corpus, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    start = time.perf_counter()
    tokens = sum(len(tokenizer.encode(doc).ids) + 1 for doc in docs)
    return time.perf_counter() - start, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--megabytes", type=float, default=20.0)
    args = parser.parse_args()
    if not (DATA / "wikitext" / "wiki.valid.jsonl").exists():
        print(f"reference data not found under {DATA}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        docs = make_corpus(corpus, args.megabytes)
        size_mb = corpus.stat().st_size / 1e6
        print(f"corpus: {docs} documents, {size_mb:.1f} MB")
        ours_s, ours_tokens = run_preprocess(corpus, Path(tmp) / "out", args.workers)
        hf_s, hf_tokens = run_hf_tokenizers(corpus)
    if ours_tokens != hf_tokens:
        print(f"token counts differ: preprocess {ours_tokens}, tokenizers {hf_tokens}")
        return 1
    ours_rate, hf_rate = ours_tokens / ours_s, hf_tokens / hf_s
    ratio = ours_rate / hf_rate
    print(f"preprocess_data.py --workers {args.workers}: {ours_tokens} tokens in {ours_s:.2f} s "
          f"= {ours_rate:,.0f} tokens/s ({size_mb / ours_s:.2f} MB/s, end to end)")
    print(f"tokenizers, 1 thread, encode per doc: {hf_tokens} tokens in {hf_s:.2f} s "
          f"= {hf_rate:,.0f} tokens/s")
    verdict = "meets" if ratio >= TARGET_RATIO else "misses"
    print(f"ratio: {ratio:.2f}x ({verdict} the >= {TARGET_RATIO:.0f}x target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
