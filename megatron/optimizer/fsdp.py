"""The optimizer of --use-torch-fsdp2: MegatronOptimizer over FSDP's sharded parameters.

The parameters are fp32 DTensors, each rank holding its dim-0 shard (over DP) of every
one, so the main parameters are the model parameters themselves and Adam's moments exist
once across DP. Adam steps the local shards with the fused kernel the optimizer without
FSDP uses, the clipping factor inside it as there, so that both give the same bits (torch's
own AdamW on CPUs computes the moments another way, and one ulp of difference in a main
parameter flips bf16 roundings of the model that grow over the iterations); other
optimizers step the DTensors themselves. The gradient norm (clipping, the nan / inf skip) is taken over the
local gradient shards, summed once over the DP x CP group (the experts' over expert-DP) and then over TP x PP, each element
counted once (megatron.distributed.fsdp.local_shards gives where each shard begins, for
the k / v replicas that TP above the query groups leaves).
"""
from typing import Optional, Tuple

import torch

from megatron.distributed.fsdp import local_shards, shard_groups
from megatron.mpu.fsdp_shards import local
from megatron.distributed.grads import expert_norm_groups, norm_and_nonfinite
from megatron.optimizer.flat_adam import clip_grad_scale, fused_adamw, fused_adamw_available
from megatron.optimizer.optimizer import MegatronOptimizer


class FSDPOptimizer(MegatronOptimizer):
    flat_allowed = False  # FSDP owns the parameters' storage: no flat buffer views

    def __init__(self, cfg, models, pstate, grad_scaler=None, fp32_main_params: bool = False):
        """`fp32_main_params`: the model computes in bf16 (FSDP's MixedPrecisionPolicy), so
        its fp32 shards are the main parameters a checkpoint saves as `fp32_param` too, as
        a bf16 run without FSDP does (megatron.checkpointing.dist_state.saves_fp32)."""
        super().__init__(cfg, models, pstate, grad_scaler)
        self.fp32_main_params = fp32_main_params
        self.fused_adam = cfg.optimizer == "adam" and fused_adamw_available(
            [local(p) for p in self.model_params])
        """Adam steps the local shards with torch's fused kernel (fp32 shards on one device)."""

    def _norm_and_nonfinite(self, grads) -> Tuple[float, bool]:
        params, shards, starts = local_shards(self.model_params, grads)
        return norm_and_nonfinite(params, shards, self.pstate.tp_group, self.pstate.mp_group,
                                  starts=starts, **shard_groups(self.pstate),
                                  **expert_norm_groups(self.pstate))

    def _update(self, grads, coeff: Optional[float]) -> None:
        if not self.fused_adam:
            super()._update(grads, coeff)
            return
        grad_scale = clip_grad_scale(coeff, local(self.model_params[0]).device)
        grad_of = dict(zip(map(id, self.model_params), grads))
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if grad_of.get(id(p)) is not None]
            if not params:
                continue
            states = [self._adam_state(p) for p in params]
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1)
            fused_adamw([local(p) for p in params], [local(grad_of[id(p)]) for p in params],
                        [local(state["exp_avg"]) for state in states],
                        [local(state["exp_avg_sq"]) for state in states], steps, group,
                        grad_scale)

    def _adam_state(self, param) -> dict:
        """torch AdamW's state of `param` (made as torch makes it at its first step), which
        checkpoints save and load as they do torch's."""
        state = self.optimizer.state[param]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def _release_grads(self) -> None:
        """FSDP's own sharded gradients stay to the next step's zero_grad (FSDPReducer), for
        --log-num-zeros-in-grad and the nan guard to read."""

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """As MegatronOptimizer's; saved fp32 main parameters (this rank's shards) replace
        the parameters themselves, which are the main parameters here."""
        super().load_state_dict(state)
        for param, saved in zip(self.model_params, state.get("fp32_from_fp16_params", ())):
            local(param).copy_(saved)
