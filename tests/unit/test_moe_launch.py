"""Megatron-LM's Mixtral 8x7B launch (examples/pretrain_mixtral_8x7b.sh, TP 1, PP 4, EP 8 on
4 nodes x 8 GPUs) through pretrain_gpt.py's set-up unchanged, at its world size of 32: the
flags and tokenizer (`pretrain_gpt.setup`), the parallel groups `initialize_distributed`
builds on each rank (torch.distributed's group calls recorded instead of made), the model
spec of every pipeline stage (built on the meta device by pretrain_gpt's model provider)
and the memory planner of each stage."""
import io

import pytest
import torch.distributed as dist

import pretrain_gpt
from megatron.pipeline.layout import pipeline_layout
from megatron.training.initialize import initialize_distributed
from megatron.training.memory import GiB, Layout, estimate, stage_expert_params, stage_params
from tests.unit.test_examples import launcher_world_size, recorded_launch

spm = pytest.importorskip("sentencepiece")
WORLD = 32


class RecordedGroup:
    """What `dist.new_group` would have returned: the ranks, for the group queries."""

    def __init__(self, ranks):
        self.ranks = list(ranks)


class RecordedWorld:
    """torch.distributed as rank `rank` of `world` sees it, with the groups recorded."""

    def __init__(self, monkeypatch, world: int):
        self.rank, self.world = 0, world
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: RecordedGroup(ranks))
        monkeypatch.setattr(dist, "get_world_size", self.size)
        monkeypatch.setattr(dist, "get_rank", self.rank_in)

    def size(self, group=None):
        return self.world if group is None else len(group.ranks)

    def rank_in(self, group=None):
        return self.rank if group is None else group.ranks.index(self.rank)


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory):
    buffer = io.BytesIO()
    sentences = ["Mixtral routes every token to two of its eight experts.",
                 "Expert parallelism splits the experts over data-parallel ranks."]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences * 40), model_writer=buffer,
                                   vocab_size=80, model_type="bpe", minloglevel=2)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(buffer.getvalue())
    return str(path)


def test_megatron_lm_mixtral_launch_sets_up_at_world_32(tmp_path, monkeypatch, tokenizer_model):
    args = recorded_launch(tmp_path, "pretrain_mixtral_8x7b.sh", TOKENIZER=tokenizer_model,
                           CHECKPOINTS=str(tmp_path / "ckpt"))
    split = args.index("pretrain_gpt.py")
    launcher, flags = args[:split], args[split + 1:]
    assert launcher_world_size(launcher) == WORLD
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    config, tokenizer = pretrain_gpt.setup(flags)
    m, p, moe = config.model, config.parallel, config.model.moe
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.expert_model_parallel_size) == (1, 4, 8)
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_grouped_gemm,
            moe.moe_token_dispatcher_type, moe.moe_aux_loss_coeff) == (8, 2, True, "alltoall", 1e-2)
    assert config.training.bf16 and p.use_distributed_optimizer
    assert not m.sequence_parallel  # --sequence-parallel at TP 1 is off, as in Megatron-LM
    assert tokenizer.vocab_size == 80

    world = RecordedWorld(monkeypatch, WORLD)
    stages = {}
    for rank in range(WORLD):
        world.rank = rank
        pstate, device = initialize_distributed(config)
        # Every rank of a stage holds one of the 8 experts; an EP group is the stage's 8
        # consecutive ranks (its DP ranks at TP 1), and expert-DP is one rank.
        assert (pstate.pp_rank, pstate.dp_rank, pstate.tp_rank) == (rank // 8, rank % 8, 0)
        assert pstate.ep_group.ranks == list(range(rank // 8 * 8, rank // 8 * 8 + 8))
        assert pstate.ep_rank == rank % 8 and pstate.edp_size == 1
        assert pstate.pp_ranks == [rank % 8 + 8 * stage for stage in range(4)]
        if rank % 8 == 3:  # the rank whose stage is built below
            stages[pstate.pp_rank] = (rank, pstate)

    for pp_rank, (rank, pstate) in stages.items():
        world.rank = rank
        chunk = pipeline_layout(m.num_layers, 4).chunk(pp_rank)
        offset, count = chunk.layer_offset, chunk.num_layers
        model = pretrain_gpt.model_provider(
            config, pstate.tp_group, pretrain_gpt.real_vocab_rows(config, tokenizer),
            expert_groups=pstate.expert_groups(), cfg=config.model, device="meta",
            pre_process=pstate.is_first_stage(), post_process=pstate.is_last_stage(),
            layer_offset=offset, num_layers=count)
        layers = model.language_model.encoder.layers
        assert (offset, len(layers)) == (8 * pp_rank, 8)
        for layer in layers:
            experts = layer.mlp.experts
            assert experts.num_local == 1 and experts.grouped
            assert tuple(experts.linear_fc1.weight.shape) == (1, 2 * 14336, 4096)
        built = sum(t.numel() for t in model.parameters())
        assert stage_params(config, pp_rank) == built
        # The planner: expert parameters divided by EP, the rest sharded over DP 8 by the
        # distributed optimizer (expert-DP 1 keeps all of its experts' optimizer state).
        planned = estimate(config, Layout(world_size=WORLD, pp_rank=pp_rank))
        experts = stage_expert_params(config, pp_rank)
        assert experts == 8 * 3 * 14336 * 4096
        assert planned["parameters"] == 2 * built and planned["gradients"] == 4 * built
        assert planned["optimizer"] == 12 * (built - experts) // 8 + 12 * experts
        assert 20 * GiB < planned["total"] < 80 * GiB, planned["total"] / GiB
