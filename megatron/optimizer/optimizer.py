"""The optimizer step: fp32 main parameters, loss-scale handling, global-norm clipping.

Model parameters may be fp16/bf16; the optimizer then updates fp32 copies
(`main params`) whose gradients are the fp32 `main_grad` buffers filled by the
data-parallel reducer, and copies the result back into the model. With fp32
models the main params are the model params themselves.
"""
from typing import List, Optional, Tuple

import torch

from megatron.distributed.grads import clip_coefficient, expert_norm_groups, norm_and_nonfinite
from megatron.optimizer.flat_adam import FlatAdamW, fused_adamw_available


def weight_decays(name: str, param: torch.Tensor) -> bool:
    """Whether parameter `name` gets weight decay: Megatron-Core's rule (its default param-group
    overrides), none on biases, whatever their shape (our stacked expert biases are
    [experts, n]), nor on any 1-D parameter (norms)."""
    return not (name.endswith(".bias") or param.ndim == 1)


def decay_flags(models) -> List[bool]:
    """`weight_decays` of every trainable parameter of `models`, in their order."""
    return [weight_decays(n, p) for m in models for n, p in m.named_parameters()
            if p.requires_grad]


def regular_order(decays: List[bool]) -> List[int]:
    """Parameter indices in MegatronOptimizer's order (its torch state ids): those with weight
    decay first, then the others, each in model order."""
    return [i for i, d in enumerate(decays) if d] + [i for i, d in enumerate(decays) if not d]


def _param_groups(named_params, weight_decay: float):
    """The torch param groups of (name, parameter) pairs, weight decay first, then none
    (`weight_decays`), each when not empty; and whether each group decays."""
    decay, no_decay = [], []
    for name, p in named_params:
        (decay if weight_decays(name, p) else no_decay).append(p)
    groups = [({"params": params, "weight_decay": weight_decay if flag else 0.0}, flag)
              for params, flag in ((decay, True), (no_decay, False)) if params]
    return [group for group, _ in groups], [flag for _, flag in groups]


def torch_optimizer(cfg, groups) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, as Megatron's Adam) or SGD over `groups`."""
    if cfg.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum,
                           weight_decay=cfg.weight_decay)


class OptimizerBase:
    """What the regular and the distributed optimizer share: the flags, the
    parallel state, the loss scaler and the wrapped torch optimizer."""

    is_distributed = False

    def __init__(self, cfg, pstate, grad_scaler=None):
        self.cfg = cfg
        self.pstate = pstate
        self.grad_scaler = grad_scaler
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.group_decays: List[bool] = []
        """Whether each of the torch optimizer's param groups has weight decay."""

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> Optional[torch.Tensor]:
        return None if self.grad_scaler is None else self.grad_scaler.scale


class MegatronOptimizer(OptimizerBase):
    """Every DP rank holds the full optimizer state (see DistributedOptimizer for ZeRO-1)."""

    flat_allowed = True
    """Whether the update may run over flat buffers (FlatAdamW), the parameters becoming
    views of them."""

    def __init__(self, cfg, models, pstate, grad_scaler=None):
        super().__init__(cfg, pstate, grad_scaler)
        named = [(n, p) for m in models for n, p in m.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        self.mixed = any(p.dtype != torch.float32 for p in self.model_params)
        if self.mixed:
            self.main_params = [p.detach().clone().float() for p in self.model_params]
        else:
            self.main_params = self.model_params
        groups, self.group_decays = _param_groups(
            [(name, main) for (name, _), main in zip(named, self.main_params)], cfg.weight_decay)
        self.optimizer = torch_optimizer(cfg, groups)
        # Adam over flat buffers where torch's fused kernel runs (fp32 main params on
        # one CPU or GPU): the parameters become views of the flat buffer.
        # The update reads the reducers' gradient buffers in place where it can.
        self.flat = None
        if cfg.optimizer == "adam" and self.flat_allowed and fused_adamw_available(
                self.main_params):
            grad_of = {id(main): getattr(mp, "main_grad", None)
                       for mp, main in zip(self.model_params, self.main_params)}
            self.flat = FlatAdamW(self.optimizer, [
                grad_of[id(p)] for group in self.optimizer.param_groups for p in group["params"]])

    def _main_grads(self) -> List[torch.Tensor]:
        """fp32 gradients of the main params: the reducer's `main_grad` views (or `.grad`),
        those the flat update reads (the same views, or copies in its buffer) when it is
        flat, else set as `.grad`."""
        grads = []
        for model_param in self.model_params:
            grad = getattr(model_param, "main_grad", None)
            if grad is None:
                grad = model_param.grad
            if grad is not None and grad.dtype != torch.float32:
                grad = grad.float()
            grads.append(grad)
        if self.flat is not None:
            return self.flat.gather_grads(self.main_params, grads)
        for main_param, grad in zip(self.main_params, grads):
            main_param.grad = grad
        return grads

    def _scale_grads(self, grads, factor: float) -> None:
        if self.flat is not None:
            self.flat.scale_grads(factor)
            return
        for g in grads:
            if g is not None:
                g.mul_(factor)

    def _norm_and_nonfinite(self, grads) -> Tuple[float, bool]:
        """The global gradient norm and whether any gradient is non-finite."""
        return norm_and_nonfinite(self.model_params, grads, self.pstate.tp_group,
                                  self.pstate.mp_group, **expert_norm_groups(self.pstate))

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], bool]:
        """One update. Returns (applied, grad_norm, skipped_for_overflow)."""
        grads = self._main_grads()
        try:
            if self.grad_scaler is not None:
                self._scale_grads(grads, 1.0 / self.grad_scaler.scale.item())
            norm, found_inf = self._norm_and_nonfinite(grads)
            if self.grad_scaler is not None:
                self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, True
            self._update(grads, clip_coefficient(norm, self.cfg.clip_grad))
        finally:
            self._release_grads()
        if self.mixed:
            torch._foreach_copy_(self.model_params, self.main_params)
        return True, norm, False

    def _update(self, grads, coeff: Optional[float]) -> None:
        """The optimizer's step from `grads`, clipped by `coeff` (None: no clipping)."""
        if self.flat is not None:  # the clipping factor goes into the update's one pass
            self.flat.step(clip_coefficient=coeff)
            return
        if coeff is not None:
            self._scale_grads(grads, coeff)
        self.optimizer.step()

    def _release_grads(self) -> None:
        """The grads are views of the reducer's buffer: never let the next backward
        accumulate into them through `.grad`."""
        for main_param in self.main_params:
            main_param.grad = None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model (after loading its weights)."""
        if self.mixed:
            for model_param, main_param in zip(self.model_params, self.main_params):
                main_param.copy_(model_param)

    def state_dict(self) -> dict:
        state = {"optimizer": (self.flat or self.optimizer).state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        if self.mixed:
            state["fp32_from_fp16_params"] = [p.detach().clone() for p in self.main_params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.flat is not None:
            self.flat.adopt_state()
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if self.mixed and "fp32_from_fp16_params" in state:
            for main, saved in zip(self.main_params, state["fp32_from_fp16_params"]):
                main.copy_(saved)
