"""Tensor parallelism is exact: layers, cross entropy, mappings, collectives and training.

One 2-rank spawn checks the layers, the vocab-parallel cross entropy and the
mappings at TP = 2, counts the collectives of one transformer layer, and trains
the tiny GPT at TP = 2 (plain, sequence parallel, full and selective
recomputation); one 4-rank spawn repeats the layer checks at TP = 4. Every
number is compared with the same computation on one device (in the rank, or in
the pytest process for the training losses).
"""
import collections
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.conftest import ROOT
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import losses, one_thread, preprocess_wiki, tiny_gpt_argv

LAYER_TOL = 1e-6      # relative error of one layer, float32
# the bfloat16 head against one device: the loss in float32 (the shards' sums merged in
# another order), the gradients rounded to bfloat16 (a few elements one ulp apart)
BF16_HEAD_TOL = 1e-2
BLOCK_TOL = 1e-5      # a whole transformer layer (several reductions in another order)
LOSS_TOL = 1e-5       # training losses after 20 iterations
ITERS = 20
SEED = 1234
TRAIN_VARIANTS = {
    "tp2": [],
    "tp2-sequence-parallel": ["--sequence-parallel"],
    "tp2-checkpoint-activations": ["--checkpoint-activations"],
    "tp2-selective-recompute": ["--recompute-granularity", "selective"],
}


# ---------------------------------------------------------------------------
# Helpers run inside the ranks
# ---------------------------------------------------------------------------
def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (absolute when expected is zero)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        return float("inf")
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff


def randn(seed, *shape, scale=1.0):
    """The same tensor on every rank (or a rank-specific one with a rank-specific seed)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def shard(full, dim, rank, size):
    from megatron.mpu.layers import shard_of
    return shard_of(full, dim % full.dim(), 1, rank, size)


def forward_backward(module, x, grad_out):
    """Output, input gradient (None for integer input) and parameter gradients."""
    if x.is_floating_point():
        x = x.clone().requires_grad_(True)
    y = module(x)
    (y * grad_out).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return y.detach(), (x.grad if x.is_floating_point() else None), grads


def init_like(module, prefix, tp_group):
    """`init_parameters` with use_cpu_initialization over the module's parameters."""
    from megatron.mpu import init_parameters
    init_parameters({f"{prefix}.{n}": p for n, p in module.named_parameters()}, SEED, tp_group, True)


def check_column(group, rank, size):
    from megatron.mpu import ColumnParallelLinear
    errors = {}
    ref = ColumnParallelLinear(16, 24, tp_group=None)
    init_like(ref, "col", None)
    with torch.no_grad():
        ref.bias.copy_(randn(3, 24))  # the init gives zeros: make the bias visible
    x, g = randn(1, 5, 3, 16), randn(2, 5, 3, 24)
    ref_y, ref_dx, ref_grads = forward_backward(ref, x, g)
    for gather in (True, False):
        par = ColumnParallelLinear(16, 24, tp_group=group, gather_output=gather)
        init_like(par, "col", group)
        tag = f"column(gather_output={gather})"
        errors[f"{tag} init weight"] = rel_err(par.weight, shard(ref.weight, 0, rank, size))
        with torch.no_grad():
            par.bias.copy_(shard(ref.bias, 0, rank, size))
        y, dx, grads = forward_backward(par, x, g if gather else shard(g, -1, rank, size))
        errors[f"{tag} output"] = rel_err(y, ref_y if gather else shard(ref_y, -1, rank, size))
        errors[f"{tag} input grad"] = rel_err(dx, ref_dx)
        for name in ("weight", "bias"):
            errors[f"{tag} {name} grad"] = rel_err(grads[name], shard(ref_grads[name], 0, rank, size))
    return errors


def check_row(group, rank, size):
    from megatron.mpu import RowParallelLinear
    errors = {}
    ref = RowParallelLinear(24, 16, tp_group=None)
    init_like(ref, "row", None)
    with torch.no_grad():
        ref.bias.copy_(randn(4, 16))
    x, g = randn(5, 5, 3, 24), randn(6, 5, 3, 16)
    ref_y, ref_dx, ref_grads = forward_backward(ref, x, g)
    for parallel_input in (True, False):
        par = RowParallelLinear(24, 16, tp_group=group, input_is_parallel=parallel_input)
        init_like(par, "row", group)
        tag = f"row(input_is_parallel={parallel_input})"
        errors[f"{tag} init weight"] = rel_err(par.weight, shard(ref.weight, 1, rank, size))
        with torch.no_grad():
            par.bias.copy_(ref.bias)
        y, dx, grads = forward_backward(par, shard(x, -1, rank, size) if parallel_input else x, g)
        errors[f"{tag} output"] = rel_err(y, ref_y)
        errors[f"{tag} input grad"] = rel_err(
            dx, shard(ref_dx, -1, rank, size) if parallel_input else ref_dx)
        errors[f"{tag} weight grad"] = rel_err(grads["weight"], shard(ref_grads["weight"], 1, rank, size))
        errors[f"{tag} bias grad"] = rel_err(grads["bias"], ref_grads["bias"])
    return errors


def ids_in_every_shard(vocab, padded, size, shape, seed):
    """Random ids below `vocab` with at least one id in each of the `size` shards."""
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    per = padded // size
    firsts = [min(r * per, vocab - 1) for r in range(size)]
    ids.view(-1)[:size] = torch.tensor(firsts)
    ids.view(-1)[size] = vocab - 1
    owners = set((ids // per).view(-1).tolist())
    assert owners == set(range(size)), f"test premise: ids {ids.tolist()} miss a shard"
    return ids


def check_embedding(group, rank, size):
    from megatron.mpu import VocabParallelEmbedding
    from megatron.tokenizer import padded_vocab_size
    vocab = 50
    padded = padded_vocab_size(vocab, 4, size)  # 56 at TP 2, 64 at TP 4: rows past 50 are padding
    assert padded > vocab and padded % size == 0
    ref = VocabParallelEmbedding(padded, 8, tp_group=None)
    init_like(ref, "emb", None)
    par = VocabParallelEmbedding(padded, 8, tp_group=group)
    init_like(par, "emb", group)
    ids = ids_in_every_shard(vocab, padded, size, (4, 6), 7)
    g = randn(8, 4, 6, 8)
    ref_y, _, ref_grads = forward_backward(ref, ids, g)
    y, _, grads = forward_backward(par, ids, g)
    tag = f"embedding(padded {vocab}->{padded})"
    return {f"{tag} init weight": rel_err(par.weight, shard(ref.weight, 0, rank, size)),
            "embedding output": rel_err(y, ref_y),
            "embedding weight grad": rel_err(grads["weight"], shard(ref_grads["weight"], 0, rank, size))}


def check_cross_entropy(group, rank, size):
    from megatron.mpu import vocab_parallel_cross_entropy
    errors = {}
    vocab = 64
    logits = randn(9, 5, 3, vocab, scale=3.0)
    target = ids_in_every_shard(vocab, vocab, size, (5, 3), 10)
    weights = randn(11, 5, 3)  # a per-token upstream gradient
    for eps in (0.0, 0.1):
        full = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), reduction="none",
                              label_smoothing=eps).view(5, 3)
        (ref * weights).sum().backward()
        local = shard(logits, -1, rank, size).requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, group, label_smoothing=eps)
        (loss * weights).sum().backward()
        errors[f"cross entropy(label_smoothing={eps}) loss"] = rel_err(loss, ref)
        errors[f"cross entropy(label_smoothing={eps}) logits grad"] = rel_err(
            local.grad, shard(full.grad, -1, rank, size))
    errors.update(check_bf16_head(group, rank, size))
    return errors


def check_bf16_head(group, rank, size):
    """The GPT head in bfloat16 (float32 softmax never kept: the shards' maxima and sums
    merged, the gradient formed in the forward) against the same head on one device, with
    the vocabulary padded so that the last shard holds padding only."""
    from megatron.mpu.cross_entropy import linear_cross_entropy
    vocab, limit = 64, 30
    hidden = randn(12, 20, 16).bfloat16()
    weight = randn(13, vocab, 16).bfloat16()
    target = torch.randint(0, limit, (20,), generator=torch.Generator().manual_seed(14))
    upstream = randn(15, 20)

    def run(w, g):
        h, w = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, target, g, vocab_limit=limit)
        (loss * upstream).sum().backward()
        return loss, h.grad, w.grad
    loss, dh, dw = run(shard(weight, 0, rank, size), group)
    dh = dh.float()
    dist.all_reduce(dh, group=group)  # each shard's share (the model's copy_to region sums them)
    ref_loss, ref_dh, ref_dw = run(weight, None)
    return {"bf16 head loss": rel_err(loss, ref_loss), "bf16 head hidden grad": rel_err(dh, ref_dh),
            "bf16 head weight grad": rel_err(dw, shard(ref_dw, 0, rank, size))}


def _mapping_case(fn, x, g):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(g)
    return y.detach(), x.grad


def check_mappings(group, rank, size):
    """Each autograd collective against its definition, with rank-specific inputs."""
    from megatron.mpu import mappings as m
    errors = {}
    xs = [randn(100 + r, 2 * size, 3, 4 * size) for r in range(size)]   # each rank's input
    gs = [randn(200 + r, 2 * size, 3, 4 * size) for r in range(size)]   # each rank's grad, full shape
    small = [t.chunk(size, 0)[r] for r, t in enumerate(gs)]             # grads of shard shape
    last = [t.chunk(size, -1)[r] for r, t in enumerate(gs)]
    total_x, total_g = sum(xs), sum(gs)
    cases = {
        # name: (function, input, upstream grad, expected output, expected input grad)
        "copy_to": (m.copy_to_tensor_model_parallel_region, xs[rank], gs[rank], xs[rank], total_g),
        "reduce_from": (m.reduce_from_tensor_model_parallel_region, xs[rank], gs[rank], total_x, gs[rank]),
        "scatter_to": (m.scatter_to_tensor_model_parallel_region, xs[0], last[rank],
                       xs[0].chunk(size, -1)[rank], torch.cat(last, -1)),
        "gather_from": (m.gather_from_tensor_model_parallel_region, xs[rank].chunk(size, -1)[rank],
                        gs[rank], torch.cat([x.chunk(size, -1)[r] for r, x in enumerate(xs)], -1),
                        gs[rank].chunk(size, -1)[rank]),
        "scatter_to_sequence": (m.scatter_to_sequence_parallel_region, xs[0], small[rank],
                                xs[0].chunk(size, 0)[rank], torch.cat(small, 0)),
        "gather_from_sequence(partial grads)": (
            m.gather_from_sequence_parallel_region, xs[rank].chunk(size, 0)[rank], gs[rank],
            torch.cat([x.chunk(size, 0)[r] for r, x in enumerate(xs)], 0), total_g.chunk(size, 0)[rank]),
        "gather_from_sequence(full grads)": (
            lambda t: m.gather_from_sequence_parallel_region(t, group, output_grad_is_partial=False),
            xs[rank].chunk(size, 0)[rank], gs[rank],
            torch.cat([x.chunk(size, 0)[r] for r, x in enumerate(xs)], 0), gs[rank].chunk(size, 0)[rank]),
        "reduce_scatter_to_sequence": (m.reduce_scatter_to_sequence_parallel_region, xs[rank],
                                       small[rank], total_x.chunk(size, 0)[rank], torch.cat(small, 0)),
    }
    for name, (fn, x, g, want_y, want_dx) in cases.items():
        call = fn if name.endswith("(full grads)") else (lambda t, fn=fn: fn(t, group))
        y, dx = _mapping_case(call, x, g)
        errors[f"{name} forward"] = rel_err(y, want_y)
        errors[f"{name} backward"] = rel_err(dx, want_dx)
    return errors


def layer_checks(group, rank, size):
    errors = {}
    for check in (check_column, check_row, check_embedding, check_cross_entropy, check_mappings):
        errors.update(check(group, rank, size))
    return errors


# -- collectives of one transformer layer --------------------------------------
class CollectiveCounter:
    """Counts all-reduces, all-gathers and reduce-scatters per phase (forward/backward).

    gloo has no reduce-scatter: `_reduce_scatter` all-reduces inside, which is
    not counted as an all-reduce of its own.
    """

    def __init__(self):
        from megatron.mpu import mappings
        self.mappings = mappings
        self.counts = collections.Counter()
        self.phase = "forward"
        self._inside = 0
        self._saved = (dist.all_reduce, mappings._gather, mappings._reduce_scatter)

    def __enter__(self):
        all_reduce, gather, reduce_scatter = self._saved

        def counted_all_reduce(*args, **kwargs):
            if not self._inside:
                self.counts[(self.phase, "all-reduce")] += 1
            return all_reduce(*args, **kwargs)

        def counted_gather(x, dim, group):
            self.counts[(self.phase, f"all-gather(dim {dim % x.dim()})")] += 1
            return gather(x, dim, group)

        def counted_reduce_scatter(x, dim, group):
            self.counts[(self.phase, f"reduce-scatter(dim {dim % x.dim()})")] += 1
            self._inside += 1
            try:
                return reduce_scatter(x, dim, group)
            finally:
                self._inside -= 1

        dist.all_reduce = counted_all_reduce
        self.mappings._gather = counted_gather
        self.mappings._reduce_scatter = counted_reduce_scatter
        return self

    def __exit__(self, *exc):
        dist.all_reduce, self.mappings._gather, self.mappings._reduce_scatter = self._saved


def layer_config(sequence_parallel):
    from megatron.config import ModelConfig
    return ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=32,
                       max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0,
                       padded_vocab_size=64, sequence_parallel=sequence_parallel)


def build_layer(cfg, group):
    from megatron.model.transformer import ParallelTransformerLayer
    layer = ParallelTransformerLayer(cfg, 1, group, None, torch.float32)
    init_like(layer, "language_model.encoder.layers.0", group)
    return layer


def count_layer_collectives(group, rank, size, sequence_parallel):
    """Counts of one layer's forward and backward, and its exactness against one device."""
    x, g = randn(12, 32, 2, 64), randn(13, 32, 2, 64)
    ref_y, ref_dx, _ = forward_backward(build_layer(layer_config(False), None), x, g)
    layer = build_layer(layer_config(sequence_parallel), group)
    if sequence_parallel:
        x, g = shard(x, 0, rank, size), shard(g, 0, rank, size)
        ref_y, ref_dx = shard(ref_y, 0, rank, size), shard(ref_dx, 0, rank, size)
    x = x.clone().requires_grad_(True)
    with CollectiveCounter() as counter:
        y = layer(x)
        counter.phase = "backward"
        y.backward(g)
    errors = {"output": rel_err(y, ref_y), "input grad": rel_err(x.grad, ref_dx)}
    return {" ".join(key): n for key, n in sorted(counter.counts.items())}, errors


# -- training ------------------------------------------------------------------
class CallCounter:
    """Counts calls of `module.name` (e.g. the activation checkpoint used by the layers)."""

    def __init__(self, module, name):
        self.module, self.name, self.calls = module, name, 0
        self._saved = getattr(module, name)

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._saved(*args, **kwargs)
        setattr(self.module, self.name, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self._saved)


def train_variants(data_prefix, cache_dir):
    """Losses of each TP = 2 variant, with counts that show the variant took effect."""
    import pretrain_gpt
    from megatron.model import attention, transformer
    results = {}
    for name, extra in TRAIN_VARIANTS.items():
        argv = tiny_gpt_argv(data_prefix, cache_dir, "--tensor-model-parallel-size", "2", *extra,
                             iters=ITERS)
        # full recomputation checkpoints layers (transformer.py), selective the core attention
        with CollectiveCounter() as comm, CallCounter(transformer, "checkpoint") as layers, \
                CallCounter(attention, "checkpoint") as cores:
            curve = losses(pretrain_gpt.main(argv))
        kinds = collections.Counter()
        for (_, kind), n in comm.counts.items():
            kinds[kind.split("(")[0]] += n
        results[name] = {"losses": curve, "checkpoints": layers.calls + cores.calls, **kinds}
    return results


def _rank_tp2(rank, world_size, data_prefix, cache_dir):
    from megatron.mpu import initialize_model_parallel, model_parallel_seed
    group = initialize_model_parallel(tp=world_size).tp_group
    model_parallel_seed(SEED, rank)  # sequence-parallel layers run dropout in the tracker
    result = {"errors": layer_checks(group, rank, world_size), "counts": {}, "layer": {}}
    for sp in (False, True):
        counts, errors = count_layer_collectives(group, rank, world_size, sp)
        result["counts"][sp], result["layer"][sp] = counts, errors
    result["losses"] = train_variants(data_prefix, cache_dir)
    return result


def _rank_tp4(rank, world_size):
    from megatron.mpu import initialize_model_parallel
    group = initialize_model_parallel(tp=world_size).tp_group
    return {"errors": layer_checks(group, rank, world_size)}


# ---------------------------------------------------------------------------
# Fixtures: one spawn per world size
# ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wiki(tmp_path_factory):
    out = tmp_path_factory.mktemp("wiki")
    return preprocess_wiki(out), out


@pytest.fixture(scope="module")
def tp2(wiki):
    prefix, out = wiki
    return run_ranks(_rank_tp2, 2, prefix, str(out / "cache-tp2"), timeout=900)


@pytest.fixture(scope="module")
def tp4():
    return run_ranks(_rank_tp4, 4)


@pytest.fixture(scope="module")
def reference_losses(wiki):
    """TP = 1 in the pytest process (one thread, like each rank: faster on busy cores)."""
    import pretrain_gpt
    prefix, out = wiki
    with one_thread():
        return losses(pretrain_gpt.main(tiny_gpt_argv(prefix, out / "cache-ref", iters=ITERS)))


def assert_small(errors, tol, where):
    bad = {name: err for name, err in errors.items() if not err < tol}
    assert not bad, f"{where}: relative errors above {tol}: {bad}"


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", ["tp2", "tp4"])
def test_layers_cross_entropy_and_mappings_equal_one_device(world, request):
    results = request.getfixturevalue(world)
    for rank, result in enumerate(results):
        errors = result["errors"]
        for prefix in ("column(gather_output=True)", "column(gather_output=False)",
                       "row(input_is_parallel=True)", "row(input_is_parallel=False)", "embedding",
                       "cross entropy(label_smoothing=0.1)", "reduce_scatter_to_sequence",
                       "bf16 head"):
            assert any(name.startswith(prefix) for name in errors), f"no check named {prefix}"
        bf16 = {name: err for name, err in errors.items() if name.startswith("bf16")}
        assert_small({name: err for name, err in errors.items() if name not in bf16}, LAYER_TOL,
                     f"{world} rank {rank}")
        assert_small(bf16, BF16_HEAD_TOL, f"{world} rank {rank}")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_transformer_layer_collectives(tp2, sequence_parallel):
    """2 all-reduces forward + 2 backward; under sequence parallelism 2 all-gathers and
    2 reduce-scatters of the sequence dimension each way and no all-reduce, plus the
    backward's 2 all-gathers of the column-parallel inputs, whose shards alone are saved."""
    if sequence_parallel:
        expected = {"forward all-gather(dim 0)": 2, "forward reduce-scatter(dim 0)": 2,
                    "backward all-gather(dim 0)": 4, "backward reduce-scatter(dim 0)": 2}
    else:
        expected = {"forward all-reduce": 2, "backward all-reduce": 2}
    for rank, result in enumerate(tp2):
        assert result["counts"][sequence_parallel] == expected, f"rank {rank}"
        assert_small(result["layer"][sequence_parallel], BLOCK_TOL, f"layer on rank {rank}")


@pytest.mark.parametrize("variant", list(TRAIN_VARIANTS))
def test_pretrain_tp2_losses_equal_tp1(tp2, reference_losses, variant):
    assert len(reference_losses) == ITERS
    for rank, result in enumerate(tp2):  # both TP ranks are on the last (only) stage
        got = result["losses"][variant]["losses"]
        assert len(got) == ITERS, f"rank {rank}: {len(got)} losses"
        rel = [abs(a - b) / abs(b) for a, b in zip(got, reference_losses)]
        assert max(rel) < LOSS_TOL, f"{variant} rank {rank}: max relative difference {max(rel):.3g}"


def test_pretrain_variants_take_effect(tp2):
    """Sequence parallelism reduce-scatters; recomputation goes through the checkpoint."""
    layer_passes = ITERS * 4 * 4  # iterations x micro batches x layers
    for rank, result in enumerate(tp2):
        runs = result["losses"]
        plain, sp = runs["tp2"], runs["tp2-sequence-parallel"]
        full, selective = runs["tp2-checkpoint-activations"], runs["tp2-selective-recompute"]
        assert plain.get("reduce-scatter", 0) == 0 and plain["checkpoints"] == 0, (rank, plain)
        assert sp.get("reduce-scatter", 0) >= 2 * layer_passes and sp["checkpoints"] == 0, (rank, sp)
        assert full["checkpoints"] == layer_passes, (rank, full)
        assert full["all-reduce"] >= plain["all-reduce"] + 2 * layer_passes, (rank, full, plain)
        assert selective["checkpoints"] >= layer_passes, (rank, selective)
        assert selective["all-reduce"] == plain["all-reduce"], (rank, selective, plain)


@pytest.mark.parametrize("flags, world, words", [
    (["--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "96"], 4,
     ["--num-attention-heads (6)", "--tensor-model-parallel-size (4)"]),
    (["--tensor-model-parallel-size", "3", "--num-attention-heads", "6", "--hidden-size", "96"], 4,
     ["--tensor-model-parallel-size (3)", "world size (4)"]),
])
def test_bad_tensor_parallel_layout_is_one_line_exit_2(tmp_path, monkeypatch, capsys, flags, world, words):
    import pretrain_gpt
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = tiny_gpt_argv(tmp_path / "none", tmp_path / "cache") + flags
    with pytest.raises(SystemExit) as exc:
        pretrain_gpt.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert all(word in err for word in words), err
    assert not dist.is_initialized()


def test_bad_layout_from_the_command_line(tmp_path):
    """The real entry point under a launcher's environment: exit 2 before any process group
    (no MASTER_ADDR is set, so creating one would fail differently)."""
    argv = tiny_gpt_argv(tmp_path / "none", tmp_path / "cache", "--tensor-model-parallel-size", "2",
                         "--num-attention-heads", "3", "--hidden-size", "96")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *map(str, argv)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--num-attention-heads (3)" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
