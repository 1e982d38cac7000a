"""Every tensor, every format (issue 33): each parameter and each persistent buffer of each
model variant round-trips bit for bit through every checkpoint path that can carry it.

The variants: dense GPT, LLaMA-style (RoPE, SwiGLU, RMSNorm, GQA), BLOOM-style (ALiBi,
embedding layer norm), fairseq-style (sinusoidal positions), an MoE with an expert bias
(`router.expert_bias`, a persistent buffer) and a shared-expert gate, and a Qwen2-MoE-style
one (shared-expert gate, no expert bias). Every tensor of the model's state dict (parameters
and persistent buffers alike) is given its own seeded random values, so that a tensor a path
drops or leaves at its initial value is found by name.

One spawn of 2 gloo ranks builds each variant at TP 2 (dense) or EP 2 (MoE) and checks:

    torch, torch_dist                 saved and loaded at that layout
    --async-save (torch, torch_dist)  written by the background writer, loaded back
    --universal-checkpoint            the torch checkpoint loaded at TP 1 x EP 1 (DP 2)
    torch_dist re-sharded at load     the torch_dist checkpoint loaded at TP 1 x EP 1

Then, in this process, from those checkpoints: tools/merge_mp_partitions.py torch -> torch,
torch -> torch_dist and torch_dist -> torch; the Hugging Face export and import for the
variants an HF family expresses (the one with an expert bias must be refused in one line:
no supported family carries it); and for the fairseq-style variant a fairseq file written from
the tensors, imported, and exported again.
"""
import functools
import os
import zlib

import pytest
import torch

from tests.distributed.run_ranks import run_ranks

VOCAB = 128
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
            max_position_embeddings=16, padded_vocab_size=VOCAB, hidden_dropout=0.0,
            attention_dropout=0.0)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
             group_query_attention=True, num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
VARIANTS = {
    "gpt": {},
    "llama": LLAMA,
    "bloom": dict(position_embedding_type="alibi", embed_layernorm=True),
    "fairseq": dict(position_embedding_type="sinusoidal", scale_embeddings=True,
                    activation="exact_gelu"),
    "moe-expert-bias": dict(LLAMA, moe=dict(MOE, moe_router_score_function="sigmoid",
                                            moe_router_enable_expert_bias=True)),
    "qwen-moe": dict(LLAMA, add_qkv_bias=True, moe=dict(MOE, moe_router_pre_softmax=True)),
}
REFUSED_BY_HF = {"moe-expert-bias": "cannot be expressed", "fairseq": "sinusoidal"}
"""Variants that no supported Hugging Face family expresses, and a word of the one-line
refusal: Mixtral's and Qwen-MoE's routers have no expert bias (nor sigmoid scores), and no
family has sinusoidal positions."""
MUST_HOLD = {"moe-expert-bias": ("mlp.router.expert_bias", "mlp.shared_experts.gate_weight"),
             "qwen-moe": ("mlp.shared_experts.gate_weight",)}
RANK_PATHS = ("torch", "torch_dist", "async-torch", "async-torch_dist", "universal",
              "torch_dist-resharded")
TOOL_PATHS = ("merge-torch-torch", "merge-torch-torch_dist", "merge-torch_dist-torch")
STALE = -7.0
"""What a model holds before a load: a tensor that the load skipped keeps it."""


def model_config(name: str):
    from megatron.config import ModelConfig, MoEConfig
    fields = dict(BASE, **VARIANTS[name])
    if "moe" in fields:
        fields["moe"] = MoEConfig(**fields["moe"])
    return ModelConfig(**fields)


@functools.lru_cache(maxsize=None)
def meta_model(name: str):
    from megatron.model import GPTModel
    return GPTModel(model_config(name), device="meta")


@functools.lru_cache(maxsize=None)
def reference(name: str):
    """Every tensor of the whole (TP 1) model: parameters and persistent buffers by state-dict
    name, each with its own seeded values (never modified: the loads compare against it)."""
    out = {}
    for key, tensor in meta_model(name).state_dict().items():
        generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{key}".encode()))
        out[key] = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    return out


def differences(got, want) -> list:
    """Names missing, surplus or not bit-identical."""
    names = sorted(set(got) | set(want))
    return [n for n in names if n not in got or n not in want or got[n].dtype != want[n].dtype
            or not torch.equal(got[n], want[n])]


# -- the ranks --------------------------------------------------------------------------
def _layout(name: str) -> dict:
    return {"ep": 2} if "moe" in VARIANTS[name] else {"tp": 2}


def _run(name: str, pstate, ckpt_format: str, universal: bool = False):
    from megatron.checkpointing.formats import RunState
    from megatron.config import Config
    from megatron.model import GPTModel
    config = Config(model=model_config(name))
    config.parallel.tensor_model_parallel_size = pstate.tp_size
    config.parallel.expert_model_parallel_size = pstate.ep_size
    config.checkpoint.ckpt_format = ckpt_format
    config.checkpoint.universal_checkpoint = universal
    model = GPTModel(config.model, tp_group=pstate.tp_group, expert_groups=pstate.expert_groups())
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.fill_(STALE)
    return RunState([model], config, pstate)


def _this_rank(full: dict, name: str, pstate) -> dict:
    """This rank's cut of the whole model (local names)."""
    from megatron.checkpointing.experts import split_experts
    from megatron.checkpointing.reshard import Sharding, cut
    sharding = meta_model(name).sharding_metadata()
    cells = cut(full, {"sharding": sharding}, pstate.tp_size, 1)
    mine = cells[(pstate.tp_rank, 0)]
    return split_experts(mine, pstate.ep_size, Sharding(sharding))[pstate.ep_rank]


def _local(run) -> dict:
    return {k: v.clone() for k, v in run.models[0].state_dict().items()}


def _saved_and_loaded(name: str, root: str, saver) -> dict:
    """Save this rank's cut of the reference at the variant's layout in each format (directly
    and in the background), load each back at that layout: the differences of each."""
    from megatron.checkpointing import api
    from megatron.mpu.parallel_state import initialize_model_parallel
    full = reference(name)
    pstate = initialize_model_parallel(**_layout(name))
    mine = _this_rank(full, name, pstate)
    out = {}
    for fmt in ("torch", "torch_dist"):
        for path, save in ((fmt, api.save), (f"async-{fmt}", saver.save)):
            source = _run(name, pstate, fmt)
            source.models[0].load_state_dict(mine, strict=True)
            save(os.path.join(root, path), 1, source)
            saver.wait()
            target = _run(name, pstate, fmt)
            api.load(os.path.join(root, path), target)
            out[path] = differences(_local(target), mine)
    return out


def _resharded(name: str, root: str) -> dict:
    """The layout's checkpoints loaded at TP 1 x EP 1 (DP 2): the whole model on each rank."""
    from megatron.checkpointing import api
    from megatron.mpu.parallel_state import initialize_model_parallel
    pstate = initialize_model_parallel()
    out = {}
    for path, fmt, universal in (("universal", "torch", True),
                                 ("torch_dist-resharded", "torch_dist", False)):
        target = _run(name, pstate, fmt, universal)
        api.load(os.path.join(root, fmt), target)
        out[path] = differences(_local(target), reference(name))
    return out


def _rank(rank, world_size, workdir):
    import gc

    from megatron.checkpointing.async_save import AsyncSaver
    saver = AsyncSaver()
    out = {}
    for name in VARIANTS:
        root = os.path.join(workdir, name)
        results = _saved_and_loaded(name, root, saver)
        results.update(_resharded(name, root))
        out.update({f"{name}/{path}": diff for path, diff in results.items()})
    del saver
    gc.collect()  # the writer process ends with its saver
    return out


# -- the tools, in this process ---------------------------------------------------------------
def _read(root: str) -> dict:
    from megatron.checkpointing import api
    return api.read_model(root)[0]


def _merged(name: str, root: str) -> dict:
    from tools import merge_mp_partitions
    out = {}
    target = ["--target-expert-model-parallel-size", "2"] if "moe" in VARIANTS[name] \
        else ["--target-tensor-model-parallel-size", "2"]
    for source, fmt, extra in (("torch", "torch", []), ("torch", "torch_dist", []),
                               ("torch_dist", "torch", target)):
        save = os.path.join(root, f"merged-{source}-{fmt}")
        status = merge_mp_partitions.main(["--load", os.path.join(root, source), "--save", save,
                                           "--ckpt-format", fmt, *extra])
        out[f"merge-{source}-{fmt}"] = differences(_read(save), reference(name)) \
            if status == 0 else [f"exit status {status}"]
    return out


def _hf_round_trip(name: str, root: str):
    """The differences after an export to Hugging Face and an import back, or the one-line
    refusal of the export."""
    from megatron.checkpointing.hf import ConversionError
    from megatron.checkpointing.hf.convert import hf_to_megatron, megatron_to_hf
    try:
        megatron_to_hf(os.path.join(root, "torch"), os.path.join(root, "hf"), VOCAB)
    except ConversionError as err:
        return str(err)
    hf_to_megatron(os.path.join(root, "hf"), os.path.join(root, "from-hf"))
    return differences(_read(os.path.join(root, "from-hf")), reference(name))


FAIRSEQ_ARGS = {"decoder_normalize_before": True, "decoder_attention_heads": 4,
                "tokens_per_sample": 16, "max_target_positions": 16, "activation_fn": "gelu",
                "share_decoder_input_output_embed": True, "dropout": 0.0,
                "attention_dropout": 0.0, "no_scale_embedding": False}


def _fairseq_round_trip(root: str) -> list:
    """A fairseq file of the reference tensors, imported and exported again: the differences
    of the imported model and of the exported fairseq tensors."""
    from megatron.checkpointing.fairseq import files, mapping
    from megatron.checkpointing.fairseq.convert import fairseq_to_megatron, megatron_to_fairseq
    from megatron.checkpointing.hf.convert import VocabOptions
    full, cfg = reference("fairseq"), model_config("fairseq")
    original = os.path.join(root, "fairseq-in")
    os.makedirs(original)
    state = {"args": None, "cfg": {"model": FAIRSEQ_ARGS}, "model": mapping.to_fairseq(full, cfg),
             "optimizer_history": [], "extra_state": {}, "last_optimizer_state": None}
    files.write_checkpoint(os.path.join(original, "model.pt"), state)
    with open(os.path.join(original, "dict.txt"), "w") as f:
        f.writelines(f"{1000 + i} {VOCAB - i}\n" for i in range(VOCAB - 4))
    fairseq_to_megatron(os.path.join(original, "model.pt"), os.path.join(root, "from-fairseq"),
                        tp=2, vocab=VocabOptions(VOCAB // 2))  # the reference's rows, unpadded
    found = differences(_read(os.path.join(root, "from-fairseq")), full)
    path = megatron_to_fairseq(os.path.join(root, "from-fairseq"), os.path.join(root, "fairseq-out"))
    back = files.load_state(path)["model"]
    return found + [f"fairseq {n}" for n in differences(back, state["model"])]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("every-tensor"))
    ranks = run_ranks(_rank, 2, workdir, timeout=600)
    tools = {}
    for name in VARIANTS:
        root = os.path.join(workdir, name)
        tools.update({f"{name}/{path}": diff for path, diff in _merged(name, root).items()})
        tools[f"{name}/hf"] = _hf_round_trip(name, root)
    tools["fairseq/fairseq"] = _fairseq_round_trip(os.path.join(workdir, "fairseq"))
    return ranks, tools, workdir


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_enumeration_holds_every_parameter_and_persistent_buffer(name):
    model = meta_model(name)
    persistent = set(model.state_dict())
    names = {n for n, _ in model.named_parameters()} | {
        n for n, _ in model.named_buffers() if n in persistent}
    assert names == set(reference(name))
    for inner in MUST_HOLD.get(name, ()):
        assert any(n.endswith(inner) for n in names), inner


@pytest.mark.parametrize("path", RANK_PATHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_tensor_round_trips_through_each_checkpoint_path(name, path, results):
    ranks = results[0]
    for rank, result in enumerate(ranks):
        assert result[f"{name}/{path}"] == [], (rank, name, path)


@pytest.mark.parametrize("path", TOOL_PATHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_tensor_round_trips_through_merge_mp_partitions(name, path, results):
    assert results[1][f"{name}/{path}"] == []


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hugging_face_export_carries_every_tensor_or_refuses_in_one_line(name, results):
    outcome = results[1][f"{name}/hf"]
    if name in REFUSED_BY_HF:
        assert isinstance(outcome, str) and len(outcome.splitlines()) == 1, outcome
        assert REFUSED_BY_HF[name] in outcome, outcome
    else:
        assert outcome == []


def test_fairseq_import_and_export_carry_every_tensor(results):
    assert results[1]["fairseq/fairseq"] == []


BIAS = "language_model.encoder.layers.0.mlp.router.expert_bias"


@pytest.mark.parametrize("target, converted", [("hf", "qwen-moe/from-hf"),
                                               ("fairseq", "fairseq/from-fairseq")])
def test_an_export_refuses_a_tensor_its_format_cannot_carry(target, converted, results,
                                                           monkeypatch):
    """A converted checkpoint holding a tensor that its origin's format lacks (an expert bias
    in a Qwen2-MoE or fairseq model) is refused in one line naming it, never exported without."""
    from megatron.checkpointing.fairseq import convert as fairseq_convert
    from megatron.checkpointing.hf import ConversionError
    from megatron.checkpointing.hf import convert as hf_convert
    module = hf_convert if target == "hf" else fairseq_convert
    read = module.read_full_model

    def with_bias(load, *args, **kwargs):
        full, stored = read(load, *args, **kwargs)
        return dict(full, **{BIAS: torch.ones(4)}), stored
    monkeypatch.setattr(module, "read_full_model", with_bias)
    export = hf_convert.megatron_to_hf if target == "hf" else fairseq_convert.megatron_to_fairseq
    save = os.path.join(results[2], f"refused-{target}")
    with pytest.raises(ConversionError) as err:
        export(os.path.join(results[2], converted), save)
    assert len(str(err.value).splitlines()) == 1 and BIAS in str(err.value), err.value
    assert "cannot carry" in str(err.value) and not os.path.exists(os.path.join(save, "model.pt"))
