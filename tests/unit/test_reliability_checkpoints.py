"""Checkpoints that are what they claim: durable, checksummed, every --load problem one line."""
import errno
import os
import random
import shutil
import signal
import struct
import subprocess
import time
import zipfile

import pytest
import torch

import pretrain_gpt
from megatron.checkpointing import io as checkpoint_io
from megatron.checkpointing.io import CheckpointError
from megatron.checkpointing.megatron_legacy import safe_load
from tests.gpt_setup import one_thread
from tests.reliability_setup import byte_dataset, small_tmpfs, tiny_argv, tree_bytes


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield

ITER = "iter_0000002"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny 2-iteration checkpoint (and its data) to copy and corrupt."""
    out = tmp_path_factory.mktemp("ckpt")
    prefix = byte_dataset(out)
    pretrain_gpt.main(tiny_argv(prefix, out / "cache", "--save", str(out / "ckpt"), iters=2))
    return out, prefix


def model_file(root):
    return os.path.join(str(root), ITER, "mp_rank_00", "model_optim_rng.pt")


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def corrupt_tracker(text):
    def apply(root):
        (root / "latest_checkpointed_iteration.txt").write_text(text)
    return apply


def truncate(root):
    """Half the file, and no checksum sidecar (as in a Megatron-LM checkpoint)."""
    path = model_file(root)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])
    os.remove(path + ".sha256")


def flip_bytes(root):
    path = model_file(root)
    data = bytearray(open(path, "rb").read())
    for i in random.Random(1).sample(range(len(data) // 2, len(data) - 100), 64):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def hostile(root):
    evil = Evil()
    evil.marker = str(root / "pwned")
    torch.save({"model": evil, "iteration": 2}, model_file(root))
    os.remove(model_file(root) + ".sha256")


def flip_tensor_bytes_without_sidecar(root):
    """64 flipped bytes inside the largest tensor's storage: the file still loads (the case
    that trained on with a grad norm of 12.4), and its sidecar is gone."""
    path = model_file(root)
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(open(path, "rb").read())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    for i in random.Random(1).sample(range(start, start + info.file_size), 64):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))
    os.remove(path + ".sha256")
    safe_load(path)  # still a loadable file


def strip_digest(root):
    """Neither sidecar nor in-file digest (a file of ours that was re-saved by hand)."""
    state = safe_load(model_file(root))
    del state[checkpoint_io.CONTENT_DIGEST]
    torch.save(state, model_file(root))
    os.remove(model_file(root) + ".sha256")


def tracker_names_another_iteration(root):
    """The tracker says 6 and iter_0000006 holds the iteration-2 file."""
    os.rename(root / ITER, root / "iter_0000006")
    (root / "latest_checkpointed_iteration.txt").write_text("6")


def nan_adam_state(root, kind="exp_avg", value=float("nan")):
    """One nan in the Adam state of a parameter (a valid sidecar: the state is the problem)."""
    state = safe_load(model_file(root))
    moments = state["optimizer"]["optimizer"]["state"]
    moments[sorted(moments)[0]][kind].view(-1)[5] = value
    checkpoint_io.save_file(state, model_file(root))


def nan_weight(root):
    state = safe_load(model_file(root))
    state["model"]["language_model"]["encoder"]["layers.1.mlp.dense_4h_to_h.weight"][3, 1] = float("nan")
    checkpoint_io.save_file(state, model_file(root))  # a valid sidecar: the weights are the problem


LOAD_CASES = [
    ("garbage tracker", corrupt_tracker("hello"), [], "not an iteration number"),
    ("empty tracker", corrupt_tracker(""), [], "not an iteration number"),
    ("negative tracker", corrupt_tracker("-5"), [], "not an iteration number"),
    ("tracker beyond any save", corrupt_tracker("7"), [], "incomplete"),
    ("missing rank dir", lambda r: shutil.rmtree(os.path.dirname(model_file(r))), [], "incomplete"),
    ("truncated file", truncate, [], "cannot be loaded"),
    ("empty file", lambda r: open(model_file(r), "wb").close(), ["--no-verify-checkpoint"],
     "does not match its checksum"),
    ("flipped bytes", flip_bytes, [], "does not match its checksum"),
    ("hostile pickle", hostile, [], "not loaded"),
    ("flipped bytes, no sidecar", flip_tensor_bytes_without_sidecar, [],
     "does not match the digest it carries"),
    ("no sidecar, no digest", strip_digest, [], "cannot be verified"),
    ("no sidecar, no digest, --no-verify-checkpoint", strip_digest,
     ["--no-verify-checkpoint", "--finetune"], None),
    ("tracker names another iteration", tracker_names_another_iteration, [],
     "holds iteration 2 but latest_checkpointed_iteration.txt says 6"),
    ("nan weight", nan_weight, [], "parameter language_model.encoder.layers.1.mlp.dense_4h_to_h.weight "
     "holds 1 nan/inf values"),
    ("nan in the adam state", nan_adam_state, [], "optimizer state exp_avg of "
     "language_model.embedding.word_embeddings.weight holds 1 nan/inf values"),
    ("inf in the adam state", lambda r: nan_adam_state(r, "exp_avg_sq", float("inf")), [],
     "optimizer state exp_avg_sq of language_model.embedding.word_embeddings.weight holds 1 "
     "nan/inf values"),
    ("no tracker beside the iteration", lambda r: os.remove(r / "latest_checkpointed_iteration.txt"),
     [], f"holds {ITER} but no latest_checkpointed_iteration.txt; pass --load "),
    ("a checkpoint directory of another name, no tracker", lambda r: (
        os.remove(r / "latest_checkpointed_iteration.txt"), os.rename(r / ITER, r / "best")),
     [], "holds best but no latest_checkpointed_iteration.txt; pass --load "),
    ("hidden size", None, ["--hidden-size", "64"], "--hidden-size 64 does not match"),
    ("heads", None, ["--num-attention-heads", "2"], "--num-attention-heads 2 does not match"),
    ("layers", None, ["--num-layers", "4"], "--num-layers 4 does not match"),
    ("tokenizer", None, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"],
     "--tokenizer-type NullTokenizer does not match"),
    ("layout", None, ["--finetune", "--no-verify-checkpoint"], None),
]


@pytest.mark.parametrize("name, damage, flags, words", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_every_load_problem_is_one_line_exit_2(saved, tmp_path, capsys, name, damage, flags, words):
    out, prefix = saved
    root = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", root)
    if damage is not None:
        damage(root)
    argv = tiny_argv(prefix, out / "cache", "--load", str(root), *flags, iters=3)
    if words is None:  # control: an undamaged checkpoint loads
        assert [h["iteration"] for h in pretrain_gpt.main(argv).history] == [1, 2, 3]
        return
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err, err
    assert "check the model flags" not in err, err  # never re-worded as a flag mismatch
    assert not (root / "pwned").exists()


def test_load_that_is_a_file_and_unwritable_save(saved, tmp_path, capsys):
    out, prefix = saved
    afile = tmp_path / "file"
    afile.write_text("x")
    for flags, words in ((["--load", str(afile)], "is a file"),
                         (["--save", str(afile / "sub")], "is not writable")):
        with pytest.raises(SystemExit) as exc:
            pretrain_gpt.main(tiny_argv(prefix, out / "cache", *flags, iters=1))
        err = capsys.readouterr().err.strip()
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and words in err, err


def test_flipped_byte_loads_with_no_verify_but_is_caught_by_default(tmp_path):
    path = str(tmp_path / "f.pt")
    checkpoint_io.save_file({"w": torch.arange(1000, dtype=torch.float32)}, path)
    assert open(path + ".sha256").read().split() == [
        subprocess.run(["sha256sum", path], capture_output=True, text=True).stdout.split()[0], "f.pt"]
    data = bytearray(open(path, "rb").read())
    data[-3000] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        checkpoint_io.load_file(path)
    assert not torch.equal(checkpoint_io.load_file(path, verify=False)["w"], torch.arange(1000.0))


class _FullDisk:
    """A file whose writes fail with ENOSPC after `room` bytes."""

    def __init__(self, file, room):
        self.file, self.room = file, room

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def _check_full_disk(directory):
    path = os.path.join(directory, "model_optim_rng.pt")
    checkpoint_io.save_file({"w": torch.zeros(100)}, path)
    before = open(path, "rb").read()
    with pytest.raises(CheckpointError) as err:
        checkpoint_io.save_file({"w": torch.zeros(200_000)}, path)
    message = str(err.value)
    assert "\n" not in message and directory in message and "needs 80" in message, message
    assert open(path, "rb").read() == before
    checkpoint_io.verify_checksum(path)
    assert not [n for n in os.listdir(directory) if ".tmp." in n]


def test_full_disk_simulated(tmp_path, monkeypatch):
    real_open = open
    import megatron.files  # where checkpoint files are opened for writing
    monkeypatch.setattr(megatron.files, "open", lambda p, m="r": _FullDisk(real_open(p, m), 50_000),
                        raising=False)
    _check_full_disk(str(tmp_path))


def test_full_disk_on_a_small_tmpfs(tmp_path):
    with small_tmpfs(tmp_path / "small", 256 * 1024) as mount:
        _check_full_disk(mount)


def test_torch_dist_full_disk_on_a_small_tmpfs(tmp_path):
    """A tmpfs with room for one torch_dist checkpoint and a half: the second save ends the
    run in one line naming ENOSPC (exit 2), its staging directory is gone, and the first
    checkpoint is still the tracked, verified one to resume from."""
    from tests.reliability_setup import run_entry
    prefix = byte_dataset(tmp_path)
    flags = ["--ckpt-format", "torch_dist", "--save-interval", "1", "--num-workers", "0"]
    pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags, "--save",
                                tmp_path / "sized", iters=1))
    room = 3 * tree_bytes(tmp_path / "sized") // 2
    with small_tmpfs(tmp_path / "small", room - room % 4096) as mount:
        save = os.path.join(mount, "ckpt")
        rc, err, _ = run_entry(tiny_argv(prefix, tmp_path / "cache", *flags, "--save", save,
                                         iters=2), timeout=120)
        assert rc == 2 and len(err) == 1, (rc, err)
        assert err[0].startswith(f"pretrain_gpt.py: error: no space left on device (ENOSPC) in "
                                 f"{save}: .iter_0000002.torch_dist.tmp (rank 0's torch_dist "
                                 f"files) needs "), err
        assert "the staging directory was removed" in err[0], err
        assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
        assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "1"
        state = pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags[:2], "--load",
                                            save, "--override-opt_param-scheduler", iters=2))
        assert [h["iteration"] for h in state.history] == [2]  # resumed from the verified one


def _save_forever(root, iteration, trainer, config, pstate):
    from megatron.checkpointing import api
    from megatron.checkpointing.formats import RunState
    torch.set_num_threads(1)
    while True:
        api.save(root, iteration, RunState(trainer.models, config, pstate, trainer.optimizer,
                                           trainer.scheduler, 4 * iteration, 0))
        iteration += 1


def test_kill_during_save(tmp_path):
    """SIGKILLs at random moments of a process that saves again and again, at least 12 and
    until 3 have landed inside a save (its temp files left behind; a fast machine saves this
    tiny model in a few ms, so a fixed 12 kills could miss): the tracker always names a
    complete, checksum-valid checkpoint, and stale temp files are removed."""
    from megatron.arguments import parse_args
    from megatron.mpu import single_process_state
    from megatron.checkpointing import api
    from megatron.checkpointing.formats import RunState
    from megatron.checkpointing.torch_format import read_rank_file
    from megatron.checkpointing.tracker import read_tracker
    from megatron.training.parallelize import build_model
    from megatron.training.trainer import Trainer

    config, _ = parse_args(tiny_argv("x", tmp_path, layers=2, hidden=64), world_size=1)
    config.model.padded_vocab_size = 4096
    pstate = single_process_state()
    trainer = Trainer(config, pstate, "cpu", build_model(
        config, pstate, "cpu", lambda **kw: pretrain_gpt.model_provider(config, None, **kw)), None)
    root, rng, inside, last = str(tmp_path / "ckpt"), random.Random(5), 0, 0
    for kills in range(1, 61):
        pid = os.fork()
        if pid == 0:
            try:
                _save_forever(root, last + 1, trainer, config, pstate)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        inside += any(".tmp." in n for _, _, names in os.walk(root) for n in names)
        tracked = read_tracker(root)
        if tracked is None:
            continue
        state = read_rank_file(api.detect(root), pstate)  # verifies the checksum
        assert state["iteration"] == tracked[0] >= last
        last = tracked[0]
        if kills >= 12 and inside >= 3:
            break
    assert last > 0 and inside >= 3, (last, inside, kills)
    api.save(root, last + 1, RunState(trainer.models, config, pstate, trainer.optimizer,
                                      trainer.scheduler))
    assert not [n for _, _, names in os.walk(root) for n in names if ".tmp." in n]


def test_merge_mp_partitions_checks_every_shape(saved, tmp_path, capsys):
    from tools import merge_mp_partitions
    out, _ = saved
    root = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", root)
    assert merge_mp_partitions.main(["--load", str(root), "--save", str(tmp_path / "good")]) == 0
    checkpoint_io.verify_checksum(model_file(tmp_path / "good"))
    state = safe_load(model_file(root))
    encoder = state["model"]["language_model"]["encoder"]
    encoder["layers.1.mlp.dense_h_to_4h.weight"] = encoder["layers.1.mlp.dense_h_to_4h.weight"][:100]
    checkpoint_io.save_file(state, model_file(root))
    capsys.readouterr()
    assert merge_mp_partitions.main(["--load", str(root), "--save", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layers.1.mlp.dense_h_to_4h.weight: the merged checkpoint " \
        "has shape (100, 32)" in err and "needs (128, 32)" in err, err


@pytest.mark.parametrize("damage, words", [
    (tracker_names_another_iteration, "holds iteration 2 but latest_checkpointed_iteration.txt says 6"),
    (nan_weight, "parameter language_model.encoder.layers.1.mlp.dense_4h_to_h.weight holds 1 "
                 "nan/inf values"),
    (flip_bytes, "does not match its checksum"),
    (flip_tensor_bytes_without_sidecar, "does not match the digest it carries"),
], ids=["iteration", "nan weight", "flipped bytes", "flipped, no sidecar"])
def test_merge_mp_partitions_runs_the_load_checks(saved, tmp_path, capsys, damage, words):
    """What --load refuses, merge_mp_partitions refuses: one line, exit 2, nothing written."""
    from tools import merge_mp_partitions
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0] / "ckpt", root)
    damage(root)
    capsys.readouterr()
    for fmt in ("torch", "torch_dist"):
        out = tmp_path / f"out-{fmt}"
        assert merge_mp_partitions.main(["--load", str(root), "--save", str(out),
                                         "--ckpt-format", fmt]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
        assert not out.exists()


def test_an_iteration_directory_given_itself_resumes_as_its_root(saved, capsys):
    from tests.gpt_setup import losses
    out, prefix = saved
    longer = ["--override-opt_param-scheduler"]  # 3 iterations, where 2 were planned
    via_root = pretrain_gpt.main(tiny_argv(prefix, out / "cache", "--load", out / "ckpt", *longer,
                                           iters=3))
    capsys.readouterr()
    given = out / "ckpt" / ITER
    direct = pretrain_gpt.main(tiny_argv(prefix, out / "cache", "--load", given, *longer, iters=3))
    assert [h["iteration"] for h in direct.history] == [3]
    assert losses(direct) == losses(via_root)
    assert f" > {given} has no latest_checkpointed_iteration.txt: it is loaded as one torch " \
           f"checkpoint directory, iteration 2" in capsys.readouterr().out


def test_torch_dist_of_ours_without_its_manifest_is_refused(tmp_path, capsys):
    """Our torch_dist checkpoint always has checksums.sha256; one without it is refused (unless
    --no-verify-checkpoint), whereas Megatron-Core's, which never has one, loads."""
    prefix = byte_dataset(tmp_path)
    root = tmp_path / "dist"
    flags = ["--ckpt-format", "torch_dist"]
    pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags, "--save", root, iters=2))
    os.remove(root / ITER / "checksums.sha256")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags, "--load", root, iters=3))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{root / ITER / 'checksums.sha256'} is missing, so the torch_dist checkpoint's files " \
           f"cannot be verified" in err, err
    state = pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags, "--load", root,
                                        "--no-verify-checkpoint", "--override-opt_param-scheduler",
                                        iters=3))
    assert [h["iteration"] for h in state.history] == [3]


def test_nan_in_torch_dist_optimizer_state_is_refused_at_load(tmp_path, capsys):
    """A torch_dist checkpoint whose Adam state holds a nan (re-written through DCP's own
    converters): refused at load naming the state, not trained on."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    prefix = byte_dataset(tmp_path)
    root, flags = tmp_path / "dist", ["--ckpt-format", "torch_dist", "--no-verify-checkpoint"]
    pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags, "--save", root, iters=2))
    directory, full = root / ITER, tmp_path / "full.pt"
    dcp_to_torch_save(directory, full)
    state = torch.load(full, weights_only=True)
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    state[key].view(-1)[7] = float("nan")
    torch.save(state, full)
    for name in os.listdir(directory):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(directory / name)
    torch_save_to_dcp(full, directory)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(tiny_argv(prefix, tmp_path / "cache", *flags, "--load", root,
                                    "--override-opt_param-scheduler", iters=3))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "optimizer state exp_avg of language_model.encoder.layers." in err, err
    assert "mlp.dense_4h_to_h.weight holds 1 nan/inf values" in err, err


def test_vocabulary_far_larger_than_the_tokenizer_is_refused(capsys):
    """A GPT-2-sized checkpoint with a byte-level tokenizer (same tokenizer type stored)."""
    from megatron.arguments import parse_args
    from megatron.training.checkpoint_setup import build_tokenizer_and_vocab
    config, _ = parse_args(tiny_argv("x", "c"), world_size=1)
    stored = {"model": {"padded_vocab_size": 50304, "make_vocab_size_divisible_by": 128},
              "data": {"tokenizer_type": "ByteLevelTokenizer"}}
    with pytest.raises(SystemExit) as exc:
        build_tokenizer_and_vocab(config, stored)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "has 50304 rows, far more than the tokenizer's 257 ids" in err, err
    stored["model"]["padded_vocab_size"] = 1024  # padded for TP 8: accepted
    build_tokenizer_and_vocab(config, stored)
    assert config.model.padded_vocab_size == 1024


def test_tokenizer_of_the_same_type_with_other_files_is_refused(saved, tmp_path, capsys):
    """A checkpoint of the 8000-entry test BPE resumed with another vocabulary's files (both
    GPT2BPETokenizer): refused, naming both digests and sizes; the right files (elsewhere,
    same content) still load."""
    from tests.data_setup import bpe_dir, other_bpe_dir
    out, prefix = saved

    def bpe(directory):
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", directory / "vocab.json",
                "--merge-file", directory / "merges.txt", "--make-vocab-size-divisible-by", "128"]

    root = tmp_path / "ckpt"
    pretrain_gpt.main(tiny_argv(prefix, out / "cache", "--save", root, *bpe(bpe_dir()), iters=1))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(tiny_argv(prefix, out / "cache", "--load", root, *bpe(other_bpe_dir()),
                                    iters=2))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{other_bpe_dir() / 'vocab.json'} (sha256 " in err, err
    assert "5000 ids) is not the one the checkpoint" in err, err
    assert "an embedding of 8064 rows" in err, err
    copy = tmp_path / "copy"
    shutil.copytree(bpe_dir(), copy)
    state = pretrain_gpt.main(tiny_argv(prefix, out / "cache", "--load", root, "--finetune",
                                        *bpe(copy), iters=1))
    assert [h["iteration"] for h in state.history] == [1]


def _mutate_checkpoint(rng, root):
    """One seeded damage to the model file; returns its kind."""
    path = model_file(root)
    kind = rng.choice(["flip", "flip, no sidecar", "truncate", "nan", "inf", "iteration"])
    if kind.startswith("flip") or kind == "truncate":
        data = bytearray(open(path, "rb").read())
        if kind == "truncate":
            data = data[:rng.randrange(len(data))]
        for i in rng.sample(range(len(data)), rng.randint(1, 64)) if kind != "truncate" else ():
            data[i] ^= rng.randrange(1, 256)
        open(path, "wb").write(bytes(data))
        if kind != "flip":
            os.remove(path + ".sha256")
        return kind
    state = safe_load(path)
    if kind == "iteration":
        state["iteration"] = rng.choice([0, 1, 3, 7])
    else:
        weights = [t for t in state["model"]["language_model"]["encoder"].values() if t.numel() > 1]
        tensor = rng.choice(weights)
        tensor.view(-1)[rng.randrange(tensor.numel())] = float(kind)
    checkpoint_io.save_file(state, path)  # a valid sidecar and digest: the content is the problem
    return kind


def test_fuzzed_checkpoint_mutations_are_refused(saved, tmp_path, capsys):
    """60 seeded damages to a checkpoint (flipped bytes with and without the sidecar, truncation,
    a nan/inf weight, a stored iteration other than the tracker's): each is one CheckpointError
    line, or (a flip that left the content whole) loads exactly the original tensors."""
    from megatron.checkpointing import api
    from megatron.checkpointing.finite import finite_model_state
    from megatron.checkpointing.model_file import from_megatron_layout
    from megatron.checkpointing.torch_format import read_rank_file
    from megatron.mpu import single_process_state
    out, _ = saved
    rng, pstate, counts = random.Random(24), single_process_state(), {}
    original = from_megatron_layout(safe_load(model_file(out / "ckpt"))["model"])
    for case in range(60):
        root = tmp_path / f"c{case}"
        shutil.copytree(out / "ckpt", root)
        kind = _mutate_checkpoint(rng, root)
        try:
            state = read_rank_file(api.detect(str(root)), pstate)
            flat = finite_model_state(from_megatron_layout(state["model"]), str(root))
        except CheckpointError as err:
            assert "\n" not in str(err), str(err)
            counts[f"{kind}: refused"] = counts.get(f"{kind}: refused", 0) + 1
            continue
        assert all(torch.equal(flat[k], v) for k, v in original.items()), (case, kind)
        counts[f"{kind}: content intact"] = counts.get(f"{kind}: content intact", 0) + 1
    with capsys.disabled():
        print(f"\ncheckpoint mutations: {dict(sorted(counts.items()))}")
    assert sum(v for k, v in counts.items() if k.endswith("refused")) >= 55, counts


def test_temp_file_clean_up_touches_only_files_of_dead_processes(tmp_path):
    child = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        live = [tmp_path / f"model_optim_rng.pt.tmp.{pid}" for pid in (os.getpid(), child.pid)]
        gone = tmp_path / "sub" / f"model_optim_rng.pt.tmp.{dead.pid}"
        gone.parent.mkdir()
        for path in live + [gone]:
            path.write_bytes(b"partial")
        assert checkpoint_io.remove_stale_temp_files(str(tmp_path)) == 1
        assert all(p.exists() for p in live) and not gone.exists()
    finally:
        child.kill()
        child.wait()


def test_save_lock_holder_stale_and_foreign_hosts(tmp_path, capsys):
    """The lock names its holder; a second lock in the same process is refused; a lock file
    of a dead process is taken over with a notice; one of another host, or of a live process
    whose flock is gone, is never taken over."""
    import json
    from megatron.checkpointing.lock import LOCK_FILE, SaveLock
    first = SaveLock(str(tmp_path))
    assert first.acquire() is None
    with pytest.raises(CheckpointError, match=rf"in use by another run: pid {os.getpid()} on host"):
        SaveLock(str(tmp_path)).acquire()
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    holder = {"pid": dead.pid, "host": __import__("socket").gethostname(), "start_time": 1.0}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    lock = SaveLock(str(tmp_path))
    assert f"took over the stale lock of pid {dead.pid}" in lock.acquire()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / LOCK_FILE).write_text(json.dumps(dict(holder, host="elsewhere")))
    with pytest.raises(CheckpointError, match="locked by pid .* on host elsewhere .* remove"):
        SaveLock(str(tmp_path)).acquire()
    assert (tmp_path / LOCK_FILE).exists()  # never removed for another host's run
    alive = subprocess.Popen(["sleep", "30"])  # a live holder whose flock is gone (e.g. over NFS)
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps(dict(holder, pid=alive.pid)))
        with pytest.raises(CheckpointError, match=f"locked by pid {alive.pid} .* may still be running"):
            SaveLock(str(tmp_path)).acquire()
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize("damage, words", [
    (flip_tensor_bytes_without_sidecar, "does not match the digest it carries"),
    (tracker_names_another_iteration, "holds iteration 2 but latest_checkpointed_iteration.txt says 6"),
    (nan_weight, "holds 1 nan/inf values"),
], ids=["flipped, no sidecar", "tracker", "nan weight"])
def test_refused_checkpoint_exits_with_loader_workers(saved, tmp_path, damage, words):
    """As a user runs it (a subprocess, the default --num-workers 2): one line, exit 2, within
    30 s, no process left behind."""
    from tests.reliability_setup import run_entry
    out, prefix = saved
    root = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", root)
    damage(root)
    rc, err, seconds = run_entry(tiny_argv(prefix, out / "cache", "--load", root, "--num-workers",
                                           "2", iters=3), timeout=90)
    assert rc == 2 and len(err) == 1 and words in err[0] and seconds < 30, (rc, err, seconds)


def test_inference_reshard_refusal_names_inference_and_the_fix(saved, tmp_path, capsys):
    """A checkpoint whose file says TP 2 but whose rank-1 file is missing: generation on one
    process re-shards it in memory to TP 1 (no --universal-checkpoint involved) and refuses
    in one line that says so and names both ways out."""
    from tools import generate_samples_gpt
    out, _ = saved
    root = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", root)
    state = safe_load(model_file(root))
    state["parallel"]["tensor_model_parallel_size"] = 2
    checkpoint_io.save_file(state, model_file(root))
    with pytest.raises(SystemExit) as exit_info:
        generate_samples_gpt.main(["--load", str(root), "--prompt", "a", "--out-seq-length", "2",
                                   "--greedy"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--universal-checkpoint" not in err, err
    for words in ("for inference re-shards it in memory to TP 1 x PP 1", "lacks the files",
                  "--tensor-model-parallel-size", "tools/merge_mp_partitions.py"):
        assert words in err, err
