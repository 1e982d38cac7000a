"""tools/estimate.py's predictions against what a built model, its optimizer and
autograd hold, across TP / PP / SP / recomputation (within 10%)."""
import pytest
import torch

from megatron.arguments import parse_args
from megatron.model import GPTModel
from megatron.mpu import init_parameters, model_parallel_seed, single_process_state
from megatron.training.memory import Layout, estimate, layer_activations, stage_layers, stage_params
from megatron.training.parallelize import build_model, chunk_config, params_dtype
from megatron.training.trainer import Trainer
from tests.distributed.run_ranks import run_ranks
from tests.gpt_setup import one_thread

VOCAB = 512


def config_for(*flags, world_size=1):
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--train-iters", "1", "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0",
            *flags]
    config, _ = parse_args(argv, world_size=world_size)
    config.model.padded_vocab_size = VOCAB
    return config


def _storages(tensors):
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def saved_bytes(module, forward):
    """(bytes of the unique storages autograd saves while `forward()` runs, excluding
    `module`'s parameters, and forward's result)."""
    params = _storages(module.parameters())
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return sum(saved.values()), out


def saved_activation_bytes(model, b, s, h) -> int:
    """Bytes autograd saves in one forward of a model stage (parameters excluded)."""
    tokens = torch.randint(0, VOCAB, (b, s))
    positions = torch.arange(s).expand(b, s)
    if not model.pre_process:
        model.set_input_tensor(torch.randn(s, b, h, requires_grad=True))
    return saved_bytes(model, lambda: model(tokens, positions,
                                            labels=tokens if model.post_process else None))[0]


def layer_saved_bytes(config, tp_group=None, tp=1) -> int:
    """Bytes one transformer layer saves in a training forward: its input is this rank's
    sequence shard under sequence parallelism, saved by the first norm (parameters excluded)."""
    from megatron.model.transformer import ParallelTransformerLayer
    cfg = chunk_config(config)
    layer = ParallelTransformerLayer(cfg, 1, tp_group, torch.device("cpu"), params_dtype(config))
    init_parameters(dict(layer.named_parameters()), 1234, tp_group, True)
    s, b = cfg.seq_length // (tp if cfg.sequence_parallel else 1), config.training.micro_batch_size
    x = torch.randn(s, b, cfg.hidden_size, dtype=params_dtype(config), requires_grad=True)
    nbytes, out = saved_bytes(layer, lambda: layer(x))
    out.float().sum().backward()  # the layer's backward runs (its collectives pair up)
    return nbytes


def measured_stage(config, pp_rank, pp_size, tp_group=None):
    """The stage's one chunk, as the pipeline layout places it (megatron/pipeline/layout.py)."""
    chunk = config.pipeline_layout().chunk(pp_rank)
    assert config.pipeline_layout().pp_size == pp_size
    model = GPTModel(chunk_config(config), tp_group=tp_group, pre_process=chunk.embedding,
                     post_process=chunk.loss, layer_offset=chunk.layer_offset,
                     num_layers=chunk.num_layers, dtype=params_dtype(config))
    params = sum(p.numel() for p in model.parameters())
    m = config.model
    return params, saved_activation_bytes(model, config.training.micro_batch_size, m.seq_length,
                                          m.hidden_size)


def measured_state(config, pstate):
    """Bytes of parameters, gradient buffers and optimizer state of a Trainer's rank."""
    model_parallel_seed(1234, pstate.tp_rank)
    models = build_model(config, pstate, torch.device("cpu"),
                         lambda cfg, **chunk: GPTModel(cfg, tp_group=pstate.tp_group, **chunk))
    trainer = Trainer(config, pstate, torch.device("cpu"), models, forward_step=None)
    trainer.optimizer.step()  # torch's optimizers create their state on the first step
    params = _storages(p for m in models for p in m.parameters())
    grads = _storages(r.buffer for r in trainer.reducers)
    opt = trainer.optimizer
    held = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held += [p for g in opt.optimizer.param_groups for p in g["params"]]
    flat = getattr(opt, "flat", None)
    if flat is not None and flat.flat_grads is not None:
        held.append(flat.flat_grads)
    optimizer = {k: v for k, v in _storages(held).items() if k not in params and k not in grads}
    return {"parameters": sum(params.values()), "gradients": sum(grads.values()),
            "optimizer": sum(optimizer.values())}


def _close(predicted, measured, what):
    assert predicted == pytest.approx(measured, rel=0.10), f"{what}: {predicted} vs {measured}"


ONE_PROCESS = [(), ("--recompute-granularity", "selective"), ("--recompute-granularity", "full"),
               ("--attention-impl", "torch"), ("--bf16",),
               # ALiBi: the explicit softmax (its probabilities); a window: our kernel or SDPA
               ("--position-embedding-type", "alibi"), ("--window-size", "16"),
               ("--sandwich-norm",)]


@pytest.mark.parametrize("flags", ONE_PROCESS, ids=lambda f: " ".join(f) or "plain")
def test_one_process_memory(flags):
    config = config_for(*flags)
    with one_thread():
        predicted = estimate(config, Layout(world_size=1, device_type="cpu"))
        measured = measured_state(config, single_process_state())
        for key in ("parameters", "gradients", "optimizer"):
            _close(predicted[key], measured[key], key)
        _, acts = measured_stage(config, 0, 1)
    _close(predicted["activations_per_micro_batch"], acts, "activations")


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_pipeline_stage_params_and_activations(pp_rank):
    """Each stage of PP = 2, built as that stage's module (no communication needed)."""
    config = config_for("--pipeline-model-parallel-size", "2", "--global-batch-size", "8", world_size=2)
    with one_thread():
        params, acts = measured_stage(config, pp_rank, 2)
    assert stage_params(config, pp_rank) == params
    predicted = estimate(config, Layout(world_size=2, pp_rank=pp_rank, device_type="cpu"))
    _close(predicted["activations_per_micro_batch"], acts, f"stage {pp_rank} activations")
    assert predicted["in_flight_micro_batches"] == 2 - pp_rank  # 1F1B: PP - stage


@pytest.mark.parametrize("pp_rank", [0, 1])
@pytest.mark.parametrize("split, layers", [
    (["--pipeline-model-parallel-layout", "Ettt|tL"], [3, 1]),
    (["--decoder-first-pipeline-num-layers", "1"], [1, 3]),
    (["--pipeline-model-parallel-layout", "Ettt|tmL", "--mtp-num-layers", "1",
      "--position-embedding-type", "rope"], [3, 2])])  # the MTP layer on the last stage
def test_uneven_pipeline_stages(pp_rank, split, layers):
    """The planner counts each stage's layers as the pipeline layout places them."""
    config = config_for("--pipeline-model-parallel-size", "2", "--global-batch-size", "8", *split,
                        world_size=2)
    assert stage_layers(config, pp_rank) == layers[pp_rank]
    with one_thread():
        params, acts = measured_stage(config, pp_rank, 2)
    assert stage_params(config, pp_rank) == params
    predicted = estimate(config, Layout(world_size=2, pp_rank=pp_rank, device_type="cpu"))
    _close(predicted["activations_per_micro_batch"], acts, f"stage {pp_rank} activations")


def _two_ranks(rank, world_size):
    """TP = 2 (with and without SP) then DP = 2 with the distributed optimizer."""
    from megatron.mpu import initialize_model_parallel
    out = {}
    for name, flags in (("tp", ("--tensor-model-parallel-size", "2")),
                        ("tp-sp", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
                        ("tp-full", ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--recompute-granularity", "full"))):
        config = config_for(*flags, world_size=2)
        pstate = initialize_model_parallel(2, 1)
        params, acts = measured_stage(config, 0, 1, pstate.tp_group)
        out[name] = {"params": params, "activations": acts, **measured_state(config, pstate)}
    config = config_for("--use-distributed-optimizer", world_size=2)
    out["dp-distopt"] = measured_state(config, initialize_model_parallel(1, 1))
    return out


def test_tensor_sequence_and_data_parallel_memory():
    results = run_ranks(_two_ranks, 2)
    for name, flags in (("tp", ("--tensor-model-parallel-size", "2")),
                        ("tp-sp", ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
                        ("tp-full", ("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--recompute-granularity", "full"))):
        config = config_for(*flags, world_size=2)
        predicted = estimate(config, Layout(world_size=2, device_type="cpu"))
        for measured in results:
            assert stage_params(config, 0) == measured[name]["params"]
            _close(predicted["activations_per_micro_batch"], measured[name]["activations"], name)
            for key in ("parameters", "gradients", "optimizer"):
                _close(predicted[key], measured[name][key], f"{name} {key}")
    config = config_for("--use-distributed-optimizer", world_size=2)
    predicted = estimate(config, Layout(world_size=2, device_type="cpu"))
    for measured in results:
        for key in ("parameters", "gradients", "optimizer"):
            _close(predicted[key], measured["dp-distopt"][key], f"distributed optimizer {key}")


def test_cli_reads_pretrain_flags(capsys):
    from tools import estimate as tool
    tool.main(["--world-size", "4", "--device-flops", "1e12", "--link-bandwidth", "1e9", "--",
               "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
               "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-4",
               "--pipeline-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "1000"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["stage", "parameters", "gradients"]
    assert [line.split()[0] for line in out[1:3]] == ["0", "1"]
    assert out[0].split()[-1] == "layers" and [line.split()[-1] for line in out[1:3]] == ["2", "2"]
    assert out[-1].startswith("step time: ")
    with pytest.raises(SystemExit):  # the layout does not fit: one line, exit 2
        tool.main(["--world-size", "3", "--", "--num-layers", "4", "--hidden-size", "64",
                   "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
                   "64", "--train-iters", "1", "--lr", "1e-4", "--pipeline-model-parallel-size", "2",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])


# Megatron's GPT layer (LayerNorm, GELU, 4h, biases, dropout) in bf16 with sequence
# parallelism and selective recomputation: Korthikanti et al.'s 34 s b h / t bytes.
MEGATRON_LAYER = ("--hidden-size", "128", "--ffn-hidden-size", "512", "--bf16",
                  "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--recompute-granularity", "selective", "--hidden-dropout", "0.1",
                  "--attention-dropout", "0.1")


def _megatron_layer(rank, world_size):
    from megatron.mpu import initialize_model_parallel
    pstate = initialize_model_parallel(2, 1)
    model_parallel_seed(1234, pstate.tp_rank)
    config = config_for(*MEGATRON_LAYER, world_size=2)
    return layer_saved_bytes(config, pstate.tp_group, tp=2)


def test_sequence_parallel_layer_saves_megatrons_activations():
    """What one layer saves, measured at TP 2, is within 10% of 34 s b h / t, and the
    planner's tensor-by-tensor account within 10% of the measurement. Without the
    column-parallel linears' shard-only saving the layer keeps 1.12x as much."""
    config = config_for(*MEGATRON_LAYER, world_size=2)
    m, b = config.model, config.training.micro_batch_size
    megatron = 34 * m.seq_length * b * m.hidden_size / 2
    planned = sum(layer_activations(config, b, "cpu").values())
    for rank, measured in enumerate(run_ranks(_megatron_layer, 2)):
        assert measured <= 1.1 * megatron, f"rank {rank}: {measured} > 1.1 x {megatron}"
        _close(planned, measured, f"rank {rank} layer activations")


def test_175b_layout_plans_megatrons_activations_per_layer():
    """GPT-3 175B on TP 8 x PP 16 x DP 8, bf16, SP, selective recomputation, micro batch 1:
    Megatron's formula gives 34 s b h / t = 102 MiB per layer; the plan stays within 112 MB."""
    argv = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--micro-batch-size", "1",
            "--global-batch-size", "1536", "--train-iters", "1", "--lr", "1e-4", "--bf16",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
            "--sequence-parallel", "--use-distributed-optimizer",
            "--recompute-granularity", "selective"]
    config, _ = parse_args(argv, world_size=1024)
    config.model.padded_vocab_size = 51200
    per_layer = sum(layer_activations(config, 1, "cuda").values())
    assert 34 * 2048 * 12288 / 8 <= per_layer <= 112e6, per_layer


def test_cli_explains_a_layers_memory(capsys):
    """--explain-memory lists the layer's tensors, largest first, summing to the plan."""
    from tools import estimate as tool
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--train-iters", "1", "--lr", "1e-4", "--bf16", "--tensor-model-parallel-size", "2",
             "--sequence-parallel", "--recompute-granularity", "selective",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    tool.main(["--world-size", "2", "--explain-memory", "--", *flags])
    out = capsys.readouterr().out.splitlines()
    start = out.index("one transformer layer saves for backward (micro batch 2, per rank):")
    rows = [line.split() for line in out[start + 1:]]
    assert rows[0][:2] == ["MLP", "activation"] and rows[-1][0] == "total"
    sizes = [float(row[row.index("MiB") - 1]) for row in rows[:-1]]
    assert sizes == sorted(sizes, reverse=True)
    assert float(rows[-1][1]) == pytest.approx(sum(sizes), abs=0.02)
    assert "Megatron's 34 s b h / t" in out[-1]


def test_cli_plans_fsdp_shards_and_gathered_units(capsys):
    """Under --use-torch-fsdp2 at DP 4 the state columns are a quarter of the fp32 state
    without FSDP (Adam: 16 bytes a parameter in all), and the gathered units and the
    unsharded gradients have their own columns, counted in the total."""
    from tools import estimate as tool
    flags = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--global-batch-size", "16", "--train-iters", "1", "--lr", "1e-4",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "50000"]  # 0.15 B parameters
    tables = {}
    for name, extra in (("plain", []), ("fsdp", ["--use-torch-fsdp2"])):
        tool.main(["--world-size", "4", "--", *flags, *extra])
        lines = capsys.readouterr().out.splitlines()
        header, row = lines[0].split(), lines[1].split()
        tables[name] = {key: float(value[:-3]) for key, value in zip(header[1:], row[1:])
                        if value.endswith("GiB")}
    plain, fsdp = tables["plain"], tables["fsdp"]
    assert set(fsdp) - set(plain) == {"gathered", "full-grads"}
    state = sum(plain[key] for key in ("parameters", "gradients", "optimizer"))
    assert sum(fsdp[key] for key in ("parameters", "gradients", "optimizer")) == \
        pytest.approx(state / 4, rel=0.02, abs=2e-3)
    assert fsdp["gathered"] > 0 and fsdp["full-grads"] > 0
    assert fsdp["total"] == pytest.approx(sum(v for k, v in fsdp.items() if k != "total"),
                                          abs=5e-3)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_stage_params_count_the_sink_logits(pp_rank):
    """--softmax-type learnable: one parameter per head and layer, counted exactly."""
    config = config_for("--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                        "--softmax-type", "learnable", world_size=2)
    with one_thread():
        params, _ = measured_stage(config, pp_rank, 2)
    assert stage_params(config, pp_rank) == params


MLA = ("--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--position-embedding-type", "rope",
       "--normalization", "RMSNorm", "--swiglu")
MLA_AND_MTP = [MLA + ("--q-lora-rank", "24"), MLA, MLA + ("--q-lora-rank", "24",
                                                         "--mtp-num-layers", "1")]


@pytest.mark.parametrize("flags", MLA_AND_MTP, ids=["q-lora", "no-q-lora", "q-lora+mtp"])
def test_mla_and_mtp_parameters_are_counted_exactly(flags):
    """The planner's parameters of multi-latent attention (the q / kv down- and
    up-projections and latent norms, not --kv-channels' QKV) and of an MTP depth equal the
    built model's."""
    config = config_for(*flags)
    with one_thread():
        params, _ = measured_stage(config, 0, 1)
    assert stage_params(config, 0) == params


def test_deepseek_v3_has_its_published_parameter_count():
    """DeepSeek-V3's shape (examples/pretrain_deepseek_v3.sh) plans 671B parameters as its
    report states (within 1 %); its MTP layer adds 11.6B more (DeepSeek's 685B also counts
    the MTP module's own copies of the embedding and head, which ours shares)."""
    flags = ("--num-layers 61 --hidden-size 7168 --num-attention-heads 128 "
             "--ffn-hidden-size 18432 --multi-latent-attention --q-lora-rank 1536 "
             "--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 "
             "--num-experts 256 --moe-ffn-hidden-size 2048 --moe-layer-freq ([0]*3+[1]*58) "
             "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 "
             "--position-embedding-type rope --normalization RMSNorm --swiglu "
             "--untie-embeddings-and-output-weights --disable-bias-linear "
             "--max-position-embeddings 4096").split()
    config = config_for(*flags)
    config.model.padded_vocab_size = 129280
    assert stage_params(config, 0) == pytest.approx(671e9, rel=0.01)
    with_mtp = config_for(*flags, "--mtp-num-layers", "1")
    with_mtp.model.padded_vocab_size = 129280
    assert stage_params(with_mtp, 0) - stage_params(config, 0) == pytest.approx(11.6e9, rel=0.01)
