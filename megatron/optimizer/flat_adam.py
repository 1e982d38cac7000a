"""AdamW over flat fp32 buffers: one fused update per parameter group.

The main parameters and Adam's two moments each live in one contiguous buffer, and
the parameters become views into theirs. The update is then one call of torch's
fused AdamW kernel per group (over a few long runs of parameters), instead of a
dozen element-wise passes per tensor (each a parallel region on CPUs).

The gradients are read where the data-parallel reducer accumulated them: the
parameters are laid out in the order of its gradient buffers, so each run of
parameters of one group is one slice of the flat parameters and one slice of a
gradient buffer (copying the gradients into a flat buffer of our own cost 4.5 ms of
a 155 ms MoE step, benchmarks/bench_moe.py). Without such buffers (--DDP-impl torch,
a bare optimizer) the gradients are copied into one, group after group.

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
    def __init__(self, optimizer: torch.optim.AdamW, grads: Optional[List] = None):
        """`grads`: where each parameter's gradient arrives (in param-group order), e.g. the
        data-parallel reducer's `main_grad` views. When they are contiguous float32 views of
        buffers, the parameters are laid out in the buffers' order and the update reads
        the gradients where they are (`reads_in_place`); otherwise `gather_grads` copies
        them into a flat gradient buffer of its own first."""
        self.optimizer = optimizer
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        group_of = [i for i, group in enumerate(optimizer.param_groups) for _ in group["params"]]
        device = self.params[0].device
        self.grads = list(grads) if grads is not None and _buffer_views(grads, device) else None
        order = list(range(len(self.params)))
        if self.grads is not None:  # buffer by buffer, in the buffers' order
            order.sort(key=lambda i: (self.grads[i].untyped_storage().data_ptr(),
                                      self.grads[i].storage_offset()))
        self.offsets, offset = [0] * len(self.params), 0
        for i in order:
            self.offsets[i] = offset
            offset += self.params[i].numel()
        self.flat_params = torch.empty(offset, dtype=torch.float32, device=device)
        self.flat_grads: Optional[torch.Tensor] = None
        """The copied gradients (only when they are not read in place)."""
        self.exp_avg = torch.zeros_like(self.flat_params)
        self.exp_avg_sq = torch.zeros_like(self.flat_params)
        self.steps = [torch.zeros((), dtype=torch.float32, device=device)
                      for _ in optimizer.param_groups]
        self.runs = self._runs(order, group_of)
        with torch.no_grad():
            for p, view in zip(self.params, self._views(self.flat_params)):
                view.copy_(p)
                p.data = view
        if self.grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        self._attach_state()

    @property
    def reads_in_place(self) -> bool:
        return self.grads is not None

    def _runs(self, order, group_of) -> List[tuple]:
        """(group, start, end, gradient span) of each stretch of parameters of one group
        that lie back to back in the flat buffer and in their gradient buffer (span None
        when the gradients are copied: flat_grads[start:end])."""
        runs = []
        for i in order:
            start, end = self.offsets[i], self.offsets[i] + self.params[i].numel()
            grad = None if self.grads is None else self.grads[i]
            last = runs[-1] if runs else None
            if (last is not None and last[0] == group_of[i] and last[2] == start
                    and (grad is None or _follows(last[3], grad))):
                first = last[3]
                span = None if grad is None else first.as_strided(
                    (end - last[1],), (1,), first.storage_offset())
                runs[-1] = (last[0], last[1], end, span)
            else:
                runs.append((group_of[i], start, end, None if grad is None else grad.view(-1)))
        return runs

    def grad_spans(self) -> List[torch.Tensor]:
        """The gradients the update reads, one tensor per run."""
        if self.grads is not None:
            return [span for _, _, _, span in self.runs]
        return [self.flat_grads[start:end] for _, start, end, _ in self.runs]

    def _views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

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
        """The gradients the update will read, as views in the order of `params` (any order).
        Read in place: `grads` must be the tensors given at construction (checked by
        identity; a missing one is all zeros in its buffer). Otherwise they are copied into
        the flat gradient buffer in one pass, a missing gradient as zeros (unlike torch's
        AdamW, which leaves such a parameter alone)."""
        by_id = dict(zip(map(id, params), grads))
        if self.grads is not None:
            for p, own in zip(self.params, self.grads):
                if by_id[id(p)] is not None and by_id[id(p)] is not own:
                    raise RuntimeError("FlatAdamW: a gradient is no longer the buffer view it "
                                       "was built with")
            mine = dict(zip(map(id, self.params), self.grads))
            return [mine[id(p)] for p in params]
        order = sorted(range(len(self.params)), key=self.offsets.__getitem__)
        pieces = [by_id[id(self.params[i])] for i in order]
        pieces = [g if g is not None else torch.zeros_like(self.params[i])
                  for g, i in zip(pieces, order)]
        torch.cat([g.reshape(-1) for g in pieces], out=self.flat_grads)
        views = dict(zip(map(id, self.params), self._views(self.flat_grads)))
        return [views[id(p)] for p in params]

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_(self.grad_spans(), factor)

    @torch.no_grad()
    def step(self, clip_coefficient: Optional[float] = None) -> None:
        """One AdamW update of every group from the gradients, multiplied by
        `clip_coefficient` inside the kernel (as its `grad_scale` divisor) when given."""
        grad_scale = clip_grad_scale(clip_coefficient, self.flat_params.device)
        spans = self.grad_spans()
        for index, (step, group) in enumerate(zip(self.steps, self.optimizer.param_groups)):
            runs = [(start, end, g) for (i, start, end, _), g in zip(self.runs, spans)
                    if i == index]
            if not runs:
                continue
            step.add_(1)
            fused_adamw([self.flat_params[a:b] for a, b, _ in runs], [g for _, _, g in runs],
                        [self.exp_avg[a:b] for a, b, _ in runs],
                        [self.exp_avg_sq[a:b] for a, b, _ in runs], [step] * len(runs), group,
                        grad_scale)


def clip_grad_scale(clip_coefficient: Optional[float], device) -> Optional[torch.Tensor]:
    """The clipping factor as the fused kernel's `grad_scale` divisor (None: no clipping)."""
    if clip_coefficient is None:
        return None
    return torch.tensor(1.0 / clip_coefficient, dtype=torch.float32, device=device)


def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, steps, group: dict,
                grad_scale: Optional[torch.Tensor]) -> None:
    """torch's fused AdamW kernel over plain fp32 tensors with the hyper-parameters of one
    param group (`steps` already advanced). Every update of fp32 main parameters goes
    through it, flat (FlatAdamW) or FSDP's shards, so that both give the same bits."""
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"],
                        beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                        eps=group["eps"], amsgrad=False, maximize=False,
                        grad_scale=grad_scale)


def _buffer_views(grads, device) -> bool:
    """Every gradient is a contiguous float32 tensor on `device`, none shared."""
    if any(g is None or not g.is_contiguous() or g.dtype != torch.float32 or g.device != device
           for g in grads):
        return False
    return len({(g.untyped_storage().data_ptr(), g.storage_offset()) for g in grads}) == len(grads)


def _follows(span: torch.Tensor, grad: torch.Tensor) -> bool:
    """`grad` starts where `span` ends, in the same storage."""
    return (grad.untyped_storage().data_ptr() == span.untyped_storage().data_ptr()
            and grad.storage_offset() == span.storage_offset() + span.numel())
