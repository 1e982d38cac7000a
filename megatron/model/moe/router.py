"""The MoE router: logits -> top-k probabilities and routing map, with load balancing.

Tokens are rows: logits [T, E]. `probs` [T, E] holds each token's combine weight for
its selected experts (0 elsewhere) and `routing_map` [T, E] (bool) the selection.
The router sees every token of this data-parallel rank's micro batch (the MoE layer
gathers a sequence-parallel input first), so its losses need no TP reduction. Under
context parallelism it sees this CP rank's chunks of each sequence: each loss is then
this rank's part of the whole sequences' loss (scores of the local tokens, token counts
and the token total of all CP ranks), so the parts sum to the single-process loss, and
their gradients, summed over CP with the weight gradients, to its gradient.

Auxiliary losses do not change the returned values: like Megatron-LM, each is
attached to an activation by `AuxLossScaler`, whose backward feeds the loss's
gradient (scaled like the main loss) into the graph. Their values (without their
coefficients) are recorded for the log line.
"""
import math
from typing import Dict, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F

from megatron.mpu.layers import init_normal, set_parallel_attributes
from megatron.mpu.mappings import all_reduce, group_size

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class Router(Protocol):
    """What the MoE layer (layer.py) needs of a router; TopKRouter below is ours."""

    metrics: Dict[str, torch.Tensor]
    """Sums over this step's micro batches of what the log line reports (load_balancing_loss,
    z_loss without their coefficients; tokens per expert), reset by collect_moe_metrics."""
    cp_group: Optional[object]
    """The context-parallel group its losses are counted over (enable_context_parallel)."""
    expert_bias: Optional[torch.Tensor]
    """A persistent buffer of per-expert score offsets (aux-loss-free balancing), or None;
    update_expert_bias moves it after every step, applied or skipped, from
    local_tokens_per_expert (both stay float32 in an fp16/bf16 model)."""

    def __call__(self, x: torch.Tensor, seq_shape: Tuple[int, int]) -> Tuple[torch.Tensor,
                                                                              torch.Tensor]:
        """x [T, h] (T = s x b tokens, sequence-major; `seq_shape` = (s, b)) -> (probs,
        routing_map), both [T, E]: each token's combine weight for its selected experts (0
        elsewhere, in x's dtype or the router dtype) and the selection (bool). Auxiliary
        losses ride on the returned tensors' autograd (AuxLossScaler), never change them."""


class AuxLossScaler(torch.autograd.Function):
    """Identity on `x`; backward gives `aux_loss` the gradient `scale` (the main loss's
    1 / micro batches x loss scale), so the loss is trained wherever it was computed."""

    scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, x, aux_loss):
        ctx.save_for_backward(aux_loss)
        return x

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        scale = 1.0 if AuxLossScaler.scale is None else AuxLossScaler.scale
        return grad, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_scale(scale) -> None:
        """Set by the trainer before each schedule: loss scale / number of micro batches."""
        AuxLossScaler.scale = torch.as_tensor(scale, dtype=torch.float32)


# -- pure routing math ---------------------------------------------------------------------
def group_limited_topk(scores, topk: int, num_groups: int, group_topk: int):
    """Top-k among the experts of the `group_topk` best groups (a group's score is the sum
    of its best topk / group_topk experts)."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return scores.masked_fill(~keep, float("-inf")).topk(topk, dim=-1)


def _topk(scores, moe):
    if moe.moe_router_group_topk:
        return group_limited_topk(scores, moe.moe_router_topk, moe.moe_router_num_groups,
                                  moe.moe_router_group_topk)
    return scores.topk(moe.moe_router_topk, dim=1)


def topk_route(logits, moe, expert_bias=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], routing_map [T, E]) of softmax or sigmoid top-k routing.

    softmax: top-k of the logits then a softmax over the k (or, pre-softmax, top-k of the
    softmax over all experts); sigmoid: top-k of the sigmoids, renormalised over the k
    when k > 1. An expert bias shifts the scores used to select, not the weights."""
    k = moe.moe_router_topk
    if moe.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits) \
            if moe.moe_router_pre_softmax else logits
        weights, index = _select(scores, expert_bias, moe)
        if not moe.moe_router_pre_softmax:
            weights = torch.softmax(weights, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        weights, index = _select(scores, expert_bias, moe)
        if k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.moe_router_topk_scaling_factor:
        weights = weights * moe.moe_router_topk_scaling_factor
    probs = torch.zeros_like(logits).scatter(1, index, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return probs, routing_map


def _select(scores, expert_bias, moe):
    if expert_bias is None:
        return _topk(scores, moe)
    _, index = _topk(scores + expert_bias, moe)
    return scores.gather(1, index), index


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of exp(cost) to uniform row and column marginals."""
    cost = torch.exp(cost)
    rows = torch.ones(cost.shape[0], dtype=cost.dtype, device=cost.device)
    cols = torch.ones(cost.shape[1], dtype=cost.dtype, device=cost.device)
    error, previous = math.inf, cols
    while error > tol:
        rows = 1.0 / rows.numel() / ((cols * cost).sum(1) + 1e-8)
        cols = 1.0 / cols.numel() / ((rows.unsqueeze(1) * cost).sum(0) + 1e-8)
        error = (previous - cols).abs().mean()
        previous = cols
    return cols * cost * rows.unsqueeze(1)


def sinkhorn_route(logits, topk: int, training: bool):
    """Select by the Sinkhorn-balanced scores in training (by the activations otherwise);
    weights are sigmoid (k = 1) or softmax (k > 1) of the logits."""
    if topk == 1:
        act = torch.sigmoid(logits)
    else:
        act = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            index = sinkhorn(logits.float()).topk(topk, dim=1).indices
    else:
        index = act.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return act * routing_map, routing_map


def capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Tokens an expert takes: ceil(tokens x topk / experts x factor)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_over_capacity(probs, routing_map, topk: int, factor: float, policy: str, pad: bool):
    """Keep at most `capacity` tokens per expert: the highest-probability ones ("probs")
    or the first in token order ("position"). With `pad` every expert takes exactly
    `capacity` tokens (the extra ones with weight 0)."""
    tokens, experts = probs.shape
    cap = capacity(tokens, topk, experts, factor)
    if cap > tokens:
        keep = torch.ones_like(routing_map)
    else:
        if policy == "probs":
            index = probs.topk(cap, dim=0, sorted=False).indices
        else:
            index = _first_selected(routing_map, cap)
        keep = torch.zeros_like(routing_map).scatter(0, index, True)
    new_map = keep if pad else routing_map & keep
    return probs * new_map, new_map


def _first_selected(routing_map, cap: int):
    """Per expert (column), the rows of its first `cap` selected tokens (then unselected
    rows, which the caller's `routing_map & keep` discards)."""
    tokens = routing_map.shape[0]
    order = torch.arange(tokens, device=routing_map.device).unsqueeze(1)
    key = torch.where(routing_map, order, order + tokens)  # selected first, in token order
    return key.topk(cap, dim=0, largest=False).indices


# -- losses ----------------------------------------------------------------------------------
def aux_loss_scores(logits, topk: int, score_function: str):
    """(routing map, scores) the load-balancing loss uses: plain top-k of the softmax, or
    of the sigmoids normalised per token (no groups, bias or dropping)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    index = scores.topk(topk, dim=1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True), scores


def switch_aux_loss(scores, tokens_per_expert, num_tokens: int, topk: int, experts: int,
                    coeff: float):
    """Switch Transformer balancing loss E x sum_i f_i P_i x coeff, f_i the fraction of the
    top-k assignments on expert i and P_i its mean score."""
    return (scores.sum(dim=0) * tokens_per_expert).sum() * (
        experts * coeff / (topk * num_tokens * num_tokens))


def z_loss(logits, coeff: float):
    """ST-MoE router z-loss: mean of logsumexp(logits)^2, times coeff."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def updated_expert_bias(tokens_per_expert, expert_bias, rate: float):
    """Aux-loss-free balancing (arXiv 2408.15664), Megatron-Core's get_updated_expert_bias:
    each expert's bias moves by `rate` towards the mean load, up when it took fewer tokens
    than the mean, down when more, not at all on a tie. [..., E] -> [..., E]."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate


class TopKRouter(torch.nn.Module):
    """Gating linear (E x h, replicated) and the routing of one MoE layer."""

    def __init__(self, cfg, device, dtype):
        super().__init__()
        self.cfg, self.moe = cfg, cfg.moe
        experts = self.moe.num_experts
        self.weight = torch.nn.Parameter(torch.empty(experts, cfg.hidden_size, device=device,
                                                     dtype=dtype))
        set_parallel_attributes(self.weight, False, init_method=init_normal(cfg.init_method_std))
        self.bias = None
        if cfg.add_bias_linear:  # as Megatron-Core's router: initialised like the weight
            self.bias = torch.nn.Parameter(torch.empty(experts, device=device, dtype=dtype))
            set_parallel_attributes(self.bias, False, init_method=init_normal(cfg.init_method_std))
        if self.moe.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts, device=device))
            self.register_buffer("local_tokens_per_expert", torch.zeros(experts, device=device),
                                 persistent=False)
        else:
            self.expert_bias = None
            self.local_tokens_per_expert = None
        self.metrics = {}
        """Sums over this step's micro batches: load_balancing_loss, z_loss, tokens."""
        self.cp_group = None
        """The context-parallel group (set by enable_context_parallel)."""

    def _apply(self, fn, *args, **kwargs):
        """Module.to / .half keep the balancing buffers float32, as Megatron-Core's
        _maintain_float32_expert_bias does: 1e-3 steps of the bias and token counts above
        2048 are not exact in fp16 or bf16 (and counts over 65504 overflow fp16)."""
        super()._apply(fn, *args, **kwargs)
        for name in ("expert_bias", "local_tokens_per_expert"):
            buffer = getattr(self, name)
            if buffer is not None and buffer.dtype != torch.float32:
                setattr(self, name, buffer.float())
        return self

    def gating(self, x):
        dtype = _DTYPES.get(self.moe.moe_router_dtype, x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)

    def forward(self, x, seq_shape) -> Tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] (T = s x b tokens, sequence-major) -> (probs, routing_map) [T, E]."""
        logits = self.gating(x)
        training = self.training and torch.is_grad_enabled()
        if training and self.moe.moe_z_loss_coeff:
            loss = z_loss(logits, self.moe.moe_z_loss_coeff) / group_size(self.cp_group)
            logits = AuxLossScaler.apply(logits, loss)
            self._record("z_loss", loss.detach() / self.moe.moe_z_loss_coeff)
        probs, routing_map = self.route(logits)
        if training:
            probs = self._balance(logits, probs, seq_shape)
            self._record("tokens", routing_map.sum(dim=0).float())
            if self.expert_bias is not None:
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def route(self, logits):
        moe = self.moe
        if moe.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = sinkhorn_route(logits, moe.moe_router_topk, self.training)
        else:
            probs, routing_map = topk_route(logits, moe, self.expert_bias)
        if moe.moe_expert_capacity_factor is not None:
            probs, routing_map = drop_over_capacity(
                probs, routing_map, moe.moe_router_topk, moe.moe_expert_capacity_factor,
                moe.moe_token_drop_policy, moe.moe_pad_expert_input_to_capacity)
        return probs, routing_map

    def _balance(self, logits, probs, seq_shape):
        """Attach the (sequence-level) load-balancing loss to the probabilities."""
        moe, kind = self.moe, self.moe.moe_router_load_balancing_type
        coeff, k = moe.moe_aux_loss_coeff, moe.moe_router_topk
        if kind not in ("aux_loss", "seq_aux_loss") or not coeff:
            return probs
        routing_map, scores = aux_loss_scores(logits, k, moe.moe_router_score_function)
        cp = group_size(self.cp_group)
        if kind == "aux_loss":
            counts = all_reduce(routing_map.sum(dim=0).float(), self.cp_group)
            loss = switch_aux_loss(scores, counts, scores.shape[0] * cp, k, moe.num_experts,
                                   coeff)
        else:  # per sequence: columns are (sequence, expert) pairs, averaged over sequences
            seq, batch = seq_shape
            counts = all_reduce(routing_map.reshape(seq, -1).sum(0).float(), self.cp_group)
            loss = switch_aux_loss(scores.reshape(seq, -1), counts, seq * cp, k,
                                   moe.num_experts, coeff) / batch
        self._record("load_balancing_loss", loss.detach() / coeff)
        return AuxLossScaler.apply(probs, loss)

    def _record(self, name, value):
        self.metrics[name] = self.metrics.get(name, 0.0) + value.float()
