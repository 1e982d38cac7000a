"""Megatron-LM / Megatron-DeepSpeed flag names, defaults and data order (issue 11, deliverables 1 and 6)."""
import numpy as np
import pytest
import torch

import pretrain_gpt
from megatron.arguments import parse_args
from megatron.config import ModelConfig
from megatron.config import data_paths
from megatron.data import gpt_dataset as gd
from megatron.data.mock_dataset import MockGPTDataset
from megatron.model import transformer
from megatron.optimizer.grad_scaler import ConstantGradScaler, build_grad_scaler
from megatron.optimizer.lr_scheduler import build_lr_scheduler
from tests.gpt_setup import one_thread

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--train-iters", "4", "--lr", "1e-3"]


def parse(*extra, world_size=1):
    return parse_args(MODEL + list(extra), parser=pretrain_gpt.build_pretrain_parser(),
                      world_size=world_size)[0]


def test_megatron_names_map_onto_our_flags():
    c = parse()
    assert c.data.tokenizer_type == "GPT2BPETokenizer"  # pretrain_gpt's default, as Megatron
    c = parse("--recompute-activations", "--use-flash-attn", "--no-query-key-layer-scaling",
              "--data-impl", "mmap")
    assert (c.model.recompute_granularity, c.model.attention_impl) == ("selective", "sdpa")
    assert c.model.apply_query_key_layer_scaling is False
    c = parse("--recompute-granularity", "full", "--recompute-method", "block",
              "--recompute-num-layers", "1", "--attention-backend", "unfused")
    assert (c.model.recompute_method, c.model.checkpoint_num_layers) == ("block", 1)
    assert c.model.attention_impl == "torch"
    for backend, impl in (("flash", "sdpa"), ("fused", "fused"), ("local", "torch"), ("auto", "auto")):
        assert parse("--attention-backend", backend).model.attention_impl == impl


def test_lazy_and_cached_data_impl_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--data-impl", "lazy")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "re-run tools/preprocess_data.py" in err


def test_tokens_flags_and_skip_ranges():
    c = parse("--global-batch-size", "4", "--train-tokens", "200", "--lr-decay-tokens", "480")
    assert c.training.train_iters == 4  # min(4, ceil(ceil(200 / 16) / 4)) = min(4, 4)
    c = parse("--global-batch-size", "4", "--train-tokens", "100")
    assert c.training.train_iters == 2  # ceil(100 / 16) = 7 samples -> 2 iterations
    c = parse("--global-batch-size", "4", "--lr-decay-tokens", "480", "--lr-warmup-iters", "0")
    scheduler = build_lr_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                   c.optimizer, c.training)
    assert scheduler.decay_steps == 30  # 480 tokens / 16 per sample, not 4 iterations x 4
    c = parse("--skip-train-iteration-range", "2-3", "7-7")
    assert [i for i in range(1, 9) if c.training.skipped_iteration(i)] == [2, 3, 7]
    with pytest.raises(SystemExit):
        parse("--skip-train-iteration-range", "5-2")


def test_loss_scale_with_bf16_is_a_constant_scaler():
    c = parse("--bf16", "--loss-scale", "1024")
    scaler = build_grad_scaler(c.optimizer, c.training.fp16, c.training.bf16)
    assert isinstance(scaler, ConstantGradScaler) and scaler.scale.item() == 1024
    assert build_grad_scaler(parse("--bf16").optimizer, False, True) is None


def test_ddp_impl_torch_with_pipelining_falls_back_with_a_notice(capsys):
    c = parse("--DDP-impl", "torch", "--pipeline-model-parallel-size", "2", world_size=2)
    assert c.parallel.DDP_impl == "local"
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "--DDP-impl local" in out[0]


@pytest.mark.parametrize("method,checkpointed", [("uniform", [0, 1, 2, 3]), ("block", [0, 1]),
                                                   (None, [0, 1, 2, 3])])
def test_recompute_methods_checkpoint_the_right_layers_with_equal_grads(monkeypatch, method,
                                                                          checkpointed):
    cfg = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8,
               max_position_embeddings=8, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    plain = transformer.ParallelTransformer(ModelConfig(**cfg), None, 0, 4, True)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    recompute = transformer.ParallelTransformer(
        ModelConfig(**cfg, recompute_granularity="full", recompute_method=method,
                    checkpoint_num_layers=2 if method == "block" else 1), None, 0, 4, True)
    recompute.load_state_dict(plain.state_dict())
    seen, real = [], transformer.checkpoint

    def spy(run, hidden, mask):
        seen.append(run)
        return real(run, hidden, mask)

    monkeypatch.setattr(transformer, "checkpoint", spy)
    x = torch.randn(8, 2, 32, requires_grad=True)  # as the embedding output
    plain(x).sum().backward()
    recompute(x).sum().backward()
    assert len(seen) == len(checkpointed)
    for (name, a), b in zip(plain.named_parameters(), recompute.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_mock_data_trains_and_logs_params_norm_and_zeros(capsys):
    argv = MODEL + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "97",
                    "--global-batch-size", "2", "--log-interval", "1", "--eval-iters", "0",
                    "--log-params-norm", "--log-num-zeros-in-grad", "--num-workers", "0",
                    "--skip-train-iteration-range", "2-3", "--hidden-dropout", "0",
                    "--attention-dropout", "0"]
    with one_thread():
        state = pretrain_gpt.main(argv)
    assert [h["iteration"] for h in state.history] == [1, 4]
    assert state.consumed_train == 8
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 2 and all(" num zeros: " in x and " params norm: " in x for x in lines)
    assert lines[0].index("grad norm") < lines[0].index("num zeros") < lines[0].index("params norm")
    assert "skipped iteration 2" in out and "skipped iteration 3" in out
    a, b = MockGPTDataset(0, 10, 16, 97, 1), MockGPTDataset(0, 10, 16, 97, 1)
    assert np.array_equal(a[3]["text"], b[3]["text"]) and a[3]["text"].max() < 97


def test_megatron_deepspeed_cutoff_changes_a_last_epoch_at_ninety_percent(tmp_path):
    sizes = np.full(100, 10, dtype=np.int32)
    sizes[0] = 11  # 1001 tokens: 100 samples of 10 per epoch
    docs = np.arange(100)
    # 190 samples: a second epoch used for 90 of its 100 samples
    assert not gd.separate_last_epoch(2, 1001, 10, 190, 0.80)
    assert gd.separate_last_epoch(2, 1001, 10, 190, 0.95)
    assert gd.separate_last_epoch(2, 1001, 10, 170, 0.80)  # 70%: both separate
    lm = gd.build_index_arrays(docs, sizes, 190, 10, 1234, 0.80)
    ds = gd.build_index_arrays(docs, sizes, 190, 10, 1234, 0.95)
    assert not np.array_equal(lm[2], ds[2])
    assert np.array_equal(lm[0], gd.build_index_arrays(docs, sizes, 190, 10, 1234)[0])
    low = [gd.build_index_arrays(docs, sizes, 170, 10, 1234, t) for t in (0.80, 0.95)]
    assert all(np.array_equal(x, y) for x, y in zip(*low))
    # the cutoff is part of the cache description: the other cutoff's cache is never used
    assert gd._describe("p", docs, sizes, 190, 10, 1, 0.80) != gd._describe("p", docs, sizes, 190, 10, 1, 0.95)
    assert parse("--separate-last-epoch-threshold", "0.95").data.separate_last_epoch_threshold == 0.95


def test_blend_weights_are_normalised_with_a_left_to_right_sum():
    weights = [0.1] * 10
    total = 0.0
    for w in weights:
        total += w
    assert total != 1.0  # a compensated sum (math.fsum, Python 3.12's sum) gives exactly 1.0
    _, normalised = data_paths.parse_data_prefix([x for w in weights for x in (str(w), "p")])
    assert normalised == [w / total for w in weights]


def test_tools_accept_megatron_spellings():
    from tools import generate_samples_gpt, merge_mp_partitions, preprocess_data
    args = preprocess_data.get_args(["--input", "x.json", "--output-prefix", "y",
                                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab", "v.json",
                                     "--merge-file", "m.txt", "--dataset-impl", "mmap"])
    assert args.vocab_file == "v.json"
    ns, _ = generate_samples_gpt.get_parser().parse_known_args(["--load", "c", "--recompute"])
    assert ns.recompute
    args = merge_mp_partitions.get_args([
        "--model-type", "GPT", "--tensor-model-parallel-size", "2",
        "--target-tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--target-pipeline-model-parallel-size", "1", "--num-layers", "24", "--hidden-size", "1024",
        "--num-attention-heads", "16", "--seq-length", "1024", "--max-position-embeddings", "1024",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt",
        "--load", "in", "--save", "out"])
    assert (args.load, args.save, args.target_tensor_model_parallel_size) == ("in", "out", 1)
    with pytest.raises(SystemExit):
        merge_mp_partitions.get_args(["--load", "in", "--save", "out", "--num-layerz", "2"])


def test_weighted_split_paths_blend_document_ranges_per_split(tmp_path):
    from megatron.data.weighted_split import build_weighted_split_dataset, parse_weighted_split_paths
    from tests.gpt_setup import bpe_flags, preprocess_wiki
    name, entries = parse_weighted_split_paths("--train-weighted-split-paths",
                                               ["TRAIN: 0.3 0:0.5 a, 0.7 0.5:1 b"])
    assert (name, entries) == ("TRAIN", [(0.3, 0.0, 0.5, "a"), (0.7, 0.5, 1.0, "b")])
    for bad in (["TRAIN 1 0:1 a"], ["T: 1 0.5:0.2 a"], ["T: x 0:1 a"], ["A: 1 0:1 a", "B: 1 0:1 b"]):
        with pytest.raises(SystemExit):
            parse("--train-weighted-split-paths", *bad)
    prefix = preprocess_wiki(tmp_path, docs=4)
    ds = build_weighted_split_dataset("train", "TRAIN", [(0.3, 0.0, 0.5, prefix),
                                                         (0.7, 0.5, 1.0, prefix)],
                                      20, 16, 1234, str(tmp_path / "cache"))
    assert len(ds) == 20 and np.bincount(ds.dataset_index).tolist() == [6, 14]
    assert [d.doc_idx.min() for d in ds.datasets] == [0, 2]
    assert [d.doc_idx.max() for d in ds.datasets] == [1, 3]
    small = build_weighted_split_dataset("train", "TRAIN", [(1.0, 0.0, 1.0, prefix)], 4, 16, 1234,
                                         str(tmp_path / "cache"), vocab_size=100)
    with pytest.raises(gd.DatasetError, match="outside the vocabulary of size 100"):
        small[0]  # the bpe-8k ids of the corpus do not fit a vocabulary of 100
    argv = MODEL + ["--train-weighted-split-paths", f"TRAIN: 0.3 0:0.5 {prefix}, 0.7 0.5:1 {prefix}",
                    "--valid-weighted-split-paths", f"VALID: 1 0.5:1 {prefix}",
                    "--data-cache-path", str(tmp_path / "cache"), "--num-workers", "0",
                    "--global-batch-size", "2", "--eval-iters", "1", "--eval-interval", "2",
                    *bpe_flags("--make-vocab-size-divisible-by", "16")]
    with one_thread():
        state = pretrain_gpt.main(argv)
    assert len(state.history) == 4 and state.validation
