"""Model-parallel RNG tracker and activation checkpointing that restores RNG.

Dropout on activations that are replicated across tensor-parallel ranks uses the
default generator, seeded identically on those ranks; dropout on activations
that are split across them (attention probabilities of a head shard) must differ
per rank and runs inside `tracker.fork()`, whose generator is seeded with
`seed + 2718 + tp_rank`.
"""
import contextlib
from typing import Dict

import torch
from torch.utils.checkpoint import detach_variable

MODEL_PARALLEL_RNG = "model-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_device_rng_state() -> torch.Tensor:
    if _device_type() == "cuda":
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if _device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for the device generator."""

    def __init__(self):
        self.states: Dict[str, torch.Tensor] = {}

    def reset(self):
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = get_device_rng_state()
        if _device_type() == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = get_device_rng_state()
        set_device_rng_state(saved)

    def get_states(self) -> Dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise ValueError(f"RNG state {name!r} is not added; call model_parallel_seed() first")
        saved = get_device_rng_state()
        set_device_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = get_device_rng_state()
            set_device_rng_state(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_seed(seed: int, tp_rank: int) -> None:
    """Seed the default generators with `seed` and the tracker with seed + 2718 + tp_rank."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


class _CheckpointFunction(torch.autograd.Function):
    """Run `fn` without keeping activations; recompute it in backward under the
    same CPU, device and tracker RNG states, so dropout masks are identical."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.fn = fn
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = get_device_rng_state()
        ctx.tracker_states = _TRACKER.get_states()
        with torch.no_grad():
            outputs = fn(*args)
        ctx.save_for_backward(*[a if torch.is_tensor(a) else None for a in args])
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        args = [t if t is not None else a for t, a in zip(saved, ctx.non_tensor_args)]
        inputs = detach_variable(tuple(args))
        now = (torch.get_rng_state(), get_device_rng_state(), _TRACKER.get_states())
        torch.set_rng_state(ctx.cpu_state)
        set_device_rng_state(ctx.device_state)
        _TRACKER.set_states(ctx.tracker_states)
        with torch.enable_grad():
            outputs = ctx.fn(*inputs)
        torch.set_rng_state(now[0])
        set_device_rng_state(now[1])
        _TRACKER.set_states(now[2])
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) + tuple(i.grad if torch.is_tensor(i) else None for i in inputs)


def checkpoint(fn, *args):
    """Activation checkpointing of `fn(*args)` that reproduces dropout exactly."""
    return _CheckpointFunction.apply(fn, *args)
