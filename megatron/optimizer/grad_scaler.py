"""Loss scaling for fp16: a static scale, or Megatron's dynamic scaler."""
import torch


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = torch.tensor([float(scale)])

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicGradScaler:
    """Halve the scale after `hysteresis` overflowing steps (never below
    `min_scale`); double it after `growth_interval` clean steps in a row."""

    def __init__(self, initial_scale: float, min_scale: float, growth_interval: int,
                 hysteresis: int, growth_factor: float = 2.0, backoff_factor: float = 0.5):
        self.scale = torch.tensor([float(initial_scale)])
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = torch.clamp(self.scale * self.backoff_factor, min=self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"].cpu()
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(opt_cfg, fp16: bool, bf16: bool = False):
    """None unless fp16 (bf16 and fp32 need no loss scaling), except that --loss-scale
    with --bf16 gives a constant scaler, as in Megatron-DeepSpeed."""
    if bf16 and opt_cfg.loss_scale is not None:
        return ConstantGradScaler(opt_cfg.loss_scale)
    if not fp16:
        return None
    if opt_cfg.loss_scale is not None:
        return ConstantGradScaler(opt_cfg.loss_scale)
    return DynamicGradScaler(opt_cfg.initial_loss_scale, opt_cfg.min_loss_scale,
                             opt_cfg.loss_scale_window, opt_cfg.hysteresis)
