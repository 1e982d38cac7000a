"""The optimizer of --use-torch-fsdp2: MegatronOptimizer over FSDP's sharded parameters.

The parameters are fp32 DTensors, each rank holding its dim-0 shard (over DP) of every
one, so the main parameters are the model parameters themselves and Adam's moments exist
once across DP. The torch optimizer steps the shards (DTensor arithmetic is local for
element-wise updates); the gradient norm (clipping, the nan / inf skip) is taken over the
local gradient shards, summed once over the DP group and then over TP x PP, each element
counted once (megatron.distributed.fsdp.local_shards gives where each shard begins, for
the k / v replicas that TP above the query groups leaves).
"""
from typing import Tuple

from megatron.distributed.fsdp import local_shards
from megatron.distributed.grads import expert_norm_groups, norm_and_nonfinite
from megatron.optimizer.optimizer import MegatronOptimizer


class FSDPOptimizer(MegatronOptimizer):
    flat_allowed = False  # FSDP owns the parameters' storage: no flat buffer views

    def _norm_and_nonfinite(self, grads) -> Tuple[float, bool]:
        params, shards, starts = local_shards(self.model_params, grads)
        return norm_and_nonfinite(params, shards, self.pstate.tp_group, self.pstate.mp_group,
                                  dp_group=self.pstate.dp_group, starts=starts,
                                  **expert_norm_groups(self.pstate))

    def _release_grads(self) -> None:
        """FSDP's own sharded gradients stay to the next step's zero_grad (FSDPReducer), for
        --log-num-zeros-in-grad and the nan guard to read."""
