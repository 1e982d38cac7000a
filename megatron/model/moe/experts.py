"""The experts of one MoE layer held by this rank, and the shared expert.

`Experts` holds this EP rank's E / EP experts as stacked weights, each split over expert
TP (ETP, by default TP) like a dense MLP: linear_fc1.weight [E_local, gates x ffn / ETP, h]
(gated: this rank's [gate_r; up_r] rows), linear_fc2.weight [E_local, h, ffn / ETP]. Its
input is tokens sorted by local expert and the count per expert; `--moe-grouped-gemm` runs each
projection of all experts as one grouped matmul (`GroupedLinear`: no padding, weight
gradients added straight into the data-parallel gradient buffer), otherwise a loop of
autograd linears over experts (the reference).

Initialisation draws all E experts from the parameter's seed and keeps the local
ones, so any EP layout starts from the single-process model.
"""
import torch
import torch.nn.functional as F

from megatron.model.spec import mlp_activation
from megatron.mpu.layers import (ColumnParallelLinear, RowParallelLinear, divide, init_normal,
                                 main_grad_of, scaled_init_normal, set_parallel_attributes)
from megatron.mpu.mappings import (copy_to_tensor_model_parallel_region, group_size,
                                   reduce_from_tensor_model_parallel_region)


def expert_init(init, num_experts: int, ep_rank: int):
    """init_method of a stacked expert tensor: draw all experts, keep this rank's."""
    def init_(tensor, generator=None):
        local = tensor.shape[0]
        full = torch.empty((num_experts,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                           device=tensor.device)
        init(full, generator)
        return tensor.copy_(full[ep_rank * local:(ep_rank + 1) * local])
    return init_


def _zeros(tensor, generator=None):
    return tensor.zero_()


def _expert_param(shape, device, dtype, dim, groups, num_experts, init, tp_group):
    param = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    set_parallel_attributes(param, dim is not None, dim if dim is not None else -1, groups, init)
    param.sharding = {"dim": dim, "groups": groups, "expert_dim": 0, "num_experts": num_experts}
    param.expert_parallel = True
    param.tensor_parallel_group = tp_group  # split over expert TP (init_parameters)
    return param


class _Linear(torch.nn.Module):
    """A stacked expert projection (named as Megatron-Core's linear_fc1 / linear_fc2)."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = weight
        self.bias = bias


class Experts(torch.nn.Module):
    def __init__(self, cfg, groups, device, dtype):
        super().__init__()
        moe = cfg.moe
        self.cfg, self.tp_group = cfg, groups.expert_tp_group  # ETP, which may be < TP
        self.grouped = moe.moe_grouped_gemm
        tp = group_size(self.tp_group)
        self.num_local = divide(moe.num_experts, groups.ep_size)
        ffn = divide(moe.moe_ffn_hidden_size or cfg.ffn_hidden_size, tp)
        gates = 2 if cfg.gated_mlp else 1
        e, h, rank = moe.num_experts, cfg.hidden_size, groups.ep_rank
        fc1_init = expert_init(init_normal(cfg.init_method_std), e, rank)
        fc2_init = expert_init(scaled_init_normal(cfg.init_method_std, cfg.num_layers), e, rank)
        common = dict(device=device, dtype=dtype, num_experts=e, tp_group=self.tp_group)
        bias1 = bias2 = None
        if cfg.add_bias_linear:
            bias1 = _expert_param((self.num_local, gates * ffn), dim=1, groups=gates,
                                  init=_zeros, **common)
            bias2 = _expert_param((self.num_local, h), dim=None, groups=1, init=_zeros, **common)
        self.linear_fc1 = _Linear(_expert_param((self.num_local, gates * ffn, h), dim=1,
                                                groups=gates, init=fc1_init, **common), bias1)
        self.linear_fc2 = _Linear(_expert_param((self.num_local, h, ffn), dim=2, groups=1,
                                                init=fc2_init, **common), bias2)
        self.activation = mlp_activation(cfg)

    def forward(self, tokens, counts):
        """tokens [N, h] sorted by local expert, counts [E_local] (a list of ints) -> [N, h]."""
        x = copy_to_tensor_model_parallel_region(tokens, self.tp_group)
        y = self._batched(x, counts) if self.grouped else self._loop(x, counts)
        y = reduce_from_tensor_model_parallel_region(y, self.tp_group)
        if self.linear_fc2.bias is not None:
            y = y + torch.repeat_interleave(self.linear_fc2.bias, torch.tensor(counts), dim=0)
        return y

    def _act(self, h, bias):
        return self.activation(h if bias is None else h + bias, None)

    def _loop(self, x, counts):
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        b1 = self.linear_fc1.bias
        outs = []
        for e, chunk in enumerate(torch.split(x, counts)):
            h = self._act(F.linear(chunk, w1[e]), None if b1 is None else b1[e])
            outs.append(F.linear(h, w2[e]))
        return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[1]))

    def _batched(self, x, counts):
        b1 = self.linear_fc1.bias
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if b1 is None and self.cfg.activation == "swiglu" and swiglu_kernel(x, w1, w2):
            return SwiGLUExperts.apply(x, w1, w2, counts)
        h = GroupedLinear.apply(x, w1, counts)
        if b1 is not None:
            b1 = torch.repeat_interleave(b1, torch.tensor(counts), dim=0)
        return GroupedLinear.apply(self._act(h, b1), w2, counts)


class GroupedLinear(torch.autograd.Function):
    """rows [N, in] sorted by expert, weight [E, out, in], counts [E] (ints) -> [N, out]:
    block e of the rows times weight[e]^T, each block one matmul written in place.

    The weight gradient goes straight into the weight's data-parallel gradient buffer
    (`main_grad`, when it has the weight's dtype), block by block, so no [E, out, in]
    gradient is made and then added there; otherwise it is returned as usual."""

    @staticmethod
    def forward(ctx, rows, weight, counts):
        out = rows.new_empty((rows.shape[0], weight.shape[1]))
        for w, x, y in zip(weight, rows.split(counts), out.split(counts)):
            torch.mm(x, w.t(), out=y)
        ctx.save_for_backward(rows, weight)
        ctx.counts, ctx.main_grad = counts, main_grad_of(weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows = grad_weight = None
        blocks = list(zip(weight, grad.split(ctx.counts), rows.split(ctx.counts)))
        if ctx.needs_input_grad[0]:
            grad_rows = grad.new_empty(rows.shape)
            for (w, g, _), out in zip(blocks, grad_rows.split(ctx.counts)):
                torch.mm(g, w, out=out)
        if ctx.needs_input_grad[1]:
            target = ctx.main_grad
            if target is None:
                target = grad_weight = torch.zeros_like(weight)
            for t, (_, g, x) in zip(target, blocks):
                if x.shape[0]:
                    t.addmm_(g.t(), x)
        return grad_rows, grad_weight, None


def swiglu_kernel(*tensors):
    """The CPU kernel of the SwiGLU experts (csrc/fused/moe_cpu.cpp) when it runs on these
    tensors (float32 on the CPU, the fused library built), else None."""
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return None
    from megatron.fused import kernels
    module = kernels.get_extension("cpu")
    return module if module is not None and hasattr(module, "swiglu_experts_forward") else None


class SwiGLUExperts(torch.autograd.Function):
    """rows [N, h] sorted by expert, w1 [E, 2F, h] ([gate; up]), w2 [E, h, F], counts ->
    sum over the block of expert e of (silu(gate) * up) w2[e]^T, [gate | up] = rows w1[e]^T.

    What GroupedLinear, the activation and GroupedLinear again compute, in one kernel that
    runs each expert's chain on one thread while the other threads run other experts (see
    csrc/fused/moe_cpu.cpp); weight gradients go into the gradient buffers as there."""

    @staticmethod
    def forward(ctx, rows, w1, w2, counts):
        rows = rows.contiguous()
        y, pre = swiglu_kernel(rows).swiglu_experts_forward(rows, w1, w2, counts)
        ctx.save_for_backward(rows, pre, w1, w2)
        ctx.counts, ctx.main_grads = counts, (main_grad_of(w1), main_grad_of(w2))
        return y

    @staticmethod
    def backward(ctx, grad):
        rows, pre, w1, w2 = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        into = ctx.main_grads if all(g is not None for g in ctx.main_grads) else (None, None)
        dx, dw1, dw2 = swiglu_kernel(rows).swiglu_experts_backward(
            grad.contiguous(), rows, pre, w1, w2, ctx.counts, ctx.needs_input_grad[0], need_dw,
            *into)
        return dx, dw1, dw2, None


class SharedExpert(torch.nn.Module):
    """An always-on MLP of width --moe-shared-expert-intermediate-size beside the routed
    experts (TP-split like the dense MLP); with --moe-shared-expert-gate its output is
    scaled by sigmoid(x . gate_weight) per token (Qwen-MoE)."""

    def __init__(self, cfg, tp_group, device, dtype):
        super().__init__()
        size = cfg.moe.moe_shared_expert_intermediate_size
        gates = 2 if cfg.gated_mlp else 1
        common = dict(tp_group=tp_group, bias=cfg.add_bias_linear, device=device, dtype=dtype)
        self.linear_fc1 = ColumnParallelLinear(
            cfg.hidden_size, gates * size, stride=gates, skip_bias_add=True,
            init_method=init_normal(cfg.init_method_std), **common)
        self.linear_fc2 = RowParallelLinear(
            size, cfg.hidden_size, input_is_parallel=True,
            init_method=scaled_init_normal(cfg.init_method_std, cfg.num_layers), **common)
        self.activation = mlp_activation(cfg)
        self.gate_weight = None
        if cfg.moe.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(torch.empty(1, cfg.hidden_size, device=device,
                                                              dtype=dtype))
            set_parallel_attributes(self.gate_weight, False,
                                    init_method=init_normal(cfg.init_method_std))

    def forward(self, x):
        h, bias = self.linear_fc1(x)
        y = self.linear_fc2(self.activation(h, bias))
        if self.gate_weight is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate_weight))
        return y
