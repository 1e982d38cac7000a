"""The optimizer of --use-torch-fsdp2: MegatronOptimizer over FSDP's sharded parameters.

The parameters are fp32 DTensors, each rank holding its dim-0 shard (over DP) of every
one, so the main parameters are the model parameters themselves and Adam's moments exist
once across DP. The torch optimizer steps the shards (DTensor arithmetic is local for
element-wise updates); the gradient norm (clipping, the nan / inf skip) is taken over the
local gradient shards, summed once over the DP x CP group (the experts' over expert-DP) and then over TP x PP, each element
counted once (megatron.distributed.fsdp.local_shards gives where each shard begins, for
the k / v replicas that TP above the query groups leaves).
"""
from typing import Tuple

import torch

from megatron.distributed.fsdp import local_shards, shard_groups
from megatron.mpu.fsdp_shards import local
from megatron.distributed.grads import expert_norm_groups, norm_and_nonfinite
from megatron.optimizer.optimizer import MegatronOptimizer


class FSDPOptimizer(MegatronOptimizer):
    flat_allowed = False  # FSDP owns the parameters' storage: no flat buffer views

    def __init__(self, cfg, models, pstate, grad_scaler=None, fp32_main_params: bool = False):
        """`fp32_main_params`: the model computes in bf16 (FSDP's MixedPrecisionPolicy), so
        its fp32 shards are the main parameters a checkpoint saves as `fp32_param` too, as
        a bf16 run without FSDP does (megatron.checkpointing.dist_state.saves_fp32)."""
        super().__init__(cfg, models, pstate, grad_scaler)
        self.fp32_main_params = fp32_main_params

    def _norm_and_nonfinite(self, grads) -> Tuple[float, bool]:
        params, shards, starts = local_shards(self.model_params, grads)
        return norm_and_nonfinite(params, shards, self.pstate.tp_group, self.pstate.mp_group,
                                  starts=starts, **shard_groups(self.pstate),
                                  **expert_norm_groups(self.pstate))

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
