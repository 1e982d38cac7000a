"""Megatron-Core 0.16.1's whole training step as the oracle of ours (issue 33, item 2).

In one spawn of 2 gloo ranks, for each case: our Trainer (built from our flags as
pretrain_gpt builds it) takes 10 steps on a fixed list of token batches; its initial weights,
saved in torch_dist, are loaded into Megatron-Core's GPTModel (local spec), which is wrapped
in its DistributedDataParallel and trained on the same batches with `get_megatron_optimizer`,
`get_forward_backward_func`, `finalize_model_grads` and `OptimizerParamScheduler` as
Megatron-LM's train_step drives them, with the same learning-rate schedule (warm-up, then
cosine or linear decay to --min-lr), weight decay (biases and norms exempt in both), clipping
and Adam hyper-parameters. Megatron-Core's final weights are loaded back into our model and
compared with ours, with the losses and gradient norms of every step (within 1e-5).

Cases: a LLaMA-style model (RoPE, RMSNorm, SwiGLU, GQA, untied, no bias) at TP 2 and at PP 2
(Megatron-Core's 1F1B schedule), and an MoE model at EP 2 (sigmoid scores, aux loss, z-loss,
expert bias), each without and with the distributed optimizer.
"""
import os
from dataclasses import dataclass
from functools import partial
from typing import List, Optional

import pytest
import torch

from tests.distributed.run_ranks import run_ranks
from tests import oracles
from tests.mcore_setup import cpu_devices

pytestmark = oracles.needs("megatron-core")

HIDDEN, HEADS, GROUPS, FFN, SEQ, VOCAB = 64, 4, 2, 128, 16, 256
ITERS, GBS, MBS = 10, 4, 1
TOL = 1e-5
EXPERTS, TOPK, MOE_FFN = 4, 2, 64
OPT = dict(lr=3e-3, min_lr=3e-4, weight_decay=0.1, clip_grad=1.7, adam_beta1=0.9,
           adam_beta2=0.95, adam_eps=1e-8)
"""Both optimizers' hyper-parameters (clipping set so that some steps clip and some not)."""
MOE = dict(moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_bias_update_rate=1e-2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
           moe_router_load_balancing_type="aux_loss")
"""The MoE settings, under Megatron-Core's names (ours are the same flags)."""


@dataclass(frozen=True)
class Case:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    distributed_optimizer: bool = False
    decay: str = "cosine"
    layers: int = 2
    sequence_parallel: bool = False
    bias: bool = False
    """Biases in every linear layer (GROUP_CASES only)."""

    @property
    def dp(self) -> int:
        return 2 // (self.tp * self.pp)

    @property
    def moe(self) -> bool:
        return self.ep > 1


CASES = {
    "tp2": Case(tp=2),
    "tp2-sp-distopt": Case(tp=2, distributed_optimizer=True, decay="linear",
                           sequence_parallel=True),
    "pp2": Case(pp=2, layers=4),
    "pp2-distopt": Case(pp=2, layers=4, distributed_optimizer=True, decay="linear"),
    "ep2": Case(ep=2),
    "ep2-distopt": Case(ep=2, distributed_optimizer=True, decay="linear"),
}


GROUP_CASES = {"ep2-biases": Case(ep=2, bias=True)}
"""Only the weight-decay groups compared: an MoE model with biases (its stacked expert biases
[experts, n] exempt, as Megatron-Core's per-expert ones). Not trained: Adam turns the float
noise of the query and key biases' near-zero gradients (softmax is shift-invariant but for
RoPE) into 1e-5 differences of the weights."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def our_argv(case: Case) -> list:
    """Our flags for `case`: the LLaMA-style model, the schedule and the optimizer."""
    argv = ["--num-layers", str(case.layers), "--hidden-size", str(HIDDEN),
            "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--use-rotary-position-embeddings",
            "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
            "--num-query-groups", str(GROUPS), "--ffn-hidden-size", str(FFN),
            "--untie-embeddings-and-output-weights",
            "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
            "--train-iters", str(ITERS), "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
            "--lr-decay-style", case.decay, "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--use-cpu-initialization", "--eval-iters", "0", "--num-workers", "0",
            "--tensor-model-parallel-size", str(case.tp),
            "--pipeline-model-parallel-size", str(case.pp),
            "--expert-model-parallel-size", str(case.ep)]
    for name, value in OPT.items():
        argv += [_flag(name), str(value)]
    if case.distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    if case.sequence_parallel:
        argv.append("--sequence-parallel")
    if not case.bias:
        argv.append("--disable-bias-linear")
    if case.moe:
        argv += ["--num-experts", str(EXPERTS), "--moe-token-dispatcher-type", "allgather"]
        argv += _flags(MOE)
    return argv


def _flags(settings: dict) -> list:
    out = []
    for name, value in settings.items():
        out += [_flag(name)] if value is True else [_flag(name), str(value)]
    return out


def batches() -> List[torch.Tensor]:
    """The global batches [GBS, SEQ + 1] of the ITERS steps (token ids below VOCAB)."""
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=generator) for _ in range(ITERS)]


def micro_batches(batch: torch.Tensor, dp: int, dp_rank: int) -> List[torch.Tensor]:
    """This DP rank's micro batches of a global batch, as our sampler deals them."""
    return [batch[(j * dp + dp_rank) * MBS:(j * dp + dp_rank + 1) * MBS]
            for j in range(GBS // (MBS * dp))]


# --- ours ---------------------------------------------------------------------------------

def our_trainer(case: Case):
    """Our Trainer for `case`, as pretrain_gpt builds it."""
    import pretrain_gpt
    from megatron.training.initialize import initialize_distributed
    from megatron.training.parallelize import build_model
    from megatron.training.trainer import Trainer
    config, tokenizer = pretrain_gpt.setup(our_argv(case))
    assert config.model.padded_vocab_size == VOCAB
    pstate, device = initialize_distributed(config)
    provider = partial(pretrain_gpt.model_provider, config, pstate.tp_group,
                       pretrain_gpt.real_vocab_rows(config, tokenizer),
                       expert_groups=pstate.expert_groups())
    models = build_model(config, pstate, device, provider)
    step = partial(pretrain_gpt.forward_step, config, tokenizer.eod, pstate, device)
    return Trainer(config, pstate, device, models, step)


def our_run(trainer, data) -> dict:
    """Our ITERS steps: the lm loss (last stage) and gradient norm of each."""
    from megatron.training.trainer import ReplayIterators
    losses, norms = [], []
    for batch in data:
        trainer.microbatches.update(trainer.state.consumed_train)
        parts = micro_batches(batch, trainer.pstate.dp_size, trainer.pstate.dp_rank)
        iterators = ReplayIterators(iter({"text": m} for m in parts), 1).all()
        reported, norm, skipped, nan = trainer.train_step(iterators)
        assert not (skipped or nan)
        trainer.state.consumed_train += GBS
        losses.append(reported.get("lm loss"))
        norms.append(norm)
    return {"losses": losses, "norms": norms}


# --- Megatron-Core ------------------------------------------------------------------------

def mcore_config(case: Case):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    moe = dict(MOE, num_moe_experts=EXPERTS, moe_token_dispatcher_type="allgather") \
        if case.moe else {}
    return TransformerConfig(
        num_layers=case.layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=case.bias,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
        expert_model_parallel_size=case.ep, sequence_parallel=case.sequence_parallel, **moe)


def mcore_model(case: Case, config, weights_dir: Optional[str] = None):
    """Megatron-Core's GPTModel stage (with our initial weights from `weights_dir`), in its
    DDP wrapper."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS if case.moe else None,
                                    normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    if weights_dir is not None:
        mcore_load(model, weights_dir)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=case.distributed_optimizer)
    return DistributedDataParallel(config, ddp, model)


def mcore_load(model, directory: str) -> None:
    from megatron.core import dist_checkpointing
    wanted = {k: v for k, v in model.sharded_state_dict().items()
              if not k.endswith("_extra_state")}
    loaded = dist_checkpointing.load(wanted, directory)  # with our common state's keys
    missing, _ = model.load_state_dict({k: loaded[k] for k in wanted}, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing


def mcore_optimizer(case: Case, model):
    """get_megatron_optimizer and OptimizerParamScheduler as Megatron-LM sets them up from
    the same flags (warm-up and decay counted in samples)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    config = OptimizerConfig(optimizer="adam", use_distributed_optimizer=case.distributed_optimizer,
                             params_dtype=torch.float32, **OPT)
    optimizer = get_megatron_optimizer(config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=OPT["lr"], min_lr=OPT["min_lr"], lr_warmup_steps=2 * GBS,
        lr_decay_steps=8 * GBS, lr_decay_style=case.decay, start_wd=OPT["weight_decay"],
        end_wd=OPT["weight_decay"], wd_incr_steps=ITERS * GBS, wd_incr_style="constant")
    return optimizer, scheduler


def mcore_forward_step(data_iterator, model):
    """Megatron-LM's pretrain_gpt forward_step and loss_func (per-token mean of the micro
    batch; the schedule divides by the token count and the number of micro batches)."""
    text = next(data_iterator)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
    output = model(tokens, positions, None, labels=labels)

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.view(-1).float() * loss_mask.view(-1))
        num_tokens = loss_mask.sum().to(torch.int)
        report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
        return loss, num_tokens, {"lm loss": report}
    return output, loss_func


def mcore_run(case: Case, model, optimizer, scheduler, data) -> dict:
    """Megatron-LM's train_step, ITERS times: zero the grad buffers, the schedule (which
    calls finalize_model_grads), the optimizer step, the scheduler step; the reported loss is
    the token-weighted mean over micro batches and DP ranks."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    forward_backward = get_forward_backward_func()
    dp_rank = parallel_state.get_data_parallel_rank()
    losses, norms = [], []
    for batch in data:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        parts = micro_batches(batch, case.dp, dp_rank)
        reported = forward_backward(
            forward_step_func=mcore_forward_step, data_iterator=iter(parts), model=[model],
            num_microbatches=len(parts), seq_length=SEQ, micro_batch_size=MBS,
            forward_only=False)
        applied, norm, _ = optimizer.step()
        assert applied
        scheduler.step(increment=GBS)
        losses.append(_reported_loss(reported))
        norms.append(norm)
    return {"losses": losses, "norms": norms}


def _reported_loss(reported):
    from megatron.core import parallel_state
    if not reported:
        return None
    total = torch.stack([r["lm loss"] for r in reported]).sum(dim=0)
    torch.distributed.all_reduce(
        total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return (total[0] / total[1]).item()


# --- the comparison -----------------------------------------------------------------------

def our_decays(trainer) -> set:
    """{(Megatron-Core key, whether it gets weight decay)} of our (regular) optimizer."""
    from megatron.checkpointing.mcore_keys import mcore_key, stacks_layers
    opt = trainer.optimizer
    model_of = {id(main): p for p, main in zip(opt.model_params, opt.main_params)}
    decays = {id(model_of[id(main)]): flag
              for group, flag in zip(opt.param_groups, opt.group_decays) for main in group["params"]}
    stacked = stacks_layers(trainer.config.model)
    return {(mcore_key(name, stacked)[0], decays[id(p)])
            for m in trainer.models for name, p in m.global_parameter_names().items()}


def mcore_decays(model, optimizer) -> set:
    """{(key, whether it gets weight decay)} of Megatron-Core's optimizer (FP32Optimizer
    groups: the model's parameters; wd_mult 0 exempts)."""
    names = {id(p): n for n, p in model.module.named_parameters()}
    keys = model.module.sharded_state_dict()
    return {(keys[names[id(p)]].key, group["wd_mult"] != 0.0)
            for group in optimizer.param_groups for p in group["params"]}


def compare_groups(case: Case) -> dict:
    """Both optimizers' weight-decay groups for `case`, untrained."""
    from megatron.core import parallel_state
    trainer = our_trainer(case)
    _mcore_parallel_state(case)
    with cpu_devices():
        model = mcore_model(case, mcore_config(case))
        theirs = mcore_decays(model, mcore_optimizer(case, model)[0])
    parallel_state.destroy_model_parallel()
    return {"decays": (our_decays(trainer), theirs)}


def _mcore_parallel_state(case: Case) -> None:
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=case.tp,
                                             pipeline_model_parallel_size=case.pp,
                                             expert_model_parallel_size=case.ep)


def compare_case(case: Case, workdir: str, name: str) -> dict:
    """Ours and Megatron-Core's over ITERS steps of `case`: their losses, gradient norms and
    the largest difference of any final weight."""
    from megatron.checkpointing import torch_dist
    from megatron.core import dist_checkpointing, parallel_state
    data = batches()
    trainer = our_trainer(case)
    layers = trainer.config.model.num_layers
    start, final = (os.path.join(workdir, name, part, "iter_0000001") for part in ("start", "final"))
    torch_dist.save_model_weights(start, trainer.models, layers, trainer.pstate)
    initial = _weights(trainer.models)
    ours = our_run(trainer, data)
    trained = _weights(trainer.models)
    _mcore_parallel_state(case)
    with cpu_devices():
        model = mcore_model(case, mcore_config(case), start)
        optimizer, scheduler = mcore_optimizer(case, model)
        decays = None if case.distributed_optimizer else (our_decays(trainer),
                                                          mcore_decays(model, optimizer))
        theirs = mcore_run(case, model, optimizer, scheduler, data)
    if torch.distributed.get_rank() == 0:
        os.makedirs(final)
    torch.distributed.barrier()
    dist_checkpointing.save(model.module.sharded_state_dict(), final)
    parallel_state.destroy_model_parallel()
    for chunk, weights in zip(trainer.models, initial):  # a load that did nothing shows
        chunk.load_state_dict(weights)
    torch_dist.load_model_weights(final, trainer.models, layers, trainer.pstate)
    return {"ours": ours, "theirs": theirs, "params": _max_diff_of(trained, _weights(trainer.models)),
            "moved": _max_diff_of(trained, initial), "decays": decays}


def _weights(models) -> List[dict]:
    """Every parameter and persistent buffer (the expert bias) of each chunk, copied."""
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in models]


def _max_diff_of(a: List[dict], b: List[dict]) -> float:
    return max((x[k] - y[k]).abs().max().item() for x, y in zip(a, b) for k in x)


def _rank(rank, world_size, workdir, names):
    from tests.mcore_setup import import_mcore
    import_mcore()
    return {name: compare_case(CASES[name], workdir, name) if name in CASES
            else compare_groups(GROUP_CASES[name]) for name in names}


@pytest.fixture(scope="module")
def spawn2(tmp_path_factory):
    names = [*CASES, *GROUP_CASES]
    return run_ranks(_rank, 2, str(tmp_path_factory.mktemp("mcore-step")), names, timeout=900)


def _max_diff(got, want) -> float:
    pairs = [(a, b) for a, b in zip(got, want) if b is not None]
    assert len(pairs) == len(want) - want.count(None)
    return max(abs(a - b) for a, b in pairs) if pairs else 0.0


@pytest.mark.parametrize("name", list(CASES))
def test_training_step_equals_megatron_core(name, spawn2):
    for rank, results in enumerate(spawn2):
        result = results[name]
        ours, theirs = result["ours"], result["theirs"]
        assert [x is None for x in ours["losses"]] == [x is None for x in theirs["losses"]]
        assert _max_diff(ours["losses"], theirs["losses"]) < TOL, (rank, result)
        assert _max_diff(ours["norms"], theirs["norms"]) < TOL, (rank, result)
        assert result["params"] < TOL, (rank, result)
        assert result["moved"] > 100 * TOL, (rank, result)  # the steps did change the weights
        assert min(ours["norms"]) < OPT["clip_grad"] < max(ours["norms"])  # some steps clip


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.distributed_optimizer]
                         + list(GROUP_CASES))
def test_weight_decay_groups_equal_megatron_core(name, spawn2):
    for rank, results in enumerate(spawn2):
        ours, theirs = results[name]["decays"]
        assert ours == theirs, (rank, sorted(ours ^ theirs))
        assert {flag for _, flag in ours} == {True, False}
