"""tools/merge_mp_partitions.py: re-sharding is lossless and re-sharded models compute the same.

Single-process checks build checkpoints by hand (TP/PP/virtual-pipeline layouts
of one random model). One spawn of 4 gloo ranks trains a 2-layer model at
TP=2 x PP=2 with pretrain_gpt.py, merges it to TP=1/PP=1 (and TP=2/PP=1), and
compares on every layout: logits of a batch, the WIKITEXT103 evaluation loss
(TP=2 x PP=2, TP=1 x DP=4 and one process) and greedy generation (TP=2 vs one process);
and evaluates a hand-made PP=2 x 2 virtual-chunk checkpoint against its merged copy.
"""
import hashlib
import json
import os
import re

import pytest
import torch
import torch.distributed as dist

from megatron.config import Config, ModelConfig, ParallelConfig
from megatron.model import GPTModel
from megatron.checkpointing import megatron_legacy
from megatron.checkpointing.io import save_file
from megatron.mpu import model_parallel_seed, single_process_state
from megatron.mpu.layers import shard_of
from megatron.checkpointing.model_file import from_megatron_layout, to_megatron_layout
from megatron.pipeline.layout import pipeline_layout
from tests.data_setup import bpe_dir
from tests.gpt_setup import preprocess_wiki
from tests.distributed.run_ranks import run_ranks
from megatron.checkpointing import reshard
from tools import merge_mp_partitions as mmp

LAYER = re.compile(r"^(language_model\.encoder\.layers\.)(\d+)(\..+)$")


def model_config(num_layers=4, padded_vocab_size=384, heads=4) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=heads,
                       seq_length=16, max_position_embeddings=32,
                       padded_vocab_size=padded_vocab_size, layer_norm_fusion=False,
                       masked_softmax_fusion=False)


def full_state(cfg: ModelConfig):
    model_parallel_seed(1234, 0)
    model = GPTModel(cfg)
    model.init_weights(21)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_layout(root, full, cfg, tp, pp, vpp=1, iteration=5):
    """Save `full` split as a training run at TP x PP (x virtual chunks) would have saved it."""
    for t in range(tp):
        for p in range(pp):
            state = {"iteration": iteration, "checkpoint_version": 3.0,
                     "config": Config(model=cfg, parallel=ParallelConfig(
                         tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)).to_dict(),
                     "parallel": {"tensor_model_parallel_size": tp,
                                  "pipeline_model_parallel_size": pp,
                                  "virtual_pipeline_model_parallel_size": vpp},
                     "optimizer": {"unused": torch.zeros(1)}}
            for v in range(vpp):
                flat = _chunk(full, cfg.num_layers, t, tp, p, pp, v, vpp)
                state["model" if vpp == 1 else f"model{v}"] = to_megatron_layout(flat)
            rank_dir = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            path = os.path.join(root, f"iter_{iteration:07d}", rank_dir, "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path))
            save_file(state, path)  # as a training run writes it: sidecar and digest
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _chunk(full, num_layers, t, tp, p, pp, v, vpp):
    chunk = pipeline_layout(num_layers, pp, vpp).chunk(p, v)
    offset, count = chunk.layer_offset, chunk.num_layers
    first, last = p == 0 and v == 0, p == pp - 1 and v == vpp - 1
    flat = {}
    for name, tensor in full.items():
        dim = reshard.legacy_partition_dim(name)
        piece = tensor if dim is None else shard_of(tensor, dim, 1, t, tp)
        match = LAYER.match(name)
        if match:
            index = int(match.group(2))
            if offset <= index < offset + count:
                flat[f"{match.group(1)}{index - offset}{match.group(3)}"] = piece
        elif "final_layernorm" in name:
            if last:
                flat[name] = piece
        elif first:
            flat[name] = piece
        if name == reshard.WORD and last and not first:
            flat[reshard.HEAD] = piece.clone()
    return flat


def read_layout(root, iteration=5):
    """{(tp, pp): flat model state} and one state of a written checkpoint."""
    directory = os.path.join(root, f"iter_{iteration:07d}")
    out, state = {}, None
    for rank_dir in sorted(os.listdir(directory)):
        match = reshard.RANK_DIR.match(rank_dir)
        path = os.path.join(directory, rank_dir, "model_optim_rng.pt")
        state = megatron_legacy.safe_load(path)
        out[(int(match.group(1)), int(match.group(2) or 0))] = from_megatron_layout(state["model"])
    return out, state


def tree_digest(root) -> str:
    digest = hashlib.sha256()
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            digest.update(name.encode())
            digest.update(open(os.path.join(folder, name), "rb").read())
    return digest.hexdigest()


# -- single process ---------------------------------------------------------------------
def test_legacy_partition_dims_match_the_gpt2_model_attributes():
    model_parallel_seed(1234, 0)
    for pre, post in ((True, True), (False, True)):
        model = GPTModel(model_config(), pre_process=pre, post_process=post)
        meta = model.sharding_metadata()  # what new checkpoints store instead of the table
        for name, param in model.named_parameters():
            expected = param.partition_dim if param.tensor_model_parallel else None
            assert reshard.legacy_partition_dim(name) == expected, name
            assert meta[name]["dim"] == expected and meta[name]["groups"] == 1, name


@pytest.mark.parametrize("source, target", [
    ((2, 2, 1), (1, 1)), ((1, 1, 1), (2, 2)), ((2, 1, 1), (4, 4)), ((4, 2, 2), (2, 1)),
    ((1, 2, 2), (1, 4)), ((2, 4, 1), (1, 2))])
def test_reshard_is_lossless(tmp_path, source, target):
    cfg = model_config()
    full = full_state(cfg)
    tp, pp, vpp = source
    write_layout(tmp_path / "src", full, cfg, tp, pp, vpp)
    before = tree_digest(tmp_path / "src")
    assert mmp.main(["--load", str(tmp_path / "src"), "--save", str(tmp_path / "out"),
                     "--target-tensor-model-parallel-size", str(target[0]),
                     "--target-pipeline-model-parallel-size", str(target[1])]) == 0
    assert tree_digest(tmp_path / "src") == before  # the input is only read
    got, state = read_layout(tmp_path / "out")
    expected = {(t, p): _chunk(full, cfg.num_layers, t, target[0], p, target[1], 0, 1)
                for t in range(target[0]) for p in range(target[1])}
    assert set(got) == set(expected)
    for key in expected:
        assert set(got[key]) == set(expected[key]), key
        for name in expected[key]:
            assert torch.equal(got[key][name], expected[key][name]), (key, name)
    assert "optimizer" not in state and state["iteration"] == 5
    assert state["parallel"] == {"tensor_model_parallel_size": target[0],
                                 "pipeline_model_parallel_size": target[1],
                                 "virtual_pipeline_model_parallel_size": 1}
    assert state["config"]["parallel"]["tensor_model_parallel_size"] == target[0]
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp" in n]


def test_reshard_errors(tmp_path, capsys):
    cfg = model_config(padded_vocab_size=258, heads=4)
    write_layout(tmp_path / "src", full_state(cfg), cfg, 1, 1)

    def run(*extra):
        code = mmp.main(["--load", str(tmp_path / "src")] + list(extra))
        return code, capsys.readouterr().err

    code, err = run("--save", str(tmp_path / "a"), "--target-tensor-model-parallel-size", "8")
    assert code == 2 and "--num-attention-heads (4)" in err
    code, err = run("--save", str(tmp_path / "a"), "--target-tensor-model-parallel-size", "4",
                    "--target-pipeline-model-parallel-size", "1")
    assert code == 2 and "padded vocabulary (258 rows)" in err and len(err.splitlines()) == 1
    code, err = run("--save", str(tmp_path / "a"), "--target-pipeline-model-parallel-size", "3")
    assert code == 2 and "not divisible by --target-pipeline-model-parallel-size 3" in err
    code, err = run("--save", str(tmp_path / "src"))
    assert code == 2 and "is the --load directory" in err
    assert run("--save", str(tmp_path / "b"))[0] == 0
    code, err = run("--save", str(tmp_path / "b"))
    assert code == 2 and "already exists" in err
    assert not os.path.exists(tmp_path / "a")
    write_layout(tmp_path / "broken", full_state(cfg), cfg, 2, 1)
    os.remove(tmp_path / "broken" / "iter_0000005" / "mp_rank_01" / "model_optim_rng.pt")
    assert mmp.main(["--load", str(tmp_path / "broken"), "--save", str(tmp_path / "c")]) == 2
    assert "incomplete" in capsys.readouterr().err


# -- 4 ranks: train at TP=2 x PP=2, merge, compare ------------------------------------------
def _train_flags(data_prefix, vocab, merges, cache):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "1e-3", "--data-path", data_prefix,
            "--split", "100,0,0", "--eval-iters", "0", "--num-workers", "0",
            "--data-cache-path", cache, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", vocab, "--merge-file", merges, "--log-interval", "100",
            "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]


def _logits_tp2_pp2(ckpt, tok_flags, tokens):
    """Logits of `tokens` from the TP=2 x PP=2 checkpoint, pipelined by hand."""
    from megatron.mpu import initialize_model_parallel
    from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab,
                                                load_inference_models, parse_inference_args)
    from tasks.main import get_parser
    config, _, stored = parse_inference_args(get_parser(), [
        "--load", ckpt, "--task", "LAMBADA", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2"] + tok_flags)
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate = initialize_model_parallel(2, 2)
    (model,), _ = load_inference_models(config, pstate, "cpu", parallel_output=False,
                                        vocab_size=tokenizer.vocab_size)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        if pstate.is_first_stage():
            dist.send(model(tokens, positions).contiguous(), pstate.next_rank)
            return None
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], 64)
        dist.recv(hidden, pstate.prev_rank)
        model.set_input_tensor(hidden)
        return model(tokens, positions)


def _single_process(ckpt, tok_flags, tokens, wiki):
    """Rank 0 alone: logits, evaluation loss and greedy tokens of the merged TP=1 model."""
    from megatron.text_generation import generate
    from megatron.training.checkpoint_setup import (build_tokenizer_and_vocab,
                                                load_inference_models, parse_inference_args)
    from tasks.main import build_dataset, get_parser, metrics_of
    from tasks.zeroshot_gpt.evaluate import evaluate
    argv = ["--load", ckpt, "--task", "WIKITEXT103", "--valid-data", wiki,
            "--micro-batch-size", "2"] + tok_flags
    config, ns, stored = parse_inference_args(get_parser(), argv)
    tokenizer = build_tokenizer_and_vocab(config, stored)
    pstate = single_process_state()
    (model,), _ = load_inference_models(config, pstate, "cpu", parallel_output=False,
                                        vocab_size=tokenizer.vocab_size)
    dataset = build_dataset(ns, tokenizer, config.model.seq_length)
    loss = metrics_of("WIKITEXT103", dataset, evaluate(
        "WIKITEXT103", dataset, [model], config, pstate, "cpu", tokenizer.eod))["avg loss"]
    if tokens is None:
        return loss
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, positions)
    greedy = generate(model, tokenizer, ["The", "In the year"], 8, greedy=True, eod_stop=False)
    return logits, loss, greedy


def _interleaved_losses(rank, tmp, tok_flags, wiki_flags, wiki):
    """A random 4-layer model saved at PP=2 x 2 virtual chunks: evaluation there (DP=2, the
    interleaved schedule) and, merged by the tool, in one process."""
    from tasks import main as tasks_main
    vpp, merged = os.path.join(tmp, "vpp"), os.path.join(tmp, "vpp_merged")
    if rank == 0:
        cfg = model_config(num_layers=4, padded_vocab_size=8064)
        write_layout(vpp, full_state(cfg), cfg, 1, 2, vpp=2)
        assert mmp.main(["--load", vpp, "--save", merged]) == 0
    dist.barrier()
    loss = tasks_main.main(["--load", vpp, "--pipeline-model-parallel-size", "2",
                            "--num-layers-per-virtual-pipeline-stage", "1"]
                           + wiki_flags + tok_flags)["avg loss"]
    return loss, (_single_process(merged, tok_flags, None, wiki) if rank == 0 else None)


def _worker(rank, world_size, tmp, data_prefix, vocab, merges, wiki):
    import pretrain_gpt
    from tasks import main as tasks_main
    from tools import generate_samples_gpt
    tok_flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                 "--merge-file", merges]
    ckpt, m11, m21 = (os.path.join(tmp, n) for n in ("ckpt", "m11", "m21"))
    pretrain_gpt.main(_train_flags(data_prefix, vocab, merges, os.path.join(tmp, "cache")) + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--train-iters", "8", "--save", ckpt])
    if rank == 0:
        assert mmp.main(["--load", ckpt, "--save", m11]) == 0
        assert mmp.main(["--load", ckpt, "--save", m21,
                         "--target-tensor-model-parallel-size", "2"]) == 0
    dist.barrier()
    tokens = torch.randint(0, 8000, (2, 32), generator=torch.Generator().manual_seed(3))
    result = {"logits": _logits_tp2_pp2(ckpt, tok_flags, tokens)}
    wiki_flags = ["--task", "WIKITEXT103", "--valid-data", wiki, "--micro-batch-size", "2"]
    result["loss_tp2_pp2"] = tasks_main.main(["--load", ckpt, "--tensor-model-parallel-size", "2",
                                              "--pipeline-model-parallel-size", "2"]
                                             + wiki_flags + tok_flags)["avg loss"]
    result["loss_dp4"] = tasks_main.main(["--load", m11] + wiki_flags + tok_flags)["avg loss"]
    result["loss_cp2"] = tasks_main.main(["--load", m11, "--context-parallel-size", "2"]
                                         + wiki_flags + tok_flags)["avg loss"]
    records = generate_samples_gpt.main(["--load", m21, "--tensor-model-parallel-size", "2",
                                         "--prompt", "The", "--prompt", "In the year", "--greedy",
                                         "--out-seq-length", "8", "--micro-batch-size", "2"]
                                        + tok_flags)
    result["greedy_tp2"] = [r["tokens"] for r in records]
    result["interleaved"] = _interleaved_losses(rank, tmp, tok_flags, wiki_flags, wiki)
    if rank == 0:
        result["single"] = _single_process(m11, tok_flags, tokens, wiki)
    return result


@pytest.fixture
def tiny_corpus(tmp_path):
    """The first articles of the test corpus preprocessed with the test vocabulary, and the
    first 300 words of the first one as a WikiText-style file."""
    prefix = preprocess_wiki(tmp_path, docs=4)
    wiki = tmp_path / "wiki.tokens"
    text = json.loads((tmp_path / "corpus.jsonl").read_text().splitlines()[0])["text"]
    wiki.write_text(" ".join(text.split(" ")[:300]))
    return prefix, str(bpe_dir() / "vocab.json"), str(bpe_dir() / "merges.txt"), str(wiki)


def test_merged_checkpoint_computes_like_the_sharded_one(tmp_path, tiny_corpus):
    data_prefix, vocab, merges, wiki = tiny_corpus
    results = run_ranks(_worker, 4, str(tmp_path), data_prefix, vocab, merges, wiki, timeout=240)
    logits, loss, greedy = results[0]["single"]
    for rank in (2, 3):  # the last pipeline stage
        torch.testing.assert_close(results[rank]["logits"], logits, rtol=1e-4, atol=1e-4)
    for r in results:
        assert r["loss_tp2_pp2"] == pytest.approx(loss, rel=1e-5)
        assert r["loss_dp4"] == pytest.approx(loss, rel=1e-5)
        assert r["loss_cp2"] == pytest.approx(loss, rel=1e-5)  # CP ranks evaluate as DP ranks
        assert r["greedy_tp2"] == greedy
        assert r["interleaved"][0] == pytest.approx(results[0]["interleaved"][1], rel=1e-5)
    assert 0.0 < loss < 9.1  # trained a little: below ln(8000) = 8.99 + noise


# -- LLaMA / BLOOM layouts: TP 2 -> 1 -> 4 by the saved sharding metadata ---------------------
SPEC_ARCHS = {
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  group_query_attention=True, num_query_groups=2,
                  untie_embeddings_and_output_weights=True, add_bias_linear=False),
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    # the rest of the spec: q/k layer norms (their gradients are summed over TP), 1 + w
    # norms, GeGLU, --kv-channels apart from hidden / heads, a QKV bias alone, RoPE on half
    "mixed": dict(qk_layernorm=True, apply_layernorm_1p=True, activation="geglu", kv_channels=8,
                  add_bias_linear=False, add_qkv_bias=True, position_embedding_type="rope",
                  rotary_percent=0.5),
    # multi-latent attention (replicated down-projections and norms, heads split), with
    # and without query compression, YaRN's mscales, values narrower than queries / keys
    "mla": dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                qk_pos_emb_head_dim=8, v_head_dim=4, position_embedding_type="rope",
                normalization="RMSNorm", activation="swiglu", add_bias_linear=False,
                rope_scaling_type="yarn", rope_scaling_factor=4.0,
                rope_scaling_original_max_position_embeddings=4, mscale=0.9,
                mscale_all_dim=0.7),
    "mla-no-q-lora": dict(multi_latent_attention=True, kv_lora_rank=8, qk_head_dim=8,
                          qk_pos_emb_head_dim=4, v_head_dim=12, position_embedding_type="rope",
                          normalization="RMSNorm"),
}


def spec_config(arch) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                       max_position_embeddings=16, padded_vocab_size=128, hidden_dropout=0.0,
                       attention_dropout=0.0, **SPEC_ARCHS[arch])


def write_tp_layout(root, full, cfg, tp):
    """`full` saved at TP = tp (PP = 1) with its sharding metadata, as a training run saves it."""
    from megatron.mpu.sharding import shard_tensor
    meta = GPTModel(cfg).sharding_metadata()
    for t in range(tp):
        flat = {name: shard_tensor(tensor, meta[name], t, tp).clone()
                for name, tensor in full.items()}
        state = {"iteration": 5, "config": Config(model=cfg, parallel=ParallelConfig(
                     tensor_model_parallel_size=tp)).to_dict(),
                 "parallel": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1,
                              "virtual_pipeline_model_parallel_size": 1},
                 "model": to_megatron_layout(flat), "sharding": meta}
        path = os.path.join(root, "iter_0000005", f"mp_rank_{t:02d}", "model_optim_rng.pt")
        os.makedirs(os.path.dirname(path))
        save_file(state, path)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")


def _spec_tokens():
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    return ids, torch.arange(16).unsqueeze(0).expand(2, 16)


def _logits_and_grads(model):
    """Logits of the spec tokens, and each parameter's gradient of the summed token losses."""
    ids, positions = _spec_tokens()
    model.zero_grad()
    model(ids, positions, labels=ids).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        return model.eval()(ids, positions), grads


def _logits_at(root, tp):
    """Logits (gathered over the vocabulary) and gradients of the TP = tp checkpoint under `root`."""
    from megatron.mpu import initialize_model_parallel
    pstate = initialize_model_parallel(tp, 1)
    state = megatron_legacy.safe_load(os.path.join(root, "iter_0000005",
                                                   f"mp_rank_{pstate.tp_rank:02d}", "model_optim_rng.pt"))
    cfg = Config.from_dict(state["config"]).model
    model = GPTModel(cfg, tp_group=pstate.tp_group, parallel_output=False)
    model.load_state_dict(from_megatron_layout(state["model"]))
    return _logits_and_grads(model)


def _spec_worker(rank, world_size, roots):
    """Logits and gradients as numpy arrays: pickled by value, not as shared-memory handles
    that vanish when the rank exits before a busy parent reads them."""
    out = {}
    for arch, by_tp in roots.items():
        out[arch] = {}
        for tp, root in by_tp.items():
            logits, grads = _logits_at(root, tp)
            out[arch][tp] = (logits.numpy(), {n: g.numpy() for n, g in grads.items()})
    return out


def test_spec_models_reshard_tp2_to_1_to_4_with_equal_logits(tmp_path):
    """Also the gradients at TP 2 and TP 4 (whose LLaMA k / v rows are replicas) are
    the single-process gradients' shards."""
    from megatron.mpu.sharding import shard_tensor
    roots, reference = {}, {}
    for arch in SPEC_ARCHS:
        cfg = spec_config(arch)
        full = full_state(cfg)
        src, one, four = (str(tmp_path / f"{arch}-{n}") for n in ("tp2", "tp1", "tp4"))
        write_tp_layout(src, full, cfg, 2)
        assert mmp.main(["--load", src, "--save", one]) == 0
        assert mmp.main(["--load", one, "--save", four,
                         "--target-tensor-model-parallel-size", "4"]) == 0
        merged, state = read_layout(one)
        assert set(merged[(0, 0)]) == set(full)
        for name, tensor in full.items():  # exact: the metadata, not a concatenation
            assert torch.equal(merged[(0, 0)][name], tensor), (arch, name)
        assert state["sharding"] == GPTModel(cfg).sharding_metadata()
        split, _ = read_layout(four)
        meta = state["sharding"]
        for t in range(4):
            for name, tensor in full.items():
                assert torch.equal(split[(t, 0)][name], shard_tensor(tensor, meta[name], t, 4))
        if cfg.untie_embeddings_and_output_weights:  # PP 2: the output layer on the last stage
            assert mmp.main(["--load", one, "--save", str(tmp_path / f"{arch}-pp2"),
                             "--target-pipeline-model-parallel-size", "2"]) == 0
            stages, _ = read_layout(tmp_path / f"{arch}-pp2")
            assert "language_model.output_layer.weight" in stages[(0, 1)]
            assert not [n for n in stages[(0, 1)] if n.startswith("word_embeddings_for_head")]
            assert "language_model.output_layer.weight" not in stages[(0, 0)]
        model = GPTModel(cfg)
        model.load_state_dict(full)
        reference[arch] = _logits_and_grads(model) + (meta,)
        roots[arch] = {2: src, 4: four}
    results = run_ranks(_spec_worker, 4, roots, timeout=240)
    for rank, result in enumerate(results):
        for arch, by_tp in result.items():
            want_logits, want_grads, meta = reference[arch]
            for tp, (logits, grads) in by_tp.items():
                what = f"{arch} TP {tp} rank {rank}"
                torch.testing.assert_close(torch.from_numpy(logits), want_logits, rtol=1e-5,
                                           atol=1e-5, msg=what)
                for name, grad in grads.items():  # k / v replicas (TP 4 > 2 groups) included
                    want = shard_tensor(want_grads[name], meta[name], rank % tp, tp)
                    torch.testing.assert_close(torch.from_numpy(grad), want, rtol=1e-4, atol=1e-5,
                                               msg=f"{what}: {name}")
