"""Data is checked before it is trusted: corrupted .idx/.bin pairs (with and without the
builder's digest sidecar), foreign .bin files, empty splits,
token ids beyond the vocabulary and malformed JSON lines each end in one named line."""
import json
import random
import struct

import numpy as np
import pytest

from megatron.data import gpt_dataset as gd
from megatron.data.indexed_dataset import (DTYPES, MAGIC, IndexedDatasetError, MMapIndexedDataset,
                                           MMapIndexedDatasetBuilder)
from tools import preprocess_data

HEADER = struct.Struct("<9sQBQQ")


def build(prefix, docs, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        for seq in doc:
            builder.add_item(np.asarray(seq, dtype=dtype))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def reference_read(idx: bytes, bin_: bytes):
    """An independent, plain-Python reader: the sequences when the pair is fully
    consistent, else None."""
    if len(idx) < HEADER.size:
        return None
    magic, version, code, n, m = HEADER.unpack_from(idx, 0)
    if magic != MAGIC or version != 1 or code not in DTYPES or m < 1:
        return None
    if len(idx) != HEADER.size + 12 * n + 8 * m:
        return None
    sizes = struct.unpack_from(f"<{n}i", idx, HEADER.size)
    pointers = struct.unpack_from(f"<{n}q", idx, HEADER.size + 4 * n)
    doc_idx = struct.unpack_from(f"<{m}q", idx, HEADER.size + 12 * n)
    itemsize = np.dtype(DTYPES[code]).itemsize
    position = 0
    for size, pointer in zip(sizes, pointers):
        if size < 0 or pointer != position:
            return None
        position += size * itemsize
    if position != len(bin_) or doc_idx[0] != 0:
        return None
    if any(b < a or b > n for a, b in zip(doc_idx, doc_idx[1:])):
        return None
    return [np.frombuffer(bin_, DTYPES[code], s, p).tolist() for s, p in zip(sizes, pointers)]


def mutate(rng, idx: bytearray, bin_: bytearray):
    kind = rng.randrange(7)
    if kind == 0:  # flip random bytes anywhere in the index
        for _ in range(rng.randint(1, 4)):
            idx[rng.randrange(len(idx))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # truncate or extend the index
        idx = idx[:rng.randrange(len(idx))] if rng.random() < 0.7 else idx + bytes(rng.randint(1, 16))
    elif kind == 2:  # truncate or extend the data
        bin_ = bin_[:rng.randrange(len(bin_) + 1)] if rng.random() < 0.7 else bin_ + bytes(4)
    elif kind == 3:  # a header field set to a random value
        field = rng.choice([(9, "<Q"), (17, "<B"), (18, "<Q"), (26, "<Q")])
        value = rng.choice([0, 1, 2, 3, 9, 255, 2 ** 31, 2 ** 63 - 1, rng.randrange(64)])
        struct.pack_into(field[1], idx, field[0], value % (256 if field[1] == "<B" else 2 ** 64))
    else:  # one size, pointer or doc-index entry set to a random value
        n, m = struct.unpack_from("<QQ", idx, 18)
        table = kind - 4
        offset, fmt, count = [(34, "<i", n), (34 + 4 * n, "<q", n), (34 + 12 * n, "<q", m)][table]
        entry = rng.randrange(count)
        low, high = (-2 ** 31, 2 ** 31 - 1) if fmt == "<i" else (-2 ** 63, 2 ** 63 - 1)
        value = rng.choice([-1, 0, 1, 7, low, high, rng.randint(-100, 100)])
        struct.pack_into(fmt, idx, offset + struct.calcsize(fmt) * entry, value)
    return idx, bin_


def _originals(tmp_path, docs=((1, 2, 3), (4,)), dtypes=(np.uint16, np.int32, np.int64, np.uint8)):
    """(idx, bin, sidecar) bytes of one small dataset per dtype."""
    tmp_path.mkdir(exist_ok=True)
    base, out = tmp_path / "base", []
    for dtype in dtypes:
        build(base, [[list(docs[0]), list(docs[1])], [[5, 6]], [[7, 8, 9, 10]], [[11]]], dtype)
        out.append(tuple((tmp_path / f"base.{ext}").read_bytes() for ext in ("idx", "bin", "bin.sha256")))
    return out


def _open_case(tmp_path, case, idx, bin_, sidecar=None):
    """'refused' (one line naming the files) or 'read' (exactly what the reference reader reads)."""
    prefix = tmp_path / f"c{case}"
    (tmp_path / f"c{case}.idx").write_bytes(idx)
    (tmp_path / f"c{case}.bin").write_bytes(bin_)
    if sidecar is not None:
        (tmp_path / f"c{case}.bin.sha256").write_bytes(sidecar)
    expected = reference_read(bytes(idx), bytes(bin_))
    try:
        ds = MMapIndexedDataset(str(prefix))
        got = [ds[i].tolist() for i in range(len(ds))]
    except IndexedDatasetError as err:
        message = str(err)
        assert "\n" not in message and f"c{case}." in message, message
        assert sidecar is not None or expected is None, (case, message)
        return "refused"
    assert expected is not None and got == expected, case
    return "read"


def _digest_mutation(rng, idx: bytearray, bin_: bytearray):
    """What only a digest can catch (10 random bytes inside the .bin, a dtype code swapped
    for another valid one), or any of the index/data mutations above."""
    kind = rng.randrange(3)
    if kind == 0:
        for position in rng.sample(range(len(bin_)), min(10, len(bin_))):
            bin_[position] ^= rng.randrange(1, 256)
    elif kind == 1:
        idx[17] = rng.choice([c for c in DTYPES if c != idx[17]])
    else:
        idx, bin_ = mutate(rng, idx, bin_)
    return idx, bin_


def test_fuzzed_index_and_data_pairs(tmp_path, capsys):
    """Seeded corruptions of .idx/.bin pairs, none read silently:
    - 1200 without a digest sidecar (Megatron's files): each is a one-line IndexedDatasetError
      naming the file, or (only when the pair is still fully consistent) reads what a
      reference reader reads;
    - 600 with the sidecar our builder writes: bit flips inside the .bin, swapped dtype codes
      and the mutations above, every one refused;
    - 120 foreign .bin files (another dataset's, longer or of the same length): refused when
      longer, and with a sidecar whatever their length."""
    rng = random.Random(13)
    originals = _originals(tmp_path)
    counts = {"plain refused": 0, "plain read": 0, "digest refused": 0, "foreign refused": 0,
              "foreign same-length, no digest": 0}
    for case in range(1200):
        idx, bin_, _ = originals[case % 4]
        counts["plain " + _open_case(tmp_path, case, *mutate(rng, bytearray(idx), bytearray(bin_)))] += 1
    for case in range(1200, 1800):
        idx, bin_, sidecar = originals[case % 4]
        idx, bin_ = _digest_mutation(rng, bytearray(idx), bytearray(bin_))
        if (bytes(idx), bytes(bin_)) == originals[case % 4][:2]:
            continue  # a mutation that changed nothing (e.g. a field set to its own value)
        assert _open_case(tmp_path, case, idx, bin_, sidecar) == "refused", case
        counts["digest refused"] += 1
    foreign = _originals(tmp_path / "other", docs=((21, 22, 23), (24, 25)))
    foreign_same = _originals(tmp_path / "same", docs=((31, 32, 33), (34,)))
    for case in range(1800, 1920):
        which, with_sidecar = case % 4, case % 3 == 0
        idx, _, sidecar = originals[which]
        longer = case % 2 == 0
        bin_ = (foreign if longer else foreign_same)[which][1]
        result = _open_case(tmp_path, case, idx, bin_, sidecar if with_sidecar else None)
        if longer or with_sidecar:
            assert result == "refused", case
            counts["foreign refused"] += 1
        else:
            counts["foreign same-length, no digest"] += 1
    with capsys.disabled():
        print(f"\nidx/bin fuzz: {counts}")
    assert counts["plain refused"] >= 900 and counts["plain read"] >= 25, counts
    assert counts["digest refused"] >= 550 and counts["foreign refused"] >= 80, counts


def test_index_error_names_the_entry(tmp_path):
    build(tmp_path / "d", [[[1, 2, 3]], [[4, 5]]])
    idx = bytearray((tmp_path / "d.idx").read_bytes())
    struct.pack_into("<q", idx, 34 + 4 * 2 + 8, 3)  # pointer of sequence 1
    (tmp_path / "d.idx").write_bytes(idx)
    with pytest.raises(IndexedDatasetError, match=r"d\.idx: sequence 1 points at byte 3, but the sizes"):
        MMapIndexedDataset(str(tmp_path / "d"))


def test_empty_split_is_refused_naming_split(tmp_path):
    build(tmp_path / "d", [[[1, 2, 3, 4, 5]]] * 3)
    train, valid, _ = gd.build_train_valid_test_datasets([str(tmp_path / "d")], "100,1,0", (4, 4, 0), 4, 1)
    assert train is not None and valid is None  # an empty valid split is skipped, as in Megatron
    with pytest.raises(gd.DatasetError,
                       match=r"--split 0,1,0 leaves the train split .* without documents .* needs 4 samples"):
        gd.build_train_valid_test_datasets([str(tmp_path / "d")], "0,1,0", (4, 4, 0), 4, 1)
    train, valid, test = gd.build_train_valid_test_datasets([str(tmp_path / "d")], "1,0,0", (4, 4, 4), 4, 1)
    assert train is not None and valid is None and test is None


def test_token_beyond_the_vocabulary_names_dataset_and_size(tmp_path):
    build(tmp_path / "d", [[[1, 2, 3, 4, 5]], [[6, 700, 8, 9]], [[1, 2, 3]]])
    train, _, _ = gd.build_train_valid_test_datasets([str(tmp_path / "d")], "1", (3, 0, 0), 3, 1,
                                                     vocab_size=512)
    with pytest.raises(gd.DatasetError, match=r"d: train sample \d holds token id 700, outside the "
                                              r"vocabulary of size 512"):
        [train[i] for i in range(len(train))]


def test_dataloader_worker_error_stays_one_line():
    wrapped = ("Caught DatasetError in DataLoader worker process 0.\nOriginal Traceback (most recent "
               "call last):\n  File \"x.py\", line 1\nmegatron.data.gpt_dataset.DatasetError: d: bad token")
    assert str(gd.DatasetError(wrapped)) == "d: bad token"


def malformed_lines(rng):
    """1100 malformed or odd JSON lines from seeded mutations and known pathologies."""
    fixed = [b"[" * 100000, b'{"text": ' + b"[" * 50000 + b"]" * 50000 + b"}", b"{" * 3000,
             b'{"text": ' + b"1" * 5000 + b"}", b'{"text": "\xff\xfe"}', b'{"text": "\\ud800"}',
             b'{"text": NaN}', b'"just a string"', b"null", b"[1, 2]", b'{"other": "x"}',
             b'{"text": null}', b'{"text": "ok"', b"\x00\x01", b'{"text": "a\\u00"}']
    good = [json.dumps({"text": t}).encode() for t in ("hello world", "caf\u00e9", "x" * 50, "")]
    lines = list(fixed)
    while len(lines) < 1100:
        line = bytearray(rng.choice(good))
        for _ in range(rng.randint(1, 3)):
            op, pos = rng.randrange(3), rng.randrange(len(line) + 1)
            if op == 0 and line:
                del line[min(pos, len(line) - 1)]
            elif op == 1:
                line[pos:pos] = bytes([rng.choice(b'{}[]",:\\\xff\x80 \tu0')])
            else:
                line[pos:pos] = rng.choice([b"[" * 4000, b'{"a":' * 2000, b"\\ud83d", b"1e999"])
        lines.append(bytes(line).replace(b"\n", b" "))
    return lines


def expected_text(line):
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj["text"] if isinstance(obj, dict) and isinstance(obj.get("text"), str) else None


def test_fuzzed_json_lines_are_encoded_or_counted():
    args = preprocess_data.get_args(["--input", "x", "--output-prefix", "y", "--tokenizer-type",
                                     "ByteLevelTokenizer", "--skip-bad-lines"])
    encoder = preprocess_data.Encoder(preprocess_data.make_options(args))
    lines = malformed_lines(random.Random(7))
    result = encoder.encode_chunk((1, lines))
    skipped = {lineno for lineno, _ in result.skipped}
    for lineno, line in enumerate(lines, start=1):
        text = expected_text(line)
        ok = text is not None and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        assert (lineno not in skipped) == ok, (lineno, line[:80])
    assert result.docs + len(skipped) == len(lines) and len(skipped) >= 900


@pytest.mark.parametrize("workers", ["1", "2"])
def test_deeply_nested_line_is_a_named_bad_line(tmp_path, capsys, workers):
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"text": "fine"}\n' + b"[" * 100000 + b"\n")
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
            "ByteLevelTokenizer", "--workers", workers, "--log-interval", "0"]
    assert preprocess_data.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {source}:2: invalid JSON (nested too deeply) "
                   "(use --skip-bad-lines to skip such lines)")
    assert preprocess_data.main(argv + ["--skip-bad-lines"]) == 0
    assert "Skipped 1 malformed lines" in capsys.readouterr().err


def test_output_bin_that_is_a_directory_is_one_line(tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "fine"}\n')
    (tmp_path / "o_text_document.bin").mkdir()
    argv = ["--input", str(source), "--output-prefix", str(tmp_path / "o"), "--tokenizer-type",
            "ByteLevelTokenizer", "--log-interval", "0"]
    assert preprocess_data.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"the output {tmp_path}/o_text_document.bin is a " \
        "directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o_text_document.bin"]


@pytest.mark.parametrize("which", ["merges.txt", "vocab.json"])
def test_undecodable_tokenizer_file_is_named(tmp_path, capsys, which):
    """Random bytes as the merges (or vocab) file: one line naming the file, exit 2."""
    import pretrain_gpt
    from tests.data_setup import bpe_dir
    from tests.reliability_setup import byte_dataset, tiny_argv
    files = {name: bpe_dir() / name for name in ("vocab.json", "merges.txt")}
    files[which] = tmp_path / which
    files[which].write_bytes(bytes(random.Random(3).randrange(256) for _ in range(4000)))
    argv = tiny_argv(byte_dataset(tmp_path), tmp_path / "cache", "--tokenizer-type", "GPT2BPETokenizer",
                     "--vocab-file", files["vocab.json"], "--merge-file", files["merges.txt"])
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and str(files[which]) in err, err
