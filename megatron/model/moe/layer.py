"""The MoE MLP of a transformer layer: router -> dispatch over EP -> experts -> combine,
plus the optional shared expert; and the per-step MoE metrics of a model.

TP: every TP rank routes the same tokens (a sequence-parallel input is gathered first
and the output split again); each expert is split over expert TP (ETP) and its output
all-reduced over ETP before the tokens are combined, so router, losses and combine see
full values. With ETP < TP the TP group holds TP / ETP blocks of ETP ranks: the routed
tokens are cut into TP / ETP equal parts (zero rows that route nowhere pad them), block b
dispatches part b over EP (its EP group then meets each token once, as Megatron-Core's
expert-tensor-and-expert-parallel group does), and the parts are gathered back over the
token group; the cut's backward gathers the parts' gradients, the gather's splits them.
"""
from typing import Dict, List

import torch

from megatron.model.moe.dispatcher import DISPATCHERS
from megatron.model.moe.experts import Experts, SharedExpert
from megatron.model.moe.router import TopKRouter, updated_expert_bias
from megatron.mpu.mappings import (all_reduce, gather_from_sequence_parallel_region, group_rank,
                                   group_size, scatter_to_sequence_parallel_region)


class MoELayer(torch.nn.Module):
    """Drop-in for ParallelMLP: forward(hidden [s, b, h]) -> (output, None)."""

    def __init__(self, cfg, layer_number: int, groups, device, dtype):
        super().__init__()
        self.cfg, self.groups, self.layer_number = cfg, groups, layer_number
        self.tp_group = groups.tp_group
        self.router = TopKRouter(cfg, device, dtype)
        self.experts = Experts(cfg, groups, device, dtype)
        self.shared_experts = None
        if cfg.moe.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(cfg, groups.tp_group, device, dtype)
        self.dispatch = DISPATCHERS[cfg.moe.moe_token_dispatcher_type]

    def forward(self, hidden):
        sp = self.cfg.sequence_parallel and group_size(self.tp_group) > 1
        if sp:  # every TP rank routes all tokens; the gradient back is a plain split
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group, False)
        s, b, h = hidden.shape
        x = hidden.reshape(s * b, h)
        probs, routing_map = self.router(x, (s, b))
        out = self._dispatch(x, probs, routing_map)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        out = out.view(s, b, h)
        if sp:
            out = scatter_to_sequence_parallel_region(out, self.tp_group)
        return out, None

    def _dispatch(self, x, probs, routing_map):
        group = self.groups.token_group
        parts = group_size(group)
        if parts == 1:
            return self.dispatch(x, probs, routing_map, self.experts, self.groups)
        tokens = x.shape[0]
        pad = -tokens % parts
        if pad:
            x, probs, routing_map = (torch.cat([t, t.new_zeros((pad, t.shape[1]))])
                                     for t in (x, probs, routing_map))
        mine = routing_map.chunk(parts)[group_rank(group)]
        out = self.dispatch(scatter_to_sequence_parallel_region(x, group),
                            scatter_to_sequence_parallel_region(probs, group), mine,
                            self.experts, self.groups)
        return gather_from_sequence_parallel_region(out, group, False)[:tokens]


def moe_layers(models) -> List[MoELayer]:
    return [m for model in models for m in model.modules() if isinstance(m, MoELayer)]


def collect_moe_metrics(models, pstate, num_micro_batches: int) -> Dict[str, float]:
    """This step's MoE log fields, the same on every rank (call on all ranks):
    load_balancing_loss and z_loss (without coefficients, averaged over micro batches,
    DP and MoE layers, as Megatron-LM logs them) and the tokens-per-expert imbalance
    (max / mean over experts, of the most imbalanced MoE layer). Clears the sums."""
    cfg = models[0].cfg
    if cfg.moe is None or not cfg.moe.enabled:
        return {}
    rows = cfg.num_layers + cfg.mtp_depths  # MTP layers count as Megatron-Core counts them
    pattern = [cfg.is_moe_layer(n) for n in range(1, rows + 1)]
    names = ("load_balancing_loss", "z_loss")
    values = torch.zeros(len(names), rows)
    tokens = torch.zeros(rows, cfg.moe.num_experts)
    for layer in moe_layers(models):
        metrics, i = layer.router.metrics, layer.layer_number - 1
        for k, name in enumerate(names):
            if name in metrics:
                values[k, i] = metrics[name].cpu() / num_micro_batches
        if "tokens" in metrics:
            tokens[i] = metrics["tokens"].cpu()
        layer.router.metrics = {}
    for group in (pstate.pp_group, pstate.dp_cp_group):  # CP ranks: parts of the sequences
        all_reduce(values, group)
        all_reduce(tokens, group)
    values /= max(1, pstate.dp_size)
    moe_rows = [i for i, is_moe in enumerate(pattern) if is_moe]
    out = {}
    present = _loss_names(cfg.moe)
    for k, name in enumerate(names):
        if name in present:
            out[name] = float(values[k, moe_rows].mean())
    counts = tokens[moe_rows]
    if counts.sum() > 0:
        out["tokens-per-expert max/mean"] = float((counts.max(1).values / counts.mean(1)).max())
    return out


def _loss_names(moe) -> set:
    names = set()
    if moe.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") and moe.moe_aux_loss_coeff:
        names.add("load_balancing_loss")
    if moe.moe_z_loss_coeff:
        names.add("z_loss")
    return names


@torch.no_grad()
def update_expert_bias(models, pstate) -> None:
    """Aux-loss-free balancing after every step, applied or skipped (Megatron-Core's
    _update_router_expert_bias in finalize_model_grads): this step's tokens per expert of
    every MoE layer of this rank, summed over DP and CP in one all-reduce (the TP ranks
    route the same tokens, so Megatron-Core's sum over TP too scales every count alike),
    move each bias (updated_expert_bias) and are reset for the next step."""
    routers = [layer.router for layer in moe_layers(models)
               if layer.router.expert_bias is not None]
    if not routers:
        return
    counts = all_reduce(torch.stack([r.local_tokens_per_expert for r in routers]),
                        pstate.dp_cp_group)
    rate = routers[0].moe.moe_router_bias_update_rate
    for router, tokens in zip(routers, counts):
        router.expert_bias.copy_(updated_expert_bias(tokens, router.expert_bias, rate))
        router.local_tokens_per_expert.zero_()
