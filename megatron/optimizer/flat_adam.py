"""AdamW over flat fp32 buffers: one fused update per parameter group.

The main parameters, a copy of their gradients and Adam's two moments each live
in one contiguous buffer, group after group (the weight-decay group, then the
rest), and the parameters become views into theirs. The update is then one call
of torch's fused AdamW kernel per group, instead of a dozen element-wise passes
per tensor (each a parallel region on CPUs).

The wrapped `torch.optim.AdamW` stays what the rest of the framework sees: its
param groups carry the learning rate the scheduler sets, and its state holds
views of the flat moments, so `state_dict` keeps torch's format and checkpoints
load into either implementation (`adopt_state` after `load_state_dict`).
"""
from typing import List, Optional

import torch


def fused_adamw_available(params: List[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel runs on these parameters: fp32, one CPU or CUDA device."""
    if not params or not hasattr(torch, "_fused_adamw_"):
        return False
    device = params[0].device
    return device.type in ("cpu", "cuda") and all(
        p.dtype == torch.float32 and p.device == device for p in params)


class FlatAdamW:
    def __init__(self, optimizer: torch.optim.AdamW):
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        total = sum(p.numel() for p in self.params)
        device = self.params[0].device
        self.flat_params = torch.empty(total, dtype=torch.float32, device=device)
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.exp_avg = torch.zeros_like(self.flat_params)
        self.exp_avg_sq = torch.zeros_like(self.flat_params)
        self.steps = [torch.zeros((), dtype=torch.float32, device=device)
                      for _ in optimizer.param_groups]
        self.group_spans, offset = [], 0
        for group in optimizer.param_groups:
            size = sum(p.numel() for p in group["params"])
            self.group_spans.append((offset, offset + size))
            offset += size
        with torch.no_grad():
            for p, view in zip(self.params, self._views(self.flat_params)):
                view.copy_(p)
                p.data = view
        self.grad_views = dict(zip(map(id, self.params), self._views(self.flat_grads)))
        self._attach_state()

    def _views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def _attach_state(self) -> None:
        """torch's per-parameter state as views of the flat moments (shared step per group)."""
        exp_avg, exp_avg_sq = self._views(self.exp_avg), self._views(self.exp_avg_sq)
        index = 0
        for step, group in zip(self.steps, self.optimizer.param_groups):
            for p in group["params"]:
                self.optimizer.state[p] = {"step": step, "exp_avg": exp_avg[index],
                                           "exp_avg_sq": exp_avg_sq[index]}
                index += 1

    def state_dict(self) -> dict:
        """torch's AdamW state dict, each parameter with a step tensor of its own (one
        tensor shared by a group would be advanced once per parameter by torch's AdamW)."""
        state = self.optimizer.state_dict()
        state["state"] = {key: dict(value, step=value["step"].clone())
                          for key, value in state["state"].items()}
        return state

    @torch.no_grad()
    def adopt_state(self) -> None:
        """Copy the state that `optimizer.load_state_dict` installed into the flat buffers."""
        for step, group in zip(self.steps, self.optimizer.param_groups):
            first = self.optimizer.state.get(group["params"][0], {})
            if "step" in first:
                step.copy_(torch.as_tensor(first["step"], dtype=torch.float32))
        for p, m, v in zip(self.params, self._views(self.exp_avg), self._views(self.exp_avg_sq)):
            state = self.optimizer.state.get(p, {})
            if "exp_avg" in state:
                m.copy_(state["exp_avg"])
                v.copy_(state["exp_avg_sq"])
        self._attach_state()

    @torch.no_grad()
    def gather_grads(self, params: List[torch.Tensor], grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Copy `grads` (of `params`, in any order) into the flat gradient buffer in
        one pass; returns views of it in the same order. A missing gradient counts as
        zeros (unlike torch's AdamW, which leaves such a parameter alone)."""
        by_id = dict(zip(map(id, params), grads))
        pieces = [by_id[id(p)] if by_id[id(p)] is not None else torch.zeros_like(p) for p in self.params]
        torch.cat([g.reshape(-1) for g in pieces], out=self.flat_grads)
        return [self.grad_views[id(p)] for p in params]

    @torch.no_grad()
    def step(self, clip_coefficient: Optional[float] = None) -> None:
        """One AdamW update of every group from the flat gradients, multiplied by
        `clip_coefficient` inside the kernel (as its `grad_scale` divisor) when given."""
        grad_scale = None
        if clip_coefficient is not None:
            grad_scale = torch.tensor(1.0 / clip_coefficient, dtype=torch.float32,
                                      device=self.flat_grads.device)
        for (start, end), step, group in zip(self.group_spans, self.steps,
                                             self.optimizer.param_groups):
            step.add_(1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_([self.flat_params[start:end]], [self.flat_grads[start:end]],
                                [self.exp_avg[start:end]], [self.exp_avg_sq[start:end]], [],
                                [step], lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"],
                                amsgrad=False, maximize=False, grad_scale=grad_scale)
