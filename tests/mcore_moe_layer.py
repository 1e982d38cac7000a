"""Reference script (run by tests/mcore_reference.py, not by pytest): Megatron-Core's
MoELayer on CPU given a config, full weights and each rank's tokens; saves its output,
router probabilities and map, and the load-balancing loss and z-loss it recorded."""
import torch

import mcore_reference


def main():
    inputs = mcore_reference.load_inputs()
    ep = inputs["ep"]
    mcore_reference.init(ep, expert_model_parallel_size=ep)
    mcore_reference.save_outputs({"cases": [run_case(case, ep) for case in inputs["cases"]]})


def run_case(inputs, ep):
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)
    from megatron.core.transformer.transformer_config import TransformerConfig
    clear_aux_losses_tracker()
    rank = dist.get_rank()
    config = TransformerConfig(**inputs["config"], activation_func=F.silu, gated_linear_unit=True,
                               add_bias_linear=False, use_cpu_initialization=True,
                               expert_model_parallel_size=ep, hidden_dropout=0.0,
                               attention_dropout=0.0, bf16=False, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = MoELayer(config, spec.submodules.mlp.submodules, layer_number=1)
    layer.set_layer_number(1)
    local = config.num_moe_experts // ep
    state = {}
    for name in layer.state_dict():
        if name.endswith("_extra_state"):
            continue
        parts = name.split(".")
        if parts[:2] == ["experts", "local_experts"]:
            parts[2] = str(rank * local + int(parts[2]))
        state[name] = inputs["weights"][".".join(parts)]
    layer.load_state_dict(state, strict=False)
    seen = {}
    layer.router.register_forward_hook(lambda m, i, o: seen.update(probs=o[0], map=o[1]))
    layer.train()
    output, _ = layer(inputs["x"][rank])
    tracker = get_moe_layer_wise_logging_tracker()
    losses = {name: float(v["values"][0]) for name, v in tracker.items()}
    return {"output": output.detach(), "probs": seen["probs"].detach(), "map": seen["map"],
            **losses}


if __name__ == "__main__":
    main()
