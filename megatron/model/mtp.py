"""Multi-token prediction (DeepSeek-V3's MTP, as Megatron-Core 0.16.1's MultiTokenPredictionBlock).

Depth k (1..D) predicts the token k + 1 places ahead. Its layer takes the previous depth's
output h (the decoder's, after its final norm, for k = 1) and the embedding e of the tokens
shifted k places left, and computes

    final_layernorm(transformer_layer(eh_proj([enorm(e); hnorm(h)])))

which the main model's output head (shared, as is the embedding) turns into the loss
against the labels shifted k places left; shifted-in places get label 0 and loss mask 0.

The loss of depth k is its masked token mean; the training loss gains
mtp_loss_scaling_factor / D times each, through the MoE auxiliary losses' AuxLossScaler
(as Megatron-Core's MTPLossAutoScaler: the gradient of the depth's loss is the main loss's
scale, the loss scale / micro batches, which the trainer sets for both). Under context
parallelism each rank holds two chunks of every sequence: the shift crosses ranks, and the mean is over the whole
sequences' tokens, as our main loss is (so CP reproduces one process; Megatron-Core divides
by each rank's own count). The depths' losses are kept per micro batch for the log line
(`collect_mtp_metrics`, the ` mtp_1 loss: ... |` fields).

Parameter names are Megatron-Core's (`mtp.layers.N.{enorm,hnorm,eh_proj,final_layernorm}`,
`mtp.layers.N.transformer_layer.*` in our layer names); the transformer layer is of the
last decoder layer's kind (dense or MoE) and has the global number --num-layers + k.
"""
from typing import Dict, List

import torch

from megatron.config import ModelConfig
from megatron.model.context_parallel import cp_token_index
from megatron.model.moe.router import AuxLossScaler
from megatron.model.spec import make_norm
from megatron.model.transformer import ParallelTransformerLayer
from megatron.mpu.layers import ColumnParallelLinear, init_normal
from megatron.mpu.mappings import (all_reduce, gather_from_tensor_model_parallel_region,
                                   group_rank, group_size, scatter_to_sequence_parallel_region)


def shift_left(t: torch.Tensor, cp_group=None) -> torch.Tensor:
    """[b, s] -> the sequence shifted one place left, 0 at its end (Megatron-Core's
    roll_tensor). Under CP `t` is this rank's two chunks of each sequence
    (megatron.model.context_parallel): the whole sequences are gathered, shifted and split
    again (token ids, positions and masks only: no gradient)."""
    cp = group_size(cp_group)
    if cp == 1:
        return torch.cat((t[:, 1:], torch.zeros_like(t[:, :1])), dim=1)
    parts = [torch.empty_like(t) for _ in range(cp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=cp_group)
    seq = t.shape[1] * cp
    whole = torch.empty((t.shape[0], seq), dtype=t.dtype, device=t.device)
    for rank, part in enumerate(parts):
        whole[:, cp_token_index(seq, rank, cp).to(t.device)] = part
    shifted = shift_left(whole)
    return shifted[:, cp_token_index(seq, group_rank(cp_group), cp).to(t.device)]


class MTPLayer(torch.nn.Module):
    """One depth: enorm / hnorm, eh_proj (column parallel, [2h] -> [h], gathered), one
    transformer layer, final_layernorm."""

    def __init__(self, cfg: ModelConfig, layer_number: int, tp_group, device, dtype,
                 expert_groups=None):
        super().__init__()
        self.cfg, self.tp_group = cfg, tp_group
        self.enorm = make_norm(cfg, device, dtype)
        self.hnorm = make_norm(cfg, device, dtype)
        self.eh_proj = ColumnParallelLinear(
            2 * cfg.hidden_size, cfg.hidden_size, tp_group=tp_group, bias=False,
            init_method=init_normal(cfg.init_method_std),
            sequence_parallel=cfg.sequence_parallel, device=device, dtype=dtype)
        self.transformer_layer = ParallelTransformerLayer(cfg, layer_number, tp_group, device,
                                                          dtype, expert_groups)
        self.final_layernorm = make_norm(cfg, device, dtype)

    def forward(self, hidden, embedded, mask=None):
        """hidden, embedded: [s(/TP with SP), b, h] -> the depth's output, alike."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        x = gather_from_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
        if self.cfg.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.final_layernorm(self.transformer_layer(x, mask))


class MTPBlock(torch.nn.Module):
    """The D MTP layers of the last pipeline stage, and their loss."""

    follows_context_parallel = True  # enable_context_parallel sets cp_group

    def __init__(self, cfg: ModelConfig, tp_group, device, dtype, expert_groups=None):
        super().__init__()
        self.cfg = cfg
        self.cp_group = None
        self.layers = torch.nn.ModuleList(
            MTPLayer(cfg, cfg.num_layers + k + 1, tp_group, device, dtype, expert_groups)
            for k in range(cfg.mtp_depths))
        self.losses: List[torch.Tensor] = []  # per micro batch: [D] detached depth losses

    def forward(self, hidden, input_ids, position_ids, labels, loss_mask, embed, head, mask=None):
        """`hidden`: the decoder's output; `embed(ids, positions)` the model's embedding,
        `head(hidden, labels)` its per-token losses [b, s]. Returns `hidden` carrying the
        depths' scaled losses for the backward."""
        loss_mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None \
            else loss_mask.float()
        state, found = hidden, []
        weight = self.cfg.mtp_loss_scaling_factor / self.cfg.mtp_depths
        for layer in self.layers:
            input_ids, position_ids = (shift_left(input_ids, self.cp_group),
                                       shift_left(position_ids, self.cp_group))
            labels = shift_left(labels, self.cp_group)
            loss_mask = shift_left(loss_mask, self.cp_group)
            state = layer(state, embed(input_ids, position_ids), mask)
            count = all_reduce(loss_mask.sum(), self.cp_group)  # the whole sequences' tokens
            loss = (head(state, labels).float() * loss_mask).sum() / count
            found.append(loss.detach())
            hidden = AuxLossScaler.apply(hidden, weight * loss)
        if self.training:
            self.losses.append(torch.stack(found))
        return hidden


def collect_mtp_metrics(models, pstate, num_micro_batches: int) -> Dict[str, float]:
    """This step's `mtp_k loss` fields, the same on every rank (call on all ranks): each
    depth's loss averaged over micro batches and DP (summed over the CP ranks' parts), as
    Megatron-LM logs them. Clears the kept losses."""
    depths = models[0].cfg.mtp_depths
    if not depths:
        return {}
    values = torch.zeros(depths)
    for model in models:
        block = getattr(model, "mtp", None)
        if block is not None:
            for found in block.losses:
                values += found.cpu().float()
            block.losses = []
    for group in (pstate.pp_group, pstate.dp_cp_group):
        all_reduce(values, group)
    values /= num_micro_batches * max(1, pstate.dp_size)
    return {f"mtp_{k + 1} loss": float(values[k]) for k in range(depths)}
