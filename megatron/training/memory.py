"""Per-rank memory and step time of a training run, predicted from its Config.

What this framework keeps (tests/unit/test_estimate.py holds the numbers against
a built model, its optimizer and the tensors autograd saves):

- parameters of the rank's pipeline stage (its chunks), sharded over TP;
- gradients: the reducer's buffer, fp32 for 16-bit models;
- optimizer: fp32 main parameters (16-bit models), Adam's two moments, and the
  flat gradient copy of the flat Adam; all but the last sharded over DP with the
  distributed optimizer (which keeps its own fp32 main shard for every model);
- activations of one micro batch, what autograd saves in the forward (SDPA or our CPU
  attention kernel, or the explicit softmax, as CoreAttention chooses; full / selective
  recomputation; sequence parallelism), times the micro batches the schedule keeps in
  flight on the rank.

Element counts per layer (layer_activations gives them in bytes, tensor by tensor), one
micro batch of b sequences of s tokens, TP = t, s' = s / t under sequence parallelism
(else s), q = heads x kv_channels, k = query groups x kv_channels (per rank: at least one
group), f = ffn width:
  norm inputs 2 s' b h; linear inputs after the norms 2 s' b h (under SP the column-parallel
  linears keep their input's shard and gather it again in the backward); QKV output
  s b (q + 2k) / t; attention output (SDPA) s b q / t; its copy for the dense layer
  s b q / t; MLP: activation input and output 2 s b f / t (gated: 4); explicit softmax:
  the probabilities b (heads / t) s^2; hidden dropout: two masks of s' b h, a byte each
  (the model's dtype with torch's CPU dropout, --no-bias-dropout-fusion).
With bf16, SP and selective recomputation that is Megatron's 34 s b h / t bytes.
At the peak, the start of the backward, the last layer's MLP backward also holds the
gradients of its inner tensors and its activation's temporaries (`backward_working_set`:
s b (h + 5 f / t) for a gated MLP, s b (h + 3 f / t) otherwise; measured with
benchmarks/bench_long_context.py, whose RSS it brings within a few percent).
Context parallelism (CP = c) divides the sequence: s above is s / c. The ring
(--cp-comm-type p2p) saves what SDPA does (q, k, v, its output and log-sum-exp);
while a layer runs, two K/V blocks travel (received and in flight: 4 s b k / t,
`cp_ring_buffers`). All-to-all (a2a) saves the whole-sequence attention of heads / c,
as many elements.
"""
from dataclasses import dataclass
from typing import Dict, Optional

from megatron.pipeline.schedule import interleaved_num_warmup, num_warmup_microbatches
from megatron.training.flops import hardware_flops

GiB = 2 ** 30


@dataclass
class Layout:
    """Where the estimate is made: one rank's place in the layout."""
    world_size: int
    pp_rank: int = 0
    device_type: str = "cuda"


def _bytes_per(config) -> int:
    return 2 if (config.training.fp16 or config.training.bf16) else 4


def _kv_per_rank(m, tp: int) -> int:
    return max(m.num_query_groups // tp, 1) * m.kv_channels


def _norm_params(m, width: int) -> int:
    return width if m.normalization == "RMSNorm" else 2 * width


def _mla_projection_params(m, tp: int) -> int:
    """The q / kv projections and latent norms of a multi-latent attention layer on one TP
    rank (megatron/model/mla.py): the down-projections replicated, the up-projections split
    by heads."""
    h, heads = m.hidden_size, m.num_attention_heads // tp
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank is None:
        q = h * heads * q_head
    else:
        q = h * m.q_lora_rank + _norm_params(m, m.q_lora_rank) + m.q_lora_rank * heads * q_head
    kv = (h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + _norm_params(m, m.kv_lora_rank)
          + m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim))
    return q + kv


def layer_params(m, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank."""
    h, q, f = m.hidden_size, m.query_projection_size, m.ffn_hidden_size
    norm = _norm_params(m, h)
    qkv_rows = q // tp + 2 * _kv_per_rank(m, tp)
    up_rows = (2 if m.gated_mlp else 1) * f // tp
    bias = m.add_bias_linear
    norms = 4 if m.sandwich_norm else 2  # --sandwich-norm: one more per branch output
    qkv = _mla_projection_params(m, tp) if m.multi_latent_attention else qkv_rows * h
    params = norms * norm + qkv + q // tp * h + up_rows * h + f // tp * h
    params += qkv_rows if (bias or m.add_qkv_bias) and not m.multi_latent_attention else 0
    params += (h + up_rows + h) if bias else 0
    if m.qk_layernorm:
        params += 2 * _norm_params(m, m.kv_channels)
    if m.softmax_type == "learnable":  # a sink logit per head (megatron/model/sinks.py)
        params += m.num_attention_heads // tp
    return params


def moe_mlp_params(m, tp: int, ep: int, etp: int):
    """(dense, expert) parameters of an MoE layer's MLP on one rank: the router and shared
    expert (replicated / TP-split), and the E / EP local experts (split over expert TP)."""
    moe, h, gates = m.moe, m.hidden_size, 2 if m.gated_mlp else 1
    f = (moe.moe_ffn_hidden_size or m.ffn_hidden_size) // etp
    experts = moe.num_experts // ep * ((gates * f + f) * h + ((gates * f + h) if m.add_bias_linear else 0))
    dense = moe.num_experts * (h + (1 if m.add_bias_linear else 0))
    shared = moe.moe_shared_expert_intermediate_size
    if shared:
        dense += (gates + 1) * shared // tp * h + (h if moe.moe_shared_expert_gate else 0)
        dense += (gates * shared // tp + h) if m.add_bias_linear else 0
    return dense, experts


def _dense_mlp_params(m, tp: int) -> int:
    f, h = m.ffn_hidden_size, m.hidden_size
    up_rows = (2 if m.gated_mlp else 1) * f // tp
    return up_rows * h + f // tp * h + ((up_rows + h) if m.add_bias_linear else 0)


def stage_layer_numbers(config, pp_rank: int):
    """Global (1-based) numbers of the layers of the rank at `pp_rank`, all its chunks (the
    MTP layers' transformer layers too: --num-layers + k)."""
    numbers, layers = [], config.model.num_layers
    for chunk in config.pipeline_layout().chunks(pp_rank):
        numbers += range(chunk.layer_offset + 1, chunk.layer_offset + chunk.num_layers + 1)
        numbers += range(layers + 1, layers + chunk.mtp_layers + 1)  # MTP layers, numbered after
    return numbers


def stage_expert_params(config, pp_rank: int) -> int:
    """Expert parameters of the rank (sharded over expert-DP by the distributed optimizer)."""
    m, p = config.model, config.parallel
    return sum(moe_mlp_params(m, p.tensor_model_parallel_size, p.expert_model_parallel_size,
                              p.expert_tp)[1]
               for n in stage_layer_numbers(config, pp_rank) if m.is_moe_layer(n))


def _moe_layers_correction(config, pp_rank: int) -> int:
    """What MoE layers hold beyond (or short of) a dense layer's MLP."""
    m, p = config.model, config.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    moe = [n for n in stage_layer_numbers(config, pp_rank) if m.is_moe_layer(n)]
    if not moe:
        return 0
    return len(moe) * (sum(moe_mlp_params(m, tp, ep, p.expert_tp)) - _dense_mlp_params(m, tp))


def stage_layers(config, pp_rank: int) -> int:
    """Transformer layers of the rank at `pp_rank`, all its chunks (the pipeline layout's)."""
    return len(stage_layer_numbers(config, pp_rank))


def _embedding_params(m, tp: int) -> int:
    """The input embedding: word (vocab-parallel), learned positions, its norm."""
    h = m.hidden_size
    params = m.padded_vocab_size // tp * h
    params += m.max_position_embeddings * h if m.position_embedding_type == "learned_absolute" else 0
    return params + (_norm_params(m, h) if m.embed_layernorm else 0)


def stage_params(config, pp_rank: int) -> int:
    """Parameters held by the rank at `pp_rank` (any TP / DP rank alike)."""
    m, p = config.model, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, vocab = m.hidden_size, m.padded_vocab_size // tp
    first, last = pp_rank == 0, pp_rank == pp - 1
    norm = _norm_params(m, h)
    params = stage_layers(config, pp_rank) * layer_params(m, tp) + _moe_layers_correction(config, pp_rank)
    if first:
        params += _embedding_params(m, tp)
    if last:
        params += norm
        if m.untie_embeddings_and_output_weights or not first:
            params += vocab * h  # the output layer, or the last stage's copy of the embeddings
        params += _mtp_params(m, tp, first)
    return params


def _mtp_params(m, tp: int, first: bool) -> int:
    """What the MTP depths add beyond their transformer layers: enorm, hnorm, final norm and
    eh_proj each, and an untied model's embedding copy on a last stage that is not first."""
    if not m.mtp_depths:
        return 0
    norm = _norm_params(m, m.hidden_size)
    params = m.mtp_depths * (3 * norm + 2 * m.hidden_size * m.hidden_size // tp)
    if m.untie_embeddings_and_output_weights and not first:
        params += _embedding_params(m, tp)
    return params


def flat_adam(config, layout: Layout) -> bool:
    """Whether MegatronOptimizer updates over flat buffers and keeps a gradient copy (it
    reads our reducer's buffers in place: only --DDP-impl torch's gradients are copied)."""
    return (config.optimizer.optimizer == "adam" and not config.parallel.use_distributed_optimizer
            and layout.device_type in ("cpu", "cuda") and config.parallel.DDP_impl == "torch")


def shard_counts(config, layout: Layout):
    """(dense, expert) shard counts of a rank's state: dense parameters shard over DP x CP,
    experts over expert-DP (the expert grid ETP x EP x expert-DP covers TP x CP x DP)."""
    p = config.parallel
    shards = layout.world_size // p.model_parallel_size * p.context_parallel_size
    edp = max(1, shards * p.tensor_model_parallel_size
              // (p.expert_tp * p.expert_model_parallel_size))
    return shards, edp


def _sharded(config, layout: Layout, bytes_per_param: int) -> int:
    """Bytes of `bytes_per_param` per parameter of the stage, sharded as shard_counts says."""
    n = stage_params(config, layout.pp_rank)
    experts = stage_expert_params(config, layout.pp_rank)
    shards, edp = shard_counts(config, layout)
    return bytes_per_param * (n - experts) // shards + bytes_per_param * experts // edp


def _moments_per_param(config) -> int:
    return 8 if config.optimizer.optimizer == "adam" else 4


def state_bytes(config, layout: Layout) -> Dict[str, int]:
    """Parameters, gradients and optimizer state of one rank, in bytes."""
    p = config.parallel
    if p.use_torch_fsdp2:
        return fsdp_state_bytes(config, layout)
    n = stage_params(config, layout.pp_rank)
    mixed = config.training.fp16 or config.training.bf16
    grads = 4 * n if (mixed or p.accumulate_allreduce_grads_in_fp32) else _bytes_per(config) * n
    if p.use_distributed_optimizer:  # its own fp32 main shard and the moments, sharded
        optimizer = _sharded(config, layout, 4 + _moments_per_param(config))
    else:
        optimizer = (4 * n if mixed else 0) + _moments_per_param(config) * n \
            + (4 * n if flat_adam(config, layout) else 0)
    return {"parameters": _bytes_per(config) * n, "gradients": grads, "optimizer": optimizer}


def fsdp_state_bytes(config, layout: Layout) -> Dict[str, int]:
    """--use-torch-fsdp2: FSDP's sharded fp32 parameters (they are the main parameters,
    megatron/optimizer/fsdp.py), its sharded fp32 gradients and the moments of the shards;
    dense ones over DP x CP, experts over expert-DP (megatron/distributed/fsdp.py)."""
    return {"parameters": _sharded(config, layout, 4), "gradients": _sharded(config, layout, 4),
            "optimizer": _sharded(config, layout, _moments_per_param(config))}


def fsdp_unit_params(config, pp_rank: int):
    """(root, other units in forward order) parameters of the rank's FSDP units, unsharded
    (TP-local): an untied model's input embedding, then each transformer layer (its experts
    with it: they are gathered in its forward); the root unit holds the rest (final norm,
    head, tied embeddings)."""
    m, p = config.model, config.parallel
    tp = p.tensor_model_parallel_size
    units = [_embedding_params(m, tp)] if pp_rank == 0 and m.untie_embeddings_and_output_weights \
        else []
    for n in stage_layer_numbers(config, pp_rank):
        units.append(layer_params(m, tp))
        if m.is_moe_layer(n):
            units[-1] += sum(moe_mlp_params(m, tp, p.expert_model_parallel_size, p.expert_tp)) \
                - _dense_mlp_params(m, tp)
    return stage_params(config, pp_rank) - sum(units), units


def fsdp_working_bytes(config, layout: Layout, num_microbatches: int) -> Dict[str, int]:
    """What FSDP holds beyond its shards at its peak, in bytes: the backward of the unit U
    (whichever makes the most), while U's gradient is reduce-scattered.
    - gathered parameters, in the compute dtype: the root unit (torch never reshards it after
      forward), U and the unit before it, which torch prefetches; with
      --no-fsdp-reshard-after-forward every unit;
    - unsharded gradients: U's as autograd makes it (compute dtype) and its fp32 copy into
      the reduce-scatter's buffer, and the root's, which is reduced only at the end of the
      backward; with more than one micro batch instead of the root's the chunk's whole fp32
      gradient, accumulated unsharded between micro batches (FSDPReducer's no_sync)."""
    root, units = fsdp_unit_params(config, layout.pp_rank)
    item, everything = _bytes_per(config), root + sum(units)
    kept = not config.parallel.fsdp_reshard_after_forward
    accumulated = 4 * everything if num_microbatches > 1 else item * root
    peak = (0, 0)
    for i, unit in enumerate(units or [0]):
        gathered = everything if kept else root + unit + (units[i - 1] if i else 0)
        peak = max(peak, (item * gathered, accumulated + (item + 4) * unit), key=sum)
    return {"fsdp gathered parameters": peak[0], "fsdp unsharded gradients": peak[1]}


def _cpu_kernel_runs(config) -> bool:
    """Whether `--attention-impl auto` runs our CPU attention kernel in training (no mask,
    no ALiBi: CoreAttention._use_cpu_kernel), by the fused package's own decision for q, k,
    v of this rank's shape and dtype (stand-ins of one row's storage) and its attention
    dropout (the kernel regenerates its mask in the backward: nothing more is saved)."""
    import torch

    from megatron import fused
    from megatron.training.kernel_choices import attention_stand_in
    m = config.model
    if not m.masked_softmax_fusion:
        return False
    dtype = (torch.float16 if config.training.fp16 else
             torch.bfloat16 if config.training.bf16 else torch.float32)
    q = attention_stand_in(config, dtype)
    return fused.causal_attention_preferred(q, q, q, dropout_p=m.attention_dropout)


def _bf16_head_in_place(config, device_type: str) -> bool:
    """Whether the head's cross entropy of bf16 logits makes no fp32 copy of them (CPUs with
    the kernels: mpu/cross_entropy.py `_forward_grad_`)."""
    import torch

    from megatron import fused
    if device_type != "cpu" or not config.training.bf16:
        return False
    return fused.softmax_grad_fusable(torch.empty(1, 16, dtype=torch.bfloat16))


def _saves_probabilities(config, device_type: str) -> bool:
    """Whether a layer's attention in training is the explicit softmax(q k^T) v, which
    saves its probabilities, rather than SDPA or our CPU kernel (output and log-sum-exp
    only): the choice of CoreAttention.forward."""
    m = config.model
    if _ring(config) or m.attention_impl == "sdpa":
        return False
    if m.attention_impl != "auto":
        return True
    if _masked_attention(m) or m.position_embedding_type == "alibi":
        return True
    if device_type == "cpu" and _cpu_kernel_runs(config):
        return False
    cpu_dropout = m.attention_dropout > 0 and device_type == "cpu"
    scaled_fp16 = config.training.fp16 and m.apply_query_key_layer_scaling
    return cpu_dropout or scaled_fp16


def _masked_attention(m) -> bool:
    """Some layer attends with a mask that takes the explicit path: attention chunks that do
    not tile the sequence (chunks that do are folded into the batch; a sliding window alone is
    our kernel's or SDPA's mask). Counted for every layer: an upper bound."""
    seq = m.seq_length
    return any(seq % m.chunk_for_layer(n) for n in m.masked_layers(seq)
               if (m.chunk_for_layer(n) or seq) < seq)


def local_seq_length(config) -> int:
    """Tokens of each sequence on one rank: seq / CP."""
    return config.model.seq_length // config.parallel.context_parallel_size


def _ring(config) -> bool:
    p = config.parallel
    return p.context_parallel_size > 1 and p.cp_comm_type == "p2p"


def _a2a(config) -> bool:
    p = config.parallel
    return p.context_parallel_size > 1 and p.cp_comm_type == "a2a"


def cp_ring_buffers(config) -> float:
    """Bytes of the K/V blocks in transit around the ring (one layer at a time)."""
    if not _ring(config):
        return 0.0
    tp = config.parallel.tensor_model_parallel_size
    s, b = local_seq_length(config), config.training.micro_batch_size
    return 4 * s * b * _kv_per_rank(config.model, tp) * _bytes_per(config)


def _mask_bytes(config, device_type: str) -> int:
    """Bytes per element of a dropout mask: a bool (our fused CPU dropout, CUDA's native
    dropout), or the model's dtype (torch's CPU dropout keeps its noise tensor)."""
    if device_type == "cpu" and not config.model.bias_dropout_fusion:
        return _bytes_per(config)
    return 1


def _core_attention(config, micro_batch: int, device_type: str) -> Dict[str, float]:
    """What the attention core (q k^T, softmax, dropout, times v) saves beyond its inputs
    q, k, v; nothing under selective recomputation, which recomputes it."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    if m.recompute_granularity == "selective":
        return {}
    s, b, item = local_seq_length(config), micro_batch, _bytes_per(config)
    heads, q = m.num_attention_heads // tp, m.query_projection_size // tp
    if not _saves_probabilities(config, device_type):  # SDPA or our kernel
        return {"attention output": s * b * q * item, "attention log-sum-exp": b * heads * s * 4}
    probs = b * heads * s * s
    out = {"attention probabilities": probs * item}
    if m.attention_dropout > 0:  # the mask and the dropped probabilities (times v)
        out["attention dropout mask"] = probs * _mask_bytes(config, device_type)
        out["attention dropped probabilities"] = probs * item
    return out


def layer_activations(config, micro_batch: int, device_type: str) -> Dict[str, float]:
    """Bytes one transformer layer saves for backward over one micro batch, tensor by
    tensor (tests/unit/test_estimate.py measures them). Under sequence parallelism every
    tensor between the column- and row-parallel linears is split over TP by heads or
    columns, and everything else by the sequence: the column-parallel linears keep their
    input's shard and gather it again in the backward (mpu.linear_with_sequence_gather).
    With selective recomputation and bf16 that is Megatron's 34 s b h / t."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    s, b, h, item = local_seq_length(config), micro_batch, m.hidden_size, _bytes_per(config)
    sp = s // tp if config.parallel.sequence_parallel else s
    if m.recompute_granularity == "full":
        return {"layer input (full recomputation)": sp * b * h * item / m.checkpoint_num_layers}
    q, k, f = m.query_projection_size // tp, _kv_per_rank(m, tp), m.ffn_hidden_size // tp
    stats = 1 if m.normalization == "RMSNorm" else 2  # 1 / rms; or mean and 1 / std
    out = {
        "attention norm input": sp * b * h * item,
        "QKV input": sp * b * h * item,
        "q, k, v": s * b * (q + 2 * k) * item,
        **_core_attention(config, micro_batch, device_type),
        "attention projection input": s * b * q * item,
        "MLP norm input": sp * b * h * item,
        "MLP input": sp * b * h * item,
        # gated: gate, its activation, up and the product; else the input and the output
        "MLP activation": s * b * f * (4 if m.gated_mlp else 2) * item,
        "norm statistics": (4 if m.sandwich_norm else 2) * stats * sp * b * 4,
    }
    if m.sandwich_norm:  # the norms of the attention and MLP outputs
        out["sandwich norm inputs (2)"] = 2 * sp * b * h * item
    if m.hidden_dropout > 0:
        out["dropout masks (2)"] = 2 * sp * b * h * _mask_bytes(config, device_type)
    return out


def backward_working_set(config) -> float:
    """Bytes the MLP backward holds on top of the saved activations (see the docstring)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    s, b = local_seq_length(config), config.training.micro_batch_size
    inner = (5 if m.gated_mlp else 3) * m.ffn_hidden_size / tp
    return s * b * (m.hidden_size + inner) * _bytes_per(config)


def _moe_activation_correction(config, micro_batch: int, pp_rank: int) -> float:
    """An MoE layer saves, instead of the dense MLP's activations: router logits and
    probabilities (3 s b E), the rows its local experts take (top-k s b h on average
    under either dispatcher: allgather's gathered tokens are only indexed, not saved)
    and their weighted outputs (top-k s b h), each expert row's activation input and
    output, and the shared expert's (tests/unit/test_moe_estimate.py measures them). With
    expert TP below TP, a rank's experts take its TP / ETP part of the routed rows."""
    m, p = config.model, config.parallel
    moe = m.moe
    layers = sum(m.is_moe_layer(n) for n in stage_layer_numbers(config, pp_rank))
    if not layers or m.recompute_granularity == "full":
        return 0.0
    tp, s, b, h = p.tensor_model_parallel_size, local_seq_length(config), micro_batch, m.hidden_size
    act = 4 if m.gated_mlp else 2
    etp = p.expert_tp
    k, f = moe.moe_router_topk, (moe.moe_ffn_hidden_size or m.ffn_hidden_size) // etp
    rows = k * s * b / (tp // etp)  # routed rows this rank's experts take
    shared = (moe.moe_shared_expert_intermediate_size or 0) // tp
    elements = 3 * s * b * moe.num_experts + 2 * rows * h
    elements += rows * f * act + s * b * shared * act + (2 * s * b * h if shared else 0)
    return layers * (elements - s * b * m.ffn_hidden_size // tp * act)


def head_activation_elements(config, micro_batch: int) -> float:
    """The last stage's final norm, output layer and cross entropy."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    s, b, h = local_seq_length(config), micro_batch, m.hidden_size
    sp = s // tp if config.parallel.sequence_parallel else s
    return sp * b * h + s * b * h + s * b * m.padded_vocab_size / tp


def in_flight_micro_batches(config, pp_rank: int, num_microbatches: int) -> float:
    """Micro batches whose activations the schedule holds at once on `pp_rank`
    (in units of the stage's whole layer stack)."""
    pp = config.parallel.pipeline_model_parallel_size
    chunks = config.virtual_pipeline_size
    if pp == 1:
        return 1
    if chunks:
        return (interleaved_num_warmup(pp_rank, pp, chunks, num_microbatches) + 1) / chunks
    return num_warmup_microbatches(pp_rank, pp, num_microbatches) + 1


def activation_bytes(config, layout: Layout, num_microbatches: int) -> Dict[str, float]:
    """Saved activations of one micro batch on the rank, and all it holds at the peak."""
    m = config.model
    b = config.training.micro_batch_size
    pp = config.parallel.pipeline_model_parallel_size
    per_micro = stage_layers(config, layout.pp_rank) * sum(
        layer_activations(config, b, layout.device_type).values())
    extra = _moe_activation_correction(config, b, layout.pp_rank)
    if layout.pp_rank == pp - 1:  # the head, again for each MTP depth
        extra += (1 + m.mtp_depths) * head_activation_elements(config, b)
    per_micro += extra * _bytes_per(config)
    head_fp32 = 4 * local_seq_length(config) * b * m.padded_vocab_size / \
        config.parallel.tensor_model_parallel_size
    if (layout.pp_rank == pp - 1 and _bytes_per(config) == 2 and not m.fp16_lm_cross_entropy
            and not _bf16_head_in_place(config, layout.device_type)):
        per_micro += head_fp32 / 2  # the cross entropy runs on fp32 logits
    in_flight = in_flight_micro_batches(config, layout.pp_rank, num_microbatches)
    return {"per_micro_batch": per_micro, "in_flight": in_flight, "total": per_micro * in_flight}


def memory_rows(config):
    """The keys of estimate() that add up to a rank's total."""
    rows = ("parameters", "gradients", "optimizer", "activations")
    if config.parallel.use_torch_fsdp2:
        rows += ("fsdp gathered parameters", "fsdp unsharded gradients")
    return rows


def estimate(config, layout: Layout, device_flops: Optional[float] = None,
             link_bandwidth: Optional[float] = None) -> Dict[str, float]:
    """Memory (bytes) of one rank and, given a device rate (FLOP/s) and a link
    bandwidth (bytes/s), a predicted step time (seconds)."""
    t, p = config.training, config.parallel
    dp = layout.world_size // p.model_parallel_size
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    out: Dict[str, float] = dict(state_bytes(config, layout))
    acts = activation_bytes(config, layout, micro)
    out["activations"] = acts["total"] + cp_ring_buffers(config) + backward_working_set(config)
    out["activations_per_micro_batch"] = acts["per_micro_batch"]
    out["in_flight_micro_batches"] = acts["in_flight"]
    if p.use_torch_fsdp2:
        out.update(fsdp_working_bytes(config, layout, micro))
    out["total"] = sum(out[key] for key in memory_rows(config))
    if device_flops:
        out.update(step_time(config, layout, micro, device_flops, link_bandwidth))
    return out


def _cp_ring_bytes(config, micro: int, layers: int) -> float:
    """Bytes each rank sends around the CP ring per step: K/V (CP - 1) hops forward and
    in the backward, the K/V gradients CP hops."""
    cp = config.parallel.context_parallel_size
    if not _ring(config):
        return 0.0
    per_hop = cp_ring_buffers(config) / 2  # one K/V block
    return layers * micro * per_hop * ((cp - 1) * 2 + cp)


def step_time(config, layout: Layout, micro: int, device_flops: float,
              link_bandwidth: Optional[float]) -> Dict[str, float]:
    """Compute (hardware FLOPs / rate, with the pipeline bubble) plus the exposed
    communication of TP (all-reduce per layer), DP (gradients) and PP (activations)."""
    m, p, t = config.model, config.parallel, config.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    dp = layout.world_size // p.model_parallel_size
    flops = hardware_flops(m, t.global_batch_size)
    chunks = config.virtual_pipeline_size or 1
    bubble = (pp - 1) / (chunks * micro)
    compute = flops / (device_flops * layout.world_size) * (1 + bubble)
    comm = 0.0
    if link_bandwidth:
        item = _bytes_per(config)
        tokens = micro * t.micro_batch_size * local_seq_length(config)
        layers = stage_layers(config, layout.pp_rank)
        # 2 all-reduces forward + 2 backward per layer, ring: 2 (t - 1) / t of the data each
        comm += 4 * layers * tokens * m.hidden_size * item * 2 * (tp - 1) / tp / link_bandwidth
        shards = dp * p.context_parallel_size  # one gradient reduction over DP x CP
        comm += 2 * (shards - 1) / shards * state_bytes(config, layout)["gradients"] \
            / link_bandwidth
        comm += 2 * micro * (pp - 1 > 0) * t.micro_batch_size * local_seq_length(config) \
            * m.hidden_size * item / tp ** (1 if p.sequence_parallel else 0) / link_bandwidth
        comm += _cp_ring_bytes(config, micro, layers) / link_bandwidth
    return {"compute_seconds": compute, "communication_seconds": comm, "step_seconds": compute + comm,
            "hardware_flops": flops}
